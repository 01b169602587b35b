#!/usr/bin/env python3
"""Weight-only quantization of a model pack, with ONNX Runtime's own quantizer.

    tools/quantize_pack.py SRC DST --quantize int8|int4 [--block-size 32]

Writes pack DST: SRC's graphs, with every MatMul of the temporal transformer whose weight is an
initializer rewritten as `MatMulNBits` (ONNX Runtime's contrib operator: weights in 8 or 4 bits,
one fp32 scale per block of `--block-size` input rows, symmetric, round to nearest), by
`onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`; nothing is packed by
hand. Activations stay in the pack's dtype. DST's `pack.yaml` is SRC's with a `quantization:`
section saying what was quantized and how, which `Pack::open` checks against the graphs:

    quantization:
      temporal: {bits: 8, block_size: 32, scheme: symmetric, matmuls: 9}

The depformer is left as it is: its weights are chosen per codebook by a `Gather` before each
MatMul, a form MatMulNBits does not take. The codec is left as it is too.

`tools/export_pack.py --quantize` and `tools/make_pack.py --quantize` call `quantize_pack`.
"""

import argparse
import os
import shutil
import sys

QUANTIZED_GRAPHS = ("temporal",)
BITS = {"int8": 8, "int4": 4}


def quantize_graph(src: str, dst: str, bits: int, block_size: int) -> int:
    """Quantizes the MatMuls with initializer weights of `src` (a model.onnx) into `dst`;
    returns how many it rewrote."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    import logging

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    model = onnx.load(src)
    config = DefaultWeightOnlyQuantConfig(
        block_size=block_size,
        is_symmetric=True,
        bits=bits,
        op_types_to_quantize=("MatMul",),
    )
    q = MatMulNBitsQuantizer(model, algo_config=config)
    q.process()
    out = q.model.model
    n = sum(1 for node in out.graph.node if node.op_type == "MatMulNBits")
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    onnx.save_model(
        out,
        dst,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="model.onnx.data",
        size_threshold=1024,
    )
    # (readable by whoever runs the pack, as the graphs it was made from)
    for f in ("model.onnx", "model.onnx.data"):
        os.chmod(os.path.join(os.path.dirname(dst), f), 0o644)
    return n


def manifest_with(text: str, records: dict) -> str:
    """`pack.yaml`'s text with its `quantization:` section (replaced if there was one)."""
    kept = []
    skipping = False
    bits = {r["bits"] for r in records.values()}
    for line in text.splitlines():
        if line.startswith("name:") and len(bits) == 1:
            # The name for logs says it: `tiny-gqa` -> `tiny-gqa-int8` (quoted or not).
            value = line[len("name:"):].strip()
            quote = value[:1] if value[:1] in ("'", '"') else ""
            value = value.strip("'\"")
            line = f"name: {quote}{value}-int{bits.pop()}{quote}"
        if line.startswith("quantization:"):
            skipping = True
            continue
        if skipping and (line.startswith(" ") or not line.strip()):
            continue
        skipping = False
        kept.append(line)
    kept.append("# Weight-only quantization (tools/quantize_pack.py): per graph, the bits of its")
    kept.append("# MatMulNBits weights, the rows per scale, and how many MatMuls were rewritten.")
    kept.append("quantization:")
    for graph, r in records.items():
        kept.append(
            f"  {graph}: {{bits: {r['bits']}, block_size: {r['block_size']}, "
            f"scheme: symmetric, matmuls: {r['matmuls']}}}"
        )
    return "\n".join(kept) + "\n"


def quantize_pack(src: str, dst: str, quantize: str, block_size: int = 32) -> dict:
    """Writes the quantized copy of pack `src` to `dst` (through a sibling temporary folder);
    returns what was quantized, per graph."""
    if quantize not in BITS:
        raise SystemExit(f"quantize_pack: --quantize {quantize}: expected one of int8, int4")
    if block_size < 16 or block_size & (block_size - 1):
        raise SystemExit(f"quantize_pack: --block-size {block_size}: a power of two, 16 or more")
    src, dst = os.path.abspath(src), os.path.abspath(dst)
    manifest = os.path.join(src, "pack.yaml")
    if not os.path.isfile(manifest):
        raise SystemExit(f"quantize_pack: {src}: not a pack (no pack.yaml)")
    with open(manifest, encoding="utf-8") as f:
        text = f.read()
    if "\nquantization:" in "\n" + text:
        raise SystemExit(f"quantize_pack: {manifest}: this pack is quantized already")
    if os.path.isdir(dst) and os.listdir(dst) and not os.path.isfile(os.path.join(dst, "pack.yaml")):
        raise SystemExit(f"quantize_pack: {dst} exists and is not a pack: not replacing it")
    tmp = dst + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    records = {}
    for entry in sorted(os.listdir(src)):
        path = os.path.join(src, entry)
        if entry == "pack.yaml":
            continue
        if entry in QUANTIZED_GRAPHS:
            n = quantize_graph(
                os.path.join(path, "model.onnx"),
                os.path.join(tmp, entry, "model.onnx"),
                BITS[quantize],
                block_size,
            )
            if n == 0:
                raise SystemExit(f"quantize_pack: {path}: no MatMul with its weights to quantize")
            records[entry] = {"bits": BITS[quantize], "block_size": block_size, "matmuls": n}
        elif os.path.isdir(path):
            shutil.copytree(path, os.path.join(tmp, entry))
        else:
            shutil.copy2(path, os.path.join(tmp, entry))
    with open(os.path.join(tmp, "pack.yaml"), "w", encoding="utf-8") as f:
        f.write(manifest_with(text, records))
    shutil.rmtree(dst, ignore_errors=True)
    os.rename(tmp, dst)
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="the float pack")
    p.add_argument("dst", help="the quantized pack to write")
    p.add_argument("--quantize", required=True, choices=sorted(BITS))
    p.add_argument("--block-size", type=int, default=32, help="rows per scale (default 32)")
    p.add_argument("-q", "--quiet", action="store_true")
    a = p.parse_args(argv)
    records = quantize_pack(a.src, a.dst, a.quantize, a.block_size)
    if not a.quiet:
        for graph, r in records.items():
            print(f"{graph}: {r['matmuls']} MatMuls in {r['bits']} bits, blocks of {r['block_size']}")
        print(f"wrote {a.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
