"""The timeline figure: kernels per stream, idle intervals, layer bands, a marked interval.

Built for WebGL and for speed: each category is one `scattergl` trace of horizontal segments
(start, end, gap) per kernel, so thousands of kernels draw in one call, and the figure is a
plain dict (plotly's object validation costs more than the query for large windows). Hover
text sits on one invisible marker per kernel at its midpoint. The y axis is numeric (one row
per stream, labelled by ticktext). The x axis is ns since `origin_ns` (the rank's first
kernel), which keeps values exact in a float64 (absolute epoch ns are not). Binned windows
(too many kernels to draw) show one segment per stream and bin.
"""
from __future__ import annotations

from typing import Any

import pandas as pd

CATEGORY_COLORS = {"compute": "#2f6fb0", "communication": "#d9822b", "memory": "#7b8794",
                   "prefetch": "#2f9e6e"}
IDLE_ROW = "idle"
IDLE_COLOR = "#d64545"
BUBBLE_ROW = "bubbles"
CAUSE_COLORS = {"launch_bound": "#d64545", "graph_boundary": "#9446ed", "host_sync": "#d9822b",
                "event_wait": "#2f6fb0", "in_graph": "#8e5bb5", "other": "#7b8794"}
MAX_BAND_LABELS = 40
MAX_BANDS = 400


def stream_label(stream: Any) -> str:
    return f"stream {stream}"


