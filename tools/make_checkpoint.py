#!/usr/bin/env python3
"""Writes a checkpoint folder in Kyutai's format, with random weights, for export tests.

A real PersonaPlex or Moshi download holds the LM's `model.safetensors`, the Mimi codec's
`tokenizer-e351c8d8-checkpoint125.safetensors` and the SentencePiece `tokenizer_spm_32k_3.model`
(newer repositories add a `config.json` with the LM's hyper-parameters). This script writes the
same files at a tiny size, so that `tools/export_pack.py` runs its real loading code in the tests:

- the LM under Kyutai's own parameter names and layouts: `text_emb`, `emb.{i}`, the fused
  `self_attn.in_proj_weight` with interleaved-pair RoPE rows, RMSNorm `alpha` of shape
  `(1, 1, dim)`, the SwiGLU `gating.linear_in` (gate and up stacked), `out_norm`,
  `text_linear`, and the depformer's per-substep weights stacked as Kyutai's
  `weights_per_step` stores them (`(steps * 3 * dim, dim)` for the fused QKV, one
  `gating.{step}` per substep, `depformer_in.{step}`, `depformer_emb.{step}`, `linears.{step}`);
- Mimi with its 32 codebooks stored as `_codebook.embedding_sum` / `cluster_usage` /
  `_initialized` running statistics (the export keeps the first 8), the transformers' fused QKV
  and LayerScale, and the SEANet convolutions under their module paths;
- `config.json` with Kyutai's keys (`dim`, `num_heads`, `depformer_num_heads`, `dep_q`,
  `delays`, `moshi_name`, `mimi_name`, `tokenizer_name`, ...).

Weights are stored in bfloat16, as the published checkpoints are. Every tensor is drawn from a
generator seeded by its name, so a rewrite is byte-identical.

`--size 7b` writes PersonaPlex-7B's tensor names, shapes and dtypes (15.6 GB for the LM, 0.3 GB
for Mimi) and its `config.json`; `--layers N` keeps N temporal layers (and at most N depformer
layers) at the real widths; `--size moshi-7b` is Moshi-7B's layout (the same, but a depformer
of 8 steps: it predicts only the model's own codebooks). The files are written tensor by tensor as they are drawn (the
safetensors header first, from the shapes alone), so the writer holds one tensor at a time,
never the checkpoint; each file is written under a `.partial` name and renamed once whole, so an
interrupted run leaves nothing that looks like a checkpoint.

    python tools/make_checkpoint.py OUT_DIR [--tokenizer models/tokenizer-tiny.model]
    python tools/make_checkpoint.py OUT_DIR --size 7b|moshi-7b [--layers 1]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import sys
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toolio import need_file, refuse, stop, writable  # noqa: E402

# --- The LM: Kyutai's `_lm_kwargs`, at a tiny size ---------------------------------------------
LM_CONFIG = {
    "dim": 64,
    "text_card": 32000,
    "existing_text_padding_id": 3,
    "n_q": 16,
    "dep_q": 16,
    "card": 2048,
    "num_heads": 4,
    "num_layers": 2,
    "hidden_scale": 4.125,
    "causal": True,
    "layer_scale": None,
    "context": 3000,
    "max_period": 10000,
    "gating": "silu",
    "norm": "rms_norm_f32",
    "positional_embedding": "rope",
    "depformer_dim": 32,
    "depformer_dim_feedforward": int(4.125 * 32),
    "depformer_num_heads": 2,
    "depformer_num_layers": 2,
    "depformer_layer_scale": None,
    "depformer_multi_linear": True,
    "depformer_context": 16,
    "depformer_max_period": 10000,
    "depformer_gating": "silu",
    "depformer_pos_emb": "none",
    "depformer_weights_per_step": True,
    "delays": [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1],
}
LM_NAME = "model.safetensors"
MIMI_NAME = "tokenizer-e351c8d8-checkpoint125.safetensors"
TOKENIZER_NAME = "tokenizer_spm_32k_3.model"

# --- Mimi at a tiny size: the real layout (SEANet ratios 8*6*5*4, 32 codebooks of 2048, a
# stride-2 resampling, 8-head transformers), narrower ---------------------------------------
MIMI = {
    "n_filters": 4,
    "dimension": 32,  # SEANet output = transformer width = quantizer input
    "tr_layers": 2,
    "tr_heads": 8,
    "tr_ffn": 128,
    "vq_dim": 16,
    "n_q": 32,
    "bins": 2048,
    "ratios": [8, 6, 5, 4],
    "kernel": 7,
    "residual_kernel": 3,
    "last_kernel": 3,
    "compress": 2,
}

# PersonaPlex-7B (nvidia/personaplex-7b-v1): Kyutai's 7B temporal transformer and a depformer
# predicting all 16 codebooks (the agent's and the user's).
LM_7B = dict(
    LM_CONFIG,
    dim=4096,
    num_heads=32,
    num_layers=32,
    depformer_dim=1024,
    depformer_dim_feedforward=int(4.125 * 1024),
    depformer_num_heads=16,
    depformer_num_layers=6,
)
# Mimi as published: SEANet of 64 filters to 512 channels, 8-layer transformers of width 512
# (8 heads, feed-forward 2048), 256-wide codebooks.
MIMI_FULL = dict(
    MIMI, n_filters=64, dimension=512, tr_layers=8, tr_heads=8, tr_ffn=2048, vq_dim=256
)
# Moshi-7B (kyutai/moshiko, moshika): the same temporal transformer; its depformer predicts
# only the model's own 8 codebooks (`dep_q` 8), so its per-step weights are half as many.
LM_MOSHI_7B = dict(LM_7B, dep_q=8)
SIZES = {"tiny": (LM_CONFIG, MIMI), "7b": (LM_7B, MIMI_FULL), "moshi-7b": (LM_MOSHI_7B, MIMI_FULL)}


def _gating_hidden(dim: int, dim_feedforward: int) -> int:
    # Kyutai's ActivationGating: (21 * dim) // 8 for a 4 * dim feed-forward, else 2/3 of it.
    return (21 * dim) // 8 if dim_feedforward == 4 * dim else (2 * dim_feedforward) // 3


class Weights:
    """Named random tensors, each from a generator seeded by its name, drawn when written
    ([`write_safetensors`]): only their names, shapes and dtypes are held until then."""

    def __init__(self, seed: int):
        self.seed = seed
        # name -> (dtype, shape, draw)
        self.tensors: dict[str, tuple] = {}

    def _rng(self, name: str) -> np.random.Generator:
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        return np.random.Generator(np.random.PCG64(int.from_bytes(digest[:8], "little")))

    def normal(self, name: str, shape, std: float | None = None) -> None:
        """Unit normal (embeddings) or std 1/sqrt(fan-in) (matrices, convolutions)."""
        if std is None:
            fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
            std = 1.0 / np.sqrt(fan_in)
        self._add(
            name,
            shape,
            ml_dtypes.bfloat16,
            lambda: self._rng(name).standard_normal(shape, dtype=np.float32) * np.float32(std),
        )

    def const(self, name: str, shape, value: float, jitter: float = 0.0) -> None:
        def draw():
            x = np.full(shape, value, np.float32)
            if jitter:
                x += self._rng(name).uniform(-jitter, jitter, shape).astype(np.float32)
            return x

        self._add(name, shape, ml_dtypes.bfloat16, draw)

    def later(self, name: str, shape, dtype, draw) -> None:
        """A tensor `draw()` makes, of `shape` and stored as `dtype`."""
        self._add(name, shape, dtype, draw)

    def _add(self, name: str, shape, dtype, draw) -> None:
        assert name not in self.tensors, name
        self.tensors[name] = (np.dtype(dtype), tuple(int(d) for d in shape), draw)


SAFETENSORS_DTYPES = {np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float32): "F32"}


def write_safetensors(path: str, w: Weights, metadata: dict[str, str]) -> int:
    """Writes `w` as a safetensors file, tensor by tensor (the header first, from the shapes),
    under `path + ".partial"`, renamed to `path` once whole. Returns the bytes written."""
    names = sorted(w.tensors)
    header: dict = {"__metadata__": metadata}
    at = 0
    for name in names:
        dtype, shape, _ = w.tensors[name]
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    partial = path + ".partial"
    with open(partial, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for name in names:
            dtype, shape, draw = w.tensors[name]
            x = np.ascontiguousarray(np.asarray(draw()).astype(dtype))
            assert x.shape == shape, (name, x.shape, shape)
            f.write(x.tobytes())
            del x
    os.replace(partial, path)
    return 8 + len(head) + at


def lm_weights(cfg: dict, seed: int) -> Weights:
    w = Weights(seed)
    dim, layers, card, text_card = cfg["dim"], cfg["num_layers"], cfg["card"], cfg["text_card"]
    n_q, dep_q = cfg["n_q"], cfg["dep_q"]
    hidden = _gating_hidden(dim, int(cfg["hidden_scale"] * dim))
    w.normal("text_emb.weight", (text_card + 1, dim), 1.0)
    for i in range(n_q):
        w.normal(f"emb.{i}.weight", (card + 1, dim), 1.0)
    for i in range(layers):
        p = f"transformer.layers.{i}"
        w.const(f"{p}.norm1.alpha", (1, 1, dim), 1.0, 0.1)
        w.const(f"{p}.norm2.alpha", (1, 1, dim), 1.0, 0.1)
        w.normal(f"{p}.self_attn.in_proj_weight", (3 * dim, dim))
        w.normal(f"{p}.self_attn.out_proj.weight", (dim, dim))
        w.normal(f"{p}.gating.linear_in.weight", (2 * hidden, dim))
        w.normal(f"{p}.gating.linear_out.weight", (dim, hidden))
    w.const("out_norm.alpha", (1, 1, dim), 1.0, 0.1)
    w.normal("text_linear.weight", (text_card, dim))

    ddim, dlayers = cfg["depformer_dim"], cfg["depformer_num_layers"]
    dhidden = _gating_hidden(ddim, cfg["depformer_dim_feedforward"])
    for k in range(dep_q):
        w.normal(f"depformer_in.{k}.weight", (ddim, dim))
    for k in range(dep_q - 1):
        w.normal(f"depformer_emb.{k}.weight", (card + 1, ddim), 1.0)
    w.normal("depformer_text_emb.weight", (text_card + 1, ddim), 1.0)
    for i in range(dlayers):
        p = f"depformer.layers.{i}"
        w.const(f"{p}.norm1.alpha", (1, 1, ddim), 1.0, 0.1)
        w.const(f"{p}.norm2.alpha", (1, 1, ddim), 1.0, 0.1)
        # weights_per_step: the substeps' matrices stacked on the first axis.
        w.normal(f"{p}.self_attn.in_proj_weight", (dep_q * 3 * ddim, ddim), 1.0 / np.sqrt(ddim))
        w.normal(f"{p}.self_attn.out_proj.weight", (dep_q * ddim, ddim), 1.0 / np.sqrt(ddim))
        for t in range(dep_q):
            w.normal(f"{p}.gating.{t}.linear_in.weight", (2 * dhidden, ddim))
            w.normal(f"{p}.gating.{t}.linear_out.weight", (ddim, dhidden))
    for k in range(dep_q):
        w.normal(f"linears.{k}.weight", (card, ddim))
    return w


def _seanet(w: Weights, side: str, m: dict) -> int:
    """SEANet's `model` list as Kyutai's seanet.py numbers it; returns the output channels."""
    nf, dim = m["n_filters"], m["dimension"]
    ratios = list(reversed(m["ratios"])) if side == "encoder" else m["ratios"]

    def conv(name, out_ch, in_ch, k, transposed=False):
        shape = (in_ch, out_ch, k) if transposed else (out_ch, in_ch, k)
        leaf = "convtr.convtr" if transposed else "conv.conv"
        w.normal(f"{side}.model.{name}.{leaf}.weight", shape)
        w.const(f"{side}.model.{name}.{leaf}.bias", (out_ch,), 0.0, 0.01)

    def resblock(idx, ch):
        hidden = ch // m["compress"]
        conv(f"{idx}.block.1", hidden, ch, m["residual_kernel"])
        conv(f"{idx}.block.3", ch, hidden, 1)

    i = 0
    if side == "encoder":
        mult = 1
        conv(i, mult * nf, 1, m["kernel"])
        i += 1
        for ratio in ratios:
            resblock(i, mult * nf)
            i += 2  # the block, then an ELU
            conv(i, mult * nf * 2, mult * nf, ratio * 2)
            i += 1
            mult *= 2
        i += 1  # ELU
        conv(i, dim, mult * nf, m["last_kernel"])
        return dim
    mult = 2 ** len(ratios)
    conv(i, mult * nf, dim, m["kernel"])
    i += 1
    for ratio in ratios:
        i += 1  # ELU
        conv(i, mult * nf // 2, mult * nf, ratio * 2, transposed=True)
        i += 1
        resblock(i, mult * nf // 2)
        i += 1
        mult //= 2
    i += 1  # ELU
    conv(i, 1, nf, m["last_kernel"])
    return 1


def mimi_weights(seed: int, m: dict = MIMI) -> Weights:
    w = Weights(seed + 1)
    _seanet(w, "encoder", m)
    _seanet(w, "decoder", m)
    dim = m["dimension"]
    # The 25 Hz <-> 12.5 Hz resampling: a learnt stride-2 convolution, a depthwise transposed one.
    w.normal("downsample.conv.conv.conv.weight", (dim, dim, 4))
    w.normal("upsample.convtr.convtr.convtr.weight", (dim, 1, 4))
    for side in ("encoder_transformer", "decoder_transformer"):
        for i in range(m["tr_layers"]):
            p = f"{side}.transformer.layers.{i}"
            for n in ("norm1", "norm2"):
                w.const(f"{p}.{n}.weight", (dim,), 1.0, 0.1)
                w.const(f"{p}.{n}.bias", (dim,), 0.0, 0.01)
            w.normal(f"{p}.self_attn.in_proj_weight", (3 * dim, dim))
            w.normal(f"{p}.self_attn.out_proj.weight", (dim, dim))
            w.normal(f"{p}.linear1.weight", (m["tr_ffn"], dim))
            w.normal(f"{p}.linear2.weight", (dim, m["tr_ffn"]))
            w.const(f"{p}.layer_scale_1.scale", (dim,), 0.01, 0.001)
            w.const(f"{p}.layer_scale_2.scale", (dim,), 0.01, 0.001)
    vq = m["vq_dim"]
    for rvq, layers in (("rvq_first", 1), ("rvq_rest", m["n_q"] - 1)):
        w.normal(f"quantizer.{rvq}.input_proj.weight", (vq, dim, 1))
        w.normal(f"quantizer.{rvq}.output_proj.weight", (dim, vq, 1))
        for j in range(layers):
            p = f"quantizer.{rvq}.vq.layers.{j}._codebook"
            # Running statistics: the table is embedding_sum / cluster_usage.
            def usage(p=p):
                return w._rng(p + ".cluster_usage").uniform(0.5, 4.0, (m["bins"],))

            def table(p=p):
                return w._rng(p + ".table").standard_normal((m["bins"], vq)) * usage(p)[:, None]

            w.later(f"{p}.cluster_usage", (m["bins"],), np.float32, usage)
            w.later(f"{p}.embedding_sum", (m["bins"], vq), np.float32, table)
            w.later(f"{p}._initialized", (1,), np.float32, lambda: np.ones((1,), np.float32))
    return w


def check_tokenizer(path: str) -> None:
    """Exit 2 unless `path` is a SentencePiece model (a file SentencePiece loads)."""
    need_file(path, "make_checkpoint", "a SentencePiece model")
    import sentencepiece

    try:
        sentencepiece.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError) as e:
        refuse("make_checkpoint", path, f"not a SentencePiece model ({str(e).splitlines()[0][:120]})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="checkpoint folder to write")
    parser.add_argument("--tokenizer", help="SentencePiece model to copy in as the text tokenizer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="tiny",
        help="tiny (a few MB), 7b (PersonaPlex-7B's names, shapes and dtypes: 16 GB) or "
             "moshi-7b (Moshi-7B's: its depformer predicts 8 codebooks)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        help="temporal layers to keep (the depformer keeps at most as many), at the real widths",
    )
    parser.add_argument(
        "--no-config",
        action="store_true",
        help="leave out config.json, as older repositories do (the export then assumes 7B sizes)",
    )
    args = parser.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        stop(f"make_checkpoint: --layers {args.layers}: at least 1")
    if args.tokenizer:
        check_tokenizer(args.tokenizer)
    writable(args.out, "make_checkpoint")
    lm_cfg, mimi = SIZES[args.size]
    lm_cfg = dict(lm_cfg)
    if args.layers:
        lm_cfg["num_layers"] = args.layers
        lm_cfg["depformer_num_layers"] = min(args.layers, lm_cfg["depformer_num_layers"])
    os.makedirs(args.out, exist_ok=True)
    metadata = {"format": "pt"}
    for name, w in ((LM_NAME, lm_weights(lm_cfg, args.seed)), (MIMI_NAME, mimi_weights(args.seed, mimi))):
        t0 = time.monotonic()
        n = write_safetensors(os.path.join(args.out, name), w, metadata)
        print(
            f"make_checkpoint: {name}: {len(w.tensors)} tensors, {n / 1e9:.2f} GB in "
            f"{time.monotonic() - t0:.1f} s",
            file=sys.stderr,
        )
    if not args.no_config:
        config = dict(lm_cfg)
        config.update(moshi_name=LM_NAME, mimi_name=MIMI_NAME, tokenizer_name=TOKENIZER_NAME)
        with open(os.path.join(args.out, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
    if args.tokenizer:
        shutil.copyfile(args.tokenizer, os.path.join(args.out, TOKENIZER_NAME))
    print(f"make_checkpoint: wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
