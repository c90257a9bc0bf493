"""The one place that names and opens profiler ranges: `step`, `L{idx}.{kind}`, then an op.

Each range is opened twice, on purpose: as an NVTX range (Nsight Systems, the CUPTI backend)
and as a `torch.profiler.record_function` (the PyTorch profiler / Kineto does not record NVTX;
our ingest reads its `user_annotation` events). The `nvtx` package is used because
`torch.cuda.nvtx` raises on CPU builds; on the GPU machine, whose image lacks the package,
`torch.cuda.nvtx` (a CUDA build there) is the fallback.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

try:
    import nvtx as _nvtx
except ModuleNotFoundError:  # the GPU machine's image: a CUDA torch build, no nvtx package
    _nvtx = None

STEP = "step"
LAYER_KINDS = ("kda", "mla", "dense")
# Every op name a layer may open, in issue order (KIMI_K3.md §2.4 / Part 3).
OPS = (
    "attn_res", "in_proj", "f_b_proj", "conv", "kda_recurrence", "o_norm",        # KDA
    "qkv_a", "g_proj", "qkv_a_g", "qkv_norm", "q_b_proj", "uk_bmm", "kv_insert", "mla_decode",  # MLA
    "uv_bmm", "gate_mul", "uk_insert", "uv_gate",                                  # MLA fused
                                                  # (qkv_a_g: qkv_a + g_proj in one launch)
    "o_proj", "all_reduce", "mlp_res",
    "moe_front",                       # fused: router + latent_down + shared gate/up, one launch
    "router", "latent_down", "shared_expert", "routing", "experts", "prefetch",     # MoE
    "moe_tail", "up_proj", "moe_gather",
    "dense_gate_up", "situ", "dense_down",                                          # layer 0
)
# Ops whose kernels are collectives (their own stream under tp_sim); a regex for trace metadata.
COMM_OPS = ("all_reduce", "moe_tail", "moe_gather")
COMM_OPS_REGEX = "^(" + "|".join(COMM_OPS) + ")$"
# Ops whose kernels only warm the L2 for a later consumer (fused path); regex for metadata.
PREFETCH_OPS = ("prefetch",)
PREFETCH_OPS_REGEX = "^(" + "|".join(PREFETCH_OPS) + ")$"


def layer_name(idx: int, kind: str) -> str:
    """`L{idx}.{kind}` with idx the 0-indexed model layer."""
    if kind not in LAYER_KINDS:
        raise ValueError(f"unknown layer kind {kind!r}")
    return f"L{idx}.{kind}"


@contextlib.contextmanager
def _nvtx_range(name: str) -> Iterator[None]:
    if _nvtx is not None:
        with _nvtx.annotate(name, domain="decodescope"):
            yield
    elif torch.cuda.is_available():
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()
    else:
        yield


@contextlib.contextmanager
def annotate(name: str) -> Iterator[None]:
    """One range under both NVTX and the PyTorch profiler."""
    with _nvtx_range(name), torch.profiler.record_function(name):
        yield


def step_range() -> contextlib.AbstractContextManager[None]:
    return annotate(STEP)


def layer_range(idx: int, kind: str) -> contextlib.AbstractContextManager[None]:
    return annotate(layer_name(idx, kind))


def op_range(op: str) -> contextlib.AbstractContextManager[None]:
    if op not in OPS:
        raise ValueError(f"unknown op name {op!r}; add it to kimi_decode.ranges.OPS")
    return annotate(op)
