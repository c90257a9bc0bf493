"""The Kineto reader on hand-made traces whose answers follow from the integers written."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kineto_builder import KinetoTraceBuilder
from tracer import classify
from tracer.errors import BadInput
from tracer.ingest import ingest_path
from tracer.store import RUN_TABLES, open_store


def _rows(con, sql: str, *params):
    return con.execute(sql, list(params)).fetchall()


def test_huge_timestamps_stay_exact(tmp_path: Path) -> None:
    """ts ≈ 4.46e12 µs plus a base: beyond exact DOUBLE; stored ns must equal base + ts exactly."""
    base = 1_711_964_646_000_000_000
    b = KinetoTraceBuilder(base_time_ns=base)
    starts = [base + 4_458_677_117_099_727 + k * 1_001 for k in range(50)]
    for k, s in enumerate(starts):
        b.launch(f"k{k}", s - 5_000, 1_001, s, 1_999 + k, stream=7)
    con = open_store(None)
    ingest_path(con, b.write(tmp_path / "big.json"), progress=False)
    got = _rows(con, "SELECT name, start_ns, end_ns FROM kernels ORDER BY start_ns")
    assert got == [(f"k{k}", s, s + 1_999 + k) for k, s in enumerate(starts)]
    calls = _rows(con, "SELECT start_ns, end_ns FROM api_calls ORDER BY start_ns")
    assert calls == [(s - 5_000, s - 5_000 + 1_001) for s in starts]


def test_args_in_other_case_and_hip_names(tmp_path: Path) -> None:
    b = KinetoTraceBuilder(rank=None)
    b.raw({"ph": "X", "cat": "Kernel", "name": "Cijk_gemm", "pid": 2, "tid": 3, "ts": 10.5, "dur": 2.25,
           "args": {"Device": 2, "Stream": 3, "Correlation": 77, "Grid": [4, 2, 1], "Block": [256, 1, 1]}})
    b.raw({"ph": "X", "cat": "Runtime", "name": "hipLaunchKernel", "pid": 100, "tid": 100, "ts": 9.0, "dur": 1.0,
           "args": {"Correlation": 77}})
    b.raw({"ph": "X", "cat": "Memcpy", "name": "CopyHostToDevice", "pid": 2, "tid": 3, "ts": 20, "dur": 1,
           "args": {"device": 2, "stream": 3, "correlation": 78, "bytes": "4096"}})
    con = open_store(None)
    ingest_path(con, b.write(tmp_path / "rocm.json"), progress=False)
    assert _rows(con, "SELECT device, stream, correlation, grid_x, grid_y, block_x, start_ns, end_ns FROM kernels") == [
        (2, 3, 77, 4, 2, 256, 10_500, 12_750)]
    assert _rows(con, "SELECT kind, name, correlation FROM api_calls") == [("runtime", "hipLaunchKernel", 77)]
    assert _rows(con, "SELECT kind, bytes, category FROM memops") == [("memcpy", 4096, "memory")]


def test_multi_rank_folder_and_file_order_ranks(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    for rank in (1, 0):
        b = KinetoTraceBuilder(rank=rank, world_size=2)
        b.launch("gemm", 0, 100, 1_000 * (rank + 1), 500)
        b.write(folder / f"r{rank}.json.gz", gz=True)
    con = open_store(None)
    (info,) = ingest_path(con, folder, progress=False)
    assert (info.kernels, info.ranks, info.streams) == (2, 2, 2)
    assert _rows(con, "SELECT rank, start_ns FROM kernels ORDER BY rank") == [(0, 1_000), (1, 2_000)]
    # Without distributedInfo the rank is the file's position in name order.
    folder2 = tmp_path / "norank"
    for i, name in enumerate(("b.json", "a.json")):
        b = KinetoTraceBuilder(rank=None)
        b.launch(name, 0, 100, 10 * (i + 1), 5)
        b.write(folder2 / name)
    ingest_path(con, folder2, progress=False)
    assert _rows(con, "SELECT rank, name FROM kernels WHERE run_id = 2 ORDER BY rank") == [(0, "a.json"), (1, "b.json")]


def test_decodescope_metadata_fills_runs_and_capture_map(tmp_path: Path) -> None:
    b = KinetoTraceBuilder()
    b.launch("gemm", 0, 10, 100, 50, stream=7)
    b.launch("my_collective", 0, 10, 200, 50, stream=13)
    b.launch("stage_weights", 0, 10, 300, 50, stream=21)
    meta = {"variant": "fused", "gpu": "NVIDIA H200", "graph_mode": True, "tp_sim": True, "config": {"B": 1},
            "comm_streams": [13], "prefetch_streams": [21],
            "graph_capture_map": [{"node_order": 0, "kernel_name": "gemm", "step": "step", "layer": "L0.mla", "op": "in_proj",
                                   "capture_stream": 7}]}
    con = open_store(None)
    ingest_path(con, b.write(tmp_path / "t.json", decodescope_meta=meta), progress=False)
    assert _rows(con, "SELECT variant, gpu, graph_mode, tp_sim, world_size FROM runs") == [("fused", "NVIDIA H200", True, True, 1)]
    assert json.loads(_rows(con, "SELECT config FROM runs")[0][0]) == meta
    assert _rows(con, "SELECT rank, node_order, kernel_name, layer_name, op_name, capture_stream FROM graph_capture_map") == [
        (0, 0, "gemm", "L0.mla", "in_proj", 7)]
    cats = dict(_rows(con, "SELECT name, category FROM kernels"))
    assert cats == {"gemm": "compute", "my_collective": "communication", "stage_weights": "prefetch"}


def test_capture_stream_that_is_not_an_integer_is_bad_input(tmp_path: Path) -> None:
    b = KinetoTraceBuilder()
    b.launch("gemm", 0, 10, 100, 50, stream=7)
    meta = {"graph_capture_map": [{"node_order": 0, "kernel_name": "gemm", "capture_stream": "7"}]}
    con = open_store(None)
    with pytest.raises(BadInput, match=r"graph_capture_map\[0\]\.capture_stream is not an integer"):
        ingest_path(con, b.write(tmp_path / "t.json", decodescope_meta=meta), progress=False)
    assert _rows(con, "SELECT count(*) FROM runs") == [(0,)]


def test_reingest_returns_existing_run(tmp_path: Path) -> None:
    b = KinetoTraceBuilder()
    b.launch("gemm", 0, 10, 100, 50)
    p = b.write(tmp_path / "t.json")
    con = open_store(None)
    (first,) = ingest_path(con, p, progress=False)
    (again,) = ingest_path(con, p, name="other", progress=False)
    assert again.reused and again.run_id == first.run_id and not first.reused
    assert _rows(con, "SELECT count(*) FROM runs") == [(1,)]
    assert _rows(con, "SELECT count(*) FROM kernels") == [(1,)]


def test_failure_inside_transaction_leaves_store_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    b = KinetoTraceBuilder()
    b.launch("gemm", 0, 10, 100, 50)
    con = open_store(tmp_path / "s.duckdb")
    ingest_path(con, b.write(tmp_path / "a.json"), progress=False)
    before = {t: _rows(con, f"SELECT count(*) FROM {t}") for t in ("runs", *RUN_TABLES)}

    def boom(*_a, **_k):
        raise RuntimeError("classifier crashed")

    monkeypatch.setattr(classify, "classify_run", boom)
    b.launch("gemm2", 0, 10, 200, 50)
    with pytest.raises(RuntimeError):
        ingest_path(con, b.write(tmp_path / "b.json"), progress=False)
    assert {t: _rows(con, f"SELECT count(*) FROM {t}") for t in ("runs", *RUN_TABLES)} == before


def test_negative_duration_is_bad_input(tmp_path: Path) -> None:
    b = KinetoTraceBuilder()
    b.kernel("bad", 1_000, -5)
    with pytest.raises(BadInput, match=r"traceEvents\[1\] \(.bad.\) has a negative duration \(-5 ns\)"):
        ingest_path(open_store(None), b.write(tmp_path / "neg.json"), progress=False)


def test_unknown_event_kinds_are_counted(tmp_path: Path) -> None:
    b = KinetoTraceBuilder()
    b.launch("gemm", 0, 10, 100, 50)
    b.raw({"ph": "X", "cat": "overhead", "name": "Buffer flush", "pid": 0, "tid": 0, "ts": 1, "dur": 1})
    b.raw({"ph": "s", "cat": "ac2g", "name": "flow", "pid": 0, "tid": 0, "ts": 1, "id": 1})
    con = open_store(None)
    ingest_path(con, b.write(tmp_path / "t.json"), progress=False)
    meta = json.loads(_rows(con, "SELECT metadata FROM runs")[0][0])
    assert meta["unhandled_events"] == {"X/overhead": 1, "s/ac2g": 1, "M/": 1, "i/": 1}
    assert meta["events"] == {"X/kernel": 1, "X/cuda_runtime": 1}


@settings(max_examples=25, deadline=None)
@given(base=st.one_of(st.none(), st.integers(0, 2_000_000_000_000_000_000)),
       starts=st.lists(st.integers(0, 5_000_000_000_000_000), min_size=1, max_size=8),
       durs=st.lists(st.integers(0, 10_000_000_000), min_size=8, max_size=8),
       gz=st.booleans())
def test_any_timestamp_is_stored_exactly(tmp_path_factory, base, starts, durs, gz) -> None:
    """Random bases and offsets up to 5e15 ns (5e12 µs, past DOUBLE's exact range) round-trip."""
    b = KinetoTraceBuilder(base_time_ns=base)
    expected = []
    for s, d in zip(starts, durs):
        start = (base or 0) + s
        b.kernel("k", start, d)
        expected.append((start, start + d))
    path = b.write(tmp_path_factory.mktemp("ts") / ("t.json.gz" if gz else "t.json"), gz=gz)
    con = open_store(None)
    ingest_path(con, path, progress=False)
    assert sorted(_rows(con, "SELECT start_ns, end_ns FROM kernels")) == sorted(expected)


def test_bad_event_in_second_rank_file_names_that_file(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    good = KinetoTraceBuilder(rank=0, world_size=2)
    good.launch("g", 0, 10, 100, 50)
    good.write(folder / "r0.json")
    bad = KinetoTraceBuilder(rank=1, world_size=2)
    bad.launch("g", 0, 10, 100, 50)      # events [1] runtime, [2] kernel
    bad.kernel("neg", 500, -1)           # event [3]
    bad.write(folder / "r1.json")
    with pytest.raises(BadInput, match=r"traceEvents\[3\] \('neg'\) has a negative duration") as err:
        ingest_path(open_store(None), folder, progress=False)
    assert err.value.path == str(folder / "r1.json")
