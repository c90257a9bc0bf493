"""temporal_breakdown and stream_gaps against set arithmetic on integer ns.

Random kernels and memops (a few ranks, streams and categories, small ns ranges) go into a store;
the oracle counts covered unit cells: busy = cells covered by any item of the rank, compute =
cells covered by a compute kernel, span = last cell + 1 - first cell, idle = span - busy.
Per stream, a gap is a run of cells missing between the stream's first and last cell.
"""
from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.interval_oracle import point_runs as runs
from tracer.store import open_store

SQL = Path(__file__).resolve().parents[2] / "analyzers" / "sql"
CATEGORIES = ("compute", "communication", "memory", "prefetch")
# (rank, stream, category, is_memop, start_ns, length_ns)
item = st.tuples(st.integers(0, 1), st.integers(7, 9), st.sampled_from(CATEGORIES), st.booleans(),
                 st.integers(0, 80), st.integers(0, 15))


def load_sql(con: duckdb.DuckDBPyConnection, *files: str) -> None:
    """Run only the named analyzer SQL files (in the order given), independent of other areas."""
    for rel in ("intervals/intervals.sql", *files):
        con.execute((SQL / rel).read_text())


def make_store(items: list[tuple]) -> duckdb.DuckDBPyConnection:
    con = open_store(None)
    load_sql(con, "temporal/device_items.sql", "temporal/temporal_breakdown.sql", "temporal/stream_gaps.sql")
    for i, (rank, stream, cat, is_memop, s, n) in enumerate(items):
        if is_memop:
            con.execute("INSERT INTO memops (run_id, memop_id, rank, stream, kind, name, start_ns, end_ns, category)"
                        " VALUES (1, ?, ?, ?, 'memcpy', 'Memcpy DtoD', ?, ?, ?)", [i, rank, stream, s, s + n, cat])
        else:
            con.execute("INSERT INTO kernels (run_id, kernel_id, rank, stream, name, start_ns, end_ns, category)"
                        " VALUES (1, ?, ?, ?, 'k', ?, ?, ?)", [i, rank, stream, s, s + n, cat])
    return con


@given(st.lists(item, max_size=30))
def test_temporal_breakdown_matches_cell_counts(items: list[tuple]) -> None:
    con = make_store(items)
    got = con.execute("SELECT rank, span_ns, busy_ns, idle_ns, compute_ns, non_compute_ns, idle_pct, compute_pct,"
                      " non_compute_pct FROM temporal_breakdown ORDER BY rank").fetchall()
    want = []
    for rank in (0, 1):
        busy = {t for r, _, _, _, s, n in items if r == rank for t in range(s, s + n)}
        if not busy:
            continue
        comp = {t for r, _, c, m, s, n in items if r == rank and c == "compute" for t in range(s, s + n)}
        span = max(busy) + 1 - min(busy)
        want.append((rank, span, len(busy), span - len(busy), len(comp), len(busy) - len(comp),
                     100 * (span - len(busy)) / span, 100 * len(comp) / span, 100 * (len(busy) - len(comp)) / span))
    assert [g[:6] for g in got] == [w[:6] for w in want]
    for g, w in zip(got, want):
        assert g[6:] == pytest.approx(w[6:])
        assert sum(g[6:]) == pytest.approx(100.0)


@given(st.lists(item, max_size=30))
def test_stream_gaps_are_missing_runs_per_stream(items: list[tuple]) -> None:
    con = make_store(items)
    got = con.execute("SELECT rank, stream, start_ns, end_ns, gap_ns FROM stream_gaps ORDER BY ALL").fetchall()
    want = []
    for rank in (0, 1):
        for stream in (7, 8, 9):
            pts = {t for r, st_, _, _, s, n in items if (r, st_) == (rank, stream) for t in range(s, s + n)}
            if pts:
                want += [(rank, stream, s, e, e - s) for s, e in runs(set(range(min(pts), max(pts) + 1)) - pts)]
    assert got == sorted(want)


def test_hand_made_breakdown() -> None:
    """Three kernels on one rank: compute [0,10) on s7, comm [5,20) on s8, compute [30,40) on s7.

    span = 40, busy = |[0,20) ∪ [30,40)| = 30, idle = 10, compute = 20, non-compute = 10
    (the comm part [10,20) not under compute). Stream 7 has one gap [10,30); stream 8 none.
    """
    con = make_store([(0, 7, "compute", False, 0, 10), (0, 8, "communication", False, 5, 15),
                      (0, 7, "compute", False, 30, 10)])
    assert con.execute("SELECT span_ns, busy_ns, idle_ns, compute_ns, non_compute_ns, idle_pct FROM temporal_breakdown"
                       ).fetchall() == [(40, 30, 10, 20, 10, 25.0)]
    assert con.execute("SELECT stream, start_ns, end_ns FROM stream_gaps").fetchall() == [(7, 10, 30)]
