"""Skinny GEMM for decode (M ≤ GEMV_MAX_ROWS rows): out = x @ Wᵀ, bf16 in and out, fp32
accumulation, the weight streamed from HBM exactly once (KIMI_K3.md Part 4: cuBLAS reaches
1–2 TB/s on these shapes at M = 1; a GEMV that keeps enough bytes in flight approaches the
copy bandwidth). vLLM's "skinnyGEMM" / CuTe skinny GEMM plays this role (KIMI_K3.md §2.2, §2.5).

Layout: one warp per output column n (a row of W [N, K]); grid = ceil(N / 8) CTAs of 8 warps.
Lane l reads the 128-bit slices l, l+32, ... of W[n] (coalesced, 512 bytes per warp load) and
the same slices of every x row (tiny, L1/L2-resident), accumulating M fp32 sums in registers;
the loop over slices is unrolled 4 deep so each lane keeps 4 weight loads in flight. A
butterfly shuffle finishes each dot product and lane 0 writes out[m, n] rounded to bf16 (as
cuBLAS rounds its fp32 accumulator). K must be a multiple of 256 (8 elements × 32 lanes).

Check on the GPU (against torch's matmul, the stock path's op; times both):
    python -m kimi_decode.kernels.gemv
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from kimi_decode.kernels._common import compile_options, compiled, current_stream, dummy_ptr, ptr

VEC = 8
WARPS = 8
# Per-M table, measured on the H200 (bench/fused_correctness.md): at M = 1 the GEMV beats
# torch's GEMM on every K3 projection (in_proj 10.1 vs 14.0 us, 4.6 TB/s); at M = 8 it loses
# (in_proj 33 vs 13.8 us: each lane re-reads 8 x-rows per weight load), so M >= 2 goes to the
# stock GEMM. The kernel itself was checked correct at M = 1 and M = 8.
GEMV_MAX_ROWS = 1


@dataclass(frozen=True)
class GemvConfig:
    """Compile-time sizes: output columns N, reduction K, rows M."""

    n: int
    k: int
    rows: int


def can_implement(m: int, n: int, k: int, dtypes: tuple[torch.dtype, ...]) -> bool:
    """Small M (the per-M table: the stock GEMM beyond GEMV_MAX_ROWS), K a multiple of 256, bf16."""
    return (1 <= m <= GEMV_MAX_ROWS and k % (VEC * 32) == 0 and n >= 1
            and all(d == torch.bfloat16 for d in dtypes))


class Gemv:
    """See the module docstring."""

    def __init__(self, cfg: GemvConfig) -> None:
        self.cfg = cfg
        self.slices = cfg.k // (VEC * 32)

    @cute.jit
    def __call__(self, x: cute.Pointer, w: cute.Pointer, out: cute.Pointer, stream: cuda.CUstream):
        n, k, m = self.cfg.n, self.cfg.k, self.cfg.rows
        mX = cute.make_tensor(x, cute.make_layout((m, k // VEC, VEC), stride=(k, VEC, 1)))
        mW = cute.make_tensor(w, cute.make_layout((n, k // VEC, VEC), stride=(k, VEC, 1)))
        mO = cute.make_tensor(out, cute.make_layout((m, n), stride=(n, 1)))
        self.kernel(mX, mW, mO).launch(grid=[(n + WARPS - 1) // WARPS, 1, 1],
                                       block=[WARPS * 32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor):
        bidx, _, _ = cute.arch.block_idx()
        col = bidx * WARPS + cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        if col < self.cfg.n:
            acc = cute.make_rmem_tensor(cute.make_layout(self.cfg.rows), Float32)
            acc.fill(0.0)
            wv = cute.make_rmem_tensor(cute.make_layout(VEC), mW.element_type)
            xv = cute.make_rmem_tensor(cute.make_layout(VEC), mX.element_type)
            for i in cutlass.range(self.slices, unroll=4):
                c = lane + i * 32
                cute.autovec_copy(mW[col, c, None], wv)
                for r in cutlass.range_constexpr(self.cfg.rows):
                    cute.autovec_copy(mX[r, c, None], xv)
                    for j in cutlass.range_constexpr(VEC):
                        acc[r] = acc[r] + wv[j].to(Float32) * xv[j].to(Float32)
            for r in cutlass.range_constexpr(self.cfg.rows):
                tot = cute.arch.warp_reduction_sum(acc[r])
                if lane == 0:
                    mO[r, col] = tot.to(mO.element_type)


def compile_for(cfg: GemvConfig) -> object:
    """The compiled kernel for `cfg` (cached)."""
    def build() -> object:
        bf = dummy_ptr(torch.bfloat16)
        return cute.compile(Gemv(cfg), bf, bf, bf, current_stream(), options=compile_options())
    return compiled(("gemv", cfg), build)


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K]ᵀ on the current stream; both contiguous bf16; returns [M, N] bf16."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or not can_implement(m, n, k, (x.dtype, w.dtype)):
        raise ValueError(f"gemv kernel cannot run M={m} N={n} K={k}")
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    compile_for(GemvConfig(n, k, m))(ptr(x), ptr(w), ptr(out), current_stream())
    return out


if __name__ == "__main__":
    from kimi_decode.kernels.checks import main_gemv
    main_gemv()
