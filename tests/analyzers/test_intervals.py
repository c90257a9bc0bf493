"""Property tests of the interval algebra macros (analyzers/sql/intervals/intervals.sql).

Oracle: set arithmetic on integer ns. An interval [s, e) is the set of unit cells
{s, s+1, ..., e-1}; a union is the set union, its islands are the maximal runs of consecutive
cells (so touching intervals merge, as the macros say), gaps are the runs of missing cells
between the first and last cell, an intersection is the set intersection. Small ranges keep the
sets tiny, so every macro is checked against an answer computed without any sweep.
"""
from __future__ import annotations

from pathlib import Path

import duckdb
from hypothesis import given
from hypothesis import strategies as st
from tests.interval_oracle import point_runs as runs

INTERVALS_SQL = Path(__file__).resolve().parents[2] / "analyzers" / "sql" / "intervals" / "intervals.sql"

# (key, start_ns, length_ns); length 0 rows must be ignored by every macro.
interval = st.tuples(st.integers(0, 2), st.integers(0, 60), st.integers(0, 12))
interval_sets = st.lists(interval, max_size=25)


def cells(rows: list[tuple[int, int, int]]) -> dict[int, set[int]]:
    """Per key, the set of covered unit cells."""
    out: dict[int, set[int]] = {}
    for key, start, length in rows:
        out.setdefault(key, set()).update(range(start, start + length))
    return {k: v for k, v in out.items() if v}


def store(a: list[tuple[int, int, int]], b: list[tuple[int, int, int]]) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    con.execute(INTERVALS_SQL.read_text())
    for name, rows in (("a", a), ("b", b)):
        con.execute(f"CREATE TABLE {name}(key INTEGER, start_ns BIGINT, end_ns BIGINT)")
        if rows:
            con.executemany(f"INSERT INTO {name} VALUES (?, ?, ?)", [(k, s, s + n) for k, s, n in rows])
    return con


@given(interval_sets)
def test_union_is_the_runs_of_covered_cells(a: list[tuple[int, int, int]]) -> None:
    got = store(a, []).execute("SELECT key, start_ns, end_ns FROM intervals_union('a') ORDER BY ALL").fetchall()
    want = sorted((k, s, e) for k, pts in cells(a).items() for s, e in runs(pts))
    assert got == want


@given(interval_sets)
def test_gaps_are_the_missing_runs_inside_the_hull(a: list[tuple[int, int, int]]) -> None:
    got = store(a, []).execute("SELECT key, start_ns, end_ns, gap_ns FROM intervals_gaps('a') ORDER BY ALL").fetchall()
    want = []
    for k, pts in cells(a).items():
        missing = set(range(min(pts), max(pts) + 1)) - pts
        want += [(k, s, e, e - s) for s, e in runs(missing)]
    assert got == sorted(want)


@given(interval_sets, interval_sets)
def test_intersect_is_the_common_cells(a: list[tuple[int, int, int]], b: list[tuple[int, int, int]]) -> None:
    got = store(a, b).execute(
        "SELECT key, start_ns, end_ns FROM intervals_intersect('a', 'b') ORDER BY ALL").fetchall()
    ca, cb = cells(a), cells(b)
    want = sorted((k, s, e) for k in ca.keys() & cb.keys() for s, e in runs(ca[k] & cb[k]))
    assert got == want


@given(interval_sets)
def test_totals_are_span_and_covered_cells(a: list[tuple[int, int, int]]) -> None:
    got = store(a, []).execute(
        "SELECT key, first_start_ns, last_end_ns, span_ns, busy_ns FROM intervals_totals('a') ORDER BY ALL").fetchall()
    want = sorted((k, min(p), max(p) + 1, max(p) + 1 - min(p), len(p)) for k, p in cells(a).items())
    assert got == want


@given(interval_sets, interval_sets)
def test_overlap_totals_are_both_and_a_only_cells(a: list[tuple[int, int, int]], b: list[tuple[int, int, int]]) -> None:
    got = store(a, b).execute(
        "SELECT key, a_ns, both_ns, a_only_ns FROM intervals_overlap_totals('a', 'b') ORDER BY ALL").fetchall()
    ca, cb = cells(a), cells(b)
    want = sorted((k, len(p), len(p & cb.get(k, set())), len(p - cb.get(k, set()))) for k, p in ca.items())
    assert got == want


def test_struct_keys_group_independently() -> None:
    """Keys are compared whole: {run 1, rank 0} and {run 1, rank 1} never merge.

    Rank 0 has [0,10) and [5,20) -> one island [0,20); rank 1 has [10,15) -> [10,15).
    """
    con = duckdb.connect()
    con.execute(INTERVALS_SQL.read_text())
    con.execute("CREATE TABLE t AS SELECT * FROM (VALUES ({'run_id': 1, 'rank': 0}, 0, 10),"
                " ({'run_id': 1, 'rank': 0}, 5, 20), ({'run_id': 1, 'rank': 1}, 10, 15)) v(key, start_ns, end_ns)")
    got = con.execute("SELECT key.rank, start_ns, end_ns FROM intervals_union('t') ORDER BY ALL").fetchall()
    assert got == [(0, 0, 20), (1, 10, 15)]
