"""MoE tail for 2 ≤ M ≤ 8 in one kernel with a grid-wide reduction (kernel "moe_up_grid"): the
same math as moe_up (kernels/moe_up.py, whose docstring states it), but the slot sums are done
once for the whole grid instead of once per CTA.

Why: moe_up has every CTA sum all `world` slots of r for every row it needs, which is right at
M = 1 (114 KB of L2 reads per CTA) and wrong at M = 8 (912 KB per CTA, 51 MB over 56 CTAs): its
check measured 25.7 µs there against 24.9 µs for the stock ops (bench/fused_correctness.md),
so the fused step kept stock's tail at M = 8: in the bundled B = 1, k = 7 trace two reductions,
a copy, the up-projection's skinny GEMM (15.7 µs for a 3.2 MB weight) and the all-gather's
concatenation, ~33 µs from FC2's end to the next layer's first kernel, in 5 launches.

Layout (grid = n / warps CTAs of `warps` warps, as moe_up: warp = one output column j):
  1. the warp's weight row into registers (14 × 128-bit loads per lane at L = 3584), before the
     PDL chain's wait; after it, lane s < world loads its shared partial for every row (moe_up's
     steps 1-2, unchanged);
  2. phase 1, distributed: thread g = block·threads + t < M·L/8 owns vector c = g mod (L/8) of
     row g div (L/8): r = bf16(Σ_s r_slots[s, row, c]) (fp32 sum in slot order, moe_up's
     rounding), stored to the scratch `rbuf` [M, L], and Σ r² over its 8 elements; a warp's 32
     vectors lie in one row (L/8 is a multiple of 32), so a butterfly and one store give the
     warp's partial wss[g div 32] (no atomics: the sum order is fixed);
  3. a grid barrier (sense reversal, as mla_attend's grid merge: thread 0 reads the epoch,
     arrives on the counter; the last re-zeroes the counter and bumps the epoch, the others poll
     it). Every CTA must be resident: n / warps = 56 CTAs at K3 TP16, far below one per SM, and
     with the PDL chain no successor can launch before every CTA has passed its wait;
  4. all M rows in one pass (moe_up works in chunks of 2 rows because it keeps r in registers;
     here r is read back, so nothing limits the chunk but shared memory: M · L · 2 B ≤ 56 KB):
     each thread issues the loads of its r vectors of every row (rbuf, L2) and of the norm
     weight together with thread m < M's loads of row m's warp partials, then rstd[m] =
     rsqrt(Σ_w wss[m·L/256 + w] / L + eps) (the partials added in order), one barrier, xn =
     bf16(r · rstd · norm) into shared memory, one barrier, moe_up's dot products for the M
     rows and its epilogue (+ shared, bf16 out). The first build did moe_up's 4 chunks of 2 rows
     after the barrier, each its own L2 round trip and barrier: 12.4 µs at M = 8 in the
     check, 13.4 in the step (expected 7-8).
Rounding points are moe_up's (r, shared, xn, y, out); only Σ r²'s fp32 order differs (per thread
8 elements, a warp butterfly, the warps in order, vs moe_up's per-thread + CTA sum), so rstd may
move in its last bits and an xn element by one bf16 ulp now and then, and with the tensor-core
dots (below) y's fp32 sum order (the mma's, then the warps in order): within the checks' 1e-2 of
moe_up and of the stock ops, not bit-equal.

Tensor-core dot products (DOTS_MMA, the default at 8 warps). ncu on the B = 1, k = 7 step at
3582044 (cold, `--section SourceCounters`, 560 warp-state samples of this kernel's 12.4 us):
~34 % of the samples in step 4's dot products, ~28 % waiting at the grid barrier (42 of the 56
CTAs have no phase-1 vector and wait there for the 14 that do), ~19 % in phase 1 and the shared
partials' loads. moe_up's dot products are one warp per column, 14 vectors × M rows of (a
shared-memory load, 8 bf16 → fp32 conversions of xn, 8 of the weights, 8 FMAs) per lane:
~2.8 K instructions per warp at M = 8, two warps per scheduler. Here the CTA's 8 columns are
the n of mma.m16n8k16 and its 8 warps split K (448 each at L = 3584): A = xn (token g in row
g = lane / 4, rows 8-15 zero: half of each mma is padding, the mma count is tiny anyway), B =
the weights, loaded before the chain's wait as the fragments (lane (g, t) holds vectors
warp·56 + 4·i + t of column 8·bidx + g, i < 14: the same 112 values per lane as moe_up's row,
the 4 lanes of a quad reading 64 contiguous bytes). Each 128-bit vector feeds two mma steps
(words 0-1, then 2-3, gemv_mma's k permutation, the same for A and B); 28 mma and 14
shared-memory loads per warp into two accumulators, then the warps' [8 × 8] partials meet in
shared memory and 8·M threads write out. The xn rows are padded by SX_PAD elements so a
quarter-warp's two token rows fall on different banks. The shared partials stay bf16 in
registers until the epilogue (the first build converted each right after its load, so the
warp stalled there for that load before issuing phase 1's), and phase 1 issues all world slot
loads before its first add (SLOT_LOADS_FIRST; the same adds in the same order). Measured
(bench/fused_runs.md, sessions 16-17, two A/B pairs at 7fb1a35): these two flags take 2.2-3.4
µs off each M = 8 layer in the step's graph, and with moe_up's and attn_res_mc's loads-first
order 3.5-4.2 µs.

Expected at M = 8: slot loads 16 × 128-bit per busy thread (3,584 of 14,336 threads), all in
flight: ~1.5 µs; barrier ~2 µs (mla_attend's: 2.2 µs for 130 CTAs); read-back and 4 chunks of
dot products ~3-4 µs: ~7-8 µs against ~33 µs of stock ops, and 4 launches fewer per layer
(with attn_res_ag the next layer's AttnRes reads the all-gather slot this kernel writes).

Check on the GPU (against moe_up, the stock ops and the float64 reference; repeated calls and
CUDA-graph replays reuse the barrier; times both):
    python -m kimi_decode.kernels.moe_up_grid
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from kimi_decode.kernels import chain
from kimi_decode.kernels import moe_up as k_up
from kimi_decode.kernels._common import (compile_options, compiled, current_stream, dummy_ptr,
                                         grid_arrive_and_wait, ptr)
from kimi_decode.kernels.gemv_mma import mma_bf16

VEC = k_up.VEC
MIN_ROWS = 2          # M = 1: moe_up (one CTA per column block re-summing is cheap there)
MAX_ROWS = k_up.MAX_ROWS
MAX_CTAS = 132        # every CTA resident for the grid barrier: at most one per SM of the H200
# The dot products on the tensor cores (module docstring, "Tensor-core dot products"): the
# CTA's 8 columns are an mma's n, its warps split K. False: moe_up's per-warp column dot
# products (CUDA cores); also where the CTA is not 8 warps (ALT_WARPS).
DOTS_MMA = True
# Phase 1's world slot vectors all loaded before the first add (the first build loaded one,
# added it, loaded the next: ptxas kept that order, one dependent round trip per slot or two)
SLOT_LOADS_FIRST = True
# Phase 1's warps spread over every CTA (phase1_item): virtual warp w·ctas + b is warp w of
# CTA b, so at M = 8 (112 busy warps, 56 CTAs) warps 0-1 of every CTA hold the r vectors instead
# of all 8 warps of CTAs 0-13; each virtual warp's 32 vectors, sums and partial index are
# unchanged (bit-equal). Why: ncu had ~28 % of the kernel's samples at the grid barrier, 42
# CTAs waiting for the 14 that did phase 1's loads alone. False: thread g = block·threads + t.
# Measured (H100, 150e59b, two fused_ab pairs, bench/fused_runs.md sessions 18-19): M = 8
# layers within ±0.8 us of off; the barrier wait is not this imbalance. Kept off.
PHASE1_SPREAD = False
MMA_WARPS = 8         # the mma's n: one CTA's columns
SX_PAD = 32           # bf16 elements of padding after each xn row in shared memory (64 B:
                      # the two token rows of a quarter-warp's 128-bit loads hit other banks)


def phase1_item(bidx, warp, lane, ctas: int, warps: int, spread: bool):
    """The phase-1 item (r vector, row-major over [M, L/8]) of lane `lane` of warp `warp` in
    CTA `bidx`; busy where < M·L/8. Plain arithmetic, so the kernel (Int32) and the tests (int)
    call the same function. spread: virtual warp warp·ctas + bidx (every CTA's low warps busy);
    else bidx·warps + warp (the low CTAs' every warp busy). Either way a virtual warp's 32 lanes
    hold 32 consecutive vectors, so its Σ r² partial goes to wss[item // 32] as before."""
    vwarp = warp * ctas + bidx if spread else bidx * warps + warp
    return vwarp * 32 + lane


@dataclass
class MoeUpGridScratch:
    """Per-layer buffers: r [M, L] bf16, the warps' Σ r² partials [M·L/256] fp32, and the
    barrier's counter + epoch [2] int32 (zero at creation; the kernel leaves the counter zero
    and only ever increments the epoch, so CUDA-graph replays need no reset)."""

    rbuf: torch.Tensor
    wss: torch.Tensor
    sync: torch.Tensor


def make_scratch(rows: int, latent: int, device: torch.device) -> MoeUpGridScratch:
    return MoeUpGridScratch(torch.zeros(rows, latent, dtype=torch.bfloat16, device=device),
                            torch.zeros(rows * latent // (VEC * 32), dtype=torch.float32, device=device),
                            torch.zeros(2, dtype=torch.int32, device=device))


def can_implement(m: int, latent: int, n: int, world: int, dtypes: tuple[torch.dtype, ...],
                  warps: int = k_up.WARPS) -> bool:
    """moe_up's rules, 2 ≤ M ≤ 8, at most MAX_CTAS CTAs, and enough threads for one r vector
    each (CTAs · threads ≥ M · L / 8)."""
    if not (MIN_ROWS <= m <= MAX_ROWS and k_up.can_implement(m, latent, n, world, dtypes, warps)):
        return False
    ctas = n // warps
    return ctas <= MAX_CTAS and ctas * warps * 32 >= m * latent // VEC


class MoeUpGrid(k_up.MoeUp):
    """See the module docstring."""

    def __init__(self, cfg: k_up.MoeUpConfig) -> None:
        super().__init__(cfg)
        self.ctas = cfg.n // cfg.warps
        self.items = cfg.rows * self.nv                  # r vectors (phase 1 work items)
        self.wpr = self.nv // 32                         # warp partials per row
        assert self.nv % 32 == 0 and self.ctas * self.threads >= self.items, cfg
        assert MIN_ROWS <= cfg.rows <= MAX_ROWS and self.ctas <= MAX_CTAS, cfg
        # step 4 takes every row at once (xn of M ≤ 8 rows: ≤ 56 KB of shared memory at
        # L = 3584), not moe_up's chunks of 2: r is read back from rbuf, not held in registers
        self.chunk, self.chunks = cfg.rows, 1
        # the tensor-core dots: 8 warps (the mma's n), each warp's K range a whole number of
        # 4-vector groups (one 128-bit vector per lane quad member and step pair)
        self.mma = bool(DOTS_MMA and cfg.warps == MMA_WARPS and self.nv % (cfg.warps * 4) == 0)
        self.vw = self.nv // cfg.warps                   # 128-bit vectors of K per warp (56)
        self.nq = self.vw // 4                           # of them per lane (14)

    @cute.jit
    def __call__(self, r_slots: cute.Pointer, sh_slots: cute.Pointer, sh_full: cute.Pointer,
                 norm: cute.Pointer, up_rows: cute.Pointer, out: cute.Pointer, rbuf: cute.Pointer,
                 wss: cute.Pointer, sync: cute.Pointer, rank: Int32, eps: Float32,
                 stream: cuda.CUstream):
        m, L = self.cfg.rows, self.cfg.latent
        mR, mS, mF, mN, mW, mO = self.views(r_slots, sh_slots, sh_full, norm, up_rows, out)
        mRb = cute.make_tensor(rbuf, cute.make_layout((m, self.nv, VEC), stride=(L, VEC, 1)))
        mWs = cute.make_tensor(wss, cute.make_layout(m * self.wpr))
        mSy = cute.make_tensor(sync, cute.make_layout(2))
        # the up rows as [n, L / 8, 4] packed bf16 pairs (the mma's B fragments)
        mW32 = cute.make_tensor(cute.recast_ptr(up_rows, dtype=Int32),
                                cute.make_layout((self.cfg.n, self.nv, 4), stride=(L // 2, 4, 1)))
        self.kernel_grid(mR, mS, mF, mN, mW, mW32, mO, mRb, mWs, mSy, rank, eps).launch(
            grid=[self.ctas, 1, 1], block=[self.threads, 1, 1], stream=stream,
            use_pdl=chain.chain_on())

    @cute.jit
    def grid_barrier(self, mSy: cute.Tensor, tidx: Int32):
        """All CTAs of the grid: sense reversal on mSy = [counter, epoch] (mla_attend's)."""
        cute.arch.sync_threads()
        if tidx == 0:
            grid_arrive_and_wait(mSy, Int32(0), Int32(1), Int32(self.ctas))
        cute.arch.sync_threads()
        cute.arch.fence_acq_rel_gpu()

    @cute.kernel
    def kernel_grid(self, mR: cute.Tensor, mS: cute.Tensor, mF: cute.Tensor, mN: cute.Tensor,
                    mW: cute.Tensor, mW32: cute.Tensor, mO: cute.Tensor, mRb: cute.Tensor,
                    mWs: cute.Tensor, mSy: cute.Tensor, rank: Int32, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()          # all 32 lanes (a full-warp shuffle)
        lane = cute.arch.lane_idx()
        col = bidx * self.warps + warp       # < n: the grid is exactly n / warps CTAs
        M, world, nv = self.cfg.rows, self.cfg.world, self.nv
        C = self.chunk
        bf16 = mW.element_type

        smem = cutlass.memory.SmemAllocator()
        row_stride = nv * VEC + SX_PAD
        sX = smem.allocate_tensor(bf16, cute.make_layout((C, nv, VEC), stride=(row_stride, VEC, 1)),
                                  byte_alignment=16)
        sRstd = smem.allocate_tensor(Float32, cute.make_layout(M), byte_alignment=16)

        # 1. moe_up's steps 1-2: the weights into registers (the warp's column row, or with the
        #    tensor-core dots the mma's B fragments of the CTA's 8 columns over the warp's K
        #    range), the chain's wait, the shared partials
        wv = cute.make_rmem_tensor(cute.make_layout((self.nv_lane, VEC), stride=(VEC, 1)), bf16)
        wq = cute.make_rmem_tensor(cute.make_layout((self.nq, 4), stride=(4, 1)), Int32)
        shp = cute.make_rmem_tensor(cute.make_layout(M), Float32)
        shb = cute.make_rmem_tensor(cute.make_layout(M), bf16)
        if cutlass.const_expr(self.mma):
            self.fragments_and_shared(mS, mF, mW32, wq, shb, col, warp, lane, rank)
        else:
            self.row_and_shared(mS, mF, mW, wv, shp, col, lane, rank)

        # 2. phase 1: one r vector per thread, its Σ r², the warp's partial
        g = phase1_item(bidx, warp, lane, self.ctas, self.warps, PHASE1_SPREAD)
        buf = cute.make_rmem_tensor(cute.make_layout(VEC), bf16)
        rb = cute.make_rmem_tensor(cute.make_layout(VEC), bf16)
        acc8 = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
        ss = Float32(0.0)
        if g < self.items:
            row = g // nv
            c = g - row * nv
            acc8.fill(0.0)
            if cutlass.const_expr(SLOT_LOADS_FIRST):
                # every slot's vector in flight before the first add (same adds, same order)
                raw = cute.make_rmem_tensor(cute.make_layout((world, VEC), stride=(VEC, 1)), bf16)
                for s in cutlass.range_constexpr(world):
                    cute.autovec_copy(mR[s, row, c, None], raw[s, None])
                for s in cutlass.range_constexpr(world):
                    for e in cutlass.range_constexpr(VEC):
                        acc8[e] = acc8[e] + raw[s, e].to(Float32)
            else:
                for s in cutlass.range_constexpr(world):
                    cute.autovec_copy(mR[s, row, c, None], buf)
                    for e in cutlass.range_constexpr(VEC):
                        acc8[e] = acc8[e] + buf[e].to(Float32)
            for e in cutlass.range_constexpr(VEC):
                rb[e] = acc8[e].to(bf16)
                v = rb[e].to(Float32)
                ss += v * v
            cute.autovec_copy(rb, mRb[row, c, None])
        ss = cute.arch.warp_reduction_sum(ss)             # every lane, outside the branch
        wg = g // 32
        if lane == 0:
            if wg < M * self.wpr:
                mWs[wg] = ss

        # 3. every CTA's r and partials are written
        self.grid_barrier(mSy, tidx)

        # 4. all M rows in one pass: this thread's vectors of r (read back from rbuf) and of
        #    the norm weight issued together with the rstd partials' loads (one L2 round trip),
        #    rstd per row (the warps' partials in order), xn = bf16(r · rstd · norm) into
        #    shared memory, one barrier, then moe_up's dot products for every row
        rv = cute.make_rmem_tensor(cute.make_layout((M, self.it, VEC), stride=(self.it * VEC, VEC, 1)), bf16)
        nbuf = cute.make_rmem_tensor(cute.make_layout((self.it, VEC), stride=(VEC, 1)), mN.element_type)
        for i in cutlass.range_constexpr(self.it):
            c = tidx + i * self.threads
            if c < nv:
                cute.autovec_copy(mN[c, None], nbuf[i, None])
                for j in cutlass.range_constexpr(M):
                    cute.autovec_copy(mRb[j, c, None], rv[j, i, None])
        if tidx < M:
            tot = Float32(0.0)
            for w in cutlass.range_constexpr(self.wpr):
                tot += mWs[tidx * self.wpr + w]
            sRstd[tidx] = cute.math.rsqrt(tot / Float32(self.cfg.latent) + eps)
        cute.arch.sync_threads()
        xb = cute.make_rmem_tensor(cute.make_layout(VEC), bf16)
        for j in cutlass.range_constexpr(M):
            rstd = sRstd[j]
            for i in cutlass.range_constexpr(self.it):
                c = tidx + i * self.threads
                if c < nv:
                    for e in cutlass.range_constexpr(VEC):
                        xb[e] = (rv[j, i, e].to(Float32) * rstd * nbuf[i, e].to(Float32)).to(bf16)
                    cute.autovec_copy(xb, sX[j, c, None])
        cute.arch.sync_threads()
        if cutlass.const_expr(self.mma):
            sX32 = cute.make_tensor(cute.recast_ptr(sX.iterator, dtype=Int32),
                                    cute.make_layout((C, nv, 4), stride=(row_stride // 2, 4, 1)))
            self.dots_mma_and_store(mO, wq, sX32, shb, bidx, tidx, warp, lane)
        else:
            acc = cute.make_rmem_tensor(cute.make_layout(C), Float32)
            self.dots_and_store(mO, wv, sX, shp, acc, xb, 0, M, col, lane)

    @cute.jit
    def fragments_and_shared(self, mS: cute.Tensor, mF: cute.Tensor, mW32: cute.Tensor,
                             wq: cute.Tensor, shb: cute.Tensor, col: Int32, warp: Int32,
                             lane: Int32, rank: Int32):
        """Step 1 with the tensor-core dots: lane (g, t) = (lane / 4, lane mod 4) loads the
        128-bit vectors warp·vw + 4·i + t, i < nq, of column bidx·8 + g (the B fragments of
        2·nq mma steps; the 4 lanes of a quad read 64 contiguous bytes per load), all before
        the chain's wait; after it lane s < world keeps slot s's shared partial of column
        `col` for every row as bf16 (converted only in the epilogue, so no instruction waits
        for these loads before the slot sums are issued)."""
        M, n, world = self.cfg.rows, self.cfg.n, self.cfg.world
        g = lane // 4
        t = lane - g * 4
        wcol = (col - warp) + g                 # the CTA's first column + g
        for i in cutlass.range_constexpr(self.nq):
            cute.autovec_copy(mW32[wcol, warp * self.vw + 4 * i + t, None], wq[i, None])
        chain.enter()
        shb.fill(0.0)
        for mm in cutlass.range_constexpr(M):
            if lane < world:
                if lane == rank:
                    shb[mm] = mF[mm, rank * n + col]
                else:
                    shb[mm] = mS[lane, mm, col]

    @cute.jit
    def dots_mma_and_store(self, mO: cute.Tensor, wq: cute.Tensor, sX32: cute.Tensor,
                           shb: cute.Tensor, bidx: Int32, tidx: Int32, warp: Int32, lane: Int32):
        """Step 5 with the tensor-core dots: per warp 2·nq mma.m16n8k16 with A = xn (token g
        in row g, rows 8-15 zero), B = the CTA's 8 columns over the warp's K range, two
        accumulators (even / odd steps) added once; the warps' [8 tokens × 8 columns] partials
        meet in shared memory with each warp's shared-partial butterfly (its column), and
        thread m·8 + c < 8·M writes out[m, 8·bidx + c] = bf16(bf16(Σ_w partials in warp
        order) + bf16(shared))."""
        M = self.cfg.rows
        W = self.warps
        g = lane // 4
        t = lane - g * 4
        smem = cutlass.memory.SmemAllocator()
        sY = smem.allocate_tensor(Float32, cute.make_layout((W, 8, 8), stride=(64, 8, 1)), byte_alignment=16)
        sSh = smem.allocate_tensor(Float32, cute.make_layout((M, W), stride=(W, 1)), byte_alignment=16)
        xrow = cutlass.min(g, Int32(M - 1))     # tokens g ≥ M: a valid row, their sums unused
        acc0 = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        acc1 = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        acc0.fill(0.0)
        acc1.fill(0.0)
        xq = cute.make_rmem_tensor(cute.make_layout(4), Int32)
        zero = Int32(0)
        for i in cutlass.range_constexpr(self.nq):
            cute.autovec_copy(sX32[xrow, warp * self.vw + 4 * i + t, None], xq)
            mma_bf16(acc0, xq[0], zero, xq[1], zero, wq[i, 0], wq[i, 1])
            mma_bf16(acc1, xq[2], zero, xq[3], zero, wq[i, 2], wq[i, 3])
        sY[warp, g, 2 * t] = acc0[0] + acc1[0]
        sY[warp, g, 2 * t + 1] = acc0[1] + acc1[1]
        for j in cutlass.range_constexpr(M):
            sh = cute.arch.warp_reduction_sum(shb[j].to(Float32))
            if lane == 0:
                sSh[j, warp] = sh
        cute.arch.sync_threads()
        if tidx < M * 8:
            m = tidx // 8
            c = tidx - m * 8
            y = Float32(0.0)
            for w in cutlass.range_constexpr(W):
                y += sY[w, m, c]
            shared = sSh[m, c].to(mO.element_type).to(Float32)
            mO[m, bidx * W + c] = (y.to(mO.element_type).to(Float32) + shared).to(mO.element_type)


def compile_for(cfg: k_up.MoeUpConfig) -> object:
    """The compiled kernel for `cfg` (cached; compiles to sm_90a PTX even without a GPU)."""
    def build() -> object:
        bf = dummy_ptr(torch.bfloat16)
        return cute.compile(MoeUpGrid(cfg), bf, bf, bf, bf, bf, bf, bf, dummy_ptr(torch.float32),
                            dummy_ptr(torch.int32), Int32(0), Float32(1e-5), current_stream(),
                            options=compile_options())
    return compiled(("moe_up_grid", cfg, DOTS_MMA, SLOT_LOADS_FIRST, PHASE1_SPREAD), build)


def moe_up_grid(r_slots: torch.Tensor, sh_slots: torch.Tensor, sh_full: torch.Tensor, rank: int,
                latent_norm: torch.Tensor, up_rows: torch.Tensor, eps: float, scratch: MoeUpGridScratch,
                out: torch.Tensor | None = None, *, warps: int = k_up.WARPS) -> torch.Tensor:
    """moe_up (same arguments and result, kernels/moe_up.py) for 2 ≤ M ≤ 8, with `scratch`
    from make_scratch(M, L) (one per call site: two launches in flight must not share it)."""
    m, L, n, world, out = k_up.checked_args("moe_up_grid", can_implement, r_slots, sh_slots, sh_full, rank,
                                            latent_norm, up_rows, out, warps)
    if (tuple(scratch.rbuf.shape) != (m, L) or scratch.wss.numel() != m * L // (VEC * 32)
            or scratch.sync.numel() != 2 or scratch.sync.dtype != torch.int32):
        raise ValueError(f"moe_up_grid scratch is not make_scratch({m}, {L})")
    compile_for(k_up.MoeUpConfig(m, L, n, world, warps))(
        ptr(r_slots), ptr(sh_slots), ptr(sh_full), ptr(latent_norm), ptr(up_rows), ptr(out),
        ptr(scratch.rbuf), ptr(scratch.wss), ptr(scratch.sync), Int32(rank), Float32(eps), current_stream())
    return out


def emulate(r_slots: torch.Tensor, sh_slots: torch.Tensor, sh_full: torch.Tensor, rank: int,
            latent_norm: torch.Tensor, up_rows: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel's rounding points in torch (CPU tests): r = bf16(fp32 slot sum), Σ r² per warp
    of 32 vectors then in warp order, xn = bf16(r · rstd · norm), y = bf16(fp32 dot), shared =
    bf16(fp32 sum), out = bf16(y + shared)."""
    m = r_slots.shape[1]
    r = r_slots.float().sum(0).bfloat16().float()                          # [M, L]
    ss = (r * r).reshape(m, -1, VEC * 32).sum(-1).sum(-1)                  # warp partials, in order
    return k_up.emulate_tail(r, ss, sh_slots, sh_full, rank, latent_norm, up_rows, eps)


def check(timing: bool = True) -> list[dict]:
    """Kernel vs moe_up (the M ≤ 8 kernel it replaces in the per-M table), the stock ops and the
    float64 reference at K3 TP16 shapes, M ∈ {2, 4, 8}, rank ∈ {0, 5}, both slot cases of
    moe_up's check; `out=` into an all-gather slot leaves the other slots untouched; 3 repeated
    calls and 3 CUDA-graph replays give the same output and leave the barrier's counter zero
    (its epoch advanced once per call). Timing (simcomm, rank 0): stock collectives + OpSet.up,
    moe_up, and this kernel."""
    from kimi_decode.comm import SimComm
    from kimi_decode.kernels.checks import DEVICE, _sync, rel, time_us
    dev = torch.device(DEVICE)
    out = []
    scratches: dict[int, MoeUpGridScratch] = {}
    for c in k_up.check_cases((2, 4, 8), 2000, dev):
        m, rank, case, args = c.m, c.rank, c.case, c.args
        if m not in scratches:   # one per M, reused by every row (its barrier must survive calls)
            scratches[m] = make_scratch(m, c.r_slots.shape[-1], dev)
        scratch = scratches[m]
        with torch.no_grad():
            y_s = k_up.stock(*args)
            y_op = k_up.stock(*args, c.ops.up)
            y_one = k_up.moe_up(*args)
            epoch0 = int(scratch.sync[1])
            y_k = moe_up_grid(*args, scratch)
            reps = [moe_up_grid(*args, scratch) for _ in range(3)]
            dst = torch.full((c.world, m, c.n), 7.0, dtype=torch.bfloat16, device=dev)
            moe_up_grid(*args, scratch, out=dst[rank])
        _sync()
        calls = 5
        ref = k_up.reference(*args)
        e_ks, e_kop, e_k, e_s = rel(y_k, y_s), rel(y_k, y_op), rel(y_k, ref), rel(y_s, ref)
        others = torch.cat([dst[:rank], dst[rank + 1:]])
        row = {"kernel": "moe_up_grid", "M": m, "rank": rank, "case": case,
               "rel_vs_stock": e_ks, "rel_vs_stock_op": e_kop, "rel_vs_moe_up": rel(y_k, y_one),
               "rel_vs_f64": e_k, "stock_rel_vs_f64": e_s,
               "repeat_equal": all(torch.equal(y, y_k) for y in reps),
               "out_slot_ok": torch.equal(dst[rank], y_k) and bool((others == 7.0).all()),
               "counter_zero": int(scratch.sync[0]) == 0,
               "epoch_advanced": int(scratch.sync[1]) - epoch0 == calls}
        if DEVICE == "cuda" and case == "all_slots" and rank == 5:
            row["graph_replays_equal"] = k_up.graph_replays_equal(
                lambda o: moe_up_grid(*args, scratch, out=o), y_k)
            row["counter_zero"] = row["counter_zero"] and int(scratch.sync[0]) == 0
        row["ok"] = bool(e_ks <= 1e-2 and e_kop <= 1e-2 and rel(y_k, y_one) <= 1e-2
                         and e_k <= 1.5 * e_s + 1e-3 and row["repeat_equal"] and row["out_slot_ok"]
                         and row["counter_zero"] and row["epoch_advanced"]
                         and row.get("graph_replays_equal", True))
        if timing and case == "simcomm" and rank == 0 and DEVICE == "cuda":
            comm = SimComm(dev, c.world, rank)
            r_s, sh_s = comm.all_reduce(c.r_loc), comm.reduce_scatter_cols(c.sh_loc)
            with torch.no_grad():
                row["stock_us"] = time_us(lambda: c.stock_call(comm))
                row["stock_up_only_us"] = time_us(lambda: c.ops.up(r_s, c.norm, c.up_rows, sh_s, c.eps))
                row["moe_up_us"] = time_us(lambda: k_up.moe_up(*args, out=dst[rank]))
                row["kernel_us"] = time_us(lambda: moe_up_grid(*args, scratch, out=dst[rank]))
            row["counter_zero_after_timing"] = int(scratch.sync[0]) == 0
            row["ok"] = row["ok"] and row["counter_zero_after_timing"]
        out.append(row)
    return out


if __name__ == "__main__":
    for r in check():
        print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()})
