#!/usr/bin/env python3
"""The quality gate of a quantized pack: its LM and its codec against the float pack's, on the
same inputs.

    tools/quality_gate.py QUANTIZED FLOAT [--frames 60] [--codes CODES.json]
                          [--min-text-agreement 0.9] [--max-text-kl 0.05]
                          [--min-audio-agreement 0.85] [--min-first-divergence 5]
                          [--codec-frames 125] [--min-decoder-snr 30]
                          [--min-code-agreement 0.7] [--min-first-code-agreement 0.9] [--json]

What is gated follows the quantized pack's `pack.yaml`: the LM when its temporal transformer is
quantized, the codec when its Mimi step graphs are (both when both are; everything when nothing
is, as when a pack is gated against itself).

**The LM.** Both packs are stepped by the independent reference loop (`tools/reference_lm.py`: numpy and
ONNX Runtime, greedy) on the same user codes (CODES, or a fixed pseudo-random stream):

- **teacher-forced**: both are fed the float pack's own tokens every step, so that an error
  does not compound, and every step compares the text logits (top-1 agreement, and the mean
  KL divergence of the quantized distribution from the float one, in nats) and, codebook by
  codebook, the depformer's top-1 audio tokens (each codebook given the float pack's previous
  ones);
- **free-running**: each runs greedy on its own, and the first agent frame whose text or audio
  tokens differ is reported (the whole run when none does).

**The codec.** Both packs' stateful step graphs (`mimi_encoder_step`, `mimi_decoder_step`, run
here with ONNX Runtime from their `state.json`, no duplex code) take the same 10 s of a
deterministic speech-like signal (gliding harmonics under a syllable-rate envelope, with
noise bursts), frame by frame: the encoders' codes are compared codebook by codebook (the first
codebook, the semantic one, on its own), and the float encoder's codes are decoded by both
decoders, whose PCM gives the decoder's signal-to-noise ratio (float PCM over the difference,
in dB).

It prints the figures and a verdict against the thresholds; exit 1 when a threshold is not
met (2 for bad arguments). The defaults are justified in docs/real-model.md by the figures
measured on the tiny packs and the full-size codec.
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_lm as R  # noqa: E402
from toolio import need_file, read_json, read_yaml, refuse  # noqa: E402


def pseudo_codes(frames: int) -> list:
    x = 12345
    out = []
    for _ in range(frames):
        row = []
        for _ in range(8):
            x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
            row.append((x >> 33) % 2048)
        out.append(row)
    return out


def softmax(z):
    z = z - np.max(z)
    e = np.exp(z)
    return e / e.sum()


class Stepper(R.Reference):
    """The reference loop, with each step's text logits and per-codebook audio logits kept."""

    def depformer_step(self, hidden, text, target, given):
        past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), self.np_type(i)) for i in self.d_kv}
        names = [o.name for o in self.depformer.get_outputs()]
        prev, out, self.audio_logits = text, [], []
        for cb in range(16):
            feeds = {
                "hidden": hidden,
                "prev_token": np.array([[prev]], np.int64),
                "substep_index": np.array(cb, np.int64),
            }
            feeds.update(past)
            outs = dict(zip(names, self.depformer.run(names, feeds)))
            for name in past:
                past[name] = outs[name.replace("past_key_values", "present")]
            logits = outs["logits"][0, 0].astype(np.float32)
            self.audio_logits.append(logits)
            tok = int(np.argmax(logits))
            out.append(tok)
            prev = int(target[cb]) if given[cb] else tok
        return out

    def temporal_step(self, column):
        hidden, logits = super().temporal_step(column)
        self.text_logits = logits
        return hidden, logits


def prime(r):
    for _ in range(6):
        r.step(R.SINE, R.TEXT_PAD, R.SILENCE)


def free_running(pack, codes):
    r = R.Reference(pack)
    prime(r)
    return [s for s in (r.step(u) for u in codes) if s is not None]


