"""CuTe DSL kernels of the fused decode path (one kernel per module, see STYLE.md).

Every kernel targets sm_90a (H200). On a machine without a GPU the DSL still traces and
compiles them to PTX, which the CPU test suite does; launching needs the GPU. The compile
target is fixed here, before `cutlass` is imported, because without a GPU the DSL would
otherwise default to sm_100a.
"""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

KERNELS = ("attn_res", "kda", "router", "gemv", "prefetch")


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
    raise KeyError(f"unknown kernel {name!r}; known: {KERNELS}")
