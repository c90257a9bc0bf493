"""Bubble figures: total bubble time per step, stacked by cause (from analyzers.bubbles JSON)."""
from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

CAUSE_COLORS = {"launch_bound": "#d64545", "graph_boundary": "#9446ed", "host_sync": "#d9822b",
                "event_wait": "#2f6fb0", "in_graph": "#8e5bb5", "other": "#7b8794"}


def by_cause_bars(result: dict[str, Any]) -> go.Figure:
    """Bubble ns per step, stacked by cause (µs on the axis, ns in the hover)."""
    steps = result.get("steps", [])
    causes: list[str] = []
    for s in steps:
        for cause in (s.get("by_cause") or {}):
            if cause not in causes:
                causes.append(cause)
    ranks = {s.get("rank", 0) for s in steps}
    xs = [(f"r{s.get('rank', 0)} " if len(ranks) > 1 else "") + f"step {s.get('step_index', s.get('step'))}"
          for s in steps]
    fig = go.Figure()
    for cause in causes:
        ns = [_ns((s.get("by_cause") or {}).get(cause)) for s in steps]
        fig.add_trace(go.Bar(x=xs, y=[v / 1000 for v in ns], name=cause, customdata=ns,
                             marker_color=CAUSE_COLORS.get(cause),
                             hovertemplate="%{x} · " + cause + ": %{customdata:,} ns<extra></extra>"))
    fig.update_layout(barmode="stack", xaxis_title="step", yaxis_title="bubble µs", height=340,
                      margin={"l": 60, "r": 10, "t": 20, "b": 50}, xaxis={"type": "category"})
    return fig


def _ns(v: Any) -> int:
    """A cause entry is ns, or a dict with bubble_ns/gap_ns (count alongside)."""
    if isinstance(v, dict):
        return int(v.get("bubble_ns", v.get("gap_ns", v.get("ns", 0))) or 0)
    return int(v or 0)
