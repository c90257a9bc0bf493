"""Read an Nsight Systems SQLite export: open and check it, copy its activity tables into
DuckDB TEMP tables, and read its lookups (enums, GPUs, thread names, export metadata).

Rows travel from SQLite to DuckDB as Arrow batches with explicit types (int64 ns, text);
the SQLite SELECTs come from `nsys_sql.STAGING`, so a column renamed between nsys versions
is one more candidate there, never code here.
"""
from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from tracer.errors import BadInput
from tracer.ingest import nsys_sql as q

SQLITE_MAGIC = b"SQLite format 3\x00"
BATCH_ROWS = 200_000
_ARROW = {"int": pa.int64(), "str": pa.string()}


def connect(path: Path) -> sqlite3.Connection:
    """Open the export read-only and immutable (no journal files next to a read-only corpus)."""
    with path.open("rb") as fh:
        head = fh.read(len(SQLITE_MAGIC))
    if head != SQLITE_MAGIC:
        raise BadInput(path, "not an SQLite database (expected an Nsight Systems SQLite export)")
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro&immutable=1", uri=True)
        db.execute("SELECT count(*) FROM sqlite_master").fetchall()
    except sqlite3.DatabaseError as exc:
        raise BadInput(path, f"corrupt SQLite file ({exc})") from None
    return db


def tables_of(db: sqlite3.Connection) -> dict[str, set[str]]:
    """Every table of the export with its column names."""
    names = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")]
    return {n: {r[1] for r in db.execute(f'PRAGMA table_info("{n}")')} for n in names}


def check_export(path: Path, tables: dict[str, set[str]]) -> None:
    """BadInput unless the file has the tables that make it an nsys export."""
    if not any(t.startswith("CUPTI_ACTIVITY_KIND_") or t == "NVTX_EVENTS" for t in tables):
        raise BadInput(path, "SQLite file is not an Nsight Systems export (no CUPTI_ACTIVITY_KIND_* or NVTX_EVENTS table)")
    for stage in q.STAGING:
        cols = tables.get(stage.source)
        if cols is not None and not {"start", "end"} <= cols and stage.source != "CUPTI_ACTIVITY_KIND_CUDA_EVENT":
            raise BadInput(path, f"table {stage.source} has no start/end columns (not an nsys export?)")


def copy_tables(con: duckdb.DuckDBPyConnection, db: sqlite3.Connection, path: Path,
           tables: dict[str, set[str]]) -> dict[str, int]:
    """Copy every staged nsys table into its DuckDB temp table; returns rows read per table."""
    has_strings = "StringIds" in tables
    rows_read: dict[str, int] = {}
    for stage in q.STAGING:
        schema = pa.schema([("seq", pa.int64())] + [(c.name, _ARROW[c.kind]) for c in stage.cols])
        batches: list[pa.RecordBatch] = []
        if stage.source in tables:
            sql = q.staging_select(stage, tables[stage.source], has_strings)
            try:
                cur = db.execute(sql)
                while rows := cur.fetchmany(BATCH_ROWS):
                    columns = list(zip(*rows))
                    batches.append(pa.record_batch(
                        [pa.array(col, type=f.type) for col, f in zip(columns, schema)], schema=schema))
            except sqlite3.DatabaseError as exc:
                raise BadInput(path, f"cannot read {stage.source} ({exc})") from None
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
                raise BadInput(path, f"unexpected value in {stage.source} ({exc})") from None
            rows_read[stage.source] = sum(b.num_rows for b in batches)
        arrow = pa.Table.from_batches(batches, schema=schema)
        con.register("_nsys_arrow", arrow)
        try:
            con.execute(f"CREATE OR REPLACE TEMP TABLE {stage.table} AS SELECT * FROM _nsys_arrow")
        finally:
            con.unregister("_nsys_arrow")
    return rows_read


def enum(db: sqlite3.Connection, tables: dict[str, set[str]], table: str, builtin: dict[int, str]) -> dict[int, str]:
    """An nsys enum: the file's own ENUM_* labels when exported, else the built-in ones."""
    if table in tables and {"id", "label"} <= tables[table]:
        found = {int(i): str(label) for i, label in db.execute(q.ENUM_SQL.format(table=table)) if label is not None}
        return {**builtin, **found}
    return builtin


