"""bubbles_in_steps / bubble_steps (analyzers/sql/bubbles/bubbles.sql) and analyzers.bubbles.

Oracles: (1) set arithmetic on integer ns for random items and random step attribution: a
bubble is a run of uncovered cells of the rank (all streams) strictly between its first and
last covered cell that lies inside the hull of some step's items (lowest step index wins);
prev/next are found by scanning the items; step totals are recounted from the cells.
(2) Hand-made traces, one per cause, whose cause follows from the rule in the docstring.
"""
from __future__ import annotations

from pathlib import Path

import duckdb
from hypothesis import given, settings
from hypothesis import strategies as st

from tracer.store import open_store

SQL = Path(__file__).resolve().parents[2] / "analyzers" / "sql"
ATTR_DDL = ("CREATE TABLE attr (run_id INTEGER, rank INTEGER, item_kind VARCHAR, item_id BIGINT, step VARCHAR,"
            " step_index INTEGER, layer VARCHAR, layer_index INTEGER, layer_kind VARCHAR, op VARCHAR, method VARCHAR)")


def make_store() -> duckdb.DuckDBPyConnection:
    con = open_store(None)
    for rel in ("intervals/intervals.sql", "temporal/device_items.sql", "temporal/stream_gaps.sql",
                "launch/launch_delays.sql", "bubbles/bubbles.sql"):
        con.execute((SQL / rel).read_text())
    con.execute(ATTR_DDL)
    return con


def kernel(con: duckdb.DuckDBPyConnection, kid: int, start: int, end: int, stream: int = 7, corr: int | None = None,
           rank: int = 0, step: int | None = 0, layer: str | None = None, op: str | None = None,
           graph_id: int | None = None) -> None:
    con.execute("INSERT INTO kernels (run_id, kernel_id, rank, stream, correlation, name, start_ns, end_ns,"
                " graph_id, category) VALUES (1, ?, ?, ?, ?, ?, ?, ?, ?, 'compute')",
                [kid, rank, stream, corr, f"k{kid}", start, end, graph_id])
    con.execute("INSERT INTO attr VALUES (1, ?, 'kernel', ?, ?, ?, ?, NULL, NULL, ?, 'range')",
                [rank, kid, None if step is None else f"s{step}", step, layer, op])


def call(con: duckdb.DuckDBPyConnection, name: str, start: int, end: int, corr: int | None = None) -> None:
    con.execute("INSERT INTO api_calls (run_id, call_id, rank, tid, kind, name, start_ns, end_ns, correlation)"
                " VALUES (1, (SELECT count(*) FROM api_calls), 0, 1, 'runtime', ?, ?, ?, ?)", [name, start, end, corr])


def causes(con: duckdb.DuckDBPyConnection) -> list[tuple]:
    return con.execute("SELECT start_ns, end_ns, cause, prev_name, next_name FROM bubbles_in_steps('attr')"
                       " ORDER BY start_ns").fetchall()


def test_launch_bound() -> None:
    """k1 [0,100) then k2 [150,200), k2's cudaLaunchKernel runs [120,140): it ended after the gap
    began at 100, so the bubble [100,150) is launch_bound."""
    con = make_store()
    kernel(con, 1, 0, 100, corr=1)
    kernel(con, 2, 150, 200, corr=2)
    call(con, "cudaLaunchKernel", -50, -40, 1)
    call(con, "cudaLaunchKernel", 120, 140, 2)
    assert causes(con) == [(100, 150, "launch_bound", "k1", "k2")]


def test_host_sync_wins_over_launch_bound() -> None:
    """Same, but a cudaStreamSynchronize [60,130) overlaps the gap [100,150): host_sync (the
    late launch is the sync's consequence, so host_sync is checked first)."""
    con = make_store()
    kernel(con, 1, 0, 100, corr=1)
    kernel(con, 2, 150, 200, corr=2)
    call(con, "cudaStreamSynchronize", 60, 130)
    call(con, "cudaLaunchKernel", 135, 140, 2)
    assert causes(con) == [(100, 150, "host_sync", "k1", "k2")]


def test_sync_while_work_is_queued_is_not_the_cause() -> None:
    """k2 was launched at [10,20), long before the gap [100,150) began; a cudaDeviceSynchronize
    [50,300) overlaps the gap but the host was only waiting for queued work: not host_sync, and
    not launch_bound either, so 'other'."""
    con = make_store()
    kernel(con, 1, 0, 100, corr=1)
    kernel(con, 2, 150, 200, corr=2)
    call(con, "cudaLaunchKernel", 10, 20, 2)
    call(con, "cudaDeviceSynchronize", 50, 300)
    assert causes(con) == [(100, 150, "other", "k1", "k2")]


def test_graph_boundary_and_gap_inside_one_replay() -> None:
    """Replay A (cudaGraphLaunch corr 10) runs k1 [0,10) and k2 [20,30); replay B (corr 11)
    runs k3 [50,60). [10,20) is inside replay A: not a boundary, launch is not a cause for
    graph kernels, the host sync [46,70) came after: the device idled between two nodes of one
    graph, 'in_graph'. [30,50) crosses into replay B: graph_boundary (checked before the sync
    that overlaps it)."""
    con = make_store()
    kernel(con, 1, 0, 10, corr=10, graph_id=5)
    kernel(con, 2, 20, 30, corr=10, graph_id=5)
    kernel(con, 3, 50, 60, corr=11, graph_id=5)
    call(con, "cudaGraphLaunch", -100, 40, 10)
    call(con, "cudaGraphLaunch", 41, 45, 11)
    call(con, "cudaStreamSynchronize", 46, 70)  # host waits on replay A: not a cause inside it
    assert causes(con) == [(10, 20, "in_graph", "k1", "k2"), (30, 50, "graph_boundary", "k2", "k3")]


