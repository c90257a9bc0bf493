"""bubbles_in_steps / bubble_steps with p_run (one run, filtered in the first scans) against the
same macros over every run of the store, filtered afterwards. The all-runs form is checked
against the cell oracle in test_bubbles.py; here random stores hold several runs on overlapping
clocks, with launch calls and host syncs, so every cause input is cut to the run as well: a
filter that dropped or leaked another run's items, gaps, calls or syncs changes a row."""
from __future__ import annotations

import duckdb
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.analyzers.test_bubbles import make_store

COLS = ("run_id, rank, step_index, step, start_ns, end_ns, gap_ns, cause, layer, op, prev_kind, prev_id, "
        "prev_stream, next_kind, next_id, next_stream")
STEP_COLS = "run_id, rank, step_index, step, span_ns, busy_ns, bubble_ns, bubbles, launch_bound_ns, other_ns, host_sync_ns"

# (run, rank, stream, start, length, step or None, launch end relative to the kernel start)
item = st.tuples(st.integers(1, 3), st.integers(0, 1), st.integers(7, 8), st.integers(0, 40), st.integers(1, 8),
                 st.one_of(st.none(), st.integers(0, 1)), st.integers(-10, 5))
# (run, rank, start, length) of a cudaDeviceSynchronize
sync = st.tuples(st.integers(1, 3), st.integers(0, 1), st.integers(0, 60), st.integers(1, 40))


def _fill(con: duckdb.DuckDBPyConnection, items: list[tuple], syncs: list[tuple]) -> None:
    for kid, (run, rank, stream, s, n, step, launch_end) in enumerate(items):
        con.execute("INSERT INTO kernels (run_id, kernel_id, rank, stream, correlation, name, start_ns, end_ns,"
                    " category) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'compute')",
                    [run, kid, rank, stream, kid, f"k{kid}", s, s + n])
        con.execute("INSERT INTO attr VALUES (?, ?, 'kernel', ?, ?, ?, ?, NULL, NULL, ?, 'range')",
                    [run, rank, kid, None if step is None else f"s{step}", step, f"L{kid % 2}", f"op{kid % 3}"])
        con.execute("INSERT INTO api_calls (run_id, call_id, rank, tid, kind, name, start_ns, end_ns, correlation)"
                    " VALUES (?, ?, ?, 1, 'runtime', 'cudaLaunchKernel', ?, ?, ?)",
                    [run, kid, rank, s + launch_end - 3, s + launch_end, kid])
    for i, (run, rank, s, n) in enumerate(syncs):
        con.execute("INSERT INTO api_calls (run_id, call_id, rank, tid, kind, name, start_ns, end_ns, correlation)"
                    " VALUES (?, ?, ?, 1, 'runtime', 'cudaDeviceSynchronize', ?, ?, NULL)",
                    [run, 10_000 + i, rank, s, s + n])


@settings(max_examples=30)  # each example builds a store: keep the shared 2 cores free
@given(st.lists(item, min_size=1, max_size=30), st.lists(sync, max_size=6))
# run 1: a host_sync bubble [10, 20) (its sync [5, 35)); run 2, same clock: a launch_bound one
@example([(1, 0, 7, 0, 10, 0, 0), (1, 0, 7, 20, 10, 0, 0), (2, 0, 7, 0, 10, 0, 0), (2, 0, 7, 20, 10, 0, 0)],
         [(1, 0, 5, 30)])
def test_per_run_equals_all_runs_filtered(items: list[tuple], syncs: list[tuple]) -> None:
    con = make_store()
    _fill(con, items, syncs)
    for run in (1, 2, 3):
        one = con.execute(f"SELECT {COLS} FROM bubbles_in_steps('attr', p_run := ?)", [run]).fetchall()
        every = con.execute(f"SELECT {COLS} FROM bubbles_in_steps('attr') WHERE run_id = ?", [run]).fetchall()
        assert sorted(one, key=repr) == sorted(every, key=repr)
        one = con.execute(f"SELECT {STEP_COLS} FROM bubble_steps('attr', p_run := ?)", [run]).fetchall()
        every = con.execute(f"SELECT {STEP_COLS} FROM bubble_steps('attr') WHERE run_id = ?", [run]).fetchall()
        assert sorted(one, key=repr) == sorted(every, key=repr)
    # the runs partition the store's bubbles
    total = con.execute("SELECT count(*) FROM bubbles_in_steps('attr')").fetchall()[0][0]
    per_run = sum(con.execute("SELECT count(*) FROM bubbles_in_steps('attr', p_run := ?)", [r]).fetchall()[0][0]
                  for r in (1, 2, 3))
    assert per_run == total
