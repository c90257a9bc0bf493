"""prefetch_items (analyzers/sql/prefetch/prefetch.sql) and analyzers.prefetch.

Oracles: (1) random items with random streams, layers and 'prefetch' categories: hidden_ns is
recounted as |cells of P ∩ cells of non-prefetch items on other streams| and the consumer is
found by scanning the items with the rule of the docstring; (2) a hand-made Kineto trace
ingested end to end, whose answer is derived below.
"""
from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzers.prefetch import NOT_APPLICABLE, prefetch
from tests.kineto_builder import KinetoTraceBuilder
from tracer.ingest import ingest_path
from tracer.store import open_store

SQL = Path(__file__).resolve().parents[2] / "analyzers" / "sql"
ATTR_DDL = ("CREATE TABLE attr (run_id INTEGER, rank INTEGER, item_kind VARCHAR, item_id BIGINT, step VARCHAR,"
            " step_index INTEGER, layer VARCHAR, layer_index INTEGER, layer_kind VARCHAR, op VARCHAR, method VARCHAR)")
# (stream, start, length, is_prefetch, layer index or None, op or None)
item = st.tuples(st.integers(7, 9), st.integers(0, 50), st.integers(1, 15), st.booleans(),
                 st.one_of(st.none(), st.integers(0, 2)), st.sampled_from(("a", "b", None)))


@settings(max_examples=40)
@given(st.lists(item, min_size=1, max_size=20))
def test_hidden_and_consumer_match_scan(items: list[tuple]) -> None:
    con = open_store(None)
    for rel in ("intervals/intervals.sql", "temporal/device_items.sql", "prefetch/prefetch.sql"):
        con.execute((SQL / rel).read_text())
    con.execute(ATTR_DDL)
    for i, (stream, s, n, pf, li, op) in enumerate(items):
        con.execute("INSERT INTO kernels (run_id, kernel_id, rank, stream, name, start_ns, end_ns, category)"
                    " VALUES (1, ?, 0, ?, 'k', ?, ?, ?)", [i, stream, s, s + n, "prefetch" if pf else "compute"])
        con.execute("INSERT INTO attr VALUES (1, 0, 'kernel', ?, 's', 0, ?, ?, 'kda', ?, 'range')",
                    [i, None if li is None else f"L{li}.kda", li, op])
    got = {r[0]: r[1:] for r in con.execute(
        "SELECT item_id, hidden_ns, consumer_id, lead_ns, late FROM prefetch_items('attr')").fetchall()}
    want = {}
    for i, (stream, s, n, pf, li, op) in enumerate(items):
        if not pf:
            continue
        other = {t for st_, s2, n2, pf2, _, _ in items if st_ != stream and not pf2 for t in range(s2, s2 + n2)}
        hidden = len(set(range(s, s + n)) & other)
        # a later layer when the prefetch has a layer index, else another (or no) op
        cands = sorted((s2, j) for j, (st_, s2, n2, pf2, li2, op2) in enumerate(items)
                       if st_ != stream and not pf2 and s2 >= s
                       and ((li2 is not None and li2 > li) if li is not None else (op2 is None or op2 != op)))
        if cands:
            cs, cid = cands[0]
            want[i] = (hidden, cid, cs - (s + n), cs < s + n)
        else:
            want[i] = (hidden, None, None, None)
    assert got == want


def _trace(tmp: Path, name: str, with_prefetch: bool) -> Path:
    """Host: step [0,2000) > L0.kda [10,1000) > in_proj [20,100) launches k_a at [30,40);
    prefetch [100,200) launches P at [110,120) on stream 9; L1.kda [1000,1900) > in_proj
    [1010,1100) launches k_b at [1020,1030). Device: k_a [2000,3000) s7, P [2500,4000) s9,
    k_b [3600,4600) s7 (baseline, no prefetch: k_b [3000,4200))."""
    b = KinetoTraceBuilder()
    b.annotation("step", 0, 2000)
    b.annotation("L0.kda", 10, 990)
    b.annotation("in_proj", 20, 80)
    b.kernel("k_a", 2000, 1000, stream=7, correlation=b.runtime("cudaLaunchKernel", 30, 10))
    if with_prefetch:
        b.annotation("prefetch", 100, 100)
        b.kernel("weight_copy", 2500, 1500, stream=9, correlation=b.runtime("cudaLaunchKernel", 110, 10))
    b.annotation("L1.kda", 1000, 900)
    b.annotation("in_proj", 1010, 90)
    kb = (3600, 1000) if with_prefetch else (3000, 1200)
    b.kernel("k_b", *kb, stream=7, correlation=b.runtime("cudaLaunchKernel", 1020, 10))
    return b.write(tmp / name)


def test_hand_made_prefetch(tmp_path: Path) -> None:
    """P [2500,4000) is covered on stream 7 by k_a over [2500,3000) and k_b over [3600,4000):
    hidden 900 of 1500 ns = 60 %. Its consumer is k_b (first kernel on another stream starting
    at or after 2500 in a later layer, L1 > L0): lead = 3600 - 4000 = -400, late. In the
    baseline the first kernel of (L1.kda, in_proj) lasts 1200 ns, k_b lasts 1000: change -200."""
    con = open_store(None)
    [run] = ingest_path(con, _trace(tmp_path, "pf.json", True), progress=False)
    [base] = ingest_path(con, _trace(tmp_path, "base.json", False), progress=False)
    out = prefetch(con, run.run_id, baseline=base.run_id)
    [p] = out["prefetches"]
    assert (p["name"], p["layer"], p["start_ns"] - _t0(con, run.run_id), p["hidden_ns"]) == ("weight_copy", "L0.kda", 2500, 900)
    assert p["hidden_pct"] == pytest.approx(60.0)
    assert (p["consumer_name"], p["lead_ns"], p["late"]) == ("k_b", -400, True)
    assert (p["baseline_consumer_dur_ns"], p["consumer_dur_change_ns"]) == (1200, -200)
    assert out["summary"]["count"] == 1 and out["summary"]["hidden_pct"] == pytest.approx(60.0)
    assert prefetch(con, base.run_id)["not_applicable"] == NOT_APPLICABLE


def _t0(con: duckdb.DuckDBPyConnection, run_id: int) -> int:
    """Device time of the trace's first kernel (k_a at 2000 ns): ingest may add a base time."""
    return con.execute("SELECT min(start_ns) FROM kernels WHERE run_id = ?", [run_id]).fetchall()[0][0] - 2000


def test_cli_with_baseline_trace(tmp_path: Path) -> None:
    """The same two traces through `decodescope prefetch TRACE --baseline TRACE`: change -200 ns."""
    import json

    from click.testing import CliRunner

    from cli.exit_codes import OK
    from cli.main import main

    pf, base = _trace(tmp_path, "pf.json", True), _trace(tmp_path, "base.json", False)
    res = CliRunner().invoke(main, ["prefetch", str(pf), "--baseline", str(base), "--format", "json"])
    assert res.exit_code == OK, res.output
    [p] = json.loads(res.output)["prefetches"]
    assert (p["lead_ns"], p["late"], p["consumer_dur_change_ns"]) == (-400, True, -200)
