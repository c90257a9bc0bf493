"""Compute/communication overlap on the two-GPU NCCL exports, against a brute-force oracle.

Oracle (plain sqlite3 and Python, no store): per device, comm = NCCL kernels (shortName or
demangledName contains "nccl", any case), compute = every other kernel; each side is merged
into disjoint intervals by a sort-and-sweep, and |comm ∩ compute| is the sum of pairwise
overlaps of the two disjoint lists (exact integer ns; with disjoint lists no time is counted
twice). The store side uses the shared interval macros (intervals_overlap_totals) on the
classifier's categories and the overlap_per_rank view, so it checks reader + classifier +
SQL together.
"""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from analyzers.views import load_views
from tracer.ingest import ingest_path
from tracer.store import open_store

PAIR = ("nsys-ai/mfu_2gpu_before.sqlite", "nsys-ai/mfu_2gpu_after.sqlite")


def merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def overlap_ns(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    return sum(max(0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def oracle(path: Path) -> dict[int, tuple[int, int]]:
    """device -> (|comm|, |comm ∩ compute|) in ns."""
    db = sqlite3.connect(f"{path.as_uri()}?mode=ro&immutable=1", uri=True)
    rows = db.execute("""
        SELECT k.deviceId, k.start, k.end,
               lower(coalesce(s.value, '') || ' ' || coalesce(d.value, '')) LIKE '%nccl%'
        FROM CUPTI_ACTIVITY_KIND_KERNEL AS k
        LEFT JOIN StringIds AS s ON s.id = k.shortName LEFT JOIN StringIds AS d ON d.id = k.demangledName
    """).fetchall()
    out = {}
    for dev in sorted({r[0] for r in rows}):
        comm = merge([(s, e) for d, s, e, nccl in rows if d == dev and nccl])
        comp = merge([(s, e) for d, s, e, nccl in rows if d == dev and not nccl])
        out[dev] = (sum(e - s for s, e in comm), overlap_ns(comm, comp))
    return out


@pytest.mark.parametrize("rel", PAIR)
def test_comm_compute_overlap_per_device(corpus: Path, rel: str) -> None:
    want = oracle(corpus / rel)
    assert all(comm > 0 for comm, _ in want.values())          # both devices do NCCL work
    con = open_store(None)
    (info,) = ingest_path(con, corpus / rel, progress=False)
    load_views(con)
    con.execute("CREATE TEMP TABLE comm AS SELECT device AS key, start_ns, end_ns FROM kernels "
                "WHERE run_id = ? AND category = 'communication'", [info.run_id])
    con.execute("CREATE TEMP TABLE other AS SELECT device AS key, start_ns, end_ns FROM kernels "
                "WHERE run_id = ? AND category <> 'communication'", [info.run_id])
    got = {k: (a, both) for k, a, both, _ in
           con.execute("SELECT key, a_ns, both_ns, a_only_ns FROM intervals_overlap_totals('comm', 'other')").fetchall()}
    assert got == want
    # the overlap view, per rank (rank r runs on device r in these exports)
    view = {r: (c, o) for r, c, o in con.execute(
        "SELECT rank, comm_ns, overlap_ns FROM overlap_per_rank WHERE run_id = ?", [info.run_id]).fetchall()}
    assert view == want
