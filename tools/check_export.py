#!/usr/bin/env python3
"""Checks an exported pack's LM graphs against the checkpoint they came from.

An independent numpy implementation of Kyutai's LM, written from its modules' definitions
(`moshi/models/lm.py`, `modules/transformer.py`, `gating.py`, `rope.py`) and reading the
checkpoint's tensors under their own names and layouts, runs the same random frames as the
pack's temporal and depformer graphs (onnxruntime, host-fed caches). Where the export mapped a
weight wrongly (a fused QKV split, the RoPE row order, a per-substep slice, a norm), the
outputs differ. Prints the largest differences and exits 1 past the tolerance.

    python tools/check_export.py CHECKPOINT_DIR PACK_DIR [--steps 6] [--tol 1e-4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import ml_dtypes  # noqa: F401  (lets numpy read the checkpoints' bfloat16)
import numpy as np
import onnxruntime as ort
from safetensors.numpy import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toolio import need_file, need_folder, read_json, refuse  # noqa: E402


def rms(x, alpha, eps=1e-8):
    return x * alpha.reshape(-1) / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rope_interleaved(x, pos, max_period):
    """Kyutai's apply_rope with interleave=True: pairs (2i, 2i+1) rotated by pos * freq_i."""
    d = x.shape[-1]
    freqs = np.exp(np.arange(d // 2) * (-np.log(max_period) * 2 / d))
    c, s = np.cos(freqs * pos), np.sin(freqs * pos)
    xr, xi = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = xr * c - xi * s
    out[..., 1::2] = xr * s + xi * c
    return out


def attend(q, ks, vs):
    """q [H, D], ks / vs [T, H, D]: softmax(q k / sqrt(D)) v over all T (causal by construction)."""
    scores = np.einsum("hd,thd->ht", q, ks) / np.sqrt(q.shape[-1])
    scores -= scores.max(axis=-1, keepdims=True)
    w = np.exp(scores)
    w /= w.sum(axis=-1, keepdims=True)
    return np.einsum("ht,thd->hd", w, vs)


def gating(x, w_in, w_out):
    h = w_in @ x
    gate, up = np.split(h, 2)
    return w_out @ ((gate / (1 + np.exp(-gate))) * up)


class KyutaiLM:
    def __init__(self, sd, cfg):
        self.sd = {k: v.astype(np.float64) for k, v in sd.items()}
        self.cfg = cfg
        self.layers = sum(1 for k in sd if k.startswith("transformer.layers.") and k.endswith(".norm1.alpha"))
        self.dep_layers = sum(1 for k in sd if k.startswith("depformer.layers.") and k.endswith(".norm1.alpha"))
        self.dep_q = sum(1 for k in sd if k.startswith("depformer_in."))
        self.cache = [([], []) for _ in range(self.layers)]
        self.pos = 0

    def temporal(self, frame):
        sd, cfg = self.sd, self.cfg
        heads, dim = cfg["num_heads"], sd["text_emb.weight"].shape[1]
        x = sd["text_emb.weight"][frame[0]].copy()
        for cb, tok in enumerate(frame[1:]):
            x += sd[f"emb.{cb}.weight"][tok]
        for i in range(self.layers):
            p = f"transformer.layers.{i}"
            h = rms(x, sd[f"{p}.norm1.alpha"])
            q, k, v = np.split(sd[f"{p}.self_attn.in_proj_weight"] @ h, 3)
            q, k, v = (t.reshape(heads, dim // heads) for t in (q, k, v))
            q = rope_interleaved(q, self.pos, cfg["max_period"])
            k = rope_interleaved(k, self.pos, cfg["max_period"])
            ks, vs = self.cache[i]
            ks.append(k)
            vs.append(v)
            ctx = cfg["context"]
            a = attend(q, np.stack(ks[-ctx:]), np.stack(vs[-ctx:])).reshape(-1)
            x = x + sd[f"{p}.self_attn.out_proj.weight"] @ a
            h = rms(x, sd[f"{p}.norm2.alpha"])
            x = x + gating(h, sd[f"{p}.gating.linear_in.weight"], sd[f"{p}.gating.linear_out.weight"])
        self.pos += 1
        out = rms(x, sd["out_norm.alpha"])
        return out, sd["text_linear.weight"] @ out

    def depformer(self, hidden, text, tokens):
        """Logits of every substep, each fed the previous substep's token from `tokens`."""
        sd, cfg = self.sd, self.cfg
        heads, q_n = cfg["depformer_num_heads"], self.dep_q
        cache = [([], []) for _ in range(self.dep_layers)]
        logits = []
        for k in range(q_n):
            prev = sd["depformer_text_emb.weight"][text] if k == 0 else sd[f"depformer_emb.{k - 1}.weight"][tokens[k - 1]]
            x = sd[f"depformer_in.{k}.weight"] @ hidden + prev
            d = x.shape[0]
            for i in range(self.dep_layers):
                p = f"depformer.layers.{i}"
                h = rms(x, sd[f"{p}.norm1.alpha"])
                w_in = sd[f"{p}.self_attn.in_proj_weight"].reshape(q_n, 3 * d, d)[k]
                q, kk, v = (t.reshape(heads, d // heads) for t in np.split(w_in @ h, 3))
                ks, vs = cache[i]
                ks.append(kk)
                vs.append(v)
                a = attend(q, np.stack(ks), np.stack(vs)).reshape(-1)
                x = x + sd[f"{p}.self_attn.out_proj.weight"].reshape(q_n, d, d)[k] @ a
                h = rms(x, sd[f"{p}.norm2.alpha"])
                x = x + gating(h, sd[f"{p}.gating.{k}.linear_in.weight"], sd[f"{p}.gating.{k}.linear_out.weight"])
            logits.append(sd[f"linears.{k}.weight"] @ x)
        return logits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("pack")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--tol", type=float, default=1e-4, help="largest difference allowed, relative to the largest |logit|")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    need_folder(a.checkpoint, "check_export", "a checkpoint")
    need_folder(a.pack, "check_export", "a pack")
    cfg = read_json(os.path.join(a.checkpoint, "config.json"), "check_export")
    weights = need_file(os.path.join(a.checkpoint, str(cfg.get("moshi_name", "model.safetensors"))),
                        "check_export", "the LM's weights")
    try:
        lm = KyutaiLM(load_file(weights), cfg)
    except (KeyError, ValueError, OSError) as e:
        refuse("check_export", weights, f"not this checkpoint's weights: {e!r}"[:300])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    graphs = {g: need_file(os.path.join(a.pack, g, "model.onnx"), "check_export", f"the {g} graph")
              for g in ("temporal", "depformer")}
    temporal = ort.InferenceSession(graphs["temporal"], so)
    depformer = ort.InferenceSession(graphs["depformer"], so)
    t_kv = [i for i in temporal.get_inputs() if i.name.startswith("past_key_values")]
    d_kv = [i for i in depformer.get_inputs() if i.name.startswith("past_key_values")]
    ftype = lambda i: np.float16 if "float16" in i.type else np.float32
    past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), ftype(i)) for i in t_kv}
    t_names = [o.name for o in temporal.get_outputs()]
    d_names = [o.name for o in depformer.get_outputs()]
    has_pos = any(i.name == "position_ids" for i in temporal.get_inputs())
    hidden_type = ftype(next(i for i in depformer.get_inputs() if i.name == "hidden"))

    rng = np.random.default_rng(a.seed)
    worst = {"hidden": 0.0, "text_logits": 0.0, "depformer_logits": 0.0}
    agree = total = 0
    for step in range(a.steps):
        frame = np.concatenate([rng.integers(0, cfg["text_card"], 1), rng.integers(0, cfg["card"], 16)])
        ref_hidden, ref_logits = lm.temporal(frame)
        n = past[t_kv[0].name].shape[2]
        feeds = {"input_frame": frame.reshape(1, 17, 1).astype(np.int64), "attention_mask": np.ones((1, n + 1), np.int64)}
        if has_pos:
            feeds["position_ids"] = np.array([[step]], np.int64)
        feeds.update(past)
        outs = dict(zip(t_names, temporal.run(t_names, feeds)))
        for name in past:
            past[name] = outs[name.replace("past_key_values", "present")]
        hidden = outs["hidden"].astype(np.float64).reshape(-1)
        logits = outs["text_logits"][0, -1].astype(np.float64)
        worst["hidden"] = max(worst["hidden"], np.abs(hidden - ref_hidden).max() / np.abs(ref_hidden).max())
        worst["text_logits"] = max(worst["text_logits"], np.abs(logits - ref_logits).max() / np.abs(ref_logits).max())

        # The depformer on the reference's hidden state, teacher-forced with random tokens.
        text = int(rng.integers(0, cfg["text_card"]))
        tokens = rng.integers(0, cfg["card"], 16)
        ref = lm.depformer(ref_hidden, text, tokens)
        dpast = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), ftype(i)) for i in d_kv}
        for k in range(len(ref)):
            prev = text if k == 0 else int(tokens[k - 1])
            feeds = {
                "hidden": ref_hidden.reshape(1, 1, -1).astype(hidden_type),
                "prev_token": np.array([[prev]], np.int64),
                "substep_index": np.array(k, np.int64),
            }
            feeds.update(dpast)
            douts = dict(zip(d_names, depformer.run(d_names, feeds)))
            for name in dpast:
                dpast[name] = douts[name.replace("past_key_values", "present")]
            got = douts["logits"][0, 0].astype(np.float64)
            worst["depformer_logits"] = max(worst["depformer_logits"], np.abs(got - ref[k]).max() / np.abs(ref[k]).max())
            agree += int(np.argmax(got) == np.argmax(ref[k]))
            total += 1
    line = ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
    print(f"check_export: {a.steps} steps, largest relative differences: {line}; depformer argmax agrees {agree}/{total}")
    if max(worst.values()) > a.tol:
        print(f"check_export: beyond the tolerance {a.tol:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
