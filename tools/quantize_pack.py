#!/usr/bin/env python3
"""Weight-only quantization of a model pack, with ONNX Runtime's own quantizer.

    tools/quantize_pack.py SRC DST [--quantize int8|int4] [--quantize-depformer int4]
                           [--quantize-codec int8] [--block-size 32] [--codec-block-size 64]
                           [--accuracy-level 4]

Writes pack DST: SRC's graphs, with weights rewritten by
`onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer` (symmetric, one scale per
block of weights, round to nearest); nothing is packed by hand. Activations stay in the pack's
dtype. The quantizer runs on one weight at a time (a model of that node alone, its weight read
from the graph's mapped file), and the graph is written as it streams: what is held is the
quantized weights and one float weight, not the graph (a 7B's temporal is 13 GiB in fp16;
quantizing it whole held the float weights and their copies). A line every 10 s says how far
each graph is.

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
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toolio import need_graph, read_yaml, stop, writable  # noqa: E402

BITS = {"int8": 8, "int4": 4}
CODEC_GRAPHS = ("mimi_encoder_step", "mimi_decoder_step")


def _config(bits: int, block_size: int, accuracy_level: int, gathers: bool):
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig

    return DefaultWeightOnlyQuantConfig(
        block_size=block_size,
        is_symmetric=True,
        bits=bits,
        accuracy_level=accuracy_level,
        op_types_to_quantize=("MatMul", "Gather") if gathers else ("MatMul",),
        # A Gather's table is quantized along its last axis (the embedding width).
        quant_axes=(("MatMul", 0), ("Gather", -1)),
    )


def _weight(node):
    """The initializer `node` would have quantized (a MatMul's B, a Gather's table), or None."""
    value = node.inputs[1] if node.op_type == "MatMul" else node.inputs[0]
    return value if value is not None and value.const_value is not None else None


def _quantize_node(node, weight, model, config):
    """ONNX Runtime's quantizer on a model of `node` alone, its weight read from the big graph
    (mapped, not held); returns the result's ModelProto. One weight at a time: the 7B's
    temporal graph is 13 GiB in fp16, and a protobuf message keeps every byte it ever held
    until it is dropped whole."""
    import onnx
    import onnx_ir as ir
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    elem = weight.const_value.dtype.value
    inputs = [onnx.helper.make_tensor_value_info(v.name, elem, None)
              for v in node.inputs if v is not None and v is not weight]
    outputs = [onnx.helper.make_tensor_value_info(v.name, elem, None) for v in node.outputs]
    w = weight.const_value
    data = ir.Tensor(w.numpy(), dtype=w.dtype, name=weight.name)  # read from the mapping
    graph = onnx.helper.make_graph([ir.serde.serialize_node(node)], "one", inputs, outputs,
                                   [ir.serde.serialize_tensor(data)])
    proto = onnx.helper.make_model(
        graph, ir_version=model.ir_version,
        opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()])
    q = MatMulNBitsQuantizer(proto, algo_config=config)
    q.process()
    return q.model.model


def _splice(graph, node, result, model) -> None:
    """Puts `result`'s nodes and initializers (a quantized `node`) in `node`'s place."""
    import onnx
    import onnx_ir as ir

    values = {v.name: v for v in node.inputs if v is not None}
    for t in result.graph.initializer:
        if t.name in graph.initializers:
            raise SystemExit(f"quantize_pack: {t.name}: a weight used by more than one node")
        own = onnx.TensorProto()
        own.CopyFrom(t)  # a message of its own: the small model's is dropped with its weight
        v = ir.Value(name=t.name, const_value=ir.serde.deserialize_tensor(own))
        graph.register_initializer(v)
        values[t.name] = v
    new = []
    for p in result.graph.node:
        n = ir.Node(p.domain, p.op_type, [values[i] if i else None for i in p.input],
                    [ir.serde.deserialize_attribute(a) for a in p.attribute],
                    num_outputs=len(p.output), name=p.name or None)
        for out, name in zip(n.outputs, p.output):
            out.name = name
            values[name] = out
        new.append(n)
    old = list(node.outputs)
    ir.convenience.replace_nodes_and_values(
        node.graph, node, [node], new, old, [values[v.name] for v in old])
    for o in result.opset_import:
        if model.opset_imports.get(o.domain, 0) < o.version:
            model.opset_imports[o.domain] = o.version
    model.ir_version = max(model.ir_version, result.ir_version)


def quantize_model(model, bits: int, block_size: int, accuracy_level: int, gathers: bool,
                   exclude=(), progress=None) -> dict:
    """Quantizes `model` (an onnx_ir Model, its weights mapped from their files) in place,
    node by node, with ONNX Runtime's `MatMulNBitsQuantizer`: each MatMul (and, with
    `gathers`, each Gather) whose weight is an initializer and whose name is not in `exclude`.
    Holds the quantized weights and one float weight at a time, not the graph's float weights.
    `progress(done, total, bytes)` is called after each node. Returns how many of each it
    rewrote."""
    for name in ("onnxruntime.quantization.matmul_nbits_quantizer", "onnxscript", "onnx_ir"):
        logging.getLogger(name).setLevel(logging.WARNING)
    config = _config(bits, block_size, accuracy_level, gathers)
    ops = ("MatMul", "Gather") if gathers else ("MatMul",)
    targets = [(n, w) for n in model.graph.all_nodes()
               if n.op_type in ops and n.name not in exclude and (w := _weight(n)) is not None]
    done_bytes = 0
    for i, (node, weight) in enumerate(targets):
        result = _quantize_node(node, weight, model, config)
        graph = weight.graph or model.graph
        _splice(graph, node, result, model)
        del result
        done_bytes += weight.const_value.nbytes
        if not weight.uses() and weight.name in graph.initializers:
            graph.initializers.pop(weight.name)
        if progress:
            progress(i + 1, len(targets), done_bytes)
    return _count(model)


def _count(model) -> dict:
    ops = [n.op_type for n in model.graph.all_nodes()]
    return {"matmuls": ops.count("MatMulNBits"), "gathers": ops.count("GatherBlockQuantized")}


def _save(model, dst: str) -> None:
    import onnx_ir as ir

    os.makedirs(os.path.dirname(dst), exist_ok=True)
    # Streams the weights to the file (the unchanged ones read from the source's mapping).
    ir.save(model, dst, external_data="model.onnx.data", size_threshold_bytes=1024)
    # (readable by whoever runs the pack, as the graphs it was made from)
    for f in ("model.onnx", "model.onnx.data"):
        os.chmod(os.path.join(os.path.dirname(dst), f), 0o644)


def quantize_graph(src: str, dst: str, bits: int, block_size: int, accuracy_level: int = 4,
                   gathers: bool = False, progress=None) -> dict:
    """Quantizes the MatMuls (and, with `gathers`, the embedding Gathers) with initializer
    weights of `src` (a model.onnx) into `dst`; returns how many of each it rewrote."""
    import onnx_ir as ir

    model = ir.load(src)
    n = quantize_model(model, bits, block_size, accuracy_level, gathers, progress=progress)
    _save(model, dst)
    return n


def quantize_depformer_graph(src: str, dst: str, block_size: int, progress=None) -> dict:
    """The depformer's per-codebook layer weights (the Gathers under `layers.`) in 4 bits."""
    import onnx_ir as ir

    model = ir.load(src)
    exclude = {
        n.name for n in model.graph.all_nodes()
        if n.op_type == "MatMul" or (n.op_type == "Gather" and "layers." not in (n.name or ""))
    }
    n = quantize_model(model, 4, block_size, 0, True, exclude, progress)
    _save(model, dst)
    return n