def teacher_forced(quantized, floating, codes):
    """Steps both on the float pack's own tokens; per step: text top-1 agreement, KL, and
    per-codebook audio top-1 agreement."""
    q, f = Stepper(quantized), Stepper(floating)
    prime(q)
    prime(f)
    text_same, kls, audio_same = [], [], np.zeros(16)
    for user in codes:
        o = f.offset
        f.text_logits = f.audio_logits = None
        q.text_logits = q.audio_logits = None
        f.step(user)
        # What the float pack chose at this step is given to the quantized one as its own:
        # its logits are computed on the same inputs, and its depformer gets the float
        # pack's earlier codebooks.
        tgt = o % f.ct
        q.ring[:, tgt] = f.ring[:, tgt]
        q.given[:, tgt] = True
        q.step(user)
        if f.text_logits is None or q.text_logits is None:
            continue
        pf, pq = softmax(f.text_logits), softmax(q.text_logits)
        text_same.append(int(np.argmax(pf) == np.argmax(pq)))
        kls.append(float(np.sum(pf * (np.log(pf + 1e-30) - np.log(pq + 1e-30)))))
        for cb in range(16):
            audio_same[cb] += int(np.argmax(f.audio_logits[cb]) == np.argmax(q.audio_logits[cb]))
    n = max(len(text_same), 1)
    return {
        "text_agreement": float(np.mean(text_same)) if text_same else 0.0,
        "text_kl": float(np.mean(kls)) if kls else float("inf"),
        "audio_agreement": [float(x / n) for x in audio_same],
        "steps": len(text_same),
    }


FRAME = 1920


def speech_like(frames: int) -> np.ndarray:
    """`frames` x 80 ms at 24 kHz: harmonics of a gliding pitch under a syllable envelope,
    with a noise burst every half second (deterministic)."""
    n = frames * FRAME
    t = np.arange(n) / 24000.0
    pitch = 140.0 + 40.0 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / 24000.0
    voiced = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 * (1 - np.cos(2 * np.pi * 4.0 * t)) * (0.6 + 0.4 * np.sin(2 * np.pi * 0.3 * t))
    rng = np.random.default_rng(7)
    bursts = rng.standard_normal(n) * (np.mod(t, 0.5) < 0.06)
    return (0.25 * voiced * envelope + 0.05 * bursts).astype(np.float32)


class StepGraph:
    """One Mimi step graph of a pack, with its state carried from call to call."""

    def __init__(self, pack: str, folder: str):
        import onnxruntime as ort

        path = os.path.join(pack, folder)
        manifest = os.path.join(path, "state.json")
        self.manifest = read_json(manifest, "quality_gate")
        states = self.manifest.get("states")
        if not isinstance(states, list) or not all(
                isinstance(s, dict) and {"input", "output", "shape", "dtype"} <= set(s)
                for s in states) or not {"input", "output"} <= set(self.manifest):
            refuse("quality_gate", manifest,
                   "not a step graph's state manifest (tools/make_mimi_step.py writes it)")
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.log_severity_level = 3
        self.session = ort.InferenceSession(
            need_file(os.path.join(path, "model.onnx"), "quality_gate", "a step graph"), so)
        self.names = [o.name for o in self.session.get_outputs()]
        types = {"f32": np.float32, "f16": np.float16, "i64": np.int64}
        self.feeds = {
            s["input"]: np.zeros([1] + s["shape"], types[s["dtype"]])
            for s in self.manifest["states"]
        }
        if self.manifest.get("active"):
            self.feeds[self.manifest["active"]] = np.ones(1, bool)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.feeds[self.manifest["input"]] = x
        out = dict(zip(self.names, self.session.run(self.names, self.feeds)))
        for s in self.manifest["states"]:
            self.feeds[s["input"]] = out[s["output"]]
        return out[self.manifest["output"]]


