"""MoE router in one kernel: fp32 GEMV + sigmoid + correction-bias top-k + renormalise
(KIMI_K3.md §1.6 step 1; the stock path issues a GEMM, a cast, sigmoid, add, topk, gather,
sum and divide, 7–8 kernels).

    logits[m, e] = <y[m], W_gate[e]>            bf16 inputs, fp32 accumulation and output
    s = sigmoid(logits)                          fp32
    ids[m] = top-k of (s + bias)                 the bias only chooses (ties: lower index)
    w[m, j] = s[m, ids[m, j]] / Σ_j s[m, ids[m, j]] · routed_scaling

Two configurations (the per-M table in `config_for`):
- `gemv` (M ≤ GEMV_MAX_ROWS): grid = E / warps CTAs, one warp per expert row; a lane keeps
  its 128-bit slices of W_gate[e] in flight and accumulates all M rows (M fp32 registers),
  warp shuffles finish the dot products and lane 0 writes logits[m, e] to a scratch buffer.
  Each CTA then bumps a global counter (release/acquire at GPU scope); the CTA that sees
  gridDim - 1 runs the top-k for every row and resets the counter to 0 (CUDA-graph replays
  find it zeroed). One launch in all.
- `topk` (larger M): the caller passes fp32 logits from its own GEMM (the stock path's
  router GEMM: tensor cores win once W_gate is re-used by many rows); this kernel does the
  rest, one warp per row.

Top-k, one warp per row: lane l holds experts l, l+32, ... (E/32 values each) in registers;
each of k rounds takes the lane-local maximum, then a butterfly argmax over the warp (value,
then lower index); the owner lane masks its winner and shuffles out the unbiased score.

Check on the GPU (against the stock router op; times both):
    python -m kimi_decode.kernels.router
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from kimi_decode.kernels._common import (arrive_count, compile_options, compiled, current_stream, dummy_ptr, ptr,
                                         sigmoid)

VEC = 8
WARPS = 8
GEMV_MAX_ROWS = 16
NEG = -3.0e38


@dataclass(frozen=True)
class RouterConfig:
    """Compile-time choices."""

    hidden: int
    experts: int
    top_k: int
    gemv: bool
    rows: int = 0          # M, compile-time in gemv mode only (registers per lane)
    scaling: float = 1.0
    # gemv mode: round the logits to bf16 before the sigmoid (a path whose router GEMM has a
    # bf16 output); False keeps KIMI_K3.md's fp32 logits, as the stock skinny GEMM does.
    logits_bf16: bool = False


def config_for(m: int, hidden: int, experts: int, top_k: int, scaling: float,
               logits_bf16: bool = False) -> RouterConfig:
    """Per-M table: the one-kernel GEMV path for small M, cuBLAS logits + top-k beyond."""
    if m <= GEMV_MAX_ROWS:
        return RouterConfig(hidden, experts, top_k, True, m, scaling, logits_bf16)
    return RouterConfig(hidden, experts, top_k, False, 0, scaling, logits_bf16)


def can_implement(hidden: int, experts: int, top_k: int, dtypes: tuple[torch.dtype, ...]) -> bool:
    """Experts split evenly over 32 lanes and over the CTAs' warps; k fits one warp."""
    return (experts % 32 == 0 and experts % WARPS == 0 and experts // 32 <= 64
            and 1 <= top_k <= 32 and hidden % (VEC * 32) == 0
            and all(d == torch.bfloat16 for d in dtypes))


