"""ranges.external_id for every args spelling, with the JSON parse skipped for args that cannot
hold one (kineto_sql.ArgsPlan.select(guard=...)): checked against json.loads of the same file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tracer.ingest import ingest_path
from tracer.ingest.kineto_sql import ARG_KEYS, ArgsPlan
from tracer.store import open_store

SPELLINGS = ARG_KEYS["external_id"]


def _trace(tmp_path: Path) -> Path:
    events = []
    for i in range(40):
        args: dict[str, object] = {"Python id": i, "Python parent id": i - 1}
        if i % 5 < len(SPELLINGS) and i % 3:
            args[SPELLINGS[i % 5]] = 1000 + i                   # each spelling
        if i % 7 == 0:
            args["note"] = "external is not a key here"         # the guard's text in a value only
        if i % 11 == 0:
            args = {"External id": str(2000 + i)}               # a string value, still an id
        cat = ("python_function", "cpu_op", "user_annotation")[i % 3]
        events.append({"ph": "X", "cat": cat, "name": f"r{i}", "pid": 1, "tid": 1, "ts": 10 * i, "dur": 5,
                       "args": args})
    events.append({"ph": "X", "cat": "cpu_op", "name": "escaped", "pid": 1, "tid": 2, "ts": 1, "dur": 1,
                   "args": {"External id": 4242}})
    events.append({"ph": "X", "cat": "cpu_op", "name": "no args", "pid": 1, "tid": 2, "ts": 3, "dur": 1})
    text = json.dumps({"traceEvents": events})
    # a key spelled with a \u escape still decodes to "External id": the guard must let it through
    text = text.replace('"External id": 4242', '"\\u0045xternal id": 4242')
    path = tmp_path / "t.json"
    path.write_text(text)
    return path


def _expected(path: Path) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for ev in json.loads(path.read_text())["traceEvents"]:
        args = ev.get("args") or {}
        value = next((args[k] for k in SPELLINGS if args.get(k) is not None), None)
        out[ev["name"]] = None if value is None else int(value)
    return out


def test_external_id_every_spelling_and_escape(tmp_path: Path) -> None:
    path = _trace(tmp_path)
    con = open_store(None)
    (run,) = ingest_path(con, path, progress=False)
    got = dict(con.execute("SELECT name, external_id FROM ranges WHERE run_id = ?", [run.run_id]).fetchall())
    expected = _expected(path)
    assert got == expected
    assert got["escaped"] == 4242 and sum(v is not None for v in got.values()) > 10


def test_guard_must_be_in_every_spelling() -> None:
    with pytest.raises(ValueError):
        ArgsPlan(("external_id",)).select(guard="External")
