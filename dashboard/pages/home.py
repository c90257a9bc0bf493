"""Overview: the headline question at a glance (µs and kernels per layer, base vs candidate).

Calls analyzers.layers.compare on the default pair (latest stock and fused runs, else the two
first runs) or on base/cand from the URL, and says what is missing when there is no pair.
"""
from __future__ import annotations

from typing import Any

import dash
from dash import dcc, html

from dashboard import components as c
from dashboard import data
from dashboard.figures import layers as layer_figs

dash.register_page(__name__, path="/", name="Overview", order=0)


def layout(base: str | None = None, cand: str | None = None, **_: Any) -> html.Div:
    all_runs = data.runs()
    if not all_runs:
        return html.Div([html.H1("decodescope"), c.no_runs()])
    d_base, d_cand = data.default_pair(all_runs)
    base_id, cand_id = c.pick_run(all_runs, base if base is not None else d_base), c.int_arg(cand, d_cand)
    if cand_id not in [r["run_id"] for r in all_runs] or cand_id == base_id:
        cand_id = None
    missing = _missing(all_runs, base_id, cand_id)
    body: list[Any] = [
        html.H1("Per layer: time and kernels"),
        html.P(["base: ", html.B(data.run_label(_run(all_runs, base_id)))]
               + ([" · candidate: ", html.B(data.run_label(_run(all_runs, cand_id)))] if cand_id else [])
               + [" · the seed's reference: stock 130 µs / 23 kernels per layer, fused 69 µs / 13"],
               className="note"),
        *[c.notice(m) for m in missing],
    ]
    try:
        if cand_id is None:
            result = data.call("layers", "layer_breakdown", base_id)
            if result.get("not_applicable"):
                body.append(c.notice(f"not applicable: {result['not_applicable']}"))
            else:
                body += [dcc.Graph(id="home-chart", figure=layer_figs.breakdown_bars(
                    result, data.run_label(_run(all_runs, base_id))))]
        else:
            result = data.call("layers", "compare", base_id, cand_id)
            if not result.get("kinds"):
                body.append(c.notice("Neither run has kernels attributed to a layer (no layer ranges or "
                                     "capture map): see the timeline and kernels pages."))
            else:
                body += [c.seed_table(layer_figs.seed_rows(result), data.run_label(_run(all_runs, base_id)),
                                      data.run_label(_run(all_runs, cand_id)), id="home-seed-table"),
                         dcc.Graph(id="home-chart", figure=layer_figs.compare_bars(result))]
    except data.PageDataError as exc:
        body.append(c.notice(str(exc)))
    body.append(html.Div([
        dcc.Link("layers side by side", href=c.href("/layers", base=base_id, cand=cand_id)),
        dcc.Link("timeline", href=c.href("/timeline", run=base_id)),
        dcc.Link("bubbles", href=c.href("/bubbles", run=base_id)),
        dcc.Link("overlap & prefetch", href=c.href("/overlap", run=base_id)),
        dcc.Link("diff", href=c.href("/diff", base=base_id, cand=cand_id)),
        dcc.Link("kernels", href=c.href("/kernels", run=base_id)),
        dcc.Link("all runs", href="/runs"),
    ], className="links", style={"marginTop": "1em"}))
    return html.Div(body)


def _run(all_runs: list[dict[str, Any]], run_id: int) -> dict[str, Any]:
    return next(r for r in all_runs if r["run_id"] == run_id)


def _missing(all_runs: list[dict[str, Any]], base: int | None, cand: int | None) -> list[str]:
    """Say plainly what the headline comparison lacks."""
    variants = {r.get("variant") for r in all_runs}
    out = []
    if "fused" not in variants:
        out.append("No fused run in this store: the comparison shows what exists "
                   "(ingest a fused trace to see stock vs fused).")
    if "stock" not in variants:
        out.append("No stock run (variant metadata) in this store.")
    if cand is None:
        out.append("Only one run: there is nothing to compare it with.")
    return out
