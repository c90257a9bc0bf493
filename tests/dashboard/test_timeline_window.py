"""analyzers.timeline against brute force: random kernels (integer ns) inserted straight into a
store, and every window query recomputed in plain Python from the same integers."""
from __future__ import annotations

from typing import Any

import duckdb
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzers import timeline
from analyzers.views import SQL_ROOT
from tracer.store import open_store

KERNEL_SQL = ("INSERT INTO kernels (run_id, kernel_id, rank, stream, correlation, name, start_ns, end_ns, category) "
              "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)")


def _load_timeline_sql(con: duckdb.DuckDBPyConnection) -> None:
    """Only the SQL these tests exercise (the interval macros and the timeline macros), so a
    colleague's half-written view elsewhere cannot break them."""
    for rel in ("intervals/intervals.sql", "timeline/timeline.sql"):
        con.execute((SQL_ROOT / rel).read_text())


def _store(kernels: list[tuple[int, int, int, int]], memops: list[tuple[int, int]] = (), run_id: int = 1,
           base: int = 1_700_000_000_000_000_000) -> duckdb.DuckDBPyConnection:
    """kernels: (rank, stream, start, dur) relative to `base` (epoch-sized ns, beyond float64 exactness)."""
    con = open_store(None)
    _load_timeline_sql(con)
    con.execute("INSERT INTO runs (run_id, name, source, path, file_hash, world_size) VALUES (?, 'r', 'test', 'x', ?, 1)",
                [run_id, f"h{run_id}"])
    con.executemany(KERNEL_SQL, [(run_id, i, r, s, i, f"k{i % 5}", base + t, base + t + d, "compute")
                                 for i, (r, s, t, d) in enumerate(kernels)])
    if memops:
        con.executemany("INSERT INTO memops (run_id, memop_id, rank, stream, kind, name, start_ns, end_ns, category) "
                        "VALUES (?, ?, 0, 99, 'memcpy', 'Memcpy', ?, ?, 'memory')",
                        [(run_id, i, base + t, base + t + d) for i, (t, d) in enumerate(memops)])
    return con


