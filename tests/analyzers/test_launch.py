"""launch_delays / analyzers.launch against a recount in Python.

Random kernels, each with a runtime launch call and sometimes also a driver call with the same
correlation (the runtime call must be the launch), some launched by cudaGraphLaunch. The oracle
recomputes delay = start - runtime call start, shorter-than-launch, and the nearest-rank
percentiles (p_q = sorted(delays)[ceil(q·n) - 1]) per rank and launch kind.
"""
from __future__ import annotations

import math

import duckdb
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzers.launch import launch_stats
from tracer.store import open_store

# (rank, call_start, call_len, kernel_delay, kernel_len, graph, with_driver_call)
launch = st.tuples(st.integers(0, 1), st.integers(0, 100), st.integers(1, 20), st.integers(0, 50),
                   st.integers(1, 30), st.booleans(), st.booleans())


def build(rows: list[tuple]) -> duckdb.DuckDBPyConnection:
    con = open_store(None)
    con.execute("INSERT INTO runs (run_id, name, source, path, file_hash, world_size) VALUES (1, 'r', 'test', 'x', 'h', 2)")
    for i, (rank, cs, cl, dl, kl, graph, drv) in enumerate(rows):
        con.execute("INSERT INTO api_calls (run_id, call_id, rank, tid, kind, name, start_ns, end_ns, correlation)"
                    " VALUES (1, ?, ?, 1, 'runtime', ?, ?, ?, ?)",
                    [2 * i, rank, "cudaGraphLaunch" if graph else "cudaLaunchKernel", cs, cs + cl, i])
        if drv:  # a driver call under the runtime call, starting later: must not be taken as the launch
            con.execute("INSERT INTO api_calls (run_id, call_id, rank, tid, kind, name, start_ns, end_ns, correlation)"
                        " VALUES (1, ?, ?, 1, 'driver', 'cuLaunchKernel', ?, ?, ?)", [2 * i + 1, rank, cs + 1, cs + cl, i])
        con.execute("INSERT INTO kernels (run_id, kernel_id, rank, stream, correlation, name, start_ns, end_ns, category)"
                    " VALUES (1, ?, ?, 7, ?, 'k', ?, ?, 'compute')", [i, rank, i, cs + dl, cs + dl + kl])
    return con


def nearest_rank(values: list[int], q: float) -> int:
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


@settings(max_examples=40)
@given(st.lists(launch, min_size=1, max_size=25))
def test_launch_stats_match_recount(rows: list[tuple]) -> None:
    got = {(r["rank"], r["launch"]): r for r in launch_stats(build(rows), 1)["ranks"]}
    want_keys = set()
    for rank in (0, 1):
        for kind in ("direct", "graph"):
            mine = [r for r in rows if r[0] == rank and r[5] == (kind == "graph")]
            if not mine:
                continue
            want_keys.add((rank, kind))
            delays = [dl for _, _, _, dl, _, _, _ in mine]
            g = got[(rank, kind)]
            assert g["items"] == len(mine)
            assert (g["p50_delay_ns"], g["p90_delay_ns"], g["p99_delay_ns"], g["max_delay_ns"]) == (
                nearest_rank(delays, 0.5), nearest_rank(delays, 0.9), nearest_rank(delays, 0.99), max(delays))
            # A graph replay has no per-item launch call, so nothing counts as shorter than it.
            want_short = 0 if kind == "graph" else sum(kl < cl for _, _, cl, _, kl, _, _ in mine)
            assert g["shorter_than_launch"] == want_short
    assert set(got) == want_keys


def test_not_applicable_without_launch_calls() -> None:
    con = open_store(None)
    con.execute("INSERT INTO kernels (run_id, kernel_id, rank, stream, correlation, name, start_ns, end_ns, category)"
                " VALUES (1, 0, 0, 7, 5, 'k', 0, 10, 'compute')")
    assert launch_stats(con, 1)["not_applicable"].startswith("no launch calls")
