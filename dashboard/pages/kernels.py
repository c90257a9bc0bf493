"""Kernels: every kernel of a run in a sortable, filterable grid, paged from the store.

The grid uses AG Grid's infinite row model: it asks for rows [start, end) with its sort and
filter model, and the server answers with that page only (analyzers.timeline.kernel_rows), so
a run with a million kernels never travels to the browser at once.
"""
from __future__ import annotations

from typing import Any

import dash
import dash_ag_grid as dag
from dash import Input, Output, State, callback, html

from dashboard import components as c
from dashboard import data

dash.register_page(__name__, path="/kernels", name="Kernels", order=7)

PAGE_ROWS = 100
TEXT_COLS = ("name", "category")
EXACT_COLS = ("start_ns", "end_ns", "correlation")
MIN_WIDTH = {"name": 260, "start_ns": 185, "end_ns": 185, "dur_ns": 110, "category": 120}
COLUMNS = [
    ("kernel_id", "kernel"), ("rank", "rank"), ("stream", "stream"), ("name", "name"), ("category", "category"),
    ("start_ns", "start (ns)"), ("end_ns", "end (ns)"), ("dur_ns", "duration (ns)"), ("correlation", "correlation"),
    ("grid_x", "grid x"), ("block_x", "block x"), ("registers_per_thread", "regs"), ("shared_mem_bytes", "smem (B)"),
]


def layout(run: str | None = None, **_: Any) -> html.Div:
    all_runs = data.runs()
    run_id = c.pick_run(all_runs, run)
    if run_id is None:
        return html.Div([html.H1("Kernels"), c.no_runs()])
    col_defs = [{"field": "where", "headerName": "", "cellRenderer": "markdown", "sortable": False,
                 "filter": False, "width": 90}]
    col_defs += [{"field": f, "headerName": h, "sortable": True,
                  "filter": "agTextColumnFilter" if f in TEXT_COLS else "agNumberColumnFilter",
                  "flex": 3 if f == "name" else 1, "minWidth": MIN_WIDTH.get(f, 80)}
                 for f, h in COLUMNS]
    return html.Div([
        html.H1("Kernels"),
        c.run_links(all_runs, "/kernels", run_id),
        html.Div(id="kernels-count", className="note"),
        dag.AgGrid(
            id="kernels-grid",
            columnDefs=col_defs,
            rowModelType="infinite",
            dashGridOptions={"cacheBlockSize": PAGE_ROWS, "maxBlocksInCache": 20, "rowBuffer": 0,
                             "infiniteInitialRowCount": PAGE_ROWS},
            defaultColDef={"filterParams": {"maxNumConditions": 1, "buttons": ["reset"]}},
            style={"height": "640px"},
        ),
        html.Div(str(run_id), id="kernels-run", hidden=True),
    ])


def kernel_href(run_id: int, row: dict[str, Any]) -> str:
    """The timeline around one kernel (5 of its durations, at least 2 µs, on each side), marked."""
    start, end = int(row["start_ns"]), int(row["end_ns"])
    pad = max(5 * (end - start), 2_000)
    return c.href("/timeline", run=run_id, rank=row["rank"], t0=start - pad, t1=end + pad, m0=start, m1=end)


@callback(Output("kernels-grid", "getRowsResponse"), Output("kernels-count", "children"),
          Input("kernels-grid", "getRowsRequest"), State("kernels-run", "children"), prevent_initial_call=True)
def _rows(request: dict[str, Any] | None, run: str) -> Any:
    """Serve one block of rows, sorted and filtered in the store."""
    if not request:
        return dash.no_update, dash.no_update
    start, end = int(request.get("startRow", 0)), int(request.get("endRow", PAGE_ROWS))
    filters = {col: spec for col, spec in (request.get("filterModel") or {}).items() if "filter" in spec}
    rows, total = data.kernel_rows(int(run), start, end - start, request.get("sortModel"), filters)
    for row in rows:
        row["where"] = f"[timeline]({kernel_href(int(run), row)})"
        for col in EXACT_COLS:  # epoch ns exceed float64 precision in JavaScript: send them as text
            row[col] = None if row[col] is None else str(row[col])
    return {"rowData": rows, "rowCount": total}, f"{total:,} kernels match"
