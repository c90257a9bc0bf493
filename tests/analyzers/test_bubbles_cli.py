"""The five commands (bubbles, overlap, prefetch, launch, temporal) in-process on one hand-made
Kineto trace, with every expected number derived here, plus their exit code on bad input.

Host (tid 1): step [0,9000) > L0.mla [10,1000) > attn [20,100) launches k1 at [30,40);
o_proj+ar [100,200) launches an NCCL all-reduce at [110,120); L1.kda [1000,8000) > in_proj
[1010,1100) launches k2 at [1020,1030); out [7550,7800) launches k3 at [7600,7700).
Device: k1 [5000,6000) s7, nccl [6000,7000) s8, k2 [6500,7500) s7, k3 [7800,8000) s7.

- temporal: span 3000; busy |[5000,7500) ∪ [7800,8000)| = 2700; idle 300 (10 %); compute
  k1 ∪ k2 ∪ k3 = 1000 + 1000 + 200 = 2200; non-compute 500 (the all-reduce outside k1, k2).
- bubbles: one, [7500,7800) = 300 ns, prev k2, next k3 (L1.kda, out); k3's launch ended at
  7700 > 7500: launch_bound. Step span 3000, busy 2700.
- overlap: comm [6000,7000), compute covers [6500,7000): overlap 500 (50 %), exposed 500.
- launch: delays 4970, 5890, 5480, 200 -> nearest-rank p50 = 4970, p90 = p99 = max = 5890;
  no kernel is shorter than its launch call (10, 10, 10, 100 ns).
- prefetch: not applicable.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.exit_codes import BAD_INPUT, OK
from cli.main import main
from tests.kineto_builder import KinetoTraceBuilder


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    b = KinetoTraceBuilder()
    b.annotation("step", 0, 9000)
    b.annotation("L0.mla", 10, 990)
    b.annotation("attn", 20, 80)
    b.kernel("k1", 5000, 1000, stream=7, correlation=b.runtime("cudaLaunchKernel", 30, 10))
    b.annotation("o_proj+ar", 100, 100)
    b.kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 6000, 1000, stream=8,
             correlation=b.runtime("cudaLaunchKernel", 110, 10))
    b.annotation("L1.kda", 1000, 7000)
    b.annotation("in_proj", 1010, 90)
    b.kernel("k2", 6500, 1000, stream=7, correlation=b.runtime("cudaLaunchKernel", 1020, 10))
    b.annotation("out", 7550, 250)
    b.kernel("k3", 7800, 200, stream=7, correlation=b.runtime("cudaLaunchKernel", 7600, 100))
    return b.write(tmp_path_factory.mktemp("cli") / "t.json")


def run(*args: str, code: int = OK) -> dict:
    res = CliRunner().invoke(main, list(args))
    assert res.exit_code == code, res.output
    return json.loads(res.output) if code == OK and "--format" in args else {}


def test_temporal(trace: Path) -> None:
    [r] = run("temporal", str(trace), "--format", "json")["ranks"]
    assert (r["span_ns"], r["busy_ns"], r["idle_ns"], r["compute_ns"], r["non_compute_ns"]) == (3000, 2700, 300, 2200, 500)
    assert r["idle_pct"] == pytest.approx(10.0)


def test_bubbles(trace: Path) -> None:
    doc = run("bubbles", str(trace), "--format", "json")
    [s] = doc["steps"]
    assert (s["span_ns"], s["busy_ns"], s["bubble_ns"], s["by_cause"]["launch_bound"]) == (3000, 2700, 300, 300)
    [b] = doc["top"]
    assert (b["end_ns"] - b["start_ns"], b["gap_ns"], b["cause"], b["prev_name"], b["next_name"], b["layer"], b["op"]) == (
        300, 300, "launch_bound", "k2", "k3", "L1.kda", "out")
    assert run("bubbles", str(trace), "--min-ns", "301", "--format", "json")["top"] == []


def test_overlap(trace: Path) -> None:
    doc = run("overlap", str(trace), "--format", "json")
    [r] = doc["ranks"]
    assert (r["comm_ns"], r["overlap_ns"], r["exposed_comm_ns"]) == (1000, 500, 500)
    assert r["overlap_pct"] == pytest.approx(50.0)
    [la] = doc["layers"]
    assert (la["layer"], la["comm_ns"], la["exposed_comm_ns"]) == ("L0.mla", 1000, 500)


def test_launch(trace: Path) -> None:
    [r] = run("launch", str(trace), "--format", "json")["ranks"]
    assert (r["launch"], r["items"], r["p50_delay_ns"], r["p90_delay_ns"], r["p99_delay_ns"], r["max_delay_ns"],
            r["shorter_than_launch"]) == ("direct", 4, 4970, 5890, 5890, 5890, 0)


def test_prefetch_not_applicable(trace: Path) -> None:
    doc = run("prefetch", str(trace), "--format", "json")
    assert doc["not_applicable"] == "no prefetch kernels or copies" and doc["summary"]["count"] == 0
    res = CliRunner().invoke(main, ["prefetch", str(trace)])
    assert res.exit_code == OK and "not applicable: no prefetch kernels or copies" in res.output


@pytest.mark.parametrize("cmd", ["bubbles", "overlap", "prefetch", "launch", "temporal"])
def test_bad_input_exits_2(trace: Path, cmd: str) -> None:
    run(cmd, str(trace), "--run", "99", code=BAD_INPUT)
    run(cmd, str(trace.parent / "missing.json"), code=BAD_INPUT)
