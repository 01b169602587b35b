#!/usr/bin/env python3
"""Builds Moshi / PersonaPlex model packs with random, deterministic weights.

The graphs come from the real exporter (mobius-onnx 0.1.0), so their structure, input and output
names, and operators are those of a real PersonaPlex export; only the sizes are reduced (by
overriding the exporter's module constants while building) and the weights are random. Every
weight is drawn from a generator seeded by its parameter name, so a rebuild is byte-identical.

    python tools/make_pack.py --size tiny --variant gqa --out models/tiny-gqa
    python tools/make_pack.py --size small --variant gqa-fp16 --mimi full --out /tmp/small
    python tools/make_pack.py --all-tiny --out models     # models/tiny, tiny-gqa, tiny-gqa-fp16

A pack is `<out>/{mimi_encoder,mimi_decoder,temporal,depformer}/model.onnx` (weights in
`model.onnx.data` beside each) plus `<out>/pack.yaml`, and Mimi's step graphs
(`mimi_{encoder,decoder}_step{,_f16}/`, see tools/make_mimi_step.py) unless `--no-step-graphs`. Variants:

    standard  temporal exported for provider "default": plain attention, takes position_ids
    gqa       provider "cpu", fp32: com.microsoft GroupQueryAttention, no position_ids
    gqa-fp16  provider "cuda", fp16 temporal and depformer (K/V, hidden and logits are fp16)

Mimi is always fp32 and exported for provider "default".

Real shapes without real weights (for the GPU check, where a 7B pack cannot be carried):

    python tools/make_pack.py --size 7b --variant gqa-fp16 --shapes-only --out gpu/7b
    python tools/fill_weights.py gpu/7b        # there: writes the weights (numpy only)

`--size 7b` is PersonaPlex's shapes (temporal 4096 wide, 32 layers of 32 heads × 128; depformer
1024 wide, 6 layers of 16 heads × 64); `--layers N` keeps the structure with fewer layers.
`--shapes-only` writes every graph (the codec's step graphs too) with its weights declared in
`model.onnx.data` but not written: beside each `model.onnx`, `weights.json` lists every such
weight (name, dtype, shape, offset, length, how to fill it), and `tools/fill_weights.py` writes
them later (a few MB to carry instead of 17 GB).

The exporter imports torch, safetensors, tqdm, huggingface_hub and transformers at import time
but needs them only to read real checkpoints; placeholder modules stand in for them here, so
neither torch nor a checkpoint is needed. Requires mobius-onnx==0.1.0 (installed --no-deps),
onnx-ir, onnxscript, onnx-shape-inference, onnx and numpy at the versions tools/setup.sh pins.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.abc
import importlib.machinery
import logging
import math
import os
import shutil
import sys
import time
import types
import warnings

# --- Placeholder modules ---------------------------------------------------------------------
# Any attribute of a placeholder module is a placeholder class: it can be subclassed, called,
# subscripted, used in annotations and as a dict key, which covers what the exporter does with
# these packages at import time. Calling into one for real (reading a checkpoint) is a bug here.

_PLACEHOLDER_PACKAGES = ("torch", "safetensors", "tqdm", "huggingface_hub", "transformers")


class _PlaceholderMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")

    def __getitem__(cls, _key):
        return cls

    def __or__(cls, _other):
        return cls

    __ror__ = __or__


def _placeholder(qualname: str) -> type:
    return _PlaceholderMeta(
        qualname, (), {"__init__": lambda self, *a, **k: None, "__module__": "placeholder"}
    )


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{self.__name__}.{name}")


# The real safetensors (its numpy API reads checkpoints in tools/export_pack.py) is used when
# installed; only its torch module, which imports torch, stays a placeholder.
_REAL_WHEN_INSTALLED = ("safetensors",)


def _wants_placeholder(fullname: str, real: frozenset) -> bool:
    top = fullname.split(".")[0]
    if top in real:
        return fullname == f"{top}.torch" or fullname.startswith(f"{top}.torch.")
    return top in _PLACEHOLDER_PACKAGES


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, real: frozenset = frozenset()):
        self.real = real

    def find_spec(self, fullname, path=None, target=None):
        if _wants_placeholder(fullname, self.real):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _PlaceholderModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def _import_exporter():
    """Imports mobius with placeholders for the packages it only needs for checkpoints."""
    import importlib.util

    real = frozenset(
        p for p in _REAL_WHEN_INSTALLED if p in sys.modules or importlib.util.find_spec(p)
    )
    for name in list(sys.modules):
        if _wants_placeholder(name, real) and not isinstance(
            sys.modules[name], _PlaceholderModule
        ):
            sys.exit(f"make_pack: {name} is already imported; run this script on its own")
    sys.meta_path.insert(0, _PlaceholderFinder(real))
    try:
        import mobius  # noqa: F401
    except ImportError as e:
        sys.exit(f"make_pack: cannot import mobius ({e}); run tools/setup.sh first")
    if mobius.__version__ != "0.1.0":
        sys.exit(f"make_pack: mobius {mobius.__version__} found, this script needs 0.1.0")


# --- Sizes -----------------------------------------------------------------------------------


def _swiglu_hidden(dim: int) -> int:
    # Kyutai's gating hidden size: (2 * int(4.125 * dim)) // 3 (11264 for 4096, 2816 for 1024).
    return (2 * int(4.125 * dim)) // 3


@dataclasses.dataclass(frozen=True)
class LmSize:
    dim: int
    layers: int
    heads: int
    head_dim: int


TEMPORAL_SIZES = {
    "tiny": LmSize(dim=64, layers=2, heads=4, head_dim=16),
    "small": LmSize(dim=512, layers=4, heads=8, head_dim=64),
    "7b": LmSize(dim=4096, layers=32, heads=32, head_dim=128),
}
# The depformer stays tiny in the test sizes (it is not what they are meant to stress), and is
# PersonaPlex's own in the 7B's.
DEPFORMER_SIZE = LmSize(dim=32, layers=2, heads=2, head_dim=16)
DEPFORMER_SIZES = {"7b": LmSize(dim=1024, layers=6, heads=16, head_dim=64)}


def lm_sizes(size: str, layers: int | None = None) -> tuple[LmSize, LmSize]:
    """The temporal transformer's and the depformer's sizes; `layers` caps both."""
    temporal = TEMPORAL_SIZES[size]
    depformer = DEPFORMER_SIZES.get(size, DEPFORMER_SIZE)
    if layers:
        temporal = dataclasses.replace(temporal, layers=layers)
        depformer = dataclasses.replace(depformer, layers=min(layers, depformer.layers))
    return temporal, depformer

# Mimi overrides (module constants of mobius.models.mimi). "full" keeps the real architecture.
# The SEANet output, the transformer and the quantizer projections share one width, so all three
# follow the transformer dim; the 1920-sample hop (ratios 8*6*5*4, stride-2 resample) and the
# 8 codebooks of 2048 entries are kept. The decoder's quantizer derives its codebook width as
# _CODEBOOK_DIM // 2 while the encoder's reads _VQ_DIM: the two must agree.
MIMI_SIZES = {
    "tiny": {
        "_N_FILTERS": 4,
        "_DIMENSION": 32,
        "_TR_DIM": 32,
        "_TR_LAYERS": 2,
        "_TR_HEADS": 2,
        "_TR_HEAD_DIM": 16,
        "_TR_FFN": 128,
        "_CODEBOOK_DIM": 32,
        "_VQ_DIM": 16,
    },
    "full": {},
}

VARIANTS = {
    # variant: (execution provider, dtype of temporal and depformer)
    "standard": ("default", "f32"),
    "gqa": ("cpu", "f32"),
    "gqa-fp16": ("cuda", "f16"),
}

ALL_TINY = {"tiny": "standard", "tiny-gqa": "gqa", "tiny-gqa-fp16": "gqa-fp16"}


@contextlib.contextmanager
def _patched(obj, values: dict):
    """Sets attributes of a module or class for the duration of a build, then restores them."""
    saved = {}
    for name, value in values.items():
        if not hasattr(obj, name):
            raise AttributeError(f"{getattr(obj, '__name__', obj)} has no {name}")
        saved[name] = getattr(obj, name)
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


def _lm_overrides(temporal: LmSize, depformer: LmSize) -> dict:
    return {
        "_T_DIM": temporal.dim,
        "_T_LAYERS": temporal.layers,
        "_T_HEADS": temporal.heads,
        "_T_HEAD_DIM": temporal.head_dim,
        "_T_FFN": _swiglu_hidden(temporal.dim),
        "_D_DIM": depformer.dim,
        "_D_LAYERS": depformer.layers,
        "_D_HEADS": depformer.heads,
        "_D_HEAD_DIM": depformer.head_dim,
        "_D_GATE_HIDDEN": _swiglu_hidden(depformer.dim),
    }


# --- Weights ---------------------------------------------------------------------------------


def _fan_in(value, shape: tuple[int, ...]) -> int:
    """Inputs that feed one output of the op consuming this weight."""
    import math

    for node, index in value.uses():
        if index != 1:
            continue
        kernel = math.prod(shape[2:])
        if node.op_type == "Conv":
            return shape[1] * kernel
        if node.op_type == "ConvTranspose":
            group = node.attributes.get_int("group", 1)
            strides = node.attributes.get_ints("strides", [1])
            return max(1, shape[0] // group * kernel // math.prod(strides))
    return shape[-1]


def _random_weight(value, seed: int):
    """A deterministic random tensor for one parameter, drawn from a generator seeded by name.

    Biases are zeros, one-dimensional weights (norms, layer scales) ones, embedding and codebook
    tables unit normal, and matrices and convolutions normal with std 1/sqrt(fan-in), which keeps
    activations and logits of order one: outputs stay finite and sampling is not degenerate.
    """
    import numpy as np
    import onnx_ir as ir

    name = value.name
    shape = tuple(int(d) for d in value.shape)
    # The Mimi encoder and decoder graphs share their codebook tables under the same names, so a
    # name seeds the same table in both and the decoder reads the codes the encoder writes.
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    rng = np.random.Generator(np.random.PCG64(int.from_bytes(digest[:8], "little")))
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        data = np.zeros(shape, np.float32)
    elif len(shape) == 1:
        data = np.ones(shape, np.float32)
    elif "emb" in name:
        data = rng.standard_normal(shape, dtype=np.float32)
    else:
        std = 1.0 / np.sqrt(_fan_in(value, shape))
        data = (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)
    return ir.Tensor(data.astype(value.dtype.numpy()), name=name)


def _unwritten(value):
    """A weight that is declared, not computed: `--shapes-only` writes its place, not its data."""
    import onnx_ir as ir

    name = value.name

    def fail():
        raise RuntimeError(f"{name}: a --shapes-only weight has no data")

    return ir.LazyTensor(fail, dtype=value.dtype, shape=ir.Shape(value.shape), name=name)


def _assign_random_weights(model, seed: int, shapes_only: bool = False) -> None:
    from mobius._optimizations import fold_initializers_after_weights

    for value in model.graph.initializers.values():
        if value.const_value is None:
            value.const_value = _unwritten(value) if shapes_only else _random_weight(value, seed)
    # As after loading a real checkpoint: folds weight Transposes and packed-QKV Concats.
    fold_initializers_after_weights(model)


# --- Building --------------------------------------------------------------------------------


def _cast_parameters(module, dtype) -> None:
    """Casts the module's float32 parameters to `dtype` before the graph is built.

    The exporter does the same in `build_from_module`, but converts precomputed tables (RoPE
    caches) through torch; doing it here with numpy (same round-to-nearest-even) leaves it
    nothing to cast.
    """
    import onnx_ir as ir

    if dtype == ir.DataType.FLOAT:
        return
    for param in module.parameters():
        if param.dtype != ir.DataType.FLOAT or getattr(param, "_keep_float32", False):
            continue
        param.type = ir.TensorType(dtype)
        if param.const_value is not None:
            param.const_value = ir.Tensor(param.const_value.numpy().astype(dtype.numpy()))


def build_mimi(size: str, seed: int, shapes_only: bool = False) -> dict:
    """Returns {"mimi_encoder": ir.Model, "mimi_decoder": ir.Model}."""
    from mobius._builder import build_from_module
    from mobius.models import mimi
    from mobius.tasks import CodecTask

    with _patched(mimi, MIMI_SIZES[size]):
        config = mimi.mimi_default_config()
        module = mimi.MimiModel(config)
        pkg = build_from_module(module, config, CodecTask(), execution_provider="default")
    out = {}
    for role in ("encoder", "decoder"):
        _assign_random_weights(pkg[role], seed, shapes_only)
        out[f"mimi_{role}"] = pkg[role]
    return out


def build_lm(size: str, variant: str, seed: int, layers: int | None = None,
             shapes_only: bool = False) -> dict:
    """Returns {"temporal": ir.Model, "depformer": ir.Model}."""
    import onnx_ir as ir
    from mobius._builder import build_from_module
    from mobius.models import moshi
    from mobius.tasks import MoshiDepformerTask, MoshiTemporalTask

    provider, dtype = VARIANTS[variant]
    temporal, dep = lm_sizes(size, layers)
    ir_dtype = ir.DataType.FLOAT16 if dtype == "f16" else ir.DataType.FLOAT
    out = {}
    # The depformer's `hidden` input is declared with the task's own copy of the temporal dim.
    with (
        _patched(moshi, _lm_overrides(temporal, dep)),
        _patched(MoshiDepformerTask, {"_TEMPORAL_DIM": temporal.dim}),
    ):
        for name, make_config, model_cls, task in (
            ("temporal", moshi.moshi_temporal_config, moshi.MoshiTemporalModel, MoshiTemporalTask),
            (
                "depformer",
                moshi.moshi_depformer_config,
                moshi.MoshiDepformerModel,
                MoshiDepformerTask,
            ),
        ):
            config = dataclasses.replace(make_config(), dtype=ir_dtype)
            module = model_cls(config)
            _cast_parameters(module, ir_dtype)
            pkg = build_from_module(module, config, task(), execution_provider=provider)
            model = pkg["model"]
            _assign_random_weights(model, seed, shapes_only)
            out[name] = model
    return out


def pack_yaml(name: str, size: str, variant: str, mimi_size: str,
              layers: int | None = None) -> str:
    temporal, dep = lm_sizes(size, layers)
    dtype = VARIANTS[variant][1]
    lines = [
        "# Model pack: <pack>/{mimi_encoder,mimi_decoder,temporal,depformer}/model.onnx",
        "# Random weights: for tests and benchmarks, not for speech.",
        f"name: {name}",
        f"variant: {variant}",
        f"dtype: {dtype}",
        f"mimi: {mimi_size}",
        "sample_rate: 24000",
        "frame_size: 1920",
        "codebooks: 8",
        "text_vocab: 32000",
        "audio_vocab: 2048",
        "delays: [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]",
        "initial_tokens:",
        "  text: 32000",
        "  audio: 2048",
        "text_padding: 3",
        "special_text_ids:",
        "  epad: 0",
        "  bos: 1",
        "  eos: 2",
        "  pad: 3",
        "silence_codes: [948, 243, 1178, 546, 1736, 1030, 1978, 2008]",
        "sine_codes: [430, 1268, 381, 1611, 1095, 1495, 56, 472]",
        "context: 3000",
        "max_positions: 8000",
        "temporal:",
        f"  dim: {temporal.dim}",
        f"  layers: {temporal.layers}",
        f"  heads: {temporal.heads}",
        f"  head_dim: {temporal.head_dim}",
        "depformer:",
        f"  dim: {dep.dim}",
        f"  layers: {dep.layers}",
        f"  heads: {dep.heads}",
        f"  head_dim: {dep.head_dim}",
    ]
    return "\n".join(lines) + "\n"


class PackWriter:
    """Writes a pack graph by graph into a sibling temporary folder (`OUT.partial`), then swaps
    it into place with `finish`: a graph can be written, and dropped, as soon as it is built,
    and an export that stops half-way leaves only the `.partial` folder, never a pack."""

    GRAPHS = ("mimi_encoder", "mimi_decoder", "temporal", "depformer")

    def __init__(self, out_dir: str):
        self.out_dir = self.replaceable(out_dir)
        self.tmp = self.out_dir + ".partial"
        shutil.rmtree(self.tmp, ignore_errors=True)
        os.makedirs(self.tmp)
        self.written: list[str] = []

    @staticmethod
    def replaceable(out_dir: str) -> str:
        """`out_dir`, absolute, once it is known to be a pack, an empty folder or nothing (a
        pack is written there in the end: anything else is not replaced)."""
        out_dir = os.path.abspath(out_dir)
        if os.path.exists(out_dir) and not os.path.isdir(out_dir):
            raise SystemExit(f"make_pack: {out_dir} exists and is not a folder: not replacing it")
        if os.path.isdir(out_dir) and os.listdir(out_dir):
            if not os.path.isfile(os.path.join(out_dir, "pack.yaml")):
                raise SystemExit(f"make_pack: {out_dir} exists and is not a pack: not replacing it")
        return out_dir

    def add(self, name: str, model, shapes_only: bool = False) -> None:
        """Writes graph `name` (its weights beside it, in `model.onnx.data`)."""
        import onnx_ir as ir

        unset = [n for n, v in model.graph.initializers.items() if v.const_value is None]
        if unset:
            raise RuntimeError(f"{name}: initializers without weights: {unset[:5]}")
        os.makedirs(os.path.join(self.tmp, name))
        if shapes_only:
            save_shapes_only(model, os.path.join(self.tmp, name))
        else:
            ir.save(model, os.path.join(self.tmp, name, "model.onnx"), external_data="model.onnx.data")
        self.written.append(name)

    def finish(self, manifest: str) -> None:
        """Writes `pack.yaml` and moves the pack into place (replacing an older pack there)."""
        missing = [g for g in self.GRAPHS if g not in self.written]
        if missing:
            raise RuntimeError(f"make_pack: graphs not written: {missing}")
        with open(os.path.join(self.tmp, "pack.yaml"), "w", encoding="utf-8") as f:
            f.write(manifest)
        if os.path.islink(self.out_dir):
            os.remove(self.out_dir)
        else:
            shutil.rmtree(self.out_dir, ignore_errors=True)
        os.rename(self.tmp, self.out_dir)

    def abandon(self) -> None:
        """Removes what was written (an export that failed)."""
        shutil.rmtree(self.tmp, ignore_errors=True)


def save_pack(out_dir: str, graphs: dict, manifest: str, shapes_only: tuple = ()) -> None:
    """Writes the pack into a sibling temporary folder, then swaps it into place."""
    w = PackWriter(out_dir)
    for name in PackWriter.GRAPHS:
        w.add(name, graphs[name], name in shapes_only)
    w.finish(manifest)


# Where a weight starts in `model.onnx.data` (ONNX Runtime maps aligned external data).
ALIGN = 4096


def _is_unwritten(tensor) -> bool:
    """In a graph built with `--shapes-only`: whether a weight is, or is computed from, one
    whose data was not made (every weight of such a graph is; what the exporter's passes
    computed from them is lazy too, and the real tables it precomputes, RoPE's, are not)."""
    import onnx_ir as ir

    return isinstance(tensor, ir.LazyTensor)


def _fill_rule(name: str, shape: tuple) -> str:
    """How tools/fill_weights.py fills a weight: as _random_weight does, at a real scale."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return "zeros"
    if len(shape) == 1:
        return "ones"
    return "normal"


def save_shapes_only(model, folder: str) -> None:
    """Writes `model.onnx` with its unwritten weights declared in `model.onnx.data` (aligned,
    in order) and `weights.json` listing them; real tensors (RoPE tables, constants) stay in
    `model.onnx` itself."""
    import json

    import onnx_ir as ir

    offset, listed = 0, []
    for name, value in model.graph.initializers.items():
        if not _is_unwritten(value.const_value):
            continue
        shape = tuple(int(d) for d in value.shape)
        length = int(value.dtype.itemsize * math.prod(shape))
        offset = (offset + ALIGN - 1) // ALIGN * ALIGN
        value.const_value = ir.ExternalTensor(
            "model.onnx.data", offset=offset, length=length, dtype=value.dtype,
            shape=ir.Shape(shape), name=name, base_dir=folder,
        )
        listed.append({
            "name": name, "dtype": value.dtype.name.lower(), "shape": list(shape),
            "offset": offset, "length": length, "fill": _fill_rule(name, shape),
        })
        offset += length
    proto = ir.serde.serialize_model(model)
    with open(os.path.join(folder, "model.onnx"), "wb") as f:
        f.write(proto.SerializeToString())
    with open(os.path.join(folder, "weights.json"), "w", encoding="utf-8") as f:
        json.dump({"format": 1, "data": "model.onnx.data", "bytes": offset, "align": ALIGN,
                   "weights": listed}, f, indent=None, separators=(",", ":"))
        f.write("\n")


def pack_name(size: str, variant: str, mimi_size: str) -> str:
    name = size if variant == "standard" else f"{size}-{variant}"
    return name if mimi_size == "tiny" else f"{name}-mimi-{mimi_size}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Build a Moshi/PersonaPlex model pack with random deterministic weights."
    )
    parser.add_argument("--size", choices=sorted(TEMPORAL_SIZES), help="default tiny")
    parser.add_argument("--variant", choices=list(VARIANTS), help="default standard")
    parser.add_argument("--mimi", choices=sorted(MIMI_SIZES), help="default tiny")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument(
        "--all-tiny",
        action="store_true",
        help="build the three tiny packs into OUT/" + ", OUT/".join(ALL_TINY),
    )
    parser.add_argument("--out", required=True, help="pack folder (with --all-tiny: its parent)")
    parser.add_argument(
        "--no-step-graphs",
        action="store_true",
        help="leave out Mimi's step graphs (tools/make_mimi_step.py): the pack streams its codec "
        "with the rolling window only",
    )
    import quantize_pack

    quantize_pack.add_arguments(parser)
    parser.add_argument("--layers", type=int,
                        help="fewer layers than the size has (the temporal's; the depformer's "
                             "at most as many)")
    parser.add_argument("--shapes-only", action="store_true",
                        help="the weights declared, not written (weights.json lists them; "
                             "tools/fill_weights.py writes them)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the exporter's log")
    args = parser.parse_args(argv)
    if args.all_tiny and (args.size or args.variant or args.mimi or args.layers):
        parser.error("--all-tiny builds fixed packs: drop --size, --variant, --mimi and --layers")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers {args.layers}: 1 or more")
    if args.shapes_only and "int" in args.quantize + args.quantize_depformer:
        parser.error("--shapes-only writes no weights to quantize: quantize after "
                     "tools/fill_weights.py")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out}: exists and is not a folder")
    args.size = args.size or "tiny"
    args.variant = args.variant or "standard"
    args.mimi = args.mimi or "tiny"

    start = time.monotonic()
    if not args.verbose:
        # Expected for these graphs: the standard temporal graph has no sliding window (see
        # MOSHI.md), and the depformer, built with the decoder role, never gets GQA.
        logging.getLogger("mobius").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", message="GQA fusion expected")
    _import_exporter()

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"make_pack: {msg}", file=sys.stderr)

    if args.all_tiny:
        jobs = [(os.path.join(args.out, name), "tiny", v) for name, v in ALL_TINY.items()]
        mimi_size = "tiny"
    else:
        jobs = [(args.out, args.size, args.variant)]
        mimi_size = args.mimi

    # Mimi does not depend on the variant: build it once, save it into every pack.
    mimi = build_mimi(mimi_size, args.seed, args.shapes_only)
    for out_dir, size, variant in jobs:
        graphs = dict(mimi)
        graphs.update(build_lm(size, variant, args.seed, args.layers, args.shapes_only))
        name = pack_name(size, variant, mimi_size) + (f"-{args.layers}l" if args.layers else "")
        manifest = pack_yaml(name, size, variant, mimi_size, args.layers)
        save_pack(out_dir, graphs, manifest, tuple(graphs) if args.shapes_only else ())
        if not args.no_step_graphs:
            import make_mimi_step

            make_mimi_step.add_step_graphs(out_dir, say=lambda _m: None)
        if "int" in args.quantize + args.quantize_codec + args.quantize_depformer:
            quantize_pack.from_arguments(out_dir, out_dir, args)
        say(f"wrote {out_dir} ({size}, {variant}, mimi {mimi_size}"
            + (")" if args.no_step_graphs else ", with step graphs)"))
    say(f"done in {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