def _brute_gaps(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Gaps of the union by marking every ns: slow, obviously right."""
    covered = set()
    for s, e in intervals:
        covered.update(range(s, e))
    if not covered:
        return []
    gaps, t, last = [], min(covered), max(covered) + 1
    while t < last:
        if t not in covered:
            g = t
            while t not in covered:
                t += 1
            gaps.append((g, t))
        t += 1
    return gaps


kernel_lists = st.lists(st.tuples(st.integers(0, 1), st.integers(7, 9), st.integers(0, 400), st.integers(0, 60)),
                        min_size=1, max_size=40)


@settings(max_examples=40)
@given(kernels=kernel_lists, t0=st.integers(-50, 450), width=st.integers(1, 300), cap=st.integers(0, 50))
def test_window_matches_brute_force(kernels: list[tuple[int, int, int, int]], t0: int, width: int, cap: int) -> None:
    base = 1_700_000_000_000_000_000
    con = _store(kernels, base=base)
    lo, hi = base + t0, base + t0 + width
    inside = [(i, k) for i, k in enumerate(kernels) if k[0] == 0 and base + k[2] + k[3] > lo and base + k[2] < hi]
    win = timeline.window(con, 1, 0, lo, hi, cap=cap, bins=7)
    assert win.total_kernels == len(inside)
    if len(inside) <= cap:
        assert win.mode == "kernels"
        assert sorted(win.rows["kernel_id"].tolist()) == sorted(i for i, _ in inside)
        got = dict(zip(win.rows["kernel_id"], zip(win.rows["start_ns"], win.rows["end_ns"])))
        for i, (_r, _s, t, d) in inside:  # exact epoch ns, not rounded through a double
            assert got[i] == (base + t, base + t + d)
        expected_gaps = _brute_gaps([(base + t - lo, base + t + d - lo) for _i, (_r, _s, t, d) in inside])
        assert [(s - lo, e - lo) for s, e in zip(win.idle["start_ns"], win.idle["end_ns"])] == expected_gaps
    else:
        assert win.mode == "binned"
        expect: dict[tuple[int, int], list[Any]] = {}
        for _i, (_r, s, t, d) in inside:
            b = min((max(base + t, lo) - lo) * 7 // (hi - lo), 6)
            e = expect.setdefault((s, b), [0, None, None, 0])
            e[0] += 1
            e[1] = base + t if e[1] is None else min(e[1], base + t)
            e[2] = base + t + d if e[2] is None else max(e[2], base + t + d)
            e[3] += min(base + t + d, hi) - max(base + t, lo)
        got = {(int(r.stream), int(r.bin)): [int(r.kernels), int(r.start_ns), int(r.end_ns), int(r.busy_ns)]
               for r in win.rows.itertuples()}
        assert got == {k: v for k, v in expect.items()}


def test_idle_includes_memops_and_all_streams() -> None:
    """Kernels [0,10) s7 and [30,40) s8, a memcpy [12,20): the device is idle on [10,12) and [20,30)."""
    con = _store([(0, 7, 0, 10), (0, 8, 30, 10)], memops=[(12, 8)], base=0)
    win = timeline.window(con, 1, 0, 0, 100)
    assert list(zip(win.idle["start_ns"], win.idle["end_ns"], win.idle["gap_ns"])) == [(10, 12, 2), (20, 30, 10)]


def test_steps_device_window_follows_launches() -> None:
    """Two `step` ranges [0,100) and [200,300); kernels launched in each run later on the device
    (kernel 0/1 launched at 10/20 run at 150..170; kernel 2 launched at 210 runs 400..450).
    The device windows are [150,190) and [400,450)."""
    con = _store([(0, 7, 150, 20), (0, 7, 170, 20), (0, 7, 400, 50)], base=0)
    con.executemany("INSERT INTO api_calls (run_id, call_id, rank, tid, kind, name, start_ns, end_ns, correlation) "
                    "VALUES (1, ?, 0, 1, 'runtime', 'cudaLaunchKernel', ?, ?, ?)",
                    [(0, 10, 15, 0), (1, 20, 25, 1), (2, 210, 215, 2)])
    con.executemany("INSERT INTO ranges (run_id, range_id, rank, tid, kind, name, start_ns, end_ns, depth) "
                    "VALUES (1, ?, 0, 1, 'nvtx', ?, ?, ?, 0)",
                    [(0, "step", 0, 100), (1, "step", 200, 300), (2, "ProfilerStep#7", 0, 300)])
    steps = timeline.steps(con, 1, 0)
    assert steps[["step_index", "dev_start_ns", "dev_end_ns", "kernels"]].values.tolist() == [
        [0, 150, 190, 2], [1, 400, 450, 1]]


@pytest.mark.parametrize("sort,filters,expect", [
    ([{"colId": "dur_ns", "sort": "desc"}], {}, lambda ks: sorted(range(len(ks)), key=lambda i: (-ks[i][3], i))),
    ([], {"name": {"filterType": "text", "type": "contains", "filter": "K1"}},
     lambda ks: [i for i in range(len(ks)) if i % 5 == 1]),
    ([{"colId": "start_ns", "sort": "asc"}], {"dur_ns": {"filterType": "number", "type": "greaterThan", "filter": 30}},
     lambda ks: sorted((i for i in range(len(ks)) if ks[i][3] > 30), key=lambda i: (ks[i][2], i))),
])
def test_kernel_rows_sort_filter_page(sort: list[dict[str, str]], filters: dict[str, Any], expect: Any) -> None:
    kernels = [(0, 7, (i * 37) % 101, (i * 13) % 50) for i in range(30)]
    con = _store(kernels, base=0)
    want = expect(kernels)
    rows, total = timeline.kernel_rows(con, 1, 5, 10, sort, filters)
    assert total == len(want)
    assert rows["kernel_id"].tolist() == want[5:15]


def test_kernel_rows_refuses_unknown_identifiers() -> None:
    con = _store([(0, 7, 0, 1)], base=0)
    with pytest.raises(ValueError):
        timeline.kernel_rows(con, 1, 0, 10, [{"colId": "name; DROP TABLE runs", "sort": "asc"}], {})
    with pytest.raises(ValueError):
        timeline.kernel_rows(con, 1, 0, 10, [], {"nope": {"filterType": "text", "type": "contains", "filter": "x"}})


def _idle_inside_steps(con: duckdb.DuckDBPyConnection, run: int) -> tuple[int, int, list[tuple[int, int]]]:
    """(first, last, idle intervals of the run's whole window that lie inside one of its `step` ranges)."""
    first, last = con.execute("SELECT min(start_ns), max(end_ns) FROM kernels WHERE run_id = ?", [run]).fetchall()[0]
    steps = con.execute("SELECT start_ns, end_ns FROM ranges WHERE name = 'step' AND run_id = ?", [run]).fetchall()
    win = timeline.window(con, run, 0, first, last)
    inside = [(s, e) for s, e in zip(win.idle["start_ns"], win.idle["end_ns"])
              if any(a <= s and e <= b for a, b in steps)]
    return first, last, inside


def test_bubble_causes_are_the_idle_intervals_inside_steps(tmp_path: Any) -> None:
    """In the hand-made decode trace each kernel's launch call starts when its slot starts and
    ends launch_ns later, when the kernel starts, i.e. after the previous kernel ended: every gap
    inside a step is launch-bound. So the window's bubbles are exactly its device-idle intervals
    that lie inside a step range, each with cause launch_bound. Gaps: gap_ns between kernels of
    an op; between layers, from the all-reduce's end (slot end - gap_ns + 100 + 500) to the next
    layer's first kernel (slot end + launch_ns): launch_ns + gap_ns - 600.
    A second run in the same store (other steps and layers, its own clock) gets its own bubbles
    only: causes are classified per run, whatever else the store holds (no size guard)."""
    from tests.dashboard.decode_traces import DecodeSpec, write_decode_trace
    from tracer.ingest import ingest_path

    spec = DecodeSpec("stock", steps=2, layers=2)
    con = open_store(None)
    _load_timeline_sql(con)
    run = ingest_path(con, write_decode_trace(tmp_path / "t.json", spec), progress=False)[0].run_id
    first, last, inside = _idle_inside_steps(con, run)
    bubbles = timeline.bubble_causes(con, run, 0, first, last)
    assert bubbles is not None and len(inside) > 0
    assert list(zip(bubbles["start_ns"], bubbles["end_ns"])) == inside
    assert set(bubbles["cause"]) == {"launch_bound"}
    assert set(bubbles["gap_ns"]) == {spec.gap_ns, spec.launch_ns + spec.gap_ns - 600}
    # a narrower window (read from the connection's copy) is the overlapping subset
    mid = (first + last) // 2
    part = timeline.bubble_causes(con, run, 0, first, mid)
    assert list(zip(part["start_ns"], part["end_ns"])) == [(s, e) for s, e in inside if s < mid]
    # a second run: its bubbles are its own idle intervals inside its own steps
    spec2 = DecodeSpec("stock", steps=3, layers=1)
    run2 = ingest_path(con, write_decode_trace(tmp_path / "u.json", spec2), progress=False)[0].run_id
    first2, last2, inside2 = _idle_inside_steps(con, run2)
    bubbles2 = timeline.bubble_causes(con, run2, 0, first2, last2)
    assert run2 != run and bubbles2 is not None and len(inside2) > 0
    assert list(zip(bubbles2["start_ns"], bubbles2["end_ns"])) == inside2
    assert set(bubbles2["cause"]) == {"launch_bound"}
