"""`decodescope summary`: counts, busy (union per rank, summed), span (max over ranks), streams,
categories and top kernels, against answers derived by hand and a brute-force point count."""
from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from cli.exit_codes import BAD_INPUT, OK
from cli.main import main
from tests.kineto_builder import KinetoTraceBuilder


def _two_rank_run(folder: Path) -> Path:
    """Rank 0: stream 7 gemm [100,400) + softmax [300,600) + memcpy [700,750);
    stream 9 ncclKernel [1000,1200). Rank 1: stream 7 gemm [50,150) and [5000,5100)."""
    r0 = KinetoTraceBuilder(rank=0, world_size=2)
    r0.launch("gemm", 0, 10, 100, 300, stream=7)
    r0.launch("softmax", 20, 10, 300, 300, stream=7)
    r0.memcpy(700, 50, stream=7)
    r0.launch("ncclKernel_AllReduce", 40, 10, 1_000, 200, stream=9)
    r0.write(folder / "rank0.json")
    r1 = KinetoTraceBuilder(rank=1, world_size=2)
    r1.launch("gemm", 0, 10, 50, 100, stream=7)
    r1.launch("gemm", 20, 10, 5_000, 100, stream=7)
    r1.write(folder / "rank1.json")
    return folder


def test_summary_json_hand_made(tmp_path: Path) -> None:
    folder = _two_rank_run(tmp_path / "run")
    res = CliRunner().invoke(main, ["summary", str(folder), "--format", "json"])
    assert res.exit_code == OK, res.output
    (run,) = json.loads(res.stdout)["runs"]
    assert (run["ranks"], run["kernels"], run["memops"], run["api_calls"]) == (2, 5, 1, 5)  # 3 + 2 kernels, one launch call each
    # busy: rank 0 = |[100,600) ∪ [700,750) ∪ [1000,1200)| = 500 + 50 + 200 = 750; rank 1 = 100 + 100.
    assert run["busy_ns"] == 750 + 200
    # span: rank 0 = 1200 - 100 = 1100, rank 1 = 5100 - 50 = 5050; the largest.
    assert run["span_ns"] == 5050
    assert run["streams"] == [{"rank": 0, "stream": 7, "kernels": 2, "busy_ns": 550},
                              {"rank": 0, "stream": 9, "kernels": 1, "busy_ns": 200},
                              {"rank": 1, "stream": 7, "kernels": 2, "busy_ns": 200}]
    assert run["categories"] == {"communication": 200, "compute": 500 + 200, "memory": 50}
    assert run["top_kernels"][:2] == [{"name": "gemm", "count": 3, "total_ns": 500},
                                      {"name": "softmax", "count": 1, "total_ns": 300}]


def test_summary_text_and_store_input(tmp_path: Path) -> None:
    folder = _two_rank_run(tmp_path / "run")
    db = tmp_path / "s.duckdb"
    assert CliRunner().invoke(main, ["ingest", str(folder), "--db", str(db)]).exit_code == OK
    res = CliRunner().invoke(main, ["summary", f"{db}:1"])
    assert res.exit_code == OK, res.output
    assert "GPU busy 950 ns" in res.stdout and "span 5050 ns" in res.stdout
    res = CliRunner().invoke(main, ["summary", str(db), "--run", "7"])
    assert res.exit_code == BAD_INPUT and len(res.stderr.splitlines()) == 1


intervals = st.lists(st.tuples(st.integers(0, 1), st.integers(0, 2), st.integers(0, 60), st.integers(0, 15)),
                     min_size=1, max_size=12)


@settings(max_examples=20, deadline=None)
@given(intervals)
def test_busy_matches_point_count(tmp_path_factory, kernels: list[tuple[int, int, int, int]]) -> None:
    """Brute force: busy = number of integer ns points covered on each rank, summed."""
    folder = tmp_path_factory.mktemp("rand")
    for rank in (0, 1):
        b = KinetoTraceBuilder(rank=rank, world_size=2)
        for r, stream, start, dur in kernels:
            if r == rank:
                b.kernel("k", start, dur, stream=stream)
        b.write(folder / f"r{rank}.json")
    res = CliRunner().invoke(main, ["summary", str(folder), "--format", "json"])
    assert res.exit_code == OK, res.output
    (run,) = json.loads(res.stdout)["runs"]
    points = {(r, t) for r, _s, start, dur in kernels for t in range(start, start + dur)}
    assert run["busy_ns"] == len(points)
    per_stream = {}
    for r, s, start, dur in kernels:
        per_stream.setdefault((r, s), set()).update(range(start, start + dur))
    assert {(x["rank"], x["stream"]): x["busy_ns"] for x in run["streams"]} == {k: len(v) for k, v in per_stream.items()}
    spans = [max(st + d for r, _s, st, d in kernels if r == rank) - min(st for r, _s, st, _d in kernels if r == rank)
             for rank in {k[0] for k in kernels}]
    assert run["span_ns"] == max(spans)
