"""MoE router in one kernel, faster than `router.py` at M ≤ 8: fp32 GEMV + sigmoid +
correction-bias top-k + renormalise (KIMI_K3.md §1.6 step 1), a drop-in for `router.route`.

Math (identical to router.py, every intermediate fp32, no bf16 rounding anywhere unless
`logits_bf16`):
    logits[m, e] = Σ_q Σ_{d in quarter q} y[m, d] · W_gate[e, d]   bf16 products, fp32 sums
                   (each quarter of D summed per lane, then by a warp butterfly, then the 4
                   quarters added in order q = 0..3); rounded to bf16 and back iff logits_bf16
    s = sigmoid(logits) = 1 / (1 + exp(-logits))                   fp32
    key = s + bias                                                 fp32, selects only
    ids[m] = the top_k experts by key, descending; ties → lower expert index
    w[m, j] = s[m, ids[m, j]] / Σ_j s[m, ids[m, j]] · routed_scaling
              (the sum taken in the output order j = 0..k-1, as router.py does)
Outputs as router.route: ids int64 [M, k], weights fp32 [M, k], ordered by key descending.

Why router.py is slow (21.6 µs at M = 1 on the H200, W_gate 12.8 MB → 3.4 µs floor):
- its GEMV runs E/8 = 112 CTAs (fewer than the 132 SMs) of one warp per expert, each lane
  streaming the whole 14 KB row: one CTA per SM, 20 SMs idle;
- its tail top-k (one warp per row, in the one CTA that finishes last) is 16 serial rounds of
  a 28-long lane-local argmax chain + a 10-shuffle butterfly argmax + a 28-long owner scan:
  ~16 × 500 cycles ≈ 4-5 µs of pure latency after the grid is done.

This kernel (one launch, grid E/EPC = 448 CTAs of 256 threads, ≤ 64 registers and ~18.5 KB
shared memory each, .minnctapersm 4 → all 448 resident at once on 132 SMs):
- GEMV: each expert row is split over KSPLIT = 4 warps (a quarter of D each, 7 × 128-bit
  slices per lane, all 7 weight loads issued before the first FMA), EPC = 2 experts per CTA
  of 8 warps: 7 KB of W_gate in flight per CTA, ~24 KB per SM, on all 132 SMs. Warp partial
  sums go to shared memory; after a CTA barrier, thread t < EPC·M adds the 4 quarters of
  (row t // EPC, expert t % EPC) in order q = 0..3 and stores the fp32 logit to a scratch
  [M, E] buffer.
- Grid completion: exactly router.py's pattern (store; fence.acq_rel.gpu; bar.sync; thread 0
  fence + atom.add.acq_rel.gpu on the counter; the CTA that reads gridDim-1 does the top-k and
  writes the counter back to 0 so CUDA-graph replays find it zeroed).
- Top-k (last CTA, one warp per row, rows over the 8 warps), no serial rounds. Lane l holds
  the keys of experts l + 32 i (i < E/32 = 28) in registers. Lower bound of the k-th largest
  key: groups of 2^group_bits adjacent lanes (the fewest lanes that still leave ≥ k groups:
  2 lanes, 16 groups of 56 experts for k = 16) take their maximum (an fmax tree, then
  butterflies); lo = the minimum of the group maxima. The ≥ k group maxima are distinct
  experts with key ≥ lo, so the k-th largest key is ≥ lo and every top-k expert has
  key ≥ lo. Candidates (key ≥ lo: ~50 of 896 for K3-like sigmoid keys, max ~125 in 256
  random rows) are compacted into shared memory (CAP = 256 per warp) at offsets from a warp
  prefix sum (shfl.up); each candidate's exact rank is counted against all candidates:
  rank = #{j : key_j > key_c or (key_j == key_c and id_j < id_c)}. Every expert that
  outranks a candidate is itself a candidate, so this is its global rank; ranks < k write
  their id to slot `rank` (ranks are distinct). More than CAP candidates (massive ties): an
  exact fallback, router.py's k rounds of butterfly argmax, where round r takes the best
  element strictly below round r-1's winner in (key desc, id asc) order.
  Finally lane j < k recomputes s_j = sigmoid(logit[id_j]) (the same fp32 formula as the
  key's s), total = Σ_j s_j in the order j = 0..k-1, w_j = s_j / total · scaling.
Expected at M = 1: ~3.5-4 µs GEMV (12.8 MB at 3.3-3.7 TB/s) + ~0.5 µs grid tail + ~1 µs top-k
(logits from L2, 9 + 5 + 1 shuffles, a ~50-step rank loop unrolled 8 deep by the compiler)
≈ 5-6 µs in a CUDA graph. At M = 8 the 8 rows run their top-k on the 8 warps in parallel;
the GEMV then reads y 8 × from L1 per weight slice (as router.py does, but on all SMs).

Check on the GPU (against the stock router ops and router.py; times all three):
    python -m kimi_decode.kernels.router_fast
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
from kimi_decode.kernels import router as _slow
from kimi_decode.kernels._common import (arrive_count, compile_options, compiled, current_stream, dummy_ptr, ptr,
                                         sigmoid)

VEC = 8
WARPS = 8
KSPLIT = 4                 # warps per expert row (quarters of D)
EPC = WARPS // KSPLIT      # experts per CTA
CAP = 256                  # candidates per row kept in shared memory (more: exact fallback)
MAX_ROWS = 8               # this kernel's M range; above, route() delegates to router.route
GEMV_MAX_ROWS = _slow.GEMV_MAX_ROWS  # the wrapper contract: logits needed only above this
NEG = -3.0e38
MIN_CTAS = 4               # .minnctapersm: ≤ 64 registers, so all E/EPC = 448 CTAs are resident at once
# Logits staged in shared memory by the last CTA when M·E is at most this (M ≤ 2 at E = 896:
# 7-14 KB more per CTA). Measured on the H200 (Nsight Compute, fused B = 1 step, 2026-12-02):
# reading them from global memory inside topk_row left one SM working 15 of the kernel's
# 20.8 us after the others were done (41 K elapsed cycles, 10.9 K SM-active on average): under
# the 64-register cap the 28 logit + 28 bias loads per lane issue one after another, each a
# full L2 round trip, between the sigmoids.
STAGE_MAX_LOGITS = 2048
# The routing sync buffer (int32 [SYNC_WORDS], zero at creation) of the MoE front with
# `publish_ready` (gemv_multi.route_and_project at M = 1, moe_experts.FC1_EARLY_IDS): word 0 is
# the router CTAs' arrival counter (the `counter` every router kernel takes), word READY_WORD
# the ids-ready flag the top-k CTA raises once ids and weights are written, word
# FC1_DONE_WORD the arrival counter of the FC1 CTAs that read the flag (the last re-zeroes the
# flag and itself). Each in its own 128-byte line, so FC1's polls of the flag do not queue
# behind the counters' atomics.
READY_WORD = 32
FC1_DONE_WORD = 64
SYNC_WORDS = 96
SMEM_CARVEOUT = 50         # percent of the SM's 228 KB as shared memory (4 CTAs × ~19 KB); set
                           # explicitly, else with min_blocks_per_mp > 1 the DSL queries the
                           # device while compiling (no GPU in CI)


@dataclass(frozen=True)
class RouterFastConfig:
    """Compile-time choices (M is compile-time: one fp32 accumulator per row per lane)."""

    hidden: int
    experts: int
    top_k: int
    rows: int
    scaling: float = 1.0
    logits_bf16: bool = False
    # raise the routing sync buffer's ids-ready flag after the top-k (the counter argument is
    # then that buffer, SYNC_WORDS long; see READY_WORD)
    publish_ready: bool = False

    @property
    def group_bits(self) -> int:
        """log2 of the lanes per group for the lower bound: 32 / 2^bits groups ≥ top_k."""
        b = 0
        while (32 >> (b + 1)) >= self.top_k:
            b += 1
        return b


def can_implement(hidden: int, experts: int, top_k: int, dtypes: tuple[torch.dtype, ...]) -> bool:
    """D splits into KSPLIT quarters of whole 32-lane 128-bit passes; E splits over 32 lanes
    and EPC experts per CTA; k fits one warp; bf16 operands."""
    return (experts % 32 == 0 and experts % EPC == 0 and 1 <= experts // 32 <= 64
            and 1 <= top_k <= 32 and top_k <= experts and hidden % (VEC * 32 * KSPLIT) == 0
            and all(d == torch.bfloat16 for d in dtypes))


class RouterFast:
    """See the module docstring."""

    def __init__(self, cfg: RouterFastConfig) -> None:
        self.cfg = cfg
        self.D, self.E, self.K = cfg.hidden, cfg.experts, cfg.top_k
        self.per_lane = cfg.experts // 32
        self.slices = cfg.hidden // (VEC * 32 * KSPLIT)   # 128-bit loads per lane (7 at K3)
        # the last CTA copies the logits and the bias to shared memory before its top-k (small M)
        self.stage = cfg.rows * cfg.experts <= STAGE_MAX_LOGITS

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
        self.kernel(mY, mW, mB, mL, mC, mI, mO, m).launch(
            grid=[self.E // EPC, 1, 1], block=[WARPS * 32, 1, 1], stream=stream,
            min_blocks_per_mp=MIN_CTAS, preferred_smem_carveout=SMEM_CARVEOUT)

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mW: cute.Tensor, mB: cute.Tensor, mL: cute.Tensor,
               mC: cute.Tensor, mI: cute.Tensor, mO: cute.Tensor, m: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp = cute.arch.warp_idx()          # all lanes, top level (a full-warp shuffle)
        lane = cute.arch.lane_idx()
        red, flag, cK, cI, selI, selS, sL, sB = self.smem_tensors()
        self.gemv_cta(mY, mW, mL, red, bidx, tidx, warp, lane, False)
        self.complete(mL, mB, mC, mI, mO, flag, cK, cI, selI, selS, sL, sB, gdim, m, tidx, warp, lane)

    def smem_tensors(self) -> tuple:
        """The kernel's shared memory, in allocation order: red (warp partial sums), flag
        (the counter value this CTA read), cK/cI (top-k candidates), selI/selS (winners), and
        when staging sL/sB (the logits and the bias for the top-k; else None, None).
        Called inside a kernel (gemv_multi.py's router segment allocates the same)."""
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout((self.cfg.rows, WARPS), stride=(WARPS, 1)), 16)
        flag = smem.allocate_tensor(Int32, cute.make_layout(1), 16)
        cK = smem.allocate_tensor(Float32, cute.make_layout((WARPS, CAP), stride=(CAP, 1)), 16)
        cI = smem.allocate_tensor(Int32, cute.make_layout((WARPS, CAP), stride=(CAP, 1)), 16)
        selI = smem.allocate_tensor(Int32, cute.make_layout((WARPS, 32), stride=(32, 1)), 16)
        selS = smem.allocate_tensor(Float32, cute.make_layout((WARPS, 32), stride=(32, 1)), 16)
        if cutlass.const_expr(self.stage):
            sL = smem.allocate_tensor(Float32, cute.make_layout((self.cfg.rows, self.E), stride=(self.E, 1)), 16)
            sB = smem.allocate_tensor(Float32, cute.make_layout(self.E), 16)
            return red, flag, cK, cI, selI, selS, sL, sB
        return red, flag, cK, cI, selI, selS, None, None

    @cute.jit
    def gemv_cta(self, mY: cute.Tensor, mW: cute.Tensor, mL: cute.Tensor, red: cute.Tensor,
                 bidx: Int32, tidx: Int32, warp: Int32, lane: Int32,
                 enter_after_loads: cutlass.Constexpr[bool]):
        """This CTA's EPC logits for every row: warp = (expert el of the CTA, quarter q of D).
        enter_after_loads (gemv_multi's router CTAs in the PDL chain, ROUTER_PRE_WAIT there):
        the chain's wait and release right after the weight loads are issued, so W_gate (a
        constant) streams while the previous kernel runs; y is read only after the wait."""
        rows = self.cfg.rows
        el = warp // KSPLIT
        q = warp % KSPLIT
        e = bidx * EPC + el                  # < E: grid = E / EPC
        wv = cute.make_rmem_tensor(cute.make_layout((self.slices, VEC), stride=(VEC, 1)), mW.element_type)
        yv = cute.make_rmem_tensor(cute.make_layout(VEC), mY.element_type)
        acc = cute.make_rmem_tensor(cute.make_layout(rows), Float32)
        acc.fill(0.0)
        base = q * (self.slices * 32) + lane
        for i in cutlass.range_constexpr(self.slices):         # all weight loads in flight first
            cute.autovec_copy(mW[e, base + i * 32, None], wv[i, None])
        if cutlass.const_expr(enter_after_loads):
            chain.enter()
        for i in cutlass.range_constexpr(self.slices):
            c = base + i * 32                                     # < D / VEC
            for r in cutlass.range_constexpr(rows):
                cute.autovec_copy(mY[r, c, None], yv)
                for j in cutlass.range_constexpr(VEC):
                    acc[r] = acc[r] + wv[i, j].to(Float32) * yv[j].to(Float32)
        for r in cutlass.range_constexpr(rows):
            tot = cute.arch.warp_reduction_sum(acc[r])          # all lanes
            if lane == 0:
                red[r, warp] = tot
        cute.arch.sync_threads()
        if tidx < EPC * rows:                                   # warp 0 only (EPC·M ≤ 16)
            rr = tidx // EPC
            ee = tidx % EPC
            s = red[rr, ee * KSPLIT]
            for qq in cutlass.range_constexpr(1, KSPLIT):
                s = s + red[rr, ee * KSPLIT + qq]
            if cutlass.const_expr(self.cfg.logits_bf16):
                s = s.to(cutlass.BFloat16).to(Float32)
            mL[rr, bidx * EPC + ee] = s
            cute.arch.fence_acq_rel_gpu()    # this thread's logits before the CTA's counter bump

    @cute.jit
    def complete(self, mL: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mI: cute.Tensor,
                 mO: cute.Tensor, flag: cute.Tensor, cK: cute.Tensor, cI: cute.Tensor,
                 selI: cute.Tensor, selS: cute.Tensor, sL: cute.Tensor | None, sB: cute.Tensor | None,
                 ctas: Int32, m: Int32, tidx: Int32, warp: Int32, lane: Int32):
        """Grid completion (router.py's pattern) over the `ctas` router CTAs: the last one to
        bump the counter runs the top-k of every row and re-zeroes the counter. With staging
        (sL, sB given) its 256 threads first copy the M×E logits and the bias to shared memory
        (coalesced, all loads independent: one L2 round trip), then the top-k reads them there."""
        arrive_count(mC, flag, tidx)
        if flag[0] == ctas - 1:                                 # CTA-uniform
            cute.arch.fence_acq_rel_gpu()
            if cutlass.const_expr(self.stage):
                n_l = self.cfg.rows * self.E
                for i in cutlass.range_constexpr((n_l + WARPS * 32 - 1) // (WARPS * 32)):
                    t = tidx + i * (WARPS * 32)
                    if t < n_l:
                        r_ = t // self.E
                        sL[r_, t - r_ * self.E] = mL[r_, t - r_ * self.E]
                for i in cutlass.range_constexpr((self.E + WARPS * 32 - 1) // (WARPS * 32)):
                    t = tidx + i * (WARPS * 32)
                    if t < self.E:
                        sB[t] = mB[t]
                cute.arch.sync_threads()
                for row in range(warp, m, WARPS):               # warp-uniform
                    self.topk_row(sL, sB, mI, mO, cK, cI, selI, selS, row, warp, lane)
            else:
                for row in range(warp, m, WARPS):               # warp-uniform
                    self.topk_row(mL, mB, mI, mO, cK, cI, selI, selS, row, warp, lane)
            if tidx == 0:
                mC[0] = Int32(0)
            if cutlass.const_expr(self.cfg.publish_ready):
                # ids and weights (written by the top-k warps above) before the flag: each
                # thread fences its own stores, the barrier orders them before thread 0's
                # release (arrive_count's pattern); FC1 reads the flag with acquire
                cute.arch.fence_acq_rel_gpu()
                cute.arch.sync_threads()
                if tidx == 0:
                    cute.arch.atomic_add(mC.iterator + READY_WORD, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def topk_row(self, mL: cute.Tensor, mB: cute.Tensor, mI: cute.Tensor, mO: cute.Tensor,
                 cK: cute.Tensor, cI: cute.Tensor, selI: cute.Tensor, selS: cute.Tensor,
                 row: Int32, warp: Int32, lane: Int32):
        """Sigmoid, biased top-k, renormalised unbiased weights for one row (one warp).
        Only the keys live in registers (28 per lane); the k winners' s are recomputed from
        their logits at the end (the same fp32 formula, so the same values)."""
        P = self.per_lane
        key = cute.make_rmem_tensor(cute.make_layout(P), Float32)
        for i in cutlass.range_constexpr(P):
            e = lane + i * 32                                   # < E
            key[i] = sigmoid(mL[row, e].to(Float32)) + mB[e]
        # lane maximum (a tree), group maximum, then the minimum over the groups: lo
        lo = _tree_max([key[i] for i in range(P)])
        for sh in cutlass.range_constexpr(self.cfg.group_bits):
            lo = cute.arch.fmax(lo, cute.arch.shuffle_sync_bfly(lo, offset=1 << sh))
        for sh in cutlass.range_constexpr(self.cfg.group_bits, 5):
            lo = cute.arch.fmin(lo, cute.arch.shuffle_sync_bfly(lo, offset=1 << sh))
        # candidates: key >= lo; exclusive prefix of the per-lane counts
        cnt = Int32(0)
        for i in cutlass.range_constexpr(P):
            if key[i] >= lo:
                cnt = cnt + 1
        incl = cnt
        for sh in cutlass.range_constexpr(5):
            v = cute.arch.shuffle_sync_up(incl, offset=1 << sh)
            if lane >= (1 << sh):
                incl = incl + v
        n = cute.arch.shuffle_sync(incl, offset=31)             # warp-uniform
        if lane < self.K:
            selI[warp, lane] = Int32(0)     # every slot defined even if NaN keys leave n < k
        cute.arch.sync_warp()               # before any lane writes a winner into selI
        if n <= CAP:
            pos = incl - cnt
            for i in cutlass.range_constexpr(P):
                if key[i] >= lo:
                    cK[warp, pos] = key[i]                      # pos < n ≤ CAP
                    cI[warp, pos] = lane + i * 32
                    pos = pos + 1
            cute.arch.sync_warp()
            for c in range(lane, n, 32):
                kc = cK[warp, c]
                ic = cI[warp, c]
                rank = Int32(0)
                for jj in range(n):
                    kj = cK[warp, jj]
                    ij = cI[warp, jj]
                    if kj > kc or (kj == kc and ij < ic):
                        rank = rank + 1
                if rank < self.K:
                    selI[warp, rank] = ic                       # ranks are distinct
        else:
            self.topk_rounds(key, selI, warp, lane)
        cute.arch.sync_warp()
        # the k winners: s recomputed from the logits, sum in output order, store
        if lane < self.K:
            win = selI[warp, lane]
            if win < 0 or win >= self.E:                        # only with NaN keys
                win = Int32(0)
                selI[warp, lane] = win
            selS[warp, lane] = sigmoid(mL[row, win].to(Float32))
        cute.arch.sync_warp()
        if lane < self.K:
            total = Float32(0.0)
            for r in cutlass.range_constexpr(self.K):
                total += selS[warp, r]
            mI[row, lane] = selI[warp, lane].to(cutlass.Int64)
            mO[row, lane] = selS[warp, lane] / total * Float32(self.cfg.scaling)
        cute.arch.sync_warp()                                   # smem reused by the next row

    @cute.jit
    def topk_rounds(self, key: cute.Tensor, selI: cute.Tensor, warp: Int32, lane: Int32):
        """Fallback for > CAP candidates: router.py's k rounds of warp argmax (value, then
        lower index), exact and slower. Instead of masking winners, round r takes the best
        element strictly below round r-1's winner in the (key desc, index asc) order, so the
        key registers stay read-only. selI[warp, r] = round r's winner."""
        pk = Float32(3.0e38)
        pi = Int32(-1)
        for r in cutlass.range_constexpr(self.K):
            bv = Float32(NEG)
            bi = Int32(self.E)
            for i in cutlass.range_constexpr(self.per_lane):
                e = lane + i * 32
                if (key[i] < pk or (key[i] == pk and e > pi)) and key[i] > bv:
                    bv = key[i]
                    bi = e
            for sh in cutlass.range_constexpr(5):
                ov = cute.arch.shuffle_sync_bfly(bv, offset=1 << sh)
                oi = cute.arch.shuffle_sync_bfly(bi, offset=1 << sh)
                if ov > bv or (ov == bv and oi < bi):
                    bv = ov
                    bi = oi
            pk = bv
            pi = bi
            if lane == 0:
                selI[warp, r] = bi


def _tree_max(vals: list) -> Float32:
    """Maximum of trace-time values as a balanced tree of fmax (depth log2 n, not n): plain
    Python at trace time, outside the DSL's control-flow rewriting."""
    while len(vals) > 1:
        nxt = [cute.arch.fmax(vals[t], vals[t + 1]) for t in range(0, len(vals) - 1, 2)]
        if len(vals) % 2:
            nxt.append(vals[-1])
        vals = nxt
    return vals[0]


def compile_for(cfg: RouterFastConfig) -> object:
    """The compiled kernel for `cfg` (cached)."""
    def build() -> object:
        bf, f32 = dummy_ptr(torch.bfloat16), dummy_ptr(torch.float32)
        i32, i64 = dummy_ptr(torch.int32), dummy_ptr(torch.int64)
        return cute.compile(RouterFast(cfg), bf, bf, f32, f32, i32, i64, f32, Int32(cfg.rows),
                            current_stream(), options=compile_options())
    return compiled(("router_fast", cfg), build)


def route(y: torch.Tensor, w_gate: torch.Tensor, bias: torch.Tensor, top_k: int,
          scaling: float, counter: torch.Tensor, logits: torch.Tensor | None = None,
          logits_bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for router.route (same arguments, outputs and contract): y [M, D] bf16,
    w_gate [E, D] bf16, bias [E] fp32, counter a zeroed int32 [1] buffer (left zeroed);
    logits [M, E] fp32 used when M > GEMV_MAX_ROWS. M ≤ MAX_ROWS runs this kernel (logits
    ignored, as router.route ignores them there); larger M delegates to router.route.
    Returns (ids [M, k] int64, weights [M, k] fp32), ordered by biased score, descending."""
    m, d = y.shape
    e = w_gate.shape[0]
    if m > MAX_ROWS or m < 1:
        return _slow.route(y, w_gate, bias, top_k, scaling, counter, logits=logits, logits_bf16=logits_bf16)
    if (not can_implement(d, e, top_k, (y.dtype, w_gate.dtype)) or bias.dtype != torch.float32
            or w_gate.shape[1] != d or bias.numel() != e):
        raise ValueError(f"router_fast kernel cannot run D={d} E={e} k={top_k}")
    cfg = RouterFastConfig(d, e, top_k, m, float(scaling), logits_bf16)
    scratch = torch.empty(m, e, dtype=torch.float32, device=y.device)
    ids = torch.empty(m, top_k, dtype=torch.int64, device=y.device)
    weights = torch.empty(m, top_k, dtype=torch.float32, device=y.device)
    compile_for(cfg)(ptr(y), ptr(w_gate), ptr(bias), ptr(scratch), ptr(counter), ptr(ids),
                     ptr(weights), Int32(m), current_stream())
    return ids, weights


# The float64 statement is router.py's: same selection semantics, one definition.
reference = _slow.reference


def emulate_select(key: torch.Tensor, s: torch.Tensor, top_k: int, scaling: float,
                   group_bits: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The kernel's top-k algorithm for one row in torch (lane l holds experts l + 32 i):
    lower bound from group maxima, candidates, exact ranks. Returns (ids, weights, n)."""
    e = key.numel()
    lane_max = key.view(e // 32, 32).amax(0)                          # [32]
    g = 1 << group_bits
    lo = lane_max.view(32 // g, g).amax(1).amin()
    cand = torch.nonzero(key >= lo).flatten()
    kc = key[cand]
    outranks = (kc[None, :] > kc[:, None]) | ((kc[None, :] == kc[:, None]) & (cand[None, :] < cand[:, None]))
    rank = outranks.sum(1)
    order = torch.argsort(rank)
    sel = cand[order][rank[order] < top_k]
    w = s[sel]
    total = torch.zeros((), dtype=s.dtype)
    for v in w:                                                      # the kernel's order
        total = total + v
    return sel, w / total * scaling, int(cand.numel())


def agreement(ids_a: torch.Tensor, w_a: torch.Tensor, ids_b: torch.Tensor,
              w_b: torch.Tensor) -> tuple[float, float]:
    """Two routings of the same rows compared: (the fraction of rows with the same expert
    set, the largest weight difference of an expert over those rows; 0 when none agree).
    Shared by the router checks (router_fast, router_mma, router_topk)."""
    ids_b, w_b = ids_b.to(ids_a.device), w_b.to(ids_a.device)
    same = (ids_a.sort(-1).values == ids_b.sort(-1).values).all(-1)
    e = int(max(int(ids_a.max()), int(ids_b.max()))) + 1
    da = torch.zeros(ids_a.shape[0], e, device=ids_a.device, dtype=torch.float64).scatter_(1, ids_a, w_a.double())
    db = torch.zeros(ids_a.shape[0], e, device=ids_a.device, dtype=torch.float64).scatter_(1, ids_b, w_b.double())
    err = float((da - db)[same].abs().max()) if bool(same.any()) else 0.0
    return float(same.float().mean()), err


def selection_facts(ids: torch.Tensor, w: torch.Tensor, ids2: torch.Tensor, w2: torch.Tensor,
                    key_ref: torch.Tensor, top_k: int) -> dict:
    """What the router checks (router_mma, router_topk) assert of a kernel's routing besides
    its agreement: `near_ties_f64`, the rows whose k-th and (k+1)-th float64 reference keys
    are within 1e-5 (fp32 summation noise may choose either: a near-tie row may differ);
    `repeat_equal`, a second call bit-equal; `dropin_types`, router.route's dtypes and shapes;
    `descending`, ids in descending reference-key order (1e-5 slack)."""
    m = ids.shape[0]
    top = key_ref.topk(top_k + 1, dim=-1).values
    key_k = key_ref.to(ids.device).gather(1, ids)
    return {"near_ties_f64": int(((top[:, top_k - 1] - top[:, top_k]) < 1e-5).sum()),
            "repeat_equal": bool(torch.equal(ids, ids2) and torch.equal(w, w2)),
            "dropin_types": ids.dtype == torch.int64 and w.dtype == torch.float32
                            and tuple(ids.shape) == (m, top_k) and tuple(w.shape) == (m, top_k),
            "descending": bool((key_k[:, :-1] >= key_k[:, 1:] - 1e-5).all())}


def check(timing: bool = True, rows: tuple[int, ...] = (1, 8)) -> list[dict]:
    """GPU check in the style of checks.check_router: kernel vs the stock routing ops on the
    stock GEMM's fp32 logits (rows_same_experts ≥ 0.99, max_weight_err ≤ 1e-3, counter back
    to 0), the float64 reference (expert sets), and router.route; times stock, router.route
    and this kernel (CUDA-graph replays)."""
    from kimi_decode import stock_ops
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels.checks import DEVICE, _sync, router_weights, stock_router, time_us
    cfg = k3_tp16()
    dev = torch.device(DEVICE)
    w_gate, bias = router_weights(cfg, dev, "check.router")
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    counter_slow = torch.zeros(1, dtype=torch.int32, device=dev)
    stock_route = stock_router(cfg, w_gate, bias)
    out = []
    for m in rows:
        y = torch.randn(m, cfg.hidden, generator=torch.Generator(device=dev).manual_seed(m), device=dev)
        y = torch.nn.functional.rms_norm(y, (cfg.hidden,)).bfloat16()
        logits = torch.mm(y.float(), w_gate.float().t())                               # fp32
        given = None if m <= GEMV_MAX_ROWS else logits
        with torch.no_grad():
            ids_s, w_s = stock_ops.route(logits, bias, cfg.top_k, cfg.routed_scaling)
            ids_k, w_k = route(y, w_gate, bias, cfg.top_k, cfg.routed_scaling, counter, logits=given)
        _sync()
        ids_r, w_r, _ = reference(y.cpu(), w_gate.cpu(), bias.cpu(), cfg.top_k, cfg.routed_scaling)
        ids_r, w_r = ids_r.to(dev), w_r.to(dev)

        with torch.no_grad():
            ids_p, w_p = _slow.route(y, w_gate, bias, cfg.top_k, cfg.routed_scaling, counter_slow, logits=given)
        _sync()
        agree, werr = agreement(ids_k, w_k, ids_s, w_s)
        agree_f64, werr_f64 = agreement(ids_k, w_k, ids_r, w_r)
        agree_py, werr_py = agreement(ids_k, w_k, ids_p, w_p)
        # drop-in: router.route's dtypes and shapes, and its order (biased score descending)
        dropin = (ids_k.dtype == ids_p.dtype and w_k.dtype == w_p.dtype and ids_k.shape == ids_p.shape
                  and w_k.shape == w_p.shape)
        key_k = torch.sigmoid(logits.double()).gather(1, ids_k) + bias.double()[ids_k]
        descending = bool((key_k[:, :-1] >= key_k[:, 1:] - 1e-5).all())   # fp32 sum-order slack
        czero = int(counter.item()) == 0
        r = {"kernel": "router_fast", "M": m, "rows_same_experts": agree, "max_weight_err": werr,
             "rows_same_experts_f64": agree_f64, "max_weight_err_f64": werr_f64,
             "rows_same_as_router_py": agree_py, "max_weight_err_vs_router_py": werr_py,
             "dropin_types": dropin, "descending": descending, "counter_zero": czero,
             "ok": agree >= 0.99 and werr <= 1e-3 and czero and dropin and descending}
        if timing:
            r["stock_us"] = time_us(lambda: stock_route(y))
            r["router_py_us"] = time_us(lambda: _slow.route(y, w_gate, bias, cfg.top_k, cfg.routed_scaling,
                                                            counter_slow, logits=given))
            r["kernel_us"] = time_us(lambda: route(y, w_gate, bias, cfg.top_k, cfg.routed_scaling, counter,
                                                   logits=given))
            r["counter_zero_after_replays"] = int(counter.item()) == 0
            r["ok"] = r["ok"] and r["counter_zero_after_replays"]
        out.append(r)
    return out


if __name__ == "__main__":
    for row in check():
        print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
