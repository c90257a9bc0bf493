"""What is in a run: counts, device busy time and span, per stream, per category, top kernels.

Definitions live with the views in analyzers/sql/summary/summary.sql (busy = union of
kernel and memop intervals per rank, summed over ranks; span = first start to last end per
rank, the largest over ranks). This module only queries them with bound parameters.
"""
from __future__ import annotations

from typing import Any

import duckdb

from analyzers.views import SQL_ROOT, _requires, ordered_sql_files

# The one SQL file this module queries; load_summary_sql adds what it requires.
SUMMARY_SQL = "summary/summary.sql"

RUN_SQL = """
SELECT run_id, name, ranks, kernels, memops, api_calls, span_ns, busy_ns
FROM summary_runs WHERE run_id = ?
"""
STREAMS_SQL = """
SELECT rank, stream, kernels, busy_ns FROM summary_streams
WHERE run_id = ? ORDER BY rank, stream NULLS LAST
"""
CATEGORIES_SQL = "SELECT category, busy_ns FROM summary_categories WHERE run_id = ? ORDER BY category"
TOP_KERNELS_SQL = """
SELECT name, kernel_count, total_ns FROM summary_kernel_totals
WHERE run_id = ? ORDER BY total_ns DESC, name LIMIT ?
"""
RUNS_SQL = """
SELECT r.run_id, r.name, r.source, r.path, r.variant, r.gpu, r.world_size, r.graph_mode, r.tp_sim,
       CAST(r.created_at AS VARCHAR) AS created_at,
       (SELECT count(*) FROM kernels AS k WHERE k.run_id = r.run_id) AS kernels
FROM runs AS r ORDER BY r.run_id
"""


def load_summary_sql(con: duckdb.DuckDBPyConnection) -> None:
    """Create the summary views and the SQL they require (intervals), nothing else.

    Not analyzers.views.load_views: that creates every analysis's views, ~0.1 s of a
    `decodescope summary` call that needs two files. TEMP objects on a read-only store, as
    load_views does; view comments are load_views's job.
    """
    wanted: list[str] = []

    def visit(rel: str) -> None:
        if rel not in wanted:
            for dep in _requires((SQL_ROOT / rel).read_text()):
                visit(dep)
            wanted.append(rel)

    visit(SUMMARY_SQL)
    paths = {SQL_ROOT / rel for rel in wanted}
    read_only = bool(con.execute(
        "SELECT readonly FROM duckdb_databases() WHERE database_name = current_database()"
    ).fetchall()[0][0])
    for path in (p for p in ordered_sql_files() if p in paths):
        text = path.read_text()
        if read_only:
            text = text.replace("CREATE OR REPLACE VIEW", "CREATE OR REPLACE TEMP VIEW")
            text = text.replace("CREATE OR REPLACE MACRO", "CREATE OR REPLACE TEMP MACRO")
        con.execute(text)


def summarize(con: duckdb.DuckDBPyConnection, run_ids: list[int], top: int = 10) -> dict[str, Any]:
    """The summary of each run, as the JSON shape `decodescope summary --format json` prints."""
    load_summary_sql(con)
    runs = []
    for run_id in run_ids:
        row = con.execute(RUN_SQL, [run_id]).fetchall()
        if not row:
            continue
        keys = ("run_id", "name", "ranks", "kernels", "memops", "api_calls", "span_ns", "busy_ns")
        out: dict[str, Any] = {k: (int(v) if isinstance(v, int) else v) for k, v in zip(keys, row[0])}
        out["streams"] = [{"rank": r, "stream": s, "kernels": int(k), "busy_ns": int(b)}
                          for r, s, k, b in con.execute(STREAMS_SQL, [run_id]).fetchall()]
        out["categories"] = {c: int(b) for c, b in con.execute(CATEGORIES_SQL, [run_id]).fetchall()}
        out["top_kernels"] = [{"name": n, "count": int(c), "total_ns": int(t)}
                              for n, c, t in con.execute(TOP_KERNELS_SQL, [run_id, top]).fetchall()]
        runs.append(out)
    return {"runs": runs}


def list_runs(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """Every run in the store with its capture facts and kernel count, oldest first."""
    cur = con.execute(RUNS_SQL)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, row)) for row in cur.fetchall()]
