"""The committed traces against the committed CUDA-event benchmark (issue: `compare` on the stock
and fused traces must report the same kernel counts and per-layer times within 5 % of the
CUDA-event figures in bench/decode.md).

Oracle: bench/decode.md's per-layer medians, measured with CUDA events around graph replays of
one layer in a separate process on the GPU, and its kernel counts from a profiled eager step;
the tool's figures come from the trace files alone. Two independent measurements of the same
configuration: a tool that mis-attributes kernels to layers, drops replays or mis-scales time
fails here. The CUDA-event figure of a one-layer graph also holds one graph launch (~4 µs,
bench/decode.md), so "within 5 %" is checked on the ratio, not exactness.
"""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import main

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "traces"
TOL = 0.05


def bench_rows() -> dict[tuple[str, int, int, str], dict[str, float]]:
    """(variant, B, k, kind) -> median over that kind's layers of µs and kernels."""
    text = (ROOT / "bench" / "decode.md").read_text()
    data = json.loads(re.search(r"<!-- decode-bench-data\n(.*?)\n-->", text, re.S).group(1))
    out = {}
    for r in data["results"]:
        kinds = sorted({x["kind"] for x in r["layers"]})
        for kind in kinds:
            rows = [x for x in r["layers"] if x["kind"] == kind]
            out[(r["variant"], r["batch"], r["spec_tokens"], kind)] = {
                "us": statistics.mean(x["median_us"] for x in rows),
                "kernels": statistics.median(x["kernels"] for x in rows)}
    return out


def pairs() -> list[tuple[int, int]]:
    found = []
    for f in sorted(TRACES.glob("k3_fused_b*_k*_graph.json.gz")):
        b, k = map(int, re.match(r"k3_fused_b(\d+)_k(\d+)_graph", f.name).groups())
        if (TRACES / f"k3_stock_b{b}_k{k}_graph.json.gz").exists():
            found.append((b, k))
    return found


@pytest.mark.parametrize("b,k", pairs() or [pytest.param(0, 0, marks=pytest.mark.skip("no fused traces"))])
def test_compare_on_traces_matches_cuda_events(b: int, k: int) -> None:
    bench = bench_rows()
    res = CliRunner().invoke(main, ["compare", str(TRACES / f"k3_stock_b{b}_k{k}_graph.json.gz"),
                                    str(TRACES / f"k3_fused_b{b}_k{k}_graph.json.gz"), "--format", "json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    for row in got["kinds"]:
        for side, variant in (("base", "stock"), ("cand", "fused")):
            ref = bench.get((variant, b, k, row["kind"]))
            # a bundled trace pair without its CUDA-event row is a stale bench, not a skip
            assert ref is not None, f"bench/decode.md has no {variant} B={b} k={k} {row['kind']} row"
            assert row[side]["kernels"] == ref["kernels"], (variant, row["kind"])
            assert abs(row[side]["span_ns"] / 1000 / ref["us"] - 1) <= TOL, (variant, row["kind"], row[side], ref)
