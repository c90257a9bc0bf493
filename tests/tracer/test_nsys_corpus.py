"""The nsys reader on every real export in the corpus, against plain sqlite3 on the same file.

The oracle shares no code with tracer.ingest: it reads the CUPTI and NVTX tables with its own
SQL and applies the reader's documented rules by hand (runtime rows of event class 0/1 only,
a `_vNNNN` suffix dropped from API names, one rank per (process, device) so an NVTX range is
stored once per device its process drives, kernels without a launch row = no runtime row with
the same pid and correlation id).
"""
from __future__ import annotations

import re
import sqlite3
from collections import Counter
from pathlib import Path

import duckdb
import pytest

from tracer.ingest import ingest_path
from tracer.store import open_store

EXPORTS = ("hta/nsys/pipit_cloverleaf-cuda_4xa100.sqlite", "hta/nsys/pipit_saxpy-mpi-cuda_a100.sqlite",
           "nsys-ai/h100_2gpu_1s.sqlite", "nsys-ai/mfu_2gpu_before.sqlite", "nsys-ai/mfu_2gpu_after.sqlite",
           "nsys-ai/healthy_1pct.sqlite")
PID = "((globalPid >> 24) & 16777215)"
TPID = "((globalTid >> 24) & 16777215)"


def sqlite_ro(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"{path.as_uri()}?mode=ro&immutable=1", uri=True)


def columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in db.execute(f'PRAGMA table_info("{table}")')}


@pytest.fixture(scope="module")
def store(corpus: Path) -> tuple[duckdb.DuckDBPyConnection, dict[str, int]]:
    con = open_store(None)
    ids = {}
    for rel in EXPORTS:
        (info,) = ingest_path(con, corpus / rel, progress=False)
        ids[rel] = info.run_id
    return con, ids


def gpu_devices_by_pid(db: sqlite3.Connection) -> dict[int | None, set[int]]:
    """Devices each process runs kernels, copies or memsets on (None: no globalPid column)."""
    out: dict[int | None, set[int]] = {}
    for table in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET"):
        cols = columns(db, table)
        if not cols:
            continue
        pid = PID if "globalPid" in cols else "NULL"
        for p, d in db.execute(f'SELECT DISTINCT {pid}, deviceId FROM "{table}"'):
            out.setdefault(p, set()).add(d)
    return out


