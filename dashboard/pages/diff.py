"""Diff: the trace-diff report between two runs, aligned by (layer kind, layer index, op).

Data from analyzers.diff.diff_runs; state in the URL: base, cand, metric, threshold.
"""
from __future__ import annotations

from typing import Any

import dash
from dash import html

from dashboard import components as c
from dashboard import data

dash.register_page(__name__, path="/diff", name="Diff", order=6)

METRICS = ("span", "busy", "kernels", "bubbles")


def layout(base: str | None = None, cand: str | None = None, metric: str | None = None,
           threshold: str | None = None, **_: Any) -> html.Div:
    all_runs = data.runs()
    if len(all_runs) < 2:
        return html.Div([html.H1("Diff"), c.notice("A diff needs two runs in the store.")])
    d_base, d_cand = data.default_pair(all_runs)
    base_id, cand_id = c.pick_run(all_runs, base or d_base), c.pick_run(all_runs, cand or d_cand)
    metric = metric if metric in METRICS else "span"
    thr = float(threshold) if threshold and threshold.replace(".", "", 1).isdigit() else 5.0
    body: list[Any] = [
        html.H1("Diff"),
        c.run_links(all_runs, "/diff", base_id, param="base", cand=cand_id, metric=metric, threshold=thr),
        c.run_links(all_runs, "/diff", cand_id, param="cand", base=base_id, metric=metric, threshold=thr),
        html.Div([html.Span("metric: ", className="note"),
                  *[html.A(m, href=c.href("/diff", base=base_id, cand=cand_id, metric=m, threshold=thr),
                           style={"marginRight": "1em", "fontWeight": "bold" if m == metric else "normal"})
                    for m in METRICS]], className="links"),
    ]
    try:
        report = data.call("diff", "diff_runs", base_id, cand_id, threshold_pct=thr, metric=metric).to_dict()
    except data.PageDataError as exc:
        return html.Div([*body, c.notice(str(exc))])
    verdict = report["verdict"]
    body += [
        html.P(f"verdict: {verdict} · mode: {report['mode']} · {len(report['regressions'])} regressions, "
               f"{len(report['improvements'])} improvements · aligned by {report['alignment'].get('aligned_by')}",
               className="error" if verdict == "regression" else "ok", id="diff-verdict"),
        *[html.P(n, className="note") for n in report.get("notes", [])],
        c.table(["layer", "op / kernel", "base steps", "cand steps", "base median", "cand median", "change %",
                 "CI of change %", "verdict"], [_row(r) for r in report["rows"]], text_cols=2, id="diff-table"),
    ]
    return html.Div(body)


def _row(r: dict[str, Any]) -> list[Any]:
    m = r.get("median") or {}
    ci = m.get("ci_pct")
    return [r.get("layer") or "", r.get("op") or r.get("kernel") or "", r.get("base_steps"), r.get("cand_steps"),
            _fmt(m.get("base")), _fmt(m.get("cand")), _fmt(m.get("change_pct"), 1),
            f"[{_fmt(ci[0], 1) or '+inf'}, {_fmt(ci[1], 1) or '+inf'}]" if ci else "", r.get("verdict")]


def _fmt(v: Any, digits: int = 0) -> str:
    return "" if v is None else f"{v:,.{digits}f}"
