"""Bubbles: device-idle intervals inside steps, ranked, by cause; each links to the timeline.

Data from analyzers.bubbles.bubbles. A bubble's link opens the timeline on its run, rank and
step with a window around the bubble and the bubble itself marked (m0/m1).
"""
from __future__ import annotations

from typing import Any

import dash
from dash import dcc, html

from dashboard import components as c
from dashboard import data
from dashboard.figures import bubbles as figs

dash.register_page(__name__, path="/bubbles", name="Bubbles", order=4)

TOP = 50


def layout(run: str | None = None, **_: Any) -> html.Div:
    all_runs = data.runs()
    run_id = c.pick_run(all_runs, run)
    if run_id is None:
        return html.Div([html.H1("Bubbles"), c.no_runs()])
    body: list[Any] = [html.H1("Bubbles"), c.run_links(all_runs, "/bubbles", run_id)]
    doc = data.definition("bubbles")
    if doc:
        body.append(html.Div(dcc.Markdown(doc), className="definition", id="bubbles-definition"))
    try:
        result = data.call("bubbles", "bubbles", run_id, top=TOP)
    except data.PageDataError as exc:
        return html.Div([*body, c.notice(str(exc))])
    if isinstance(result, dict) and result.get("not_applicable"):
        return html.Div([*body, c.notice(f"not applicable: {result['not_applicable']}")])
    if result.get("note"):
        body.append(c.notice(result["note"]))
    body.append(dcc.Graph(id="bubbles-causes", figure=figs.by_cause_bars(result)))
    rows = []
    for i, b in enumerate(result.get("top", [])):
        rows.append([
            dcc.Link(f"#{i + 1}", href=bubble_href(run_id, b), id={"type": "bubbles-link", "index": i}),
            b.get("cause"), f"{b['gap_ns']:,}", b.get("step_index"), b.get("layer"), b.get("op"),
            b.get("prev_name"), b.get("next_name"), b.get("rank"),
        ])
    body += [html.H2(f"Largest {len(rows)} bubbles (each links to its place on the timeline)"),
             c.table(["bubble", "cause", "gap (ns)", "step", "layer", "op", "previous kernel", "next kernel",
                      "rank"], rows, text_cols=2, id="bubbles-table")]
    if result.get("layers"):
        body += [html.H2("By layer"), c.table(
            ["layer", "bubbles", "bubble ns", *figs.CAUSE_COLORS],
            [[lay["layer"], lay["bubbles"], f"{lay['bubble_ns']:,}",
              *[f"{(lay.get('by_cause') or {}).get(k, 0):,}" for k in figs.CAUSE_COLORS]]
             for lay in result["layers"]], id="bubbles-layers")]
    return html.Div(body)


def bubble_href(run_id: int, b: dict[str, Any]) -> str:
    """Timeline link: a window of 10 gaps (at least 2 µs) centred on the bubble, bubble marked."""
    start, end = int(b["start_ns"]), int(b["end_ns"])
    pad = max(5 * (end - start), 1_000)
    return c.href("/timeline", run=run_id, rank=b.get("rank", 0), step=b.get("step_index"),
                  t0=start - pad, t1=end + pad, m0=start, m1=end)
