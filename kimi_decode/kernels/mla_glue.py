"""MLA glue in two launches: the small per-head GEMMs around the latent attention and the
copies that surround them (KIMI_K3.md Part 3). Replaces, in stock.MLAAttention.forward,
  uk_bmm + kv_insert  (torch.bmm, OpSet.kv_insert: 2 kernels, ~2.8 + 1.3 µs at B = 1)  by `uk_insert`,
  uv_bmm + gate_mul   (torch.bmm, sigmoid_gate:     2 kernels, ~3.3 + 1.2 µs at B = 1)  by `uv_gate`.

Shapes (K3 TP16): H = 6 local heads, nope = 128, rope = 64, c = 512, vd = 128, M = B·T ≤ 8.

Exact math (every bf16 rounding point; fp32 accumulation as cuBLAS's bf16 bmm):
- uk_insert(q, a, ckv, w_uk_t, cache, pos, T, rope_off) -> q_full [B, T·H, c + rope]
    q [M, H, nope + rope] bf16 (contiguous), w_uk_t [H, nope, c], ckv [M, c], a [M, A] bf16,
    cache [B, C, c + rope] bf16, pos int64 [1] on the GPU (read by the kernel, never the host).
    q_lat[m, h, j]          = bf16( Σ_{k<nope} fp32(q[m, h, k]) · fp32(w_uk_t[h, k, j]) )
    q_full[b, t·H + h]      = [ q_lat[m, h] | q[m, h, nope:] ]            (m = b·T + t; a copy)
    cache[b, pos + t]       = [ ckv[m] | a[m, rope_off:rope_off + rope] ]  (copies; rows with
                              pos + t outside [0, C) are skipped: stock's index_copy_ would
                              raise there, the kernel never writes out of bounds)
  (stock's kv_insert copies a[:, rope_off:], i.e. all of a's columns past rope_off: the same
  bytes when rope_off + rope = A, as at K3: 2048 + 64 = 2112; the wrapper requires it.)
  uk_insert_norm (GlueConfig.norm; kernel "mla_norm_fold", kernels/mla_norm_fold.py) takes
  a's raw c_kv part instead of ckv: ckv[m] = bf16(fp32(a[m, ql:ql + c]) · rstd · fp32(kv_norm)),
  rstd = rsqrt(Σ fp32(a)² / c + eps): warp w of every CTA reduces row min(w, M-1) (2 vectors
  per lane, a butterfly outside any branch), the head-0 CTAs write their tile's vectors.
  stock: torch.bmm (bf16 out, fp32 accumulate, one rounding) then kv_insert (pure copies), so
  q_full's rope half and the cache rows are bit-equal to stock; q_lat differs from cuBLAS only
  by the fp32 summation order (one bf16 ulp at rounding boundaries).
- uv_gate(o_lat, w_uv, g) -> o [M, H·vd]
    o_lat [B, T·H, c] bf16 (= rows m·H + h), w_uv [H, c, vd], g [M, H·vd] bf16:
    y[m, h, j]   = bf16( Σ_{k<c} fp32(o_lat[m, h, k]) · fp32(w_uv[h, k, j]) )     (stock bmm)
    s[m, h·vd+j] = bf16( 1 / (1 + exp(-fp32(g))) )                 (eager torch.sigmoid on bf16:
                                                                     fp32 math, bf16 result)
    o[m, h·vd+j] = bf16( fp32(y) · fp32(s) )                         (eager bf16 multiply)
  (bf16·bf16 is exact in fp32, so the last line is one correctly rounded bf16 product: nvcc
  emits it as mul.bf16, same bits.) This is the EAGER stock_ops.sigmoid_gate. With
  cfg.compile_ops the stock module runs it torch.compile'd: inductor keeps σ(g) in fp32 (it
  does not emulate the intermediate bf16 rounding), i.e. o = bf16(fp32(y) · σ(g)); the two
  differ by ≤ 1 bf16 ulp of σ (2⁻⁹ relative) per element, well inside the 1e-2 tolerance.
  exp is cute.math.exp (range reduction + ex2.approx, ~2 fp32 ulp), torch uses expf: the
  bf16 rounding of σ differs only within a few fp32 ulps of a rounding boundary.
  Summation order (the only other difference to cuBLAS): per thread its P rows in order, a
  butterfly over the G lanes, then the 8 warp sums in warp order.

Layout (both kernels, one shared GEMM tile): a CTA owns one head h and COLS output columns
(a column tile ct) of that head's [K, N] weight (K = nope, N = c for uk; K = c, N = vd for
uv), for all M rows. 256 threads = 8 warps; within a warp, lane l owns the 8-column vector
v = l / G of the tile and the row offset rl = l % G (G = 32 / (COLS / 8) lanes per vector);
pass i covers weight rows r = i·(8·G) + warp·G + rl, so K / (8·G) passes cover K. Every
thread issues all its 128-bit weight loads first (P = 4 per thread for both kernels: 64 B
in flight per thread, 16 KB per CTA), then stages its head's activation rows in shared memory
as fp32 (M × K, ≤ 16 KB), then does P·M·8 FMAs into M × 8 fp32 accumulators. A butterfly over
the G lanes of a vector group (consecutive lanes: warp_reduction_sum(threads_in_group=G))
sums the rows of the warp, lane rl = 0 writes red[warp, m, col], one barrier, and thread
(m, col) adds the 8 warp sums in warp order and writes the bf16 result (uv: times the bf16
sigmoid of g, rounded again).
  uk_insert: COLS = 64 (G = 4), grid (c / 64, H) = (8, 6) = 48 CTAs, 16 KB of w_uk_t each.
    Side copies, by CTA-uniform branches, issued after the weight loads: CTAs of head 0 copy
    their 64 ckv columns of every row into the cache rows (M × 8 vectors); the ct = 0 CTA of
    each head copies q's rope part of that head into q_full (M × 8 vectors); the ct = 0 CTA of
    head H - 1 copies a's rope part into the cache rows (M × 8 vectors). Every copy is one
    128-bit load + store per thread; no two CTAs write the same bytes.
  uv_gate: COLS = 16 (G = 16), grid (vd / 16, H) = (8, 6) = 48 CTAs, 16 KB of w_uv each.

Why it should reach its target: the weights are 768 KB per kernel (0.2 µs of HBM); both
kernels are latency bound: one launch, one round of 4 independent 128-bit loads per thread
(all 48 CTAs in flight at once), ≤ 256 FMAs and ≤ 256 shuffles per thread at M = 8, one
barrier. Expected ~3 µs each at M = 1 (launch ~2 µs + one HBM round trip + the reduction)
against 4.1 µs (uk_bmm + kv_insert) and 4.5 µs (uv_bmm + gate_mul) for the stock pairs.

Check on the GPU (vs torch.bmm + OpSet(cfg).kv_insert and torch.bmm + sigmoid_gate, eager
and torch.compile'd; float64 reference; times both):
    python -m kimi_decode.kernels.mla_glue
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from kimi_decode.kernels import chain
from kimi_decode.kernels._common import (compile_options, compiled, current_stream, dummy_ptr, ptr,
                                         sigmoid)

THREADS = 256
WARPS = THREADS // 32
VEC = 8               # bf16 per 128-bit load
MAX_ROWS = 8          # M = B·T: accumulators M × 8 per thread, activations M × K fp32 in smem
UK_COLS = 64          # q_lat columns per uk_insert CTA
UV_COLS = 16          # o columns per uv_gate CTA
NORM_MAX_VECS = 4     # uk_insert_norm: c_kv vectors per lane (c ≤ 1024; K3: c = 512, 2)


@dataclass(frozen=True)
class GlueConfig:
    """Compile-time sizes. rows M = B·T, tokens T, heads H, per-head GEMM [K, N] with
    `cols` output columns per CTA. uk (kind "uk"): K = nope, N = c, plus the q row layout
    (qdim = nope + rope), the cache row (c + rope), and a's row width and rope offset. uv
    (kind "uv"): K = c, N = vd."""

    kind: str
    rows: int
    tokens: int
    heads: int
    k: int
    n: int
    cols: int
    rope: int = 64
    a_cols: int = 0
    rope_off: int = 0
    # uk_insert_norm: ckv = bf16(RMSNorm(a[:, ckv_off:ckv_off + c]; kv_norm, eps)) in-kernel
    norm: bool = False
    ckv_off: int = 0
    eps: float = 0.0

    @property
    def vpr(self) -> int:         # 8-column vectors per tile row
        return self.cols // VEC

    @property
    def group(self) -> int:       # lanes per vector (rows of a warp pass)
        return 32 // self.vpr

    @property
    def passes(self) -> int:      # weight loads per thread
        return self.k // (WARPS * self.group)


def _tile_ok(k: int, n: int, cols: int) -> bool:
    if cols % VEC or n % cols or cols // VEC > 32 or 32 % (cols // VEC):
        return False
    span = WARPS * (32 // (cols // VEC))           # weight rows per pass
    return k % span == 0 and 1 <= k // span <= 8


def can_implement_uk(rows: int, tokens: int, heads: int, nope: int, rope: int, kv_rank: int,
                     a_cols: int, rope_off: int, dtypes: tuple[torch.dtype, ...]) -> bool:
    """uk_insert: M = B·T ≤ 8 with T | M; rope a multiple of 8; the UK_COLS tiles divide c and
    the passes cover nope exactly; a's rope slice inside its row and 16-byte aligned; bf16."""
    return (1 <= rows <= MAX_ROWS and tokens >= 1 and rows % tokens == 0 and heads >= 1
            and rope % VEC == 0 and rope >= VEC and _tile_ok(nope, kv_rank, UK_COLS)
            and a_cols % VEC == 0 and rope_off % VEC == 0 and 0 <= rope_off and rope_off + rope <= a_cols
            and all(d == torch.bfloat16 for d in dtypes))


