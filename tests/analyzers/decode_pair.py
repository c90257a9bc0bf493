"""A tiny eager/graph pair of Kineto traces of one decode "workload" in our NVTX convention,
written with tests.kineto_builder, and the per-layer truth derived from the numbers below.

Per step s (host times from H = 1_000_000 s, GPU times from G = 50_000_000 + 1_000_000 s):
  L0.kda  in_proj         gemm_in   [G+0,    G+1000)  stream 7
                          conv1d    [G+1200, G+1700)  stream 7
          kda_recurrence  kda_rec   [G+1800, G+4800 + 100 s)  stream 7
  L1.mla  o_proj+ar       gemm_o    [G+5000, G+6000)  stream 7
                          allreduce [G+5500, G+7000)  stream 9 (overlaps gemm_o)
  outside layers          sample    [G+8000, G+8100)  (eager only: not in the graph)
L0.kda: 3 kernels, span 4800 + 100 s, busy 1000 + 500 + 3000 + 100 s = 4500 + 100 s, bubble 300;
        ops in_proj (2 kernels, busy 1500), kda_recurrence (1, busy 3000 + 100 s).
L1.mla: 2 kernels, span 2000, busy |[5000, 7000)| = 2000, bubble 0; op o_proj+ar (2, busy 2000).
With 3 steps the lower medians are the values of s = 1 (span 4900, busy 4600 for L0.kda).
The graph trace replays the five layer kernels from one cudaGraphLaunch per step, with the
capture map our tracer writes (decodescope.graph_capture_map).
"""
from __future__ import annotations

from pathlib import Path

from tests.kineto_builder import KinetoTraceBuilder

KERNELS = [  # name, GPU start, GPU end (before the step's shift), stream, layer, op
    ("gemm_in", 0, 1000, 7, "L0.kda", "in_proj"),
    ("conv1d", 1200, 1700, 7, "L0.kda", "in_proj"),
    ("kda_rec", 1800, 4800, 7, "L0.kda", "kda_recurrence"),
    ("gemm_o", 5000, 6000, 7, "L1.mla", "o_proj+ar"),
    ("allreduce", 5500, 7000, 9, "L1.mla", "o_proj+ar"),
]
HOST = {  # layer/op host ranges, relative to the step start
    "L0.kda": (1000, 40_000), "in_proj": (1000, 20_000), "kda_recurrence": (20_000, 40_000),
    "L1.mla": (40_000, 80_000), "o_proj+ar": (40_000, 80_000),
}


def _gpu(s: int, start: int, end: int, name: str) -> tuple[int, int]:
    g = 50_000_000 + 1_000_000 * s
    extra = 100 * s if name == "kda_rec" else 0
    return g + start, g + end + extra


def write_eager(path: Path, steps: int = 3) -> Path:
    b = KinetoTraceBuilder()
    for s in range(steps):
        h = 1_000_000 * s
        b.annotation("step", h, 100_000)
        for name, (a, e) in HOST.items():
            b.annotation(name, h + a, e - a)
        for i, (kname, start, end, stream, layer, op) in enumerate(KERNELS):
            t = h + HOST[op][0] + 100 + 10 * i
            gs, ge = _gpu(s, start, end, kname)
            b.launch(kname, t, 5, gs, ge - gs, stream=stream)
        gs, ge = _gpu(s, 8000, 8100, "sample")
        b.launch("sample", h + 90_000, 5, gs, ge - gs)
    return b.write(path, gz=True, decodescope_meta={"variant": "stock", "graph_mode": False})


def write_graph(path: Path, steps: int = 3, with_map: bool = True,
                names: list[str] | None = None, capture_streams: bool = True) -> Path:
    """`names` replaces the kernel names of the LAST replay (to plant a mismatch). The map
    gives each node's capture stream (its kernel's stream here) unless `capture_streams` is
    False, as maps written before the tracer recorded them."""
    b = KinetoTraceBuilder()
    for s in range(steps):
        h = 1_000_000 * s
        b.annotation("step", h, 100_000)
        corr = b.runtime("cudaGraphLaunch", h + 500, 20)
        for i, (kname, start, end, stream, _, _) in enumerate(KERNELS):
            gs, ge = _gpu(s, start, end, kname)
            if names is not None and s == steps - 1:
                kname = names[i]
            b.kernel(kname, gs, ge - gs, stream=stream, correlation=corr)
    meta = {"variant": "stock", "graph_mode": True}
    if with_map:
        meta["graph_capture_map"] = [
            {"node_order": i, "kernel_name": k[0], "step": "step", "layer": k[4], "op": k[5],
             **({"capture_stream": k[3]} if capture_streams else {})}
            for i, k in enumerate(KERNELS)]
    return b.write(path, gz=True, decodescope_meta=meta)


EXPECTED_LAYERS = [
    {"layer": "L0.kda", "index": 0, "kind": "kda", "kernels": 3, "span_ns": 4900, "busy_ns": 4600,
     "bubble_ns": 300, "ops": [{"op": "in_proj", "kernels": 2, "busy_ns": 1500},
                               {"op": "kda_recurrence", "kernels": 1, "busy_ns": 3100}]},
    {"layer": "L1.mla", "index": 1, "kind": "mla", "kernels": 2, "span_ns": 2000, "busy_ns": 2000,
     "bubble_ns": 0, "ops": [{"op": "o_proj+ar", "kernels": 2, "busy_ns": 2000}]},
]