def codec(quantized: str, floating: str, frames: int) -> dict:
    """Encoder code agreement and decoder SNR of the quantized step graphs against the float."""
    pcm = speech_like(frames).reshape(frames, 1, 1, FRAME)
    enc_q = StepGraph(quantized, "mimi_encoder_step")
    enc_f = StepGraph(floating, "mimi_encoder_step")
    codes_q = np.concatenate([enc_q(x) for x in pcm], axis=-1)[0]  # (codebooks, frames)
    codes_f = np.concatenate([enc_f(x) for x in pcm], axis=-1)[0]
    per_codebook = [float(x) for x in (codes_q == codes_f).mean(axis=1)]
    dec_q = StepGraph(quantized, "mimi_decoder_step")
    dec_f = StepGraph(floating, "mimi_decoder_step")
    out_q, out_f = [], []
    for i in range(frames):
        c = codes_f[:, i].reshape(1, -1, 1)
        out_q.append(dec_q(c).astype(np.float64).ravel())
        out_f.append(dec_f(c).astype(np.float64).ravel())
    a, b = np.concatenate(out_f), np.concatenate(out_q)
    snr = 10 * np.log10(np.sum(a * a) / max(np.sum((a - b) ** 2), 1e-30))
    return {
        "code_agreement": float(np.mean(per_codebook)),
        "first_code_agreement": per_codebook[0],
        "code_agreement_per_codebook": per_codebook,
        "decoder_snr_db": float(snr),
        "codec_frames": frames,
    }


def quantized_graphs(pack: str, manifest: dict) -> set:
    """The graphs the pack's `pack.yaml` (read: `manifest`) says are quantized."""
    path = os.path.join(pack, "pack.yaml")
    section = manifest.get("quantization") or {}
    if not isinstance(section, dict):
        refuse("quality_gate", path, "quantization: expected a mapping of graphs")
    return set(section)


