#!/usr/bin/env python3
"""Builds a duplex model pack from a PersonaPlex / Moshi checkpoint folder in Kyutai's format.

    python tools/export_pack.py CHECKPOINT_DIR --out models/personaplex-cuda              # GPU
    python tools/export_pack.py CHECKPOINT_DIR --out models/personaplex-cpu --provider cpu
    python tools/export_pack.py CHECKPOINT_DIR --from-hub nvidia/personaplex-7b-v1 --out ...

CHECKPOINT_DIR holds what Kyutai and NVIDIA publish: the LM's `model.safetensors`, Mimi's
`tokenizer-*.safetensors`, the SentencePiece `tokenizer_spm_32k_3.model` and, in newer
repositories, `config.json` (the LM's hyper-parameters; without it the published 7B sizes are
assumed and checked against the tensors). Nothing is downloaded unless `--from-hub` is given;
when files are missing, the exact download command is printed.

The graphs come from the exporter (mobius-onnx), built at the sizes the checkpoint's tensors
and config say. The weights are read with safetensors' numpy API (no torch) and mapped onto
the exporter's parameter names by this script, which follows Kyutai's module layout: the fused
QKV split and its Q/K rows reordered from interleaved-pair to half-split RoPE, RMSNorm `alpha`
squeezed, the depformer's per-substep weights stacked, Mimi's codebooks rebuilt from their
running statistics (`embedding_sum / cluster_usage`) and cut to the 8 the model uses. Every
graph parameter must receive a tensor of its shape, and every checkpoint tensor must be used or
be one the graphs do not need (listed); anything else is an error naming the tensor.

The pack: temporal (GroupQueryAttention, fp16 for `--provider cuda`, fp32 for `cpu`),
depformer (same dtype), Mimi encoder and decoder (fp32) with their step graphs for stateful
streaming (fp32 and fp16, tools/make_mimi_step.py), the tokenizer, and `pack.yaml` filled
in from the checkpoint. The pack is then checked by loading it (`duplex doctor --pack`).

Memory: each weight is read from the mapped checkpoint, converted and written as its graph is
saved, then dropped; graphs are written one at a time into `OUT.partial` and the folder renamed
once whole. A PersonaPlex-7B exports in about 3.5 min with under 1 GiB of the exporter's own
memory (the checkpoint's mapped pages come on top; the kernel drops them as needed). With
`--quantize*`, the float pack is written beside OUT (`OUT.float`), quantized into OUT
(tools/quantize_pack.py, one weight at a time; the graphs left float are moved, not copied)
and removed: OUT is never a float pack that was meant to be quantized. The load check on
the CPU refuses, saying why, an fp16 pack whose widened weights would not fit this machine's
memory (ONNX Runtime's CPU provider multiplies in fp32): the export then says to check the pack
on the GPU that runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import make_pack  # noqa: E402  (the exporter's import shims and the pack writer)
from toolio import writable  # noqa: E402

EXIT_USAGE = 2  # bad input, before anything is built
LM_GLOB, MIMI_GLOB, TOKENIZER = "model.safetensors", "tokenizer-*.safetensors", "tokenizer_spm_32k_3.model"

# Kyutai's `_lm_kwargs` for the published 7B (used when there is no config.json).
LM_DEFAULTS = {
    "dim": 4096,
    "text_card": 32000,
    "existing_text_padding_id": 3,
    "n_q": 16,
    "card": 2048,
    "num_heads": 32,
    "num_layers": 32,
    "context": 3000,
    "max_period": 10000,
    "depformer_dim": 1024,
    "depformer_num_heads": 16,
    "depformer_num_layers": 6,
    "delays": [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1],
}
# What the exporter's graphs implement; a config asking for anything else is refused.
LM_REQUIRED = {
    "gating": "silu",
    "norm": "rms_norm_f32",
    "positional_embedding": "rope",
    "depformer_pos_emb": "none",
    "depformer_multi_linear": True,
    "depformer_weights_per_step": True,
    "layer_scale": None,
    "depformer_layer_scale": None,
    "depformer_weights_per_step_schedule": None,
    "depformer_low_rank_embeddings": None,
    "depformer_norm": None,
}
MIMI_HEADS = 8  # Kyutai's Mimi transformers: 8 heads (its checkpoint has no config)
MIMI_ACTIVE = 8  # codebooks the model reads
PUBLISHED_SILENCE = [948, 243, 1178, 546, 1736, 1030, 1978, 2008]
PUBLISHED_SINE = [430, 1268, 381, 1611, 1095, 1495, 56, 472]

PROVIDERS = {"cuda": ("gqa-fp16", "f16"), "cpu": ("gqa", "f32")}


class ExportError(Exception):
    """Bad input: a missing file, an unknown layout, a tensor of the wrong shape."""


# --- Finding the checkpoint ------------------------------------------------------------------


@dataclasses.dataclass
class Checkpoint:
    dir: str
    lm: str
    mimi: str
    tokenizer: str | None
    config: dict
    has_config: bool


def download_command(repo: str, folder: str, names: list[str]) -> str:
    """The Hub CLI command (huggingface_hub's `hf`) that fetches `names` (file names or
    patterns) into `folder`. Gated repositories need `hf auth login` first."""
    patterns = " ".join(f"'{n}'" for n in names)
    return f"hf download {repo} --include {patterns} --local-dir {folder}"


def find_checkpoint(folder: str, repo_hint: str) -> Checkpoint:
    import glob

    if not os.path.isdir(folder):
        raise ExportError(
            f"{folder}: checkpoint folder not found; download it with\n  "
            + download_command(repo_hint, folder, [LM_GLOB, MIMI_GLOB, TOKENIZER])
        )
    cfg_path = os.path.join(folder, "config.json")
    config, has_config = {}, os.path.isfile(cfg_path)
    if has_config:
        try:
            with open(cfg_path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ExportError(f"{cfg_path}: not a readable JSON config: {e}") from None
        if not isinstance(config, dict):
            raise ExportError(f"{cfg_path}: expected a JSON object of LM hyper-parameters")
    lm = os.path.join(folder, config.get("moshi_name", LM_GLOB))
    tok = os.path.join(folder, config.get("tokenizer_name", TOKENIZER))
    if "mimi_name" in config:
        mimi = [os.path.join(folder, config["mimi_name"])]
    else:
        mimi = sorted(glob.glob(os.path.join(folder, MIMI_GLOB)))
    # A name that is there but is no regular file (a FIFO would be waited on) is not "missing".
    for path in (lm, tok, *mimi[:1]):
        if os.path.exists(path) and not os.path.isfile(path):
            raise ExportError(f"{path}: not a regular file (a folder, a FIFO, a device or a socket)")
    missing = []
    if not os.path.isfile(lm):
        missing.append(os.path.basename(lm))
    if not mimi or not os.path.isfile(mimi[0]):
        missing.append(os.path.basename(mimi[0]) if mimi else MIMI_GLOB)
    if not os.path.isfile(tok):
        missing.append(os.path.basename(tok))
    if missing:
        raise ExportError(
            f"{folder}: missing {', '.join(missing)}; download with\n  "
            + download_command(repo_hint, folder, missing)
        )
    if len(mimi) > 1:
        raise ExportError(
            f"{folder}: several Mimi checkpoints ({', '.join(map(os.path.basename, mimi))}); "
            "name one with \"mimi_name\" in config.json"
        )
    return Checkpoint(folder, lm, mimi[0], tok, config, has_config)


def from_hub(repo: str, folder: str) -> None:
    """Downloads the files a pack needs from the Hub into `folder` (needs network, and a
    token for gated repositories: `hf auth login` or HF_TOKEN)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ExportError(
            "--from-hub needs huggingface_hub: run `make export-deps` (or download the files "
            "yourself: " + download_command(repo, folder, [LM_GLOB, MIMI_GLOB, TOKENIZER]) + ")"
        ) from None
    patterns = ["config.json", LM_GLOB, MIMI_GLOB, TOKENIZER]
    snapshot_download(repo_id=repo, local_dir=folder, allow_patterns=patterns)