def test_other_when_nothing_explains_the_gap() -> None:
    """Two eager kernels, both issued long before (launch calls end at 1 and 2), no sync, no
    wait record: the gap [10,20) has no cause: 'other'."""
    con = make_store()
    kernel(con, 1, 0, 10, corr=20)
    kernel(con, 2, 20, 30, corr=21)
    call(con, "cudaLaunchKernel", 0, 1, 20)
    call(con, "cudaLaunchKernel", 1, 2, 21)
    assert causes(con) == [(10, 20, "other", "k1", "k2")]


def test_event_wait() -> None:
    """k1 [0,100) on stream 7, k2 [130,160) on stream 8 launched early ([1,2)); a Stream Wait
    Event on stream 8 waiting on stream 9 at [110,111) lies between stream 8's previous work
    (none: the gap start 100 is used) and k2's start: event_wait."""
    con = make_store()
    kernel(con, 1, 0, 100, stream=7, corr=1)
    kernel(con, 2, 130, 160, stream=8, corr=2)
    call(con, "cudaLaunchKernel", 1, 2, 2)
    con.execute("INSERT INTO gpu_syncs (run_id, rank, stream, name, start_ns, end_ns, wait_on_stream)"
                " VALUES (1, 0, 8, 'Stream Wait Event', 110, 111, 9)")
    assert causes(con) == [(100, 130, "event_wait", "k1", "k2")]


def test_other_and_steps() -> None:
    """Step 0 = k1 [0,10), k2 [30,40) (launched early); step 1 = k3 [100,110), k4 [115,120).
    Bubbles: [10,30) in step 0 (other), [110,115) in step 1; [40,100) lies between steps and is
    no bubble. Step 0: span 40, bubble 20, busy 20; step 1: span 20, bubble 5, busy 15."""
    con = make_store()
    for kid, s, e, step in ((1, 0, 10, 0), (2, 30, 40, 0), (3, 100, 110, 1), (4, 115, 120, 1)):
        kernel(con, kid, s, e, corr=kid, step=step)
        call(con, "cudaLaunchKernel", -10 - kid, -5 - kid, kid)
    assert [c[:3] for c in causes(con)] == [(10, 30, "other"), (110, 115, "other")]
    got = con.execute("SELECT step_index, span_ns, busy_ns, bubble_ns, other_ns FROM bubble_steps('attr')"
                      " ORDER BY step_index").fetchall()
    assert got == [(0, 40, 20, 20, 20), (1, 20, 15, 5, 5)]


# (rank, stream, start, length, step or None)
item = st.tuples(st.integers(0, 1), st.integers(7, 8), st.integers(0, 60), st.integers(1, 10),
                 st.one_of(st.none(), st.integers(0, 2)))


@settings(max_examples=40)  # each example builds a store: keep the shared 2 cores free
@given(st.lists(item, min_size=1, max_size=20))
def test_bubbles_match_cell_oracle(items: list[tuple]) -> None:
    con = make_store()
    for kid, (rank, stream, s, n, step) in enumerate(items):
        kernel(con, kid, s, s + n, stream=stream, rank=rank, step=step)
    got = con.execute("SELECT rank, step_index, start_ns, end_ns, prev_id, next_id FROM bubbles_in_steps('attr')"
                      " ORDER BY rank, start_ns").fetchall()
    want, totals = [], {}
    for rank in (0, 1):
        mine = [(kid, it) for kid, it in enumerate(items) if it[0] == rank]
        cov = {t for _, (_, _, s, n, _) in mine for t in range(s, s + n)}
        if not cov:
            continue
        hulls = {}
        for _, (_, _, s, n, step) in mine:
            if step is not None:
                lo, hi = hulls.get(step, (s, s + n))
                hulls[step] = (min(lo, s), max(hi, s + n))
        gaps, t = [], min(cov)
        while t <= max(cov):
            if t not in cov:
                u = t
                while u not in cov:
                    u += 1
                gaps.append((t, u))
                t = u
            t += 1
        for step, (lo, hi) in hulls.items():
            totals[(rank, step)] = [hi - lo, 0]
        for s, e in gaps:
            inside = sorted(k for k, (lo, hi) in hulls.items() if lo <= s and e <= hi)
            if not inside:
                continue
            prev = sorted(((-it[2], it[1], kid) for kid, it in mine if it[2] + it[3] == s))[0][2]
            nxt = sorted(((it[1], kid) for kid, it in mine if it[2] == e))[0][1]
            want.append((rank, inside[0], s, e, prev, nxt))
            totals[(rank, inside[0])][1] += e - s
    assert sorted(got) == sorted(want)
    steps = con.execute("SELECT rank, step_index, span_ns, bubble_ns, busy_ns FROM bubble_steps('attr')").fetchall()
    assert sorted(steps) == sorted((r, s, span, b, span - b) for (r, s), (span, b) in totals.items())
