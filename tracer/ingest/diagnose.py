"""Say precisely why a file is not a Kineto trace, once DuckDB has refused it.

Runs only on failure, so it may afford a plain Python parse: DuckDB's messages name a byte
offset or a cast, while the user needs to hear "truncated gzip" or "traceEvents[3] is a number".
"""
from __future__ import annotations

import gzip
import zlib
from pathlib import Path
from typing import Any

import duckdb
import orjson

from tracer.errors import BadInput

_NUMERIC_FIELDS = ("ts", "dur")
_TEXT_FIELDS = ("ph", "cat", "name")


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _read_bytes(path: Path) -> bytes:
    with path.open("rb") as fh:
        raw = fh.read()
    if raw[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as exc:
            raise BadInput(path, f"truncated or corrupt gzip ({exc})") from None
    if path.name.lower().endswith(".gz"):
        raise BadInput(path, "named .gz but is not gzip-compressed")
    return raw


def diagnose_json(path: Path, exc: duckdb.Error) -> BadInput:
    """The BadInput that explains why `path` failed to parse as a Kineto trace."""
    try:
        raw = _read_bytes(path)
    except BadInput as bad:
        return bad
    except OSError as os_exc:
        return BadInput(path, f"cannot be read ({os_exc.strerror or os_exc})")
    if not raw.strip():
        return BadInput(path, "is empty")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as jexc:
        return BadInput(path, f"not JSON ({jexc})")
    if not isinstance(doc, dict):
        return BadInput(path, f"top level is {_kind(doc)}, expected an object with traceEvents")
    events = doc.get("traceEvents")
    if events is None:
        return BadInput(path, "no traceEvents list (not a Kineto / Chrome trace)")
    if not isinstance(events, list):
        return BadInput(path, f"traceEvents is {_kind(events)}, expected a list of event objects")
    for i, ev in enumerate(events):
        if not isinstance(ev, dict):
            return BadInput(path, f"traceEvents[{i}] is {_kind(ev)}, expected an event object")
        for key in _NUMERIC_FIELDS:
            v = ev.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                return BadInput(path, f"traceEvents[{i}].{key} is {_kind(v)}, expected a number of µs")
        for key in _TEXT_FIELDS:
            v = ev.get(key)
            if isinstance(v, (dict, list)):
                return BadInput(path, f"traceEvents[{i}].{key} is {_kind(v)}, expected a string")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return BadInput(path, f"cannot be read as a Kineto trace ({first})")