# --- Reading tensors ---------------------------------------------------------------------------


class Tensors:
    """The tensors of a safetensors file, read on first use (numpy, bf16 via ml_dtypes)."""

    def __init__(self, path: str):
        import ml_dtypes  # noqa: F401  (lets numpy read bfloat16 tensors)
        from safetensors import safe_open

        self.path = path
        try:
            self._file = safe_open(path, framework="numpy")
        except Exception as e:  # noqa: BLE001 (safetensors raises its own error types)
            raise ExportError(f"{path}: not a safetensors file: {e}") from None
        self.names = set(self._file.keys())
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def shape(self, name: str) -> tuple[int, ...]:
        self._need(name)
        return tuple(self._file.get_slice(name).get_shape())

    def __getitem__(self, name: str):
        import numpy as np

        self._need(name)
        self.used.add(name)
        x = self._file.get_tensor(name)
        return x.astype(np.float32) if x.dtype != np.float32 else x

    def _need(self, name: str) -> None:
        if name not in self.names:
            raise ExportError(f"{self.path}: no tensor {name!r} (not a Kyutai checkpoint of this layout?)")

    def count(self, fmt: str) -> int:
        n = 0
        while any(k.startswith(fmt.format(n) + ".") or k == fmt.format(n) for k in self.names):
            n += 1
        return n


