"""Skinny GEMM on the tensor cores for 2 ≤ M ≤ 8 rows (kernel "gemv_mma"): out = x @ Wᵀ, bf16
in and out, fp32 accumulation, each weight streamed from HBM once.

Why: at M = 8 (B = 1 with k = 7 speculative tokens, or B = 8) every projection of the fused
step still ran the stock skinny GEMM (Triton) or cuBLAS: in the bundled B = 1, k = 7 trace
in_proj takes 20.8 µs for 46 MB (2.2 TB/s) where the M = 1 GEMV takes 13.7, and the MoE front
(latent_down + shared gate/up + router GEMM) ~42 µs for 88 MB. The CUDA-core GEMV does not fix
that: its split-K layout issues M·8 fp32 FMAs per weight element (in_proj at M = 8: 184 M FMAs,
~6 µs of the H200's FMA issue plus the converts) and measured 21-24 µs (gemv_variants rows of
bench/fused_correctness.md). One `mma.sync.m16n8k16` bf16 instruction does 2048 MACs, so on the
tensor cores the same product is pure weight streaming; M ≤ 8 is exactly the instruction's n.

Layout. A CTA owns TILE = 16 output columns (16 rows of W: the mma's m) and splits K over its
`warps` warps: chunk c (32 consecutive k) goes to warp c % warps, so in each round the CTA's warps
read 512 contiguous bytes of every one of its 16 rows. Per chunk, lane (g = lane / 4,
t = lane % 4) issues three 128-bit loads: W[row g][32c + 8t .. +8], W[row g + 8][same] and
x[min(g, M - 1)][same], and the warp runs two mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32 on
them. The k order inside a chunk is permuted, which a dot product does not care about, so that
every fragment comes from one 128-bit load instead of four 32-bit ones: PTX's fragments are
    A (16×16, row):  reg0 = A[g][2t, 2t+1]   reg1 = A[g+8][2t, 2t+1]
                     reg2 = A[g][2t+8, 2t+9] reg3 = A[g+8][2t+8, 2t+9]
    B (16×8, col):   reg0 = B[2t, 2t+1][g]   reg1 = B[2t+8, 2t+9][g]
    C (16×8, f32):   c0, c1 = C[g][2t, 2t+1] c2, c3 = C[g+8][2t, 2t+1]
and logical k (2t + j, 2t + 8 + j) of mma step s ∈ {0, 1} is physical k 32c + 8t + 4s + j and
32c + 8t + 4s + 2 + j: the 32-bit words w0..w3 of the lane's 128-bit W load (w_s = k pair 2s,
2s + 1 of its 8) give step 0 (w0, w1) and step 1 (w2, w3), and the x load's words the same. The
map depends on t and s only, so A and B agree on it (emulate() below replays it in float64).
Each warp unrolls `unroll` chunks: 3·unroll loads in flight per lane (4 chunks: 4 KB of weight
per warp, 32 KB per 8-warp CTA). Rows past N are clamped to N - 1 for the loads and never
stored; x rows ≥ M load row M - 1 and their output columns are dropped.

Finish: each lane puts its 4 accumulators in shared memory red[warp, lane, 4], one barrier, and
thread i < 128 = 16·8 adds the warps' values for (column i / 8, row i % 8) in warp order and
writes out[row, col] rounded to bf16 if row < M and col < N.

Exact math: out[m, n] = bf16(Σ_k fp32(x[m, k])·fp32(w[n, k])), the tensor cores' fp32
accumulation (each mma adds its 16 products to the running fp32 value; the PTX ISA leaves the
order inside one mma unspecified) then the in-order sum of the warps' partials, rounded once to
bf16 as torch's matmul rounds its accumulator: another summation order than stock's, so equal
within bf16 tolerance, not bit-equal.

PDL chain (kernels/chain.py): launched with PDL when the chain is on; the first chunk round's
weights are loaded before the wait (what no kernel of the step writes), x after it.

RMSNorm prologue (GemvMmaNorm, gemv_mma_rmsnorm; MLA's q_b_proj with qkv_norm's q half folded
in at 2 ≤ M ≤ 8, as gemv_rmsnorm does at M = 1): after the wait, warp r < M normalises row r
of a[:, :K] (row stride A: qkv_a's output) into shared memory, bf16((x · rstd) · w_norm) with
rstd = rsqrt(Σx² / K + eps) (gemv_rmsnorm's formula; stock's rounding point), one barrier,
then the mma loop reads x from there. Why: at M = 8 qkv_norm was a launch of its own (2.2-2.5
µs in the 6c4ee16 traces) between qkv_a and q_b; gemv_rmsnorm's CUDA-core layout took 17.2 µs
at M = 8 (kernels/mla_norm_fold.py), this keeps q_b on the tensor cores and adds one 3 KB L2
row read per warp and a barrier.

Expected: in_proj at M = 8 46 MB at the M = 1 GEMV's ~3.3-3.5 TB/s cold, ~13-14 µs vs the
stock skinny GEMM's 20.8 µs in the step; the check (`python -m kimi_decode.kernels.gemv_mma`)
times both on cold weights at M = 2, 4, 8 on every K3 projection shape the step runs.
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T

from kimi_decode.kernels import chain
from kimi_decode.kernels._common import compile_options, compiled, current_stream, dummy_ptr, ptr, wait_count
from kimi_decode.kernels.gemv import situ_act

MIN_ROWS = 2      # M = 1 keeps the CUDA-core GEMV (kernels/gemv.py), which beats stock there
MAX_ROWS = 8      # the mma's n
TILE = 16         # output columns per CTA (the mma's m)
CHUNK = 32        # k per lane round: 8 bf16 per lane × 4 lanes per row, two k16 mma steps
UNROLL = 4        # chunks whose loads a lane issues before its first mma
WARP_CHOICES = (16, 8, 4)   # warps per CTA, the first that divides the chunk count (see warps_for)
FEW_CTAS = 132    # below this many CTAs (one per SM) a CTA takes 16 warps when K allows
NORM_K_MULTIPLE = 256   # the RMSNorm prologue: K / 8 vectors shared evenly by a warp's 32 lanes
MMA_PTX = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
           "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")


@dataclass(frozen=True)
class GemvMmaConfig:
    """Compile-time sizes: output columns N, reduction K, rows M (2..8); warps per CTA and the
    unroll depth (chunks per lane in flight)."""

    n: int
    k: int
    rows: int
    warps: int = 8
    unroll: int = UNROLL
    out_f32: bool = False     # fp32 output (the router's logits), else bf16
    # SiTU-GLU prologue (the shared expert's down projection): x is h [M, 2K] and the kernel
    # multiplies bf16(SiTU(h[:, :K], h[:, K:])) (module docstring, "SiTU prologue")
    situ: bool = False
    beta: float = 0.0
    lin_beta: float = 0.0
    # RMSNorm prologue (MLA's q_b with qkv_norm's q half folded in, GemvMmaNorm): x is columns
    # [0, K) of rows of width x_stride (qkv_a's output), normalised with this eps
    eps: float = 0.0
    x_stride: int = 0
    # gemv_mma_pair.GemvMmaNormAfter: the producer CTAs' signals to wait for (0: not that kernel)
    after: int = 0


def warps_for(n: int, k: int) -> int:
    """Warps per CTA: 16 when the grid has fewer CTAs than SMs (shared gate/up, g_proj, q_b:
    more bytes in flight per CTA) and the chunk count allows, else 8, else 4; 0 if none
    divides K / 32."""
    chunks = k // CHUNK
    ctas = (n + TILE - 1) // TILE
    for w in WARP_CHOICES:
        if w == 16 and ctas >= FEW_CTAS:
            continue
        if chunks % w == 0:
            return w
    return 0


def can_implement(m: int, n: int, k: int, dtypes: tuple[torch.dtype, ...]) -> bool:
    """2 ≤ M ≤ 8, K a multiple of 32 whose chunk count some WARP_CHOICES entry divides, bf16."""
    return (MIN_ROWS <= m <= MAX_ROWS and n >= 1 and k % CHUNK == 0 and warps_for(n, k) > 0
            and all(d == torch.bfloat16 for d in dtypes))


@cute.jit
def mma_bf16(acc: cute.Tensor, a0: Int32, a1: Int32, a2: Int32, a3: Int32, b0: Int32, b1: Int32):
    """acc[0:4] += A·B for one m16n8k16 bf16 mma (fragments as packed bf16x2 words)."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32(), T.f32(), T.f32(), T.f32()]),
        [Int32(a0).ir_value(), Int32(a1).ir_value(), Int32(a2).ir_value(), Int32(a3).ir_value(),
         Int32(b0).ir_value(), Int32(b1).ir_value(),
         Float32(acc[0]).ir_value(), Float32(acc[1]).ir_value(), Float32(acc[2]).ir_value(),
         Float32(acc[3]).ir_value()],
        MMA_PTX,
        "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    for i in cutlass.range_constexpr(4):
        acc[i] = Float32(llvm.extractvalue(T.f32(), res, [i]))