@pytest.mark.parametrize("rel", EXPORTS)
def test_kernels_match_sqlite(store, corpus: Path, rel: str) -> None:
    con, ids = store
    db = sqlite_ro(corpus / rel)
    want = Counter(db.execute(
        "SELECT k.deviceId, d.value, k.start, k.end FROM CUPTI_ACTIVITY_KIND_KERNEL AS k "
        "JOIN StringIds AS d ON d.id = k.demangledName").fetchall())
    got = Counter(con.execute("SELECT device, name, start_ns, end_ns FROM kernels WHERE run_id = ?",
                              [ids[rel]]).fetchall())
    assert sum(got.values()) == db.execute("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchone()[0]
    assert got == want
    # kernel ids are 0..n-1 in (rank, start) order, and each rank holds one device
    rows = con.execute("SELECT kernel_id, rank, start_ns FROM kernels WHERE run_id = ? ORDER BY kernel_id",
                       [ids[rel]]).fetchall()
    assert [r[0] for r in rows] == list(range(len(rows)))
    assert [(r[1], r[2]) for r in rows] == sorted((r[1], r[2]) for r in rows)
    per_rank = con.execute("SELECT rank, count(DISTINCT device) FROM kernels WHERE run_id = ? GROUP BY rank",
                           [ids[rel]]).fetchall()
    assert all(n == 1 for _, n in per_rank)


@pytest.mark.parametrize("rel", EXPORTS)
def test_memops_and_syncs_match_sqlite(store, corpus: Path, rel: str) -> None:
    con, ids = store
    db = sqlite_ro(corpus / rel)
    want = Counter()
    for table, kind in (("CUPTI_ACTIVITY_KIND_MEMCPY", "memcpy"), ("CUPTI_ACTIVITY_KIND_MEMSET", "memset")):
        if columns(db, table):
            want.update({(kind, s, e, b): n for s, e, b, n in db.execute(
                f'SELECT start, "end", bytes, count(*) FROM "{table}" GROUP BY 1, 2, 3')})
    got = Counter(con.execute("SELECT kind, start_ns, end_ns, bytes FROM memops WHERE run_id = ?",
                              [ids[rel]]).fetchall())
    assert got == want
    n_sync = db.execute("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_SYNCHRONIZATION").fetchone()[0] \
        if columns(db, "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION") else 0
    assert con.execute("SELECT count(*) FROM gpu_syncs WHERE run_id = ?", [ids[rel]]).fetchone()[0] == n_sync
    # every sync sits on the device its rank's kernels run on (nsys 2026.2 writes deviceId 0 for
    # all syncs; the reader takes the device of the sync's context)
    off = con.execute("""SELECT count(*) FROM gpu_syncs AS s
                         WHERE s.run_id = ? AND s.device NOT IN (SELECT k.device FROM kernels AS k
                                                                 WHERE k.run_id = s.run_id AND k.rank = s.rank)""",
                      [ids[rel]]).fetchone()[0]
    assert off == 0


@pytest.mark.parametrize("rel", EXPORTS)
def test_api_calls_match_sqlite(store, corpus: Path, rel: str) -> None:
    con, ids = store
    db = sqlite_ro(corpus / rel)
    gpu_pids = set(gpu_devices_by_pid(db))
    cols = columns(db, "CUPTI_ACTIVITY_KIND_RUNTIME")
    where = "WHERE r.eventClass IN (0, 1)" if "eventClass" in cols else ""
    want = Counter()
    for pid, name, start, end in db.execute(
            f"SELECT {TPID}, s.value, r.start, r.end FROM CUPTI_ACTIVITY_KIND_RUNTIME AS r "
            f"JOIN StringIds AS s ON s.id = r.nameId {where}"):
        if pid in gpu_pids or None in gpu_pids:
            want[(re.sub(r"_v\d+$", "", name), start, end)] += 1
    got = Counter(con.execute("SELECT name, start_ns, end_ns FROM api_calls WHERE run_id = ?",
                              [ids[rel]]).fetchall())
    assert got == want
    assert sum(got.values()) > 0


@pytest.mark.parametrize("rel", EXPORTS)
def test_nvtx_ranges_match_sqlite(store, corpus: Path, rel: str) -> None:
    """Each push/pop or start/end range once per device its process drives, names resolved."""
    con, ids = store
    db = sqlite_ro(corpus / rel)
    want = Counter()
    if columns(db, "NVTX_EVENTS"):
        devices = gpu_devices_by_pid(db)
        for pid, tid, name, start, end in db.execute(
                f"SELECT {TPID}, globalTid & 16777215, coalesce(n.text, s.value), n.start, n.end "
                "FROM NVTX_EVENTS AS n LEFT JOIN StringIds AS s ON s.id = n.textId WHERE n.eventType IN (59, 60)"):
            want[(pid, tid, name, start, end)] += len(devices.get(pid, ()))
    got = Counter(con.execute("SELECT pid, tid, name, start_ns, end_ns FROM ranges WHERE run_id = ?",
                              [ids[rel]]).fetchall())
    assert got == want
    # nesting is consistent: a parent encloses its child on the same rank and thread, one level up
    bad = con.execute("""
        SELECT count(*) FROM ranges AS c LEFT JOIN ranges AS p
          ON p.run_id = c.run_id AND p.range_id = c.parent_id
        WHERE c.run_id = ? AND (
          (c.parent_id IS NULL) <> (c.depth = 0)
          OR (c.parent_id IS NOT NULL AND (p.rank <> c.rank OR p.tid <> c.tid OR p.depth <> c.depth - 1
                                           OR p.start_ns > c.start_ns)))""", [ids[rel]]).fetchone()[0]
    assert bad == 0


@pytest.mark.parametrize("rel", EXPORTS)
def test_window_cut_counts(store, corpus: Path, rel: str) -> None:
    """kernels_without_launch in runs.metadata = kernels with no runtime row of the same pid and correlation."""
    con, ids = store
    db = sqlite_ro(corpus / rel)
    same_pid = f"AND {TPID.replace('globalTid', 'r.globalTid')} = {PID.replace('globalPid', 'k.globalPid')}" \
        if "globalPid" in columns(db, "CUPTI_ACTIVITY_KIND_KERNEL") else ""
    want = db.execute(f"""
        SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL AS k WHERE NOT EXISTS (
          SELECT 1 FROM CUPTI_ACTIVITY_KIND_RUNTIME AS r WHERE r.correlationId = k.correlationId {same_pid})
    """).fetchone()[0]
    meta = con.execute("SELECT metadata->>'$.kernels_without_launch', metadata->>'$.derived_window_ns', "
                       "world_size, source FROM runs WHERE run_id = ?", [ids[rel]]).fetchone()
    assert int(meta[0]) == want
    assert meta[3] == "nsys"
    window = dict(db.execute("SELECT name, value FROM META_DATA_EXPORT").fetchall()).get("DERIVED_WINDOW_NS") \
        if columns(db, "META_DATA_EXPORT") else None
    assert meta[1] == window
    assert meta[2] == sum(len(d) for d in gpu_devices_by_pid(db).values())
    start_cols = columns(db, "TARGET_INFO_SESSION_START_TIME")
    for col, key in (("utcEpochNs", "session_start_utc_epoch_ns"), ("systemClockNs", "session_start_clock_ns")):
        want_ns = db.execute(f"SELECT {col} FROM TARGET_INFO_SESSION_START_TIME").fetchone()[0] \
            if col in start_cols else None
        got = con.execute(f"SELECT metadata->>'$.{key}' FROM runs WHERE run_id = ?", [ids[rel]]).fetchone()[0]
        assert (int(got) if got is not None else None) == want_ns


def test_readme_figures_of_the_cut_windows(store) -> None:
    """The corpus README's own counts: launch rows missing for 1810, 24 and 10 kernels."""
    con, ids = store
    got = {rel.split("/")[1]: int(con.execute("SELECT metadata->>'$.kernels_without_launch' FROM runs "
                                              "WHERE run_id = ?", [rid]).fetchone()[0])
           for rel, rid in ids.items() if rel.startswith("nsys-ai/")}
    assert got == {"h100_2gpu_1s.sqlite": 3442 - 1632, "mfu_2gpu_before.sqlite": 24,
                   "mfu_2gpu_after.sqlite": 10, "healthy_1pct.sqlite": 0}


def test_cut_window_warning_printed(corpus: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """10 kernels without a launch call (the corpus README) out of all kernels, counted by sqlite3."""
    path = corpus / "nsys-ai/mfu_2gpu_after.sqlite"
    total = sqlite_ro(path).execute("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchone()[0]
    con = open_store(None)
    ingest_path(con, path, progress=False)
    err = capfd.readouterr().err
    assert "warning:" in err and f"10 of {total} kernels have no launch call" in err


def test_backtrace_rows_of_old_schema_are_skipped(store, corpus: Path) -> None:
    """nsys 2022.2 duplicates each runtime call as an eventClass 67 'CUDA backtrace' row."""
    con, ids = store
    rel = "hta/nsys/pipit_saxpy-mpi-cuda_a100.sqlite"
    skipped = con.execute("SELECT metadata->'$.runtime_rows_skipped' FROM runs WHERE run_id = ?",
                          [ids[rel]]).fetchone()[0]
    [(backtraces,)] = sqlite_ro(corpus / rel).execute(
        "SELECT count(*) FROM CUPTI_ACTIVITY_KIND_RUNTIME WHERE eventClass = 67").fetchall()
    assert backtraces > 0 and skipped == f'{{"67 CUDA backtrace":{backtraces}}}'


def test_gpu_names_and_ranks(store) -> None:
    con, ids = store
    rows = {rel: con.execute("SELECT gpu, world_size FROM runs WHERE run_id = ?", [rid]).fetchone()
            for rel, rid in ids.items()}
    assert rows["hta/nsys/pipit_cloverleaf-cuda_4xa100.sqlite"] == ("NVIDIA A100-SXM4-80GB", 1)
    assert rows["nsys-ai/healthy_1pct.sqlite"] == ("NVIDIA H100 80GB HBM3", 1)
    assert rows["nsys-ai/mfu_2gpu_before.sqlite"] == (None, 2)   # no TARGET_INFO_GPU in the export
    # two processes, one GPU each: rank = device order
    ranks = con.execute("SELECT DISTINCT rank, device FROM kernels WHERE run_id = ? ORDER BY rank",
                        [ids["nsys-ai/mfu_2gpu_before.sqlite"]]).fetchall()
    assert ranks == [(0, 0), (1, 1)]
