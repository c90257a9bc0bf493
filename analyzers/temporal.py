"""Temporal breakdown per rank in HTA's sense, so users can check us against HTA.

Over the GPU span of a rank (first device item start to last end, all streams): idle = time no
kernel or memop runs on any stream, compute = union of compute kernels, non-compute = the rest
of the busy time; idle + compute + non-compute = span exactly (integer ns). It matches HTA's
get_temporal_breakdown except where we differ on purpose (HTA drops kernels not launched
before the last ProfilerStep and counts cuda_sync / stream-carrying cpu_op rows as GPU time;
kinds come from our classifier, not HTA's name regex): see bench/hta_compare.md.
"""
from __future__ import annotations

from typing import Any

import duckdb

from analyzers.attribution import load_sql

NOT_APPLICABLE = "no kernels or memops in this run"
RANKS_SQL = """
SELECT rank, span_ns, busy_ns, idle_ns, compute_ns, non_compute_ns, idle_pct, compute_pct, non_compute_pct
FROM temporal_breakdown WHERE run_id = ? ORDER BY rank"""


def temporal_breakdown(con: duckdb.DuckDBPyConnection, run_id: int) -> dict[str, Any]:
    """{"run_id", "ranks": [{rank, span_ns, busy_ns, idle_ns, compute_ns, non_compute_ns,
    idle_pct, compute_pct, non_compute_pct}]}, or not applicable when the run has no device item."""
    load_sql(con, "temporal")
    cur = con.execute(RANKS_SQL, [run_id])
    cols = [d[0] for d in cur.description]
    ranks = [dict(zip(cols, r)) for r in cur.fetchall()]
    if not ranks:
        return {"run_id": run_id, "not_applicable": NOT_APPLICABLE, "ranks": []}
    return {"run_id": run_id, "ranks": ranks}
