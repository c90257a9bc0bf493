"""analyzers.summary on real multi-rank and multi-stream traces against a plain Python sweep
over the stored intervals (union per rank summed; span per rank, max; union per stream)."""
from __future__ import annotations

from collections import defaultdict

import pytest

from analyzers.summary import summarize
from tests.interval_oracle import union_ns


@pytest.mark.parametrize("folder", ["param_dlrm_8rank_v100", "hta_negative_queue_a100_rank0", "tracelens_mi300x_xdit_sd3.5"])
def test_summary_matches_python_sweep(corpus_store, folder: str) -> None:
    con, ids = corpus_store
    run_id = ids[folder]
    rows = con.execute("SELECT rank, stream, category, start_ns, end_ns FROM kernels WHERE run_id = $1 "
                       "UNION ALL SELECT rank, stream, category, start_ns, end_ns FROM memops WHERE run_id = $1",
                       [run_id]).fetchall()
    by_rank, by_stream, by_cat = defaultdict(list), defaultdict(list), defaultdict(list)
    for rank, stream, cat, s, e in rows:
        by_rank[rank].append((s, e))
        by_stream[(rank, stream)].append((s, e))
        by_cat[(rank, cat)].append((s, e))
    (run,) = summarize(con, [run_id])["runs"]
    assert run["busy_ns"] == sum(union_ns(v) for v in by_rank.values())
    assert run["span_ns"] == max(max(e for _, e in v) - min(s for s, _ in v) for v in by_rank.values())
    assert {(x["rank"], x["stream"]): x["busy_ns"] for x in run["streams"]} == {k: union_ns(v) for k, v in by_stream.items()}
    cats: dict[str, int] = defaultdict(int)
    for (_, cat), v in by_cat.items():
        cats[cat] += union_ns(v)
    assert run["categories"] == {c: n for c, n in cats.items() if n}
    assert run["ranks"] == len(by_rank)
