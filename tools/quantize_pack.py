#!/usr/bin/env python3
"""Weight-only quantization of a model pack, with ONNX Runtime's own quantizer.

    tools/quantize_pack.py SRC DST [--quantize int8|int4] [--quantize-depformer int4]
                           [--quantize-codec int8] [--block-size 32] [--codec-block-size 64]
                           [--accuracy-level 4]

Writes pack DST: SRC's graphs, with weights rewritten by
`onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer` (symmetric, one scale per
block of weights, round to nearest); nothing is packed by hand. Activations stay in the pack's
dtype.

* `--quantize int8|int4` (the LM): every MatMul of the temporal transformer whose weight is an
  initializer becomes `MatMulNBits` (8 or 4 bits, one scale per `--block-size` input rows). With
  int4, its embedding tables become `GatherBlockQuantized` too (ONNX Runtime quantizes a
  `Gather` in 4 bits only; `--float-embeddings` keeps them float), which is what brings the
  pack's size down, since a Moshi LM's 17 embedding tables and its text head are a large share
  of its weights. The depformer stays float.
* `--quantize-depformer int4` (opt-in): the depformer's weights are chosen per codebook by a
  `Gather` before each MatMul, a form `MatMulNBits` does not take; this rewrites those Gathers
  of its layers' weights as `GatherBlockQuantized` (4 bits, `--block-size`), so that a
  substep dequantizes its codebook's matrices as it takes them. It saves memory (the 7B's
  depformer is 2.8 GB in fp16), not time: on a CPU the `small` pack's depformer frame took 4
  times as long. Its embedding tables and output heads stay float (quantized too, the frame
  took 21 times as long).
* `--quantize-codec int8` (Mimi's stateful step graphs, `mimi_{encoder,decoder}_step`): their
  weights are first folded into the `[K, N]` constants a MatMul reads (the step graphs reshape
  and transpose the exporter's weights as they go; the folding is exact), then every MatMul
  becomes `MatMulNBits`, 8 bits, one scale per `--codec-block-size` rows: the transformer's
  linears and the convolutions that run as one GEMM per call. The encoder's RVQ distances stay
  float (a nearest-code search on rounded codebooks picks other codes), and so do the
  convolutions with many output frames per call (bound by compute, not by reading weights),
  the offline graphs and the fp16 step graphs.

`--accuracy-level` is the `MatMulNBits` attribute of that name: 4 (the default) lets ONNX
Runtime's CPU kernels multiply in int8 (the activations are quantized per block on the fly),
which is what makes a quantized graph fast on a CPU (8-bit weights at level 0 measured 17
times slower than float on the small pack, level 4 3.4 times faster); 0 keeps the activations
in float. CUDA ignores it.

DST's `pack.yaml` is SRC's with a `quantization:` section saying what was done, which
`Pack::open` checks against the graphs' nodes, and a name that says it (`-int4`, `-codec8`):

    quantization:
      temporal: {bits: 4, block_size: 32, scheme: symmetric, matmuls: 9, gathers: 17, accuracy_level: 4}
      mimi_decoder_step: {bits: 8, block_size: 64, scheme: symmetric, matmuls: 55, accuracy_level: 4}

`tools/export_pack.py` and `tools/make_pack.py` take the same `--quantize` and
`--quantize-codec` and call `quantize_pack`.
"""

import argparse
import logging
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toolio import read_yaml, stop  # noqa: E402

BITS = {"int8": 8, "int4": 4}
CODEC_GRAPHS = ("mimi_encoder_step", "mimi_decoder_step")


def _save(model, dst: str) -> None:
    import onnx

    os.makedirs(os.path.dirname(dst), exist_ok=True)
    onnx.save_model(
        model,
        dst,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="model.onnx.data",
        size_threshold=1024,
    )
    # (readable by whoever runs the pack, as the graphs it was made from)
    for f in ("model.onnx", "model.onnx.data"):
        os.chmod(os.path.join(os.path.dirname(dst), f), 0o644)


