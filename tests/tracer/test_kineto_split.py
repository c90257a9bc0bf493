"""Chunked reading gives exactly the events of a whole-document read, in any JSON layout, and a
cut that lands inside a string or a nested value falls back instead of corrupting events."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.kineto_builder import KinetoTraceBuilder
from tracer.ingest import ingest_path
from tracer.ingest import kineto_split
from tracer.ingest.kineto_split import split_trace
from tracer.store import open_store


def _builder(n: int) -> KinetoTraceBuilder:
    b = KinetoTraceBuilder(base_time_ns=1_700_000_000_000_000_000)
    for i in range(n):
        # names with separators inside strings: '}, {' must not be taken for an event boundary
        b.launch("k}, {" + str(i) if i % 7 == 0 else f"k{i}", 1_700_000_000_000_000_000 + 10 * i, 3,
                 1_700_000_000_000_000_000 + 10 * i + 5, 4 + i % 3, stream=7 + i % 2)
    b.raw({"ph": "X", "cat": "cpu_op", "name": "nested", "pid": 1000, "tid": 1, "ts": 0.5, "dur": 0.25,
           "args": {"list": [{"a": 1}, {"b": 2}], "s": "}\n,{"}})
    return b


@pytest.mark.parametrize("indent", [None, 1, 4])
def test_chunks_cover_every_event(tmp_path: Path, indent: int | None) -> None:
    b = _builder(300)
    doc = json.loads(b.to_json())
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc, indent=indent))
    work = tmp_path / "w"
    work.mkdir()
    split = split_trace(path, work, target_chunk_bytes=2_000)
    assert split is not None and len(split.chunks) > 3
    assert split.meta["traceEvents"] == [] and split.meta["baseTimeNanoseconds"] == b.base_time_ns
    got = []
    for c in split.chunks:
        try:
            got.extend(json.loads(c.read_text()))
        except json.JSONDecodeError:
            got = None  # a cut inside a string: the reader must fall back; checked below
            break
    if got is not None:
        assert got == doc["traceEvents"]


@pytest.mark.parametrize("indent", [None, 2])
def test_chunked_ingest_equals_whole_document_ingest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     indent: int | None) -> None:
    b = _builder(400)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(json.loads(b.to_json()), indent=indent))
    query = "SELECT rank, name, start_ns, end_ns, stream, correlation FROM kernels ORDER BY kernel_id"
    real_split = kineto_split.split_trace
    splits: list = []
    monkeypatch.setattr("tracer.ingest.kineto.split_trace",
                        lambda p, w: splits.append(real_split(p, w, target_chunk_bytes=1_500)) or splits[-1])
    chunked = open_store(None)
    ingest_path(chunked, path, progress=False)
    assert splits and splits[0] is not None and len(splits[0].chunks) > 1  # really read in chunks
    monkeypatch.setattr("tracer.ingest.kineto.split_trace", lambda p, w: None)
    whole = open_store(None)
    ingest_path(whole, path, progress=False)
    assert chunked.execute(query).fetchall() == whole.execute(query).fetchall()
    assert len(whole.execute(query).fetchall()) == 400
    ranges = "SELECT name, start_ns, end_ns, depth FROM ranges ORDER BY range_id"
    assert chunked.execute(ranges).fetchall() == whole.execute(ranges).fetchall()


def test_empty_event_list(tmp_path: Path) -> None:
    path = tmp_path / "e.json"
    path.write_text('{"traceEvents": [], "baseTimeNanoseconds": 5}')
    con = open_store(None)
    (info,) = ingest_path(con, path, progress=False)
    assert info.kernels == 0


def test_metadata_says_how_each_file_was_parsed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut at every separator: the one inside the name 'k}, {0' breaks a chunk, so that file falls
    back to the whole-document read (and says so); a file without such names stays chunked."""
    real_split = kineto_split.split_trace
    monkeypatch.setattr("tracer.ingest.kineto.split_trace", lambda p, w: real_split(p, w, target_chunk_bytes=1))
    plain = KinetoTraceBuilder()
    for i in range(5):
        plain.launch(f"k{i}", 10 * i, 3, 10 * i + 5, 4)
    tricky = _builder(5)
    con = open_store(None)
    for p in (plain.write(tmp_path / "plain.json"), tricky.write(tmp_path / "tricky.json")):
        ingest_path(con, p, progress=False)
    parsed = [json.loads(m)["files"][0]["parsed_as"] for (m,) in
              con.execute("SELECT metadata FROM runs ORDER BY run_id").fetchall()]
    assert parsed[0].endswith(" chunks") and int(parsed[0].split()[0]) > 5
    assert parsed[1].startswith("whole document (chunked read failed")
    assert con.execute("SELECT count(*) FROM kernels WHERE run_id = 2").fetchall() == [(5,)]


def test_lists_of_objects_after_the_events(tmp_path: Path) -> None:
    """TraceLens re-serialises with traceEvents first and deviceProperties (a list of objects)
    after it: the event list must end at its own bracket, not at deviceProperties'."""
    events = json.loads(_builder(50).to_json())["traceEvents"]
    doc = {"metadata": {"x": 1}, "traceEvents": events, "schemaVersion": 1,
           "deviceProperties": [{"id": 0, "name": "A"}, {"id": 1, "name": "B"}], "baseTimeNanoseconds": 7}
    path = tmp_path / "tl.json"
    path.write_text(json.dumps(doc, indent=2))
    work = tmp_path / "w"
    work.mkdir()
    split = split_trace(path, work, target_chunk_bytes=1_000)
    assert split is not None and split.meta["deviceProperties"] == doc["deviceProperties"]
    got = [e for c in split.chunks for e in json.loads(c.read_text())]
    assert got == events