def can_implement_uk_norm(rows: int, tokens: int, heads: int, nope: int, rope: int, kv_rank: int,
                          a_cols: int, rope_off: int, ckv_off: int, dtypes: tuple[torch.dtype, ...]) -> bool:
    """uk_insert_norm: uk_insert's limits, plus a's c_kv slice 16-byte aligned and before the
    rope slice, and c a multiple of 256 with at most NORM_MAX_VECS vectors per lane (one warp
    holds a whole c_kv row: c / 256 128-bit loads per lane)."""
    return (can_implement_uk(rows, tokens, heads, nope, rope, kv_rank, a_cols, rope_off, dtypes)
            and rows <= WARPS and ckv_off % VEC == 0 and 0 <= ckv_off and ckv_off + kv_rank <= rope_off
            and kv_rank % (32 * VEC) == 0 and kv_rank // (32 * VEC) <= NORM_MAX_VECS)


def can_implement_uv(rows: int, heads: int, kv_rank: int, v_dim: int, dtypes: tuple[torch.dtype, ...]) -> bool:
    """uv_gate: M ≤ 8; the UV_COLS tiles divide vd and the passes cover c exactly; bf16."""
    return (1 <= rows <= MAX_ROWS and heads >= 1 and _tile_ok(kv_rank, v_dim, UV_COLS)
            and all(d == torch.bfloat16 for d in dtypes))


def can_implement(rows: int, tokens: int, heads: int, nope: int, rope: int, kv_rank: int,
                  v_dim: int, a_cols: int, rope_off: int, dtypes: tuple[torch.dtype, ...]) -> bool:
    """Both kernels (the K3 TP16 MLA layer at M = B·T ≤ 8)."""
    return (can_implement_uk(rows, tokens, heads, nope, rope, kv_rank, a_cols, rope_off, dtypes)
            and can_implement_uv(rows, heads, kv_rank, v_dim, dtypes))


class MLAGlue:
    """See the module docstring. kind "uk": uk_insert; kind "uv": uv_gate."""

    def __init__(self, cfg: GlueConfig) -> None:
        assert cfg.kind in ("uk", "uv") and _tile_ok(cfg.k, cfg.n, cfg.cols), cfg
        assert 1 <= cfg.rows <= MAX_ROWS and cfg.rows % cfg.tokens == 0, cfg
        self.cfg = cfg
        self.M, self.T, self.H, self.K, self.N = cfg.rows, cfg.tokens, cfg.heads, cfg.k, cfg.n
        self.B = cfg.rows // cfg.tokens
        self.VPR, self.G, self.P = cfg.vpr, cfg.group, cfg.passes
        self.COLS = cfg.cols
        self.SPAN = WARPS * self.G
        # uk: x rows are q [M, H, qdim]; the cache row is c + rope
        self.QD = cfg.k + cfg.rope
        self.D = cfg.n + cfg.rope
        self.RV = cfg.rope // VEC

    @cute.jit
    def __call__(self, x: cute.Pointer, w: cute.Pointer, out: cute.Pointer, g: cute.Pointer,
                 a: cute.Pointer, ckv: cute.Pointer, cache: cute.Pointer, pos: cute.Pointer,
                 cache_len: Int32, stream: cuda.CUstream):
        """uk: x = q, out = q_full, (a, ckv, cache, pos, cache_len) the insert; g unused
        (uk with `norm`: g = kv_a_norm's weight [c], ckv unused: c_kv is read from a).
        uv: x = o_lat, out = o, g = gate; a, ckv, cache, pos unused (any pointers)."""
        M, H, K, N = self.M, self.H, self.K, self.N
        mW = cute.make_tensor(w, cute.make_layout((H, K, N // VEC, VEC), stride=(K * N, N, VEC, 1)))
        grid = [N // self.COLS, H, 1]
        if cutlass.const_expr(self.cfg.kind == "uk"):
            QD, D, A = self.QD, self.D, self.cfg.a_cols
            mQ = cute.make_tensor(x, cute.make_layout((M, H, QD // VEC, VEC), stride=(H * QD, QD, VEC, 1)))
            mO = cute.make_tensor(out, cute.make_layout((M * H, D), stride=(D, 1)))
            mOv = cute.make_tensor(out, cute.make_layout((M * H, D // VEC, VEC), stride=(D, VEC, 1)))
            mA = cute.make_tensor(a, cute.make_layout((M, A // VEC, VEC), stride=(A, VEC, 1)))
            mC = cute.make_tensor(ckv, cute.make_layout((M, N // VEC, VEC), stride=(N, VEC, 1)))
            mK = cute.make_tensor(cache, cute.make_layout((self.B * cache_len, D // VEC, VEC),
                                                          stride=(D, VEC, 1)))
            mP = cute.make_tensor(pos, cute.make_layout(1))
            mN = cute.make_tensor(g, cute.make_layout((N // VEC, VEC), stride=(VEC, 1)))
            self.kernel_uk(mQ, mW, mO, mOv, mA, mC, mK, mP, mN, cache_len).launch(
                grid=grid, block=[THREADS, 1, 1], stream=stream, use_pdl=chain.chain_on())
        else:
            mX = cute.make_tensor(x, cute.make_layout((M, H, K // VEC, VEC), stride=(H * K, K, VEC, 1)))
            mO = cute.make_tensor(out, cute.make_layout((M, H * N), stride=(H * N, 1)))
            mG = cute.make_tensor(g, cute.make_layout((M, H * N), stride=(H * N, 1)))
            self.kernel_uv(mX, mW, mO, mG).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.jit
    def gemm_tile(self, mX: cute.Tensor, mW: cute.Tensor, s_x: cute.Tensor, red: cute.Tensor,
                  h: Int32, ct: Int32, tid: Int32, warp: Int32, lane: Int32, wbuf: cute.Tensor):
        """Stage x[:, h, :K] in shared memory (fp32), then the tile's partial sums into
        red[warp, m, col]; wbuf holds this thread's P weight vectors (already issued).
        Ends with a barrier: red is complete on return."""
        M, K = self.M, self.K
        KV = K // VEC
        xb = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
        for i in range(tid, M * KV, THREADS):
            m = i // KV
            v = i - m * KV
            cute.autovec_copy(mX[m, h, v, None], xb)
            for e in cutlass.range_constexpr(VEC):
                s_x[m, v * VEC + e] = xb[e].to(Float32)
        cute.arch.sync_threads()

        v = lane // self.G
        rl = lane - v * self.G
        acc = cute.make_rmem_tensor(cute.make_layout((M, VEC), stride=(VEC, 1)), Float32)
        acc.fill(0.0)
        wf = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
        for i in cutlass.range_constexpr(self.P):
            r = i * self.SPAN + warp * self.G + rl
            for e in cutlass.range_constexpr(VEC):
                wf[e] = wbuf[i, e].to(Float32)
            for m in cutlass.range_constexpr(M):
                xv = s_x[m, r]
                for e in cutlass.range_constexpr(VEC):
                    acc[m, e] = acc[m, e] + xv * wf[e]
        # Butterfly over the G consecutive lanes of this vector group (all 32 lanes take part;
        # only the store is predicated), then one value per (warp, m, column).
        for m in cutlass.range_constexpr(M):
            for e in cutlass.range_constexpr(VEC):
                s = cute.arch.warp_reduction_sum(acc[m, e], threads_in_group=self.G)
                if rl == 0:
                    red[warp, m, v * VEC + e] = s
        cute.arch.sync_threads()

    @cute.jit
    def load_w(self, mW: cute.Tensor, wbuf: cute.Tensor, h: Int32, ct: Int32, warp: Int32, lane: Int32):
        """wbuf[i] = w[h, r_i, ct·VPR + v] (the rows of pass i; always in bounds: the grid
        covers N exactly and P·SPAN = K)."""
        v = lane // self.G
        rl = lane - v * self.G
        for i in cutlass.range_constexpr(self.P):
            r = i * self.SPAN + warp * self.G + rl
            cute.autovec_copy(mW[h, r, ct * self.VPR + v, None], wbuf[i, None])

    @cute.kernel
    def kernel_uk(self, mQ: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor, mOv: cute.Tensor,
                  mA: cute.Tensor, mC: cute.Tensor, mK: cute.Tensor, mP: cute.Tensor, mN: cute.Tensor,
                  cache_len: Int32):
        M, T, H, COLS, VPR, RV = self.M, self.T, self.H, self.COLS, self.VPR, self.RV
        tid, _, _ = cute.arch.thread_idx()
        ct, h, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()          # full-warp shuffle: here, outside every branch
        lane = cute.arch.lane_idx()

        smem = cutlass.memory.SmemAllocator()
        s_x = smem.allocate_tensor(Float32, cute.make_layout((M, self.K), stride=(self.K, 1)), byte_alignment=16)
        red = smem.allocate_tensor(Float32, cute.make_layout((WARPS, M, COLS), stride=(M * COLS, COLS, 1)),
                                   byte_alignment=16)

        wbuf = cute.make_rmem_tensor(cute.make_layout((self.P, VEC), stride=(VEC, 1)), BFloat16)
        self.load_w(mW, wbuf, h, ct, warp, lane)
        chain.enter()      # PDL chain (kernels/chain.py): W_UK above; q, a, the cache below

        # The copies (CTA-uniform branches, no shuffles inside).
        p0 = mP[0].to(Int32)
        cv = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
        if cutlass.const_expr(self.cfg.norm):
            self.norm_ckv(mA, mN, mK, p0, cache_len, h, ct, warp, lane)
        else:
            if h == 0:                       # ckv columns of this tile -> cache rows
                for i in range(tid, M * VPR, THREADS):
                    m = i // VPR
                    v = i - m * VPR
                    b = m // T
                    p = p0 + (m - b * T)
                    if p >= 0:
                        if p < cache_len:
                            cute.autovec_copy(mC[m, ct * VPR + v, None], cv)
                            cute.autovec_copy(cv, mK[b * cache_len + p, ct * VPR + v, None])
        if ct == 0:                          # q's rope part of head h -> q_full
            for i in range(tid, M * RV, THREADS):
                m = i // RV
                v = i - m * RV
                cute.autovec_copy(mQ[m, h, self.K // VEC + v, None], cv)
                cute.autovec_copy(cv, mOv[m * H + h, self.N // VEC + v, None])
            if h == H - 1:                   # a's rope part -> cache rows
                for i in range(tid, M * RV, THREADS):
                    m = i // RV
                    v = i - m * RV
                    b = m // T
                    p = p0 + (m - b * T)
                    if p >= 0:
                        if p < cache_len:
                            cute.autovec_copy(mA[m, self.cfg.rope_off // VEC + v, None], cv)
                            cute.autovec_copy(cv, mK[b * cache_len + p, self.N // VEC + v, None])

        self.gemm_tile(mQ, mW, s_x, red, h, ct, tid, warp, lane, wbuf)
        for i in range(tid, M * COLS, THREADS):
            m = i // COLS
            col = i - m * COLS
            tot = Float32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                tot += red[w, m, col]
            mO[m * H + h, ct * COLS + col] = tot.to(BFloat16)

    @cute.jit
    def norm_ckv(self, mA: cute.Tensor, mN: cute.Tensor, mK: cute.Tensor, p0: Int32, cache_len: Int32,
                 h: Int32, ct: Int32, warp: Int32, lane: Int32):
        """uk_insert_norm's ckv copy: warp w normalises row m = w (M ≤ 8 warps) and the CTAs
        of head 0 write their tile's VPR vectors of it into the cache. Every warp of every
        CTA loads and reduces (row min(w, M-1): in bounds), so the butterfly is never inside
        a branch; only the stores are predicated.
            ss   = Σ_k fp32(a[m, ckv_off + k])²   (lane order, then a butterfly)
            rstd = rsqrt(ss / c + eps)
            ckv  = bf16( fp32(a) · rstd · fp32(kv_norm) )"""
        NV = self.N // (32 * VEC)               # c_kv vectors per lane (K3: 2)
        off = self.cfg.ckv_off // VEC
        mrow = cutlass.min(warp, Int32(self.M - 1))
        xr = cute.make_rmem_tensor(cute.make_layout((NV, VEC), stride=(VEC, 1)), BFloat16)
        for j in cutlass.range_constexpr(NV):
            cute.autovec_copy(mA[mrow, off + lane + 32 * j, None], xr[j, None])
        ss = Float32(0.0)
        for j in cutlass.range_constexpr(NV):
            for e in cutlass.range_constexpr(VEC):
                f = xr[j, e].to(Float32)
                ss = ss + f * f
        ss = cute.arch.warp_reduction_sum(ss)
        rstd = cute.math.rsqrt(ss / Float32(self.N) + Float32(self.cfg.eps))
        nb = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
        yb = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
        if h == 0:
            if warp < self.M:
                b = warp // self.T
                p = p0 + (warp - b * self.T)
                if p >= 0:
                    if p < cache_len:
                        for j in cutlass.range_constexpr(NV):
                            v = lane + 32 * j       # this lane's vector of the row
                            if v >= ct * self.VPR:
                                if v < ct * self.VPR + self.VPR:   # in this CTA's column tile
                                    cute.autovec_copy(mN[v, None], nb)
                                    for e in cutlass.range_constexpr(VEC):
                                        yb[e] = (xr[j, e].to(Float32) * rstd * nb[e].to(Float32)).to(BFloat16)
                                    cute.autovec_copy(yb, mK[b * cache_len + p, v, None])

    @cute.kernel
    def kernel_uv(self, mX: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor, mG: cute.Tensor):
        M, N, COLS = self.M, self.N, self.COLS
        tid, _, _ = cute.arch.thread_idx()
        ct, h, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()          # full-warp shuffle: here, outside every branch
        lane = cute.arch.lane_idx()

        smem = cutlass.memory.SmemAllocator()
        s_x = smem.allocate_tensor(Float32, cute.make_layout((M, self.K), stride=(self.K, 1)), byte_alignment=16)
        red = smem.allocate_tensor(Float32, cute.make_layout((WARPS, M, COLS), stride=(M * COLS, COLS, 1)),
                                   byte_alignment=16)

        wbuf = cute.make_rmem_tensor(cute.make_layout((self.P, VEC), stride=(VEC, 1)), BFloat16)
        self.load_w(mW, wbuf, h, ct, warp, lane)
        self.gemm_tile(mX, mW, s_x, red, h, ct, tid, warp, lane, wbuf)
        for i in range(tid, M * COLS, THREADS):
            m = i // COLS
            col = i - m * COLS
            tot = Float32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                tot += red[w, m, col]
            n = h * N + ct * COLS + col
            mO[m, n] = gated(tot, mG[m, n].to(Float32))


@cute.jit
def gated(tot: Float32, gate: Float32) -> BFloat16:
    """o = bf16( bf16(tot) · bf16(σ(gate)) ): the stock rounding points of uv_bmm + gate_mul
    (module docstring). Shared with mla_attend's uv mode, so both round identically."""
    y = tot.to(BFloat16).to(Float32)                                # the bmm's bf16 output
    s = sigmoid(gate).to(BFloat16).to(Float32)                      # torch.sigmoid in bf16
    return (y * s).to(BFloat16)                                     # the bf16 multiply


def config_uk(rows: int, tokens: int, heads: int, nope: int, rope: int, kv_rank: int,
              a_cols: int, rope_off: int) -> GlueConfig:
    return GlueConfig("uk", rows, tokens, heads, nope, kv_rank, UK_COLS, rope, a_cols, rope_off)


def config_uk_norm(rows: int, tokens: int, heads: int, nope: int, rope: int, kv_rank: int,
                   a_cols: int, rope_off: int, ckv_off: int, eps: float) -> GlueConfig:
    return GlueConfig("uk", rows, tokens, heads, nope, kv_rank, UK_COLS, rope, a_cols, rope_off,
                      norm=True, ckv_off=ckv_off, eps=float(eps))


def config_uv(rows: int, heads: int, kv_rank: int, v_dim: int) -> GlueConfig:
    return GlueConfig("uv", rows, 1, heads, kv_rank, v_dim, UV_COLS)


def compile_for(cfg: GlueConfig) -> object:
    """The compiled kernel for `cfg` (cached)."""
    def build() -> object:
        bf = dummy_ptr(torch.bfloat16)
        return cute.compile(MLAGlue(cfg), bf, bf, bf, bf, bf, bf, bf, dummy_ptr(torch.int64), Int32(1),
                            current_stream(), options=compile_options())
    return compiled(("mla_glue", cfg), build)


def uk_insert(q: torch.Tensor, a: torch.Tensor, ckv: torch.Tensor, w_uk_t: torch.Tensor,
              cache: torch.Tensor, pos: torch.Tensor, T: int, rope_off: int) -> torch.Tensor:
    """One launch for uk_bmm + kv_insert (module docstring). q [M, H, nope + rope], a [M, A],
    ckv [M, c], w_uk_t [H, nope, c], cache [B, C, c + rope] (written in place), pos int64 [1]
    on the device. Returns q_full [B, T·H, c + rope] bf16."""
    M, H, QD = q.shape
    Hw, nope, c = w_uk_t.shape
    B, C, D = cache.shape
    rope = D - c
    A = a.shape[1]
    if (Hw != H or QD != nope + rope or M != B * T or tuple(ckv.shape) != (M, c) or a.shape[0] != M
            or rope_off + rope != A
            or pos.dtype != torch.int64 or pos.numel() != 1
            or not can_implement_uk(M, T, H, nope, rope, c, A, rope_off,
                                    (q.dtype, a.dtype, ckv.dtype, w_uk_t.dtype, cache.dtype))):
        raise ValueError(f"uk_insert kernel cannot run q {tuple(q.shape)} cache {tuple(cache.shape)}")
    q_full = torch.empty(B, T * H, D, dtype=q.dtype, device=q.device)
    fn = compile_for(config_uk(M, T, H, nope, rope, c, A, rope_off))
    p = ptr(q)
    fn(p, ptr(w_uk_t), ptr(q_full), p, ptr(a), ptr(ckv), ptr(cache), ptr(pos), Int32(C), current_stream())
    return q_full


def uk_insert_norm(q: torch.Tensor, a: torch.Tensor, kv_norm: torch.Tensor, eps: float, w_uk_t: torch.Tensor,
                   cache: torch.Tensor, pos: torch.Tensor, T: int, rope_off: int, ckv_off: int) -> torch.Tensor:
    """uk_insert with qkv_norm's c_kv half inside: the cache rows get
    [bf16(RMSNorm(a[:, ckv_off:ckv_off + c]; kv_norm, eps)) | a[:, rope_off:rope_off + rope]]
    (module docstring). q [M, H, nope + rope], a [M, A], kv_norm [c]; the rest as uk_insert.
    Returns q_full [B, T·H, c + rope] bf16."""
    M, H, QD = q.shape
    Hw, nope, c = w_uk_t.shape
    B, C, D = cache.shape
    rope = D - c
    A = a.shape[1]
    if (Hw != H or QD != nope + rope or M != B * T or a.shape[0] != M or tuple(kv_norm.shape) != (c,)
            or rope_off + rope != A
            or pos.dtype != torch.int64 or pos.numel() != 1
            or not can_implement_uk_norm(M, T, H, nope, rope, c, A, rope_off, ckv_off,
                                         (q.dtype, a.dtype, kv_norm.dtype, w_uk_t.dtype, cache.dtype))):
        raise ValueError(f"uk_insert_norm kernel cannot run q {tuple(q.shape)} a {tuple(a.shape)} "
                         f"cache {tuple(cache.shape)}")
    q_full = torch.empty(B, T * H, D, dtype=q.dtype, device=q.device)
    fn = compile_for(config_uk_norm(M, T, H, nope, rope, c, A, rope_off, ckv_off, eps))
    p, pa = ptr(q), ptr(a)
    fn(p, ptr(w_uk_t), ptr(q_full), ptr(kv_norm), pa, pa, ptr(cache), ptr(pos), Int32(C), current_stream())
    return q_full


def uv_gate(o_lat: torch.Tensor, w_uv: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """One launch for uv_bmm + gate_mul (module docstring). o_lat [B, T·H, c] (rows m·H + h),
    w_uv [H, c, vd], g [M, H·vd]. Returns o [M, H·vd] bf16."""
    H, c, vd = w_uv.shape
    M = g.shape[0]
    if (o_lat.numel() != M * H * c or o_lat.shape[-1] != c or tuple(g.shape) != (M, H * vd)
            or not can_implement_uv(M, H, c, vd, (o_lat.dtype, w_uv.dtype, g.dtype))):
        raise ValueError(f"uv_gate kernel cannot run o_lat {tuple(o_lat.shape)} g {tuple(g.shape)}")
    o = torch.empty(M, H * vd, dtype=g.dtype, device=g.device)
    fn = compile_for(config_uv(M, H, c, vd))
    x = ptr(o_lat)
    # a, ckv, cache, pos are unused by the uv kernel: any valid pointers of the right types
    fn(x, ptr(w_uv), ptr(o), ptr(g), x, x, x, _pos_dummy(g.device), Int32(1), current_stream())
    return o


_POS_DUMMY: dict[torch.device, torch.Tensor] = {}


def _pos_dummy(dev: torch.device) -> torch.Tensor:
    t = _POS_DUMMY.get(dev)
    if t is None:
        t = _POS_DUMMY[dev] = torch.zeros(1, dtype=torch.int64, device=dev)
    return t


def reference_uk(q: torch.Tensor, a: torch.Tensor, ckv: torch.Tensor, w_uk_t: torch.Tensor,
                 cache: torch.Tensor, pos: int, T: int, rope_off: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 statement: (q_full [B, T·H, c + rope] with q_lat unrounded, the new cache).
    `cache` is not modified; `pos` is a host int."""
    M, H, QD = q.shape
    nope, c = w_uk_t.shape[1:]
    B, C, D = cache.shape
    rope = D - c
    q_lat = torch.einsum("mhk,hkj->mhj", q[..., :nope].double(), w_uk_t.double())
    q_full = torch.cat([q_lat, q[..., nope:].double()], -1).reshape(B, T * H, D)
    new = cache.double().clone()
    rows = torch.cat([ckv.double(), a[:, rope_off:rope_off + rope].double()], -1).reshape(B, T, D)
    new[:, pos:pos + T] = rows
    return q_full, new


def reference_uv(o_lat: torch.Tensor, w_uv: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """float64 statement: o = (o_lat @ w_uv per head) · σ(g), unrounded. [M, H·vd]."""
    H, c, vd = w_uv.shape
    M = g.shape[0]
    y = torch.einsum("mhk,hkj->mhj", o_lat.reshape(M, H, c).double(), w_uv.double()).reshape(M, H * vd)
    return y * torch.sigmoid(g.double())


def stock_uk(q, a, ckv, w_uk_t, cache, pos, T: int, rope_off: int, opset) -> torch.Tensor:
    """The stock op pair, as stock.MLAAttention.forward issues it (uk_bmm, kv_insert)."""
    nope = w_uk_t.shape[1]
    q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w_uk_t).transpose(0, 1)
    return opset.kv_insert(q_lat, q, ckv, a, rope_off, cache, pos, T)


def stock_uv(o_lat, w_uv, g, gate) -> torch.Tensor:
    """The stock op pair (uv_bmm, gate_mul) with `gate` = sigmoid_gate (eager or compiled)."""
    H, c, vd = w_uv.shape
    M = g.shape[0]
    o = torch.bmm(o_lat.reshape(M, H, c).transpose(0, 1), w_uv).transpose(0, 1)
    return gate(o.reshape(M, -1), g)


def check(timing: bool = True, cases: tuple[tuple[int, int], ...] = ((1, 0), (1, 7), (8, 0))) -> list[dict]:
    """Both kernels vs the stock op pairs (torch.bmm + OpSet(cfg).kv_insert; torch.bmm +
    sigmoid_gate eager and torch.compile'd) and the float64 references at the K3 TP16 shapes
    for (B, k) in `cases` (M = B·(k+1) ≤ 8). The cache rows written must equal stock's
    exactly (copies), every other cache row must stay untouched, q_full's rope half equal;
    q_full / o: rel ≤ 1e-2 vs stock and ≤ 1.5 × stock's f64 error + 1e-3."""
    from kimi_decode import stock_ops
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels.checks import DEVICE, _sync, rel, time_us
    dev = torch.device(DEVICE)
    gate_c = stock_ops.maybe_compiled(stock_ops.sigmoid_gate, True)
    out = []
    for bsz, k in cases:
        cfg = k3_tp16(batch=bsz, spec_tokens=k)
        H, T, c, rope = cfg.mla_local_heads, cfg.tokens_per_seq, cfg.kv_lora_rank, cfg.qk_rope_dim
        nope, vd, ql, C = cfg.qk_nope_dim, cfg.v_head_dim, cfg.q_lora_rank, cfg.cache_len
        M, A, rope_off = bsz * T, cfg.qkv_a_rows, ql + c
        opset = stock_ops.OpSet(cfg)
        gen = torch.Generator(device=dev).manual_seed(100 * bsz + k)
        rnd = lambda *s, sc=1.0: (torch.randn(*s, generator=gen, device=dev) * sc).bfloat16()  # noqa: E731
        q = rnd(M, H, nope + rope)
        a = rnd(M, A)
        ckv = rnd(M, c)
        w_uk_t = rnd(H, nope, c, sc=c ** -0.5)
        w_uv = rnd(H, c, vd, sc=c ** -0.5)
        cache0 = rnd(bsz, C, c + rope)
        pos_i = cfg.context_len + 3 * (1 + k)
        pos = torch.tensor([pos_i], dtype=torch.int64, device=dev)
        o_lat = rnd(bsz, T * H, c)
        g = rnd(M, H * vd, sc=2.0)

        # uk_insert
        cache_s, cache_k = cache0.clone(), cache0.clone()
        with torch.no_grad():
            qf_s = stock_uk(q, a, ckv, w_uk_t, cache_s, pos, T, rope_off, opset)
            qf_k = uk_insert(q, a, ckv, w_uk_t, cache_k, pos, T, rope_off)
        _sync()
        qf_ref, cache_ref = reference_uk(q, a, ckv, w_uk_t, cache0, pos_i, T, rope_off)
        lat_s, lat_k, lat_r = qf_s[..., :c], qf_k[..., :c], qf_ref[..., :c]
        e_ks, e_k, e_s = rel(lat_k, lat_s), rel(lat_k, lat_r), rel(lat_s, lat_r)
        cache_eq = torch.equal(cache_k, cache_s)
        cache_ref_eq = torch.equal(cache_k.double(), cache_ref)
        rope_eq = torch.equal(qf_k[..., c:], qf_s[..., c:])
        ok = (tuple(qf_k.shape) == tuple(qf_s.shape) and e_ks <= 1e-2 and e_k <= 1.5 * e_s + 1e-3
              and cache_eq and cache_ref_eq and rope_eq and bool(torch.isfinite(qf_k).all()))
        r = {"kernel": "mla_glue", "op": "uk_insert", "B": bsz, "k": k, "M": M,
             "rel_vs_stock": e_ks, "rel_vs_f64": e_k, "stock_rel_vs_f64": e_s,
             "cache_equal_stock": cache_eq, "cache_equal_f64": cache_ref_eq, "rope_equal": rope_eq,
             "ok": bool(ok)}
        if timing:
            r["stock_us"] = time_us(lambda: stock_uk(q, a, ckv, w_uk_t, cache_s, pos, T, rope_off, opset))
            r["kernel_us"] = time_us(lambda: uk_insert(q, a, ckv, w_uk_t, cache_k, pos, T, rope_off))
        out.append(r)

        # uv_gate
        with torch.no_grad():
            o_s = stock_uv(o_lat, w_uv, g, stock_ops.sigmoid_gate)
            o_c = stock_uv(o_lat, w_uv, g, gate_c)
            o_k = uv_gate(o_lat, w_uv, g)
        _sync()
        ref = reference_uv(o_lat, w_uv, g)
        e_ks, e_k, e_s, e_kc = rel(o_k, o_s), rel(o_k, ref), rel(o_s, ref), rel(o_k, o_c)
        ok = (tuple(o_k.shape) == tuple(o_s.shape) and e_ks <= 1e-2 and e_kc <= 1e-2
              and e_k <= 1.5 * e_s + 1e-3 and bool(torch.isfinite(o_k).all()))
        r = {"kernel": "mla_glue", "op": "uv_gate", "B": bsz, "k": k, "M": M,
             "rel_vs_stock": e_ks, "rel_vs_compiled": e_kc, "rel_vs_f64": e_k, "stock_rel_vs_f64": e_s,
             "bits_equal_stock": float((o_k == o_s).float().mean()), "ok": bool(ok)}
        if timing:
            r["stock_us"] = time_us(lambda: stock_uv(o_lat, w_uv, g, gate_c))
            r["stock_eager_us"] = time_us(lambda: stock_uv(o_lat, w_uv, g, stock_ops.sigmoid_gate))
            r["kernel_us"] = time_us(lambda: uv_gate(o_lat, w_uv, g))
        out.append(r)
    return out


if __name__ == "__main__":
    for row in check():
        print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
