"""Per-layer figures: stacked busy time by op, kernel counts, and the base-vs-candidate chart.

Inputs are the analyzers' JSON shapes (analyzers.layers.layer_breakdown and compare); times
arrive as integer ns and are shown in µs only at the axis (ns stay in the hover text).
"""
from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

BUBBLE_COLOR = "#e4e7eb"
# Plotly's D3 + Dark24 palettes: enough distinct colours for the ~25 ops of a K3 layer.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf", "#2e91e5", "#e15f99", "#1ca71c", "#fb0d0d", "#da16ff", "#b68100",
           "#750d86", "#eb663b", "#511cfb", "#00a08b", "#fb00d1", "#fc0080", "#b2828d", "#6c7c32",
           "#778aae", "#862a16", "#a777f1", "#620042", "#1616a7", "#da60ca", "#6c4516", "#0d2a63")


def op_colors(*breakdowns: dict[str, Any]) -> dict[str, str]:
    """One colour per op across several runs, in order of first appearance, so the same op has
    the same colour in side-by-side charts."""
    out: dict[str, str] = {}
    for op in _ops([layer for bd in breakdowns for layer in bd.get("layers", [])]):
        out[op] = PALETTE[len(out) % len(PALETTE)]
    return out


def _ops(layers: list[dict[str, Any]]) -> list[str]:
    ops: list[str] = []
    for layer in layers:
        for op in layer.get("ops", []):
            if op["op"] not in ops:
                ops.append(op["op"])
    return ops


def breakdown_bars(breakdown: dict[str, Any], title: str, colors: dict[str, str] | None = None) -> go.Figure:
    """Stacked bars per layer: busy time of each op (µs), plus the layer's bubble time on top."""
    layers = breakdown.get("layers", [])
    names = [layer["layer"] for layer in layers]
    colors = colors or op_colors(breakdown)
    fig = go.Figure()
    for op in _ops(layers):
        values = [next((o["busy_ns"] for o in layer.get("ops", []) if o["op"] == op), 0) for layer in layers]
        fig.add_trace(go.Bar(x=names, y=[v / 1000 for v in values], name=str(op), marker_color=colors.get(op),
                             customdata=values, hovertemplate="%{x} · " + str(op) + ": %{customdata:,} ns<extra></extra>"))
    bubbles = [layer.get("bubble_ns", 0) or 0 for layer in layers]
    fig.add_trace(go.Bar(x=names, y=[b / 1000 for b in bubbles], name="bubble", marker_color=BUBBLE_COLOR,
                         customdata=bubbles, hovertemplate="%{x} · bubble: %{customdata:,} ns<extra></extra>"))
    fig.update_layout(barmode="stack", title={"text": title}, yaxis_title="µs per layer (median over steps)",
                      margin={"l": 60, "r": 10, "t": 50, "b": 80}, height=420, legend={"font": {"size": 10}})
    return fig


def kernel_bars(breakdown: dict[str, Any], title: str, colors: dict[str, str] | None = None) -> go.Figure:
    """Kernels per layer, stacked by op."""
    layers = breakdown.get("layers", [])
    names = [layer["layer"] for layer in layers]
    colors = colors or op_colors(breakdown)
    fig = go.Figure()
    for op in _ops(layers):
        fig.add_trace(go.Bar(x=names, y=[next((o["kernels"] for o in layer.get("ops", []) if o["op"] == op), 0)
                                         for layer in layers], name=str(op), marker_color=colors.get(op),
                             hovertemplate="%{x} · " + str(op) + ": %{y} kernels<extra></extra>"))
    fig.update_layout(barmode="stack", title={"text": title}, yaxis_title="kernels per layer",
                      margin={"l": 60, "r": 10, "t": 50, "b": 80}, height=360, showlegend=False)
    return fig


def seed_rows(compare: dict[str, Any]) -> list[dict[str, Any]]:
    """The seed table's rows (per layer kind, from analyzers.layers.compare): ns and kernels per
    layer for base and candidate, and the candidate/base ratios."""
    rows = []
    for k in compare.get("kinds", []):
        b, c = k.get("base") or {}, k.get("cand") or {}
        rows.append({
            "kind": k.get("kind"),
            "base_us": _us(b.get("span_ns")), "base_ns": b.get("span_ns"), "base_kernels": _kernels(b.get("kernels")),
            "cand_us": _us(c.get("span_ns")), "cand_ns": c.get("span_ns"), "cand_kernels": _kernels(c.get("kernels")),
            "time_ratio": k.get("ratio_time"), "kernel_ratio": k.get("ratio_kernels"),
        })
    return rows


def compare_bars(compare: dict[str, Any]) -> go.Figure:
    """µs per layer of each layer kind, base and candidate side by side (kernels in the hover)."""
    rows = seed_rows(compare)
    kinds = [r["kind"] for r in rows]
    fig = go.Figure()
    for side, label in (("base", compare.get("base", {}).get("run", "base")),
                        ("cand", compare.get("cand", {}).get("run", "candidate"))):
        fig.add_trace(go.Bar(x=kinds, y=[r[f"{side}_us"] for r in rows], name=str(label),
                             customdata=[[r[f"{side}_ns"], r[f"{side}_kernels"]] for r in rows],
                             hovertemplate="%{x}: %{customdata[0]:,} ns, %{customdata[1]} kernels per layer<extra></extra>",
                             text=[f"{r[f'{side}_kernels']} k" if r[f"{side}_kernels"] is not None else "" for r in rows],
                             textposition="outside"))
    fig.update_layout(barmode="group", yaxis_title="µs per layer", xaxis_title="layer kind",
                      margin={"l": 60, "r": 10, "t": 30, "b": 50}, height=380)
    return fig


def _us(ns: Any) -> float | None:
    return None if ns is None else round(ns / 1000, 1)


def _kernels(v: Any) -> float | int | None:
    """Kernels per layer: a mean over layers, shown as an integer when it is one."""
    if v is None:
        return None
    return int(v) if float(v).is_integer() else round(float(v), 1)
