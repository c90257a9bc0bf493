"""Cut a Kineto file into event chunks that DuckDB parses in parallel and in less memory.

Why: DuckDB parses a JSON document as one object; for a 62 MB trace that alone takes ~400 MB
(its parse tree) on one thread. Events of `traceEvents` are consecutive objects separated by
`}` `,` `{` (with any whitespace); cutting the array at such separators every few MB gives
chunks that, wrapped in `[...]`, are JSON arrays DuckDB reads file by file, in parallel.

A wrong cut cannot pass silently. A separator found inside a string or inside a nested value
leaves an unterminated string or unbalanced brackets at the chunk edge, so that chunk fails to
parse; the caller then falls back to the whole-document read (which also produces the precise
error messages). Anything unexpected here (no traceEvents, bad gzip, odd tail) returns None
for the same fallback.
"""
from __future__ import annotations

import re
import gzip
import zlib
from dataclasses import dataclass
from pathlib import Path

import orjson

_KEY = b'"traceEvents"'


@dataclass
class Split:
    """A trace cut in two: the document without its events, and the event chunks."""

    meta: dict            # the top-level object with "traceEvents": []
    chunks: list[Path]    # files holding JSON arrays of consecutive events, in order


def _raw_text(path: Path) -> bytes | None:
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(data)
        except (EOFError, OSError, zlib.error):
            return None
    if path.name.lower().endswith(".gz"):
        return None  # named .gz but not gzip: the whole-document read reports it
    return data


_SEP = re.compile(rb"\}\s*,\s*\{")
_CLOSE = re.compile(rb"\}\s*\]")
_MAX_TAIL_TRIES = 16


def _meta_with_tail(raw: bytes, bracket: int, body_start: int) -> tuple[dict, int] | None:
    """The document with an empty traceEvents list, and where the events end (exclusive)."""
    closes = [m.start() for m in _CLOSE.finditer(raw, max(body_start, len(raw) - (1 << 20)))]
    if not closes:
        closes = [m.start() for m in _CLOSE.finditer(raw, body_start)]
    for close in reversed(closes[-_MAX_TAIL_TRIES:]):
        end_bracket = raw.index(b"]", close)
        try:
            meta = orjson.loads(raw[: bracket + 1] + raw[end_bracket:])
        except orjson.JSONDecodeError:
            continue
        if isinstance(meta, dict) and meta.get("traceEvents") == []:
            return meta, close + 1
    return None


def split_trace(path: Path, workdir: Path, target_chunk_bytes: int = 8 << 20) -> Split | None:
    """Write the events of `path` as chunk files under `workdir`; None if that is not possible."""
    raw = _raw_text(path)
    if raw is None:
        return None
    key = raw.find(_KEY)
    if key < 0:
        return None
    bracket = raw.find(b"[", key)
    if bracket < 0 or raw[key + len(_KEY):bracket].strip() != b":":
        return None
    body_start = bracket + 1
    while body_start < len(raw) and raw[body_start] in b" \t\r\n":
        body_start += 1
    if raw[body_start:body_start + 1] == b"]":
        try:
            meta = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        return Split(meta, []) if isinstance(meta, dict) else None
    if raw[body_start:body_start + 1] != b"{":
        return None
    found = _meta_with_tail(raw, bracket, body_start)
    if found is None:
        return None
    meta, body_end = found

    cuts = [(body_start, None)]
    pos = body_start + max(target_chunk_bytes, 1)
    while pos < body_end:
        m = _SEP.search(raw, pos, body_end)
        if m is None:
            break
        cuts.append((m.end() - 1, m.start() + 1))  # next chunk starts at "{", this one ends after "}"
        pos = m.end() + target_chunk_bytes
    view = memoryview(raw)
    chunks: list[Path] = []
    for i, (a, _) in enumerate(cuts):
        b = cuts[i + 1][1] if i + 1 < len(cuts) else body_end
        out = workdir / f"{path.name}.{i:04d}.json"
        with out.open("wb") as fh:
            fh.write(b"[")
            fh.write(view[a:b])
            fh.write(b"]")
        chunks.append(out)
    view.release()
    return Split(meta, chunks)
