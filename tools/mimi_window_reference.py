#!/usr/bin/env python3
"""Writes the offline reference of streaming Mimi past 10 s: the pack's whole-utterance graphs
with the codec transformer's attention limited to its context of 250 frames.

    python tools/mimi_window_reference.py PACK OUT

The exporter's offline graphs attend to every earlier frame (a full causal mask), which equals
Kyutai's offline codec only for the first 250 transformer frames (10 s). Kyutai's codec attends
to the last 250 (`0 <= q - k < 250`). OUT becomes a copy of PACK whose `mimi_encoder` and
`mimi_decoder` graphs have that banded mask instead, built by editing the exporter's own graph
(the lower triangle less the triangle 250 below the diagonal): a whole-utterance reference made
without the step graphs' code. The other graphs are linked. Used by the tests.
"""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import onnx
from onnx import helper, numpy_helper

CONTEXT = 250


def band(model: onnx.ModelProto) -> int:
    """Replaces each causal `Trilu` mask by a band of CONTEXT; returns how many it changed."""
    g = model.graph
    changed = 0
    nodes = list(g.node)
    out = []
    for n in nodes:
        out.append(n)
        if n.op_type != "Trilu" or len(n.input) != 1:
            continue
        upper = next((a.i for a in n.attribute if a.name == "upper"), 1)
        if upper != 0:
            continue
        tag = f"_band{changed}"
        k = numpy_helper.from_array(np.array(-CONTEXT, dtype=np.int64), "k" + tag)
        g.initializer.append(k)
        old = n.output[0]
        n.output[0] = "tril" + tag
        out.append(helper.make_node("Trilu", [n.input[0], "k" + tag], ["far" + tag], upper=0))
        out.append(helper.make_node("Sub", ["tril" + tag, "far" + tag], [old]))
        changed += 1
    del g.node[:]
    g.node.extend(out)
    return changed


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    pack, out = argv
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    for entry in os.listdir(pack):
        src = os.path.abspath(os.path.join(pack, entry))
        if entry in ("mimi_encoder", "mimi_decoder"):
            model = onnx.load(os.path.join(src, "model.onnx"), load_external_data=False)
            if band(model) != 1:
                print(f"{src}: expected one causal mask", file=sys.stderr)
                return 1
            os.makedirs(os.path.join(out, entry))
            onnx.save(model, os.path.join(out, entry, "model.onnx"))
            # Copied, not linked: ONNX Runtime refuses weights outside the model's folder.
            shutil.copyfile(
                os.path.join(src, "model.onnx.data"), os.path.join(out, entry, "model.onnx.data")
            )
        elif entry == "pack.yaml":
            with open(os.path.join(src)) as f:
                text = "".join(line for line in f if not line.startswith("mimi_streaming:"))
            with open(os.path.join(out, entry), "w") as f:
                f.write(text)
        elif not entry.startswith("mimi_"):
            os.symlink(src, os.path.join(out, entry))
    return 0


if __name__ == "__main__":
    sys.exit(main())
