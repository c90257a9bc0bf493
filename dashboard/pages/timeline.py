"""Timeline: kernels per stream for a chosen step (or window), layers as bands, idle marked.

State in the URL: run, rank, step, and the window t0/t1 (absolute ns), plus an optional
marked interval m0/m1 (a bubble linked from the Bubbles page). Zooming asks the server for
the new window (server-side windowing in analyzers.timeline: raw kernels up to a cap, per-stream
bins above it), and the address bar is rewritten (history.replaceState) so it can be shared.
"""
from __future__ import annotations

from typing import Any

import dash
from dash import ClientsideFunction, Input, Output, State, callback, clientside_callback, dcc, html

from dashboard import components as c
from dashboard import data
from dashboard.figures.timeline import timeline_figure
from dashboard.timeline_state import pack_state, unpack_state, window_from_relayout

dash.register_page(__name__, path="/timeline", name="Timeline", order=3)


def layout(run: str | None = None, rank: str | None = None, step: str | None = None, t0: str | None = None,
           t1: str | None = None, m0: str | None = None, m1: str | None = None, **_: Any) -> html.Div:
    all_runs = data.runs()
    run_id = c.pick_run(all_runs, run)
    if run_id is None:
        return html.Div([html.H1("Timeline"), c.no_runs()])
    ranks = data.timeline_ranks(run_id)
    rank_id = c.int_arg(rank, ranks[0] if ranks else 0)
    extent = data.timeline_extent(run_id, rank_id)
    if extent is None:
        return html.Div([html.H1("Timeline"), c.run_links(all_runs, "/timeline", run_id),
                         c.notice(f"run {run_id} rank {rank_id} has no kernels")])
    steps = data.timeline_steps(run_id, rank_id)
    step_idx = c.int_arg(step)
    start, end, step_idx = _initial_window(extent, steps, step_idx, c.int_arg(t0), c.int_arg(t1))
    mark = (c.int_arg(m0), c.int_arg(m1))
    state = pack_state(run=run_id, rank=rank_id, step=step_idx, origin=extent["first_start_ns"], t0=start, t1=end,
                       mark=None if None in mark else mark,
                       extent=(extent["first_start_ns"], extent["last_end_ns"]))
    figure, info = _render(state)
    step_options = [{"label": f"step {s['step_index']} ({s['name']}, {s['kernels']:,} kernels)",
                     "value": s["step_index"]} for s in steps]
    return html.Div([
        html.H1("Timeline"),
        c.run_links(all_runs, "/timeline", run_id),
        _rank_links(run_id, ranks, rank_id),
        html.Div([
            html.Label(["step", dcc.Dropdown(step_options, step_idx, id="timeline-step", className="dropdown",
                                             placeholder="whole run" if steps else "no step ranges in this run")]),
            html.A("link to this view", id="timeline-permalink", href=_permalink(state)),
            dcc.Link("bubbles of this run, by cause", href=c.href("/bubbles", run=run_id)),
            dcc.Link("kernels table", href=c.href("/kernels", run=run_id)),
        ], className="controls"),
        html.Div(info, id="timeline-info", className="note"),
        dcc.Graph(id="timeline-graph", figure=figure, config={"scrollZoom": True, "displaylogo": False}),
        dcc.Store(id="timeline-state", data=state),
        dcc.Store(id="timeline-url-sync"),
        html.P("Drag to zoom (the server sends only the kernels of the visible window; above "
               f"{data.timeline.DEFAULT_CAP:,} kernels they come aggregated per stream), double-click to reset. "
               "Bottom row: bubbles coloured by cause (device idle inside a step, from the Bubbles analysis), or "
               "plain device-idle intervals (no kernel or memop on any stream) where causes are not available "
               "(no bubbles analysis in this build, or a window drawn as bins); "
               "bands: layers.",
               className="note"),
    ])


def _rank_links(run_id: int, ranks: list[int], current: int) -> html.Div:
    """One link per rank (a rank has its own clock, steps and streams: a new view)."""
    items: list[Any] = [html.Span("rank: ", className="note")]
    for r in ranks:
        items.append(html.B(str(r)) if r == current else dcc.Link(str(r), href=c.href("/timeline", run=run_id, rank=r)))
        items.append(" ")
    return html.Div(items, className="links runlinks", id="timeline-ranks")


def _initial_window(extent: dict[str, int], steps: list[dict[str, Any]], step: int | None,
                    t0: int | None, t1: int | None) -> tuple[int, int, int | None]:
    """(t0, t1, step): the URL window if given, else the step's device window, else the first
    step's, else the whole run."""
    if t0 is not None and t1 is not None and t1 > t0:
        return t0, t1, step
    chosen = next((s for s in steps if s["step_index"] == step), None) or (steps[0] if steps and step is None else None)
    if chosen is not None and chosen["dev_end_ns"] > chosen["dev_start_ns"]:
        return int(chosen["dev_start_ns"]), int(chosen["dev_end_ns"]), int(chosen["step_index"])
    return extent["first_start_ns"], max(extent["last_end_ns"], extent["first_start_ns"] + 1), None


def _render(packed: dict[str, Any]) -> tuple[Any, str]:
    state = unpack_state(packed)
    win, bands, causes = data.timeline_window(state["run"], state["rank"], state["t0"], state["t1"])
    fig = timeline_figure(win.rows, win.mode, win.idle, bands, state["origin"], win.start_ns, win.end_ns,
                          state["mark"], bubbles=causes)
    shown = "each kernel" if win.mode == "kernels" else f"binned per stream ({len(win.rows):,} bins)"
    idle_ns = int(win.idle["gap_ns"].sum()) if len(win.idle) else 0
    info = (f"window [{win.start_ns}, {win.end_ns}) ns = {win.end_ns - win.start_ns:,} ns · "
            f"{win.total_kernels:,} kernels, {shown} · device idle inside: {idle_ns:,} ns")
    return fig, info


def _permalink(state: dict[str, Any]) -> str:
    mark = state.get("mark") or [None, None]
    return c.href("/timeline", run=state["run"], rank=state["rank"], step=state.get("step"),
                  t0=state["t0"], t1=state["t1"], m0=mark[0], m1=mark[1])


@callback(Output("timeline-graph", "figure"), Output("timeline-info", "children"),
          Output("timeline-permalink", "href"), Output("timeline-state", "data"),
          Input("timeline-graph", "relayoutData"), Input("timeline-step", "value"),
          State("timeline-state", "data"), prevent_initial_call=True)
def _update(relayout: dict[str, Any] | None, step: int | None, state: dict[str, Any]) -> Any:
    """Zoom or step changed: fetch the new window from the store and redraw."""
    cur = unpack_state(state)
    new = dict(cur)
    if dash.ctx.triggered_id == "timeline-step":
        steps = data.timeline_steps(cur["run"], cur["rank"])
        chosen = next((s for s in steps if s["step_index"] == step), None)
        new["step"] = step
        new["t0"], new["t1"] = ((int(chosen["dev_start_ns"]), int(chosen["dev_end_ns"])) if chosen
                                else tuple(cur["extent"]))
    else:
        window = window_from_relayout(relayout or {}, cur)
        if window is None:
            return dash.no_update, dash.no_update, dash.no_update, dash.no_update
        new["t0"], new["t1"] = window
    packed = pack_state(**new)
    fig, info = _render(packed)
    return fig, info, _permalink(packed), packed


clientside_callback(
    ClientsideFunction(namespace="decodescope", function_name="replaceUrl"),
    Output("timeline-url-sync", "data"),
    Input("timeline-permalink", "href"),
    prevent_initial_call=True,
)
