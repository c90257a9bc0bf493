"""CuTe DSL kernels of the fused decode path (one kernel per module, see STYLE.md).

Every kernel targets sm_90a (H200). On a machine without a GPU the DSL still traces and
compiles them to PTX, which the CPU test suite does; launching needs the GPU. The compile
target is fixed here, before `cutlass` is imported, because without a GPU the DSL would
otherwise default to sm_100a.
"""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

KERNELS = ("attn_res", "kda", "router", "gemv", "prefetch",
           # second round (2026-12-02 session 3): many-CTA KDA, routed experts, faster router,
           # AttnRes finishing the all-reduce, GEMV out=/K%128/SiTU prologue, MoE tail, MLA attention
           "kda_split", "experts", "router_fast", "attn_res_ar", "gemv_variants", "moe_up", "mla_attend",
           # AttnRes reading the MoE all-gather slots in place (no concatenation kernel)
           "attn_res_ag", "mla_glue",
           # third round: one grid for the GEMVs that share an input (MoE front with the router; MLA qkv_a + g_proj)
           "gemv_multi",
           # fourth round: FC2 of the routed experts in one wave, every lane loading
           # (moe_experts.ExpertsFC2v2); AttnRes at M = 1 with one row over a cluster of CTAs;
           # MLA qkv_norm folded into q_b's GEMV prologue and uk_insert (one launch fewer)
           # mla_attend also doing mla_glue's uv_gate (W_UV + sigmoid gate) in its launch
           "experts_v2", "attn_res_mc", "mla_norm_fold", "mla_attend_uv",
           # fifth round: kda_split at T = 1 with every global load issued up front (shorter
           # chain); the routed experts' FC1 + FC2 v2 in one persistent launch; per-shape GEMV
           # configurations at M = 1 (gemv.TUNED / TUNED_MULTI; check_sweep times them)
           "kda_fast", "experts_one", "gemv_tuned",
           # sixth round: the layer's kernels launched with programmatic dependent launch, each
           # prefetching its weights before its wait (kernels/chain.py)
           "pdl_chain",
           # seventh round: the projections at 2 ≤ M ≤ 8 on the tensor cores (mma.sync m16n8k16)
           "gemv_mma",
           # the MoE tail at 2 ≤ M ≤ 8 in one kernel, the slot sums once per grid (grid barrier)
           "moe_up_grid",
           # FC2 v2 staging its activations with cp.async (one round trip, no registers)
           "experts_v2_async",
           # eighth round (M = 8): the router's logits on the tensor cores with its top-k in the
           # last CTA (one launch); the shared expert's SiTU GLU as gemv_mma's prologue
           "router_mma", "gemv_mma_situ",
           # the KDA decode kernel for T ≥ 2 tokens per sequence, the per-token prelude batched
           "kda_multi",
           # twelfth round (M = 2..8): FC2 of the routed experts as a resident grid, one row per
           # CTA walking column blocks (no per-CTA prologue per 24 KB)
           "experts_rows",
           # the router's selection from gemv_mma's logits in one CTA (stock's Triton kernel out)
           "router_topk",
           # thirteenth round: MLA decode attention on the tensor cores (mma.sync) for many
           # query rows (B = 1, k = 7; B = 8), the split merge in the same launch
           "mla_attend_mma",
           # fourteenth round (M = 2..8): the MLA layer's qkv_a and g_proj in one gemv_mma grid;
           # qkv_norm folded into q_b's gemv_mma (RMSNorm prologue) and uk_insert
           "gemv_mma_pair", "mla_norm_fold_mma",
           # gemv_mma's (warps, unroll) per weight shape at 2 ≤ M ≤ 8 (gemv_mma.TUNED, check_sweep)
           "gemv_mma_tuned",
           # fifteenth round (M = 2..8): the MoE front (router + top-k, latent_down, shared
           # gate/up) in one gemv_mma grid, as gemv_multi is at M = 1
           "front_mma",
           # the MoE tail at 1 ≤ M ≤ 8 with the slot sums shared over clusters of 8 CTAs through
           # distributed shared memory (no grid barrier, no scratch); opt-in until measured
           "moe_up_cluster")
# Kernel name -> the module whose `check(timing)` is its GPU check (second-round kernels; the
# first five live in checks.py).
CHECK_MODULES = {"kda_split": "kda_split", "experts": "moe_experts", "router_fast": "router_fast",
                 "attn_res_ar": "attn_res", "attn_res_ag": "attn_res", "gemv_variants": "gemv", "moe_up": "moe_up",
                 "mla_attend": "mla_attend", "mla_glue": "mla_glue", "gemv_multi": "gemv_multi",
                 "experts_v2": "moe_experts", "attn_res_mc": "attn_res_mc", "mla_norm_fold": "mla_norm_fold",
                 "mla_attend_uv": "mla_attend", "kda_fast": "kda_fast", "experts_one": "moe_experts_one",
                 "gemv_tuned": "gemv", "pdl_chain": "chain_check",
                 "gemv_mma": "gemv_mma", "moe_up_grid": "moe_up_grid", "experts_v2_async": "moe_experts",
                 "router_mma": "router_mma", "gemv_mma_situ": "gemv_mma", "kda_multi": "kda_multi",
                 "experts_rows": "moe_fc2_rows", "router_topk": "router_topk",
                 "mla_attend_mma": "mla_attend_mma", "gemv_mma_pair": "gemv_mma_pair",
                 "mla_norm_fold_mma": "mla_norm_fold", "gemv_mma_tuned": "gemv_mma",
                 "front_mma": "front_mma", "moe_up_cluster": "moe_up_cluster"}


def applicable(name: str, cfg: object) -> bool:
    """Whether kernel `name` supports the shapes and dtypes of config `cfg` (KimiConfig)."""
    import torch

    if name == "attn_res":
        from kimi_decode.kernels.attn_res import can_implement
        return can_implement(cfg.hidden, 0, cfg.attn_res_slots, (cfg.torch_dtype, torch.float32))
    if name == "kda":
        from kimi_decode.kernels.kda_decode import can_implement
        return can_implement(cfg.kda_local_heads, cfg.kda_head_dim, cfg.conv_kernel,
                             cfg.in_proj_rows, (cfg.torch_dtype,))
    if name == "router":
        from kimi_decode.kernels.router import can_implement
        return can_implement(cfg.hidden, cfg.num_experts, cfg.top_k, (cfg.torch_dtype,))
    if name == "gemv":
        return cfg.torch_dtype == torch.bfloat16
    if name == "prefetch":
        return True
    if name in CHECK_MODULES:
        # shape limits are checked per call by each wrapper's can_implement (M-dependent);
        # here only the dtype the kernels are written for
        return cfg.torch_dtype == torch.bfloat16
    raise KeyError(f"unknown kernel {name!r}; known: {KERNELS}")