# --- Sizes from the checkpoint -----------------------------------------------------------------


def _gating_hidden(t: Tensors, name: str, dim: int) -> int:
    rows, cols = t.shape(name)
    if cols != dim or rows % 2:
        raise ExportError(f"{t.path}: {name} is {rows}x{cols}, expected (2 * hidden) x {dim}")
    return rows // 2


def lm_sizes(t: Tensors, ck: Checkpoint) -> dict:
    cfg = dict(LM_DEFAULTS)
    cfg.update({k: v for k, v in ck.config.items() if not isinstance(v, dict)})
    where = os.path.join(ck.dir, "config.json") if ck.has_config else "the published 7B sizes"
    for key, want in LM_REQUIRED.items():
        if key in cfg and cfg[key] != want:
            raise ExportError(f"{where}: {key} = {cfg[key]!r}; the exporter's graphs need {want!r}")
    for key in ("conditioners", "fuser", "lora"):
        if cfg.get(key):
            raise ExportError(f"{where}: {key} is set; conditioned / LoRA LMs are not supported")
    dim = t.shape("text_emb.weight")[1]
    layers = t.count("transformer.layers.{}")
    n_q = t.count("emb.{}")
    dep_q = t.count("depformer_in.{}")
    dep_layers = t.count("depformer.layers.{}")
    ddim = t.shape("depformer_text_emb.weight")[1]
    for key, have in (
        ("dim", dim),
        ("num_layers", layers),
        ("n_q", n_q),
        ("depformer_dim", ddim),
        ("depformer_num_layers", dep_layers),
    ):
        if cfg[key] != have:
            raise ExportError(f"{where}: {key} is {cfg[key]} but {t.path} has {have}")
    if "dep_q" in cfg and cfg["dep_q"] != dep_q:
        raise ExportError(f"{where}: dep_q is {cfg['dep_q']} but {t.path} has {dep_q} depformer_in")
    heads, dheads = cfg["num_heads"], cfg["depformer_num_heads"]
    for key, v in (("num_heads", heads), ("depformer_num_heads", dheads)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ExportError(f"{where}: {key} is {v!r}: a count of heads, 1 or more")
    if dim % heads or ddim % dheads:
        raise ExportError(f"{where}: num_heads {heads} / depformer_num_heads {dheads} do not divide the widths {dim} / {ddim}")
    if n_q != 16 or dep_q not in (8, 16):
        raise ExportError(
            f"{t.path}: {n_q} audio streams and {dep_q} depformer steps; duplex runs the "
            "two-speaker layout of PersonaPlex / Moshi (16 streams, 16 or 8 steps)"
        )
    delays = cfg["delays"]
    if len(delays) != n_q + 1:
        raise ExportError(f"{where}: {len(delays)} delays for {n_q + 1} channels")
    return {
        "temporal": make_pack.LmSize(dim=dim, layers=layers, heads=heads, head_dim=dim // heads),
        "depformer": make_pack.LmSize(dim=ddim, layers=dep_layers, heads=dheads, head_dim=ddim // dheads),
        "ffn": _gating_hidden(t, "transformer.layers.0.gating.linear_in.weight", dim),
        "dep_ffn": _gating_hidden(t, "depformer.layers.0.gating.0.linear_in.weight", ddim),
        "dep_q": dep_q,
        "text_card": t.shape("text_linear.weight")[0],
        "card": t.shape("linears.0.weight")[0],
        "context": int(cfg["context"]),
        "max_period": float(cfg["max_period"]),
        "delays": list(delays),
        "text_padding": int(cfg["existing_text_padding_id"]),
    }


def mimi_sizes(t: Tensors) -> dict:
    p = "encoder_transformer.transformer.layers"
    tr_dim = t.shape(f"{p}.0.self_attn.in_proj_weight")[1]
    vq_dim, codebook_dim, _ = t.shape("quantizer.rvq_first.input_proj.weight")
    if tr_dim % MIMI_HEADS:
        raise ExportError(f"{t.path}: transformer width {tr_dim} is not a multiple of {MIMI_HEADS} heads")
    n_rest = t.count("quantizer.rvq_rest.vq.layers.{}")
    if n_rest < MIMI_ACTIVE - 1:
        raise ExportError(f"{t.path}: {n_rest + 1} codebooks, the model reads {MIMI_ACTIVE}")
    return {
        "_N_FILTERS": t.shape("encoder.model.0.conv.conv.weight")[0],
        "_DIMENSION": codebook_dim,
        "_TR_DIM": tr_dim,
        "_TR_LAYERS": t.count(p + ".{}"),
        "_TR_HEADS": MIMI_HEADS,
        "_TR_HEAD_DIM": tr_dim // MIMI_HEADS,
        "_TR_FFN": t.shape(f"{p}.0.linear1.weight")[0],
        "_CODEBOOK_DIM": codebook_dim,
        "_VQ_DIM": vq_dim,
    }


# --- Kyutai names -> the exporter's parameter names (numpy) ------------------------------------


def halfsplit(w, head_dim: int):
    """Q/K rows from Kyutai's interleaved-pair RoPE, (2i, 2i+1), to half-split, (i, i + D/2)."""
    import numpy as np

    rows, cols = w.shape
    order = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    return w.reshape(rows // head_dim, head_dim, cols)[:, order, :].reshape(rows, cols)


def temporal_weights(t: Tensors, s: dict) -> dict:
    """Thunks (called once, when their tensor is assigned) keyed by the exporter's names."""
    hd, dim = s["temporal"].head_dim, s["temporal"].dim
    out = {"embed.text_emb.weight": lambda: t["text_emb.weight"]}
    for cb in range(16):
        out[f"embed.emb.{cb}.weight"] = lambda cb=cb: t[f"emb.{cb}.weight"]
    for i in range(s["temporal"].layers):
        src, dst = f"transformer.layers.{i}", f"model.layers.{i}"
        qkv = f"{src}.self_attn.in_proj_weight"
        out.update({
            f"{dst}.input_layernorm.weight": lambda n=f"{src}.norm1.alpha": t[n].reshape(-1),
            f"{dst}.post_attention_layernorm.weight": lambda n=f"{src}.norm2.alpha": t[n].reshape(-1),
            f"{dst}.self_attn.q_proj.weight": lambda n=qkv: halfsplit(t[n][:dim], hd),
            f"{dst}.self_attn.k_proj.weight": lambda n=qkv: halfsplit(t[n][dim : 2 * dim], hd),
            f"{dst}.self_attn.v_proj.weight": lambda n=qkv: t[n][2 * dim :],
            f"{dst}.self_attn.o_proj.weight": lambda n=f"{src}.self_attn.out_proj.weight": t[n],
            f"{dst}.mlp.gate_up_proj.weight": lambda n=f"{src}.gating.linear_in.weight": t[n],
            f"{dst}.mlp.down_proj.weight": lambda n=f"{src}.gating.linear_out.weight": t[n],
        })
    out["model.norm.weight"] = lambda: t["out_norm.alpha"].reshape(-1)
    out["text_linear.weight"] = lambda: t["text_linear.weight"]
    return out


def depformer_weights(t: Tensors, s: dict) -> dict:
    """The depformer's per-substep weights stacked `(16, ...)`. A Moshi checkpoint (8 steps:
    the model predicts its own 8 codebooks only) gets its steps 0..7 repeated as 8..15: those
    substeps predict the user's stream, which is always provided, so `user_substeps: skip`
    never runs them and their weights decide nothing."""
    import numpy as np

    d, q = s["depformer"].dim, s["dep_q"]
    steps = [k % q for k in range(16)]

    def per_step(w, rows):  # Kyutai stacks (q * rows, cols) -> (16, rows, cols)
        w = w.reshape(q, rows, w.shape[-1])
        return w[steps]

    out = {
        "depformer_in.weight": lambda: np.stack([t[f"depformer_in.{k}.weight"] for k in steps]),
        "text_emb.weight": lambda: t["depformer_text_emb.weight"],
        "audio_emb": lambda: np.stack([t[f"depformer_emb.{min(k, q - 2)}.weight"] for k in range(15)]),
        "linears.weight": lambda: np.stack([t[f"linears.{k}.weight"] for k in steps]),
    }
    for i in range(s["depformer"].layers):
        src, dst = f"depformer.layers.{i}", f"layers.{i}"
        out.update({
            f"{dst}.norm1.weight": lambda n=f"{src}.norm1.alpha": t[n].reshape(-1),
            f"{dst}.norm2.weight": lambda n=f"{src}.norm2.alpha": t[n].reshape(-1),
            f"{dst}.in_proj.weight": lambda n=f"{src}.self_attn.in_proj_weight": per_step(t[n], 3 * d),
            f"{dst}.out_proj.weight": lambda n=f"{src}.self_attn.out_proj.weight": per_step(t[n], d),
            f"{dst}.gating_in.weight": lambda src=src: np.stack([t[f"{src}.gating.{k}.linear_in.weight"] for k in steps]),
            f"{dst}.gating_out.weight": lambda src=src: np.stack([t[f"{src}.gating.{k}.linear_out.weight"] for k in steps]),
        })
    return out


def mimi_weights(t: Tensors, s: dict) -> dict:
    import numpy as np

    out = {}
    for key in sorted(t.names):
        if key.startswith(("encoder.model.", "downsample.")):
            out[f"encoder.{key}"] = lambda k=key: t[k]
        elif key.startswith(("decoder.model.", "upsample.")):
            out[f"decoder.{key}"] = lambda k=key: t[k]
    hd, dim = s["_TR_HEAD_DIM"], s["_TR_DIM"]
    for side, comp in (("encoder_transformer", "encoder"), ("decoder_transformer", "decoder")):
        for i in range(s["_TR_LAYERS"]):
            src, dst = f"{side}.transformer.layers.{i}", f"{comp}.{side}.transformer.layers.{i}"
            qkv = f"{src}.self_attn.in_proj_weight"
            pairs = {
                "input_layernorm.weight": f"{src}.norm1.weight",
                "input_layernorm.bias": f"{src}.norm1.bias",
                "post_attention_layernorm.weight": f"{src}.norm2.weight",
                "post_attention_layernorm.bias": f"{src}.norm2.bias",
                "self_attn.o_proj.weight": f"{src}.self_attn.out_proj.weight",
                "mlp.up_proj.weight": f"{src}.linear1.weight",
                "mlp.down_proj.weight": f"{src}.linear2.weight",
                "self_attn_layer_scale.scale": f"{src}.layer_scale_1.scale",
                "mlp_layer_scale.scale": f"{src}.layer_scale_2.scale",
            }
            for d, n in pairs.items():
                out[f"{dst}.{d}"] = lambda n=n: t[n]
            out[f"{dst}.self_attn.q_proj.weight"] = lambda n=qkv: halfsplit(t[n][:dim], hd)
            out[f"{dst}.self_attn.k_proj.weight"] = lambda n=qkv: halfsplit(t[n][dim : 2 * dim], hd)
            out[f"{dst}.self_attn.v_proj.weight"] = lambda n=qkv: t[n][2 * dim :]

    def codebook(prefix):
        usage = np.maximum(t[f"{prefix}.cluster_usage"], np.float32(1e-8))[:, None]
        return t[f"{prefix}.embedding_sum"] / usage

    books = [("rvq_first", 0)] + [("rvq_rest", j) for j in range(MIMI_ACTIVE - 1)]
    for comp in ("encoder", "decoder"):
        for rvq in ("rvq_first", "rvq_rest"):
            for proj in ("input_proj", "output_proj"):
                n = f"quantizer.{rvq}.{proj}.weight"
                out[f"{comp}.{n}"] = lambda n=n: t[n]
        for rvq, j in books:
            p = f"quantizer.{rvq}.vq.layers.{j}._codebook"
            out[f"{comp}.{p}.embedding.weight"] = lambda p=p: codebook(p)
    return out


def ignorable(name: str) -> bool:
    """Checkpoint tensors no graph reads: the codebooks past the 8 the model uses, the
    codebooks' `_initialized` flags, and the training-only extra heads."""
    import re

    m = re.match(r"quantizer\.rvq_rest\.vq\.layers\.(\d+)\._codebook\.", name)
    if m and int(m.group(1)) >= MIMI_ACTIVE - 1:
        return True
    return name.endswith("._initialized") or name.startswith("extra_heads.")


def assign(model, weights: dict, graph: str) -> None:
    """Sets every parameter of `model` from `weights`, cast to its dtype; then folds. Each
    weight is a lazy tensor, read from the checkpoint (mapped) and converted when the graph is
    written, then dropped: a graph's weights are never all in memory at once (a 7B's temporal
    is 13 GiB in fp16, 26 in fp32)."""
    import numpy as np
    import onnx_ir as ir
    from mobius._optimizations import fold_initializers_after_weights

    def load(name: str, thunk, dtype, want: tuple):
        def read():
            x = thunk()
            if tuple(x.shape) != want:
                raise ExportError(f"{graph}: {name} is {tuple(x.shape)} in the checkpoint, the graph wants {want}")
            return ir.Tensor(np.ascontiguousarray(x.astype(dtype)), name=name)
        return read

    for name, value in model.graph.initializers.items():
        if value.const_value is not None:
            continue  # the exporter's own tables (RoPE caches)
        if name not in weights:
            raise ExportError(f"{graph}: no checkpoint tensor maps to the parameter {name!r}")
        want = tuple(int(d) for d in value.shape)
        value.const_value = ir.LazyTensor(load(name, weights[name], value.dtype.numpy(), want),
                                          dtype=value.dtype, shape=ir.Shape(want), name=name)
    fold_initializers_after_weights(model)


# --- Building ------------------------------------------------------------------------------------


def build_lm(t: Tensors, s: dict, provider: str):
    """Yields (name, graph) for the temporal transformer, then the depformer: each is built
    and weighted only once the one before has been taken (and written) by the caller."""
    import onnx_ir as ir
    from mobius._builder import build_from_module
    from mobius.models import moshi
    from mobius.tasks import MoshiDepformerTask, MoshiTemporalTask

    dtype = ir.DataType.FLOAT16 if PROVIDERS[provider][1] == "f16" else ir.DataType.FLOAT
    overrides = make_pack._lm_overrides(s["temporal"], s["depformer"])
    overrides.update(_T_FFN=s["ffn"], _D_GATE_HIDDEN=s["dep_ffn"], _T_CONTEXT=s["context"], _ROPE_THETA=s["max_period"])
    with (
        make_pack._patched(moshi, overrides),
        make_pack._patched(MoshiDepformerTask, {"_TEMPORAL_DIM": s["temporal"].dim}),
    ):
        for name, make_config, cls, task, weights in (
            ("temporal", moshi.moshi_temporal_config, moshi.MoshiTemporalModel, MoshiTemporalTask, temporal_weights),
            ("depformer", moshi.moshi_depformer_config, moshi.MoshiDepformerModel, MoshiDepformerTask, depformer_weights),
        ):
            config = dataclasses.replace(make_config(), dtype=dtype)
            module = cls(config)
            make_pack._cast_parameters(module, dtype)
            model = build_from_module(module, config, task(), execution_provider=provider)["model"]
            assign(model, weights(t, s), name)
            yield name, model
            del model, module


def build_mimi(t: Tensors, s: dict) -> dict:
    from mobius._builder import build_from_module
    from mobius.models import mimi
    from mobius.tasks import CodecTask

    with make_pack._patched(mimi, s):
        config = mimi.mimi_default_config()
        module = mimi.MimiModel(config)
        pkg = build_from_module(module, config, CodecTask(), execution_provider="default")
    weights = mimi_weights(t, s)
    out = {}
    for role in ("encoder", "decoder"):
        assign(pkg[role], weights, f"mimi_{role}")
        out[f"mimi_{role}"] = pkg[role]
    return out


def frame_codes(pack_dir: str, *signals) -> list[list[int]] | None:
    """For each signal, the codes the pack's encoder gives the last of its frames, from one
    session (None when onnxruntime is not installed)."""
    try:
        import numpy as np
        import onnxruntime as ort
    except ImportError:
        return None
    so = ort.SessionOptions()
    so.log_severity_level = 3
    enc = ort.InferenceSession(os.path.join(pack_dir, "mimi_encoder", "model.onnx"), so)
    name = enc.get_inputs()[0].name
    out = []
    for signal in signals:
        codes = enc.run(None, {name: np.asarray(signal, np.float32)[None, None, :]})[0]
        out.append([int(c) for c in codes[0, :, -1]])
    return out


def manifest(name: str, provider: str, s: dict, mimi_full: bool, silence, sine) -> str:
    variant, dtype = PROVIDERS[provider]
    tl, dl = s["temporal"], s["depformer"]
    lines = [
        "# Model pack exported by tools/export_pack.py from a Kyutai-format checkpoint.",
        f"name: {name}",
        f"variant: {variant}",
        f"dtype: {dtype}",
        f"mimi: {'full' if mimi_full else 'custom'}",
        "sample_rate: 24000",
        "frame_size: 1920",
        "codebooks: 8",
        f"text_vocab: {s['text_card']}",
        f"audio_vocab: {s['card']}",
        f"delays: {json.dumps(s['delays']).replace(',', ', ').replace('  ', ' ')}",
        "initial_tokens:",
        f"  text: {s['text_card']}",
        f"  audio: {s['card']}",
        f"text_padding: {s['text_padding']}",
        "special_text_ids:",
        "  epad: 0",
        "  bos: 1",
        "  eos: 2",
        "  pad: 3",
        f"silence_codes: {json.dumps(silence)}",
        f"sine_codes: {json.dumps(sine)}",
        f"context: {s['context']}",
        "max_positions: 8000",
        "tokenizer: tokenizer.model",
        "temporal:",
        f"  dim: {tl.dim}",
        f"  layers: {tl.layers}",
        f"  heads: {tl.heads}",
        f"  head_dim: {tl.head_dim}",
        "depformer:",
        f"  dim: {dl.dim}",
        f"  layers: {dl.layers}",
        f"  heads: {dl.heads}",
        f"  head_dim: {dl.head_dim}",
    ]
    return "\n".join(lines) + "\n"


def find_duplex(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    local = os.path.join(HERE, "..", "target", "release", "duplex")
    if os.access(local, os.X_OK):
        return os.path.abspath(local)
    return shutil.which("duplex")


def folder_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Build a duplex model pack from a Kyutai-format PersonaPlex / Moshi checkpoint."
    )
    parser.add_argument("checkpoint", help="folder with model.safetensors, tokenizer-*.safetensors, tokenizer_spm_32k_3.model")
    parser.add_argument("--out", required=True, help="pack folder to write")
    parser.add_argument("--provider", choices=sorted(PROVIDERS), default="cuda",
                        help="cuda: fp16 LM graphs for a GPU (default); cpu: fp32")
    parser.add_argument("--from-hub", metavar="REPO", help="download the checkpoint from this Hub repository into CHECKPOINT first")
    parser.add_argument("--name", help="the pack's name (default: the output folder's)")
    parser.add_argument("--duplex", help="duplex binary for the load check (default: target/release/duplex, then PATH)")
    parser.add_argument("--no-check", action="store_true", help="skip the load check")
    import quantize_pack

    quantize_pack.add_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="show the exporter's log")
    args = parser.parse_args(argv)

    start = time.monotonic()

    def say(msg: str) -> None:
        print(f"export_pack: {msg}", file=sys.stderr, flush=True)

    writable(args.out, "export_pack")
    if not args.verbose:
        logging.getLogger("mobius").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", message="GQA fusion expected")
    try:
        if args.from_hub:
            say(f"downloading {args.from_hub} into {args.checkpoint}")
            from_hub(args.from_hub, args.checkpoint)
        ck = find_checkpoint(args.checkpoint, args.from_hub or "nvidia/personaplex-7b-v1")
        lm, codec = Tensors(ck.lm), Tensors(ck.mimi)
        s = lm_sizes(lm, ck)
        ms = mimi_sizes(codec)
    except ExportError as e:
        print(f"export_pack: {e}", file=sys.stderr)
        return EXIT_USAGE
    tl, dl = s["temporal"], s["depformer"]
    say(
        f"checkpoint {ck.dir}: temporal {tl.layers} layers x {tl.dim} ({tl.heads} heads), "
        f"depformer {dl.layers} x {dl.dim}, {s['dep_q']} steps; Mimi {ms['_TR_LAYERS']}-layer "
        f"transformers x {ms['_TR_DIM']}, SEANet {ms['_N_FILTERS']} filters"
        + ("" if ck.has_config else " (no config.json: the published 7B hyper-parameters)")
    )
    if s["dep_q"] == 8:
        say("an 8-step depformer (Moshi): steps 0..7 stand in for 8..15; run it with user_substeps: skip")

    make_pack._import_exporter()
    out = os.path.abspath(args.out)
    name = args.name or os.path.basename(out)
    mimi_full = ms["_TR_DIM"] == 512 and ms["_N_FILTERS"] == 64
    quantized = "int" in args.quantize + args.quantize_codec + args.quantize_depformer
    make_pack.PackWriter.replaceable(out)
    # A quantized pack is made from the float one, written beside it (`OUT.float`) and removed
    # once the quantized pack is in place: OUT is never a float pack that was to be quantized.
    built = out + ".float" if quantized else out
    # Graph by graph: each is built, weighted, written and dropped before the next is built
    # (a 7B's temporal alone is 13 GiB in fp16), into `.partial` until the pack is whole.
    writer = make_pack.PackWriter(built)
    try:
        t0 = time.monotonic()
        def graphs():
            yield from build_lm(lm, s, args.provider)
            yield from build_mimi(codec, ms).items()  # built once the LM's are written

        for graph, model in graphs():
            writer.add(graph, model)
            del model
            gc.collect()
            say(f"  {graph:<21} built and written ({time.monotonic() - t0:.1f} s)")
        for tensors in (lm, codec):
            unused = sorted(n for n in tensors.names - tensors.used if not ignorable(n))
            if unused:
                raise ExportError(f"{tensors.path}: tensors no graph reads: {', '.join(unused[:8])}"
                                  + (f" and {len(unused) - 8} more" if len(unused) > 8 else ""))
        say(f"built, weighted and wrote the graphs in {time.monotonic() - t0:.1f} s")
    except ExportError as e:
        writer.abandon()
        print(f"export_pack: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BaseException:
        writer.abandon()
        raise
    try:
        # Written once with the published codes, so the encoder can be run, then with the codes
        # of silence and of a 440 Hz sine under this codec when it is not the published one.
        writer.finish(manifest(name, args.provider, s, mimi_full, PUBLISHED_SILENCE, PUBLISHED_SINE))
        shutil.copyfile(ck.tokenizer, os.path.join(built, "tokenizer.model"))
        import numpy as np

        n = 1920 * 4
        silence, sine = frame_codes(built, np.zeros(n), 0.5 * np.sin(2 * np.pi * 440 * np.arange(n) / 24000)) or (None, None)
        if silence is not None and not mimi_full:
            with open(os.path.join(built, "pack.yaml"), "w", encoding="utf-8") as f:
                f.write(manifest(name, args.provider, s, mimi_full, silence, sine))
            say(f"this codec's silence codes {silence}, sine codes {sine}")
        elif silence is not None and silence != PUBLISHED_SILENCE:
            say(f"note: this Mimi encodes silence as {silence}, not the published {PUBLISHED_SILENCE}")
        # Mimi's step graphs (stateful streaming, fp32 and fp16) from the graphs just written.
        import make_mimi_step

        steps = make_mimi_step.add_step_graphs(built, say=lambda _m: None)
        if quantized:
            t0 = time.monotonic()
            for g, r in quantize_pack.from_arguments(built, out, args, say, consume=True).items():
                say(f"{quantize_pack.describe(g, r)} ({time.monotonic() - t0:.1f} s)")
        for g in ("temporal", "depformer", "mimi_encoder", "mimi_decoder", *steps):
            say(f"  {g:<21} {folder_size(os.path.join(out, g)) / 2**20:9.1f} MiB")
        say(f"wrote {out} ({PROVIDERS[args.provider][0]}, {PROVIDERS[args.provider][1]}) in {time.monotonic() - start:.1f} s")
    finally:
        if quantized:
            shutil.rmtree(built, ignore_errors=True)

    if args.no_check:
        return 0
    duplex = find_duplex(args.duplex)
    if duplex is None:
        say(f"no duplex binary found to check the pack: run `duplex doctor --pack {out}`")
        return 0
    check = subprocess.run([duplex, "doctor", "--pack", out], capture_output=True, text=True)
    sys.stderr.write(check.stdout + check.stderr)
    if check.returncode != 0 and "widens its temporal weights to fp32" in check.stderr:
        # (a GPU pack too big for this machine's CPU: whole, but to be checked where it runs)
        say(f"wrote {out}, but this machine cannot check it on its CPU (above); check it on the "
            f"GPU that will run it: duplex doctor --pack {out} --provider cuda")
        return 0
    if check.returncode != 0:
        say(f"the pack does not load (duplex doctor --pack {out} exited {check.returncode})")
        return 1
    say("the pack loads: " + out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
