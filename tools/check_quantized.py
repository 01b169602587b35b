#!/usr/bin/env python3
"""One quantized layer of a pack against numpy: dequantize, then multiply.

    tools/check_quantized.py QUANTIZED_PACK FLOAT_PACK [--graph temporal]

Takes the first `MatMulNBits` node of the quantized pack's graph and, with numpy alone,
unpacks its weights as ONNX Runtime's contrib operator specifies them (B: [N, blocks, bytes per
block], 8-bit values, or two 4-bit values per byte with the low nibble first; one scale per
block; the zero point 2^(bits-1) when the graph gives none), and checks:

- that the node, run alone by ONNX Runtime on random inputs in float arithmetic (accuracy level
  0), gives A @ W (W dequantized by numpy) to float rounding;
- that at the node's own accuracy level 4 (a CPU multiplies in int8) it gives A' @ W, A' being
  A rounded by numpy to 8 bits per block of the node's block size (symmetric, the block's
  largest magnitude at 127): the only other rounding is the input's;
- that W is the float pack's weight rounded to its block's steps (within one step; within half
  a step but for the few clipped at the block's largest magnitude).

Prints one JSON object with the figures; exit 1 when a check fails.
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toolio import need_file, need_folder, refuse  # noqa: E402


def load(pack, graph):
    """The graph `graph` of the pack in folder `pack`, or exit 2 naming what is missing."""
    import onnx

    need_folder(pack, "check_quantized", "a pack")
    path = need_file(os.path.join(pack, graph, "model.onnx"), "check_quantized",
                     f"the pack's {graph} graph")
    try:
        return onnx.load(path)
    except Exception as e:  # a damaged file: onnx raises its parser's own kinds
        refuse("check_quantized", path, f"not an ONNX model: {str(e).splitlines()[0][:200]}")


def dequantize(packed, scales, zero_points, bits, k, n, block_size):
    """W as [K, N] float32 from MatMulNBits' B, scales and zero points."""
    blocks = (k + block_size - 1) // block_size
    packed = packed.reshape(n, blocks, -1)
    if bits == 8:
        q = packed.astype(np.int32)
    elif bits == 4:
        low = (packed & 0x0F).astype(np.int32)
        high = (packed >> 4).astype(np.int32)
        q = np.stack([low, high], axis=-1).reshape(n, blocks, -1)
    else:
        raise SystemExit(f"{bits} bits: not checked here")
    q = q[:, :, :block_size]
    scales = scales.reshape(n, blocks).astype(np.float32)
    if zero_points is None:
        zp = np.full((n, blocks), 1 << (bits - 1), dtype=np.int32)
    elif bits == 8:
        zp = zero_points.reshape(n, blocks).astype(np.int32)
    else:
        zb = zero_points.reshape(n, -1)
        zp = np.stack([zb & 0x0F, zb >> 4], axis=-1).reshape(n, -1)[:, :blocks].astype(np.int32)
    w = (q - zp[:, :, None]).astype(np.float32) * scales[:, :, None]
    return w.reshape(n, blocks * block_size)[:, :k].T.copy()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("quantized")
    p.add_argument("float")
    p.add_argument("--graph", default="temporal")
    a = p.parse_args(argv)

    import onnx
    from onnx import helper, numpy_helper
    import onnxruntime as ort

    qm = load(a.quantized, a.graph)
    fm = load(a.float, a.graph)
    inits = {t.name: t for t in qm.graph.initializer}
    node = next((n for n in qm.graph.node if n.op_type == "MatMulNBits"), None)
    if node is None:
        print(json.dumps({"error": "no MatMulNBits node"}))
        return 1
    attrs = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    bits, k, n, block = attrs.get("bits", 4), attrs["K"], attrs["N"], attrs["block_size"]
    packed = numpy_helper.to_array(inits[node.input[1]])
    scales = numpy_helper.to_array(inits[node.input[2]])
    zps = (
        numpy_helper.to_array(inits[node.input[3]])
        if len(node.input) > 3 and node.input[3]
        else None
    )
    w = dequantize(packed, scales, zps, bits, k, n, block)

    # The float weight this node came from: the float graph's MatMul on the same input.
    fnode = next(
        (f for f in fm.graph.node if f.op_type == "MatMul" and f.input[0] == node.input[0]), None
    )
    finits = {t.name: t for t in fm.graph.initializer}
    if fnode is None or fnode.input[1] not in finits:
        print(json.dumps({"error": f"no float MatMul on {node.input[0]} in {a.float}"}))
        return 1
    w_float = numpy_helper.to_array(finits[fnode.input[1]]).astype(np.float32)

    # The node alone, run by ONNX Runtime.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, k)).astype(np.float32)
    tensors = [inits[name] for name in node.input[1:] if name]
    single = helper.make_node(
        "MatMulNBits",
        ["A"] + list(node.input[1:]),
        ["Y"],
        domain="com.microsoft",
        **attrs,
    )
    graph = helper.make_graph(
        [single],
        "one_layer",
        [helper.make_tensor_value_info("A", onnx.TensorProto.FLOAT, [3, k])],
        [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, [3, n])],
        initializer=tensors,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    model.ir_version = 8
    def run(level):
        node_in_model = model.graph.node[0]
        node_in_model.ClearField("attribute")
        node_in_model.attribute.extend(
            helper.make_attribute(key, value)
            for key, value in {**attrs, "accuracy_level": level}.items()
        )
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run(None, {"A": x})[0]

    rel = lambda y, want: float(np.max(np.abs(y - want)) / (np.max(np.abs(want)) + 1e-12))  # noqa: E731
    # In float arithmetic (accuracy level 0): exactly the dequantized weights times the input.
    err = rel(run(0), x @ w)
    # As the pack runs it: at level 4 a CPU multiplies in int8, the input rounded to 8 bits per
    # block of the node's block size (symmetric, scale = largest magnitude / 127).
    level = int(attrs.get("accuracy_level", 0))
    xq = x.copy()
    if level == 4:
        for b in range(0, k, block):
            part = x[:, b:b + block]
            scale = np.max(np.abs(part), axis=1, keepdims=True) / 127.0
            xq[:, b:b + block] = np.round(part / np.where(scale == 0, 1, scale)) * scale
    err_level = rel(run(level), xq @ w)
    err_level_float = rel(run(level), x @ w)

    # Against the float weight: rounded to the nearest step of its block (a weight at the
    # block's largest magnitude may be clipped to the last level: within one step).
    blocks = (k + block - 1) // block
    # (A block's scale takes the sign of its weight of largest magnitude: its size is the step.)
    step = np.abs(np.repeat(scales.reshape(n, blocks).astype(np.float32), block, axis=1)[:, :k].T)
    off = np.abs(w - w_float)
    excess = float(np.max(off - step - 1e-6))
    beyond_half = float(np.mean(off > 0.5 * step + 1e-6))
    report = {
        "node": node.name,
        "bits": int(bits),
        "block_size": int(block),
        "K": int(k),
        "N": int(n),
        "ort_vs_numpy_relative_error": err,
        "accuracy_level": level,
        "ort_at_level_vs_numpy_relative_error": err_level,
        "ort_at_level_vs_float_input_relative_error": err_level_float,
        "weight_error_beyond_one_step": excess,
        "weights_beyond_half_a_step": beyond_half,
        "weight_relative_rms_error": float(
            np.sqrt(np.mean((w - w_float) ** 2) / np.mean(w_float**2))
        ),
    }
    print(json.dumps(report))
    return 0 if err < 1e-4 and err_level < 1e-4 and excess <= 0 else 1


if __name__ == "__main__":
    sys.exit(main())
