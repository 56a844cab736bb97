"""Writing a command's JSON result to standard output ('-') or a file."""

from __future__ import annotations

import sys
from pathlib import Path

import orjson


def write_json(obj, dest: str, numpy: bool = False) -> Path | None:
    """Write ``obj`` as indented JSON to ``dest``; returns the file written (None for '-')."""
    opt = orjson.OPT_INDENT_2 | (orjson.OPT_SERIALIZE_NUMPY if numpy else 0)
    data = orjson.dumps(obj, option=opt) + b"\n"
    if dest == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return None
    out = Path(dest)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    return out