def _quantize(model, bits: int, block_size: int, accuracy_level: int, gathers: bool,
              exclude=()):
    """Runs ONNX Runtime's quantizer on `model` (a ModelProto); returns the new ModelProto."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    for name in ("onnxruntime.quantization.matmul_nbits_quantizer", "onnxscript", "onnx_ir"):
        logging.getLogger(name).setLevel(logging.WARNING)
    config = DefaultWeightOnlyQuantConfig(
        block_size=block_size,
        is_symmetric=True,
        bits=bits,
        accuracy_level=accuracy_level,
        op_types_to_quantize=("MatMul", "Gather") if gathers else ("MatMul",),
        # A Gather's table is quantized along its last axis (the embedding width).
        quant_axes=(("MatMul", 0), ("Gather", -1)),
    )
    q = MatMulNBitsQuantizer(model, algo_config=config, nodes_to_exclude=list(exclude))
    q.process()
    return q.model.model


def _count(model) -> dict:
    ops = [n.op_type for n in model.graph.node]
    return {"matmuls": ops.count("MatMulNBits"), "gathers": ops.count("GatherBlockQuantized")}


def quantize_graph(src: str, dst: str, bits: int, block_size: int, accuracy_level: int = 4,
                   gathers: bool = False) -> dict:
    """Quantizes the MatMuls (and, with `gathers`, the embedding Gathers) with initializer
    weights of `src` (a model.onnx) into `dst`; returns how many of each it rewrote."""
    import onnx

    out = _quantize(onnx.load(src), bits, block_size, accuracy_level, gathers)
    _save(out, dst)
    return _count(out)


def quantize_depformer_graph(src: str, dst: str, block_size: int) -> dict:
    """The depformer's per-codebook layer weights (the Gathers under `layers.`) in 4 bits."""
    import onnx

    model = onnx.load(src)
    exclude = [
        n.name for n in model.graph.node
        if n.op_type == "MatMul" or (n.op_type == "Gather" and "layers." not in n.name)
    ]
    out = _quantize(model, 4, block_size, 0, True, exclude)
    _save(out, dst)
    return _count(out)


def quantize_codec_graph(src: str, dst: str, block_size: int, accuracy_level: int = 4) -> dict:
    """A Mimi step graph with its MatMul weights folded into constants and quantized to 8 bits,
    all but the encoder's RVQ distances."""
    import onnx_ir as ir
    from onnxscript.optimizer import fold_constants

    model = ir.load(src)
    # In memory first: folding makes new tensors from the weights, and the graph is rewritten.
    model = ir.external_data.load_to_model(model)
    # The exporter's weights reach the MatMuls through Reshape and Transpose: fold them
    # (exact), whatever their size, so that the quantizer sees constant [K, N] weights.
    fold_constants(model, input_size_limit=1 << 40, output_size_limit=1 << 40)
    ir.passes.common.RemoveUnusedNodesPass()(model)
    exclude = [
        n.name for n in model.graph.all_nodes()
        if n.op_type == "MatMul" and "/quantizer/" in (n.name or "") and "/vq/" in (n.name or "")
    ]
    out = _quantize(ir.to_proto(model), 8, block_size, accuracy_level, False, exclude)
    _save(out, dst)
    return _count(out)


def record_line(graph: str, r: dict) -> str:
    extra = f", gathers: {r['gathers']}" if r.get("gathers") else ""
    level = f", accuracy_level: {r['accuracy_level']}" if r["matmuls"] else ""
    return (
        f"  {graph}: {{bits: {r['bits']}, block_size: {r['block_size']}, scheme: symmetric, "
        f"matmuls: {r['matmuls']}{extra}{level}}}"
    )


