#!/usr/bin/env python3
"""The quality gate of a quantized pack: its LM against the float pack's, on the same inputs.

    tools/quality_gate.py QUANTIZED FLOAT [--frames 60] [--codes CODES.json]
                          [--min-text-agreement 0.9] [--max-text-kl 0.05]
                          [--min-audio-agreement 0.85] [--min-first-divergence 8] [--json]

Both packs are stepped by the independent reference loop (`tools/reference_lm.py`: numpy and
ONNX Runtime, greedy) on the same user codes (CODES, or a fixed pseudo-random stream):

- **teacher-forced**: both are fed the float pack's own tokens every step, so that an error
  does not compound, and every step compares the text logits (top-1 agreement, and the mean
  KL divergence of the quantized distribution from the float one, in nats) and, codebook by
  codebook, the depformer's top-1 audio tokens (each codebook given the float pack's previous
  ones);
- **free-running**: each runs greedy on its own, and the first agent frame whose text or audio
  tokens differ is reported (the whole run when none does).

It prints the figures and a verdict against the thresholds; exit 1 when a threshold is not
met (2 for bad arguments). The defaults are justified in docs/real-model.md by the figures
measured on the tiny packs.
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_lm as R  # noqa: E402


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("quantized")
    p.add_argument("float")
    p.add_argument("--frames", type=int, default=60)
    p.add_argument("--codes", help="user codes, JSON [[8 ints], ...] (default: pseudo-random)")
    p.add_argument("--min-text-agreement", type=float, default=0.9)
    p.add_argument("--max-text-kl", type=float, default=0.05)
    p.add_argument("--min-audio-agreement", type=float, default=0.85)
    p.add_argument("--min-first-divergence", type=int, default=8)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    a = p.parse_args(argv)
    for pack in (a.quantized, a.float):
        if not os.path.isfile(os.path.join(pack, "pack.yaml")):
            print(f"quality_gate: {pack}: not a pack (no pack.yaml)", file=sys.stderr)
            return 2
    if a.frames < 10:
        print(f"quality_gate: --frames {a.frames}: 10 or more", file=sys.stderr)
        return 2
    codes = json.load(open(a.codes)) if a.codes else pseudo_codes(a.frames)
    codes = codes[: a.frames]

    tf = teacher_forced(a.quantized, a.float, codes)
    fq, ff = free_running(a.quantized, codes), free_running(a.float, codes)
    first = next((i for i, (x, y) in enumerate(zip(fq, ff)) if x != y), min(len(fq), len(ff)))
    audio_mean = float(np.mean(tf["audio_agreement"]))
    checks = {
        "text_agreement": tf["text_agreement"] >= a.min_text_agreement,
        "text_kl": tf["text_kl"] <= a.max_text_kl,
        "audio_agreement": audio_mean >= a.min_audio_agreement,
        "first_divergence": first >= min(a.min_first_divergence, len(ff)),
    }
    report = {
        "quantized": a.quantized,
        "float": a.float,
        "steps": tf["steps"],
        "text_agreement": tf["text_agreement"],
        "text_kl": tf["text_kl"],
        "audio_agreement": audio_mean,
        "audio_agreement_per_codebook": tf["audio_agreement"],
        "first_divergence": first,
        "frames": len(ff),
        "passed": all(checks.values()),
        "failed": [k for k, ok in checks.items() if not ok],
    }
    if a.json:
        print(json.dumps(report))
    else:
        print(f"quantized {a.quantized} against float {a.float}, {tf['steps']} steps teacher-forced")
        print(f"  text top-1 agreement   {tf['text_agreement']:.3f}   (at least {a.min_text_agreement})")
        print(f"  text KL, nats per step {tf['text_kl']:.4f}  (at most {a.max_text_kl})")
        print(f"  audio top-1 agreement  {audio_mean:.3f}   (at least {a.min_audio_agreement}; per codebook "
              + " ".join(f"{x:.2f}" for x in tf["audio_agreement"]) + ")")
        print(f"  free-running: the first differing frame is {first} of {len(ff)} "
              f"(at least {min(a.min_first_divergence, len(ff))})")
        print("passed" if report["passed"] else "FAILED: " + ", ".join(report["failed"]))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
