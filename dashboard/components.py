"""Small layout pieces the pages share: query-string parsing, links that carry state, notices.

No data access here (that is dashboard/data.py) and no figures (dashboard/figures/).
"""
from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from dash import dcc, html

from dashboard import data


def int_arg(value: Any, default: int | None = None) -> int | None:
    """A query-string value as int (URL state is text); `default` when absent or malformed."""
    if value is None or value == "":
        return default
    try:
        return int(str(value))
    except ValueError:
        return default


def href(path: str, **query: Any) -> str:
    """`path?k=v...` with the None values left out, so a link carries exactly the view's state."""
    q = {k: v for k, v in query.items() if v is not None and v != ""}
    return f"{path}?{urlencode(q)}" if q else path


def notice(text: str, kind: str = "missing") -> html.Div:
    """A one-line notice: 'missing' (something is not there), 'error' or 'ok'."""
    return html.Div(text, className=kind)


def capture_stream_notice(breakdown: dict[str, Any]) -> list[html.Div]:
    """The layers page's notice for a run whose graph kernels have no capture stream (traces
    captured before it was recorded): its per-op busy time may hold PDL waits the replay moved
    across streams (analyzers/sql/kernels/exposed.sql). Empty when there is nothing to say."""
    n = breakdown.get("graph_kernels_without_capture_stream") or 0
    if not n:
        return []
    return [notice(f"{n} graph-replayed kernels have no capture stream (a trace captured before they "
                   "were recorded): where the replay moved a PDL chain across streams, the wait stays "
                   "in that op's busy time.")]


def run_links(all_runs: list[dict[str, Any]], path: str, current: int | None, param: str = "run",
              **keep: Any) -> html.Div:
    """One link per run to `path` with `param` set to it (other state in `keep` carried along)."""
    items: list[Any] = [html.Span(f"{param}: ", className="note")]
    for r in all_runs:
        label = data.run_label(r)
        if r["run_id"] == current:
            items.append(html.B(label, style={"marginRight": "1em"}))
        else:
            items.append(dcc.Link(label, href=href(path, **{**keep, param: r["run_id"]}),
                                  style={"marginRight": "1em"}))
        items.append(" ")  # a break opportunity between runs
    return html.Div(items, className="links runlinks")


def pick_run(all_runs: list[dict[str, Any]], run: Any) -> int | None:
    """The run named in the URL if it exists, else the first run of the store."""
    ids = [r["run_id"] for r in all_runs]
    wanted = int_arg(run)
    if wanted in ids:
        return wanted
    return ids[0] if ids else None


def table(header: list[str], rows: list[list[Any]], text_cols: int = 1, id: str | None = None) -> html.Table:
    """A plain HTML table; the first `text_cols` columns are left-aligned text."""
    def cell(tag: Any, i: int, v: Any) -> Any:
        return tag("" if v is None else v, className="text" if i < text_cols else None)

    kwargs = {"id": id} if id else {}
    return html.Table([
        html.Thead(html.Tr([cell(html.Th, i, h) for i, h in enumerate(header)])),
        html.Tbody([html.Tr([cell(html.Td, i, v) for i, v in enumerate(r)]) for r in rows]),
    ], className="plain", **kwargs)


def no_runs() -> html.Div:
    return notice("The store has no runs yet: ingest a trace on the Runs page.")


def seed_table(rows: list[dict[str, Any]], base_name: str, cand_name: str, id: str) -> html.Table:
    """The seed-style table: per layer kind, µs / kernels per layer for both runs and the ratio."""
    def ratio(v: Any) -> str:
        return "" if v is None else f"{v:.2f}×"

    def us(r: dict[str, Any], side: str) -> Any:
        if r[f"{side}_ns"] is None:
            return "–"
        return html.Span([f"{r[f'{side}_us']:,} µs", html.Br(), html.Small(f"{r[f'{side}_ns']:,} ns")])

    body = [[r["kind"], us(r, "base"), r["base_kernels"], us(r, "cand"), r["cand_kernels"],
             ratio(r["time_ratio"]), ratio(r["kernel_ratio"])] for r in rows]
    return table(["layer kind", f"{base_name}: time / layer", "kernels / layer", f"{cand_name}: time / layer",
                  "kernels / layer", "time ratio", "kernel ratio"], body, id=id)