def manifest_with(text: str, records: dict, suffix: str) -> str:
    """`pack.yaml`'s text with its `quantization:` section (replaced if there was one) and its
    name ending in `suffix`."""
    kept = []
    skipping = False
    for line in text.splitlines():
        if line.startswith("name:") and suffix:
            # The name for logs says it: `tiny-gqa` -> `tiny-gqa-int8` (quoted or not).
            value = line[len("name:"):].strip()
            quote = value[:1] if value[:1] in ("'", '"') else ""
            value = value.strip("'\"")
            line = f"name: {quote}{value}{suffix}{quote}"
        if line.startswith("quantization:"):
            skipping = True
            continue
        if skipping and (line.startswith(" ") or not line.strip()):
            continue
        skipping = False
        kept.append(line)
    kept.append("# Weight-only quantization (tools/quantize_pack.py): per graph, the bits of its")
    kept.append("# weights, the rows per scale, how many MatMuls (MatMulNBits) and embedding")
    kept.append("# tables (GatherBlockQuantized) were rewritten, and the MatMuls' accuracy_level.")
    kept.append("quantization:")
    for graph, r in records.items():
        kept.append(record_line(graph, r))
    return "\n".join(kept) + "\n"


def quantize_pack(src: str, dst: str, quantize: str | None = None, block_size: int = 32,
                  quantize_codec: str | None = None, codec_block_size: int = 64,
                  accuracy_level: int = 4, float_embeddings: bool = False,
                  quantize_depformer: str | None = None) -> dict:
    """Writes the quantized copy of pack `src` to `dst` (through a sibling temporary folder;
    `dst` may be `src`); returns what was quantized, per graph."""
    quantize = None if quantize in (None, "none") else quantize
    quantize_codec = None if quantize_codec in (None, "none") else quantize_codec
    quantize_depformer = None if quantize_depformer in (None, "none") else quantize_depformer
    if quantize_depformer not in (None, "int4"):
        stop(f"quantize_pack: --quantize-depformer {quantize_depformer}: expected int4")
    if quantize is not None and quantize not in BITS:
        stop(f"quantize_pack: --quantize {quantize}: expected one of int8, int4")
    if quantize_codec not in (None, "int8"):
        stop(f"quantize_pack: --quantize-codec {quantize_codec}: expected int8")
    if quantize is None and quantize_codec is None and quantize_depformer is None:
        stop("quantize_pack: nothing to do: give --quantize, --quantize-depformer "
             "or --quantize-codec")
    for flag, b in (("--block-size", block_size), ("--codec-block-size", codec_block_size)):
        if b < 16 or b & (b - 1):
            stop(f"quantize_pack: {flag} {b}: a power of two, 16 or more")
    if accuracy_level not in (0, 1, 2, 3, 4):
        stop(f"quantize_pack: --accuracy-level {accuracy_level}: 0 to 4")
    src, dst = os.path.abspath(src), os.path.abspath(dst)
    manifest = os.path.join(src, "pack.yaml")
    if not os.path.isfile(manifest):
        stop(f"quantize_pack: {src}: not a pack (no pack.yaml)")
    # (read as YAML first: a manifest that is not is named here, not copied into DST)
    read_yaml(manifest, "quantize_pack")
    with open(manifest, encoding="utf-8") as f:
        text = f.read()
    if "\nquantization:" in "\n" + text:
        stop(f"quantize_pack: {manifest}: this pack is quantized already")
    if quantize_codec and not all(os.path.isdir(os.path.join(src, g)) for g in CODEC_GRAPHS):
        stop(
            f"quantize_pack: {src}: --quantize-codec needs Mimi's step graphs "
            f"({', '.join(CODEC_GRAPHS)}); add them with tools/make_mimi_step.py {src}"
        )
    if os.path.exists(dst) and not os.path.isdir(dst):
        stop(f"quantize_pack: {dst} exists and is not a folder: not replacing it")
    if os.path.isdir(dst) and os.listdir(dst) and not os.path.isfile(os.path.join(dst, "pack.yaml")):
        stop(f"quantize_pack: {dst} exists and is not a pack: not replacing it")
    tmp = dst + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    records = {}
    for entry in sorted(os.listdir(src)):
        path = os.path.join(src, entry)
        graph = os.path.join(path, "model.onnx")
        if entry == "pack.yaml":
            continue
        if entry == "temporal" and quantize:
            bits = BITS[quantize]
            n = quantize_graph(graph, os.path.join(tmp, entry, "model.onnx"), bits, block_size,
                               accuracy_level, gathers=bits == 4 and not float_embeddings)
            if n["matmuls"] == 0:
                raise SystemExit(f"quantize_pack: {path}: no MatMul with its weights to quantize")
            records[entry] = {"bits": bits, "block_size": block_size,
                              "accuracy_level": accuracy_level, **n}
        elif entry == "depformer" and quantize_depformer:
            n = quantize_depformer_graph(graph, os.path.join(tmp, entry, "model.onnx"), block_size)
            if n["gathers"] == 0:
                raise SystemExit(f"quantize_pack: {path}: no per-codebook weights to quantize")
            records[entry] = {"bits": 4, "block_size": block_size, "accuracy_level": 0, **n}
        elif entry in CODEC_GRAPHS and quantize_codec:
            n = quantize_codec_graph(graph, os.path.join(tmp, entry, "model.onnx"),
                                     codec_block_size, accuracy_level)
            if n["matmuls"] == 0:
                raise SystemExit(f"quantize_pack: {path}: no MatMul with its weights to quantize")
            shutil.copy2(os.path.join(path, "state.json"), os.path.join(tmp, entry, "state.json"))
            records[entry] = {"bits": 8, "block_size": codec_block_size,
                              "accuracy_level": accuracy_level, **n}
        elif os.path.isdir(path):
            shutil.copytree(path, os.path.join(tmp, entry))
        else:
            shutil.copy2(path, os.path.join(tmp, entry))
    suffix = ((f"-{quantize}" if quantize else "") + ("-dep4" if quantize_depformer else "")
              + ("-codec8" if quantize_codec else ""))
    with open(os.path.join(tmp, "pack.yaml"), "w", encoding="utf-8") as f:
        f.write(manifest_with(text, records, suffix))
    shutil.rmtree(dst, ignore_errors=True)
    os.rename(tmp, dst)
    return records


