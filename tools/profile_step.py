#!/usr/bin/env python3
"""Where a Mimi step graph's time goes: ONNX Runtime's own profiler, per operator type.

    tools/profile_step.py PACK [--role encoder|decoder|both] [--batch 1,8] [--dtype f32|f16]
                          [--calls 20] [--threads 1] [--nodes 0]

Runs `PACK/mimi_{role}_step{,_f16}` on the CPU as the shared codec does: every row active, the
K/V rings bound in place as both input and output (so `TensorScatter` writes over them, as in
duplex), the other states ping-ponged between two buffers, one intra-op thread. After a few
warm-up calls it profiles `--calls` calls of B rows and prints, per operator type, the time per
call and per row (types under 0.1 ms a call at every B summed on one line), then the whole
call's wall time; `--nodes N` also lists the N slowest nodes with their shapes. An operator type whose time per row stays flat as B grows is one that
batching amortizes (a weight read once per call); one whose time grows with B is work each row
costs on its own.

The figures are this machine's; the script knows the step graphs' manifest (`state.json`), not
duplex's runtime.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

import numpy as np


def profile(folder: str, rows: int, calls: int, threads: int):
    import onnxruntime as ort

    with open(os.path.join(folder, "state.json"), encoding="utf-8") as f:
        m = json.load(f)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(tempfile.mkdtemp(prefix="profile_step."), "run")
    s = ort.InferenceSession(os.path.join(folder, "model.onnx"), so,
                             providers=["CPUExecutionProvider"])
    kinds = {"f32": np.float32, "f16": np.float16, "i64": np.int64}
    value = ort.OrtValue.ortvalue_from_numpy
    rng = np.random.default_rng(0)
    if m["role"] == "encoder":
        frame = (0.1 * rng.standard_normal((rows, 1, m["frame_samples"]))).astype(np.float32)
    else:
        frame = rng.integers(0, 2048, (rows, m["codebooks"], 1)).astype(np.int64)
    b = s.io_binding()
    b.bind_ortvalue_input(m["input"], value(frame))
    b.bind_ortvalue_input(m["active"], value(np.ones(rows, dtype=bool)))
    b.bind_output(m["output"])
    pairs = []
    for st in m["states"]:
        a = value(np.zeros([rows] + st["shape"], dtype=kinds[st["dtype"]]))
        if st["inplace"]:
            b.bind_ortvalue_input(st["input"], a)
            b.bind_ortvalue_output(st["output"], a)
        else:
            pairs.append((st, a, value(np.zeros([rows] + st["shape"], dtype=kinds[st["dtype"]]))))

    def call(parity: int):
        for st, x, y in pairs:
            src, dst = (x, y) if parity == 0 else (y, x)
            b.bind_ortvalue_input(st["input"], src)
            b.bind_ortvalue_output(st["output"], dst)
        s.run_with_iobinding(b)

    for i in range(5):
        call(i % 2)
    t0 = time.perf_counter()
    for i in range(calls):
        call(i % 2)
    wall = (time.perf_counter() - t0) / calls
    trace = s.end_profiling()
    with open(trace, encoding="utf-8") as f:
        events = json.load(f)
    os.remove(trace)
    by_op = collections.Counter()
    by_node = collections.Counter()
    shapes = {}
    kernels = sorted((e for e in events
                      if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")),
                     key=lambda e: e["ts"])
    # The profile covers the warm-up calls too (a first call's allocations can take longer than
    # all the others): only the timed calls' kernels count, the same calls as the wall time.
    per_call = len(kernels) // (calls + 5)
    for e in kernels[5 * per_call:]:
        op = e["args"].get("op_name", "?")
        by_op[op] += e["dur"]
        node = e["name"][: -len("_kernel_time")]
        by_node[node] += e["dur"]
        shapes[node] = (op, e["args"].get("input_type_shape"))
    return wall, {k: v / 1e3 / calls for k, v in by_op.items()}, \
        {k: v / 1e3 / calls for k, v in by_node.items()}, shapes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pack")
    p.add_argument("--role", choices=["encoder", "decoder", "both"], default="both")
    p.add_argument("--batch", default="1,8", help="batch sizes, comma-separated (default 1,8)")
    p.add_argument("--dtype", choices=["f32", "f16"], default="f32")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--nodes", type=int, default=0, help="also list the N slowest nodes")
    p.add_argument("--min-ms", type=float, default=0.1,
                   help="list an operator type alone when it takes this long at some B "
                        "(default 0.1 ms; the rest are summed on one line; 0 lists every type)")
    a = p.parse_args(argv)
    try:
        batches = [int(x) for x in a.batch.split(",")]
        if not batches or min(batches) < 1:
            raise ValueError
    except ValueError:
        print(f"profile_step: --batch {a.batch!r}: positive integers, comma-separated",
              file=sys.stderr)
        return 2
    roles = ["encoder", "decoder"] if a.role == "both" else [a.role]
    for role in roles:
        folder = os.path.join(a.pack, f"mimi_{role}_step" + ("" if a.dtype == "f32" else "_f16"))
        if not os.path.isfile(os.path.join(folder, "state.json")):
            print(f"profile_step: {folder}: no step graph (tools/make_mimi_step.py builds it)",
                  file=sys.stderr)
            return 2
        results = {rows: profile(folder, rows, a.calls, a.threads) for rows in batches}
        ops = collections.Counter()
        for _, by_op, _, _ in results.values():
            ops.update(by_op)
        head = "".join(f"  B={rows:<3} ms/call  ms/row" for rows in batches)
        print(f"\n{folder} ({a.threads} thread{'s' if a.threads > 1 else ''}, "
              f"{a.calls} calls)\n{'operator':<24}{head}")
        shown = [op for op, _ in ops.most_common()
                 if max(results[r][1].get(op, 0.0) for r in batches) >= a.min_ms]
        rest = [op for op in ops if op not in shown]
        for label, members in [(op, [op]) for op in shown] + (
                [(f"({len(rest)} other types)", rest)] if rest else []):
            cells = "".join(
                f"  {sum(results[r][1].get(o, 0.0) for o in members):>13.2f}"
                f" {sum(results[r][1].get(o, 0.0) for o in members) / r:>7.2f}"
                for r in batches)
            print(f"{label:<24}{cells}")
        cells = "".join(f"  {results[r][0] * 1e3:>13.2f} {results[r][0] * 1e3 / r:>7.2f}"
                        for r in batches)
        print(f"{'whole call (wall)':<24}{cells}")
        if a.nodes:
            last = batches[-1]
            _, _, by_node, shapes = results[last]
            print(f"slowest nodes at B={last} (ms per call):")
            for node, ms in collections.Counter(by_node).most_common(a.nodes):
                op, shape = shapes[node]
                print(f"  {ms:7.2f}  {op:<22} {node[-48:]}  {json.dumps(shape)[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
