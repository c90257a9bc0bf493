"""Every user mistake on `ingest` (and the store commands) is one line, exit 2, store unchanged.

Each case starts from a store holding one good run, records its bytes, runs the CLI in-process
on a bad input, and checks: exit code BAD_INPUT, stderr is exactly one line
`error: <path>: <problem>`, and the store file is byte-for-byte what it was.
"""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.exit_codes import BAD_INPUT, OK
from cli.main import main
from tests.kineto_builder import KinetoTraceBuilder


def _good_trace(path: Path) -> Path:
    b = KinetoTraceBuilder()
    b.launch("gemm", 0, 10, 100, 50)
    return b.write(path)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    db = tmp_path / "store.duckdb"
    res = CliRunner().invoke(main, ["ingest", str(_good_trace(tmp_path / "good.json")), "--db", str(db)])
    assert res.exit_code == OK, res.output
    return db


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _neg_dur(tmp_path: Path) -> Path:
    b = KinetoTraceBuilder()
    b.kernel("k", 1_000, -7)
    return b.write(tmp_path / "neg.json")


def _truncated_gz(tmp_path: Path) -> Path:
    full = gzip.compress(_good_trace(tmp_path / "src.json").read_bytes() * 1)
    return _write(tmp_path, "trunc.json.gz", full[: len(full) // 2])


CASES = {
    "missing file": (lambda t: t / "nope.json", "no such file or directory"),
    "not json": (lambda t: _write(t, "x.json", b"this is not json"), "not JSON"),
    "empty file": (lambda t: _write(t, "x.json", b""), "is empty"),
    "truncated gzip": (_truncated_gz, "truncated or corrupt gzip"),
    "top-level list": (lambda t: _write(t, "x.json", b'[{"traceEvents": []}]'), "top level is a list"),
    "top-level number": (lambda t: _write(t, "x.json", b"42"), "top level is a number"),
    "no traceEvents": (lambda t: _write(t, "x.json", b'{"schemaVersion": 1}'), "no traceEvents"),
    "traceEvents not a list": (lambda t: _write(t, "x.json", b'{"traceEvents": {"a": 1}}'), "traceEvents is an object"),
    "event not an object": (lambda t: _write(t, "x.json", b'{"traceEvents": [{"ph": "X"}, 5]}'), r"traceEvents\[1\] is a number"),
    "ts not a number": (lambda t: _write(t, "x.json", json.dumps({"traceEvents": [{"ph": "X", "ts": "soon"}]}).encode()),
                        r"traceEvents\[0\].ts is a string"),
    "negative duration": (_neg_dur, "negative duration"),
    "empty folder": (lambda t: (t / "emptydir").mkdir() or t / "emptydir", "no trace files"),
    "unknown suffix": (lambda t: _write(t, "trace.txt", b"{}"), "unknown trace format"),
    "gz that is not gzip": (lambda t: _write(t, "x.json.gz", b'{"traceEvents": []}'), "not gzip"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_ingest_bad_input(tmp_path: Path, store: Path, case: str) -> None:
    make, problem = CASES[case]
    bad = make(tmp_path)
    before = store.read_bytes()
    res = CliRunner().invoke(main, ["ingest", str(bad), "--db", str(store)])
    assert res.exit_code == BAD_INPUT, res.output
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(f"error: {bad}: "), lines[0]
    assert re.search(problem, lines[0]), lines[0]
    assert "Traceback" not in res.output
    assert store.read_bytes() == before


def test_second_path_bad_leaves_store_unchanged(tmp_path: Path, store: Path) -> None:
    """All paths are checked before the store is opened: a wrong second path writes nothing."""
    b = KinetoTraceBuilder()
    b.launch("other", 0, 10, 100, 60)
    good2 = b.write(tmp_path / "good2.json")
    before = store.read_bytes()
    res = CliRunner().invoke(main, ["ingest", str(good2), str(tmp_path / "missing"), "--db", str(store)])
    assert res.exit_code == BAD_INPUT
    assert store.read_bytes() == before


def test_db_that_is_not_duckdb(tmp_path: Path) -> None:
    fake = _write(tmp_path, "fake.duckdb", b"I am a text file, not a database\n" * 10)
    before = fake.read_bytes()
    trace = _good_trace(tmp_path / "t.json")
    for args in (["ingest", str(trace), "--db", str(fake)], ["runs", "--db", str(fake)], ["summary", str(fake)]):
        res = CliRunner().invoke(main, args)
        assert res.exit_code == BAD_INPUT, (args, res.output)
        lines = res.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {fake}: "), res.stderr
        assert fake.read_bytes() == before


def test_bad_rules_file(tmp_path: Path, store: Path) -> None:
    rules = _write(tmp_path, "r.json", b'{"rules": [{"category": "nope", "stream": 1}]}')
    before = store.read_bytes()
    res = CliRunner().invoke(main, ["ingest", str(_good_trace(tmp_path / "t2.json")), "--db", str(store), "--rules", str(rules)])
    assert res.exit_code == BAD_INPUT
    assert res.stderr.startswith(f"error: {rules}: ") and len(res.stderr.splitlines()) == 1
    assert store.read_bytes() == before


def test_runs_on_missing_db(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["runs", "--db", str(tmp_path / "none.duckdb")])
    assert res.exit_code == BAD_INPUT and res.stderr.startswith("error: ")
    assert not (tmp_path / "none.duckdb").exists()
