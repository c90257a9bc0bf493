"""Prefetch effectiveness: is each prefetch hidden under other work, early enough for the kernel
that needs it, and does that kernel get faster than in a run without prefetch?

For every prefetch kernel or copy (classifier category 'prefetch', or attributed to an op whose
name contains 'prefetch'): hidden_pct (share of its time with non-prefetch work on another
stream), lead_ns over its consumer (the first kernel on another stream, starting at or after the
prefetch starts, in a later layer; in another op when layers are unknown), and late (consumer
started before the prefetch ended). With a baseline run (same workload, no prefetch) the
consumer's duration is compared with the median over the baseline's steps of the first kernel
of the same layer and op. Exact rules: analyzers/sql/prefetch/prefetch.sql, docs/metrics.md.
"""
from __future__ import annotations

import statistics
from typing import Any

import duckdb

from analyzers.attribution import attribute, load_sql

NOT_APPLICABLE = "no prefetch kernels or copies"
ITEMS_SQL = """
SELECT rank, item_kind, item_id, name, stream, step_index, layer, op, start_ns, end_ns, dur_ns,
       hidden_ns, hidden_pct, consumer_id, consumer_name, consumer_layer, consumer_op,
       consumer_start_ns, consumer_dur_ns, lead_ns, late
FROM prefetch_items('kernel_attribution') WHERE run_id = ?
ORDER BY rank, start_ns, item_kind, item_id"""
BASELINE_SQL = """
SELECT layer, op, dur_ns FROM first_kernel_by_layer_op('kernel_attribution') WHERE run_id = ?"""


def _rows(con: duckdb.DuckDBPyConnection, sql: str, params: list[Any]) -> list[dict[str, Any]]:
    cur = con.execute(sql, params)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def prefetch(con: duckdb.DuckDBPyConnection, run_id: int, baseline: int | None = None,
             **attribution_kwargs: Any) -> dict[str, Any]:
    """Per-prefetch rows and a duration-weighted summary for one run; `baseline` is the run_id
    of the same workload without prefetch (already in `con`)."""
    load_sql(con, "temporal", "prefetch")
    attribute(con, [run_id] + ([baseline] if baseline is not None else []), **attribution_kwargs)
    rows = _rows(con, ITEMS_SQL, [run_id])
    if not rows:
        return {"run_id": run_id, "not_applicable": NOT_APPLICABLE, "prefetches": [],
                "summary": {"count": 0, "hidden_pct": None}}
    if baseline is not None:
        base: dict[tuple, list[int]] = {}
        for r in _rows(con, BASELINE_SQL, [baseline]):
            base.setdefault((r["layer"], r["op"]), []).append(r["dur_ns"])
        for r in rows:
            durs = base.get((r["consumer_layer"], r["consumer_op"]))
            ref = int(statistics.median_low(durs)) if durs and r["consumer_dur_ns"] is not None else None
            r["baseline_consumer_dur_ns"] = ref
            r["consumer_dur_change_ns"] = None if ref is None else r["consumer_dur_ns"] - ref
    total = sum(r["dur_ns"] for r in rows)
    leads = [r["lead_ns"] for r in rows if r["lead_ns"] is not None]
    summary = {
        "count": len(rows),
        "dur_ns": total,
        "hidden_ns": sum(r["hidden_ns"] for r in rows),
        "hidden_pct": 100.0 * sum(r["hidden_ns"] for r in rows) / total if total else None,
        "late": sum(bool(r["late"]) for r in rows),
        "without_consumer": sum(r["consumer_id"] is None for r in rows),
        "median_lead_ns": int(statistics.median_low(leads)) if leads else None,
    }
    return {"run_id": run_id, "baseline_run_id": baseline, "prefetches": rows, "summary": summary}
