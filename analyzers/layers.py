"""Per-layer breakdown: kernels, span, busy and bubble time per layer and op, over steps.

Definitions (analyzers/sql/layers/layers.sql): span = first kernel start to last kernel end;
busy = length of the union of the kernel intervals (all streams); bubble = span - busy; all
integer ns. Summaries over steps use the lower median (the middle element, or the lower of
the two middle elements), so every figure stays an integer number of ns. Layers come from
analyzers.attribution (eager ranges, capture map or eager reference for CUDA graphs).
"""
from __future__ import annotations

from fractions import Fraction
from typing import Any

import duckdb
import pandas as pd

from analyzers.attribution import WITHOUT_CAPTURE_STREAM, attribute, load_sql

STEPS_SQL = "SELECT * EXCLUDE (first_start_ns) FROM layers_steps('kernel_attribution', ?) " \
            "ORDER BY rank, step_index NULLS FIRST, layer_index, layer, op NULLS FIRST"
SUMMARY_SQL = """
CREATE OR REPLACE TEMP TABLE _layers_steps AS SELECT * FROM layers_steps('kernel_attribution', ?);
"""
SUMMARY_SELECT_SQL = "SELECT * FROM layers_summary('_layers_steps') " \
                     "ORDER BY layer_index NULLS LAST, layer, op NULLS FIRST"
STEP_COUNT_SQL = "SELECT count(DISTINCT step_index) FROM _layers_steps WHERE step_index IS NOT NULL"
RUN_NAME_SQL = "SELECT name FROM runs WHERE run_id = ?"
# Graph kernels with no capture stream (attribution.WITHOUT_CAPTURE_STREAM): their op's busy
# time may hold a PDL wait the replay moved across streams, which the reader should be told.
NO_CAPTURE_STREAM_SQL = f"SELECT count(*) FROM kernel_attribution WHERE run_id = ? AND {WITHOUT_CAPTURE_STREAM}"


def _attributed(con: duckdb.DuckDBPyConnection, run_id: int, attribution_kwargs: dict[str, Any]) -> None:
    """Attribute the run (refreshing kernel_attribution) and load the layer macros.

    `attributed=True` among the kwargs skips the attribution: the caller has just run it
    (and kept its report), so the run is not attributed twice.
    """
    kw = dict(attribution_kwargs)
    if not kw.pop("attributed", False):
        attribute(con, [run_id], **kw)
    load_sql(con, "layers")


def layer_steps(con: duckdb.DuckDBPyConnection, run_id: int, **attribution_kwargs: Any) -> pd.DataFrame:
    """One row per (rank, step_index, layer, op) of the run, op NULL for the whole-layer row;
    columns run_id, rank, step_index, layer, layer_index, layer_kind, op, kernels, span_ns,
    busy_ns, bubble_ns."""
    _attributed(con, run_id, attribution_kwargs)
    return con.execute(STEPS_SQL, [run_id]).df()


def layer_breakdown(con: duckdb.DuckDBPyConnection, run_id: int, **attribution_kwargs: Any) -> dict[str, Any]:
    """Medians over steps per layer and per op, as the issue's JSON:
    {"run", "steps", "layers": [{"layer", "index", "kind", "kernels", "span_ns", "busy_ns",
    "bubble_ns", "ops": [{"op", "kernels", "busy_ns"}]}], "graph_kernels_without_capture_stream"}.
    Ops are ordered by their median offset from the layer's first kernel. A run with no layer
    at all says why instead. The last count is of graph kernels whose op busy time cannot
    leave out a PDL wait across replay streams (no capture stream known)."""
    _attributed(con, run_id, attribution_kwargs)
    con.execute(SUMMARY_SQL, [run_id])
    rows = con.execute(SUMMARY_SELECT_SQL).df()
    steps = con.execute(STEP_COUNT_SQL).fetchall()[0][0]
    name = con.execute(RUN_NAME_SQL, [run_id]).fetchall()[0][0]
    no_stream = con.execute(NO_CAPTURE_STREAM_SQL, [run_id]).fetchall()[0][0]
    out: dict[str, Any] = {"run": name, "steps": int(steps), "layers": [],
                           "graph_kernels_without_capture_stream": int(no_stream)}
    if rows.empty:
        out["not_applicable"] = ("no kernel is attributed to a layer: no range matches the layer "
                                 "pattern around any launch, and no capture map or reference applies")
        return out
    layers = rows[rows["op"].isna()]
    ops = rows[rows["op"].notna()]
    for r in layers.itertuples(index=False):
        mine = ops[ops["layer"] == r.layer].sort_values(["offset_ns", "op"])
        out["layers"].append({
            "layer": r.layer,
            "index": None if pd.isna(r.layer_index) else int(r.layer_index),
            "kind": None if pd.isna(r.layer_kind) else str(r.layer_kind),
            "kernels": int(r.kernels), "span_ns": int(r.span_ns), "busy_ns": int(r.busy_ns),
            "bubble_ns": int(r.bubble_ns),
            "ops": [{"op": str(o.op), "kernels": int(o.kernels), "busy_ns": int(o.busy_ns)}
                    for o in mine.itertuples(index=False)],
        })
    return out


def _round_mean(values: list[int]) -> int:
    """Mean of integers rounded half to even (Fraction keeps it exact)."""
    return round(Fraction(sum(values), len(values)))


def kind_table(breakdown: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per layer kind: number of layers, ns per layer (mean over the layers of the kind of
    their median span, rounded half to even) and kernels per layer (mean of medians)."""
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for layer in breakdown["layers"]:
        by_kind.setdefault(layer["kind"] or "layer", []).append(layer)
    out = {}
    for kind, layers in by_kind.items():
        spans = [x["span_ns"] for x in layers]
        kernels = [x["kernels"] for x in layers]
        out[kind] = {"layers": len(layers), "span_ns": _round_mean(spans),
                     "us": _round_mean(spans) / 1000, "kernels": sum(kernels) / len(kernels)}
    return out


def compare(con: duckdb.DuckDBPyConnection, base_run: int, cand_run: int, **kw: Any) -> dict[str, Any]:
    """The stock-vs-fused table: per layer kind, µs and kernels per layer of each run, and the
    ratios cand/base (NULL where base is 0 or the kind is missing on one side)."""
    base = layer_breakdown(con, base_run, **kw)
    cand = layer_breakdown(con, cand_run, **kw)
    tb, tc = kind_table(base), kind_table(cand)
    kinds = sorted(set(tb) | set(tc))
    rows = []
    for kind in kinds:
        b, c = tb.get(kind), tc.get(kind)
        rows.append({
            "kind": kind, "base": b, "cand": c,
            "ratio_time": (c["span_ns"] / b["span_ns"]) if b and c and b["span_ns"] else None,
            "ratio_kernels": (c["kernels"] / b["kernels"]) if b and c and b["kernels"] else None,
        })
    return {"base": {"run": base["run"], "steps": base["steps"]},
            "cand": {"run": cand["run"], "steps": cand["steps"]}, "kinds": rows}
