"""Hand-made decode runs for the trace-diff tests: a 'stock' and a 'fused' model, several steps,
seeded jitter, written either as store-shaped frames (kernels + a brute-force layer_steps stub
that follows the documented contract) or as a Kineto trace through the test builder.

Stock and fused differ the way the real variants do: the same layers and NVTX op names, but
different kernel names per op and fewer kernels. Every time is an integer ns.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from tests.interval_oracle import union_ns

# (op, [(kernel name, duration ns)]) per layer kind. Fused: other names, fewer, shorter kernels.
STOCK = {
    "kda": [("attn_res", [("rmsnorm_fwd", 4_000), ("vectorized_add", 3_000)]),
            ("in_proj", [("sm90_gemm_bf16_128x64", 30_000), ("sm90_gemm_bf16_64x64", 12_000)]),
            ("kda_recurrence", [("chunk_fwd_kernel_o", 40_000), ("chunk_fwd_kernel_h", 25_000),
                                ("elementwise_mul", 5_000)]),
            ("o_proj+ar", [("sm90_gemm_bf16_128x64", 20_000), ("all_reduce_sim", 15_000)])],
    "mla": [("attn_res", [("rmsnorm_fwd", 4_000), ("vectorized_add", 3_000)]),
            ("q_proj", [("sm90_gemm_bf16_128x64", 18_000), ("rope_kernel", 6_000)]),
            ("attention", [("flash_mla_decode", 60_000), ("softmax_reduce", 9_000)]),
            ("o_proj+ar", [("sm90_gemm_bf16_128x64", 20_000), ("all_reduce_sim", 15_000)])],
}
FUSED = {
    "kda": [("attn_res", [("fused_attn_res_norm", 5_000)]),
            ("in_proj", [("cute_gemm_in_proj_fused", 36_000)]),
            ("kda_recurrence", [("cute_kda_recurrence", 52_000)]),
            ("o_proj+ar", [("cute_gemm_o_proj", 19_000), ("all_reduce_sim", 15_000)])],
    "mla": [("attn_res", [("fused_attn_res_norm", 5_000)]),
            ("q_proj", [("cute_q_proj_rope", 20_000)]),
            ("attention", [("flash_mla_decode", 60_000)]),
            ("o_proj+ar", [("cute_gemm_o_proj", 19_000), ("all_reduce_sim", 15_000)])],
}
LAYERS = [(0, "kda"), (1, "kda"), (2, "kda"), (3, "mla")]
GAP_NS = 1_500  # idle gap between consecutive kernels (launch latency)
STEP_GAP_NS = 50_000


@dataclass
class Synth:
    """Knobs of one synthetic run."""

    ops: dict[str, list[tuple[str, list[tuple[str, int]]]]]
    steps: int = 12
    jitter: float = 0.004  # relative sd of each kernel's duration
    seed: int = 0
    scale: dict[tuple[int, str], float] | None = None  # (layer index, op) -> duration factor
    layers: list[tuple[int, str]] | None = None


def kernel_rows(s: Synth) -> pd.DataFrame:
    """One row per kernel (the columns of analyzers.diff.ATTRIBUTED_KERNELS_SQL), rank 0."""
    rng = np.random.default_rng(s.seed)
    rows = []
    t = 1_000_000
    for step in range(s.steps):
        for idx, kind in s.layers or LAYERS:
            for op, kernels in s.ops[kind]:
                factor = (s.scale or {}).get((idx, op), 1.0)
                for name, dur in kernels:
                    d = int(round(dur * factor * (1 + s.jitter * rng.standard_normal())))
                    rows.append({"rank": 0, "step_index": step, "layer": f"L{idx}.{kind}", "layer_kind": kind,
                                 "layer_index": idx, "op": op, "name": name, "start_ns": t, "end_ns": t + d,
                                 "category": "communication" if "all_reduce" in name else "compute"})
                    t += d + GAP_NS
        t += STEP_GAP_NS
    return pd.DataFrame(rows)


def layer_steps_stub(k: pd.DataFrame, run_id: int = 1) -> pd.DataFrame:
    """The documented layer_steps contract, recomputed by brute force from kernel rows."""
    out = []
    for (rank, step, layer, kind, idx), g in k.groupby(["rank", "step_index", "layer", "layer_kind", "layer_index"]):
        parts = [(None, g)] + [(op, h) for op, h in g.groupby("op")]
        for op, h in parts:
            iv = list(zip(h["start_ns"], h["end_ns"]))
            span = int(h["end_ns"].max() - h["start_ns"].min())
            busy = union_ns(iv)
            out.append({"run_id": run_id, "rank": rank, "step_index": step, "layer": layer, "layer_index": idx,
                        "layer_kind": kind, "op": op, "kernels": len(h), "span_ns": span, "busy_ns": busy,
                        "bubble_ns": span - busy})
    return pd.DataFrame(out)


def sample(s: Synth, name: str, run_id: int = 1):
    """A RunSample for analyzers.diff.compare built from the synthetic run."""
    from analyzers.diff import RunSample

    k = kernel_rows(s)
    return RunSample(run_id, name, layer_steps_stub(k, run_id), k)


def write_kineto(s: Synth, path: Path, variant: str = "stock", meta: dict | None = None,
                 layer_fmt: str = "L{idx}.{kind}") -> Path:
    """The same run as a Kineto trace: `step`, layer (`layer_fmt`) and op annotations around launches."""
    from tests.kineto_builder import KinetoTraceBuilder

    k = kernel_rows(s)
    k["layer"] = [layer_fmt.format(idx=i, kind=kd) for i, kd in zip(k["layer_index"], k["layer_kind"])]
    b = KinetoTraceBuilder(rank=0, world_size=1)
    lead = 20_000  # host runs this far ahead of the device
    for step, gs in k.groupby("step_index"):
        b.annotation("step", int(gs.start_ns.min()) - lead - 500, int(gs.start_ns.max() - gs.start_ns.min()) + 1_000)
        for layer, gl in gs.groupby("layer", sort=False):
            b.annotation(layer, int(gl.start_ns.min()) - lead - 300, int(gl.start_ns.max() - gl.start_ns.min()) + 600)
            for op, go in gl.groupby("op", sort=False):
                b.annotation(op, int(go.start_ns.min()) - lead - 100, int(go.start_ns.max() - go.start_ns.min()) + 200)
                for r in go.itertuples():
                    b.launch(r.name, int(r.start_ns) - lead, 50, int(r.start_ns), int(r.end_ns - r.start_ns),
                             stream=9 if r.category == "communication" else 7)
    return b.write(path, gz=True, decodescope_meta={"variant": variant, **(meta or {})})


def write_kineto_graph(s: Synth, path: Path) -> Path:
    """The same run replayed from a CUDA graph by a foreign tool: one `cudaGraphLaunch` per step
    inside a `step` range, the kernels carry its correlation and a graph id, and there is no
    layer or op range and no capture map, so only an eager reference can attribute them."""
    from tests.kineto_builder import KinetoTraceBuilder

    k = kernel_rows(s)
    b = KinetoTraceBuilder(rank=0, world_size=1)
    for step, gs in k.groupby("step_index"):
        first = int(gs.start_ns.min())
        b.annotation("step", first - 30_000, 20_000)
        corr = b.runtime("cudaGraphLaunch", first - 25_000, 5_000)
        for r in gs.itertuples():
            b.kernel(r.name, int(r.start_ns), int(r.end_ns - r.start_ns), correlation=corr, graph_id=1,
                     stream=9 if r.category == "communication" else 7)
    return b.write(path, gz=True, decodescope_meta={"variant": "stock"})


def test_layer_steps_stub_is_consistent() -> None:
    """The stub obeys span = busy + bubble and counts every kernel once per step."""
    k = kernel_rows(Synth(STOCK, steps=3))
    ls = layer_steps_stub(k)
    assert (ls.span_ns == ls.busy_ns + ls.bubble_ns).all()
    whole = ls[ls.op.isna()]
    assert whole.kernels.sum() == len(k)
    # sequential kernels with GAP_NS between: a layer's bubble is GAP_NS per inner gap
    assert (whole.bubble_ns == (whole.kernels - 1) * GAP_NS).all()
