"""Hand-made decode traces for the dashboard tests, written with the Kineto builder.

Each trace has `steps` steps; each step runs `layers` layers (L{i}.kda / L{i}.mla) whose ops
launch `kernels_per_op` kernels of `kernel_ns` each on stream 7, one after the other with a
`gap_ns` idle gap between consecutive kernels, and one all-reduce kernel per layer on stream
20. Everything is integer ns, so a test can derive what any view must show.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.kineto_builder import KinetoTraceBuilder

OPS = ("in_proj", "attn", "o_proj")


@dataclass(frozen=True)
class DecodeSpec:
    variant: str
    steps: int = 2
    layers: int = 4
    kernels_per_op: int = 2
    kernel_ns: int = 3_000
    gap_ns: int = 1_000
    launch_ns: int = 400
    step_pause_ns: int = 50_000

    def layer_name(self, i: int) -> str:
        return f"L{i}.{'mla' if i % 4 == 3 else 'kda'}"


def write_decode_trace(path: Path, spec: DecodeSpec, base_ns: int = 1_700_000_000_000_000_000) -> Path:
    """Write the trace of `spec` to `path` (absolute ns start at base_ns) and return the path."""
    b = KinetoTraceBuilder(base_time_ns=base_ns)
    t = base_ns
    for _step in range(spec.steps):
        step_start = t
        for li in range(spec.layers):
            layer_start = t
            for op in OPS:
                op_start = t
                for k in range(spec.kernels_per_op):
                    b.launch(f"{spec.variant}_{op}_k{k}", t, spec.launch_ns, t + spec.launch_ns,
                             spec.kernel_ns, stream=7)
                    t += spec.launch_ns + spec.kernel_ns + spec.gap_ns - spec.launch_ns
                b.annotation(op, op_start, t - op_start)
            b.launch("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", t - spec.gap_ns, 100, t - spec.gap_ns + 100,
                     500, stream=20)
            b.annotation(spec.layer_name(li), layer_start, t - layer_start)
        b.annotation("step", step_start, t - step_start)
        t += spec.step_pause_ns
    return b.write(path, decodescope_meta={"variant": spec.variant, "graph_mode": False, "tp_sim": True})
