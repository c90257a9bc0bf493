"""Every public corpus trace ingests completely and exactly, checked against a plain-json reading.

The oracle (corpus_oracle.py) parses each file with json + Decimal and counts kernels, memops,
runtime/driver calls and host ranges per rank, and lists every kernel's, memop's and API call's
(rank, name, start, end) in exact ns. The store must hold the same multisets: nothing dropped,
nothing rounded.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.tracer.corpus_oracle import expected_for

FOLDERS = sorted(p.name for p in (Path(__file__).resolve().parents[2].parent / "shared" / "corpus" / "hta" / "kineto").iterdir())


def _per_rank(con, table: str, run_id: int) -> Counter:
    rows = con.execute(f"SELECT rank, count(*) FROM {table} WHERE run_id = ? GROUP BY rank", [run_id]).fetchall()
    return Counter({r: n for r, n in rows})


@pytest.mark.parametrize("folder", FOLDERS)
def test_counts_and_exact_kernel_times(corpus_store, corpus: Path, folder: str) -> None:
    con, ids = corpus_store
    run_id = ids[folder]
    exp = expected_for(corpus / "hta" / "kineto" / folder)
    assert _per_rank(con, "kernels", run_id) == +exp.kernels
    assert _per_rank(con, "memops", run_id) == +exp.memops
    assert _per_rank(con, "api_calls", run_id) == +exp.api_calls
    assert _per_rank(con, "ranges", run_id) == +exp.ranges
    for table, expected in (("kernels", exp.kernel_times), ("memops", exp.memop_times), ("api_calls", exp.api_times)):
        got = Counter(con.execute(f"SELECT rank, name, start_ns, end_ns FROM {table} WHERE run_id = ?", [run_id]).fetchall())
        assert got == expected, table
    n_ann, n_sync = con.execute(
        "SELECT (SELECT count(*) FROM gpu_annotations WHERE run_id = $1), "
        "(SELECT count(*) FROM gpu_syncs WHERE run_id = $1)", [run_id]).fetchall()[0]
    assert (n_ann, n_sync) == (exp.gpu_annotations, exp.gpu_syncs)
    meta = json.loads(con.execute("SELECT metadata FROM runs WHERE run_id = ?", [run_id]).fetchall()[0][0])
    # Nothing dropped unseen: handled + unhandled event counts cover every event of the files.
    assert sum(meta["events"].values()) + sum(meta["unhandled_events"].values()) == exp.events


def test_kernel_ids_follow_rank_then_start(corpus_store) -> None:
    con, ids = corpus_store
    run_id = ids["param_dlrm_8rank_v100"]
    rows = con.execute("SELECT kernel_id, rank, start_ns FROM kernels WHERE run_id = ? ORDER BY kernel_id", [run_id]).fetchall()
    assert [r[0] for r in rows] == list(range(len(rows)))
    assert [(r[1], r[2]) for r in rows] == sorted((r[1], r[2]) for r in rows)
    assert sorted({r[1] for r in rows}) == list(range(8))


def test_range_nesting_is_consistent(corpus_store) -> None:
    """A parent starts no later than its child and is one level shallower, on the same thread."""
    con, ids = corpus_store
    bad = con.execute("""
        SELECT count(*) FROM ranges c JOIN ranges p ON p.run_id = c.run_id AND p.range_id = c.parent_id
        WHERE c.run_id = ? AND (p.depth <> c.depth - 1 OR p.start_ns > c.start_ns OR p.end_ns <= c.start_ns
                                OR p.tid IS DISTINCT FROM c.tid OR p.rank <> c.rank)""",
                      [ids["hta_negative_queue_a100_rank0"]]).fetchall()[0][0]
    assert bad == 0
    roots = con.execute("SELECT count(*) FROM ranges WHERE run_id = ? AND (depth = 0) <> (parent_id IS NULL)",
                        [ids["hta_negative_queue_a100_rank0"]]).fetchall()[0][0]
    assert roots == 0


def test_nccl_kernels_are_communication(corpus_store) -> None:
    con, ids = corpus_store
    rows = con.execute("SELECT DISTINCT category FROM kernels WHERE run_id = ? AND name ILIKE '%nccl%'",
                       [ids["hta_nccl_data_a100_rank0"]]).fetchall()
    assert rows == [("communication",)]
    n = con.execute("SELECT count(*) FROM kernels WHERE run_id = ? AND category = 'communication'",
                    [ids["hta_nccl_data_a100_rank0"]]).fetchall()[0][0]
    assert n == 21  # corpus README: 15 AllReduce + 6 Broadcast NCCL kernels


def test_rocm_and_graph_traces_keep_every_kernel(corpus_store) -> None:
    con, ids = corpus_store
    for folder, kernels in (("tracelens_mi300x_vllm_decode_full_graph", 425),
                            ("tracelens_mi300x_sglang_qwen3_8b_decode_graph", 555)):
        n, launches = con.execute(
            "SELECT (SELECT count(*) FROM kernels WHERE run_id = $1), "
            "(SELECT count(*) FROM api_calls WHERE run_id = $1 AND name = 'hipGraphLaunch')",
            [ids[folder]]).fetchall()[0]
        assert (n, launches) == (kernels, 1)  # corpus README figures, independent of our reader
