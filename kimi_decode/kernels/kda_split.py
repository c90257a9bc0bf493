"""Fused KDA decode spread over many CTAs: conv update + SiLU + f_b gate projection +
lower-bound gate + β + L2 norms + delta-rule recurrence + gated RMSNorm in one launch, with
grid (V_SPLIT, H, B) instead of kda_decode.py's (B, H) (KIMI_K3.md §1.4, §2.4 #3-#7; same
contract as kimi_decode.kernels.kda_decode, plus a scratch the caller keeps).

Why: in the delta rule every value column j of S [d_k, d_v] evolves on its own,
    S[:, j] ← S[:, j] ⊙ e^g;  S[:, j] += β k̂ (v_j − k̂ᵀS[:, j]);  o_j = q̂ᵀS[:, j],
and only the prelude (conv of the q and k channels, their L2 norms, the gate g over the keys,
β) is shared by all columns. So each CTA owns C = d / V_SPLIT columns of one (b, h) and
recomputes the cheap prelude itself (f_b[h] is 32 KB bf16, L2-resident after the first CTA),
convolving only its own C value channels. kda_decode.py's 6 CTAs at B = 1 ran 39.5 µs on the
H200 (latency of one SM doing all of a head); here 96 CTAs (V_SPLIT = 16) each do 1/16 of the
state plus the prelude, so the launch is bound by one CTA's short dependency chain.

Math per sequence b, head h, token t (row m = b·T + t of z [M, R]; P = H·d), as the stock ops:
    x      = conv input channel ch: z[m, ch] (bf16), history conv_state[b, ch, 0:3] (bf16)
    y      = x·w[ch, 3] + Σ_{j<3} hist_j·w[ch, j]  (that order)  fp32; hist ← (hist_1, hist_2, x)
    q,k,v  = SiLU(y)                                          fp32 (q: ch = h·d+i, k: P+h·d+i, v: 2P+h·d+j)
    q̂ = q · d^-½ / max(‖q‖, 1e-6),  k̂ = k / max(‖k‖, 1e-6)   fp32
    g[i]  = lb · σ( e^{A_log[h]} · (bf16(Σ_j f_b[h·d+i, j] · z[m, 4P+j]) + dt_bias[h·d+i]) )
                                                              ↑ the one bf16 rounding inside
                                                                (stock's f_b_proj has a bf16 output)
    β     = σ(z[m, 4P + d + h])
    S ← S ⊙ e^{g}[:, None];  S ← S + β k̂ ⊗ (v − k̂ᵀS);  o = q̂ᵀ S          S fp32 [d, d]
    out[m, h·d + j] = bf16( o_j · rsqrt(Σ o²/d + eps) · o_norm[j] · σ(z[m, 3P + h·d + j]) )
                                                              ↑ rounded once, as stock's gated_rms_norm
conv_state stores the bf16 inputs themselves (exact); rec_state stays fp32.
Tokens of one sequence run in order inside each CTA (k = 7: T = 8), so the state advances
by T tokens exactly as the stock loop does.

Layout: 128 threads = d (4 warps). Thread tid: column c = tid mod C of the CTA's slice
(global column c0 + c, c0 = split·C), key rows kr + r·(128/C) for r < C (kr = tid div C):
C fp32 registers of S. For a fixed r the CTA reads 128/C rows × C consecutive columns, i.e.
whole 32-byte sectors for C ≥ 8. kᵀS and qᵀS for a column: butterfly shuffles over lane
bits ≥ log2 C (lanes that share c), then the 4 warp partials meet in shared memory.
Prelude: the z inputs the CTA needs for all T tokens (q, k channels, f_a, its v channels, β)
are staged into shared memory once, so T = 8 pays one load latency, not eight. Per token,
thread tid convolves q channel tid and k channel tid, threads tid < C the CTA's v channels;
thread tid computes gate g[tid] as one dot product over f_b row h·d+tid (128-bit loads, L1
after the first token; f_a from shared memory, broadcast).

Ownership (CTAs do not synchronise, so read and write sets of different CTAs are disjoint
or ordered by the arrival counter):
- rec_state[b, h, :, c0:c0+C] and the v conv channels 2P+h·d+c0.. : the CTA (b, h, split)
  alone reads and writes them;
- the q, k conv history of (b, h): read by all V_SPLIT CTAs at their start, written only by
  the LAST CTA of (b, h) to arrive (after it has seen every other CTA's release, so every
  read is done);
- the gated RMSNorm needs the whole row o[0:d]: each CTA writes its raw fp32 o columns to
  scratch.o [M, P], fences, and bumps scratch.counter[b·H + h] (atomic acq_rel at GPU scope,
  router.py's pattern); the CTA that sees V_SPLIT − 1 reads the T rows back, normalises them,
  writes the bf16 output and re-zeroes the counter (CUDA-graph replays find it zero).

Expected time at B = 1, k = 0 (96 CTAs, one per SM): one CTA's chain is ≈ 1 µs of loads (S
slice 4 KB, f_b row 256 B/thread from L2 or HBM, conv history), a few hundred ns of math and
6 barriers, one atomic round trip + the last CTA's 512 B scratch read (~1 µs): ≈ 3-5 µs plus
launch, target ≤ 8 µs. k = 7 adds per token only shared-memory work, 5 barriers and the f_b
row from L1 (≈ 0.4-0.6 µs): ≈ 7-10 µs at B = 1. At B = 64 (V_SPLIT = 4, 1536 CTAs) the 49 MB
of state read + written bounds it at ≈ 13-15 µs (k = 0); the 32 KB f_b read per CTA (50 MB of
L2 traffic) is the next cost, which is why V_SPLIT shrinks as B grows (splits_for).

Check on the GPU (against the stock KDAAttention ops and the verified one-CTA-per-head kernel):
    python -m kimi_decode.kernels.kda_split
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

from dataclasses import dataclass
from typing import Callable

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from kimi_decode.kernels._common import compile_options, compiled, current_stream, dummy_ptr, ptr, sigmoid
from kimi_decode.kernels.kda_decode import CONV, KDAConfig

THREADS = 128   # = head_dim: one thread per key for the gate, per q/k channel for the conv
WARPS = THREADS // 32
VEC = 8         # bf16 per 128-bit load of f_b


@dataclass(frozen=True)
class KDASplitConfig:
    """Compile-time sizes: the KDA sizes and V_SPLIT (column groups per head)."""

    kda: KDAConfig
    splits: int


def splits_for(batch: int) -> int:
    """V_SPLIT per batch: ≥ 96 CTAs at B = 1, fewer redundant preludes as B grows."""
    if batch <= 2:
        return 16           # C = 8 columns: B·H·16 = 96 CTAs at B = 1
    if batch <= 16:
        return 8            # C = 16: 384 CTAs at B = 8
    return 4                # C = 32: 1536 CTAs at B = 64


def can_implement(heads: int, head_dim: int, conv_kernel: int, in_proj_rows: int,
                  dtypes: tuple[torch.dtype, ...], splits: int = 16) -> bool:
    """d = 128 (= threads), 4-tap conv, bf16 activations, C = d / V_SPLIT in {4, 8, 16, 32}
    (C divides a warp, so a column's lanes are one xor class)."""
    p = heads * head_dim
    return (head_dim == THREADS and conv_kernel == CONV and in_proj_rows >= 4 * p + head_dim + heads
            and in_proj_rows % 8 == 0 and splits in (4, 8, 16, 32)
            and all(dt == torch.bfloat16 for dt in dtypes))


@dataclass
class KDAScratch:
    """Persistent device buffers the caller keeps: raw o [B·T, P] fp32 and the per-(b, h)
    arrival counters [B·H] int32 (zero between launches: the kernel leaves them zeroed)."""

    o: torch.Tensor
    counter: torch.Tensor


def make_scratch(kcfg: KDAConfig, batch: int, device: torch.device | str) -> KDAScratch:
    """Scratch for up to `batch` sequences."""
    p = kcfg.heads * kcfg.head_dim
    return KDAScratch(o=torch.empty(batch * kcfg.tokens, p, dtype=torch.float32, device=device),
                      counter=torch.zeros(batch * kcfg.heads, dtype=torch.int32, device=device))


class KDASplit:
    """See the module docstring."""

    def __init__(self, cfg: KDASplitConfig) -> None:
        k = cfg.kda
        self.cfg, self.k = cfg, k
        self.H, self.d, self.T, self.R = k.heads, k.head_dim, k.tokens, k.in_proj_rows
        self.P = self.H * self.d
        self.VS = cfg.splits
        self.C = self.d // self.VS                     # columns per CTA
        self.rows = THREADS // self.C                  # key rows per register index
        self.lg = self.C.bit_length() - 1              # log2 C: first xor offset of a column's lanes

    @cute.jit
    def __call__(self, z: cute.Pointer, f_b: cute.Pointer, conv_w: cute.Pointer,
                 conv_state: cute.Pointer, dt_bias: cute.Pointer, a_log: cute.Pointer,
                 rec_state: cute.Pointer, o_norm: cute.Pointer, out: cute.Pointer,
                 o_buf: cute.Pointer, counter: cute.Pointer, batch: Int32, stream: cuda.CUstream):
        self.kernel(*self.views(z, f_b, conv_w, conv_state, dt_bias, a_log, rec_state, o_norm, out,
                                o_buf, counter, batch)).launch(
            grid=[self.VS, self.H, batch], block=[THREADS, 1, 1], stream=stream)

    @cute.jit
    def views(self, z: cute.Pointer, f_b: cute.Pointer, conv_w: cute.Pointer,
              conv_state: cute.Pointer, dt_bias: cute.Pointer, a_log: cute.Pointer,
              rec_state: cute.Pointer, o_norm: cute.Pointer, out: cute.Pointer,
              o_buf: cute.Pointer, counter: cute.Pointer, batch: Int32) -> tuple:
        """The kernel's global tensors (mZ, mFb, mCw, mCs, mDt, mA, mS, mOn, mOut, mOb, mC);
        shared with kda_fast.KDAFast, whose rows are m = B (T = 1)."""
        H, d, P = self.H, self.d, self.P
        m = batch * self.T
        mZ = cute.make_tensor(z, cute.make_layout((m, self.R), stride=(self.R, 1)))
        mFb = cute.make_tensor(f_b, cute.make_layout((P, d // VEC, VEC), stride=(d, VEC, 1)))
        mCw = cute.make_tensor(conv_w, cute.make_layout((3 * P, CONV), stride=(CONV, 1)))
        mCs = cute.make_tensor(conv_state, cute.make_layout(
            (batch, 3 * P, CONV - 1), stride=(3 * P * (CONV - 1), CONV - 1, 1)))
        mDt = cute.make_tensor(dt_bias, cute.make_layout(P))
        mA = cute.make_tensor(a_log, cute.make_layout(H))
        mS = cute.make_tensor(rec_state, cute.make_layout(
            (batch, H, d, d), stride=(H * d * d, d * d, d, 1)))
        mOn = cute.make_tensor(o_norm, cute.make_layout(d))
        mOut = cute.make_tensor(out, cute.make_layout((m, P), stride=(P, 1)))
        mOb = cute.make_tensor(o_buf, cute.make_layout((m, P), stride=(P, 1)))
        mC = cute.make_tensor(counter, cute.make_layout(batch * H))
        return mZ, mFb, mCw, mCs, mDt, mA, mS, mOn, mOut, mOb, mC

    @cute.kernel
    def kernel(self, mZ: cute.Tensor, mFb: cute.Tensor, mCw: cute.Tensor, mCs: cute.Tensor,
               mDt: cute.Tensor, mA: cute.Tensor, mS: cute.Tensor, mOn: cute.Tensor,
               mOut: cute.Tensor, mOb: cute.Tensor, mC: cute.Tensor):
        d, P, T, C = self.d, self.P, self.T, self.C
        kc = self.k
        tid, sp, h, b, lane, warp, c, kr, c0 = self.indices()
        smem = cutlass.memory.SmemAllocator()
        s_q, s_k, s_eg, s_v, s_part, s_red, s_flag = self.shared(smem)
        # This CTA's z inputs for all T tokens, staged once (one load latency, not T).
        s_zq = smem.allocate_tensor(Float32, cute.make_layout((T, d), stride=(d, 1)))
        s_zk = smem.allocate_tensor(Float32, cute.make_layout((T, d), stride=(d, 1)))
        s_fa = smem.allocate_tensor(Float32, cute.make_layout((T, d), stride=(d, 1)))
        s_zv = smem.allocate_tensor(Float32, cute.make_layout((T, C), stride=(C, 1)))
        s_beta = smem.allocate_tensor(Float32, cute.make_layout(T))

        # This CTA's state slice and conv histories into registers (all reads before any write).
        S, gq, gk, gv = self.load_slice(mS, tid, h, b, c, kr, c0)
        hq, hk, hv, wq, wk, wv = self.load_conv_qk(mCs, mCw, b, gq, gk)
        if tid < C:
            self.load_conv_v(mCs, mCw, b, gv, hv, wv)
        decay = cute.math.exp(mA[h])
        fbv = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
        for t in cutlass.range_constexpr(T):
            row = b * T + t
            s_zq[t, tid] = mZ[row, gq].to(Float32)
            s_zk[t, tid] = mZ[row, gk].to(Float32)
            s_fa[t, tid] = mZ[row, 4 * P + tid].to(Float32)
            if tid < C:
                s_zv[t, tid] = mZ[row, gv].to(Float32)
            if tid == 0:
                s_beta[t] = sigmoid(mZ[row, 4 * P + d + h].to(Float32))

        for t in range(T):
            row = b * T + t
            cute.arch.sync_threads()                    # staged z; the previous token's readers are done
            # Conv update + SiLU: q and k channel tid; v channels of the slice on tid < C.
            xq = s_zq[t, tid]
            yq = xq * wq[CONV - 1]
            xk = s_zk[t, tid]
            yk = xk * wk[CONV - 1]
            aq, ak = self.conv_qk(xq, xk, yq, yk, hq, hk, wq, wk, s_q, s_k, tid)
            if tid < C:
                xv = s_zv[t, tid]
                yv = xv * wv[CONV - 1]
                for j in cutlass.range_constexpr(CONV - 1):
                    yv += hv[j] * wv[j]
                for j in cutlass.range_constexpr(CONV - 2):
                    hv[j] = hv[j + 1]
                hv[CONV - 2] = xv
                s_v[tid] = yv * sigmoid(yv)
            self.norm_partials(aq, ak, s_red, lane, warp)
            cute.arch.sync_threads()
            # Gate of key tid: f_b row h·d + tid (16 × 128-bit loads) · f_a (shared, broadcast).
            acc = Float32(0.0)
            for vi in cutlass.range_constexpr(d // VEC):
                cute.autovec_copy(mFb[h * d + tid, vi, None], fbv)
                for j in cutlass.range_constexpr(VEC):
                    acc += fbv[j].to(Float32) * s_fa[t, vi * VEC + j]
            gr = acc.to(BFloat16).to(Float32) + mDt[h * d + tid]
            g = Float32(kc.gate_lower_bound) * sigmoid(decay * gr)
            s_eg[tid] = cute.math.exp(g)
            q_scale, k_scale = self.l2_scales(s_red)
            cute.arch.sync_threads()
            kS = self.decay_and_kS(S, s_eg, s_k, s_part, k_scale, tid, lane, warp, c, kr)
            u = s_beta[t] * (s_v[c] - kS)
            self.update_and_o(S, s_k, s_q, s_part, k_scale, q_scale, u, mOb, row, tid, h, lane, warp,
                              c, kr, c0)

        self.arrive(mS, mCs, mC, S, hv, s_flag, tid, h, b, c, kr, c0, gv)
        if s_flag[0] == self.VS - 1:                    # CTA-uniform: the last CTA of (b, h)
            self.write_qk_history(mCs, hq, hk, b, gq, gk)
            wn = mOn[tid].to(Float32)
            for t in range(T):
                row = b * T + t
                # alternating slots: the barrier of token t+1 separates reuse at t+2
                o_r, rs = self.row_rsqrt(mOb, s_red, t % 2, row, tid, h, lane, warp)
                gate = sigmoid(mZ[row, 3 * P + h * d + tid].to(Float32))
                mOut[row, h * d + tid] = (o_r * rs * wn * gate).to(BFloat16)
            if tid == 0:
                mC[b * self.H + h] = Int32(0)

    # Blocks shared with kda_fast.KDAFast (same operations in the same order: the PTX of both
    # kernels is byte-identical to the one they had when each wrote them out).

    @cute.jit
    def indices(self) -> tuple:
        """(tid, split, h, b, lane, warp, c, kr, c0): thread and CTA coordinates, this thread's
        column c of the slice, first key row kr (keys kr + r·rows), the slice's first column c0."""
        tid, _, _ = cute.arch.thread_idx()
        sp, h, b = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = tid // 32                  # arithmetic, not warp_idx() (a shuffle)
        c = tid % self.C                  # this thread's column in the slice
        kr = tid // self.C                # first key row; keys kr + r·rows
        c0 = sp * self.C                  # first global column of the slice
        return tid, sp, h, b, lane, warp, c, kr, c0

    @cute.jit
    def shared(self, smem: cutlass.memory.SmemAllocator) -> tuple:
        """(s_q, s_k, s_eg, s_v, s_part, s_red, s_flag): the per-token shared buffers."""
        d, C = self.d, self.C
        s_q = smem.allocate_tensor(Float32, cute.make_layout(d))
        s_k = smem.allocate_tensor(Float32, cute.make_layout(d))
        s_eg = smem.allocate_tensor(Float32, cute.make_layout(d))        # exp(g) per key
        s_v = smem.allocate_tensor(Float32, cute.make_layout(C))
        s_part = smem.allocate_tensor(Float32, cute.make_layout((2, WARPS, C), stride=(WARPS * C, C, 1)))
        s_red = smem.allocate_tensor(Float32, cute.make_layout((2, WARPS), stride=(WARPS, 1)))
        s_flag = smem.allocate_tensor(Int32, cute.make_layout(1))
        return s_q, s_k, s_eg, s_v, s_part, s_red, s_flag

    def key_of(self, kr, r: int):
        """The key row of state register r of a thread whose first key row is kr (kr + r·128/C;
        kda_multi's WARP_COLUMNS layout overrides it)."""
        return kr + r * self.rows

    @cute.jit
    def load_slice(self, mS: cute.Tensor, tid: Int32, h: Int32, b: Int32, c: Int32, kr: Int32,
                   c0: Int32) -> tuple:
        """(S, gq, gk, gv): this CTA's state slice in registers (C fp32) and the thread's conv
        channels (gv used by tid < C only: then c = tid)."""
        d, P = self.d, self.P
        S = cute.make_rmem_tensor(cute.make_layout(self.C), Float32)
        for r in cutlass.range_constexpr(self.C):
            S[r] = mS[b, h, self.key_of(kr, r), c0 + c]
        gq = h * d + tid                  # q channel of this thread
        gk = P + h * d + tid              # k channel
        gv = 2 * P + h * d + c0 + c       # v channel (used by tid < C only: then c = tid)
        return S, gq, gk, gv

    @cute.jit
    def load_conv_qk(self, mCs: cute.Tensor, mCw: cute.Tensor, b: Int32, gq: Int32, gk: Int32) -> tuple:
        """(hq, hk, hv, wq, wk, wv): conv history and weights of the q and k channels (fp32);
        the v ones zeroed (load_conv_v fills them on tid < C)."""
        hq = cute.make_rmem_tensor(cute.make_layout(CONV - 1), Float32)
        hk = cute.make_rmem_tensor(cute.make_layout(CONV - 1), Float32)
        hv = cute.make_rmem_tensor(cute.make_layout(CONV - 1), Float32)
        wq = cute.make_rmem_tensor(cute.make_layout(CONV), Float32)
        wk = cute.make_rmem_tensor(cute.make_layout(CONV), Float32)
        wv = cute.make_rmem_tensor(cute.make_layout(CONV), Float32)
        for j in cutlass.range_constexpr(CONV - 1):
            hq[j] = mCs[b, gq, j].to(Float32)
            hk[j] = mCs[b, gk, j].to(Float32)
            hv[j] = Float32(0.0)
        for j in cutlass.range_constexpr(CONV):
            wq[j] = mCw[gq, j]
            wk[j] = mCw[gk, j]
            wv[j] = Float32(0.0)
        return hq, hk, hv, wq, wk, wv

    @cute.jit
    def load_conv_v(self, mCs: cute.Tensor, mCw: cute.Tensor, b: Int32, gv: Int32,
                    hv: cute.Tensor, wv: cute.Tensor):
        """Conv history and weights of v channel gv into hv, wv (the caller guards tid < C)."""
        for j in cutlass.range_constexpr(CONV - 1):
            hv[j] = mCs[b, gv, j].to(Float32)
        for j in cutlass.range_constexpr(CONV):
            wv[j] = mCw[gv, j]

    @cute.jit
    def conv_qk(self, xq: Float32, xk: Float32, yq: Float32, yk: Float32, hq: cute.Tensor,
                hk: cute.Tensor, wq: cute.Tensor, wk: cute.Tensor, s_q: cute.Tensor, s_k: cute.Tensor,
                tid: Int32) -> tuple:
        """Conv update + SiLU of q and k channel tid from inputs xq, xk and their first terms
        yq = xq·w[3], yk = xk·w[3] (the caller computes those: where each product sits
        relative to the loads is part of the PTX), history advanced in place: (aq, ak), also
        stored to s_q[tid], s_k[tid]."""
        for j in cutlass.range_constexpr(CONV - 1):
            yq += hq[j] * wq[j]
            yk += hk[j] * wk[j]
        for j in cutlass.range_constexpr(CONV - 2):
            hq[j] = hq[j + 1]
            hk[j] = hk[j + 1]
        hq[CONV - 2] = xq
        hk[CONV - 2] = xk
        aq = yq * sigmoid(yq)
        ak = yk * sigmoid(yk)
        s_q[tid] = aq
        s_k[tid] = ak
        return aq, ak

    @cute.jit
    def norm_partials(self, aq: Float32, ak: Float32, s_red: cute.Tensor, lane: Int32, warp: Int32):
        """‖q‖², ‖k‖²: whole-warp shuffles (uniform code), one value per warp in s_red[0|1, warp]."""
        sq = cute.arch.warp_reduction_sum(aq * aq)
        sk = cute.arch.warp_reduction_sum(ak * ak)
        if lane == 0:
            s_red[0, warp] = sq
            s_red[1, warp] = sk

    @cute.jit
    def l2_scales(self, s_red: cute.Tensor) -> tuple:
        """(q_scale, k_scale) = (d^-½ / max(‖q‖, eps), 1 / max(‖k‖, eps)) from the warp partials
        (after a barrier)."""
        qn = Float32(0.0)
        kn = Float32(0.0)
        for w in cutlass.range_constexpr(WARPS):
            qn += s_red[0, w]
            kn += s_red[1, w]
        q_scale = Float32(self.d ** -0.5) / cute.arch.fmax(cute.math.sqrt(qn), Float32(self.k.l2_eps))
        k_scale = Float32(1.0) / cute.arch.fmax(cute.math.sqrt(kn), Float32(self.k.l2_eps))
        return q_scale, k_scale

    @cute.jit
    def publish_partial(self, part: Float32, scale: Float32, s_part: cute.Tensor, slot: int,
                        lane: Int32, warp: Int32):
        """A column's sum over this warp's lanes that share c (butterfly over lane bits ≥ log2 C),
        scaled, into s_part[slot, warp, c] by lanes < C; then a barrier."""
        for sh in cutlass.range_constexpr(self.lg, 5):
            part += cute.arch.shuffle_sync_bfly(part, offset=1 << sh)
        if lane < self.C:
            s_part[slot, warp, lane] = part * scale
        cute.arch.sync_threads()

    @cute.jit
    def decay_and_kS(self, S: cute.Tensor, s_eg: cute.Tensor, s_k: cute.Tensor, s_part: cute.Tensor,
                     k_scale: Float32, tid: Int32, lane: Int32, warp: Int32, c: Int32, kr: Int32) -> Float32:
        """Decay, then k̂ᵀS[:, c]: this thread's share, the shuffles over lanes that share c, the
        4 warp partials through s_part[0] (one barrier)."""
        part = Float32(0.0)
        for r in cutlass.range_constexpr(self.C):
            key = kr + r * self.rows
            S[r] = S[r] * s_eg[key]
            part += s_k[key] * S[r]
        self.publish_partial(part, k_scale, s_part, 0, lane, warp)
        kS = Float32(0.0)
        for w in cutlass.range_constexpr(WARPS):
            kS += s_part[0, w, c]
        return kS

    @cute.jit
    def update_and_o(self, S: cute.Tensor, s_k: cute.Tensor, s_q: cute.Tensor, s_part: cute.Tensor,
                     k_scale: Float32, q_scale: Float32, u: Float32, mOb: cute.Tensor, row: Int32,
                     tid: Int32, h: Int32, lane: Int32, warp: Int32, c: Int32, kr: Int32, c0: Int32):
        """Delta-rule update with u = β(v − k̂ᵀS), then q̂ᵀS[:, c] as in decay_and_kS (through
        s_part[1]); threads tid < C write raw o of column c0 + c to scratch row `row`."""
        part = Float32(0.0)
        for r in cutlass.range_constexpr(self.C):
            key = kr + r * self.rows
            S[r] = S[r] + s_k[key] * k_scale * u
            part += s_q[key] * S[r]
        self.publish_partial(part, q_scale, s_part, 1, lane, warp)
        if tid < self.C:
            o_c = Float32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                o_c += s_part[1, w, c]
            mOb[row, h * self.d + c0 + c] = o_c

    @cute.jit
    def arrive(self, mS: cute.Tensor, mCs: cute.Tensor, mC: cute.Tensor, S: cute.Tensor,
               hv: cute.Tensor, s_flag: cute.Tensor, tid: Int32, h: Int32, b: Int32, c: Int32,
               kr: Int32, c0: Int32, gv: Int32):
        """Own slice of the state and own v history back; then arrive: s_flag[0] = the counter
        of (b, h) before this CTA's bump (V_SPLIT − 1: the last CTA), after a barrier."""
        for r in cutlass.range_constexpr(self.C):
            mS[b, h, self.key_of(kr, r), c0 + c] = S[r]
        if tid < self.C:
            for j in cutlass.range_constexpr(CONV - 1):
                mCs[b, gv, j] = hv[j].to(BFloat16)
        cute.arch.fence_acq_rel_gpu()                   # this thread's o stores before the bump
        cute.arch.sync_threads()
        if tid == 0:
            cute.arch.fence_acq_rel_gpu()
            old = cute.arch.atomic_add(mC.iterator + (b * self.H + h), Int32(1), sem="acq_rel", scope="gpu")
            s_flag[0] = old
        cute.arch.sync_threads()

    @cute.jit
    def row_rsqrt(self, mOb: cute.Tensor, s_red: cute.Tensor, slot: Int32, row: Int32, tid: Int32,
                  h: Int32, lane: Int32, warp: Int32) -> tuple:
        """The last CTA: (o_r, rsqrt(Σo²/d + eps)) of scratch row `row`, column h·d + tid; the
        warp sums meet in s_red[slot] (one barrier)."""
        o_r = mOb[row, h * self.d + tid]
        so = cute.arch.warp_reduction_sum(o_r * o_r)
        if lane == 0:
            s_red[slot, warp] = so
        cute.arch.sync_threads()
        on = Float32(0.0)
        for w in cutlass.range_constexpr(WARPS):
            on += s_red[slot, w]
        return o_r, cute.math.rsqrt(on / self.d + Float32(self.k.norm_eps))

    @cute.jit
    def write_qk_history(self, mCs: cute.Tensor, hq: cute.Tensor, hk: cute.Tensor, b: Int32,
                         gq: Int32, gk: Int32):
        """The last CTA of (b, h): every CTA of (b, h) has read the q, k history (acquire
        fence), write the advanced one."""
        cute.arch.fence_acq_rel_gpu()
        for j in cutlass.range_constexpr(CONV - 1):
            mCs[b, gq, j] = hq[j].to(BFloat16)
            mCs[b, gk, j] = hk[j].to(BFloat16)


def compile_for(cfg: KDASplitConfig) -> object:
    """The compiled kernel for `cfg` (cached)."""
    return compile_kernel(KDASplit, "kda_split", cfg)


def compile_kernel(cls: type, name: str, cfg: KDASplitConfig) -> object:
    """The compiled `cls` (KDASplit or a subclass with its signature) for `cfg`, cached under
    (name, cfg)."""
    def build() -> object:
        bf, f32, i32 = dummy_ptr(torch.bfloat16), dummy_ptr(torch.float32), dummy_ptr(torch.int32)
        return cute.compile(cls(cfg), bf, bf, f32, bf, f32, f32, f32, bf, bf, f32, i32, Int32(1),
                            current_stream(), options=compile_options())
    return compiled((name, cfg), build)


def kda_decode_split(z: torch.Tensor, f_b: torch.Tensor, conv_w: torch.Tensor,
                     conv_state: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
                     rec_state: torch.Tensor, o_norm: torch.Tensor, kcfg: KDAConfig,
                     scratch: KDAScratch, splits: int | None = None) -> torch.Tensor:
    """Launch on the current stream; conv_state [B, 3P, 3] bf16 and rec_state [B, H, d, d] fp32
    advance in place by T tokens. z [B·T, R] bf16 (in_proj output); scratch from make_scratch
    (for ≥ B sequences). Returns out [B·T, P] bf16."""
    return launch("kda_decode_split", compile_for,
                  lambda dts, vs: can_implement(kcfg.heads, kcfg.head_dim, conv_w.shape[1],
                                                kcfg.in_proj_rows, dts, vs),
                  z, f_b, conv_w, conv_state, dt_bias, a_log, rec_state, o_norm, kcfg, scratch, splits)


def launch(name: str, compile_fn: Callable[[KDASplitConfig], object],
           implementable: Callable[[tuple[torch.dtype, ...], int], bool], z: torch.Tensor,
           f_b: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor, dt_bias: torch.Tensor,
           a_log: torch.Tensor, rec_state: torch.Tensor, o_norm: torch.Tensor, kcfg: KDAConfig,
           scratch: KDAScratch, splits: int | None) -> torch.Tensor:
    """The wrappers' shared body (kda_decode_split, kda_fast.kda_decode_fast): operand checks
    (ValueError naming `name`; `implementable(bf16 operand dtypes, V_SPLIT)` is the kernel's
    can_implement), the output, the launch of compile_fn's kernel on the current stream."""
    batch = conv_state.shape[0]
    p = kcfg.heads * kcfg.head_dim
    vs = splits or splits_for(batch)
    if (z.shape != (batch * kcfg.tokens, kcfg.in_proj_rows) or rec_state.dtype != torch.float32
            or rec_state.shape != (batch, kcfg.heads, kcfg.head_dim, kcfg.head_dim)
            or conv_state.shape != (batch, 3 * p, CONV - 1)
            or scratch.o.shape[0] < z.shape[0] or scratch.o.shape[1] != p
            or scratch.counter.numel() < batch * kcfg.heads):
        raise ValueError(f"{name}: operand shapes do not match the config")
    fp32 = (conv_w, dt_bias, a_log, rec_state, scratch.o)
    if (not implementable((z.dtype, f_b.dtype, conv_state.dtype, o_norm.dtype), vs)
            or any(t.dtype != torch.float32 for t in fp32) or scratch.counter.dtype != torch.int32):
        raise ValueError(f"{name} cannot run this configuration")
    out = torch.empty(z.shape[0], p, dtype=torch.bfloat16, device=z.device)
    compile_fn(KDASplitConfig(kcfg, vs))(
        ptr(z), ptr(f_b), ptr(conv_w), ptr(conv_state), ptr(dt_bias), ptr(a_log), ptr(rec_state),
        ptr(o_norm), ptr(out), ptr(scratch.o), ptr(scratch.counter), Int32(batch), current_stream())
    return out


def reference(z: torch.Tensor, f_b: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor,
              dt_bias: torch.Tensor, a_log: torch.Tensor, rec_state: torch.Tensor,
              o_norm: torch.Tensor, kcfg: KDAConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 statement of the module docstring (inputs untouched): (out [M, P] float64, not
    rounded; new conv_state in conv_state's dtype; new rec_state float64)."""
    H, d, T = kcfg.heads, kcfg.head_dim, kcfg.tokens
    P, B = H * d, conv_state.shape[0]
    zd = z.double()
    new = zd[:, :3 * P].reshape(B, T, 3 * P).transpose(1, 2)                      # [B, 3P, T]
    full = torch.cat([conv_state.double(), new], dim=-1)                            # [B, 3P, 3+T]
    y = (full.unfold(-1, CONV, 1) * conv_w.double()[:, None, :]).sum(-1)            # [B, 3P, T]
    act = torch.nn.functional.silu(y).transpose(1, 2).reshape(B, T, 3, H, d)
    q, k, v = act.unbind(2)                                                          # [B, T, H, d]
    q = q / q.norm(dim=-1, keepdim=True).clamp_min(kcfg.l2_eps) * d ** -0.5
    k = k / k.norm(dim=-1, keepdim=True).clamp_min(kcfg.l2_eps)
    fb = (zd[:, 4 * P:4 * P + d] @ f_b.double().t()).to(torch.bfloat16).double()  # bf16, as stock
    g = (fb + dt_bias.double()).reshape(B, T, H, d) * a_log.double().exp()[:, None]
    g = kcfg.gate_lower_bound * torch.sigmoid(g)
    beta = torch.sigmoid(zd[:, 4 * P + d:4 * P + d + H]).reshape(B, T, H)
    S, outs = rec_state.double(), []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        kS = (k[:, t, :, :, None] * S).sum(-2)                                      # [B, H, d]
        S = S + (beta[:, t, :, None] * k[:, t])[..., None] * (v[:, t] - kS)[..., None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    o = torch.stack(outs, dim=1).reshape(B * T, H, d)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + kcfg.norm_eps) * o_norm.double()
    out = o.reshape(B * T, P) * torch.sigmoid(zd[:, 3 * P:4 * P])
    return out, full[..., -(CONV - 1):].to(conv_state.dtype), S


def _stock_core(mod: torch.nn.Module, z: torch.Tensor) -> torch.Tensor:
    """The stock KDAAttention ops between in_proj and o_proj (stock.KDAAttention.forward),
    advancing mod's conv and recurrent state: out [M, P] bf16."""
    cfg, k = mod.cfg, mod.k
    H, d, P = cfg.kda_local_heads, cfg.kda_head_dim, cfg.kda_local_dim
    qkv, gate_out = z[:, :3 * P], z[:, 3 * P:4 * P]
    f_a, beta_in = z[:, 4 * P:4 * P + d], z[:, 4 * P + d:4 * P + d + H]
    f_b = k.linear(f_a, mod.f_b)
    act = k.conv_(mod.conv_state, qkv, mod.conv_w, cfg.batch)
    o = k.kda_(act, f_b, beta_in, mod.dt_bias, mod.a_log, mod.rec_state, cfg.gate_lower_bound, H)
    return k.gated_rms_norm(o, mod.o_norm, gate_out, cfg.rms_eps, z.dtype)


@torch.no_grad()
def _timings(mod: torch.nn.Module, kcfg: KDAConfig, scratch: KDAScratch, conv_k: torch.Tensor,
             rec_k: torch.Tensor, batch: int) -> dict:
    """µs per call: the stock ops, this kernel (its V_SPLIT and the alternatives), and the
    verified one-CTA-per-head kernel, on one in_proj output."""
    from kimi_decode.kernels.checks import time_us
    from kimi_decode.kernels.kda_decode import kda_decode
    cfg = mod.cfg
    z = mod.k.linear(torch.randn(cfg.rows, cfg.hidden, device=rec_k.device).bfloat16(), mod.in_proj)
    conv_v, rec_v = mod.conv_state.clone(), mod.rec_state.clone()

    def split(vs: int | None = None) -> torch.Tensor:
        return kda_decode_split(z, mod.f_b, mod.conv_w, conv_k, mod.dt_bias, mod.a_log, rec_k, mod.o_norm,
                                kcfg, scratch, splits=vs)
    r = {"stock_us": time_us(lambda: _stock_core(mod, z)), "kernel_us": time_us(split),
         "verified_us": time_us(lambda: kda_decode(z, mod.f_b, mod.conv_w, conv_v, mod.dt_bias, mod.a_log,
                                                   rec_v, mod.o_norm, kcfg))}
    for vs in (4, 8, 16, 32):                       # the V_SPLIT table's alternatives
        if vs != splits_for(batch):
            r[f"kernel_us_vs{vs}"] = time_us(lambda vs=vs: split(vs))
    return r


def check_module(batch: int, spec: int, dev: torch.device) -> tuple:
    """(cfg, module, kcfg) of the checks: K3 TP16 at `batch` sequences and k = spec, a stock
    KDAAttention with the seeded check weights, and its KDAConfig."""
    from kimi_decode.comm import LocalComm, SideStream
    from kimi_decode.config import k3_tp16
    from kimi_decode.stock import KDAAttention, Runtime
    from kimi_decode.weights import Seeder
    cfg = k3_tp16(batch=batch, spec_tokens=spec)
    rt = Runtime(LocalComm(), SideStream(dev))
    mod = KDAAttention(cfg, Seeder(cfg, dev).sub("check.kda"), rt)
    kcfg = KDAConfig(cfg.kda_local_heads, cfg.kda_head_dim, cfg.tokens_per_seq, cfg.in_proj_rows,
                     cfg.gate_lower_bound, 1e-6, cfg.rms_eps)
    return cfg, mod, kcfg


@torch.no_grad()
def check_input(mod: torch.nn.Module, step: int, dev: torch.device) -> torch.Tensor:
    """z of check step `step`: the stock in_proj of a seeded, RMS-normalised bf16 input."""
    cfg = mod.cfg
    gen = torch.Generator(device=dev).manual_seed(step)
    x = torch.nn.functional.rms_norm(torch.randn(cfg.rows, cfg.hidden, generator=gen, device=dev),
                                     (cfg.hidden,)).bfloat16()
    return mod.k.linear(x, mod.in_proj)


def check_row(kernel: str, batch: int, spec: int, e: dict, conv_equal: bool, scratch: KDAScratch,
              **extra: object) -> dict:
    """A check's row: the errors `e` (out vs stock and vs float64, stock vs float64, rec_state
    vs stock), conv_state equality, the counters back at zero, `extra`, and `ok`, the
    acceptance: out within 1e-2 of stock and within 1.5× stock's own error vs float64,
    rec_state within 1e-3 of stock, conv_state equal, counters zero."""
    counter_zero = int(scratch.counter.abs().sum().item()) == 0
    return {"kernel": kernel, "B": batch, "k": spec, "splits": splits_for(batch), "rel_out": e["out"],
            "rel_out_vs_f64": e["out_f64"], "stock_rel_vs_f64": e["stock_f64"],
            "rel_rec_state": e["rec"], "conv_state_equal": conv_equal, "counter_zero": counter_zero,
            **extra,
            "ok": (e["out"] <= 1e-2 and e["out_f64"] <= 1.5 * e["stock_f64"] + 1e-3
                   and e["rec"] <= 1e-3 and conv_equal and counter_zero)}


def check_beside_split(kernel: str, launch_fn: Callable[..., torch.Tensor], timings_fn: Callable[..., dict],
                       timing: bool, batches: tuple[int, ...], spec: int, steps: int) -> list[dict]:
    """The check of a kernel with kda_decode_split's contract (kda_fast, kda_multi): `launch_fn`
    vs the stock KDAAttention ops on the module's own tensors (z = the stock in_proj of fresh
    inputs) at k = `spec`, `steps` steps with state carried, vs the float64 reference on the
    same pre-step state, and vs kda_split on the same inputs and state ("bit_identical": out,
    rec_state and conv_state equal; reported, not required). `ok` is kda_split's acceptance
    (check_row). With timing, `timings_fn(mod, kcfg, conv, rec, batch)` adds its columns."""
    from kimi_decode.kernels.checks import DEVICE, _sync, rel
    dev = torch.device(DEVICE)
    out = []
    for b in batches:
        _, mod, kcfg = check_module(b, spec, dev)
        sc_k, sc_s = make_scratch(kcfg, b, dev), make_scratch(kcfg, b, dev)
        conv_k, rec_k = mod.conv_state.clone(), mod.rec_state.clone()
        conv_s, rec_s = mod.conv_state.clone(), mod.rec_state.clone()
        e = {"out": 0.0, "out_f64": 0.0, "stock_f64": 0.0, "rec": 0.0, "vs_split": 0.0}
        conv_equal, same = True, True
        for step in range(steps):
            z = check_input(mod, step, dev)
            with torch.no_grad():
                ref, _, _ = reference(z, mod.f_b, mod.conv_w, mod.conv_state, mod.dt_bias, mod.a_log,
                                      mod.rec_state, mod.o_norm, kcfg)
                o_st = _stock_core(mod, z)
                o_k = launch_fn(z, mod.f_b, mod.conv_w, conv_k, mod.dt_bias, mod.a_log, rec_k, mod.o_norm,
                                kcfg, sc_k)
                o_p = kda_decode_split(z, mod.f_b, mod.conv_w, conv_s, mod.dt_bias, mod.a_log, rec_s,
                                       mod.o_norm, kcfg, sc_s)
            _sync()
            e["out"] = max(e["out"], rel(o_k, o_st))
            e["out_f64"] = max(e["out_f64"], rel(o_k, ref))
            e["stock_f64"] = max(e["stock_f64"], rel(o_st, ref))
            e["rec"] = max(e["rec"], rel(rec_k, mod.rec_state))
            e["vs_split"] = max(e["vs_split"], rel(o_k, o_p))
            conv_equal &= torch.equal(conv_k, mod.conv_state)
            same &= torch.equal(o_k, o_p) and torch.equal(rec_k, rec_s) and torch.equal(conv_k, conv_s)
            # continue from stock's state so the steps compare like for like
            for t in (conv_k, conv_s):
                t.copy_(mod.conv_state)
            for t in (rec_k, rec_s):
                t.copy_(mod.rec_state)
        r = check_row(kernel, b, spec, e, conv_equal, sc_k, rel_out_vs_kda_split=e["vs_split"],
                      bit_identical=same)
        if timing:
            r.update(timings_fn(mod, kcfg, conv_k, rec_k, b))
        out.append(r)
        del mod
    return out


def check(timing: bool = True, batches: tuple[int, ...] = (1, 8, 64),
          spec: tuple[int, ...] = (0, 7), alt_splits: tuple[int, ...] = (4, 8, 16, 32)) -> list[dict]:
    """Kernel vs the stock KDAAttention ops on the module's own tensors (z = the stock in_proj
    of fresh inputs), 3 steps with state carried, and vs the float64 reference on the same
    pre-step state; timing vs the stock ops and vs the verified kda_decode kernel. Each V_SPLIT
    in `alt_splits` is checked once more against the reference ("alt_splits_ok"), so a
    re-tuned splits_for table rests on verified configurations."""
    from kimi_decode.kernels.checks import DEVICE, _sync, rel
    dev = torch.device(DEVICE)
    out = []
    for b in batches:
        for k in spec:
            cfg, mod, kcfg = check_module(b, k, dev)
            scratch = make_scratch(kcfg, b, dev)
            conv_k, rec_k = mod.conv_state.clone(), mod.rec_state.clone()
            e = {"out": 0.0, "out_f64": 0.0, "stock_f64": 0.0, "rec": 0.0}
            conv_equal = True
            for step in range(3):
                z = check_input(mod, step, dev)
                with torch.no_grad():
                    ref, _, _ = reference(z, mod.f_b, mod.conv_w, mod.conv_state, mod.dt_bias, mod.a_log,
                                          mod.rec_state, mod.o_norm, kcfg)
                    o_s = _stock_core(mod, z)
                    o_k = kda_decode_split(z, mod.f_b, mod.conv_w, conv_k, mod.dt_bias, mod.a_log, rec_k,
                                           mod.o_norm, kcfg, scratch)
                _sync()
                e["out"] = max(e["out"], rel(o_k, o_s))
                e["out_f64"] = max(e["out_f64"], rel(o_k, ref))
                e["stock_f64"] = max(e["stock_f64"], rel(o_s, ref))
                e["rec"] = max(e["rec"], rel(rec_k, mod.rec_state))
                conv_equal &= torch.equal(conv_k, mod.conv_state)
                # continue from stock's state so the three steps compare like for like
                conv_k.copy_(mod.conv_state)
                rec_k.copy_(mod.rec_state)
            alt_ok, alt_err = True, 0.0
            x = torch.randn(cfg.rows, cfg.hidden, generator=torch.Generator(device=dev).manual_seed(3), device=dev)
            with torch.no_grad():
                z = mod.k.linear(torch.nn.functional.rms_norm(x, (cfg.hidden,)).bfloat16(), mod.in_proj)
                ref, cs_ref, s_ref = reference(z, mod.f_b, mod.conv_w, mod.conv_state, mod.dt_bias, mod.a_log,
                                               mod.rec_state, mod.o_norm, kcfg)
                for vs in alt_splits:
                    cs_a, rec_a = mod.conv_state.clone(), mod.rec_state.clone()
                    o_a = kda_decode_split(z, mod.f_b, mod.conv_w, cs_a, mod.dt_bias, mod.a_log, rec_a,
                                           mod.o_norm, kcfg, scratch, splits=vs)
                    _sync()
                    alt_err = max(alt_err, rel(o_a, ref))
                    alt_ok &= (rel(o_a, ref) <= 1e-2 and rel(rec_a, s_ref) <= 1e-3
                               and torch.equal(cs_a, cs_ref))
            r = check_row("kda_split", b, k, e, conv_equal, scratch,
                          alt_splits_ok=alt_ok, alt_splits_rel_out_vs_f64=alt_err)
            if timing:
                r.update(_timings(mod, kcfg, scratch, conv_k, rec_k, b))
            out.append(r)
            del mod
    return out


if __name__ == "__main__":
    for row in check():
        print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
