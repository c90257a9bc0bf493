"""Kimi K3 hyper-parameters and the per-rank slice one decode step runs (KIMI_K3.md §1, §1.8).

`KimiConfig` holds the published model numbers, the tensor-parallel slice (tp, rank) and the
run parameters (batch B, speculative rows k, layer slice, dtype, seed). `__post_init__` derives
every per-rank size, so the model code never divides by tp itself. Presets: `k3_tp16` (one
rank of TP16 on an H200) and `tiny` (same structure, CPU-test sized).

Layout choices for the stock path, recorded in the config so traces carry them:
- MoE experts are TP-sliced (stock vLLM layout): every rank holds all experts, each with an
  intermediate slice of moe_intermediate/tp, padded up to `moe_pad_local_inter` (vLLM pads
  192 -> 256 with zero columns, so the math is unchanged).
- Expert weights are bf16, de-quantised from MXFP4 (`expert_weight_format`): H200 has no
  MXFP4 tensor-core path; a later fused path reads the same weights.
- The MLA latent cache is kept in `dtype` (bf16), not fp8.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

MAX_LAYERS = 12  # one K3 AttnRes block: the longest slice a step runs
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def _ceil_to(x: int, mult: int) -> int:
    return -(-x // mult) * mult


@dataclass
class KimiConfig:
    """Model numbers (defaults = published K3 text config) plus the per-rank run slice."""

    # --- model (KIMI_K3.md §1.1) ---
    hidden: int = 7168
    num_layers: int = 93
    kda_heads: int = 96
    kda_head_dim: int = 128
    conv_kernel: int = 4
    gate_lower_bound: float = -5.0
    mla_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_dim: int = 128
    qk_rope_dim: int = 64
    v_head_dim: int = 128
    num_experts: int = 896
    top_k: int = 16
    moe_intermediate: int = 3072
    latent_dim: int = 3584
    num_shared_experts: int = 2
    dense_intermediate: int = 33792
    attn_res_block: int = 12
    rms_eps: float = 1e-5
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    routed_scaling: float = 1.0
    # 1-indexed full-attention (MLA) layers of the published config: 4, 8, ..., 92, 93.
    mla_layers_1idx: tuple[int, ...] = tuple(range(4, 93, 4)) + (93,)
    # --- slice and layout ---
    tp: int = 16
    rank: int = 0
    moe_pad_local_inter: int = 256      # vLLM's min_moe_intermediate_per_partition
    in_proj_pad: int = 16               # in_proj_qkvgfab rows padded to a multiple of this
    weight_chunks: int = 16             # seeding granularity of sharded weights (>= any tp used)
    expert_weight_format: str = "bf16 (de-quantised from MXFP4)"
    kv_cache_dtype: str = "bf16"
    # routed experts: "grouped_mm" (torch._grouped_mm: each selected expert read once),
    # "gather_bmm" (gpt-fast style gather + bmm), or "auto" (grouped_mm when torch has it)
    expert_impl: str = "auto"
    # compile each non-GEMM op group with torch.compile (~1 Triton kernel each, as vLLM's
    # fused kernels); off = plain eager ops (CPU tests)
    compile_ops: bool = False
    # with compile_ops on CUDA: the op groups inductor cannot make one kernel (skinny GEMMs,
    # AttnRes, conv, recurrent KDA, routing, experts, latent up-proj) run the Triton kernels of
    # stock_triton.py, as stock vLLM's Triton / skinny-GEMM kernels; `triton_off` names op
    # groups of stock_ops.TRITON_OPS that stay torch (e.g. one whose device check failed)
    triton_ops: bool = True
    triton_off: tuple[str, ...] = ()
    # --- run parameters ---
    batch: int = 1
    spec_tokens: int = 0                # k: draft rows verified per sequence (0 or 7)
    layers: tuple[int, ...] = (4, 5, 6, 7)  # 0-indexed model layers this step runs
    context_len: int = 4096             # MLA tokens already cached per sequence
    max_steps: int = 64                 # cache room for this many further steps
    dtype: str = "bfloat16"
    seed: int = 0
    tp_sim: bool = False                # simulate TP collectives locally (one GPU)
    sim_world: int = 16                 # ranks whose partials a simulated collective reads

    # derived (filled by __post_init__)
    derived: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.layers = tuple(int(i) for i in self.layers)
        self.triton_off = tuple(self.triton_off)
        if self.expert_impl == "auto":
            self.expert_impl = "grouped_mm" if hasattr(torch, "_grouped_mm") else "gather_bmm"
        if self.expert_impl not in ("grouped_mm", "gather_bmm"):
            raise ValueError(f"unknown expert_impl {self.expert_impl!r}")
        if self.spec_tokens not in (0, 7) and self.batch * (1 + self.spec_tokens) > 512:
            raise ValueError("spec_tokens must be small (0 or 7 in K3 practice)")
        if not 1 <= self.batch <= 64:
            raise ValueError(f"batch must be in 1..64, got {self.batch}")
        if not self.layers or any(b != a + 1 for a, b in zip(self.layers, self.layers[1:])):
            raise ValueError(f"layers must be a non-empty contiguous range, got {self.layers}")
        if self.layers[0] < 0 or self.layers[-1] >= self.num_layers or len(self.layers) > MAX_LAYERS:
            raise ValueError(f"layers {self.layers} outside 0..{self.num_layers - 1} or longer than {MAX_LAYERS}")
        for name, total in (("kda_heads", self.kda_heads), ("mla_heads", self.mla_heads),
                            ("moe_intermediate", self.moe_intermediate),
                            ("shared intermediate", self.moe_intermediate * self.num_shared_experts),
                            ("dense_intermediate", self.dense_intermediate), ("hidden", self.hidden)):
            if total % self.tp:
                raise ValueError(f"{name}={total} is not divisible by tp={self.tp}")
        if self.weight_chunks % self.tp or self.kda_heads % self.weight_chunks or self.mla_heads % self.weight_chunks:
            raise ValueError("weight_chunks must be a multiple of tp and divide the head counts")
        if not 0 <= self.rank < self.tp:
            raise ValueError(f"rank {self.rank} outside tp={self.tp}")
        h_kda, h_mla = self.kda_heads // self.tp, self.mla_heads // self.tp
        p_local = h_kda * self.kda_head_dim
        inter = self.moe_intermediate // self.tp
        in_proj = 4 * p_local + self.kda_head_dim + h_kda
        self.derived = {
            "rows": self.batch * (1 + self.spec_tokens),           # M
            "tokens_per_seq": 1 + self.spec_tokens,               # T
            "kda_local_heads": h_kda,
            "kda_local_dim": p_local,                             # P / tp
            "in_proj_rows": _ceil_to(in_proj, self.in_proj_pad),  # 3216 at TP16
            "in_proj_used": in_proj,
            "mla_local_heads": h_mla,
            "qk_head_dim": self.qk_nope_dim + self.qk_rope_dim,  # 192
            "qkv_a_rows": self.q_lora_rank + self.kv_lora_rank + self.qk_rope_dim,  # 2112
            "expert_local_inter": inter,                          # 192 at TP16
            "expert_local_inter_padded": max(inter, self.moe_pad_local_inter),
            "shared_local_inter": self.moe_intermediate * self.num_shared_experts // self.tp,  # 384
            "dense_local_inter": self.dense_intermediate // self.tp,  # 2112
            "row_shard": self.hidden // self.tp,                  # 448: up-proj rows this rank owns
            "cache_len": self.context_len + self.max_steps * (1 + self.spec_tokens),
            "attn_res_slots": math.ceil(self.num_layers / self.attn_res_block),  # 8
        }

    # --- helpers the model uses ---
    def __getattr__(self, name: str) -> Any:
        derived = self.__dict__.get("derived")
        if derived and name in derived:
            return derived[name]
        raise AttributeError(name)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def layer_kind(self, idx: int) -> str:
        """'dense' for layer 0 (KDA + dense MLP), 'mla' for full-attention layers, else 'kda'."""
        if idx + 1 in self.mla_layers_1idx:
            return "mla"
        return "dense" if idx == 0 else "kda"

    def with_(self, **changes: Any) -> "KimiConfig":
        """A copy with some fields changed (derived sizes recomputed)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """All fields, JSON-friendly, derived sizes included (for trace metadata)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "derived"}
        out["layers"] = list(self.layers)
        out["triton_off"] = list(self.triton_off)
        out["mla_layers_1idx"] = list(self.mla_layers_1idx)
        out["layer_kinds"] = [self.layer_kind(i) for i in self.layers]
        out["derived"] = dict(self.derived)
        return out


def k3_tp16(**run: Any) -> KimiConfig:
    """One rank of a TP16 K3 deployment, the real per-rank shapes of KIMI_K3.md §1.8."""
    return KimiConfig(**run)


def tiny(**run: Any) -> KimiConfig:
    """Same structure at toy sizes: runs a few steps on the CPU in well under a second.

    tp defaults to 1; the weights are seeded in 2 chunks so a tp=2 run holds exact shards.
    MLA sits at 0-indexed 3, 7, ... as in K3 (same 1-indexed rule, fewer layers).
    """
    base: dict[str, Any] = dict(
        hidden=64, num_layers=16, kda_heads=4, kda_head_dim=16, mla_heads=4, q_lora_rank=32,
        kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=8, num_experts=16, top_k=4,
        moe_intermediate=16, latent_dim=32, dense_intermediate=96, attn_res_block=4,
        mla_layers_1idx=(4, 8, 12, 15, 16), tp=1, moe_pad_local_inter=0, in_proj_pad=8,
        weight_chunks=2, layers=(0, 1, 2, 3, 4), context_len=6, max_steps=8, dtype="float32",
        situ_beta=4.0, situ_linear_beta=25.0,
    )
    base.update(run)
    return KimiConfig(**base)


PRESETS = {"k3_tp16": k3_tp16, "tiny": tiny}


def parse_layers(text: str) -> tuple[int, ...]:
    """'4-7' or '4,5,6,7' -> (4, 5, 6, 7)."""
    try:
        if "-" in text:
            a, b = text.split("-", 1)
            return tuple(range(int(a), int(b) + 1))
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{text!r}: use FIRST-LAST or a comma list of layer indices") from None