def load_enums(con: duckdb.DuckDBPyConnection, db: sqlite3.Connection, tables: dict[str, set[str]]) -> None:
    con.execute(q.ENUM_TABLE_SQL)
    rows = [("copy", k, v) for k, v in q.COPY_KINDS.items()]   # Kineto's short spellings
    rows += [("mem", k, v) for k, v in enum(db, tables, "ENUM_CUDA_MEM_KIND", q.MEM_KINDS).items()]
    rows += [("sync", k, v) for k, v in q.SYNC_TYPES.items()]
    con.executemany(q.ENUM_INSERT_SQL, rows)


def export_meta(db: sqlite3.Connection, tables: dict[str, set[str]]) -> dict[str, str]:
    for table in ("META_DATA_EXPORT", "EXPORT_META_DATA"):
        if table in tables:
            return {str(k): str(v) for k, v in db.execute(q.EXPORT_META_SQL.format(table=table))}
    return {}


def session_start(db: sqlite3.Connection, tables: dict[str, set[str]]) -> dict[str, int]:
    """When the session started: UTC epoch ns, and (nsys >= 2025) the same instant on the
    trace clock, so an event at t happened at utc + (t - clock) wall time."""
    cols = tables.get("TARGET_INFO_SESSION_START_TIME", set())
    out: dict[str, int] = {}
    for col, key in (("utcEpochNs", "session_start_utc_epoch_ns"), ("systemClockNs", "session_start_clock_ns")):
        if col in cols:
            row = db.execute(q.SESSION_START_SQL.format(col=col)).fetchall()
            if row and row[0][0] is not None:
                out[key] = int(row[0][0])
    return out


def gpus(db: sqlite3.Connection, tables: dict[str, set[str]]) -> dict[int, dict[str, Any]]:
    """TARGET_INFO_GPU rows by id (the deviceId of the CUPTI tables)."""
    cols = tables.get("TARGET_INFO_GPU")
    if not cols or "id" not in cols:
        return {}
    present = [c for c in q.GPU_INFO_COLUMNS if c in cols]
    sql = "SELECT " + ", ".join(f'"{c}"' for c in present) + ' FROM "TARGET_INFO_GPU"'
    return {int(row[0]): dict(zip(present, row)) for row in db.execute(sql)}


def thread_names(db: sqlite3.Connection, tables: dict[str, set[str]]) -> dict[tuple[int, int], str]:
    if "ThreadNames" not in tables or "StringIds" not in tables:
        return {}
    return {((gtid >> 24) & q.PID_MASK, gtid & q.PID_MASK): str(name)
            for gtid, name in db.execute(q.THREAD_NAMES_SQL) if gtid is not None}


def unread_tables(db: sqlite3.Connection, tables: dict[str, set[str]]) -> dict[str, int]:
    """Activity tables the store has no place for, with their row counts (never lost unseen)."""
    read = {s.source for s in q.STAGING}
    out: dict[str, int] = {}
    for t in sorted(tables):
        if t in read or not t.startswith(("CUPTI_", "CUDA_", "NVTX_EVENTS", "OSRT_", "CUBLAS_", "CUDNN_",
                                          "MPI_", "NCCL_", "UCX_", "OPENMP_", "NVVIDEO_", "DIAGNOSTIC_")):
            continue
        n = int(db.execute(f'SELECT count(*) FROM "{t}"').fetchall()[0][0])
        if n:
            out[t] = n
    return out


@dataclass
class Lookups:
    """Everything besides activity rows that the run's metadata reports about one export."""

    export: dict[str, str]                    # META_DATA_EXPORT name -> value
    gpus: dict[int, dict[str, Any]]           # TARGET_INFO_GPU by id
    threads: dict[tuple[int, int], str]       # (pid, tid) -> thread name
    unread: dict[str, int]                    # activity tables not read -> rows
    event_classes: dict[int, str]             # runtime-table eventClass labels
    event_types: dict[int, str]               # NVTX eventType labels
    session_start: dict[str, int]             # session_start_utc_epoch_ns / _clock_ns


def lookups(db: sqlite3.Connection, tables: dict[str, set[str]]) -> Lookups:
    return Lookups(
        export=export_meta(db, tables), gpus=gpus(db, tables), threads=thread_names(db, tables),
        unread=unread_tables(db, tables),
        event_classes=enum(db, tables, "ENUM_NSYS_EVENT_CLASS", q.EVENT_CLASSES),
        event_types=enum(db, tables, "ENUM_NSYS_EVENT_TYPE", q.NVTX_EVENT_TYPES),
        session_start=session_start(db, tables))
