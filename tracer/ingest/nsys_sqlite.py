"""Nsight Systems SQLite export reader (`nsys export --type sqlite`, `.sqlite`; one file = one run).

What is read (see docs/nsys.md): CUPTI_ACTIVITY_KIND_KERNEL, _MEMCPY, _MEMSET, _RUNTIME (and
_DRIVER when exported), _SYNCHRONIZATION and _CUDA_EVENT, NVTX_EVENTS (push/pop and start/end
ranges), StringIds, TARGET_INFO_GPU, ThreadNames and the export's own metadata table. Columns
are picked by name with fallbacks, so exports from nsys 2022.2 (schema 2.9) to 2026.2 (3.25)
and hand-made subsets read the same way.

Rank: one rank per (process, device) pair that has GPU activity, numbered by device id then
pid (two GPUs driven by two processes are ranks 0 and 1 in device order). Host rows follow
their process: an API call goes to the rank of the GPU work it launched (same pid and
correlation id), else to its process's first rank; NVTX ranges go to every rank of their
process. Host rows of processes with no GPU work are counted in metadata, not stored.

Windows cut from longer captures (nsys-ai's derived fixtures) lose launch calls made before
the window and ranges that cross its edges; the reader counts what it can see of that
(`kernels_without_launch`, `launches_without_kernel`, `ranges_cut`), stores it in
`runs.metadata`, and prints one warning line per issue on stderr.

`stage` reads and checks the export into TEMP tables outside the store transaction (Python
moves rows from SQLite to DuckDB as Arrow batches and nests NVTX ranges with
tracer.ingest.nesting); `write` inserts them as one run inside it; `discard` drops the TEMP
tables. Everything else is SQL in tracer.ingest.nsys_sql.
"""
from __future__ import annotations

import sqlite3
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from tracer.errors import BadInput
from tracer.ingest import nsys_sql as q
from tracer.ingest.nesting import nest
from tracer.ingest.progress import Progress
from tracer.ingest.runmeta import RunMeta

SUFFIXES = (".sqlite",)
SQLITE_MAGIC = b"SQLite format 3\x00"
BATCH_ROWS = 200_000
_ARROW = {"int": pa.int64(), "str": pa.string()}


def _connect(path: Path) -> sqlite3.Connection:
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


def _tables(db: sqlite3.Connection) -> dict[str, set[str]]:
    """Every table of the export with its column names."""
    names = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")]
    return {n: {r[1] for r in db.execute(f'PRAGMA table_info("{n}")')} for n in names}


def _check_export(path: Path, tables: dict[str, set[str]]) -> None:
    """BadInput unless the file has the tables that make it an nsys export."""
    if not any(t.startswith("CUPTI_ACTIVITY_KIND_") or t == "NVTX_EVENTS" for t in tables):
        raise BadInput(path, "SQLite file is not an Nsight Systems export (no CUPTI_ACTIVITY_KIND_* or NVTX_EVENTS table)")
    for stage in q.STAGING:
        cols = tables.get(stage.source)
        if cols is not None and not {"start", "end"} <= cols and stage.source != "CUPTI_ACTIVITY_KIND_CUDA_EVENT":
            raise BadInput(path, f"table {stage.source} has no start/end columns (not an nsys export?)")


