"""Runs: the runs in the store with their metadata, a pair picker, and trace upload.

Upload (dcc.Upload) or a server-side path ingests a new trace with the CLI's bad-input rules:
a file that cannot be read shows the one-line `error: <file>: <problem>` here and leaves the
store unchanged (the ingest runs in one transaction).
"""
from __future__ import annotations

import base64
import tempfile
from pathlib import Path
from typing import Any

import dash
import duckdb
from dash import Input, Output, State, callback, dcc, html

from dashboard import components as c
from dashboard import data
from tracer.errors import BadInput

dash.register_page(__name__, path="/runs", name="Runs", order=1)


def layout(base: str | None = None, cand: str | None = None, **_: Any) -> html.Div:
    all_runs = data.runs()
    d_base, d_cand = data.default_pair(all_runs)
    base_id = c.int_arg(base, d_base)
    cand_id = c.int_arg(cand, d_cand)
    options = [{"label": data.run_label(r), "value": r["run_id"]} for r in all_runs]
    store = data.pool()
    return html.Div([
        html.H1("Runs"),
        html.P(f"store: {store.label}" + ("" if store.writable else " (read-only: uploads disabled)"),
               className="note", id="runs-store"),
        _runs_table(all_runs) if all_runs else c.no_runs(),
        html.H2("Compare two runs"),
        html.Div([
            html.Label(["base (e.g. stock)", dcc.Dropdown(options, base_id, id="runs-base", className="dropdown",
                                                           clearable=False)]),
            html.Label(["candidate (e.g. fused)", dcc.Dropdown(options, cand_id, id="runs-cand",
                                                                className="dropdown")]),
        ], className="controls"),
        html.Div(_pair_links(base_id, cand_id), id="runs-pair-links", className="links"),
        html.H2("Add a trace"),
        html.P("Kineto / PyTorch-profiler JSON (.json, .json.gz). Bad files are rejected with one line "
               "and leave the store unchanged.", className="note"),
        dcc.Upload(html.Div("Drop a trace here or click to choose one"), id="runs-upload",
                   className="upload", multiple=False),
        html.Div([
            dcc.Input(id="runs-path", type="text", placeholder="or a path on the server: /data/trace.json.gz",
                      style={"width": "26em"}),
            html.Button("Ingest", id="runs-path-go"),
        ], className="controls", style={"marginTop": "0.6em"}),
        html.Div(id="runs-upload-result"),
    ])


def _runs_table(all_runs: list[dict[str, Any]]) -> html.Table:
    header = ["run", "name", "source", "variant", "gpu", "B / k", "ranks", "graph", "tp_sim", "kernels", "created",
              "views"]
    rows = []
    for r in all_runs:
        rid = r["run_id"]
        views = html.Span([
            dcc.Link("timeline", href=c.href("/timeline", run=rid)), " ",
            dcc.Link("kernels", href=c.href("/kernels", run=rid)), " ",
            dcc.Link("layers", href=c.href("/layers", base=rid)), " ",
            dcc.Link("bubbles", href=c.href("/bubbles", run=rid)),
        ], className="links")
        batch, spec = data.workload(r)
        rows.append([rid, r["name"], r["source"], r["variant"], r["gpu"],
                     "" if batch is None else f"{batch} / {spec or 0}", r["world_size"],
                     _yes_no(r["graph_mode"]), _yes_no(r["tp_sim"]), f"{r['kernels']:,}", r["created_at"], views])
    return c.table(header, rows, text_cols=5, id="runs-table")


def _yes_no(v: Any) -> str:
    return "" if v is None else ("yes" if v else "no")


def _pair_links(base: int | None, cand: int | None) -> list[Any]:
    if base is None:
        return []
    return [dcc.Link(f"{label} →", href=c.href(path, base=base, cand=cand))
            for label, path in (("layers side by side", "/layers"), ("diff", "/diff"), ("overview", "/"))]


@callback(Output("runs-pair-links", "children"), Input("runs-base", "value"), Input("runs-cand", "value"),
          prevent_initial_call=True)
def _update_pair(base: int | None, cand: int | None) -> list[Any]:
    return _pair_links(base, cand)


@callback(Output("runs-upload-result", "children"), Output("runs-upload", "contents"),
          Input("runs-upload", "contents"), Input("runs-path-go", "n_clicks"),
          State("runs-upload", "filename"), State("runs-path", "value"),
          prevent_initial_call=True)
def _ingest(contents: str | None, _clicks: int | None, filename: str | None, path: str | None) -> Any:
    """Ingest the uploaded file (under its own name) or the typed server path. The upload is
    cleared afterwards, so choosing the same file again is a new upload."""
    if dash.ctx.triggered_id == "runs-upload":
        if not contents:
            return dash.no_update, dash.no_update
        if not filename:
            return c.notice("error: the upload has no file name", "error"), None
        return _ingest_upload(contents, filename), None
    if not path:
        return c.notice("error: type a path first", "error"), dash.no_update
    return _ingest_file(Path(path).expanduser(), Path(path).name, shown=path), dash.no_update


def _ingest_upload(contents: str, filename: str) -> Any:
    safe = Path(filename).name
    try:
        payload = base64.b64decode(contents.split(",", 1)[1], validate=False)
    except (IndexError, ValueError):
        return c.notice(f"error: {safe}: the upload could not be decoded", "error")
    with tempfile.TemporaryDirectory(prefix="decodescope-upload-") as tmp:
        target = Path(tmp) / safe
        target.write_bytes(payload)
        return _ingest_file(target, Path(safe).name.split(".")[0], shown=safe)


def _ingest_file(path: Path, name: str, shown: str) -> Any:
    """Ingest and report in one line; errors name the file as the user gave it."""
    try:
        infos = data.pool().ingest(path, name=name)
    except BadInput as exc:
        return c.notice(f"error: {shown}: {exc.problem}", "error")
    except duckdb.Error as exc:
        return c.notice(f"error: {shown}: store error: {str(exc).splitlines()[0]}", "error")
    parts = []
    for info in infos:
        what = "already in the store as" if info.reused else "ingested as"
        parts.append(html.Span([f"{shown}: {what} run {info.run_id} ({info.kernels:,} kernels) ",
                                dcc.Link("timeline", href=c.href("/timeline", run=info.run_id)), " ",
                                dcc.Link("runs", href="/runs")]))
    return html.Div(parts, className="ok", id="runs-upload-ok")