def segment_traces(starts: list[int], ends: list[int], row: list[int], origin_ns: int, name: str, color: str,
                   texts: list[str], width: int = 14) -> list[dict[str, Any]]:
    """A line trace of (start, end, gap) segments at y = row, and a marker trace carrying the
    hover text at each segment's midpoint (same legend group, no legend entry of its own)."""
    xs: list[int | None] = []
    ys: list[int | None] = []
    for s, e, y in zip(starts, ends, row):
        xs += [s - origin_ns, e - origin_ns, None]
        ys += [y, y, None]
    mids = [(s + e) // 2 - origin_ns for s, e in zip(starts, ends)]
    return [
        {"type": "scattergl", "mode": "lines", "name": name, "legendgroup": name, "x": xs, "y": ys,
         "line": {"color": color, "width": width}, "hoverinfo": "skip", "connectgaps": False},
        {"type": "scattergl", "mode": "markers", "name": name, "legendgroup": name, "showlegend": False,
         "x": mids, "y": list(row), "text": texts, "hoverinfo": "text",
         "marker": {"color": color, "size": 4, "opacity": 0}},
    ]


def timeline_figure(rows: pd.DataFrame, mode: str, idle: pd.DataFrame, bands: pd.DataFrame,
                    origin_ns: int, start_ns: int, end_ns: int,
                    mark: tuple[int, int] | None = None, bubbles: pd.DataFrame | None = None) -> dict[str, Any]:
    """The figure (a plotly figure dict) for one window.

    rows: kernels (stream, name, category, start_ns, end_ns, dur_ns) when mode == 'kernels', or
    bins (stream, bin, kernels, start_ns, end_ns, busy_ns, longest_name) when mode == 'binned'.
    idle: device-idle intervals (start_ns, end_ns, gap_ns). bands: layers (layer, start_ns, end_ns).
    mark: an interval to highlight (e.g. the bubble a link came from), absolute ns.
    bubbles: when given (start_ns, end_ns, gap_ns, cause, prev_name, next_name, layer, op), the
    bottom row shows these bubbles coloured by cause instead of the plain idle intervals.
    """
    streams = sorted(rows["stream"].dropna().unique().tolist()) if len(rows) else []
    bottom = BUBBLE_ROW if bubbles is not None else IDLE_ROW
    has_bottom = len(bubbles) > 0 if bubbles is not None else len(idle) > 0
    labels = [stream_label(s) for s in streams] + ([bottom] if has_bottom else [])
    # top to bottom: streams in order, idle last
    y_of = {s: len(labels) - 1 - i for i, s in enumerate(streams)}
    data: list[dict[str, Any]] = []
    if mode == "kernels" and len(rows):
        for cat, part in rows.groupby("category", sort=True):
            texts = [f"{n}<br>stream {st} · {d:,} ns<br>start {s - origin_ns:,} ns"
                     for n, st, d, s in zip(part["name"], part["stream"], part["dur_ns"], part["start_ns"])]
            data += segment_traces(part["start_ns"].tolist(), part["end_ns"].tolist(),
                                   [y_of[s] for s in part["stream"]], origin_ns, str(cat),
                                   CATEGORY_COLORS.get(str(cat), "#9446ed"), texts)
    elif mode == "binned" and len(rows):
        texts = [f"stream {st}: {k:,} kernels, busy {b:,} ns<br>longest: {n}"
                 for st, k, b, n in zip(rows["stream"], rows["kernels"], rows["busy_ns"], rows["longest_name"])]
        data += segment_traces(rows["start_ns"].clip(lower=start_ns).tolist(), rows["end_ns"].clip(upper=end_ns).tolist(),
                               [y_of[s] for s in rows["stream"]], origin_ns,
                               "kernels (binned: zoom in for single kernels)", "#52606d", texts)
    if bubbles is not None:
        for cause, part in bubbles.groupby("cause", sort=True):
            texts = [f"bubble {g:,} ns: {cause}<br>{p} → {n}<br>{lay or ''} {op or ''}"
                     for g, p, n, lay, op in zip(part["gap_ns"], part["prev_name"], part["next_name"],
                                                 part["layer"], part["op"])]
            data += segment_traces(part["start_ns"].tolist(), part["end_ns"].tolist(), [0] * len(part), origin_ns,
                                   f"bubble: {cause}", CAUSE_COLORS.get(str(cause), IDLE_COLOR), texts, width=10)
    elif len(idle):
        texts = [f"device idle {g:,} ns" for g in idle["gap_ns"]]
        data += segment_traces(idle["start_ns"].tolist(), idle["end_ns"].tolist(), [0] * len(idle), origin_ns,
                               "device idle (bubble)", IDLE_COLOR, texts, width=10)
    shapes, annotations = _bands(bands, origin_ns) if len(bands) <= MAX_BANDS else ([], [])
    if mark is not None:
        shapes.append({"type": "rect", "xref": "x", "yref": "paper", "x0": mark[0] - origin_ns,
                       "x1": mark[1] - origin_ns, "y0": 0, "y1": 1, "fillcolor": "rgba(214,69,69,0.15)",
                       "line": {"color": IDLE_COLOR, "width": 2}, "layer": "above"})
    layout = {
        "shapes": shapes, "annotations": annotations, "height": 180 + 36 * max(1, len(labels)),
        "margin": {"l": 90, "r": 20, "t": 40, "b": 40}, "dragmode": "zoom", "hovermode": "closest",
        "legend": {"orientation": "h", "y": -0.25}, "uirevision": "timeline", "plot_bgcolor": "#fff",
        "xaxis": {"title": {"text": f"ns since first kernel (origin {origin_ns} ns)"},
                  "range": [start_ns - origin_ns, end_ns - origin_ns], "tickformat": ",d"},
        "yaxis": {"tickvals": list(range(len(labels))), "ticktext": list(reversed(labels)),
                  "range": [-0.6, len(labels) - 0.4], "fixedrange": True, "zeroline": False},
    }
    return {"data": data, "layout": layout}


def _bands(bands: pd.DataFrame, origin_ns: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    shapes: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    for i, (layer, s, e) in enumerate(zip(bands["layer"], bands["start_ns"], bands["end_ns"])):
        shapes.append({"type": "rect", "xref": "x", "yref": "paper", "x0": s - origin_ns, "x1": e - origin_ns,
                       "y0": 0, "y1": 1, "fillcolor": "#9fb3c8" if i % 2 else "#d9e2ec", "opacity": 0.35,
                       "line": {"width": 0}, "layer": "below"})
        if len(bands) <= MAX_BAND_LABELS:
            annotations.append({"x": (s + e) // 2 - origin_ns, "y": 1.0, "xref": "x", "yref": "paper",
                                "text": str(layer), "showarrow": False, "yanchor": "bottom", "font": {"size": 10}})
    return shapes, annotations