def read_codes(path: str, manifest: dict) -> list:
    """The user's codes of `--codes`: frames of `codebooks` codes each, within the vocabulary of
    the pack whose `pack.yaml` is `manifest`."""
    n, vocab = manifest.get("codebooks", 8), manifest.get("audio_vocab", 2048)
    codes = read_json(path, "quality_gate", list)
    for i, frame in enumerate(codes):
        if not (isinstance(frame, list) and len(frame) == n and all(
                isinstance(c, int) and not isinstance(c, bool) and 0 <= c < vocab for c in frame)):
            refuse("quality_gate", path, f"frame {i}: expected {n} codes from 0 to {vocab - 1}, "
                                         f"found {json.dumps(frame)[:60]}")
    if not codes:
        refuse("quality_gate", path, "no frames")
    return codes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("quantized")
    p.add_argument("float")
    p.add_argument("--frames", type=int, default=60, help="LM frames (default 60)")
    p.add_argument("--codes", help="user codes, JSON [[8 ints], ...] (default: pseudo-random)")
    p.add_argument("--min-text-agreement", type=float, default=0.9)
    p.add_argument("--max-text-kl", type=float, default=0.05)
    p.add_argument("--min-audio-agreement", type=float, default=0.85)
    p.add_argument("--min-first-divergence", type=int, default=5)
    p.add_argument("--codec-frames", type=int, default=125, help="codec frames (default 125: 10 s)")
    p.add_argument("--min-decoder-snr", type=float, default=30.0, help="dB (default 30)")
    p.add_argument("--min-code-agreement", type=float, default=0.7,
                   help="the encoder's codes, mean over codebooks (default 0.7)")
    p.add_argument("--min-first-code-agreement", type=float, default=0.9,
                   help="the encoder's first (semantic) codebook (default 0.9)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    a = p.parse_args(argv)
    manifests = {}
    for pack in (a.quantized, a.float):
        if not os.path.isfile(os.path.join(pack, "pack.yaml")):
            print(f"quality_gate: {pack}: not a pack (no pack.yaml)", file=sys.stderr)
            return 2
        manifests[pack] = read_yaml(os.path.join(pack, "pack.yaml"), "quality_gate")
    if a.frames < 10 or a.codec_frames < 10:
        print("quality_gate: --frames and --codec-frames: 10 or more", file=sys.stderr)
        return 2
    graphs = quantized_graphs(a.quantized, manifests[a.quantized])
    lm = bool(graphs & {"temporal", "depformer"})
    has_codec = bool(graphs & {"mimi_encoder_step", "mimi_decoder_step"})
    if not graphs:
        # Nothing quantized (a pack against itself, or two float packs): everything there is.
        lm = True
        has_codec = all(
            os.path.isfile(os.path.join(pack, g, "state.json"))
            for pack in (a.quantized, a.float)
            for g in ("mimi_encoder_step", "mimi_decoder_step")
        )
    report = {"quantized": a.quantized, "float": a.float}
    checks = {}
    if lm:
        for pack in (a.quantized, a.float):
            for g in ("temporal", "depformer"):
                need_file(os.path.join(pack, g, "model.onnx"), "quality_gate", f"the pack's {g} graph")
        codes = read_codes(a.codes, manifests[a.float]) if a.codes else pseudo_codes(a.frames)
        codes = codes[: a.frames]
        tf = teacher_forced(a.quantized, a.float, codes)
        fq, ff = free_running(a.quantized, codes), free_running(a.float, codes)
        first = next((i for i, (x, y) in enumerate(zip(fq, ff)) if x != y), min(len(fq), len(ff)))
        audio_mean = float(np.mean(tf["audio_agreement"]))
        checks.update({
            "text_agreement": tf["text_agreement"] >= a.min_text_agreement,
            "text_kl": tf["text_kl"] <= a.max_text_kl,
            "audio_agreement": audio_mean >= a.min_audio_agreement,
            "first_divergence": first >= min(a.min_first_divergence, len(ff)),
        })
        report.update({
            "steps": tf["steps"],
            "text_agreement": tf["text_agreement"],
            "text_kl": tf["text_kl"],
            "audio_agreement": audio_mean,
            "audio_agreement_per_codebook": tf["audio_agreement"],
            "first_divergence": first,
            "frames": len(ff),
        })
    if has_codec:
        c = codec(a.quantized, a.float, a.codec_frames)
        checks.update({
            "decoder_snr": c["decoder_snr_db"] >= a.min_decoder_snr,
            "code_agreement": c["code_agreement"] >= a.min_code_agreement,
            "first_code_agreement": c["first_code_agreement"] >= a.min_first_code_agreement,
        })
        report.update(c)
    report["passed"] = all(checks.values())
    report["failed"] = [k for k, ok in checks.items() if not ok]
    if a.json:
        print(json.dumps(report))
    else:
        print(f"quantized {a.quantized} against float {a.float}")
        if lm:
            print(f"  LM, {report['steps']} steps teacher-forced:")
            print(f"  text top-1 agreement   {report['text_agreement']:.3f}   (at least {a.min_text_agreement})")
            print(f"  text KL, nats per step {report['text_kl']:.4f}  (at most {a.max_text_kl})")
            print(f"  audio top-1 agreement  {report['audio_agreement']:.3f}   (at least {a.min_audio_agreement}; per codebook "
                  + " ".join(f"{x:.2f}" for x in report["audio_agreement_per_codebook"]) + ")")
            print(f"  free-running: the first differing frame is {report['first_divergence']} of {report['frames']} "
                  f"(at least {min(a.min_first_divergence, report['frames'])})")
        if has_codec:
            print(f"  codec, {a.codec_frames} frames of a speech-like signal:")
            print(f"  decoder SNR            {report['decoder_snr_db']:.1f} dB (at least {a.min_decoder_snr})")
            print(f"  encoder code agreement {report['code_agreement']:.3f}   (at least {a.min_code_agreement}; per codebook "
                  + " ".join(f"{x:.2f}" for x in report["code_agreement_per_codebook"]) + ")")
            print(f"  first codebook         {report['first_code_agreement']:.3f}   (at least {a.min_first_code_agreement})")
        print("passed" if report["passed"] else "FAILED: " + ", ".join(report["failed"]))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
