"""Nsight Systems SQLite export reader (`nsys export --type sqlite`, `.sqlite`).

One export is one run; a folder of exports (one per node or per MPI rank) is one run whose
ranks are numbered across the exports in file-name order. What is read (see docs/nsys.md):
CUPTI_ACTIVITY_KIND_KERNEL, _MEMCPY, _MEMSET, _RUNTIME (and _DRIVER when exported),
_SYNCHRONIZATION and _CUDA_EVENT, NVTX_EVENTS (push/pop and start/end ranges), StringIds,
TARGET_INFO_GPU, ThreadNames and the export's own metadata table. Columns are picked by name
with fallbacks, so exports from nsys 2022.2 (schema 2.9) to 2026.2 (3.25) and hand-made
subsets read the same way.

Rank: one rank per (process, device) pair that has GPU activity, numbered by device id then
pid (two GPUs driven by two processes are ranks 0 and 1 in device order). Host rows follow
their process: an API call goes to the rank of the GPU work it launched (same pid and
correlation id), else to its process's first rank; NVTX ranges go to every rank of their
process. Host rows of processes with no GPU work are counted in metadata, not stored.

Windows cut from longer captures (nsys-ai's derived fixtures) lose launch calls made before
the window and ranges that cross its edges; the reader counts what it can see of that
(`kernels_without_launch`, `launches_without_kernel`, `ranges_cut`), stores it in
`runs.metadata`, and prints one warning line per issue on stderr.

`stage` reads and checks every export outside the store transaction: rows move from SQLite to
DuckDB TEMP tables (tracer.ingest.nsys_export), SQL places them on ranks (tracer.ingest.nsys_sql),
NVTX ranges are nested (tracer.ingest.nesting), and the finished rows wait in _nsys_out_*
tables. `write` inserts them as one run inside the transaction; `discard` drops the TEMP tables.
"""
from __future__ import annotations

import sqlite3
import sys
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa

from tracer.errors import BadInput
from tracer.ingest import nsys_export as ex
from tracer.ingest import nsys_sql as q
from tracer.ingest.nesting import nest
from tracer.ingest.nsys_meta import FileFacts, file_facts, run_meta
from tracer.ingest.progress import Progress
from tracer.ingest.runmeta import RunMeta

SUFFIXES = (".sqlite",)


@dataclass
class Staged:
    """The staged exports of one run, in rank order; their rows wait in _nsys_out_*."""

    files: list[FileFacts]


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


def _stage_file(con: duckdb.DuckDBPyConnection, idx: int, path: Path, prog: Progress) -> FileFacts:
    """One export into _nsys_out_* (run_id = idx, ranks and ids local to the export)."""
    prog.step(f"reading {path.name}")
    db = ex.connect(path)
    try:
        try:
            tables = ex.tables_of(db)
        except sqlite3.DatabaseError as exc:
            raise BadInput(path, f"corrupt SQLite file ({exc})") from None
        ex.check_export(path, tables)
        rows_read = ex.copy_tables(con, db, path, tables)
        ex.load_enums(con, db, tables)
        lookups = ex.lookups(db, tables)
    finally:
        db.close()
    prog.step(f"placing rows of {path.name} on ranks")
    syncs_moved = int(con.execute(q.SYNC_DEVICE_FROM_CONTEXT_SQL).fetchall()[0][0])
    for sql in (q.DERIVE_IDS_SQL, q.RANKS_SQL, q.LAUNCHED_SQL, q.HOST_CALLS_SQL):
        con.execute(sql)
    bad = con.execute(q.BAD_ROWS_SQL).fetchall()
    if bad:
        what = ", ".join(f"{n} {src}" for src, n in bad)
        raise BadInput(path, f"activity rows with no start/end or ending before they start ({what}): corrupt export?")
    if not con.execute("SELECT count(*) FROM _nsys_ranks").fetchall()[0][0]:
        raise BadInput(path, "no CUDA GPU activity in the export (no kernel, memcpy, memset or sync rows): "
                             "capture with nsys profile --trace=cuda")
    last_ns = con.execute(q.LAST_NS_SQL).fetchall()[0][0]
    con.execute(q.STAGE_RANGES_SQL, [last_ns if last_ns is not None else 0])
    prog.step(f"nesting ranges of {path.name}")
    _nest_ranges(con)
    for sql in (q.INSERT_KERNELS_SQL, q.INSERT_MEMOPS_SQL, q.INSERT_API_CALLS_SQL, q.INSERT_GPU_SYNCS_SQL,
                q.INSERT_RANGES_SQL):
        con.execute(sql, [idx])
    facts = file_facts(con, idx, path, lookups, rows_read, syncs_moved)
    con.execute(q.DROP_FILE_STAGING_SQL)
    return facts


def stage(con: duckdb.DuckDBPyConnection, files: list[Path], prog: Progress) -> Staged:
    """Read, check and place every export of the run, outside the store transaction.

    Raises BadInput for a file that is not an nsys export, cannot be read, or has no GPU work.
    """
    con.execute(q.CREATE_OUT_SQL)
    return Staged([_stage_file(con, idx, path, prog) for idx, path in enumerate(files)])


def write(con: duckdb.DuckDBPyConnection, staged: Staged, run_id: int, prog: Progress) -> RunMeta:
    """Insert the staged exports as run `run_id` (inside the caller's transaction); its runs-row facts."""
    prog.step("writing tables")
    con.execute(q.BASES_TABLE_SQL)
    bases = [0, 0, 0, 0, 0]                 # rank, kernel, memop, call, range
    rank_bases = []
    for idx, f in enumerate(staged.files):
        con.execute(q.BASES_INSERT_SQL, [idx, *bases])
        rank_bases.append(bases[0])
        bases = [bases[0] + len(f.ranks), *(b + n for b, n in zip(bases[1:], f.counts))]
    for table in q.OUT_TABLES:
        con.execute(q.WRITE_SQL[table], [run_id])
    meta = run_meta(staged.files, rank_bases)
    for f in staged.files:
        for w in f.warnings:
            print(f"warning: {f.path}: {w}", file=sys.stderr)
    return meta


def discard(con: duckdb.DuckDBPyConnection) -> None:
    """Drop every TEMP table `stage` may have left."""
    con.execute(q.DROP_STAGING_SQL)


def read_run(con: duckdb.DuckDBPyConnection, files: list[Path], run_id: int, prog: Progress) -> RunMeta:
    """stage + write + discard in one call (the single-function reader form)."""
    try:
        return write(con, stage(con, files, prog), run_id, prog)
    finally:
        discard(con)
