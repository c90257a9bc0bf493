"""Open a decodescope store (DuckDB) and hold its schema.

The schema lives in `schema.sql` beside this module and is the one contract between the
tracer (writers) and the analyzers (readers). Opening a store creates any missing table.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import duckdb

from tracer.errors import BadInput

SCHEMA_SQL = resources.files("tracer").joinpath("schema.sql").read_text()

# Tables that every reader fills for a run, in the order they are deleted on rollback.
RUN_TABLES = (
    "kernels", "memops", "api_calls", "ranges", "gpu_annotations", "gpu_syncs",
    "graph_capture_map", "category_rules",
)


def open_store(path: str | Path | None = None, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """Open (or create) the store at `path`, or an in-memory store when `path` is None.

    A file that exists but is not a DuckDB database raises BadInput naming it.
    """
    if path is None:
        con = duckdb.connect(":memory:")
    else:
        p = Path(path)
        if p.is_dir():
            raise BadInput(p, "is a directory, not a DuckDB database")
        if read_only and not p.exists():
            raise BadInput(p, "no such database")
        try:
            con = duckdb.connect(str(p), read_only=read_only)
        except duckdb.Error as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BadInput(p, f"not a DuckDB database ({first})") from None
    if not read_only:
        con.execute(SCHEMA_SQL)
    return con


@contextlib.contextmanager
def transaction(con: duckdb.DuckDBPyConnection) -> Iterator[duckdb.DuckDBPyConnection]:
    """One all-or-nothing transaction: commit on success, roll back on any exception."""
    con.execute("BEGIN TRANSACTION")
    try:
        yield con
    except BaseException:
        con.execute("ROLLBACK")
        raise
    else:
        con.execute("COMMIT")


def run_ids(con: duckdb.DuckDBPyConnection) -> list[int]:
    """Every run in the store, oldest first."""
    return [r[0] for r in con.execute("SELECT run_id FROM runs ORDER BY run_id").fetchall()]
