"""Launch statistics: how long after its launch call does each kernel start, and which kernels
run for less time than it took the host to launch them?

delay_ns = device start - launch call start (the call found by correlation id, runtime call
preferred), per kernel and memop; its distribution (p50, p90, p99 as exact sample values, and
max) per rank and launch kind (direct launches vs graph replays, whose items share one graph
launch), and per layer; `shorter_than_launch` counts items whose device time is below the
launch call's host time. Definitions: analyzers/sql/launch/launch_delays.sql, docs/metrics.md.
"""
from __future__ import annotations

from typing import Any

import duckdb

from analyzers.attribution import attribute, load_sql

NOT_APPLICABLE = "no launch calls: no kernel or memop has a launching API call in the trace"
COUNT_SQL = "SELECT count(*) FROM launch_delays WHERE run_id = ?"
_STATS = """
  count(*) AS items,
  quantile_disc(delay_ns, 0.5) AS p50_delay_ns,
  quantile_disc(delay_ns, 0.9) AS p90_delay_ns,
  quantile_disc(delay_ns, 0.99) AS p99_delay_ns,
  max(delay_ns) AS max_delay_ns,
  count(*) FILTER (WHERE shorter_than_launch) AS shorter_than_launch"""
RANKS_SQL = f"""
SELECT rank, CASE WHEN graph_launched THEN 'graph' ELSE 'direct' END AS launch, {_STATS}
FROM launch_delays WHERE run_id = ? GROUP BY ALL ORDER BY rank, launch"""
LAYERS_SQL = f"""
SELECT d.rank, a.layer, CASE WHEN graph_launched THEN 'graph' ELSE 'direct' END AS launch, {_STATS}
FROM launch_delays d
JOIN kernel_attribution a
  ON a.run_id = d.run_id AND a.rank = d.rank AND a.item_kind = d.item_kind AND a.item_id = d.item_id
WHERE d.run_id = ? GROUP BY ALL ORDER BY d.rank, a.layer NULLS LAST, launch"""
SHORT_SQL = """
SELECT name, count(*) AS items, CAST(median(dur_ns) AS BIGINT) AS median_dur_ns,
       CAST(median(launch_dur_ns) AS BIGINT) AS median_launch_dur_ns
FROM launch_delays WHERE run_id = ? AND shorter_than_launch
GROUP BY name ORDER BY items DESC, name LIMIT ?"""


def _rows(con: duckdb.DuckDBPyConnection, sql: str, params: list[Any]) -> list[dict[str, Any]]:
    cur = con.execute(sql, params)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def launch_stats(con: duckdb.DuckDBPyConnection, run_id: int, top: int = 10,
                 **attribution_kwargs: Any) -> dict[str, Any]:
    """Delay distribution per rank and launch kind, per layer, and the kernel names most often
    shorter than their launch call, for one run."""
    load_sql(con, "temporal", "launch")
    if not con.execute(COUNT_SQL, [run_id]).fetchall()[0][0]:
        return {"run_id": run_id, "not_applicable": NOT_APPLICABLE, "ranks": [], "layers": []}
    attribute(con, [run_id], **attribution_kwargs)
    return {
        "run_id": run_id,
        "ranks": _rows(con, RANKS_SQL, [run_id]),
        "layers": _rows(con, LAYERS_SQL, [run_id]),
        "shorter_than_launch": _rows(con, SHORT_SQL, [run_id, top]),
    }
