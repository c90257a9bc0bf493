"""The timeline figure: kernels per stream, idle intervals, layer bands, a marked interval.

Built for WebGL: each category is one `Scattergl` trace of horizontal segments (start, end,
gap) per kernel, so tens of thousands of kernels draw in one call. The x axis is ns since
`origin_ns` (the rank's first kernel), which keeps values exact in a float64 (absolute epoch
ns are not). Binned windows (too many kernels to draw) show one segment per stream and bin.
"""
from __future__ import annotations

from typing import Any

import pandas as pd
import plotly.graph_objects as go

CATEGORY_COLORS = {"compute": "#2f6fb0", "communication": "#d9822b", "memory": "#7b8794",
                   "prefetch": "#2f9e6e"}
IDLE_ROW = "idle"
IDLE_COLOR = "#d64545"
MAX_BAND_LABELS = 40


def stream_label(stream: Any) -> str:
    return f"stream {stream}"


def _segment_trace(rows: pd.DataFrame, y: list[str], origin_ns: int, name: str, color: str,
                   texts: list[str], width: int = 14) -> go.Scattergl:
    xs: list[int | None] = []
    ys: list[str | None] = []
    hover: list[str | None] = []
    for s, e, yy, t in zip(rows["start_ns"].tolist(), rows["end_ns"].tolist(), y, texts):
        xs.extend((s - origin_ns, e - origin_ns, None))
        ys.extend((yy, yy, None))
        hover.extend((t, t, None))
    return go.Scattergl(x=xs, y=ys, mode="lines", name=name, line={"color": color, "width": width},
                        text=hover, hoverinfo="text", connectgaps=False)


def timeline_figure(rows: pd.DataFrame, mode: str, idle: pd.DataFrame, bands: pd.DataFrame,
                    origin_ns: int, start_ns: int, end_ns: int,
                    mark: tuple[int, int] | None = None) -> go.Figure:
    """The figure for one window.

    rows: kernels (stream, name, category, start_ns, end_ns, dur_ns) when mode == 'kernels', or
    bins (stream, bin, kernels, start_ns, end_ns, busy_ns, longest_name) when mode == 'binned'.
    idle: device-idle intervals (start_ns, end_ns, gap_ns). bands: layers (layer, start_ns, end_ns).
    mark: an interval to highlight (e.g. the bubble a link came from), absolute ns.
    """
    fig = go.Figure()
    streams = sorted(rows["stream"].dropna().unique().tolist()) if len(rows) else []
    categories: list[str] = []
    if mode == "kernels" and len(rows):
        for cat, part in rows.groupby("category", sort=True):
            categories.append(str(cat))
            texts = [f"{n}<br>stream {st} · {d:,} ns<br>start {s - origin_ns:,} ns"
                     for n, st, d, s in zip(part["name"], part["stream"], part["dur_ns"], part["start_ns"])]
            fig.add_trace(_segment_trace(part, [stream_label(s) for s in part["stream"]], origin_ns,
                                         str(cat), CATEGORY_COLORS.get(str(cat), "#9446ed"), texts))
    elif mode == "binned" and len(rows):
        clipped = rows.assign(start_ns=rows["start_ns"].clip(lower=start_ns), end_ns=rows["end_ns"].clip(upper=end_ns))
        texts = [f"{k:,} kernels, busy {b:,} ns<br>longest: {n}"
                 for k, b, n in zip(rows["kernels"], rows["busy_ns"], rows["longest_name"])]
        fig.add_trace(_segment_trace(clipped, [stream_label(s) for s in rows["stream"]], origin_ns,
                                     "kernels (binned: zoom in for single kernels)", "#52606d", texts))
    if len(idle):
        texts = [f"device idle {g:,} ns" for g in idle["gap_ns"]]
        fig.add_trace(_segment_trace(idle, [IDLE_ROW] * len(idle), origin_ns, "device idle (bubble)",
                                     IDLE_COLOR, texts, width=10))
    shapes: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    for i, (layer, s, e) in enumerate(zip(bands["layer"], bands["start_ns"], bands["end_ns"]) if len(bands) else []):
        shapes.append({"type": "rect", "xref": "x", "yref": "paper", "x0": s - origin_ns, "x1": e - origin_ns,
                       "y0": 0, "y1": 1, "fillcolor": "#9fb3c8" if i % 2 else "#d9e2ec", "opacity": 0.35,
                       "line": {"width": 0}, "layer": "below"})
        if len(bands) <= MAX_BAND_LABELS:
            annotations.append({"x": (s + e) / 2 - origin_ns, "y": 1.0, "xref": "x", "yref": "paper",
                                "text": str(layer), "showarrow": False, "yanchor": "bottom",
                                "font": {"size": 10}})
    if mark is not None:
        shapes.append({"type": "rect", "xref": "x", "yref": "paper", "x0": mark[0] - origin_ns,
                       "x1": mark[1] - origin_ns, "y0": 0, "y1": 1, "fillcolor": "rgba(214,69,69,0.15)",
                       "line": {"color": IDLE_COLOR, "width": 2}, "layer": "above"})
    y_order = [stream_label(s) for s in streams] + ([IDLE_ROW] if len(idle) else [])
    fig.update_layout(
        shapes=shapes, annotations=annotations, height=180 + 36 * max(1, len(y_order)),
        margin={"l": 90, "r": 20, "t": 40, "b": 40}, dragmode="zoom", hovermode="closest",
        legend={"orientation": "h", "y": -0.25}, uirevision="timeline",
        xaxis={"title": {"text": f"ns since first kernel (origin {origin_ns} ns)"},
               "range": [start_ns - origin_ns, end_ns - origin_ns], "tickformat": ",d"},
        yaxis={"categoryorder": "array", "categoryarray": list(reversed(y_order)), "fixedrange": True},
        plot_bgcolor="#fff",
    )
    return fig
