"""Compute/communication overlap on the two-GPU NCCL exports, against a brute-force oracle.

Oracle (plain sqlite3 and Python, no store): per device, comm = NCCL kernels (shortName or
demangledName contains "nccl", any case), compute = every other kernel; each side is merged
into disjoint intervals by a sort-and-sweep, and |comm ∩ compute| is the sum of pairwise
overlaps of the two disjoint lists (exact integer ns; with disjoint lists no time is counted
twice). The store side uses the shared interval macros (intervals_overlap_totals) on the
classifier's categories, the overlap_per_rank view and analyzers.overlap, so it checks
reader + classifier + SQL together.
"""
from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzers.overlap import overlap
from analyzers.views import load_views
from tests.interval_oracle import merge_intervals as merge
from tests.nsys_builder import NsysExportBuilder
from tracer.ingest import ingest_path
from tracer.store import open_store

PAIR = ("nsys-ai/mfu_2gpu_before.sqlite", "nsys-ai/mfu_2gpu_after.sqlite")


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
    # and the overlap analyzer, which also reports exposed communication
    ranks = overlap(con, info.run_id)["ranks"]
    assert {r["rank"]: (r["comm_ns"], r["overlap_ns"], r["exposed_comm_ns"]) for r in ranks} == {
        d: (c, o, c - o) for d, (c, o) in want.items()}


def store_overlap(path: Path) -> dict[int, tuple[int, int]]:
    """device -> (comm_ns, overlap_ns) from analyzers.overlap on the ingested export."""
    con = open_store(None)
    (info,) = ingest_path(con, path, progress=False)
    device = dict(con.execute("SELECT DISTINCT rank, device FROM kernels WHERE run_id = ?", [info.run_id]).fetchall())
    result = overlap(con, info.run_id)
    return {device[r["rank"]]: (r["comm_ns"], r["overlap_ns"]) for r in result["ranks"]}


def test_hand_made_two_gpu_overlap(tmp_path: Path) -> None:
    """The real pair runs NCCL on the compute stream, so its overlap is 0; here it is not.
    Device 0: compute [0,100) and [150,200) on stream 7, NCCL [50,170) on stream 9:
    comm 120, overlap [50,100) + [150,170) = 70. Device 1: NCCL [0,40) on 15, compute [30,35)
    and [38,60) on 16: comm 40, overlap 5 + 2 = 7."""
    b = NsysExportBuilder()
    for name, s, e, st_, pid, dev in (("gemm", 0, 100, 7, 20, 0), ("gemm", 150, 200, 7, 20, 0),
                                      ("ncclDevKernel_SendRecv", 50, 170, 9, 20, 0),
                                      ("ncclDevKernel_SendRecv", 0, 40, 15, 21, 1),
                                      ("add", 30, 35, 16, 21, 1), ("add", 38, 60, 16, 21, 1)):
        b.kernel(name, s, e, stream=st_, pid=pid, device=dev)
    path = b.write(tmp_path / "two_gpu.sqlite")
    assert oracle(path) == {0: (120, 70), 1: (40, 7)}
    assert store_overlap(path) == {0: (120, 70), 1: (40, 7)}


kernel = st.tuples(st.integers(0, 1), st.integers(0, 1), st.booleans(), st.integers(0, 200), st.integers(1, 60))


@settings(max_examples=12)  # each example is a whole ingest plus attribution (~1 s)
@given(st.lists(kernel, min_size=1, max_size=25))
def test_random_two_gpu_overlap_matches_oracle(kernels: list[tuple[int, int, bool, int, int]]) -> None:
    b = NsysExportBuilder()
    for dev, stream, nccl, s, n in kernels:
        b.kernel("ncclKernel" if nccl else "gemm", s, s + n, stream=7 + stream, pid=20 + dev, device=dev)
    with tempfile.TemporaryDirectory() as d:
        path = b.write(Path(d) / "r.sqlite")
        want = {dev: v for dev, v in oracle(path).items() if v[0] > 0}   # the view has rows only with comm
        assert store_overlap(path) == want
