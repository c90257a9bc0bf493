"""bench/profiler_overhead.py on the CPU: the per-replay span it reads off a trace, and the page.

Oracle: a hand-made Kineto trace with two graph launches whose kernels' extents are known
(one launch's kernels overlap on two streams, and an eager kernel between them must not count).
"""
from __future__ import annotations

from bench.profiler_overhead import render, replay_spans_ns


def _trace() -> dict:
    ev = [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0.0, "dur": 5.0, "args": {"correlation": 1}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 6.0, "dur": 5.0, "args": {"correlation": 2}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 7.0, "dur": 1.0, "args": {"correlation": 3}},
        # replay 1: 10.000 .. 30.500 us (the second kernel on another stream ends last)
        {"ph": "X", "cat": "kernel", "name": "a", "ts": 10.0, "dur": 12.25, "args": {"correlation": 1, "stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "b", "ts": 11.5, "dur": 19.0, "args": {"correlation": 1, "stream": 9}},
        # an eager kernel between the replays
        {"ph": "X", "cat": "kernel", "name": "e", "ts": 31.0, "dur": 100.0, "args": {"correlation": 3, "stream": 7}},
        # replay 2: 40.001 .. 45.004 us
        {"ph": "X", "cat": "kernel", "name": "a", "ts": 40.001, "dur": 5.003, "args": {"correlation": 2, "stream": 7}},
    ]
    return {"traceEvents": ev}


def test_replay_spans_are_integer_ns_per_launch() -> None:
    assert replay_spans_ns(_trace()) == [20500, 5003]


def test_render_names_the_kernel_sets_and_ratios() -> None:
    row = {"batch": 1, "spec_tokens": 7, "first_ns": [230000, 215000, 216000, 201000], "none_ns": [200000, 202000, 201000], "cpu_ns": [201000] * 3,
           "cupti_ns": [220000] * 3, "trace_spans_ns": [210000, 212000, 211000]}
    data = {"date": "2026-12-03T00:00:00+00:00", "commit": "abc", "gpu": "H200", "torch": "2.11", "cuda": "13.0",
            "reps": 3, "layers": [4, 5, 6, 7], "default_kernels": ["gemv", "pdl_chain"],
            "rows": [dict(row, variant="stock", kernel_set=None),
                     dict(row, variant="fused", kernel_set=["gemv", "pdl_chain"]),
                     dict(row, variant="fused", kernel_set=["gemv"])]}
    md = render(data)
    assert "| stock | 1 | 7 | stock | 216.0 | 201.0 | 201.0 | 220.0 | 1.095 | 211.0 | 1.050 |" in md
    assert "| fused | 1 | 7 | default | 216.0 | 201.0 |" in md
    assert "| fused | 1 | 7 | default - pdl_chain | 216.0 | 201.0 |" in md
    assert "profiler-overhead-data" in md
