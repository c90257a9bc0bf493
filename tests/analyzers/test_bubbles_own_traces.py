"""Bubbles on our bundled K3 traces (traces/*.json.gz), recounted in Python from the store.

For every step of every bundled trace: the step window is the hull of the items attributed to
it; busy = |∪ all device items of the rank ∩ window| by a plain sweep; then span = busy + bubble
and the causes add up to the bubbles. Eager captures have a launch call for every kernel, so the
launch statistics must cover every kernel as a direct launch; graph captures replay every
in-step kernel from a graph launch.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from analyzers.bubbles import CAUSES, bubbles
from analyzers.launch import launch_stats
from tracer.ingest import ingest_path
from tracer.store import open_store

TRACES = sorted((Path(__file__).resolve().parents[2] / "traces").glob("*.json.gz"))


def params() -> list:
    if not TRACES:
        return [pytest.param(None, marks=pytest.mark.skip(reason="no bundled traces under traces/ yet"))]
    return [pytest.param(p, id=p.name) for p in TRACES]


def clipped_union(rows: list[tuple[int, int]], lo: int, hi: int) -> int:
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in rows if e > lo and s < hi):
        if cur_e is not None and s <= cur_e:
            cur_e = max(cur_e, e)
            continue
        if cur_e is not None:
            total += cur_e - cur_s
        cur_s, cur_e = s, e
    return total + (cur_e - cur_s if cur_e is not None else 0)


@pytest.mark.parametrize("trace", params())
def test_step_totals_recount(trace: Path) -> None:
    con = open_store(None)
    [run] = ingest_path(con, trace, progress=False)
    doc = bubbles(con, run.run_id, top=5)
    assert doc["steps"], "our captures have `step` ranges"
    items = con.execute("SELECT d.rank, d.start_ns, d.end_ns, a.step_index FROM device_items d"
                        " JOIN kernel_attribution a ON a.run_id = d.run_id AND a.item_kind = d.item_kind"
                        " AND a.item_id = d.item_id WHERE d.run_id = ?", [run.run_id]).fetchall()
    for s in doc["steps"]:
        mine = [(a, b) for r, a, b, st in items if r == s["rank"] and st == s["step_index"]]
        lo, hi = min(a for a, _ in mine), max(b for _, b in mine)
        busy = clipped_union([(a, b) for r, a, b, _ in items if r == s["rank"]], lo, hi)
        assert (s["span_ns"], s["busy_ns"], s["bubble_ns"]) == (hi - lo, busy, hi - lo - busy)
        assert sum(s["by_cause"][c] for c in CAUSES) == s["bubble_ns"]
    kernels = con.execute("SELECT count(*) FROM kernels WHERE run_id = ?", [run.run_id]).fetchall()[0][0]
    kinds = {r["launch"]: r["items"] for r in launch_stats(con, run.run_id)["ranks"]}
    if "_eager" in trace.name:
        assert kinds.get("graph", 0) == 0 and kinds["direct"] >= kernels
    else:
        in_step = con.execute("SELECT count(*) FROM kernel_attribution WHERE run_id = ? AND item_kind = 'kernel'"
                              " AND step_index IS NOT NULL", [run.run_id]).fetchall()[0][0]
        assert kinds["graph"] >= in_step
