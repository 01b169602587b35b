"""Reading the manifests and lists a tool is given (`pack.yaml`, `state.json`, `weights.json`,
a codes file): one that is missing, unreadable or malformed stops the tool (exit 2) with one
line that names the tool, the file and what is wrong, and where (never a traceback).

    from toolio import read_json, read_yaml, refuse
    manifest = read_yaml(path, "quality_gate")        # a mapping, or exit 2
    refuse("quality_gate", path, "what is wrong")     # the same for what the caller checks
    stop("quantize_pack: --block-size 12: a power of two, 16 or more")  # any other refusal
    graph = need_file(os.path.join(pack, "temporal", "model.onnx"), "check_export", "a graph")
    need_folder(checkpoint, "check_export", "a checkpoint folder")
    writable(out, "export_pack")                      # where the output goes can be written
    need_graph(path, "quantize_pack")                 # an ONNX graph, whole (and its weights)

A path that is a FIFO or a device is refused before it is opened (opening one would wait for a
writer for ever). Knows nothing of what the files mean beyond their top-level kind.
"""

from __future__ import annotations

import json
import os
import stat
import sys


def stop(message: str):
    """Stops the tool: `message` on stderr, exit 2 (refused before the tool began its work)."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def refuse(tool: str, path: str, what: str):
    """Stops the tool: `tool: path: what` on stderr, exit 2."""
    stop(f"{tool}: {path}: {what}")


def need_file(path: str, tool: str, what: str = "a file") -> str:
    """`path`, when it is a regular file; else exit 2 naming what it is instead."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        refuse(tool, path, f"no such file ({what} was expected here)")
    except OSError as e:
        refuse(tool, path, e.strerror or str(e))
    if stat.S_ISDIR(mode):
        refuse(tool, path, f"a folder, not {what}")
    if not stat.S_ISREG(mode):
        refuse(tool, path, f"not a regular file (a FIFO, a device or a socket), not {what}")
    return path


def need_folder(path: str, tool: str, what: str = "a folder") -> str:
    """`path`, when it is a folder; else exit 2."""
    if not os.path.exists(path):
        refuse(tool, path, f"no such folder ({what} was expected)")
    if not os.path.isdir(path):
        refuse(tool, path, f"not a folder ({what} was expected)")
    return path


def writable(path: str, tool: str) -> str:
    """`path`, when a folder can be made there (or it is one) and files written in it: its
    nearest existing ancestor is a folder a file can be created in. Else exit 2, before any work
    (a pack under /proc, on a read-only mount, inside a file)."""
    import tempfile

    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        refuse(tool, path, "exists and is not a folder")
    at = path
    while not os.path.exists(at):
        at = os.path.dirname(at)
    if not os.path.isdir(at):
        refuse(tool, path, f"{at} is not a folder: nothing can be written under it")
    try:
        fd, probe = tempfile.mkstemp(dir=at, prefix=".duplex-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        refuse(tool, path, f"cannot write in {at}: {e.strerror or e}")
    return path


def need_graph(path: str, tool: str) -> str:
    """`path`, when it is an ONNX graph that reads whole (its structure, and each external
    weight file as long as the graph says): else exit 2 naming the file (a truncated copy, a
    graph whose weights are missing), before any work is done on it."""
    need_file(path, tool, "an ONNX graph")
    import onnx

    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and friends: no shared base class
        refuse(tool, path, f"not a whole ONNX graph ({type(e).__name__}: {str(e)[:120]})")
    folder = os.path.dirname(path)
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        where = os.path.join(folder, info.get("location", ""))
        end = int(info.get("offset", 0) or 0) + int(info.get("length", 0) or 0)
        try:
            size = os.stat(need_file(where, tool, f"the weights of {path}")).st_size
        except OSError as e:
            refuse(tool, where, e.strerror or str(e))
        if size < end:
            refuse(tool, where, f"{size} bytes, but {path} reads {t.name} up to byte {end} "
                                "(a truncated copy?)")
    return path


def _text(path: str, tool: str) -> str:
    need_file(path, tool)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        refuse(tool, path, "no such file")
    except IsADirectoryError:
        refuse(tool, path, "a folder, not a file")
    except UnicodeDecodeError as e:
        refuse(tool, path, f"not UTF-8 text (byte {e.start})")
    except OSError as e:
        refuse(tool, path, e.strerror or str(e))


def read_json(path: str, tool: str, kind=dict):
    """The JSON value of `path`, which must be a `kind` (dict or list)."""
    text = _text(path, tool)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        refuse(tool, path, f"not JSON: {e.msg} (line {e.lineno}, column {e.colno})")
    if not isinstance(value, kind):
        refuse(tool, path, f"expected a JSON {'object' if kind is dict else 'array'}, "
                          f"found {type(value).__name__}")
    return value


def read_yaml(path: str, tool: str) -> dict:
    """The YAML mapping of `path`."""
    import yaml

    text = _text(path, tool)
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        refuse(tool, path, f"not YAML: {problem}{where}")
    if not isinstance(value, dict):
        refuse(tool, path, f"expected a YAML mapping, found {type(value).__name__}")
    return value