def quantize_codec_graph(src: str, dst: str, block_size: int, accuracy_level: int = 4,
                         progress=None) -> dict:
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
    exclude = {
        n.name for n in model.graph.all_nodes()
        if n.op_type == "MatMul" and "/quantizer/" in (n.name or "") and "/vq/" in (n.name or "")
    }
    n = quantize_model(model, 8, block_size, accuracy_level, False, exclude, progress)
    _save(model, dst)
    return n


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
                  quantize_depformer: str | None = None, say=None, consume: bool = False) -> dict:
    """Writes the quantized copy of pack `src` to `dst` (through a sibling temporary folder;
    `dst` may be `src`); returns what was quantized, per graph. `say(line)`, if given, hears
    how each graph's quantization goes (a line every 10 s or so, and one when it is done).
    With `consume` (`src` is to be removed after), the graphs left as they were are moved, not
    copied: a 7B's 13 GiB temporal graph is not written twice to quantize its codec."""
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
    writable(dst, "quantize_pack")
    # Every graph to be quantized reads whole before any is.
    for entry in sorted(os.listdir(src)):
        if ((entry == "temporal" and quantize) or (entry == "depformer" and quantize_depformer)
                or (entry in CODEC_GRAPHS and quantize_codec)):
            need_graph(os.path.join(src, entry, "model.onnx"), "quantize_pack")
    if os.path.isdir(dst) and os.listdir(dst) and not os.path.isfile(os.path.join(dst, "pack.yaml")):
        stop(f"quantize_pack: {dst} exists and is not a pack: not replacing it")
    tmp = dst + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    records = {}

    def progress(graph: str):
        if say is None:
            return None
        t0 = time.monotonic()
        last = [t0]

        def tell(done: int, total: int, nbytes: int) -> None:
            now = time.monotonic()
            if now - last[0] >= 10 or done == total:
                last[0] = now
                say(f"  {graph}: {done}/{total} weights quantized ({nbytes / 2**30:.2f} GiB read), "
                    f"{now - t0:.0f} s")
        return tell

    try:
        for entry in sorted(os.listdir(src)):
            path = os.path.join(src, entry)
            graph = os.path.join(path, "model.onnx")
            if entry == "pack.yaml":
                continue
            if entry == "temporal" and quantize:
                bits = BITS[quantize]
                n = quantize_graph(graph, os.path.join(tmp, entry, "model.onnx"), bits, block_size,
                                   accuracy_level, gathers=bits == 4 and not float_embeddings,
                                   progress=progress(entry))
                if n["matmuls"] == 0:
                    raise SystemExit(f"quantize_pack: {path}: no MatMul with its weights to quantize")
                records[entry] = {"bits": bits, "block_size": block_size,
                                  "accuracy_level": accuracy_level, **n}
            elif entry == "depformer" and quantize_depformer:
                n = quantize_depformer_graph(graph, os.path.join(tmp, entry, "model.onnx"), block_size,
                                             progress(entry))
                if n["gathers"] == 0:
                    raise SystemExit(f"quantize_pack: {path}: no per-codebook weights to quantize")
                records[entry] = {"bits": 4, "block_size": block_size, "accuracy_level": 0, **n}
            elif entry in CODEC_GRAPHS and quantize_codec:
                n = quantize_codec_graph(graph, os.path.join(tmp, entry, "model.onnx"),
                                         codec_block_size, accuracy_level, progress(entry))
                if n["matmuls"] == 0:
                    raise SystemExit(f"quantize_pack: {path}: no MatMul with its weights to quantize")
                shutil.copy2(os.path.join(path, "state.json"), os.path.join(tmp, entry, "state.json"))
                records[entry] = {"bits": 8, "block_size": codec_block_size,
                                  "accuracy_level": accuracy_level, **n}
            elif consume:
                os.rename(path, os.path.join(tmp, entry))
            elif os.path.isdir(path):
                shutil.copytree(path, os.path.join(tmp, entry))
            else:
                shutil.copy2(path, os.path.join(tmp, entry))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # (an interrupted run leaves no half pack)
        raise
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


def from_arguments(src: str, dst: str, a, say=None, consume: bool = False) -> dict:
    return quantize_pack(src, dst, a.quantize, a.block_size, a.quantize_codec,
                         a.codec_block_size, a.accuracy_level, a.float_embeddings,
                         a.quantize_depformer, say, consume)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="the float pack")
    p.add_argument("dst", help="the quantized pack to write")
    add_arguments(p)
    p.add_argument("-q", "--quiet", action="store_true")
    a = p.parse_args(argv)
    records = from_arguments(
        a.src, a.dst, a, None if a.quiet else lambda m: print(f"quantize_pack: {m}", file=sys.stderr, flush=True))
    if not a.quiet:
        for graph, r in records.items():
            print(describe(graph, r))
        print(f"wrote {a.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
