"""kda_split for T ≥ 2 tokens per sequence (speculative decode, k = T − 1), and for T = 1 at
B ≥ 2, with everything that does not depend on the recurrent state done for all T tokens at
once (kernel "kda_multi"; KIMI_K3.md §1.4; same math, grid, scratch and ownership as
kimi_decode.kernels.kda_split, whose docstring this module assumes).

Why: at B = 1, k = 7 the fused step still ran stock's four Triton kernels between in_proj and
o_proj (f_b projection 2.7 µs, conv 3.7, recurrence 12.1, gated norm 2.8 in a KDA layer of the
a40ffe1 trace: 23.4 µs from in_proj's end to o_proj's start), because kda_split, the one-launch kernel, took
28.4-29.4 µs there (bench/fused_correctness.md): it runs its whole per-token body T times in
sequence — the z loads, the conv, two norm reductions, the 128-term gate dot product (its f_b
row re-read from L1), 5 barriers — and the last CTA then normalises the T output rows one
after the other, each with its own L2 round trip (the o row written by the other CTAs) and
barrier. But only the delta rule itself is sequential in t: the conv of token t depends on
the inputs alone (the history is the previous tokens' inputs), the L2 norms, the gate and β
on token t alone.

This kernel, per CTA (one (b, h) and C value columns, 128 threads):
1. before the PDL chain's wait: the state slice, the q/k/v conv history and weights, the
   thread's f_b row (16 × 128-bit loads into registers), dt_bias, A_log, o_norm;
2. after it: every z value the CTA needs for all T tokens in one batch of independent loads
   (q, k channel of the thread, f_a (the mma's B fragments, or f_a[tid] into shared memory),
   the v channel on tid < C, the output gate), then β of token tid on thread tid < T: a β
   computed inside the token loop (thread 0, a branch) made ptxas issue the tokens' loads one
   round trip after another (BETA_AFTER_LOADS);
3. for t = 0..T−1, registers only: conv update + SiLU of q, k (and v), q̂, k̂ norm partials
   per warp into shared memory (T slots, no barrier between tokens);
4. the T gates. On the tensor cores (GATE_MMA, T ≤ 8): raw gate [key, token] = Σ_j
   f_b[h·d + key, j] · f_a[token, j] is a [128 × 128] · [128 × T] product, i.e. per warp two
   16-key tiles × 4 k chunks × 2 mma.m16n8k16 (A = f_b rows, fragments loaded before the wait
   as gemv_mma loads weight rows; B = f_a straight from z, 4 128-bit loads per lane with step
   2's loads), 16 mma per warp in place of 1,024 FMAs and 256 shared-memory vector loads per
   thread; each lane then finishes the 4 (key, token) gates of its C fragment into s_eg before
   step 3, so step 3's barrier covers them. Why: ncu on the B = 1, k = 7 step (9e42f27, cold)
   had this kernel at 20.3 µs with one warp per scheduler issuing every 7.2 cycles: ~4.5 K
   instructions per warp in one dependent stream, ~1.4 K of them the gate dot products. The
   first build (GATE_MMA False, and T > 8): one barrier, the gates of key tid as T interleaved
   128-term dot products (f_b from registers, f_a[t] from shared memory, each in key order as
   kda_split), one barrier;
5. the recurrence, token by token: kda_split's decay + k̂ᵀS and update + q̂ᵀS (two barriers per
   token, the only per-token synchronisation left), o columns to the scratch;
6. the gated RMSNorm over the head's d columns, which V_SPLIT CTAs share. With the cluster
   (CLUSTER_NORM, V_SPLIT = CLUSTER_SPLITS = 8 CTAs per head, C = 16 columns each, launched as
   one thread-block cluster per (b, h)): the raw o columns stay in shared memory, thread
   t < T pushes its CTA's Σ_c o² of token t into every rank's shared memory (DSMEM), one
   cluster barrier, and each thread normalises one (token, column) of its own CTA; rank 0
   writes the advanced q, k conv history (every rank has read it by then). Without it (the
   first build, V_SPLIT > 8): arrival as kda_split; the last CTA loads all T o rows at once
   (an L2 round trip after the fence and the counter's atomic round trip), T warp sums, ONE
   barrier, then the T normalised, gated output rows, one CTA doing all d columns.
Barriers: 2·T + 4 (2·T + 3 with the tensor-core gates, 2 fewer again with the cluster
epilogue, which adds 2 cluster barriers) instead of kda_split's 5·T + T + 2; dependent global
round trips: 3 (the state, z, the last CTA's o rows; with the cluster 2, and no atomic)
instead of kda_split's T + 3.

Numerics: with the tensor-core gates the raw gate's fp32 sum runs in the mma's order (k
permuted inside each 32-wide chunk, chunks in order) before its bf16 rounding, so a gate may
move by one bf16 ulp against kda_split's key-order sum. Otherwise every value is written as
the same fp32 operations in the same order as in kda_split (conv taps, SiLU, the
warp-then-warp-order norm sums, the FMA gates' key-order sum and its bf16 rounding, kᵀS / q̂ᵀS
shuffles and partial order, the last CTA's Σo² order; the cluster epilogue sums Σo² per CTA
over its columns in order, then the ranks in order); which
products LLVM contracts into fmas is its own choice, so bit-identity with kda_split is not
guaranteed. The check reports it ("bit_identical") and holds the kernel to kda_split's own
tolerances against the stock ops and float64. Measured (H200, ba774df / 8c6e2b1,
bench/fused_correctness.md): out equal to kda_split's at B = 1, k = 7 and within 6.8e-07 at
B = 8, k = 7, but not every state bit (bit_identical False); 16.6-16.9 µs at B = 1, k = 7
against kda_split's 28.4, 23.6 against 47.9 at B = 8; in the B = 1, k = 7 step 17.4-17.8 µs
exposed where stock's four kernels took 23.4 µs from in_proj's end to o_proj's start
(bench/fused_runs.md). With the tensor-core gates (d714341) 14.4 µs at B = 1, k = 7; with the
cluster epilogue too (ccfc99b) 12.7 µs, 13.7 µs exposed in the step (the ccfc99b trace).

T = 1 (B ≥ 2, k = 0): nothing above assumes T ≥ 2, so the kernel also replaces stock's four
KDA kernels at B = 8, k = 0 (M = 8), where kda_fast (the B = 1, T = 1 kernel) measured 13.1 µs
against 9.6 for stock's four (fused.py's per-M table): one launch, the same prelude, one token.
The wrapper's choice of epilogue is by grid size (kda_decode_multi): before this the cluster
flag followed V_SPLIT alone, so B = 8, k = 7 (V_SPLIT 8, 384 CTAs) ran the clustered grid the
CLUSTER_NORM note measured slower. Measured (H200, check at 939672d, bench/fused_correctness.md):
B = 8, k = 0 10.7 µs against kda_split's 9.7 (out bit-identical to kda_split), B = 64 33.1
against 31.1; B = 8, k = 7 23.9 µs with the counter's epilogue; but in the B = 8 step the KDA
layer took 203.0-203.4 µs with this kernel against 209.0 with kda_split and 210.4-210.8 with
stock's four (bench/fused_runs.md, session 11), so fused.py runs it at B = 8, k = 0.

Check on the GPU (B = 1 and 8 at k = 7, B = 8 and 64 at k = 0, 3 steps with state carried;
against the stock ops, float64 and kda_split; times the stock ops, kda_split and this kernel):
    python -m kimi_decode.kernels.kda_multi
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

import functools

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass._mlir.dialects import llvm

from kimi_decode.kernels import chain
from kimi_decode.kernels._common import sigmoid, sm_count
from kimi_decode.kernels.gemv_mma import mma_bf16
from kimi_decode.kernels.kda_decode import CONV, KDAConfig
from kimi_decode.kernels.kda_split import (THREADS, VEC, WARPS, KDAScratch, KDASplit, KDASplitConfig,
                                           compile_kernel, launch, splits_for)
from kimi_decode.kernels.kda_split import can_implement as split_can_implement

MAX_TOKENS = 16    # T·d·4 B of shared memory per buffer (5 of them), and T registers per z value
# The T gates on the tensor cores (T ≤ MMA_TOKENS, the mma's n; module docstring, step 4);
# False: the 128-term FMA dot products of the first build (also used above MMA_TOKENS)
GATE_MMA = True
MMA_TOKENS = 8
# The tensor-core build takes 174 registers (ptxas, CUDA 13.0: 2 CTAs of 128 threads per SM;
# the FMA build 168, 3 per SM; capping the mma build at 168 spills 48-144 B). Where its grid
# needs more than 2 CTAs per SM the wrapper takes the FMA build: B = 8, k = 7 (384 CTAs) ran
# 30.1 µs with the tensor-core gates and 23.7 with the FMA ones (d714341); every shape the
# fused step runs kda_multi at (M ≤ 8: B ≤ 4, at most 192 CTAs) fits.
MMA_CTAS_PER_SM = 2
# The gated RMSNorm across a head's V_SPLIT CTAs through a thread-block cluster (module
# docstring, step 6): every CTA keeps its o columns in shared memory, the per-token Σo²
# partials meet in each CTA's shared memory (DSMEM), every CTA normalises its own columns.
# Needs V_SPLIT ≤ 8 (a portable cluster) and T·C ≤ 128 (one output per thread). The wrapper
# runs V_SPLIT = CLUSTER_SPLITS where the grid has at most one CTA per SM (B = 1, k = 7: 48
# CTAs, 12.7 µs in the check at ccfc99b against 14.3 for the counter's V_SPLIT 16); at B = 8,
# k = 7 (384 CTAs in clusters of 8) it ran 34.3 µs against 23.7 for the counter's V_SPLIT 8
# (d714341), so larger grids keep kda_split's splits_for. False: the counter everywhere.
CLUSTER_NORM = True
CLUSTER_SPLITS = 8
# The most CTAs per SM a grid may have for the wrapper to take the cluster epilogue. 1: at
# B = 8, k = 7 the clustered 384-CTA grid ran 33.9 µs against 23.9 for the counter's (939672d);
# at B = 8, k = 0 (T = 1) it ran 10.2 against 10.7 alone, but the B = 8 KDA layer 200.1 against
# 200.4 µs with the limit at 3 (d9ea8dc, `bench/fused_device.py --patch
# 'kimi_decode.kernels.kda_multi:CLUSTER_MAX_CTAS_PER_SM=3'`, bench/fused_runs.md session 12).
CLUSTER_MAX_CTAS_PER_SM = 1
# The recurrence with a column's key rows in ONE warp (step 5 without barriers): thread (warp,
# lane) holds column c = warp·C/4 + lane mod C/4 and keys kr·C + r (key_of: contiguous, read as
# 128-bit shared loads) with kr = lane div C/4 (warp_column), so k̂ᵀS and q̂ᵀS of a column are
# butterfly shuffles over lane bits ≥ log2(C/4) alone, every lane ends with the column's sum,
# and no token waits on a barrier. Why: kda_split's layout (c = tid mod C) spreads a column's
# keys over the 4 warps, so each token paid two shared-memory rounds and two barriers (16 of the
# kernel's ~20 at T = 8); at B = 1 the kernel ran 12.5 µs at T = 8 against kda_fast's 6.2 at T =
# 1 (H200, bench/fused_correctness.md), ~0.8 µs per further token. Measured (H100, session 24,
# bench/fused_runs.md): no gain, with or without the contiguous keys (key_of): 13.1-13.2 µs
# alone against 13.1, and the B = 1, k = 7 / B = 8 KDA layers within ±0.5 µs; the token loop is
# not what bounds the kernel. Kept off (False: kda_split's layout and blocks) for an H200 A/B.
WARP_COLUMNS = False
# The cluster epilogue writes the CTA's state slice and v history back after the Σo² exchange
# and the output (ncu at B = 1, k = 7, session 24: issued before it, the exchange's cluster
# barrier, whose release is a GPU-scope MEMBAR in SASS, waited for those stores: 35 of the
# kernel's 628 stall samples). Measured no gain (H100, session 24: the layers within ±0.5 µs).
# Kept off (False: before it, as every build until session 24) for an H200 A/B.
STATE_AFTER_EXCHANGE = False
# Step 2's loads as one batch in SASS: β of token tid by thread tid < T after the loop. Why
# (ncu, H100, B = 1, k = 7 step, session 24): with β computed inside the token loop by thread 0
# (a branch: the sigmoid's division has a slow-path call), ptxas issued each token's z loads,
# converted them (waiting on them) and only then the next token's, so the prelude paid T
# dependent global round trips (145 of its 287 stall samples long-scoreboard, spread over the
# 8 per-token blocks; 973aac8's build) where the docstring's step 2 promises one. Measured (H100,
# 4b4fcfb, bench/fused_runs.md session 24): the kernel alone 10.2 µs against 13.1 at B = 1,
# k = 7 (cluster build), 21.9 against 25.8 at B = 8, k = 7; the B = 1, k = 7 KDA layer
# 247.4-251.7 µs against 252.7-257.1 with β in the loop (B = 8 and the MLA layer unchanged).
# False: β in the loop (the build every figure before session 24 measured).
BETA_AFTER_LOADS = True


def can_implement(heads: int, head_dim: int, conv_kernel: int, in_proj_rows: int, tokens: int,
                  dtypes: tuple[torch.dtype, ...], splits: int = 16) -> bool:
    """kda_split's limits, and 1 ≤ T ≤ MAX_TOKENS tokens per sequence (T = 1 for B ≥ 2: the
    kernel is T-generic; at B = 1, T = 1 fused.py runs kda_fast)."""
    return 1 <= tokens <= MAX_TOKENS and split_can_implement(heads, head_dim, conv_kernel, in_proj_rows,
                                                             dtypes, splits)


def warp_column(tid, cols: int) -> tuple:
    """(c, kr) of thread `tid` in the WARP_COLUMNS layout for a slice of `cols` columns: the
    warp holds cols / WARPS columns and each column's 128 / cols key groups kr (key_of: keys
    kr·cols + r) sit in lanes that differ only in bits ≥ log2(cols / WARPS). Plain // and %: the kernel calls
    it on Int32, the tests on Python ints."""
    cpw = cols // WARPS
    warp = tid // 32
    lane = tid - warp * 32
    return warp * cpw + lane % cpw, lane // cpw


def cluster_applies(splits: int, tokens: int, cols: int) -> bool:
    """The cluster epilogue's limits: on, V_SPLIT a portable cluster size (≤ 8), and one
    output (token, column) per thread of the CTA."""
    return CLUSTER_NORM and 2 <= splits <= 8 and tokens * cols <= THREADS


class KDAMulti(KDASplit):
    """See the module docstring (T ≥ 1). kda_split's @cute.jit blocks (indices, state and conv
    loads, q/k conv, norm partials, l2 scales, kᵀS, update and q̂ᵀS, arrival, q/k history) are
    reused on per-token slices of T-deep shared buffers."""

    def __init__(self, cfg: KDASplitConfig, cluster: bool | None = None) -> None:
        """`cluster`: the cluster epilogue (None: wherever cluster_applies; the wrapper passes
        its grid-size choice, see kda_decode_multi)."""
        super().__init__(cfg)
        if not 1 <= self.T <= MAX_TOKENS:
            raise ValueError(f"kda_multi is the 1 ≤ T ≤ {MAX_TOKENS} kernel, not T = {self.T}")
        # the gates on the tensor cores: keys = the mma's m (two 16-key tiles per warp, 4 warps:
        # d = 128), tokens its n (≤ 8), f_b's k in 4 chunks of 32 (d = 128)
        self.gate_mma = GATE_MMA and self.T <= MMA_TOKENS and self.d == 128 and THREADS == 128
        applies = cluster_applies(self.VS, self.T, self.C)
        if cluster and not applies:
            raise ValueError(f"kda_multi's cluster epilogue cannot run V_SPLIT = {self.VS}, T = {self.T}")
        self.cluster = applies if cluster is None else cluster
        self.warp_columns = WARP_COLUMNS
        self.lg_w = (self.C // WARPS).bit_length() - 1     # first xor offset of a column's lanes

    @cute.jit
    def indices(self) -> tuple:
        """kda_split's coordinates, with (c, kr) from warp_column under WARP_COLUMNS."""
        tid, _, _ = cute.arch.thread_idx()
        sp, h, b = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = tid // 32
        c = tid % self.C
        kr = tid // self.C
        if cutlass.const_expr(self.warp_columns):
            c, kr = warp_column(tid, self.C)
        c0 = sp * self.C
        return tid, sp, h, b, lane, warp, c, kr, c0

    @cute.jit
    def column_sum(self, part: Float32) -> Float32:
        """WARP_COLUMNS: the sum over the lanes that share this lane's column (butterfly over lane
        bits ≥ log2(C/4)); every one of them gets it."""
        for sh in cutlass.range_constexpr(self.lg_w, 5):
            part += cute.arch.shuffle_sync_bfly(part, offset=1 << sh)
        return part

    def key_of(self, kr, r: int):
        """The key row of register r of a thread whose first key row is kr: kr·C + r (the thread's
        keys contiguous) with WARP_COLUMNS, else kda_split's kr + r·128/C."""
        if self.warp_columns:
            return kr * self.C + r
        return super().key_of(kr, r)

    @cute.jit
    def load_slice(self, mS: cute.Tensor, tid: Int32, h: Int32, b: Int32, c: Int32, kr: Int32,
                   c0: Int32) -> tuple:
        """kda_split's load_slice (keys of key_of) with gv the v channel of column tid: threads
        tid < C convolve the slice's v channels whatever the layout's c."""
        S, gq, gk, _ = KDASplit.load_slice(self, mS, tid, h, b, c, kr, c0)
        return S, gq, gk, 2 * self.P + h * self.d + c0 + tid

    @cute.jit
    def token_warp(self, S: cute.Tensor, s_eg: cute.Tensor, s_k: cute.Tensor, s_q: cute.Tensor,
                   k_scale: Float32, q_scale: Float32, beta: Float32, v: Float32, ob: cute.Tensor,
                   row: Int32, h: Int32, lane: Int32, c: Int32, kr: Int32, c0: Int32):
        """One token of the delta rule in the WARP_COLUMNS layout, no barrier. s_eg, s_k, s_q are
        this token's [rows, C] views (key = kr·C + r, key_of): the thread's C keys are contiguous,
        so each comes in as C/4 128-bit shared loads. Decay and k̂ᵀS[:, c] (4 partial sums over
        the C keys, then the column's lanes), u = β(v − k̂ᵀS), the update with k_scale·u taken
        once, and q̂ᵀS[:, c] the same way; the column's kr = 0 lane writes raw o."""
        C = self.C
        eg = cute.make_rmem_tensor(cute.make_layout(C), Float32)
        kk = cute.make_rmem_tensor(cute.make_layout(C), Float32)
        qq = cute.make_rmem_tensor(cute.make_layout(C), Float32)
        cute.autovec_copy(s_eg[kr, None], eg)
        cute.autovec_copy(s_k[kr, None], kk)
        cute.autovec_copy(s_q[kr, None], qq)
        acc = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        acc.fill(0.0)
        for r in cutlass.range_constexpr(C):
            S[r] = S[r] * eg[r]
            acc[r % 4] += kk[r] * S[r]
        kS = self.column_sum((acc[0] + acc[1]) + (acc[2] + acc[3])) * k_scale
        ku = k_scale * (beta * (v - kS))
        acc.fill(0.0)
        for r in cutlass.range_constexpr(C):
            S[r] = S[r] + kk[r] * ku
            acc[r % 4] += qq[r] * S[r]
        o_c = self.column_sum((acc[0] + acc[1]) + (acc[2] + acc[3])) * q_scale
        if lane < self.C // WARPS:                          # kr = 0
            ob[row, h * self.d + c0 + c] = o_c

    @cute.jit
    def __call__(self, z: cute.Pointer, f_b: cute.Pointer, conv_w: cute.Pointer,
                 conv_state: cute.Pointer, dt_bias: cute.Pointer, a_log: cute.Pointer,
                 rec_state: cute.Pointer, o_norm: cute.Pointer, out: cute.Pointer,
                 o_buf: cute.Pointer, counter: cute.Pointer, batch: Int32, stream: cuda.CUstream):
        # f_b and z as 128-bit vectors of 4 packed bf16 pairs (the mma fragments' words)
        mFbw = cute.make_tensor(cute.recast_ptr(f_b, dtype=Int32),
                                cute.make_layout((self.P, self.d // VEC, 4), stride=(self.d // 2, 4, 1)))
        mZw = cute.make_tensor(cute.recast_ptr(z, dtype=Int32),
                               cute.make_layout((batch * self.T, self.R // VEC, 4), stride=(self.R // 2, 4, 1)))
        self.kernel_multi(*self.views(z, f_b, conv_w, conv_state, dt_bias, a_log, rec_state, o_norm, out,
                                      o_buf, counter, batch), mFbw, mZw).launch(
            grid=[self.VS, self.H, batch], block=[THREADS, 1, 1],
            cluster=[self.VS if self.cluster else 1, 1, 1], stream=stream, use_pdl=chain.chain_on())

    @cute.jit
    def gate_fragments(self, mFbw: cute.Tensor, mDt: cute.Tensor, h: Int32, warp: Int32,
                       lane: Int32) -> tuple:
        """Before the wait: the A fragments of this warp's 32 keys (two 16-key tiles: rows g and
        g + 8 of each, lane (g, t) taking the 128-bit vector t of every 32-wide k chunk, as
        gemv_mma) and the dt_bias of the 4 keys whose gates the lane will hold."""
        g = lane // 4
        t = lane - g * 4
        fa = cute.make_rmem_tensor(cute.make_layout((2, 4, 2, 4), stride=(32, 8, 4, 1)), Int32)
        dts = cute.make_rmem_tensor(cute.make_layout((2, 2), stride=(2, 1)), Float32)
        for mt in cutlass.range_constexpr(2):
            key = warp * 32 + mt * 16 + g
            for cc in cutlass.range_constexpr(4):
                cute.autovec_copy(mFbw[h * self.d + key, cc * 4 + t, None], fa[mt, cc, 0, None])
                cute.autovec_copy(mFbw[h * self.d + key + 8, cc * 4 + t, None], fa[mt, cc, 1, None])
            dts[mt, 0] = mDt[h * self.d + key]
            dts[mt, 1] = mDt[h * self.d + key + 8]
        return fa, dts

    @cute.jit
    def gate_x_fragments(self, mZw: cute.Tensor, b: Int32, lane: Int32) -> cute.Tensor:
        """After the wait, with step 2's other z loads: the B fragments, f_a of the T tokens
        (lane (g, t): token min(g, T - 1)'s vector t of each 32-wide k chunk, from z)."""
        T = self.T
        g = lane // 4
        t = lane - g * 4
        xw = cute.make_rmem_tensor(cute.make_layout((4, 4), stride=(4, 1)), Int32)
        xrow = b * T + cutlass.min(g, Int32(T - 1))
        for cc in cutlass.range_constexpr(4):
            cute.autovec_copy(mZw[xrow, 4 * self.P // VEC + cc * 4 + t, None], xw[cc, None])
        return xw

    @cute.jit
    def gates_mma(self, fa: cute.Tensor, dts: cute.Tensor, xw: cute.Tensor, s_eg: cute.Tensor,
                  decay: Float32, warp: Int32, lane: Int32):
        """Step 4 on the tensor cores: 8 mma.m16n8k16 per 16-key tile (A = f_b rows, B = f_a of
        the tokens, fp32 accumulation); the lane then holds the raw gates of keys (g, g + 8) of
        each tile for tokens (2t, 2t + 1) (the C fragment) and writes exp(g) of those with
        token < T to s_eg."""
        kc, T = self.k, self.T
        g = lane // 4
        t = lane - g * 4
        for mt in cutlass.range_constexpr(2):
            acc = cute.make_rmem_tensor(cute.make_layout(4), Float32)
            acc.fill(0.0)
            for cc in cutlass.range_constexpr(4):
                mma_bf16(acc, fa[mt, cc, 0, 0], fa[mt, cc, 1, 0], fa[mt, cc, 0, 1], fa[mt, cc, 1, 1],
                         xw[cc, 0], xw[cc, 1])
                mma_bf16(acc, fa[mt, cc, 0, 2], fa[mt, cc, 1, 2], fa[mt, cc, 0, 3], fa[mt, cc, 1, 3],
                         xw[cc, 2], xw[cc, 3])
            for i in cutlass.range_constexpr(4):
                tok = 2 * t + i % 2
                if tok < T:
                    gr = acc[i].to(BFloat16).to(Float32) + dts[mt, i // 2]
                    gate = Float32(kc.gate_lower_bound) * sigmoid(decay * gr)
                    s_eg[tok, warp * 32 + mt * 16 + g + 8 * (i // 2)] = cute.math.exp(gate)

    @cute.jit
    def epilogue_cluster(self, mS: cute.Tensor, mCs: cute.Tensor, mOut: cute.Tensor, S: cute.Tensor,
                         hv: cute.Tensor, hq: cute.Tensor, hk: cute.Tensor, s_ob: cute.Tensor,
                         xred: cute.Tensor, zo: Float32, wo: Float32, tid: Int32, sp: Int32, h: Int32,
                         b: Int32, c: Int32, kr: Int32, c0: Int32, gq: Int32, gk: Int32, gv: Int32):
        """Step 6 with the cluster (the CTAs of (b, h) are its V_SPLIT ranks, rank = sp): thread t < T:
        this CTA's Σ_c o² of token t (its C columns in order) stored into every rank's xred[t, sp]
        (st.shared::cluster); one cluster barrier (release / acquire); then thread (t, c) = (tid div
        C, tid mod C) adds xred[t, 0..] in rank order (every CTA the same sum) and writes out[b·T + t,
        h·d + c0 + c]. Rank 0 writes the advanced q, k conv history: past the barrier every rank has
        read it. The own state slice and v history go back after all that (STATE_AFTER_EXCHANGE), else
        first."""
        d, T, C, VS = self.d, self.T, self.C, self.VS
        kc = self.k
        if cutlass.const_expr(not STATE_AFTER_EXCHANGE):
            self.store_own(mS, mCs, S, hv, tid, h, b, c, kr, c0, gv)
        cute.arch.sync_threads()                        # s_ob of the last token
        if tid < T * VS:
            t = tid // VS
            dst = tid - t * VS
            ss = Float32(0.0)
            for j in cutlass.range_constexpr(C):
                ss += s_ob[t, j] * s_ob[t, j]
            remote = cute.arch.map_dsmem_ptr(xred.iterator + (t * 8 + sp), dst)
            llvm.store(ss.ir_value(), remote.to_llvm_ptr())
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if sp == 0:
            self.write_qk_history(mCs, hq, hk, b, gq, gk)
        if tid < T * C:
            t = tid // C
            j = tid - t * C
            on = Float32(0.0)
            for r in cutlass.range_constexpr(VS):
                on += xred[t, r]
            rs = cute.math.rsqrt(on / d + Float32(kc.norm_eps))
            mOut[b * T + t, h * d + c0 + j] = (s_ob[t, j] * rs * wo * sigmoid(zo)).to(BFloat16)
        if cutlass.const_expr(STATE_AFTER_EXCHANGE):     # no CTA reads them (the switch's note)
            self.store_own(mS, mCs, S, hv, tid, h, b, c, kr, c0, gv)

    @cute.jit
    def store_own(self, mS: cute.Tensor, mCs: cute.Tensor, S: cute.Tensor, hv: cute.Tensor, tid: Int32,
                  h: Int32, b: Int32, c: Int32, kr: Int32, c0: Int32, gv: Int32):
        """The CTA's own state slice (keys of key_of) and, on threads tid < C, its v channels'
        conv history back to global memory."""
        for r in cutlass.range_constexpr(self.C):
            mS[b, h, self.key_of(kr, r), c0 + c] = S[r]
        if tid < self.C:
            for j in cutlass.range_constexpr(CONV - 1):
                mCs[b, gv, j] = hv[j].to(BFloat16)

    @cute.kernel
    def kernel_multi(self, mZ: cute.Tensor, mFb: cute.Tensor, mCw: cute.Tensor, mCs: cute.Tensor,
                     mDt: cute.Tensor, mA: cute.Tensor, mS: cute.Tensor, mOn: cute.Tensor,
                     mOut: cute.Tensor, mOb: cute.Tensor, mC: cute.Tensor, mFbw: cute.Tensor,
                     mZw: cute.Tensor):
        d, P, T, C = self.d, self.P, self.T, self.C
        kc = self.k
        tid, sp, h, b, lane, warp, c, kr, c0 = self.indices()
        smem = cutlass.memory.SmemAllocator()
        s_q = smem.allocate_tensor(Float32, cute.make_layout((T, d), stride=(d, 1)), byte_alignment=16)
        s_k = smem.allocate_tensor(Float32, cute.make_layout((T, d), stride=(d, 1)), byte_alignment=16)
        s_eg = smem.allocate_tensor(Float32, cute.make_layout((T, d), stride=(d, 1)),    # exp(g) per key
                                    byte_alignment=16)
        s_fa = smem.allocate_tensor(Float32, cute.make_layout((T, d // VEC, VEC), stride=(d, VEC, 1)),
                                    byte_alignment=16)
        s_v = smem.allocate_tensor(Float32, cute.make_layout((T, C), stride=(C, 1)))
        s_beta = smem.allocate_tensor(Float32, cute.make_layout(T))
        s_n = smem.allocate_tensor(Float32, cute.make_layout((T, 2, WARPS), stride=(2 * WARPS, WARPS, 1)))
        s_o = smem.allocate_tensor(Float32, cute.make_layout((T, WARPS), stride=(WARPS, 1)))
        s_part = smem.allocate_tensor(Float32, cute.make_layout((2, WARPS, C), stride=(WARPS * C, C, 1)))
        s_flag = smem.allocate_tensor(Int32, cute.make_layout(1))
        if cutlass.const_expr(self.cluster):
            s_ob = smem.allocate_tensor(Float32, cute.make_layout((T, C), stride=(C, 1)))
            xred = smem.allocate_tensor(Float32, cute.make_layout((T, 8), stride=(8, 1)), byte_alignment=16)
            # every CTA of the cluster arrives once it runs; the matching wait (before the first
            # remote store) makes sure no CTA's shared memory is written before it started
            cute.arch.cluster_arrive_relaxed()

        # 1. State, conv history and weights, the f_b row, constants: what no kernel of this
        #    step writes (before the PDL chain's wait).
        S, gq, gk, gv = self.load_slice(mS, tid, h, b, c, kr, c0)
        hq, hk, hv, wq, wk, wv = self.load_conv_qk(mCs, mCw, b, gq, gk)
        if tid < C:
            self.load_conv_v(mCs, mCw, b, gv, hv, wv)
        if cutlass.const_expr(self.gate_mma):
            fa, dts = self.gate_fragments(mFbw, mDt, h, warp, lane)
        else:
            fb = cute.make_rmem_tensor(cute.make_layout((d // VEC, VEC), stride=(VEC, 1)), BFloat16)
            for vi in cutlass.range_constexpr(d // VEC):
                cute.autovec_copy(mFb[h * d + tid, vi, None], fb[vi, None])
            dt = mDt[h * d + tid]
        decay = cute.math.exp(mA[h])
        if cutlass.const_expr(self.cluster):      # the norm weight of this thread's output column
            wn = mOn[c0 + tid % C].to(Float32)
        else:
            wn = mOn[tid].to(Float32)
        chain.enter()
        # 2. Every z value of the T tokens (in_proj's output), one batch of independent loads.
        xq = cute.make_rmem_tensor(cute.make_layout(T), Float32)
        xk = cute.make_rmem_tensor(cute.make_layout(T), Float32)
        xv = cute.make_rmem_tensor(cute.make_layout(T), Float32)
        zg = cute.make_rmem_tensor(cute.make_layout(T), Float32)
        if cutlass.const_expr(self.gate_mma):
            xw = self.gate_x_fragments(mZw, b, lane)
        zo = Float32(0.0)
        if cutlass.const_expr(self.cluster):      # the output gate of this thread's (token, column)
            if tid < T * C:
                zo = mZ[b * T + tid // C, 3 * P + h * d + c0 + tid % C].to(Float32)
        for t in cutlass.range_constexpr(T):
            row = b * T + t
            xq[t] = mZ[row, gq].to(Float32)
            xk[t] = mZ[row, gk].to(Float32)
            if cutlass.const_expr(not self.gate_mma):
                s_fa[t, tid // VEC, tid % VEC] = mZ[row, 4 * P + tid].to(Float32)
            if cutlass.const_expr(not self.cluster):
                zg[t] = mZ[row, 3 * P + h * d + tid].to(Float32)
            xv[t] = Float32(0.0)
            if tid < C:
                xv[t] = mZ[row, gv].to(Float32)
            if cutlass.const_expr(not BETA_AFTER_LOADS):
                if tid == 0:
                    s_beta[t] = sigmoid(mZ[row, 4 * P + d + h].to(Float32))
        if cutlass.const_expr(BETA_AFTER_LOADS):      # β of token tid (the switch's note)
            if tid < T:
                s_beta[tid] = sigmoid(mZ[b * T + tid, 4 * P + d + h].to(Float32))
        if cutlass.const_expr(self.gate_mma):
            # 4 (first: its fragments then die before step 3's values live). The T gates on the
            #    tensor cores, f_a from z in registers, so no barrier is needed before them and
            #    step 3's barrier covers s_eg too
            self.gates_mma(fa, dts, xw, s_eg, decay, warp, lane)
        # 3. Conv + SiLU and the norm partials of every token (the history advances in order).
        for t in cutlass.range_constexpr(T):
            aq, ak = self.conv_qk(xq[t], xk[t], xq[t] * wq[CONV - 1], xk[t] * wk[CONV - 1], hq, hk, wq, wk,
                                  s_q[t, None], s_k[t, None], tid)
            if tid < C:
                yv = xv[t] * wv[CONV - 1]
                for j in cutlass.range_constexpr(CONV - 1):
                    yv += hv[j] * wv[j]
                for j in cutlass.range_constexpr(CONV - 2):
                    hv[j] = hv[j + 1]
                hv[CONV - 2] = xv[t]
                s_v[t, tid] = yv * sigmoid(yv)
            self.norm_partials(aq, ak, s_n[t, None, None], lane, warp)
        if cutlass.const_expr(self.gate_mma):
            cute.arch.sync_threads()                    # s_eg, s_q, s_k, s_v, s_n, s_beta
        else:
            cute.arch.sync_threads()                    # s_fa, s_q, s_k, s_v, s_n, s_beta
            # 4. The T gates of key tid: T interleaved dot products, each in key order.
            acc = cute.make_rmem_tensor(cute.make_layout(T), Float32)
            acc.fill(0.0)
            fav = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
            for vi in cutlass.range_constexpr(d // VEC):
                for t in cutlass.range_constexpr(T):
                    cute.autovec_copy(s_fa[t, vi, None], fav)
                    for j in cutlass.range_constexpr(VEC):
                        acc[t] += fb[vi, j].to(Float32) * fav[j]
            for t in cutlass.range_constexpr(T):
                gr = acc[t].to(BFloat16).to(Float32) + dt
                g = Float32(kc.gate_lower_bound) * sigmoid(decay * gr)
                s_eg[t, tid] = cute.math.exp(g)
            cute.arch.sync_threads()                    # s_eg
        # 5. The delta rule, token by token (kda_split's blocks on the token's slices).
        # With the cluster the raw o columns go to s_ob [T, C] instead of the scratch: the same
        # store, through a view whose (row, column) → t·C + c - offset lands in s_ob.
        ob = mOb
        if cutlass.const_expr(self.cluster):
            ob = cute.make_tensor(s_ob.iterator + (-(b * T * C + h * d + c0)),
                                  cute.make_layout((b * T + T, P), stride=(C, 1)))
        for t in range(T):
            row = b * T + t
            q_scale, k_scale = self.l2_scales(s_n[t, None, None])
            if cutlass.const_expr(self.warp_columns):
                # [T, rows, C] views: thread kr's C keys as one contiguous, 16-byte aligned run
                rk = cute.make_layout((T, self.rows, C), stride=(d, C, 1))
                self.token_warp(S, cute.make_tensor(s_eg.iterator, rk)[t, None, None],
                                cute.make_tensor(s_k.iterator, rk)[t, None, None],
                                cute.make_tensor(s_q.iterator, rk)[t, None, None], k_scale, q_scale, s_beta[t],
                                s_v[t, c], ob, row, h, lane, c, kr, c0)
            else:
                kS = self.decay_and_kS(S, s_eg[t, None], s_k[t, None], s_part, k_scale, tid, lane, warp, c, kr)
                u = s_beta[t] * (s_v[t, c] - kS)
                self.update_and_o(S, s_k[t, None], s_q[t, None], s_part, k_scale, q_scale, u, ob, row, tid,
                                  h, lane, warp, c, kr, c0)
        if cutlass.const_expr(self.cluster):
            cute.arch.cluster_wait()                    # every CTA of the cluster has started
            self.epilogue_cluster(mS, mCs, mOut, S, hv, hq, hk, s_ob, xred, zo, wn, tid, sp, h, b, c, kr,
                                  c0, gq, gk, gv)
        else:
            # 6. Arrival; the last CTA of (b, h) normalises the T rows with one barrier.
            self.arrive(mS, mCs, mC, S, hv, s_flag, tid, h, b, c, kr, c0, gv)
            if s_flag[0] == self.VS - 1:                    # CTA-uniform: the last CTA of (b, h)
                self.write_qk_history(mCs, hq, hk, b, gq, gk)
                o_r = cute.make_rmem_tensor(cute.make_layout(T), Float32)
                for t in cutlass.range_constexpr(T):
                    o_r[t] = mOb[b * T + t, h * d + tid]
                for t in cutlass.range_constexpr(T):
                    so = cute.arch.warp_reduction_sum(o_r[t] * o_r[t])
                    if lane == 0:
                        s_o[t, warp] = so
                cute.arch.sync_threads()
                for t in cutlass.range_constexpr(T):
                    on = Float32(0.0)
                    for w in cutlass.range_constexpr(WARPS):
                        on += s_o[t, w]
                    rs = cute.math.rsqrt(on / d + Float32(kc.norm_eps))
                    mOut[b * T + t, h * d + tid] = (o_r[t] * rs * wn * sigmoid(zg[t])).to(BFloat16)
                if tid == 0:
                    mC[b * self.H + h] = Int32(0)


def _build_name(gate_mma: bool, cluster: bool) -> str:
    """The compile-cache name of a build: the switches the kernel reads when traced (GATE_MMA,
    WARP_COLUMNS, STATE_AFTER_EXCHANGE, BETA_AFTER_LOADS, and the epilogue: the cluster's or
    the counter's) are part of it, so flipping one in a process never reuses a kernel traced
    with the other setting."""
    return (f"kda_multi{'' if gate_mma else '_fma'}{'_cluster' if cluster else ''}"
            f"{'_warp_columns' if WARP_COLUMNS else ''}{'_state_last' if STATE_AFTER_EXCHANGE else ''}"
            f"{'' if BETA_AFTER_LOADS else '_beta_in_loop'}")


def _cluster_for(cfg: KDASplitConfig, cluster: bool | None) -> bool:
    """The epilogue of a build: `cluster` when given, else wherever cluster_applies."""
    if cluster is not None:
        return cluster
    return cluster_applies(cfg.splits, cfg.kda.tokens, cfg.kda.head_dim // cfg.splits)


def compile_for(cfg: KDASplitConfig, cluster: bool | None = None) -> object:
    """The compiled kernel for `cfg` (cached); `cluster` as KDAMulti takes it."""
    cl = _cluster_for(cfg, cluster)
    return compile_kernel(functools.partial(KDAMulti, cluster=cl), _build_name(GATE_MMA, cl), cfg)


def compile_fma(cfg: KDASplitConfig, cluster: bool | None = None) -> object:
    """The compiled kernel with the first build's FMA gates (GATE_MMA off while it is traced;
    cached under its own name), for the check's timing beside the tensor-core one."""
    global GATE_MMA
    saved, GATE_MMA = GATE_MMA, False
    try:
        cl = _cluster_for(cfg, cluster)
        return compile_kernel(functools.partial(KDAMulti, cluster=cl), _build_name(False, cl), cfg)
    finally:
        GATE_MMA = saved


def kda_decode_multi(z: torch.Tensor, f_b: torch.Tensor, conv_w: torch.Tensor,
                     conv_state: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
                     rec_state: torch.Tensor, o_norm: torch.Tensor, kcfg: KDAConfig,
                     scratch: KDAScratch, splits: int | None = None, *, fma_gates: bool = False,
                     cluster: bool | None = None) -> torch.Tensor:
    """kda_split.kda_decode_split's contract for 1 ≤ T ≤ MAX_TOKENS (kcfg.tokens): conv_state
    and rec_state advance in place by T tokens; scratch from kda_split.make_scratch. Returns
    out [B·T, P] bf16. V_SPLIT: `splits`, else CLUSTER_SPLITS where that grid has at most one
    CTA per SM, else kda_split's splits_for. The epilogue: `cluster`, else the cluster's where
    it applies and the grid has at most CLUSTER_MAX_CTAS_PER_SM CTAs per SM (larger clustered
    grids measured slower, CLUSTER_NORM's note), else the counter's. `fma_gates`: the first build's gates (the check
    times both); also taken where the grid would not fit at MMA_CTAS_PER_SM CTAs per SM."""
    batch = conv_state.shape[0]
    sms = sm_count(z.device)
    if splits is None:
        fits = batch * kcfg.heads * CLUSTER_SPLITS <= sms
        applies = cluster_applies(CLUSTER_SPLITS, kcfg.tokens, kcfg.head_dim // CLUSTER_SPLITS)
        splits = CLUSTER_SPLITS if fits and applies else splits_for(batch)
    ctas = batch * kcfg.heads * splits
    if cluster is None:
        cluster = (cluster_applies(splits, kcfg.tokens, kcfg.head_dim // splits)
                   and ctas <= CLUSTER_MAX_CTAS_PER_SM * sms)
    fma_gates = fma_gates or ctas > MMA_CTAS_PER_SM * sms
    build = functools.partial(compile_fma if fma_gates else compile_for, cluster=cluster)
    return launch("kda_decode_multi", build,
                  lambda dts, vs: can_implement(kcfg.heads, kcfg.head_dim, conv_w.shape[1],
                                                kcfg.in_proj_rows, kcfg.tokens, dts, vs),
                  z, f_b, conv_w, conv_state, dt_bias, a_log, rec_state, o_norm, kcfg, scratch, splits)


@torch.no_grad()
def _timings(mod: torch.nn.Module, kcfg: KDAConfig, conv_k: torch.Tensor, rec_k: torch.Tensor,
             batch: int) -> dict:
    """µs per call in CUDA-graph replays, on one in_proj output: the stock ops (what the step
    runs at k = 7 without this kernel), kda_split and this kernel (each on its own state), and
    this kernel at every V_SPLIT (kernel_us_vs{n}) and with the first build's FMA gates
    (kernel_fma_gates_us)."""
    from kimi_decode.kernels import kda_split as ks
    from kimi_decode.kernels.checks import time_us
    cfg = mod.cfg
    z = mod.k.linear(torch.randn(cfg.rows, cfg.hidden, device=rec_k.device).bfloat16(), mod.in_proj)
    conv_s, rec_s = conv_k.clone(), rec_k.clone()
    sc_m, sc_s = ks.make_scratch(kcfg, batch, rec_k.device), ks.make_scratch(kcfg, batch, rec_k.device)
    r = {"stock_us": time_us(lambda: ks._stock_core(mod, z)),
         "kda_split_us": time_us(lambda: ks.kda_decode_split(
             z, mod.f_b, mod.conv_w, conv_s, mod.dt_bias, mod.a_log, rec_s, mod.o_norm, kcfg, sc_s)),
         "kernel_us": time_us(lambda: kda_decode_multi(
             z, mod.f_b, mod.conv_w, conv_k, mod.dt_bias, mod.a_log, rec_k, mod.o_norm, kcfg, sc_m))}
    conv_f, rec_f = conv_k.clone(), rec_k.clone()
    r["kernel_fma_gates_us"] = time_us(lambda: kda_decode_multi(
        z, mod.f_b, mod.conv_w, conv_f, mod.dt_bias, mod.a_log, rec_f, mod.o_norm, kcfg, sc_m, fma_gates=True))
    # every V_SPLIT (state outputs discarded), each with the wrapper's epilogue (8: the
    # cluster's where the grid has at most one CTA per SM); and 8 clustered where it has more
    for vs in (8, 16, 32):
        conv_a, rec_a = conv_k.clone(), rec_k.clone()
        r[f"kernel_us_vs{vs}"] = time_us(lambda vs=vs: kda_decode_multi(
            z, mod.f_b, mod.conv_w, conv_a, mod.dt_bias, mod.a_log, rec_a, mod.o_norm, kcfg, sc_m, splits=vs))
    if (batch * kcfg.heads * CLUSTER_SPLITS > sm_count(z.device)
            and cluster_applies(CLUSTER_SPLITS, kcfg.tokens, kcfg.head_dim // CLUSTER_SPLITS)):
        conv_a, rec_a = conv_k.clone(), rec_k.clone()
        r["kernel_us_vs8_cluster"] = time_us(lambda: kda_decode_multi(
            z, mod.f_b, mod.conv_w, conv_a, mod.dt_bias, mod.a_log, rec_a, mod.o_norm, kcfg, sc_m,
            splits=CLUSTER_SPLITS, cluster=True))
    return r


def check(timing: bool = True, batches: tuple[int, ...] = (1, 8), spec: int = 7, steps: int = 3,
          k0_batches: tuple[int, ...] = (8, 64)) -> list[dict]:
    """kda_fast.check's harness at k = spec: the kernel vs the stock KDAAttention ops on the
    module's own tensors, `steps` steps with state carried, vs the float64 reference on the
    same pre-step state, and vs kda_split on the same inputs and state ("bit_identical"). `ok`
    is kda_split's acceptance (kda_split.check_row); B = 1 is where fused.py uses it at k = 7,
    B = 8 (V_SPLIT = 8) covers a second column width. Then the same at k = 0 (T = 1) for
    `k0_batches`: B = 8 is where fused.py uses it at T = 1 (M = 8), B = 64 (M = 64, past the
    per-M table) is timed for the record. Timing: stock ops, kda_split, this kernel."""
    from kimi_decode.kernels import kda_split as ks
    rows = ks.check_beside_split("kda_multi", kda_decode_multi, _timings, timing, batches, spec, steps)
    if k0_batches:
        rows += ks.check_beside_split("kda_multi", kda_decode_multi, _timings, timing, k0_batches, 0, steps)
    return rows


if __name__ == "__main__":
    for row in check():
        print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
