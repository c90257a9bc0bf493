"""Overlap and prefetch: hidden and exposed communication, and prefetch effectiveness, per layer.

Data from analyzers.overlap.overlap and analyzers.prefetch.prefetch; each section shows the
analyzer's own definition (its docstring) above the numbers.
"""
from __future__ import annotations

from typing import Any

import dash
from dash import dcc, html

from dashboard import components as c
from dashboard import data
from dashboard.figures import overlap as figs

dash.register_page(__name__, path="/overlap", name="Overlap & prefetch", order=5)


def layout(run: str | None = None, **_: Any) -> html.Div:
    all_runs = data.runs()
    run_id = c.pick_run(all_runs, run)
    if run_id is None:
        return html.Div([html.H1("Overlap & prefetch"), c.no_runs()])
    return html.Div([
        html.H1("Overlap & prefetch"),
        c.run_links(all_runs, "/overlap", run_id),
        html.H2("Communication overlap"),
        *_section("overlap", "overlap", run_id, _overlap_body),
        html.H2("Prefetch"),
        *_section("prefetch", "prefetch", run_id, _prefetch_body),
    ])


def _section(module: str, function: str, run_id: int, render: Any) -> list[Any]:
    out: list[Any] = []
    doc = data.definition(module)
    if doc:
        out.append(html.Div(dcc.Markdown(doc), className="definition", id=f"overlap-{module}-definition"))
    try:
        result = data.call(module, function, run_id)
    except data.PageDataError as exc:
        return [*out, c.notice(str(exc))]
    na = figs.not_applicable(result)
    if na:
        return [*out, c.notice(na)]
    return [*out, *render(result)]


def _overlap_body(result: dict[str, Any]) -> list[Any]:
    ranks = [[r.get("rank"), f"{r.get('comm_ns') or 0:,}", f"{r.get('overlap_ns') or 0:,}",
              _pct(r.get("overlap_pct")), f"{r.get('exposed_comm_ns') or 0:,}"] for r in result.get("ranks", [])]
    layers = [[r.get("rank"), r.get("layer") or "(none)", r.get("steps"), f"{r.get('comm_ns') or 0:,}",
               f"{r.get('overlap_ns') or 0:,}", _pct(r.get("overlap_pct")), f"{r.get('exposed_comm_ns') or 0:,}"]
              for r in result.get("layers", [])]
    return [c.table(["rank", "comm (ns)", "hidden under compute (ns)", "overlap %", "exposed comm (ns)"], ranks,
                    id="overlap-ranks"),
            dcc.Graph(id="overlap-layers", figure=figs.overlap_per_layer(result)),
            c.table(["rank", "layer", "steps", "comm (ns)", "hidden (ns)", "overlap %", "exposed (ns)"], layers,
                    text_cols=2, id="overlap-layers-table")]


def _prefetch_body(result: dict[str, Any]) -> list[Any]:
    summary = result.get("summary", {})
    rows = [[p.get("name"), p.get("layer"), p.get("consumer_name"), f"{p.get('dur_ns') or 0:,}",
             _pct(p.get("hidden_pct")), _num(p.get("lead_ns")),
             "–" if p.get("consumer_id") is None else ("late" if p.get("late") else "on time")]
            for p in result.get("prefetches", [])]
    return [html.P(f"{summary.get('count', len(rows))} prefetches, {_pct(summary.get('hidden_pct'))} % of their "
                   "time hidden (duration-weighted)", className="note"),
            dcc.Graph(id="overlap-prefetch", figure=figs.prefetch_bars(result)),
            c.table(["prefetch", "layer", "consumer", "duration (ns)", "hidden %", "lead over consumer (ns)",
                     "consumer started"], rows, text_cols=3, id="overlap-prefetch-table")]


def _pct(v: Any) -> str:
    return "–" if v is None else f"{v:.1f}"


def _num(v: Any) -> str:
    return "–" if v is None else f"{v:,}"
