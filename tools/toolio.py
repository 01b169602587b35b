"""Reading the manifests and lists a tool is given (`pack.yaml`, `state.json`, `weights.json`,
a codes file): one that is missing, unreadable or malformed stops the tool (exit 2) with one
line that names the tool, the file and what is wrong, and where (never a traceback).

    from toolio import read_json, read_yaml, refuse
    manifest = read_yaml(path, "quality_gate")        # a mapping, or exit 2
    refuse("quality_gate", path, "what is wrong")     # the same for what the caller checks
    stop("quantize_pack: --block-size 12: a power of two, 16 or more")  # any other refusal

Knows nothing of what the files mean beyond their top-level kind.
"""

from __future__ import annotations

import json
import sys


def stop(message: str):
    """Stops the tool: `message` on stderr, exit 2 (refused before the tool began its work)."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def refuse(tool: str, path: str, what: str):
    """Stops the tool: `tool: path: what` on stderr, exit 2."""
    stop(f"{tool}: {path}: {what}")


def _text(path: str, tool: str) -> str:
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
