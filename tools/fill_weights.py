#!/usr/bin/env python3
"""Writes the weights of a pack built with `tools/make_pack.py --shapes-only`.

    python3 tools/fill_weights.py PACK [--check]

Every graph folder of PACK with a `weights.json` gets its `model.onnx.data`: each weight listed
there written at its offset, reproducibly (the same bytes on every machine): `normal` weights
are a normal draw × 0.02 (a stretch of one block of 2^22 values drawn once from a seeded
generator, begun at a place that depends on the weight's name), `ones` (norms) are 1.0, `zeros`
(biases) 0. These are weights of a sane scale for timing, not a model: they say nothing.

`--check` writes nothing: it checks that each data file is there, is as long as `weights.json`
says, and that every weight lies inside it. Needs numpy only (no onnx), so that it runs on a
machine that has only what PyTorch brought. Exit 1 when a check fails, 2 for bad arguments.
"""

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

BLOCK = 1 << 22
SCALE = 0.02
DTYPES = {"float16": np.float16, "float": np.float32, "float32": np.float32,
          "bfloat16": None}


def block(dtype) -> np.ndarray:
    """The seeded normal block every `normal` weight is cut from, in `dtype`, twice over (so
    that any stretch of BLOCK values starting inside the first copy is contiguous)."""
    rng = np.random.Generator(np.random.PCG64(20261203))
    b = (rng.standard_normal(BLOCK, dtype=np.float32) * np.float32(SCALE)).astype(dtype)
    return np.concatenate([b, b])


def start(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") % BLOCK


def graphs(pack: str) -> list:
    return sorted(
        e for e in os.listdir(pack)
        if os.path.isfile(os.path.join(pack, e, "weights.json"))
    )


def read_listing(folder: str) -> dict:
    """`folder/weights.json`, checked: a malformed listing is named, not a traceback. (This
    script travels alone to the GPU machine: it reads its JSON itself.)"""
    path = os.path.join(folder, "weights.json")

    def bad(what: str):
        print(f"fill_weights: {path}: {what}", file=sys.stderr)
        raise SystemExit(2)

    try:
        with open(path, encoding="utf-8") as f:
            listing = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        bad(f"unreadable: {e}")
    except json.JSONDecodeError as e:
        bad(f"not JSON: {e.msg} (line {e.lineno}, column {e.colno})")
    if not isinstance(listing, dict):
        bad("expected a JSON object")
    if listing.get("format") != 1:
        bad(f"format {listing.get('format')!r}, expected 1")
    ints = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
    if not isinstance(listing.get("data"), str) or os.sep in listing["data"] or not ints(listing.get("bytes")):
        bad("expected `data` (a file name in the folder) and `bytes` (its size)")
    weights = listing.get("weights")
    if not isinstance(weights, list):
        bad("expected `weights`, a list")
    for i, w in enumerate(weights):
        if not (isinstance(w, dict) and isinstance(w.get("name"), str)
                and isinstance(w.get("shape"), list) and all(ints(d) for d in w["shape"])
                and ints(w.get("offset")) and ints(w.get("length")) and "fill" in w):
            bad(f"weight {i}: expected name, dtype, shape, offset, length and fill")
        if DTYPES.get(w.get("dtype")) is None:
            bad(f"{w['name']}: dtype {w.get('dtype')} is not handled")
    return listing


def check(folder: str, listing: dict) -> list:
    """What is wrong with `folder`'s data file (nothing: an empty list)."""
    path = os.path.join(folder, listing["data"])
    if not os.path.isfile(path):
        return [f"{path}: missing"]
    size = os.path.getsize(path)
    wrong = [] if size == listing["bytes"] else [f"{path}: {size} bytes, weights.json says {listing['bytes']}"]
    for w in listing["weights"]:
        n = int(np.prod(w["shape"])) * np.dtype(DTYPES[w["dtype"]]).itemsize
        if n != w["length"] or w["offset"] + w["length"] > size:
            wrong.append(f"{path}: {w['name']} ({w['length']} bytes at {w['offset']}) does not fit")
    return wrong


def fill(folder: str, listing: dict) -> int:
    """Writes `folder`'s data file; returns its bytes."""
    path = os.path.join(folder, listing["data"])
    blocks = {}
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        f.truncate(listing["bytes"])
        for w in listing["weights"]:
            dtype = DTYPES[w["dtype"]]
            n = int(np.prod(w["shape"]))
            f.seek(w["offset"])
            if w["fill"] in ("ones", "zeros"):
                f.write((np.ones if w["fill"] == "ones" else np.zeros)(n, dtype).tobytes())
                continue
            if dtype not in blocks:
                blocks[dtype] = block(dtype)
            b, at, left = blocks[dtype], start(w["name"]), n
            while left:
                take = min(left, BLOCK)
                f.write(b[at:at + take].tobytes())
                left -= take
                at = (at + take) % BLOCK
    os.replace(tmp, path)
    return listing["bytes"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pack")
    p.add_argument("--check", action="store_true", help="check the data files, write nothing")
    a = p.parse_args(argv)
    if not os.path.isfile(os.path.join(a.pack, "pack.yaml")):
        print(f"fill_weights: {a.pack}: not a pack (no pack.yaml)", file=sys.stderr)
        return 2
    found = graphs(a.pack)
    if not found:
        print(f"fill_weights: {a.pack}: no weights.json (not built with --shapes-only)", file=sys.stderr)
        return 2
    wrong = []
    t0 = time.monotonic()
    total = 0
    for g in found:
        folder = os.path.join(a.pack, g)
        listing = read_listing(folder)
        if not a.check:
            total += fill(folder, listing)
        wrong += check(folder, listing)
    for w in wrong:
        print(f"fill_weights: {w}", file=sys.stderr)
    if wrong:
        return 1
    if a.check:
        print(f"fill_weights: {a.pack}: {', '.join(found)}: every weight in place")
    else:
        print(f"fill_weights: {a.pack}: wrote {total / 2**30:.2f} GiB ({', '.join(found)}) "
              f"in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
