"""Layers: per-layer busy time stacked by op and kernel counts, two runs side by side.

Data from analyzers.layers (layer_breakdown per run, compare for the seed table); state in the
URL: base and cand run ids.
"""
from __future__ import annotations

from typing import Any

import dash
from dash import dcc, html

from dashboard import components as c
from dashboard import data
from dashboard.figures import layers as figs

dash.register_page(__name__, path="/layers", name="Layers", order=2)


def layout(base: str | None = None, cand: str | None = None, **_: Any) -> html.Div:
    all_runs = data.runs()
    if not all_runs:
        return html.Div([html.H1("Layers"), c.no_runs()])
    d_base, d_cand = data.default_pair(all_runs)
    base_id = c.pick_run(all_runs, base if base is not None else d_base)
    cand_id = c.int_arg(cand, d_cand if base is None else None)
    if cand_id not in [r["run_id"] for r in all_runs]:
        cand_id = None
    labels = {r["run_id"]: data.run_label(r) for r in all_runs}
    body: list[Any] = [
        html.H1("Layers"),
        c.run_links(all_runs, "/layers", base_id, param="base", cand=cand_id),
        c.run_links(all_runs, "/layers", cand_id, param="cand", base=base_id),
    ]
    if cand_id is None:
        body.append(c.notice("One run shown: pick a candidate run above to see two side by side."))
    try:
        refs = {run_id: data.eager_sibling(all_runs, run_id) for run_id in (base_id, cand_id)}
        sides = [(side, run_id, data.call("layers", "layer_breakdown", run_id, graph_reference=refs[run_id]))
                 for side, run_id in (("base", base_id), ("cand", cand_id)) if run_id is not None]
        colors = figs.op_colors(*[bd for _s, _r, bd in sides])
        columns = []
        for side, run_id, bd in sides:
            content: list[Any] = [html.H2(labels[run_id], id=f"layers-{side}-title")]
            if bd.get("not_applicable"):
                content.append(c.notice(f"not applicable: {bd['not_applicable']}"))
            else:
                content += c.capture_stream_notice(bd)
                ref = refs.get(run_id)
                content += [
                    html.P(f"median over {bd.get('steps')} steps"
                           + (f"; capture streams from eager run {labels[ref]}" if ref is not None else ""),
                           className="note", id=f"layers-{side}-steps"),
                    dcc.Graph(id=f"layers-{side}-time", figure=figs.breakdown_bars(bd, "busy time by op (µs)", colors)),
                    dcc.Graph(id=f"layers-{side}-kernels", figure=figs.kernel_bars(bd, "kernels by op", colors)),
                ]
            columns.append(html.Div(content, style={"flex": "1", "minWidth": "0"}))
        body.append(html.Div(columns, style={"display": "flex", "gap": "1em"}))
        if cand_id is not None:
            cmp = data.call("layers", "compare", base_id, cand_id)
            body += [html.H2("Per layer kind"),
                     c.seed_table(figs.seed_rows(cmp), labels[base_id], labels[cand_id], id="layers-seed-table")]
    except data.PageDataError as exc:
        body.append(c.notice(str(exc)))
    return html.Div(body)
