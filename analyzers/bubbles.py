"""Decode bubbles: when, inside a step, does the device run nothing at all, and why?

A bubble is a maximal interval inside a step during which no kernel and no memop runs on any
stream of a rank (the gaps of the union across streams, integer ns). Each is placed between
the item that ended last before it (prev) and the one that starts it (next), with next's layer
and op, and given one cause: graph_boundary, host_sync, launch_bound, event_wait, in_graph or other; the
exact rules are the comment above `bubbles_in_steps` in analyzers/sql/bubbles/bubbles.sql and
docs/metrics.md. Per-stream gaps, HTA's per-stream idle time, are a different metric named
`stream_gaps` (a stream gap may be covered by another stream; a bubble never is).

Steps come from `analyzers.attribution` (`step` ranges, else ProfilerStep#N). A run without
any step range is treated as one step spanning the whole run, and the result says so.
"""
from __future__ import annotations

from typing import Any

import duckdb

from analyzers.attribution import attribute, load_sql

CAUSES = ("launch_bound", "graph_boundary", "host_sync", "event_wait", "in_graph", "other")

# One step spanning the whole run, for runs without step ranges (same shape as kernel_attribution).
WHOLE_RUN_ATTRIBUTION_SQL = """
CREATE OR REPLACE TEMP VIEW _bubbles_whole_run AS
SELECT run_id, rank, item_kind, item_id, '(whole run)' AS step, 0 AS step_index, layer, layer_index,
       layer_kind, op
FROM kernel_attribution"""
HAS_STEPS_SQL = "SELECT count(step_index) FROM kernel_attribution WHERE run_id = ?"
HAS_ITEMS_SQL = "SELECT count(*) FROM device_items WHERE run_id = ?"
STEPS_SQL = """
SELECT rank, step_index, step, span_ns, busy_ns, bubble_ns, bubbles, launch_bound_ns,
       graph_boundary_ns, host_sync_ns, event_wait_ns, in_graph_ns, other_ns
FROM bubble_steps(?, p_run := ?) ORDER BY rank, step_index"""
LAYERS_SQL = """
SELECT coalesce(layer, '(none)') AS layer, cause, count(*) AS bubbles, CAST(sum(gap_ns) AS BIGINT) AS gap_ns
FROM bubbles_in_steps(?, p_run := ?) WHERE gap_ns >= ?
GROUP BY ALL ORDER BY layer, cause"""
TOP_SQL = """
SELECT rank, step, step_index, start_ns, end_ns, gap_ns, cause, prev_name, next_name, prev_stream,
       next_stream, layer, op, prev_layer, prev_op, next_layer, next_op
FROM bubbles_in_steps(?, p_run := ?) WHERE gap_ns >= ?
ORDER BY gap_ns DESC, rank, start_ns LIMIT ?"""
STREAM_GAPS_SQL = """
SELECT rank, stream, count(*) AS gaps, CAST(sum(gap_ns) AS BIGINT) AS gap_ns, max(gap_ns) AS max_gap_ns
FROM stream_gaps WHERE run_id = ? AND gap_ns >= ? GROUP BY ALL ORDER BY rank, stream"""


def _rows(con: duckdb.DuckDBPyConnection, sql: str, params: list[Any]) -> list[dict[str, Any]]:
    cur = con.execute(sql, params)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def bubbles(con: duckdb.DuckDBPyConnection, run_id: int, step_pattern: str | None = None,
            min_ns: int = 0, top: int = 20) -> dict[str, Any]:
    """Bubble totals per step (by cause), per layer (by cause), the `top` longest bubbles and the
    per-stream gap summary of one run. `min_ns` drops shorter bubbles from the layer totals,
    the ranked list and the stream gaps; step totals always hold every bubble, so that
    span_ns = busy_ns + bubble_ns exactly."""
    load_sql(con, "temporal", "launch", "bubbles")
    if not con.execute(HAS_ITEMS_SQL, [run_id]).fetchall()[0][0]:
        return {"run_id": run_id, "not_applicable": "no kernels or memops in this run"}
    attribute(con, [run_id], step_pattern=step_pattern)
    attr, note = "kernel_attribution", None
    if not con.execute(HAS_STEPS_SQL, [run_id]).fetchall()[0][0]:
        con.execute(WHOLE_RUN_ATTRIBUTION_SQL)
        attr, note = "_bubbles_whole_run", "no step ranges: the whole run is treated as one step"
    steps = []
    for r in _rows(con, STEPS_SQL, [attr, run_id]):
        steps.append({"rank": r["rank"], "step": r["step"], "step_index": r["step_index"],
                      "span_ns": r["span_ns"], "busy_ns": r["busy_ns"], "bubble_ns": r["bubble_ns"],
                      "bubbles": r["bubbles"], "by_cause": {c: r[f"{c}_ns"] for c in CAUSES}})
    layers: dict[str, dict[str, Any]] = {}
    for r in _rows(con, LAYERS_SQL, [attr, run_id, min_ns]):
        entry = layers.setdefault(r["layer"], {"layer": r["layer"], "bubbles": 0, "bubble_ns": 0,
                                               "by_cause": {c: 0 for c in CAUSES}})
        entry["bubbles"] += r["bubbles"]
        entry["bubble_ns"] += r["gap_ns"]
        entry["by_cause"][r["cause"]] = r["gap_ns"]
    out: dict[str, Any] = {
        "run_id": run_id, "min_ns": min_ns, "steps": steps,
        "layers": sorted(layers.values(), key=lambda e: -e["bubble_ns"]),
        "top": _rows(con, TOP_SQL, [attr, run_id, min_ns, top]),
        "stream_gaps": _rows(con, STREAM_GAPS_SQL, [run_id, min_ns]),
    }
    if note:
        out["note"] = note
    return out