def _stage(con: duckdb.DuckDBPyConnection, db: sqlite3.Connection, path: Path,
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


def _enum(db: sqlite3.Connection, tables: dict[str, set[str]], table: str, builtin: dict[int, str]) -> dict[int, str]:
    """An nsys enum: the file's own ENUM_* labels when exported, else the built-in ones."""
    if table in tables and {"id", "label"} <= tables[table]:
        found = {int(i): str(label) for i, label in db.execute(q.ENUM_SQL.format(table=table)) if label is not None}
        return {**builtin, **found}
    return builtin


def _load_enums(con: duckdb.DuckDBPyConnection, db: sqlite3.Connection, tables: dict[str, set[str]]) -> None:
    con.execute(q.ENUM_TABLE_SQL)
    rows = [("copy", k, v) for k, v in q.COPY_KINDS.items()]   # Kineto's short spellings
    rows += [("mem", k, v) for k, v in _enum(db, tables, "ENUM_CUDA_MEM_KIND", q.MEM_KINDS).items()]
    rows += [("sync", k, v) for k, v in q.SYNC_TYPES.items()]
    con.executemany(q.ENUM_INSERT_SQL, rows)


def _nest_ranges(con: duckdb.DuckDBPyConnection) -> None:
    cols = con.execute(q.NVTX_RANGES_FOR_NESTING_SQL).fetchnumpy()
    ids = cols["range_id"].tolist()
    depth, parent = nest(cols["thread"].tolist(), cols["start_ns"].tolist(), cols["end_ns"].tolist(), ids)
    nesting = pa.table({"range_id": pa.array(ids, pa.int64()), "depth": pa.array(depth, pa.int32()),
                        "parent_id": pa.array(parent, pa.int64())})
    con.register("_nsys_nesting_arrow", nesting)
    try:
        con.execute("CREATE OR REPLACE TEMP TABLE _nsys_nesting AS SELECT * FROM _nsys_nesting_arrow")
    finally:
        con.unregister("_nsys_nesting_arrow")


def _export_meta(db: sqlite3.Connection, tables: dict[str, set[str]]) -> dict[str, str]:
    for table in ("META_DATA_EXPORT", "EXPORT_META_DATA"):
        if table in tables:
            return {str(k): str(v) for k, v in db.execute(q.EXPORT_META_SQL.format(table=table))}
    return {}


def _session_start(db: sqlite3.Connection, tables: dict[str, set[str]]) -> dict[str, int]:
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


def _gpus(db: sqlite3.Connection, tables: dict[str, set[str]]) -> dict[int, dict[str, Any]]:
    """TARGET_INFO_GPU rows by id (the deviceId of the CUPTI tables)."""
    cols = tables.get("TARGET_INFO_GPU")
    if not cols or "id" not in cols:
        return {}
    present = [c for c in q.GPU_INFO_COLUMNS if c in cols]
    sql = "SELECT " + ", ".join(f'"{c}"' for c in present) + ' FROM "TARGET_INFO_GPU"'
    return {int(row[0]): dict(zip(present, row)) for row in db.execute(sql)}


def _thread_names(db: sqlite3.Connection, tables: dict[str, set[str]]) -> dict[tuple[int, int], str]:
    if "ThreadNames" not in tables or "StringIds" not in tables:
        return {}
    return {((gtid >> 24) & q.PID_MASK, gtid & q.PID_MASK): str(name)
            for gtid, name in db.execute(q.THREAD_NAMES_SQL) if gtid is not None}


def _labelled(rows: list[tuple[Any, int]], labels: dict[int, str]) -> dict[str, int]:
    return {f"{k} {labels.get(k, 'unknown')}" if k is not None else "none": int(n) for k, n in rows}


def _unread_tables(db: sqlite3.Connection, tables: dict[str, set[str]]) -> dict[str, int]:
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


def _window_facts(con: duckdb.DuckDBPyConnection, export: dict[str, str], ranges_cut: int,
                  n_kernels: int) -> tuple[dict[str, Any], list[str]]:
    """Counts of what a cut window lost, and the warning lines that say so."""
    without: dict[str, dict[str, int]] = {}
    for rank, src, n in con.execute(q.WITHOUT_LAUNCH_SQL).fetchall():
        without.setdefault(f"{src}s_without_launch", {})[str(rank)] = int(n)
    launches_without = int(con.execute(q.LAUNCH_WITHOUT_KERNEL_SQL).fetchall()[0][0])
    facts: dict[str, Any] = {
        "kernels_without_launch": sum(without.get("kernels_without_launch", {}).values()),
        "kernels_without_launch_by_rank": without.get("kernels_without_launch", {}),
        "memops_without_launch": sum(without.get("memcpys_without_launch", {}).values())
        + sum(without.get("memsets_without_launch", {}).values()),
        "launches_without_kernel": launches_without,
        "ranges_cut": ranges_cut,
    }
    window = export.get("DERIVED_WINDOW_NS")
    if window:
        facts["derived_window_ns"] = window
        facts["derived_from"] = export.get("DERIVED_FROM")
    warnings: list[str] = []
    where = f"window {window} ns cut from a longer capture" if window else "capture window edges"
    if facts["kernels_without_launch"]:
        warnings.append(f"{facts['kernels_without_launch']} of {n_kernels} kernels have no launch call in the "
                        f"export ({where}); they cannot be attributed to NVTX ranges through their launch")
    if launches_without:
        warnings.append(f"{launches_without} kernel launch calls have no kernel in the export ({where})")
    if ranges_cut:
        warnings.append(f"{ranges_cut} NVTX ranges were still open at the end of the capture; "
                        "they are cut at its last timestamp")
    if window:
        warnings.append("NVTX ranges that cross the window's edges are not in the export: outer ranges "
                        "(whole steps, forward passes) may be missing")
    return facts, warnings


@dataclass
class Staged:
    """What `stage` read from the export besides its TEMP tables: lookups and counts."""

    path: Path
    rows_read: dict[str, int]
    export: dict[str, str]
    gpus: dict[int, dict[str, Any]]
    threads: dict[tuple[int, int], str]
    unread: dict[str, int]
    event_classes: dict[int, str]
    event_types: dict[int, str]
    syncs_moved: int
    session_start: dict[str, int]


def stage(con: duckdb.DuckDBPyConnection, files: list[Path], prog: Progress) -> Staged:
    """Read and check one export into TEMP tables, outside the store transaction.

    Raises BadInput for a file that is not an nsys export or cannot be read. Ranks, host-row
    placement and NVTX nesting are worked out here too; `write` only inserts.
    """
    if len(files) != 1:
        raise BadInput(files[0].parent, f"{len(files)} nsys exports in one folder; ingest each export as its own run")
    path = files[0]
    prog.step(f"reading {path.name}")
    db = _connect(path)
    try:
        try:
            tables = _tables(db)
        except sqlite3.DatabaseError as exc:
            raise BadInput(path, f"corrupt SQLite file ({exc})") from None
        _check_export(path, tables)
        rows_read = _stage(con, db, path, tables)
        _load_enums(con, db, tables)
        staged = Staged(
            path=path, rows_read=rows_read, export=_export_meta(db, tables), gpus=_gpus(db, tables),
            threads=_thread_names(db, tables), unread=_unread_tables(db, tables),
            event_classes=_enum(db, tables, "ENUM_NSYS_EVENT_CLASS",
                                {0: "CUDA runtime", 1: "CUDA driver", 67: "CUDA backtrace"}),
            event_types=_enum(db, tables, "ENUM_NSYS_EVENT_TYPE", q.NVTX_EVENT_TYPES),
            syncs_moved=0, session_start=_session_start(db, tables))
    finally:
        db.close()
    prog.step("placing rows on ranks")
    staged.syncs_moved = int(con.execute(q.SYNC_DEVICE_FROM_CONTEXT_SQL).fetchall()[0][0])
    for sql in (q.DERIVE_IDS_SQL, q.RANKS_SQL, q.LAUNCHED_SQL, q.HOST_CALLS_SQL):
        con.execute(sql)
    if not con.execute("SELECT count(*) FROM _nsys_ranks").fetchall()[0][0]:
        raise BadInput(path, "no CUDA GPU activity in the export (no kernel, memcpy, memset or sync rows): "
                             "capture with nsys profile --trace=cuda")
    last_ns = con.execute(q.LAST_NS_SQL).fetchall()[0][0]
    con.execute(q.STAGE_RANGES_SQL, [last_ns if last_ns is not None else 0])
    prog.step("nesting ranges")
    _nest_ranges(con)
    return staged


def write(con: duckdb.DuckDBPyConnection, staged: Staged, run_id: int, prog: Progress) -> RunMeta:
    """Insert the staged export as run `run_id` (inside the caller's transaction); its runs-row facts."""
    prog.step("writing tables")
    for sql in (q.INSERT_KERNELS_SQL, q.INSERT_MEMOPS_SQL, q.INSERT_API_CALLS_SQL, q.INSERT_GPU_SYNCS_SQL,
                q.INSERT_RANGES_SQL):
        con.execute(sql, [run_id])
    ranks = con.execute("SELECT rank, pid, device FROM _nsys_ranks ORDER BY rank").fetchall()
    n_kernels = int(con.execute("SELECT count(*) FROM _nsys_kernel").fetchall()[0][0])
    ranges_cut = int(con.execute(q.RANGES_CUT_SQL).fetchall()[0][0])
    window, warnings = _window_facts(con, staged.export, ranges_cut, n_kernels)
    runtime_classes = con.execute(q.RUNTIME_CLASSES_SQL).fetchall()
    nvtx_types = con.execute(q.NVTX_TYPES_SQL).fetchall()
    domains = {str(d): n for d, n in con.execute(q.NVTX_DOMAINS_SQL).fetchall()}
    calls_dropped, ranges_dropped = con.execute(q.HOST_ROWS_DROPPED_SQL).fetchall()[0]
    graph_kernels, graph_launches = con.execute(q.GRAPH_EVIDENCE_SQL).fetchall()[0]
    host_threads = con.execute(q.HOST_THREADS_SQL, [run_id, run_id]).fetchall()

    skipped_classes = [(k, n) for k, n in runtime_classes if k not in q.EVENT_CLASS_KIND and k is not None]
    rank_info = []
    for rank, pid, device in ranks:
        gpu = staged.gpus.get(int(device)) if device is not None else None
        rank_info.append({"rank": rank, "pid": pid, "device": device, "gpu": gpu})
    names = sorted({str(r["gpu"]["name"]) for r in rank_info if r["gpu"] and r["gpu"].get("name")})
    if calls_dropped or ranges_dropped:
        warnings.append(f"{calls_dropped} API calls and {ranges_dropped} NVTX ranges belong to processes with no "
                        "GPU activity in the export; not stored")
    for w in warnings:
        print(f"warning: {staged.path}: {w}", file=sys.stderr)
    metadata: dict[str, Any] = {
        "nsys_version": staged.export.get("EXPORT_PRODUCT_VERSION"),
        "export_schema_version": staged.export.get("EXPORT_SCHEMA_VERSION"),
        **staged.session_start,
        "rank_source": "one rank per (process, device) with GPU activity, in device-id then pid order",
        "ranks": rank_info,
        "rows_read": staged.rows_read,
        "unread_tables": staged.unread,
        "runtime_rows_skipped": _labelled(skipped_classes, staged.event_classes),
        "nvtx_event_types": _labelled(nvtx_types, staged.event_types),
        "nvtx_domains": domains,
        "host_rows_without_gpu_process": {"api_calls": int(calls_dropped), "nvtx_ranges": int(ranges_dropped)},
        "threads": {f"{pid}/{tid}": staged.threads[(pid, tid)] for pid, tid in sorted(host_threads)
                    if (pid, tid) in staged.threads},
        "graph_launches": int(graph_launches),
        "syncs_device_from_context": staged.syncs_moved,
        **window,
        "warnings": warnings,
    }
    if not names:
        metadata["gpu_note"] = "the export has no TARGET_INFO_GPU row for the devices used: GPU model unknown"
    return RunMeta(
        world_size=max(len(ranks), 1),
        metadata=metadata,
        gpu=" / ".join(names) if names else None,
        graph_mode=bool(graph_kernels or graph_launches) if n_kernels else None,
    )


def discard(con: duckdb.DuckDBPyConnection) -> None:
    """Drop every TEMP table `stage` may have left."""
    con.execute(q.DROP_STAGING_SQL)


def read_run(con: duckdb.DuckDBPyConnection, files: list[Path], run_id: int, prog: Progress) -> RunMeta:
    """stage + write + discard in one call (the single-function reader form)."""
    try:
        return write(con, stage(con, files, prog), run_id, prog)
    finally:
        discard(con)
