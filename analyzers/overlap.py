"""Compute-communication overlap: how much of the communication is hidden under compute?

Per rank (as HTA's get_comm_comp_overlap), per step and per layer: comm_ns = |∪ communication
items|, overlap_ns = |comm ∩ compute| (compute kernels on any stream of the rank),
exposed_comm_ns = |comm \\ compute|, overlap_pct = 100 · overlap_ns / comm_ns. Communication is
what the store's classifier decided (kernels.category = 'communication': NCCL/RCCL, vLLM custom
all-reduce, simulated collectives named in capture metadata, user rules), never a regex here.
Definitions: analyzers/sql/overlap/*.sql and docs/metrics.md.
"""
from __future__ import annotations

from typing import Any

import duckdb

from analyzers.attribution import attribute, load_sql

NOT_APPLICABLE = "no communication kernels (no item has classifier category 'communication')"
HAS_COMM_SQL = "SELECT count(*) FROM device_items WHERE run_id = ? AND category = 'communication'"
RANKS_SQL = """
SELECT rank, comm_ns, overlap_ns, overlap_pct, exposed_comm_ns
FROM overlap_per_rank WHERE run_id = ? ORDER BY rank"""
STEPS_SQL = """
SELECT rank, step, step_index, comm_ns, overlap_ns, overlap_pct, exposed_comm_ns
FROM overlap_by_layer('kernel_attribution') WHERE run_id = ? AND level = 'step'
ORDER BY rank, step_index"""
# Layers summed over steps: the pct is then the ratio of the sums (time-weighted).
LAYERS_SQL = """
SELECT rank, nullif(layer, '') AS layer, count(*) AS steps,
  CAST(sum(comm_ns) AS BIGINT) AS comm_ns, CAST(sum(overlap_ns) AS BIGINT) AS overlap_ns,
  100.0 * sum(overlap_ns) / nullif(sum(comm_ns), 0) AS overlap_pct,
  CAST(sum(exposed_comm_ns) AS BIGINT) AS exposed_comm_ns
FROM overlap_by_layer('kernel_attribution') WHERE run_id = ? AND level = 'layer'
GROUP BY rank, layer ORDER BY rank, exposed_comm_ns DESC, layer"""


def _rows(con: duckdb.DuckDBPyConnection, sql: str, params: list[Any]) -> list[dict[str, Any]]:
    cur = con.execute(sql, params)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def overlap(con: duckdb.DuckDBPyConnection, run_id: int, **attribution_kwargs: Any) -> dict[str, Any]:
    """Overlap per rank (whole run), per step and per layer (summed over steps) of one run, or
    {"not_applicable": why} when the run has no communication item."""
    load_sql(con, "temporal", "overlap")
    if not con.execute(HAS_COMM_SQL, [run_id]).fetchall()[0][0]:
        return {"run_id": run_id, "not_applicable": NOT_APPLICABLE, "ranks": [], "steps": [], "layers": []}
    attribute(con, [run_id], **attribution_kwargs)
    return {
        "run_id": run_id,
        "ranks": _rows(con, RANKS_SQL, [run_id]),
        "steps": _rows(con, STEPS_SQL, [run_id]),
        "layers": _rows(con, LAYERS_SQL, [run_id]),
    }