class Router:
    """See the module docstring."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.D, self.E, self.K = cfg.hidden, cfg.experts, cfg.top_k
        self.per_lane = cfg.experts // 32
        self.vec_per_lane = cfg.hidden // (VEC * 32)

    @cute.jit
    def __call__(self, y: cute.Pointer, w_gate: cute.Pointer, bias: cute.Pointer,
                 logits: cute.Pointer, counter: cute.Pointer, ids: cute.Pointer,
                 weights: cute.Pointer, m: Int32, stream: cuda.CUstream):
        nv = self.D // VEC
        mY = cute.make_tensor(y, cute.make_layout((m, nv, VEC), stride=(self.D, VEC, 1)))
        mW = cute.make_tensor(w_gate, cute.make_layout((self.E, nv, VEC), stride=(self.D, VEC, 1)))
        mB = cute.make_tensor(bias, cute.make_layout(self.E))
        mL = cute.make_tensor(logits, cute.make_layout((m, self.E), stride=(self.E, 1)))
        mC = cute.make_tensor(counter, cute.make_layout(1))
        mI = cute.make_tensor(ids, cute.make_layout((m, self.K), stride=(self.K, 1)))
        mO = cute.make_tensor(weights, cute.make_layout((m, self.K), stride=(self.K, 1)))
        if cutlass.const_expr(self.cfg.gemv):
            grid = self.E // WARPS
        else:
            grid = (m + WARPS - 1) // WARPS
        self.kernel(mY, mW, mB, mL, mC, mI, mO, m).launch(
            grid=[grid, 1, 1], block=[WARPS * 32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mW: cute.Tensor, mB: cute.Tensor, mL: cute.Tensor,
               mC: cute.Tensor, mI: cute.Tensor, mO: cute.Tensor, m: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        if cutlass.const_expr(self.cfg.gemv):
            self.gemv(mY, mW, mL, bidx * WARPS + warp, lane)
            smem = cutlass.memory.SmemAllocator()
            flag = smem.allocate_tensor(Int32, cute.make_layout(1))
            arrive_count(mC, flag, tidx)
            if flag[0] == gdim - 1:
                cute.arch.fence_acq_rel_gpu()
                for row in range(warp, m, WARPS):
                    self.topk_row(mL, mB, mI, mO, row, lane)
                if tidx == 0:
                    mC[0] = Int32(0)
        else:
            row = bidx * WARPS + warp
            if row < m:
                self.topk_row(mL, mB, mI, mO, row, lane)

    @cute.jit
    def gemv(self, mY: cute.Tensor, mW: cute.Tensor, mL: cute.Tensor, e: Int32, lane: Int32):
        """mL[:, e] = y @ W[e] for all rows: lane-strided 128-bit slices, fp32 accumulation."""
        acc = cute.make_rmem_tensor(cute.make_layout(self.cfg.rows), Float32)
        acc.fill(0.0)
        wv = cute.make_rmem_tensor(cute.make_layout(VEC), mW.element_type)
        yv = cute.make_rmem_tensor(cute.make_layout(VEC), mY.element_type)
        for i in cutlass.range_constexpr(self.vec_per_lane):
            c = lane + i * 32
            cute.autovec_copy(mW[e, c, None], wv)
            for r in cutlass.range_constexpr(self.cfg.rows):
                cute.autovec_copy(mY[r, c, None], yv)
                for j in cutlass.range_constexpr(VEC):
                    acc[r] = acc[r] + wv[j].to(Float32) * yv[j].to(Float32)
        for r in cutlass.range_constexpr(self.cfg.rows):
            tot = cute.arch.warp_reduction_sum(acc[r])
            if cutlass.const_expr(self.cfg.logits_bf16):
                tot = tot.to(cutlass.BFloat16).to(Float32)
            if lane == 0:
                mL[r, e] = tot
        if lane == 0:
            cute.arch.fence_acq_rel_gpu()   # this warp's logits before the CTA's counter bump

    @cute.jit
    def topk_row(self, mL: cute.Tensor, mB: cute.Tensor, mI: cute.Tensor, mO: cute.Tensor,
                 row: Int32, lane: Int32):
        """Sigmoid, biased top-k, renormalised unbiased weights for one row (one warp)."""
        sc = cute.make_rmem_tensor(cute.make_layout(self.per_lane), Float32)
        key = cute.make_rmem_tensor(cute.make_layout(self.per_lane), Float32)
        for i in cutlass.range_constexpr(self.per_lane):
            e = lane + i * 32
            sc[i] = sigmoid(mL[row, e].to(Float32))
            key[i] = sc[i] + mB[e]
        my_id = Int32(0)
        my_s = Float32(0.0)
        total = Float32(0.0)
        for r in cutlass.range_constexpr(self.K):
            bv = Float32(NEG)
            bi = Int32(self.E)
            for i in cutlass.range_constexpr(self.per_lane):
                if key[i] > bv:
                    bv = key[i]
                    bi = lane + i * 32
            for sh in cutlass.range_constexpr(5):
                ov = cute.arch.shuffle_sync_bfly(bv, offset=1 << sh)
                oi = cute.arch.shuffle_sync_bfly(bi, offset=1 << sh)
                if ov > bv or (ov == bv and oi < bi):
                    bv = ov
                    bi = oi
            owner_s = Float32(0.0)
            for i in cutlass.range_constexpr(self.per_lane):
                if lane + i * 32 == bi:
                    owner_s = sc[i]
                    key[i] = Float32(NEG)
            s_win = cute.arch.shuffle_sync(owner_s, offset=bi % 32)
            total += s_win
            if lane == r:
                my_id = bi
                my_s = s_win
        if lane < self.K:
            mI[row, lane] = my_id.to(cutlass.Int64)
            mO[row, lane] = my_s / total * Float32(self.cfg.scaling)


def compile_for(cfg: RouterConfig) -> object:
    """The compiled kernel for `cfg` (cached)."""
    def build() -> object:
        bf, f32 = dummy_ptr(torch.bfloat16), dummy_ptr(torch.float32)
        i32, i64 = dummy_ptr(torch.int32), dummy_ptr(torch.int64)
        return cute.compile(Router(cfg), bf, bf, f32, f32, i32, i64, f32, Int32(1), current_stream(), options=compile_options())
    return compiled(("router", cfg), build)


def route(y: torch.Tensor, w_gate: torch.Tensor, bias: torch.Tensor, top_k: int,
          scaling: float, counter: torch.Tensor, logits: torch.Tensor | None = None,
          logits_bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch on the current stream. y [M, D] bf16, w_gate [E, D] bf16, bias [E] fp32,
    counter: a zeroed int32 [1] buffer the caller keeps (the kernel leaves it zeroed);
    logits [M, E] fp32: the caller's router GEMM output, used (and required for speed) when
    M > GEMV_MAX_ROWS. Returns (ids [M, k] int64, weights [M, k] fp32), ordered by biased
    score, descending."""
    m, d = y.shape
    e = w_gate.shape[0]
    if not can_implement(d, e, top_k, (y.dtype, w_gate.dtype)) or bias.dtype != torch.float32:
        raise ValueError(f"router kernel cannot run D={d} E={e} k={top_k}")
    cfg = config_for(m, d, e, top_k, scaling, logits_bf16)
    if cfg.gemv:
        scratch = torch.empty(m, e, dtype=torch.float32, device=y.device)
    else:
        if logits is None:
            logits = torch.mm(y.float(), w_gate.float().t())
        scratch = logits.float().contiguous()
    ids = torch.empty(m, top_k, dtype=torch.int64, device=y.device)
    weights = torch.empty(m, top_k, dtype=torch.float32, device=y.device)
    compile_for(cfg)(ptr(y), ptr(w_gate), ptr(bias), ptr(scratch), ptr(counter), ptr(ids),
                     ptr(weights), Int32(m), current_stream())
    return ids, weights


def reference(y: torch.Tensor, w_gate: torch.Tensor, bias: torch.Tensor, top_k: int,
              scaling: float, logits_bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 statement of the module docstring: (ids, weights, biased scores [M, E])."""
    logits = y.double() @ w_gate.double().t()
    if logits_bf16:
        logits = logits.to(torch.bfloat16).double()
    s = torch.sigmoid(logits)
    key = s + bias.double()
    ids = key.topk(top_k, dim=-1).indices
    w = s.gather(1, ids)
    return ids, w / w.sum(-1, keepdim=True) * scaling, key


if __name__ == "__main__":
    from kimi_decode.kernels.checks import main_router
    main_router()