def describe(graph: str, r: dict) -> str:
    """One line for a person: what was done to `graph`."""
    parts = [f"{r['matmuls']} MatMuls"] if r["matmuls"] else []
    parts += [f"{r['gathers']} gathered weights"] if r.get("gathers") else []
    level = f", accuracy level {r['accuracy_level']}" if r["matmuls"] else ""
    return (f"{graph}: {' and '.join(parts)} in {r['bits']} bits, blocks of "
            f"{r['block_size']}{level}")


def add_arguments(p: argparse.ArgumentParser, required: bool = False) -> None:
    """The quantization options, shared with tools/make_pack.py and tools/export_pack.py."""
    p.add_argument("--quantize", choices=["none", *sorted(BITS)], default="none",
                   help="the LM's weights: the temporal transformer's MatMuls, and with int4 "
                        "its embedding tables (default none)")
    p.add_argument("--quantize-depformer", choices=["none", "int4"], default="none",
                   help="the depformer's per-codebook layer weights, for memory, not speed "
                        "(default none)")
    p.add_argument("--quantize-codec", choices=["none", "int8"], default="none",
                   help="Mimi's step graphs' MatMul weights (default none)")
    p.add_argument("--block-size", type=int, default=32,
                   help="with --quantize: weight rows per scale (default 32)")
    p.add_argument("--codec-block-size", type=int, default=64,
                   help="with --quantize-codec: weight rows per scale (default 64)")
    p.add_argument("--accuracy-level", type=int, default=4,
                   help="MatMulNBits accuracy_level: 4 multiplies in int8 on a CPU, 0 in float "
                        "(default 4; CUDA ignores it)")
    p.add_argument("--float-embeddings", action="store_true",
                   help="with --quantize int4: keep the embedding tables float")


def from_arguments(src: str, dst: str, a) -> dict:
    return quantize_pack(src, dst, a.quantize, a.block_size, a.quantize_codec,
                         a.codec_block_size, a.accuracy_level, a.float_embeddings,
                         a.quantize_depformer)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="the float pack")
    p.add_argument("dst", help="the quantized pack to write")
    add_arguments(p)
    p.add_argument("-q", "--quiet", action="store_true")
    a = p.parse_args(argv)
    records = from_arguments(a.src, a.dst, a)
    if not a.quiet:
        for graph, r in records.items():
            print(describe(graph, r))
        print(f"wrote {a.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
