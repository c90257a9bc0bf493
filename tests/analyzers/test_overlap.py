"""overlap_per_rank against set arithmetic on integer ns.

Oracle: comm = cells covered by a communication item of the rank, compute = cells covered by a
compute item; overlap = |comm ∩ compute|, exposed = |comm \\ compute|, pct = 100 overlap / comm.
"""
from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracer.store import open_store

SQL = Path(__file__).resolve().parents[2] / "analyzers" / "sql"
item = st.tuples(st.integers(0, 1), st.integers(7, 9), st.sampled_from(("compute", "communication", "memory")),
                 st.integers(0, 80), st.integers(0, 15))


def make_store(items: list[tuple]) -> duckdb.DuckDBPyConnection:
    con = open_store(None)
    for rel in ("intervals/intervals.sql", "temporal/device_items.sql", "overlap/overlap_per_rank.sql"):
        con.execute((SQL / rel).read_text())
    for i, (rank, stream, cat, s, n) in enumerate(items):
        con.execute("INSERT INTO kernels (run_id, kernel_id, rank, stream, name, start_ns, end_ns, category)"
                    " VALUES (1, ?, ?, ?, 'k', ?, ?, ?)", [i, rank, stream, s, s + n, cat])
    return con


@given(st.lists(item, max_size=30))
def test_overlap_per_rank_matches_cells(items: list[tuple]) -> None:
    con = make_store(items)
    got = con.execute("SELECT rank, comm_ns, overlap_ns, exposed_comm_ns, overlap_pct FROM overlap_per_rank"
                      " ORDER BY rank").fetchall()
    want = []
    for rank in (0, 1):
        comm = {t for r, _, c, s, n in items if r == rank and c == "communication" for t in range(s, s + n)}
        comp = {t for r, _, c, s, n in items if r == rank and c == "compute" for t in range(s, s + n)}
        if comm:
            want.append((rank, len(comm), len(comm & comp), len(comm - comp), 100 * len(comm & comp) / len(comm)))
    assert [g[:4] for g in got] == [w[:4] for w in want]
    assert [g[4] for g in got] == pytest.approx([w[4] for w in want])


def test_hand_made_overlap() -> None:
    """comm [5,20) on s8 against compute [0,10) and [15,18) on s7: overlap = 5 + 3 = 8, exposed 7."""
    con = make_store([(0, 7, "compute", 0, 10), (0, 8, "communication", 5, 15), (0, 7, "compute", 15, 3)])
    assert con.execute("SELECT comm_ns, overlap_ns, exposed_comm_ns FROM overlap_per_rank").fetchall() == [(15, 8, 7)]


ATTR_DDL = ("CREATE TABLE attr (run_id INTEGER, rank INTEGER, item_kind VARCHAR, item_id BIGINT, step VARCHAR,"
            " step_index INTEGER, layer VARCHAR, layer_index INTEGER, layer_kind VARCHAR, op VARCHAR, method VARCHAR)")
# (rank, category, start, length, step or None, layer or None)
attributed = st.tuples(st.integers(0, 1), st.sampled_from(("compute", "communication", "memory")),
                       st.integers(0, 60), st.integers(1, 12), st.one_of(st.none(), st.integers(0, 1)),
                       st.sampled_from((None, "L0.mla", "L1.kda")))


@settings(max_examples=40)  # each example builds a store: keep the shared 2 cores free
@given(st.lists(attributed, max_size=25))
def test_overlap_by_layer_matches_cells(items: list[tuple]) -> None:
    """Per (rank, step) and (rank, step, layer): comm cells of that group's comm items against
    the compute cells of the whole rank."""
    con = make_store([])
    con.execute((SQL / "overlap" / "overlap_by_layer.sql").read_text())
    con.execute(ATTR_DDL)
    for i, (rank, cat, s, n, step, layer) in enumerate(items):
        con.execute("INSERT INTO kernels (run_id, kernel_id, rank, stream, name, start_ns, end_ns, category)"
                    " VALUES (1, ?, ?, 7, 'k', ?, ?, ?)", [i, rank, s, s + n, cat])
        con.execute("INSERT INTO attr VALUES (1, ?, 'kernel', ?, ?, ?, ?, NULL, NULL, NULL, 'range')",
                    [rank, i, None if step is None else f"s{step}", step, layer])
    got = con.execute("SELECT rank, step_index, level, layer, comm_ns, overlap_ns, exposed_comm_ns"
                      " FROM overlap_by_layer('attr') ORDER BY ALL").fetchall()
    want = []
    for rank in (0, 1):
        comp = {t for r, c, s, n, _, _ in items if r == rank and c == "compute" for t in range(s, s + n)}
        groups: dict[tuple, set[int]] = {}
        for r, c, s, n, step, layer in items:
            if r == rank and c == "communication" and step is not None:
                groups.setdefault((step, "step", ""), set()).update(range(s, s + n))
                groups.setdefault((step, "layer", layer or ""), set()).update(range(s, s + n))
        want += [(rank, step, level, layer, len(p), len(p & comp), len(p - comp))
                 for (step, level, layer), p in groups.items()]
    assert got == sorted(want)
