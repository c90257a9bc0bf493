"""Overlap and prefetch figures (from analyzers.overlap / analyzers.prefetch JSON)."""
from __future__ import annotations

from typing import Any

import plotly.graph_objects as go


def not_applicable(result: Any) -> str | None:
    """The analyzer's "not applicable: why" answer, if that is what it returned."""
    if isinstance(result, str):
        return result
    if isinstance(result, dict):
        for key in ("not_applicable", "not applicable"):
            if result.get(key):
                why = result[key]
                return why if str(why).startswith("not applicable") else f"not applicable: {why}"
    return None


def overlap_per_layer(result: dict[str, Any]) -> go.Figure:
    """Per layer: communication hidden under compute vs exposed (µs, stacked)."""
    layers = result.get("layers", [])
    ranks = {layer.get("rank", 0) for layer in layers}
    names = [(f"r{layer.get('rank', 0)} " if len(ranks) > 1 else "") + str(layer.get("layer") or "(none)")
             for layer in layers]
    fig = go.Figure()
    for key, label, color in (("overlap_ns", "hidden under compute", "#2f9e6e"),
                              ("exposed_comm_ns", "exposed communication", "#d64545")):
        ns = [int(layer.get(key) or 0) for layer in layers]
        fig.add_trace(go.Bar(x=names, y=[v / 1000 for v in ns], name=label, marker_color=color, customdata=ns,
                             hovertemplate="%{x}: %{customdata:,} ns<extra>" + label + "</extra>"))
    fig.update_layout(barmode="stack", yaxis_title="communication µs", height=340,
                      margin={"l": 60, "r": 10, "t": 20, "b": 60})
    return fig


def prefetch_bars(result: dict[str, Any]) -> go.Figure:
    """Each prefetch's share hidden under other work (%), late ones in red."""
    prefetches = result.get("prefetches", [])
    labels = [f"{p.get('layer') or ''} {p.get('name', '')}"[:60] for p in prefetches]
    fig = go.Figure(go.Bar(x=list(range(len(prefetches))), y=[p.get("hidden_pct") or 0 for p in prefetches],
                           marker_color=["#d64545" if p.get("late") else "#2f9e6e" for p in prefetches],
                           text=labels, hovertemplate="%{text}: %{y:.1f} % hidden<extra></extra>"))
    fig.update_layout(xaxis_title="prefetch (in time order)", yaxis_title="% hidden", yaxis_range=[0, 100],
                      height=300, margin={"l": 60, "r": 10, "t": 20, "b": 50})
    return fig