class GemvMma:
    """See the module docstring."""

    def __init__(self, cfg: GemvMmaConfig) -> None:
        assert MIN_ROWS <= cfg.rows <= MAX_ROWS and cfg.k % CHUNK == 0, cfg
        assert cfg.warps in WARP_CHOICES and (cfg.k // CHUNK) % cfg.warps == 0, cfg
        assert cfg.unroll >= 1, cfg
        self.cfg = cfg
        self.per_warp = cfg.k // CHUNK // cfg.warps          # chunks each warp takes
        self.u = min(cfg.unroll, self.per_warp)
        self.rounds = self.per_warp // self.u                # full unrolled rounds
        self.rest = self.per_warp - self.rounds * self.u     # chunks of the last, short round
        self.ctas = (cfg.n + TILE - 1) // TILE

    @cute.jit
    def __call__(self, x: cute.Pointer, w: cute.Pointer, out: cute.Pointer, stream: cuda.CUstream):
        n, k, m = self.cfg.n, self.cfg.k, self.cfg.rows
        # 128-bit vectors of 4 packed bf16 pairs: [rows, K / 8, 4] words
        x32 = cute.recast_ptr(x, dtype=Int32)
        w32 = cute.recast_ptr(w, dtype=Int32)
        if cutlass.const_expr(self.cfg.situ):       # h [M, 2K] as [M, 2K / 8, 8] bf16 vectors
            mX = cute.make_tensor(x, cute.make_layout((m, k // 4, 8), stride=(2 * k, 8, 1)))
        else:
            mX = cute.make_tensor(x32, cute.make_layout((m, k // 8, 4), stride=(k // 2, 4, 1)))
        mW = cute.make_tensor(w32, cute.make_layout((n, k // 8, 4), stride=(k // 2, 4, 1)))
        mO = cute.make_tensor(out, cute.make_layout((m, n), stride=(n, 1)))
        self.kernel(mX, mW, mO).launch(grid=[self.ctas, 1, 1], block=[self.cfg.warps * 32, 1, 1],
                                       stream=stream, use_pdl=chain.chain_on())

    @cute.jit
    def load_round(self, mX: cute.Tensor, mW: cute.Tensor, wv: cute.Tensor, xv: cute.Tensor,
                   base: Int32, count: cutlass.Constexpr[int], warp: Int32, t: Int32,
                   row_lo: Int32, row_hi: Int32, xrow: Int32, with_x: cutlass.Constexpr[bool]):
        """Loads of chunks base .. base + count - 1 of this warp (chunk j is K chunk
        warp + j·warps): the two weight vectors, and the x vector when `with_x`."""
        for u in cutlass.range_constexpr(count):
            v = (warp + (base + u) * self.cfg.warps) * 4 + t      # 128-bit vector index in the row
            cute.autovec_copy(mW[row_lo, v, None], wv[u, 0, None])
            cute.autovec_copy(mW[row_hi, v, None], wv[u, 1, None])
            if cutlass.const_expr(with_x):
                cute.autovec_copy(mX[xrow, v, None], xv[u, None])

    @cute.jit
    def load_x(self, mX: cute.Tensor, xv: cute.Tensor, base: Int32, count: cutlass.Constexpr[int],
               warp: Int32, t: Int32, xrow: Int32):
        for u in cutlass.range_constexpr(count):
            v = (warp + (base + u) * self.cfg.warps) * 4 + t
            cute.autovec_copy(mX[xrow, v, None], xv[u, None])

    @cute.jit
    def mma_round(self, acc: cute.Tensor, wv: cute.Tensor, xv: cute.Tensor, count: cutlass.Constexpr[int]):
        """Two mma steps per loaded chunk (words 0, 1 then 2, 3 of each 128-bit vector)."""
        for u in cutlass.range_constexpr(count):
            mma_bf16(acc, wv[u, 0, 0], wv[u, 1, 0], wv[u, 0, 1], wv[u, 1, 1], xv[u, 0], xv[u, 1])
            mma_bf16(acc, wv[u, 0, 2], wv[u, 1, 2], wv[u, 0, 3], wv[u, 1, 3], xv[u, 2], xv[u, 3])

    @cute.jit
    def stage_situ(self, mH: cute.Tensor, sX: cute.Tensor, tidx: Int32):
        """The SiTU prologue: x[r, :] = bf16(SiTU(h[r, :K], h[r, K:])) for every row r < M into
        shared memory, 8 elements (one 128-bit load of gate and of up) per thread and step."""
        kv = self.cfg.k // 8
        units = self.cfg.rows * kv
        threads = self.cfg.warps * 32
        gv = cute.make_rmem_tensor(cute.make_layout(8), mH.element_type)
        uv = cute.make_rmem_tensor(cute.make_layout(8), mH.element_type)
        av = cute.make_rmem_tensor(cute.make_layout(8), mH.element_type)
        for s in cutlass.range_constexpr((units + threads - 1) // threads):
            unit = tidx + s * threads
            if unit < units:
                r = unit // kv
                c = unit - r * kv
                cute.autovec_copy(mH[r, c, None], gv)           # gate: h[r, 8c : 8c + 8]
                cute.autovec_copy(mH[r, kv + c, None], uv)      # up:   h[r, K + 8c : ...]
                for j in cutlass.range_constexpr(8):
                    av[j] = situ_act(gv[j].to(Float32), uv[j].to(Float32), self.cfg.beta,
                                     self.cfg.lin_beta).to(mH.element_type)
                cute.autovec_copy(av, sX[r, c, None])
        cute.arch.sync_threads()

    @cute.jit
    def stage_norm(self, mA: cute.Tensor, mNw: cute.Tensor, sX: cute.Tensor, warp: Int32, lane: Int32):
        """The RMSNorm prologue: warp r < M takes row r of a (K / 256 128-bit vectors per lane,
        slices lane + 32·i), ss = Σ fp32(x)² in slice order then a butterfly, rstd = rsqrt(ss / K
        + eps), and writes xn = bf16((fp32(x) · rstd) · fp32(w_norm)) (stock's rounding point,
        gemv_rmsnorm's formula) into sX [M, K / 8, 8]; then one barrier."""
        k, m, W = self.cfg.k, self.cfg.rows, self.cfg.warps
        per_lane = k // 8 // 32
        xv = cute.make_rmem_tensor(cute.make_layout((per_lane, 8), stride=(8, 1)), mA.element_type)
        wv = cute.make_rmem_tensor(cute.make_layout(8), mNw.element_type)
        ov = cute.make_rmem_tensor(cute.make_layout(8), mA.element_type)
        for rr in cutlass.range_constexpr((m + W - 1) // W):
            r = warp + rr * W
            if r < m:                                   # warp-uniform
                for i in cutlass.range_constexpr(per_lane):
                    cute.autovec_copy(mA[r, lane + 32 * i, None], xv[i, None])
                ss = Float32(0.0)
                for i in cutlass.range_constexpr(per_lane):
                    for j in cutlass.range_constexpr(8):
                        ss += xv[i, j].to(Float32) * xv[i, j].to(Float32)
                ss = cute.arch.warp_reduction_sum(ss)
                rstd = cute.math.rsqrt(ss / k + Float32(self.cfg.eps))
                for i in cutlass.range_constexpr(per_lane):
                    cute.autovec_copy(mNw[lane + 32 * i, None], wv)
                    for j in cutlass.range_constexpr(8):
                        ov[j] = ((xv[i, j].to(Float32) * rstd) * wv[j].to(Float32)).to(mA.element_type)
                    cute.autovec_copy(ov, sX[r, lane + 32 * i, None])
        cute.arch.sync_threads()

    @cute.jit
    def tile_partials(self, mX: cute.Tensor, mW: cute.Tensor, red: cute.Tensor, tile: Int32,
                      tidx: Int32, warp: Int32, lane: Int32, release: cutlass.Constexpr[bool] = True,
                      mNw: cute.Tensor | None = None, after: cute.Tensor | None = None,
                      after_target: cutlass.Constexpr[int] = 0, wait_now: cutlass.Constexpr[bool] = True):
        """The CTA's 16 × M partial products over its K range: round 0's weights before the
        chain's wait, then (SiTU prologue: staged after the wait) every round's loads and mma;
        each warp's accumulators land in red[warp, lane, :] and the CTA meets at a barrier.
        mX: x as [M, K / 8, 4] words, or h [M, 2K / 8, 8] bf16 with the SiTU prologue.
        `release=False`: the chain's wait only; the caller releases the next kernel later.
        `mNw` (GemvMmaNorm): the RMSNorm weight; mX is then a [M, K / 8, 8] bf16 view of a's
        rows, normalised into shared memory after the wait (stage_norm).
        `after` (gemv_mma_pair.SIGNAL): after the chain's step, wait until `after_target`
        producer CTAs of the previous grid have signalled on counter after[0] (wait_count);
        `wait_now=False`: the chain's step is the release alone, and the caller waits for the
        previous grid at its end (the pair's consumer, gemv_mma_pair.GemvMmaNormAfter)."""
        n, m, U = self.cfg.n, self.cfg.rows, self.u
        g = lane // 4
        t = lane - g * 4
        row_lo = cutlass.min(tile * TILE + g, Int32(n - 1))
        row_hi = cutlass.min(tile * TILE + g + 8, Int32(n - 1))
        xrow = cutlass.min(g, Int32(m - 1))
        acc = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        acc.fill(0.0)
        wv = cute.make_rmem_tensor(cute.make_layout((U, 2, 4), stride=(8, 4, 1)), Int32)
        xv = cute.make_rmem_tensor(cute.make_layout((U, 4), stride=(4, 1)), Int32)
        # round 0: its weights before the chain's wait (weights are never written by the step)
        self.load_round(mX, mW, wv, xv, Int32(0), U, warp, t, row_lo, row_hi, xrow, False)
        if cutlass.const_expr(not wait_now):
            chain.release()
        elif cutlass.const_expr(release):
            chain.enter()
        else:
            chain.wait()
        if cutlass.const_expr(after is not None):
            wait_count(after, after_target, tidx)
        if cutlass.const_expr(self.cfg.situ):
            k = self.cfg.k
            smem = cutlass.memory.SmemAllocator()
            sX = smem.allocate_tensor(mX.element_type, cute.make_layout((m, k // 8, 8), stride=(k, 8, 1)),
                                      byte_alignment=16)
            self.stage_situ(mX, sX, tidx)
            mX = cute.make_tensor(cute.recast_ptr(sX.iterator, dtype=Int32),
                                  cute.make_layout((m, k // 8, 4), stride=(k // 2, 4, 1)))
        if cutlass.const_expr(mNw is not None):
            k = self.cfg.k
            smem = cutlass.memory.SmemAllocator()
            sX = smem.allocate_tensor(mX.element_type, cute.make_layout((m, k // 8, 8), stride=(k, 8, 1)),
                                      byte_alignment=16)
            self.stage_norm(mX, mNw, sX, warp, lane)
            mX = cute.make_tensor(cute.recast_ptr(sX.iterator, dtype=Int32),
                                  cute.make_layout((m, k // 8, 4), stride=(k // 2, 4, 1)))
        self.load_x(mX, xv, Int32(0), U, warp, t, xrow)
        self.mma_round(acc, wv, xv, U)
        for i in cutlass.range(1, self.rounds, unroll=1):
            self.load_round(mX, mW, wv, xv, i * U, U, warp, t, row_lo, row_hi, xrow, True)
            self.mma_round(acc, wv, xv, U)
        if cutlass.const_expr(self.rest > 0):
            self.load_round(mX, mW, wv, xv, Int32(self.rounds * U), self.rest, warp, t, row_lo, row_hi,
                            xrow, True)
            self.mma_round(acc, wv, xv, self.rest)
        for i in cutlass.range_constexpr(4):
            red[warp, lane, i] = acc[i]
        cute.arch.sync_threads()

    @cute.jit
    def tile_sum(self, red: cute.Tensor, tidx: Int32) -> tuple[Int32, Int32, Float32]:
        """For thread tidx < 128: (tile column c, x row r, the warps' partials added in warp
        order) of output (r, 16·tile + c)."""
        c = tidx // 8                               # tile column (weight row) 0..15
        r = tidx - c * 8                            # x row 0..7
        src_lane = (c % 8) * 4 + r // 2             # the lane holding (c, r) ...
        src_i = (c // 8) * 2 + r % 2                # ... in accumulator src_i
        tot = Float32(0.0)
        for w in cutlass.range_constexpr(self.cfg.warps):
            tot += red[w, src_lane, src_i]
        return c, r, tot

    def smem_red(self) -> cute.Tensor:
        """The warps' accumulators in shared memory (allocated first, inside a kernel)."""
        smem = cutlass.memory.SmemAllocator()
        return smem.allocate_tensor(Float32, cute.make_layout((self.cfg.warps, 32, 4), stride=(128, 4, 1)),
                                    byte_alignment=16)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor):
        n, m = self.cfg.n, self.cfg.rows
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()                     # all 32 lanes, before any branch
        lane = cute.arch.lane_idx()
        red = self.smem_red()
        self.tile_partials(mX, mW, red, bidx, tidx, warp, lane)
        if tidx < TILE * 8:
            c, r, tot = self.tile_sum(red, tidx)
            col = bidx * TILE + c
            if r < m:
                if col < n:
                    mO[r, col] = tot.to(mO.element_type)


class GemvMmaNorm(GemvMma):
    """out = bf16(RMSNorm(a[:, :K]; w_norm, eps)) @ Wᵀ (module docstring, "RMSNorm prologue")."""

    def __init__(self, cfg: GemvMmaConfig) -> None:
        super().__init__(cfg)
        assert cfg.k % NORM_K_MULTIPLE == 0 and cfg.x_stride >= cfg.k and cfg.x_stride % 8 == 0, cfg

    @cute.jit
    def norm_views(self, a: cute.Pointer, w_norm: cute.Pointer, w: cute.Pointer, out: cute.Pointer):
        """a's rows as [M, K / 8, 8] bf16 (stride x_stride), w_norm [K / 8, 8], W as int32 words,
        the output [M, N]."""
        n, k, m, xs = self.cfg.n, self.cfg.k, self.cfg.rows, self.cfg.x_stride
        mA = cute.make_tensor(a, cute.make_layout((m, k // 8, 8), stride=(xs, 8, 1)))
        mNw = cute.make_tensor(w_norm, cute.make_layout((k // 8, 8), stride=(8, 1)))
        mW = cute.make_tensor(cute.recast_ptr(w, dtype=Int32), cute.make_layout((n, k // 8, 4), stride=(k // 2, 4, 1)))
        mO = cute.make_tensor(out, cute.make_layout((m, n), stride=(n, 1)))
        return mA, mNw, mW, mO

    @cute.jit
    def __call__(self, a: cute.Pointer, w_norm: cute.Pointer, w: cute.Pointer, out: cute.Pointer,
                 stream: cuda.CUstream):
        mA, mNw, mW, mO = self.norm_views(a, w_norm, w, out)
        self.kernel_norm(mA, mNw, mW, mO).launch(grid=[self.ctas, 1, 1], block=[self.cfg.warps * 32, 1, 1],
                                                 stream=stream, use_pdl=chain.chain_on())

    @cute.kernel
    def kernel_norm(self, mA: cute.Tensor, mNw: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()                     # all 32 lanes, before any branch
        lane = cute.arch.lane_idx()
        red = self.smem_red()
        self.tile_partials(mA, mW, red, bidx, tidx, warp, lane, True, mNw)
        self.store_out(red, mO, bidx, tidx)

    @cute.jit
    def store_out(self, red: cute.Tensor, mO: cute.Tensor, bidx: Int32, tidx: Int32):
        """The tile's finish: thread tidx < 128 writes output (row, 16·bidx + column)."""
        if tidx < TILE * 8:
            c, r, tot = self.tile_sum(red, tidx)
            col = bidx * TILE + c
            if r < self.cfg.rows:
                if col < self.cfg.n:
                    mO[r, col] = tot.to(mO.element_type)


def compile_for(cfg: GemvMmaConfig) -> object:
    """The compiled kernel for `cfg` (cached)."""
    def build() -> object:
        bf = dummy_ptr(torch.bfloat16)
        o = dummy_ptr(torch.float32 if cfg.out_f32 else torch.bfloat16)
        return cute.compile(GemvMma(cfg), bf, bf, o, current_stream(), options=compile_options())
    return compiled(("gemv_mma", cfg), build)


def compile_norm(cfg: GemvMmaConfig) -> object:
    """The compiled GemvMmaNorm for `cfg` (cached)."""
    def build() -> object:
        bf = dummy_ptr(torch.bfloat16)
        return cute.compile(GemvMmaNorm(cfg), bf, bf, bf, bf, current_stream(), options=compile_options())
    return compiled(("gemv_mma_norm", cfg), build)


# Per weight shape (N, K): (warps per CTA, chunks in flight per lane), used at 2 ≤ M ≤ 8 when
# the kernel set "gemv_mma_tuned" is on (set_tuned; fused.FusedDecoder._apply_modes); shapes
# not listed keep warps_for and UNROLL. Every configuration computes the same products; only
# the split of K over the warps (their fp32 partial sums) differs, so results agree within
# bf16 rounding (check_sweep holds each to check()'s rule). From check_sweep on the H200 at
# 0bb4935 (cold weights, M = 8; bench/fused_correctness.md) and the step: 16 warps × 4 won
# alone for in_proj (14.5 vs 16.1 µs), latent_down (15.8 vs 17.2) and qkv_a (10.9 vs 13.7),
# but in the bench (one process per entry, fused only, bench/fused_runs.md session 11)
# latent_down's made the KDA layer 6 µs slower (214.8 vs 208.7 µs at B = 1, k = 7: its
# 16-warp grid beside the router's logits and FC1's resident CTAs), so only these two:
# in_proj: KDA layer 206.9 / 201.7 µs (B = 1, k = 7 / B = 8) vs 208.7 / 203.6;
# qkv_a: MLA layer 222.0 / 225.8 µs vs 224.7 / 229.6.
TUNED: dict[tuple[int, int], tuple[int, int]] = {
    (3216, 7168): (16, 4),     # in_proj
    (2112, 7168): (16, 4),     # qkv_a
}
_tuned_on = False


def set_tuned(on: bool) -> None:
    """Use TUNED at 2 ≤ M ≤ 8 (kernel set "gemv_mma_tuned") or not."""
    global _tuned_on
    _tuned_on = bool(on)


def tuned_on() -> bool:
    return _tuned_on


def config_valid(k: int, warps: int, unroll: int) -> bool:
    """A (warps, unroll) the kernel can build for reduction length K."""
    return warps in WARP_CHOICES and k % CHUNK == 0 and (k // CHUNK) % warps == 0 and unroll >= 1


def config_for(m: int, n: int, k: int, unroll: int | None = None, out_f32: bool = False,
               warps: int | None = None) -> GemvMmaConfig:
    """The launch configuration: explicit `warps` / `unroll`, else TUNED's entry for (N, K) when
    the tuned mode is on, else warps_for and UNROLL."""
    tw, tu = TUNED.get((n, k), (None, None)) if _tuned_on else (None, None)
    w, u = warps or tw or warps_for(n, k), unroll or tu or UNROLL
    if not config_valid(k, w, u):
        raise ValueError(f"gemv_mma cannot split K = {k} over {w} warps with unroll {u}")
    return GemvMmaConfig(n, k, m, warps=w, unroll=u, out_f32=out_f32)


# Process-wide switch (kernel "gemv_mma" with "gemv"), set by fused.enable() and each forward
# (FusedDecoder._apply_modes) as gemv.set_tuned is; fused._linear reads it per call.
_enabled = False


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


def gemv_mma(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
             unroll: int | None = None, out_dtype: torch.dtype = torch.bfloat16,
             warps: int | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]ᵀ on the current stream for 2 ≤ M ≤ 8; both contiguous bf16; returns
    [M, N] in `out_dtype` (bf16, or float32 for the router's logits: the fp32 sum unrounded),
    written into `out` when given (a contiguous [M, N] tensor of that dtype, e.g. an
    all-reduce slot buf[rank]). `unroll`: chunks in flight per lane (the check times 4 and 8;
    the result does not depend on it); `warps`: warps per CTA (the sum order over K does);
    both default to config_for's choice (TUNED in the tuned mode)."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or not can_implement(m, n, k, (x.dtype, w.dtype)):
        raise ValueError(f"gemv_mma cannot run M={m} N={n} K={k} ({x.dtype}, {w.dtype})")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"gemv_mma writes bf16 or float32, not {out_dtype}")
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    elif tuple(out.shape) != (m, n) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"gemv_mma out must be a contiguous [{m}, {n}] {out_dtype} tensor, got "
                         f"{tuple(out.shape)} {out.dtype}")
    cfg = config_for(m, n, k, unroll, out_f32=out_dtype == torch.float32, warps=warps)
    compile_for(cfg)(ptr(x), ptr(w), ptr(out), current_stream())
    return out


def can_implement_situ(m: int, n: int, inter: int, dtypes: tuple[torch.dtype, ...]) -> bool:
    """The SiTU prologue: h [M, 2·inter] @ w [N, inter]; can_implement's rules with K = inter."""
    return can_implement(m, n, inter, dtypes)


def gemv_mma_situ(h: torch.Tensor, w: torch.Tensor, inter: int, beta: float, lin_beta: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16(SiTU(h[:, :inter], h[:, inter:])) @ wᵀ for 2 ≤ M ≤ 8 in one launch (the shared
    expert's GLU + down projection; stock: situ_glu then the GEMM, two kernels); h [M, 2·inter]
    and w [N, inter] contiguous bf16; returns [M, N] bf16, into `out` when given."""
    m = h.shape[0]
    n = w.shape[0]
    if (h.shape[1] != 2 * inter or w.shape[1] != inter or not h.is_contiguous()
            or not can_implement_situ(m, n, inter, (h.dtype, w.dtype))):
        raise ValueError(f"gemv_mma_situ cannot run h {tuple(h.shape)} w {tuple(w.shape)} inter={inter}")
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=h.device)
    elif tuple(out.shape) != (m, n) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"gemv_mma_situ out must be a contiguous [{m}, {n}] bf16 tensor, got "
                         f"{tuple(out.shape)} {out.dtype}")
    cfg = GemvMmaConfig(n, inter, m, warps=warps_for(n, inter), situ=True, beta=float(beta),
                        lin_beta=float(lin_beta))
    compile_for(cfg)(ptr(h), ptr(w), ptr(out), current_stream())
    return out


def can_implement_norm(m: int, n: int, k: int, a_cols: int, dtypes: tuple[torch.dtype, ...]) -> bool:
    """The RMSNorm prologue: can_implement's rules, K a multiple of NORM_K_MULTIPLE (whole
    128-bit vectors per lane), a's rows at least K wide and 16-byte aligned."""
    return (can_implement(m, n, k, dtypes) and k % NORM_K_MULTIPLE == 0 and a_cols >= k
            and a_cols % 8 == 0)


def norm_config(a: torch.Tensor, w_norm: torch.Tensor, w: torch.Tensor, k: int, eps: float) -> GemvMmaConfig:
    """gemv_mma_rmsnorm's launch configuration, after checking its arguments (ValueError)."""
    m, A = a.shape
    n = w.shape[0]
    if (w.dim() != 2 or w.shape[1] != k or tuple(w_norm.shape) != (k,) or not a.is_contiguous()
            or not w.is_contiguous() or not can_implement_norm(m, n, k, A, (a.dtype, w_norm.dtype, w.dtype))):
        raise ValueError(f"gemv_mma_rmsnorm cannot run a {tuple(a.shape)} w {tuple(w.shape)} k={k}")
    return GemvMmaConfig(n, k, m, warps=warps_for(n, k), eps=float(eps), x_stride=A)


def gemv_mma_rmsnorm(a: torch.Tensor, w_norm: torch.Tensor, w: torch.Tensor, k: int, eps: float) -> torch.Tensor:
    """bf16(RMSNorm(a[:, :k]; w_norm, eps)) @ w[N, k]ᵀ for 2 ≤ M ≤ 8 in one launch (MLA:
    qkv_norm's q half + q_b_proj; kernels/gemv.py's gemv_rmsnorm at M = 1); a [M, A ≥ k]
    contiguous bf16 (its first k columns are read), w_norm [k], w [N, k]; returns [M, N] bf16.
    Equal to gemv_mma(xn, w) for xn = the prologue's normalised rows, which equal stock's
    mla_norms q half except where rstd's last fp32 bits move a product across a bf16 rounding
    boundary (kernels/mla_norm_fold.py's check)."""
    cfg = norm_config(a, w_norm, w, k, eps)
    out = torch.empty(a.shape[0], cfg.n, dtype=torch.bfloat16, device=a.device)
    compile_norm(cfg)(ptr(a), ptr(w_norm), ptr(w), ptr(out), current_stream())
    return out


# ---- float64 replay of the fragment mapping (CPU tests) and the device check ----

def physical_k(c: int, t: int, s: int, logical: int) -> int:
    """The K index the kernel feeds as logical k (0..15) of mma step s in chunk c, for the
    k-pair owner t (logical ∈ {2t, 2t+1, 2t+8, 2t+9})."""
    j = logical % 2
    hi = logical >= 8
    assert logical - 8 * hi - j == 2 * t
    return CHUNK * c + 8 * t + 4 * s + 2 * hi + j


def emulate(x: torch.Tensor, w: torch.Tensor, warps: int) -> torch.Tensor:
    """The kernel's arithmetic in float64, fragment by fragment: per CTA tile and warp, each
    mma step gathers A[r][logical] = W[row r][physical_k(...)] and B[logical][col] =
    x[col][physical_k(...)] through the same per-lane map the kernel uses, accumulates A·B,
    then the warps are summed in order; rows ≥ M and columns ≥ N are dropped as the kernel
    drops them. Returns [M, N] float64 (no bf16 rounding)."""
    x = x.double()
    w = w.double()
    m, k = x.shape
    n = w.shape[0]
    chunks = k // CHUNK
    out = torch.zeros(m, n, dtype=torch.float64)
    for tile in range((n + TILE - 1) // TILE):
        rows = [min(tile * TILE + r, n - 1) for r in range(TILE)]
        xr = [min(col, m - 1) for col in range(8)]
        part = torch.zeros(warps, TILE, 8, dtype=torch.float64)
        for wp in range(warps):
            for c in range(wp, chunks, warps):
                for s in range(2):
                    A = torch.zeros(TILE, 16, dtype=torch.float64)
                    B = torch.zeros(16, 8, dtype=torch.float64)
                    for lane in range(32):
                        g, t = divmod(lane, 4)
                        for logical in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9):
                            kk = physical_k(c, t, s, logical)
                            A[g, logical] = w[rows[g], kk]
                            A[g + 8, logical] = w[rows[g + 8], kk]
                            B[logical, g] = x[xr[g], kk]
                    part[wp] += A @ B
        tot = part.sum(0)
        for r in range(TILE):
            col = tile * TILE + r
            if col < n:
                out[:, col] = tot[r, :m]
    return out


def check(timing: bool = True) -> list[dict]:
    """gemv_mma vs the stock path's GEMM op (stock_ops.OpSet.linear: the Triton skinny GEMM at
    these M) on every K3 TP16 projection the fused step runs at M = 2..8, at M = 2, 4, 8: bf16
    tolerance against stock and float64 (checks.py's rule), `out=` into a slot leaves the other
    slots untouched. With timing, both on COLD weights (the calls cycle through copies ≥ 160 MB,
    beyond the 50 MB L2, as in the step): stock_us, kernel_us, kernel_tbs."""
    import itertools

    from kimi_decode import stock_ops
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels import checks
    dev = torch.device(checks.DEVICE)
    cfg = k3_tp16(batch=8, spec_tokens=0)
    ops = stock_ops.OpSet(cfg)
    D = cfg.hidden
    shapes = {"in_proj": (cfg.in_proj_rows, D), "o_proj": (D, cfg.kda_local_dim),
              "latent_down": (cfg.latent_dim, D), "shared_gate_up": (2 * cfg.shared_local_inter, D),
              "shared_down": (D, cfg.shared_local_inter), "qkv_a": (cfg.qkv_a_rows, D),
              "g_proj": (cfg.mla_local_heads * cfg.v_head_dim, D),
              "q_b": (cfg.mla_local_heads * cfg.qk_head_dim, cfg.q_lora_rank),
              "router": (cfg.num_experts, D)}       # fp32 logits, as stock's router GEMM
    out = []
    for m in (2, 4, 8):
        for name, (n, k) in shapes.items():
            gen = torch.Generator(device=dev).manual_seed(7000 + 10 * m + len(name))
            w = (torch.randn(n, k, generator=gen, device=dev) * k ** -0.5).bfloat16()
            x = torch.randn(m, k, generator=gen, device=dev).bfloat16()
            world, rank = 16, 3
            od = torch.float32 if name == "router" else torch.bfloat16
            buf = torch.randn(world, m, n, generator=gen, device=dev).to(od)
            before = buf.clone()
            with torch.no_grad():
                y_s = ops.linear(x, w, od)
                y_k = gemv_mma(x, w, out_dtype=od)
                y_slot = gemv_mma(x, w, out=buf[rank], out_dtype=od)
            checks._sync()
            ref = x.double() @ w.double().t()
            e_ks, e_k, e_s = checks.rel(y_k, y_s), checks.rel(y_k, ref), checks.rel(y_s, ref)
            others = [i for i in range(world) if i != rank]
            r = {"kernel": "gemv_mma", "op": name, "M": m, "N": n, "K": k, "warps": warps_for(n, k),
                 "rel_vs_stock": e_ks, "rel_vs_f64": e_k, "stock_rel_vs_f64": e_s,
                 "slot_equal": bool(torch.equal(y_slot, y_k)),
                 "other_slots_untouched": bool(torch.equal(buf[others], before[others])),
                 "repeat_equal": bool(torch.equal(gemv_mma(x, w, out_dtype=od), y_k)),
                 "unroll8_equal": bool(torch.equal(gemv_mma(x, w, unroll=8, out_dtype=od), y_k))}
            if name == "router":   # fp32 logits: the top-16 sets as stock_ops.route picks them
                bias = torch.randn(n, generator=gen, device=dev) * 0.02
                ids_s, _ = stock_ops.route(y_s, bias, cfg.top_k, cfg.routed_scaling)
                ids_k, _ = stock_ops.route(y_k, bias, cfg.top_k, cfg.routed_scaling)
                same = [set(a.tolist()) == set(b.tolist()) for a, b in zip(ids_s, ids_k)]
                r["routing_rows_equal"] = f"{sum(same)}/{len(same)}"
            r["ok"] = bool(e_ks <= 1e-2 and e_k <= 1.5 * e_s + 1e-3 and r["slot_equal"]
                           and r["other_slots_untouched"] and r["repeat_equal"] and r["unroll8_equal"])
            if timing:
                copies = max(2, -(-(160 << 20) // (n * k * 2)))
                ws = [w] + [(torch.randn(n, k, generator=gen, device=dev) * k ** -0.5).bfloat16()
                            for _ in range(copies - 1)]
                cyc = itertools.cycle(ws)
                r["stock_us"] = checks.time_us(lambda: ops.linear(x, next(cyc), od))
                cyc = itertools.cycle(ws)
                r["kernel_us"] = checks.time_us(lambda: gemv_mma(x, next(cyc), out_dtype=od))
                r["kernel_tbs"] = n * k * 2 / (r["kernel_us"] * 1e-6) / 1e12
                cyc = itertools.cycle(ws)
                r["kernel_u8_us"] = checks.time_us(lambda: gemv_mma(x, next(cyc), unroll=8, out_dtype=od))
                del ws
            out.append(r)
    return out


SWEEP_WARPS = (8, 16)        # 4 only where warps_for picks it (more bytes in flight is the question)
SWEEP_UNROLLS = (2, 4, 8)


def sweep_shapes(cfg: object) -> dict[str, tuple[int, int]]:
    """The (N, K) of every projection the fused step runs through gemv_mma at 2 ≤ M ≤ 8 (K3
    TP16), by op name (the router's fp32 logits included)."""
    D = cfg.hidden
    return {"in_proj": (cfg.in_proj_rows, D), "o_proj": (D, cfg.kda_local_dim),
            "latent_down": (cfg.latent_dim, D), "shared_gate_up": (2 * cfg.shared_local_inter, D),
            "qkv_a": (cfg.qkv_a_rows, D), "g_proj": (cfg.mla_local_heads * cfg.v_head_dim, D),
            "q_b": (cfg.mla_local_heads * cfg.qk_head_dim, cfg.q_lora_rank), "router": (cfg.num_experts, D)}


def check_sweep(timing: bool = True, m: int = 8) -> list[dict]:
    """Kernel set "gemv_mma_tuned": every valid (warps, unroll) of SWEEP_WARPS × SWEEP_UNROLLS (and
    the default) at M = m on each sweep_shapes entry. Each configuration's output must pass check()'s rule
    against the stock GEMM op and float64 (rel ≤ 1e-2 vs stock, float64 error ≤ 1.5x stock's +
    1e-3; the router's fp32 logits too). With timing, each on COLD weights (copies ≥ 160 MB,
    as check()): "w{warps}_u{unroll}_us", plus "best", "best_us", "default" (warps_for and
    UNROLL) and "default_us". One row per shape; TUNED takes the winners."""
    import itertools

    from kimi_decode import stock_ops
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels import checks
    dev = torch.device(checks.DEVICE)
    cfg = k3_tp16(batch=8, spec_tokens=0)
    ops = stock_ops.OpSet(cfg)
    out = []
    for name, (n, k) in sweep_shapes(cfg).items():
        gen = torch.Generator(device=dev).manual_seed(7900 + len(name))
        w = (torch.randn(n, k, generator=gen, device=dev) * k ** -0.5).bfloat16()
        x = torch.randn(m, k, generator=gen, device=dev).bfloat16()
        od = torch.float32 if name == "router" else torch.bfloat16
        with torch.no_grad():
            y_s = ops.linear(x, w, od)
        ref = x.double() @ w.double().t()
        e_s = checks.rel(y_s, ref)
        default = (warps_for(n, k), UNROLL)
        configs = sorted({(wp, u) for wp in SWEEP_WARPS for u in SWEEP_UNROLLS if config_valid(k, wp, u)}
                         | {default})
        r = {"kernel": "gemv_mma_tuned", "op": name, "M": m, "N": n, "K": k,
             "default": f"w{default[0]}_u{default[1]}", "stock_rel_vs_f64": e_s}
        ok, worst = True, 0.0
        for wp, u in configs:
            with torch.no_grad():
                y = gemv_mma(x, w, out_dtype=od, warps=wp, unroll=u)
            checks._sync()
            e_ks, e_k = checks.rel(y, y_s), checks.rel(y, ref)
            worst = max(worst, e_k)
            ok = ok and e_ks <= 1e-2 and e_k <= 1.5 * e_s + 1e-3
        r["worst_rel_vs_f64"] = worst
        r["configs"] = len(configs)
        r["ok"] = bool(ok)
        if timing:
            copies = max(2, -(-(160 << 20) // (n * k * 2)))
            ws = [w] + [(torch.randn(n, k, generator=gen, device=dev) * k ** -0.5).bfloat16()
                        for _ in range(copies - 1)]
            times = {}
            for wp, u in configs:
                cyc = itertools.cycle(ws)
                times[(wp, u)] = checks.time_us(
                    lambda wp=wp, u=u: gemv_mma(x, next(cyc), out_dtype=od, warps=wp, unroll=u))
                r[f"w{wp}_u{u}_us"] = times[(wp, u)]
            best = min(times, key=times.get)
            r.update(best=f"w{best[0]}_u{best[1]}", best_warps=best[0], best_unroll=best[1],
                     best_us=times[best], default_us=times[default],
                     best_tbs=n * k * 2 / (times[best] * 1e-6) / 1e12)
            del ws
        out.append(r)
    return out


def tuned_from_sweep(rows: list[dict], min_gain: float = 0.03) -> dict[tuple[int, int], tuple[int, int]]:
    """TUNED entries from check_sweep rows: a shape's winner where every configuration passed
    and the winner beats the default by at least `min_gain` (relative), else nothing (the
    default stays: a gain within the replays' spread is not one)."""
    table = {}
    for r in rows:
        if r.get("ok") and "best_us" in r and r["best_us"] < (1 - min_gain) * r["default_us"]:
            table[(r["N"], r["K"])] = (r["best_warps"], r["best_unroll"])
    return table


def check_situ(timing: bool = True) -> list[dict]:
    """gemv_mma_situ (the shared expert's SiTU GLU + down projection, kernel "gemv_mma_situ") at
    M = 2, 4, 8 on the K3 shape (h [M, 768], w [7168, 384]) against the step's stock ops
    (situ_glu, then the GEMM op), gemv_mma on stock's activation (the same products from the
    same bf16 x: equal within one bf16 rounding of the output) and float64 (gemv.reference_situ);
    `out=` into a slot leaves the others untouched; repeat bit-equal. With timing on cold weights:
    stock_us (the two stock kernels), mma_us (stock's SiTU + gemv_mma: the step before this
    kernel), kernel_us."""
    import itertools

    from kimi_decode import stock_ops
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels import checks
    from kimi_decode.kernels.gemv import reference_situ
    dev = torch.device(checks.DEVICE)
    cfg = k3_tp16(batch=8, spec_tokens=0)
    ops = stock_ops.OpSet(cfg)
    D, Is = cfg.hidden, cfg.shared_local_inter
    beta, lin = cfg.situ_beta, cfg.situ_linear_beta
    out = []
    for m in (2, 4, 8):
        gen = torch.Generator(device=dev).manual_seed(7500 + m)
        w = (torch.randn(D, Is, generator=gen, device=dev) * Is ** -0.5).bfloat16()
        h = (torch.randn(m, 2 * Is, generator=gen, device=dev) * 3.0).bfloat16()
        world, rank = 16, 3
        buf = torch.randn(world, m, D, generator=gen, device=dev).bfloat16()
        before = buf.clone()

        def stock_call(w: torch.Tensor = w) -> torch.Tensor:
            return ops.linear(ops.situ(h, Is, beta, lin), w)
        with torch.no_grad():
            y_s = stock_call()
            y_m = gemv_mma(ops.situ(h, Is, beta, lin).contiguous(), w)
            y_k = gemv_mma_situ(h, w, Is, beta, lin)
            y_slot = gemv_mma_situ(h, w, Is, beta, lin, out=buf[rank])
            y_rep = gemv_mma_situ(h, w, Is, beta, lin)
        checks._sync()
        ref = reference_situ(h, w, Is, beta, lin)
        others = [i for i in range(world) if i != rank]
        e_ks, e_k, e_s = checks.rel(y_k, y_s), checks.rel(y_k, ref), checks.rel(y_s, ref)
        r = {"kernel": "gemv_mma_situ", "M": m, "N": D, "K": Is, "warps": warps_for(D, Is),
             "rel_vs_stock": e_ks, "rel_vs_f64": e_k, "stock_rel_vs_f64": e_s,
             "rel_vs_gemv_mma": checks.rel(y_k, y_m),
             "slot_equal": bool(torch.equal(y_slot, y_k)),
             "other_slots_untouched": bool(torch.equal(buf[others], before[others])),
             "repeat_equal": bool(torch.equal(y_rep, y_k))}
        r["ok"] = bool(e_ks <= 1e-2 and e_k <= 1.5 * e_s + 1e-3 and r["rel_vs_gemv_mma"] <= 1e-2
                       and r["slot_equal"] and r["other_slots_untouched"] and r["repeat_equal"])
        if timing:
            copies = max(2, -(-(160 << 20) // (D * Is * 2)))
            ws = [w] + [(torch.randn(D, Is, generator=gen, device=dev) * Is ** -0.5).bfloat16()
                        for _ in range(copies - 1)]
            cyc = itertools.cycle(ws)
            r["stock_us"] = checks.time_us(lambda: stock_call(next(cyc)))
            cyc = itertools.cycle(ws)
            r["mma_us"] = checks.time_us(lambda: gemv_mma(ops.situ(h, Is, beta, lin).contiguous(), next(cyc)))
            cyc = itertools.cycle(ws)
            r["kernel_us"] = checks.time_us(lambda: gemv_mma_situ(h, next(cyc), Is, beta, lin))
            del ws
        out.append(r)
    return out


if __name__ == "__main__":
    for r in check():
        print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()})
