"""Skinny GEMM for decode (M ≤ GEMV_MAX_ROWS rows; split-K up to SPLITK_MAX_ROWS): out = x @ Wᵀ, bf16 in and out, fp32
accumulation, the weight streamed from HBM exactly once (KIMI_K3.md Part 4: cuBLAS reaches
1–2 TB/s on these shapes at M = 1; a GEMV that keeps enough bytes in flight approaches the
copy bandwidth). vLLM's "skinnyGEMM" / CuTe skinny GEMM plays this role (KIMI_K3.md §2.2, §2.5).

Layout: one warp per output column n (a row of W [N, K]); grid = ceil(N / 8) CTAs of 8 warps.
Lane l reads the 128-bit slices l, l+32, ... of W[n] (coalesced, 512 bytes per warp load) and
the same slices of every x row (tiny, L1/L2-resident), accumulating M fp32 sums in registers;
the loop over slices is unrolled 4 deep so each lane keeps 4 weight loads in flight. A
butterfly shuffle finishes each dot product and lane 0 writes out[m, n] rounded to bf16 (as
cuBLAS rounds its fp32 accumulator). K must be a multiple of 256 (8 elements × 32 lanes).

Variants (compile-time fields of GemvConfig; the defaults are the kernel above, unchanged):
- `out=`: the wrapper writes into a caller-given contiguous [M, N] bf16 tensor (e.g. the
  all-reduce slot buf[rank] of SimComm's [world, M, N] buffer) instead of allocating; the
  kernel is the same (it only ever writes out[0:M, 0:N]).
- `vec = 4` (64-bit loads, 4 bf16 per lane per slice): K a multiple of 128 only, e.g. the
  shared expert's down projection, K = 384 (3 slices per lane). Same loop, same math.
- `situ = True` (gemv_situ): the SiTU-GLU prologue of the shared expert. The kernel takes
  h [M, 2·K] (gate K | up K, the bf16 output of shared_gate_up) instead of x; each CTA first
  computes x = bf16(SiTU(h[:, :K], h[:, K:])) for all M·K inputs into shared memory (256
  threads, `vec` consecutive inputs per thread per step; 96 of 256 threads busy at M = 1,
  K = 384), one barrier, then the GEMV loop above reads x from shared memory. When K is at
  most PRELOAD_SLICES slices per lane (shared_down: 3), each warp issues its whole weight
  row into registers before the prologue, so the HBM latency overlaps the SiTU math (the
  column is clamped to N-1 for that load; warps past N never store). Recomputing
  per CTA (not per warp) keeps the transcendentals (2 tanh + 1 exp per input) at
  ceil(N/8)·M·K = 344 K evaluations at M = 1 for shared_down instead of 2.75 M. Any M ≤ 8
  (x for M = 8 is 6 KB of shared memory; the x re-reads per weight load come from smem).
- `cols = C > 0` (split-K, what gemv() runs for 2 ≤ M ≤ SPLITK_MAX_ROWS): a CTA of 8 warps
  owns C = 4 output columns; the K/(32·vec) slices are dealt round-robin to its warps (slice
  s = warp + 8·i; the warps < slices % 8 take one more, a warp-uniform branch); per slice a
  lane loads its vec elements of the C weight rows and of the M x rows and does C·M·vec FMAs,
  so each x load serves C columns (the one-warp-per-column kernel re-read all M x rows per
  weight load: in_proj at M = 8 took 33 µs vs torch's 13.8 µs). Then each warp butterflies
  its C·M sums, lane 0 puts them in shared memory red[warp, c, m], one barrier, and thread
  t < C·M adds the 8 warp sums in warp order and writes out[m, col] rounded to bf16. Weight
  rows past N are clamped to N-1 for the loads and never stored. ceil(N/4) CTAs: in_proj
  804, g_proj 192 (≥ 132 SMs for every K3 projection). `kwarps` = 4 instead of 8 halves the
  CTA and doubles each warp's K share (the per-warp butterflies of C·M sums cost ~20% of the
  work at M = 8 with 8 warps on K = 7168); check_variants times both.
- gemv_rmsnorm (class GemvRMSNorm; GemvConfig.eps, x_stride): the RMSNorm prologue of MLA's
  q_b projection (kernel "mla_norm_fold", kernels/mla_norm_fold.py): x is columns [0, K) of
  rows of width x_stride (qkv_a's output a [M, 2112], K = 1536), normalised in-kernel. The
  plain layout (one warp per column); each warp issues its whole weight row (K ≤ 8 slices per
  lane) into registers, loads the x slices it multiplies, Σx² over the warp by a butterfly
  (every warp re-reads the 3 KB row from L2: no shared memory, no barrier), rstd, then per
  slice xn = bf16(x · rstd · w_norm) and the plain FMA chain. Launched with at most 128
  registers (min_blocks_per_mp = 2: ptxas took 145 uncapped, one CTA per SM, and q_b's 144
  CTAs would not all be resident on 132 SMs); M ≤ 8 (at M = 8 ptxas spills 6 bytes under
  the cap; the per-M table uses M = 1).
- gemv_tuned (kernel "gemv_tuned"; GemvConfig.per_warp, warps, hint, unroll; TUNE_CONFIGS):
  per-shape configurations at M = 1, looked up in TUNED[(N, K)] (gemv) and TUNED_MULTI[(K,
  segment N's, router?)] (gemv_multi) while set_tuned(True) (fused.enable() with "gemv" and
  "gemv_tuned" on). Each table entry is the fastest config of the device sweep
  (check_sweep) for its shape, one line per shape. The plain-layout configs: `per_warp` P = 2
  or 4 output columns per warp (per slice the lane issues P weight loads and one x load that
  serves all P; each column keeps its own FMA chain in the plain order and its butterfly:
  bit-identical); `warps` = 4 per CTA (finer CTAs: in_proj 804 instead of 402 on 132 SMs, the
  most-loaded SM 7/6.09 = 15% over the mean instead of 4/3.05 = 31%); `unroll` 7 / 14 (divide
  K = 7168's 28 slices per lane) and 8 (the earlier trial); `hint` = L1::no_allocate or
  L1::evict_first on the weight loads (autovec_copy's l1c_evict_priority; the DSL exposes no
  L2 eviction policy on a plain load); "full" (all of a short row's slices, K ≤ 8 slices). The
  split-K layout at M = 1 ("sk4", "sk4w4", "sk2": `cols` columns per CTA, K dealt to its warps)
  is swept for gemv() only: another fp32 summation order, so within bf16 tolerance of the
  default, not bit-identical (check_sweep asserts exactly that split).
  Why the plain layout stalls at ~3.0 TB/s (Little's law: ~3.8 TB/s × ~1 µs / 132 SMs ≈ 29 KB
  in flight per SM): in_proj has 3216 warps (one per row) for 132 SMs, 24.4 warps per SM; the
  SASS of the default unrolled body (nvdisasm, sm_90a) issues 5 of its 8 LDG.128 (4 weight, 4
  x) before the first FMA and interleaves the rest with the FMA chains, so ~2.5-3 weight loads
  per lane (1.3-1.5 KB per warp) are outstanding: 24 × ~1.4 KB ≈ 34 KB per SM, just the Little
  need with no margin. Deeper unrolls do not change that (u7, u14: 6 LDG before the first FMA;
  ptxas sinks the rest to their uses: 40-44 registers, not 4 per load), and unroll 8 over 28
  slices puts a conditional exit after 4 slices inside the body (no loads hoisted above it),
  which fits the 3-5% it gained. Expected per config (expectations, the sweep measures):
  split-K sk4 on in_proj: 804 CTAs × 8 warps all resident (≤ 8 CTAs of 8 warps per SM), 48.7
  warps per SM with 4 weight rows per lane per slice (its SASS issues 12 of the 20 LDG of its
  2-slice body before the second FMA group): ≥ 4 × 512 B × 48.7 ≈ 100 KB per SM, 3×
  the need, so the stream should approach the copy rate (46 MB at 3.8 TB/s ≈ 12 µs vs 15.3 µs
  in the step) less its barrier + 8-warp reduction (~1 µs); per_warp 2 halves the warps per SM
  (12.2) and with ~4 early LDG (2.7 weight) keeps ~17 KB per SM: expected no gain on in_proj
  unless ptxas issues the second row's loads earlier; warps 4: same 24 warps per SM, a smaller
  tail (above): a few %; the L1 hints: weights never re-read, x stays in L1: at most a few %.
  o_proj (K = 768, 3 slices): the default is already fully unrolled (unroll 4 ≥ 3: "u*" and
  "full" are the same kernel, not swept twice; SASS: 4 of its 6 LDG before the first FMA, the
  rest right after): 54 warps per SM × ~1-1.5 KB ≈ 55-80 KB, so it is not short of loads in
  flight; its 44% of peak is ramp and tail (11 MB is 2.9 µs at 3.8 TB/s vs
  4.6 µs): per_warp 2 / 4 (448 / 224 CTAs) cut the CTA launches; expected ≤ 1 µs. The MoE
  front keeps 8 warps per CTA (router_fast's CTAs) and ≤ 64 registers (4 CTAs per SM; the
  default already spills 16 bytes under that cap, ptxas 13.0): p2, the hints.

Exact math (every rounding point; matches the stock ops):
- plain: out[m, n] = bf16( Σ_k fp32(x[m, k]) · fp32(w[n, k]) ), fp32 sum (lane-strided partial
  sums, then a butterfly; split-K: per-warp partials, then the 8 warps in order), one
  rounding to bf16 at the end (torch's x @ wᵀ rounds its fp32 accumulator once, too; only
  the summation order differs).
- situ: with g = fp32(h[m, k]), u = fp32(h[m, K + k]), all in fp32 and in stock_ops.situ's
  order: a = (β · tanh(g / β)) · σ(g), σ(g) = 1 / (1 + exp(-g)); b = β_lin · tanh(u / β_lin);
  x[m, k] = bf16(a · b)  (stock_ops.situ_glu's .to(bf16)); then the plain formula on x.
  tanh and exp are cute.math's non-fastmath functions (tanh lowers to an ex2/rcp expansion,
  not tanh.approx.f32; σ's 1/(1+e) is rcp.rn and u/β_lin div.rn, as torch's IEEE ops), so x
  matches torch's fp32 SiTU to a few fp32 ulps and its bf16 rounding differs only for values
  within those ulps of a bf16 rounding boundary (one bf16 ulp there).
- rmsnorm: ss = Σ_k fp32(x[m, k])² (lane order, then a butterfly); rstd = rsqrt(ss / K + eps)
  (rsqrt.approx.f32); xn[m, k] = bf16((fp32(x) · rstd) · fp32(w_norm[k])), stock's rounding
  point (stock_triton.mla_norms: x · rstd · w in fp32, then bf16); then the plain formula on
  xn in the plain kernel's order, so at M = 1 the output is bit-identical to gemv(xn, W).
  Stock's rstd (1/sqrt, another Σ order) may differ in its last fp32 bits: xn equals stock's
  qa except within those bits of a bf16 rounding boundary (one bf16 ulp there).

Why it should reach its target: shared_down is 7168 × 384 bf16 = 5.5 MB; at ~4 TB/s that is
~1.4 µs of HBM time, so gemv_situ is latency bound (~3-4 µs at M = 1: h load + SiTU + barrier
overlap the weight fetch issued first, then 3 FMAs rounds and a butterfly) versus the stock
path's two launches (SiTU elementwise + cuBLAS GEMM, ~3 µs each at these shapes). Split-K at
M = 8 on in_proj: 46 MB of weight (~11.5 µs at 4 TB/s) against 184 M fp32 FMAs (~6.5 µs of
the H200's FMA issue) plus the bf16→fp32 converts: ~12 µs expected vs torch's 13.8 µs, i.e.
a modest win at best; check_variants measures it (the per-M table decides).

Check on the GPU (against torch's matmul, the stock path's op; times both): check_gemv in
checks.py (the plain kernel) and check_variants below (out= into an all-reduce slot, K = 384,
gemv_situ vs stock situ_glu + matmul, split-K at M = 3 and 8); both run by
    python -m kimi_decode.kernels.gemv
check_sweep (kernel "gemv_tuned"; every TUNE_CONFIGS entry on in_proj, o_proj, q_b and the two
gemv_multi fronts, equal to the default, timed on cold weights; one row per shape with
"<config>_us" and "best"):
    python -m kimi_decode.kernels.gemv --sweep
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

from dataclasses import dataclass, replace

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32  # noqa: F401

from kimi_decode.kernels import chain
from kimi_decode.kernels._common import (compile_options, compiled, current_stream, dummy_ptr, ptr,
                                         sigmoid)

VEC = 8
VEC_NARROW = 4  # 64-bit loads for K a multiple of 128 (not of 256)
WARPS = 8
PRELOAD_SLICES = 4  # gemv_situ: K ≤ 4 slices per lane → the warp's weight row is loaded up front
NORM_MAX_SLICES = 8  # gemv_rmsnorm: K ≤ 8 slices per lane (2048); q_b: K = 1536, 6 slices
# Per-M table, measured on the H200 (bench/fused_correctness.md): at M = 1 the GEMV beats
# torch's GEMM on every K3 projection (in_proj 10.1 vs 14.0 us, 4.6 TB/s); at M = 8 it loses
# (in_proj 33 vs 13.8 us: each lane re-reads 8 x-rows per weight load), so M >= 2 goes to the
# stock GEMM, or to the tensor-core kernel (kernels/gemv_mma.py) where "gemv_mma" is enabled.
# The kernel itself was checked correct at M = 1 and M = 8.
GEMV_MAX_ROWS = 1
# The split-K layout (GemvConfig.cols > 0) for 2 ≤ M ≤ SPLITK_MAX_ROWS: SPLITK_COLS output
# columns per CTA, K split over its 8 warps (not yet measured on the GPU: check_variants times it).
SPLITK_MIN_ROWS = 2   # gemv() picks the layout by M alone; GEMV_MAX_ROWS only gates can_implement
SPLITK_MAX_ROWS = 8
SPLITK_COLS = 4
SPLITK_WARPS = 8      # warps per split-K CTA; check_variants also times 4 (fewer, longer K shares)
# Weight loads in flight per lane in the one-warp-per-column loop (the loop's unroll depth; the
# summation order does not depend on it, so results are bit-identical for any value).
# check_variants times 4 and 8 on cold weights (in_proj, latent_down at M = 1).
GEMV_UNROLL = 4
HINTS = ("", "no_allocate", "evict_first")   # GemvConfig.hint: L1 policy of the weight loads


@dataclass(frozen=True)
class GemvConfig:
    """Compile-time sizes: output columns N, reduction K, rows M; the load width `vec`
    (8: 128-bit loads, K % 256 == 0; 4: 64-bit loads, K % 128 == 0); and the SiTU-GLU
    prologue (`situ`: the kernel's x operand is h [M, 2K], x = bf16(SiTU(h[:, :K], h[:, K:])))
    with its β and β_lin; `cols` > 0 selects the split-K layout (`cols` output columns per
    CTA, the K slices dealt round-robin to its 8 warps; not with situ). The defaults are the
    original, GPU-verified kernel."""

    n: int
    k: int
    rows: int
    vec: int = VEC
    situ: bool = False
    beta: float = 4.0
    lin_beta: float = 25.0
    cols: int = 0
    kwarps: int = WARPS          # split-K: warps per CTA sharing the K slices (4 or 8)
    unroll: int = 4              # one-warp-per-column loop: slices (weight loads) in flight per lane
    # gemv_tuned (plain layout only; the defaults are the plain kernel): output columns per warp
    # (1, 2 or 4), warps per CTA (8 or 4), and the L1 policy of the weight loads ("" normal,
    # "no_allocate": ld.global.L1::no_allocate, "evict_first": ld.global.L1::evict_first)
    per_warp: int = 1
    warps: int = WARPS
    hint: str = ""
    # gemv_rmsnorm (class GemvRMSNorm only): x is columns [0, K) of rows of width x_stride
    # (e.g. the q part of qkv_a's output), normalised in the prologue with this eps
    eps: float = 0.0
    x_stride: int = 0
    # PDL chain: release the successor at the kernel's start (kernels/chain.py, early
    # release; gemv() sets it from chain.early_release); acted on by the preloaded short
    # row only (o_proj), ignored by the other layouts
    early: bool = False


def vec_for(k: int) -> int:
    """The load width for K: 8 (the 128-bit fast path) when K % 256 == 0, else 4."""
    return VEC if k % (VEC * 32) == 0 else VEC_NARROW


def can_implement(m: int, n: int, k: int, dtypes: tuple[torch.dtype, ...],
                  k_multiple: int = VEC * 32, max_rows: int = GEMV_MAX_ROWS) -> bool:
    """Small M (the per-M table: the stock GEMM beyond GEMV_MAX_ROWS), K a multiple of
    `k_multiple`, bf16. The defaults are what fused.py's wiring expects today (K = 384 and
    M ≥ 2 go to the stock GEMM); pass k_multiple=128 to admit the 64-bit-load variant
    (shared_down, K = 384) and max_rows=SPLITK_MAX_ROWS to admit the split-K layout (M ≤ 8)."""
    return (1 <= m <= min(max_rows, SPLITK_MAX_ROWS) and k_multiple in (VEC * 32, VEC_NARROW * 32)
            and k >= 1 and k % k_multiple == 0 and n >= 1
            and all(d == torch.bfloat16 for d in dtypes))


def can_implement_norm(m: int, n: int, k: int, x_stride: int, dtypes: tuple[torch.dtype, ...],
                       max_rows: int = GEMV_MAX_ROWS) -> bool:
    """gemv_rmsnorm: x = columns [0, K) of [M, x_stride] rows; K a multiple of 256 with at most
    NORM_MAX_SLICES slices per lane (the warp's weight row and x row live in registers);
    x_stride ≥ K and a multiple of 8 (16-byte aligned rows); bf16; M ≤ max_rows (the kernel
    itself handles M ≤ SPLITK_MAX_ROWS)."""
    return (can_implement(m, n, k, dtypes, max_rows=max_rows) and k // (VEC * 32) <= NORM_MAX_SLICES
            and x_stride >= k and x_stride % VEC == 0)


def can_implement_situ(m: int, n: int, inter: int, dtypes: tuple[torch.dtype, ...],
                       max_rows: int = GEMV_MAX_ROWS) -> bool:
    """gemv_situ: h [M, 2·inter], w [N, inter]; inter a multiple of 128; bf16; M ≤ max_rows
    (the kernel itself handles M ≤ SPLITK_MAX_ROWS: x staged in shared memory)."""
    return can_implement(m, n, inter, dtypes, k_multiple=VEC_NARROW * 32, max_rows=max_rows)


@cute.jit
def situ_act(g: Float32, u: Float32, beta: cutlass.Constexpr[float], lin_beta: cutlass.Constexpr[float]) -> Float32:
    """stock_ops.situ in fp32, same operation order: (β·tanh(g/β)·σ(g)) · (β_lin·tanh(u/β_lin)).
    Shared by gemv_situ's prologue and gemv_mma's (GemvMmaConfig.situ)."""
    b_ = Float32(beta)
    lin = Float32(lin_beta)
    a = b_ * cute.math.tanh(g / b_)
    a = a * sigmoid(g)
    b = lin * cute.math.tanh(u / lin)
    return a * b


class Gemv:
    """See the module docstring."""

    def __init__(self, cfg: GemvConfig) -> None:
        assert cfg.vec in (VEC, VEC_NARROW) and cfg.k % (cfg.vec * 32) == 0, cfg
        self.cfg = cfg
        self.slices = cfg.k // (cfg.vec * 32)
        self.kv = cfg.k // cfg.vec                       # vec-slices per x row
        self.units = cfg.rows * self.kv                  # prologue work items (situ)
        self.steps = (self.units + WARPS * 32 - 1) // (WARPS * 32)
        self.preload = self.slices <= PRELOAD_SLICES     # situ: whole weight row in registers
        assert not (cfg.situ and cfg.cols), cfg
        assert cfg.kwarps in (4, 8), cfg
        self.kw = cfg.kwarps if cfg.cols else WARPS      # warps per CTA of this layout
        assert cfg.cols * cfg.rows <= self.kw * 32, cfg  # one finishing thread per (column, row)
        self.full = self.slices // self.kw               # split-K: rounds every warp takes
        self.tail = self.slices % self.kw                # warps < tail take one more slice
        assert cfg.per_warp in (1, 2, 4) and cfg.warps in (4, 8) and cfg.hint in HINTS, cfg
        assert (cfg.per_warp, cfg.warps) == (1, WARPS) or (cfg.cols == 0 and not cfg.situ), cfg
        assert cfg.unroll >= 1, cfg
        self.cpc = cfg.warps * cfg.per_warp             # plain layout: output columns per CTA
        self.ctas = (cfg.n + self.cpc - 1) // self.cpc if cfg.cols == 0 else (cfg.n + cfg.cols - 1) // cfg.cols
        # PDL chain (kernels/chain.py): bytes of each weight row prefetched into L2 before the
        # wait (0 without the chain; gemv_multi re-sets it for its total rows)
        self.pf = chain.row_prefetch_bytes(cfg.k * 2, cfg.n)
        # PDL chain: a short row (o_proj, K = 768: 3 slices per lane) goes into registers before
        # the wait, the whole of it (column_preloaded); the split-K layout loads its first
        # CHAIN_PEEL rounds there (kernel_splitk)
        self.preload_chain = (chain.chain_on() and cfg.per_warp == 1 and cfg.cols == 0 and not cfg.situ
                              and self.slices <= FULL_MAX_SLICES)
        self.peel = min(CHAIN_PEEL, self.full) if chain.chain_on() and cfg.cols else 0
        # early release (chain.py) applies to the preloaded short row only: gemv() passes
        # chain.early_release(M) for every plain config, the other layouts ignore it
        self.early = cfg.early and self.preload_chain
        # PDL chain, plain layout, one column per warp: slices whose weights the lane loads
        # before the wait (column_preloaded); gemv_multi sets it (MultiConfig.peel), 0 elsewhere
        self.plain_peel = 0

    @cute.jit
    def __call__(self, x: cute.Pointer, w: cute.Pointer, out: cute.Pointer, stream: cuda.CUstream):
        n, k, m, vec = self.cfg.n, self.cfg.k, self.cfg.rows, self.cfg.vec
        xk = 2 * k if cutlass.const_expr(self.cfg.situ) else k     # h [M, 2K] for situ
        mX = cute.make_tensor(x, cute.make_layout((m, xk // vec, vec), stride=(xk, vec, 1)))
        mW = cute.make_tensor(w, cute.make_layout((n, k // vec, vec), stride=(k, vec, 1)))
        mO = cute.make_tensor(out, cute.make_layout((m, n), stride=(n, 1)))
        if cutlass.const_expr(self.cfg.situ):
            # not in the PDL chain: the shared expert's down GEMV runs on the side stream, off the
            # critical path, and a PDL launch there would start it (resident, waiting) at the
            # MoE front's release on another stream, where no trace analysis can tell its wait
            # from its work (analyzers/sql/kernels/exposed.sql clips same-stream overlap only)
            self.kernel_situ(mX, mW, mO).launch(grid=[(n + WARPS - 1) // WARPS, 1, 1],
                                                block=[WARPS * 32, 1, 1], stream=stream)
        elif cutlass.const_expr(self.cfg.cols > 0):
            self.kernel_splitk(mX, mW, mO).launch(grid=[self.ctas, 1, 1],
                                                  block=[self.kw * 32, 1, 1], stream=stream,
                                                  use_pdl=chain.chain_on())
        else:
            self.kernel(mX, mW, mO).launch(grid=[self.ctas, 1, 1],
                                           block=[self.cfg.warps * 32, 1, 1], stream=stream,
                                           use_pdl=chain.chain_on())

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor):
        bidx, _, _ = cute.arch.block_idx()
        wid = bidx * self.cfg.warps + cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        self.warp_columns(mX, mW, mO, wid, lane)

    @cute.jit
    def warp_columns(self, mX: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor, wid: Int32, lane: Int32):
        """Warp `wid` of the plain layout: column wid (per_warp = 1, the original kernel's
        code) or columns wid·P .. wid·P + P - 1 (per_warp = P); also gemv_multi's segments.
        With the PDL chain, lane 0 first prefetches the first `pf` bytes of each of the warp's
        rows into L2, then the chain's wait (kernels/chain.py)."""
        if cutlass.const_expr(self.preload_chain):
            self.column_preloaded(mX, mW, mO, wid, lane, self.slices, self.early)
        elif cutlass.const_expr(chain.chain_on() and self.plain_peel > 0 and self.cfg.per_warp == 1):
            self.chain_prefetch_rows(mW, wid, 1, lane == 0)
            self.column_preloaded(mX, mW, mO, wid, lane, self.plain_peel, False)
        else:
            if cutlass.const_expr(chain.chain_on()):
                self.chain_prefetch_rows(mW, wid * self.cfg.per_warp, self.cfg.per_warp, lane == 0)
                chain.enter()
            if cutlass.const_expr(self.cfg.per_warp == 1):
                self.column(mX, mW, mO, wid, lane)
            else:
                self.columns(mX, mW, mO, wid * self.cfg.per_warp, lane)

    @cute.jit
    def chain_prefetch_rows(self, mW: cute.Tensor, row0: Int32, nrows: cutlass.Constexpr[int], pred):
        """PDL chain: where `pred`, one L2 prefetch of the first `pf` bytes of each weight row
        row0 .. row0 + nrows - 1 (clamped to N - 1: in bounds)."""
        if cutlass.const_expr(self.pf > 0):
            if pred:
                for q in cutlass.range_constexpr(nrows):
                    r = cutlass.min(row0 + q, Int32(self.cfg.n - 1))
                    chain.prefetch(mW.iterator + r * self.cfg.k, self.pf)

    @cute.jit
    def load_w(self, src: cute.Tensor, dst: cute.Tensor):
        """One weight slice into registers, with the configured L1 policy (default: the plain
        kernel's unhinted copy)."""
        if cutlass.const_expr(self.cfg.hint == "no_allocate"):
            cute.autovec_copy(src, dst, l1c_evict_priority=cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE)
        elif cutlass.const_expr(self.cfg.hint == "evict_first"):
            cute.autovec_copy(src, dst, l1c_evict_priority=cute.nvgpu.CacheEvictionPriority.EVICT_FIRST)
        else:
            cute.autovec_copy(src, dst)

    @cute.jit
    def columns(self, mX: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor, col0: Int32, lane: Int32):
        """out[:, col0 + q] = x @ W[col0 + q] for q < P = per_warp, one warp: per slice the lane
        issues the P weight loads (P × unroll in flight), loads each x slice once for all P
        columns, and runs each column's FMA chain in the plain kernel's order (slice i, element
        j), then one butterfly per column as column() does: bit-identical to it. Rows past N
        (only when N % P != 0) are clamped to N-1 for the loads and never stored."""
        P, m, vec, n = self.cfg.per_warp, self.cfg.rows, self.cfg.vec, self.cfg.n
        if col0 < n:
            acc = cute.make_rmem_tensor(cute.make_layout((P, m), stride=(m, 1)), Float32)
            acc.fill(0.0)
            wv = cute.make_rmem_tensor(cute.make_layout((P, vec), stride=(vec, 1)), mW.element_type)
            xv = cute.make_rmem_tensor(cute.make_layout(vec), mX.element_type)
            for i in cutlass.range(self.slices, unroll=self.cfg.unroll):
                c = lane + i * 32
                for q in cutlass.range_constexpr(P):
                    if cutlass.const_expr(n % P == 0):
                        self.load_w(mW[col0 + q, c, None], wv[q, None])
                    else:
                        self.load_w(mW[cutlass.min(col0 + q, Int32(n - 1)), c, None], wv[q, None])
                for r in cutlass.range_constexpr(m):
                    cute.autovec_copy(mX[r, c, None], xv)
                    for q in cutlass.range_constexpr(P):
                        for j in cutlass.range_constexpr(vec):
                            acc[q, r] = acc[q, r] + wv[q, j].to(Float32) * xv[j].to(Float32)
            for q in cutlass.range_constexpr(P):
                for r in cutlass.range_constexpr(m):
                    tot = cute.arch.warp_reduction_sum(acc[q, r])
                    if lane == 0:
                        if cutlass.const_expr(n % P == 0):
                            mO[r, col0 + q] = tot.to(mO.element_type)
                        else:
                            if col0 + q < n:
                                mO[r, col0 + q] = tot.to(mO.element_type)

    @cute.jit
    def column(self, mX: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor, col: Int32, lane: Int32):
        """out[:, col] = x @ W[col] for one warp (nothing past N): the plain kernel's body,
        also one segment of gemv_multi.py's kernel."""
        if col < self.cfg.n:
            acc = cute.make_rmem_tensor(cute.make_layout(self.cfg.rows), Float32)
            acc.fill(0.0)
            wv = cute.make_rmem_tensor(cute.make_layout(self.cfg.vec), mW.element_type)
            xv = cute.make_rmem_tensor(cute.make_layout(self.cfg.vec), mX.element_type)
            for i in cutlass.range(self.slices, unroll=self.cfg.unroll):
                c = lane + i * 32
                self.load_w(mW[col, c, None], wv)
                for r in cutlass.range_constexpr(self.cfg.rows):
                    cute.autovec_copy(mX[r, c, None], xv)
                    for j in cutlass.range_constexpr(self.cfg.vec):
                        acc[r] = acc[r] + wv[j].to(Float32) * xv[j].to(Float32)
            for r in cutlass.range_constexpr(self.cfg.rows):
                tot = cute.arch.warp_reduction_sum(acc[r])
                if lane == 0:
                    mO[r, col] = tot.to(mO.element_type)

    @cute.jit
    def column_preloaded(self, mX: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor, col: Int32, lane: Int32,
                         pre: cutlass.Constexpr[int], early: cutlass.Constexpr[bool]):
        """column() for the PDL chain with the first `pre` slices of the warp's weight row in
        registers before the chain's wait: the whole row for a short one (o_proj, K = 768:
        preload_chain), the first unrolled round(s) for gemv_multi's projection warps
        (MultiConfig.peel: those resident while the previous kernel runs stream them then).
        A warp past N loads row N-1 (in bounds) and stores nothing; x only after the wait;
        then column()'s FMA chain in its order (slice, row, element): bit-identical to
        column(). `early`: release the successor first (kernels/chain.py, early release)."""
        S, vec = self.slices, self.cfg.vec
        chain.begin(early)                 # early release: its successor reads only constants first
        colc = cutlass.min(col, Int32(self.cfg.n - 1))
        wall = cute.make_rmem_tensor(cute.make_layout((pre, vec), stride=(vec, 1)), mW.element_type)
        for i in cutlass.range_constexpr(pre):
            self.load_w(mW[colc, lane + i * 32, None], wall[i, None])
        chain.enter_or_wait(early)
        if col < self.cfg.n:
            acc = cute.make_rmem_tensor(cute.make_layout(self.cfg.rows), Float32)
            acc.fill(0.0)
            xv = cute.make_rmem_tensor(cute.make_layout(vec), mX.element_type)
            for i in cutlass.range_constexpr(pre):
                c = lane + i * 32
                for r in cutlass.range_constexpr(self.cfg.rows):
                    cute.autovec_copy(mX[r, c, None], xv)
                    for j in cutlass.range_constexpr(vec):
                        acc[r] = acc[r] + wall[i, j].to(Float32) * xv[j].to(Float32)
            if cutlass.const_expr(pre < S):      # the rest of the row: column()'s loop
                wv = cute.make_rmem_tensor(cute.make_layout(vec), mW.element_type)
                for i in cutlass.range(pre, S, unroll=self.cfg.unroll):
                    c = lane + i * 32
                    self.load_w(mW[col, c, None], wv)
                    for r in cutlass.range_constexpr(self.cfg.rows):
                        cute.autovec_copy(mX[r, c, None], xv)
                        for j in cutlass.range_constexpr(vec):
                            acc[r] = acc[r] + wv[j].to(Float32) * xv[j].to(Float32)
            for r in cutlass.range_constexpr(self.cfg.rows):
                tot = cute.arch.warp_reduction_sum(acc[r])
                if lane == 0:
                    mO[r, col] = tot.to(mO.element_type)

    @cute.jit
    def situ(self, g: Float32, u: Float32) -> Float32:
        return situ_act(g, u, self.cfg.beta, self.cfg.lin_beta)

    @cute.kernel
    def kernel_situ(self, mH: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor):
        m, vec, kv = self.cfg.rows, self.cfg.vec, self.kv
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        col = bidx * WARPS + cute.arch.warp_idx()      # all 32 lanes, before any branch
        lane = cute.arch.lane_idx()
        smem = cutlass.memory.SmemAllocator()
        sX = smem.allocate_tensor(mH.element_type,
                                  cute.make_layout((m, kv, vec), stride=(self.cfg.k, vec, 1)),
                                  byte_alignment=16)
        # Short K (shared_down: 3 slices per lane): issue this warp's whole weight row before
        # the prologue so the HBM latency overlaps the SiTU math. A warp past N (only in the
        # last CTA when N % 8 != 0) loads row N-1 instead (in bounds) and never stores.
        wall = cute.make_rmem_tensor(cute.make_layout((PRELOAD_SLICES, vec), stride=(vec, 1)),
                                     mW.element_type)
        if cutlass.const_expr(self.preload):
            colc = cutlass.min(col, Int32(self.cfg.n - 1))
            for i in cutlass.range_constexpr(self.slices):
                cute.autovec_copy(mW[colc, lane + i * 32, None], wall[i, None])
        # Prologue (every thread of the CTA, also warps past N): x = bf16(SiTU(gate, up)).
        gv = cute.make_rmem_tensor(cute.make_layout(vec), mH.element_type)
        uv = cute.make_rmem_tensor(cute.make_layout(vec), mH.element_type)
        av = cute.make_rmem_tensor(cute.make_layout(vec), mH.element_type)
        for s in cutlass.range_constexpr(self.steps):
            unit = tidx + s * (WARPS * 32)
            if unit < self.units:
                r = unit // kv
                c = unit - r * kv
                cute.autovec_copy(mH[r, c, None], gv)          # gate: h[r, c·vec : c·vec+vec]
                cute.autovec_copy(mH[r, kv + c, None], uv)     # up:   h[r, K + c·vec : ...]
                for j in cutlass.range_constexpr(vec):
                    av[j] = self.situ(gv[j].to(Float32), uv[j].to(Float32)).to(mH.element_type)
                cute.autovec_copy(av, sX[r, c, None])
        cute.arch.sync_threads()
        if col < self.cfg.n:
            acc = cute.make_rmem_tensor(cute.make_layout(m), Float32)
            acc.fill(0.0)
            xv = cute.make_rmem_tensor(cute.make_layout(vec), mH.element_type)
            if cutlass.const_expr(self.preload):
                for i in cutlass.range_constexpr(self.slices):
                    c = lane + i * 32
                    for r in cutlass.range_constexpr(m):
                        cute.autovec_copy(sX[r, c, None], xv)
                        for j in cutlass.range_constexpr(vec):
                            acc[r] = acc[r] + wall[i, j].to(Float32) * xv[j].to(Float32)
            else:
                wv = cute.make_rmem_tensor(cute.make_layout(vec), mW.element_type)
                for i in cutlass.range(self.slices, unroll=4):
                    c = lane + i * 32
                    cute.autovec_copy(mW[col, c, None], wv)
                    for r in cutlass.range_constexpr(m):
                        cute.autovec_copy(sX[r, c, None], xv)
                        for j in cutlass.range_constexpr(vec):
                            acc[r] = acc[r] + wv[j].to(Float32) * xv[j].to(Float32)
            for r in cutlass.range_constexpr(m):
                tot = cute.arch.warp_reduction_sum(acc[r])
                if lane == 0:
                    mO[r, col] = tot.to(mO.element_type)


    @cute.jit
    def splitk_slice(self, mX: cute.Tensor, mW: cute.Tensor, acc: cute.Tensor, wv: cute.Tensor,
                     xv: cute.Tensor, bidx: Int32, s: Int32, lane: Int32):
        """acc[q, r] += W[col_q, slice s] · x[r, slice s] for this lane's vec elements."""
        self.splitk_load(mW, wv, bidx, s, lane)
        self.splitk_fma(mX, acc, wv, xv, s, lane)

    @cute.jit
    def splitk_load(self, mW: cute.Tensor, wv: cute.Tensor, bidx: Int32, s: Int32, lane: Int32):
        """wv[q, :] = this lane's vec elements of slice s of the CTA's weight row q."""
        c = s * 32 + lane                               # the warp reads 32·vec contiguous elements
        for q in cutlass.range_constexpr(self.cfg.cols):
            colq = cutlass.min(bidx * self.cfg.cols + q, Int32(self.cfg.n - 1))  # in bounds
            cute.autovec_copy(mW[colq, c, None], wv[q, None])

    @cute.jit
    def splitk_fma(self, mX: cute.Tensor, acc: cute.Tensor, wv: cute.Tensor, xv: cute.Tensor,
                   s: Int32, lane: Int32):
        """acc[q, r] += wv[q, :] · x[r, slice s] (splitk_slice's FMA order)."""
        c = s * 32 + lane
        for r in cutlass.range_constexpr(self.cfg.rows):
            cute.autovec_copy(mX[r, c, None], xv)
            for q in cutlass.range_constexpr(self.cfg.cols):
                for j in cutlass.range_constexpr(self.cfg.vec):
                    acc[q, r] = acc[q, r] + wv[q, j].to(Float32) * xv[j].to(Float32)

    @cute.kernel
    def kernel_splitk(self, mX: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor):
        m, vec, C = self.cfg.rows, self.cfg.vec, self.cfg.cols
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()                     # all 32 lanes, before any branch
        lane = cute.arch.lane_idx()
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout((self.kw, C, m), stride=(C * m, m, 1)),
                                   byte_alignment=16)
        acc = cute.make_rmem_tensor(cute.make_layout((C, m), stride=(m, 1)), Float32)
        acc.fill(0.0)
        wv = cute.make_rmem_tensor(cute.make_layout((C, vec), stride=(vec, 1)), mW.element_type)
        xv = cute.make_rmem_tensor(cute.make_layout(vec), mX.element_type)
        # PDL chain: thread q < C prefetches the first bytes of the CTA's weight row q, and the
        # warps load their first `peel` rounds of weights into registers, before the wait
        # Round i: warp w takes slice w + kw·i, so the CTA streams each of its C weight rows
        # front to back in kw·512-byte steps (vec = 8).
        if cutlass.const_expr(chain.chain_on()):
            pre = cute.make_rmem_tensor(cute.make_layout((max(self.peel, 1), C, vec), stride=(C * vec, vec, 1)),
                                        mW.element_type)
            self.chain_prefetch_rows(mW, bidx * C + tidx, 1, tidx < C)
            for i in cutlass.range_constexpr(self.peel):
                self.splitk_load(mW, pre[i, None, None], bidx, warp + i * self.kw, lane)
            chain.enter()
            for i in cutlass.range_constexpr(self.peel):
                self.splitk_fma(mX, acc, pre[i, None, None], xv, warp + i * self.kw, lane)
            for i in cutlass.range(self.peel, self.full, unroll=2):
                self.splitk_slice(mX, mW, acc, wv, xv, bidx, warp + i * self.kw, lane)
        else:
            for i in cutlass.range(self.full, unroll=2):
                self.splitk_slice(mX, mW, acc, wv, xv, bidx, warp + i * self.kw, lane)
        if cutlass.const_expr(self.tail > 0):
            if warp < self.tail:                        # warp-uniform; no shuffles inside
                self.splitk_slice(mX, mW, acc, wv, xv, bidx, warp + self.full * self.kw, lane)
        for q in cutlass.range_constexpr(C):
            for r in cutlass.range_constexpr(m):
                tot = cute.arch.warp_reduction_sum(acc[q, r])
                if lane == 0:
                    red[warp, q, r] = tot
        cute.arch.sync_threads()
        if tidx < C * m:
            q = tidx // m
            r = tidx - q * m
            col = bidx * C + q
            tot = Float32(0.0)
            for w in cutlass.range_constexpr(self.kw):
                tot += red[w, q, r]
            if col < self.cfg.n:
                mO[r, col] = tot.to(mO.element_type)


class GemvRMSNorm(Gemv):
    """gemv_rmsnorm: out = bf16(RMSNorm(x; w_norm, eps)) @ Wᵀ, one warp per output column (the
    plain kernel's layout and summation order), the norm recomputed by every warp: see the
    module docstring."""

    def __init__(self, cfg: GemvConfig) -> None:
        assert cfg.vec == VEC and not cfg.situ and cfg.cols == 0, cfg
        assert cfg.k % (VEC * 32) == 0 and cfg.k // (VEC * 32) <= NORM_MAX_SLICES, cfg
        assert cfg.x_stride >= cfg.k and cfg.x_stride % VEC == 0 and 1 <= cfg.rows <= SPLITK_MAX_ROWS, cfg
        assert (cfg.per_warp, cfg.warps, cfg.hint) == (1, WARPS, ""), cfg
        super().__init__(cfg)

    @cute.jit
    def __call__(self, x: cute.Pointer, wn: cute.Pointer, w: cute.Pointer, out: cute.Pointer,
                 stream: cuda.CUstream):
        n, k, m, vec = self.cfg.n, self.cfg.k, self.cfg.rows, self.cfg.vec
        mX = cute.make_tensor(x, cute.make_layout((m, k // vec, vec), stride=(self.cfg.x_stride, vec, 1)))
        mN = cute.make_tensor(wn, cute.make_layout((k // vec, vec), stride=(vec, 1)))
        mW = cute.make_tensor(w, cute.make_layout((n, k // vec, vec), stride=(k, vec, 1)))
        mO = cute.make_tensor(out, cute.make_layout((m, n), stride=(n, 1)))
        # ≤ 128 registers (2 CTAs per SM): all ceil(N/8) CTAs resident at once (q_b: 144 CTAs
        # on 132 SMs; uncapped, ptxas took 145 registers at M = 1, one CTA per SM, two waves).
        # The explicit carveout (-1: the driver's default) keeps the DSL from querying the
        # device at compile time (no GPU in CI), as moe_experts does.
        self.kernel_norm(mX, mN, mW, mO).launch(grid=[(n + WARPS - 1) // WARPS, 1, 1],
                                                block=[WARPS * 32, 1, 1], stream=stream,
                                                min_blocks_per_mp=2, preferred_smem_carveout=-1,
                                                use_pdl=chain.chain_on())

    @cute.kernel
    def kernel_norm(self, mX: cute.Tensor, mN: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor):
        m, vec, S, k = self.cfg.rows, self.cfg.vec, self.slices, self.cfg.k
        bidx, _, _ = cute.arch.block_idx()
        col = bidx * WARPS + cute.arch.warp_idx()      # all 32 lanes, before any branch
        lane = cute.arch.lane_idx()
        # A warp past N (only when N % 8 != 0) works on row N-1 (in bounds) and never stores:
        # no branch around the shuffles below.
        colc = cutlass.min(col, Int32(self.cfg.n - 1))
        # 1. The warp's whole weight row, issued first (S 128-bit loads per lane from HBM).
        wall = cute.make_rmem_tensor(cute.make_layout((S, vec), stride=(vec, 1)), mW.element_type)
        for i in cutlass.range_constexpr(S):
            cute.autovec_copy(mW[colc, lane + i * 32, None], wall[i, None])
        chain.enter()      # PDL chain: x (qkv_a's output) is read below, the weights above
        nv = cute.make_rmem_tensor(cute.make_layout(vec), mN.element_type)
        xv = cute.make_rmem_tensor(cute.make_layout((S, vec), stride=(vec, 1)), mX.element_type)
        xn = cute.make_rmem_tensor(cute.make_layout(vec), mX.element_type)
        eps = Float32(self.cfg.eps)
        for r in cutlass.range_constexpr(m):
            # 2. Row r: the lane's slices of x (the same slices the plain kernel reads), Σx² over
            # the warp (lane order, then a butterfly: every lane gets the total), rstd.
            for i in cutlass.range_constexpr(S):
                cute.autovec_copy(mX[r, lane + i * 32, None], xv[i, None])
            ss = Float32(0.0)
            for i in cutlass.range_constexpr(S):
                for j in cutlass.range_constexpr(vec):
                    f = xv[i, j].to(Float32)
                    ss = ss + f * f
            ss = cute.arch.warp_reduction_sum(ss)
            rstd = cute.math.rsqrt(ss / Float32(k) + eps)
            # 3. xn = bf16(x · rstd · w_norm) (stock's rounding point), then the plain kernel's
            # dot product in its order: slice i, element j, one fp32 chain per lane. The norm
            # weight slice is loaded here, not up front (L1/L2-resident: every warp reads the
            # same K values; held across the shuffle it pushed ptxas past 128 registers).
            acc = Float32(0.0)
            for i in cutlass.range_constexpr(S):
                cute.autovec_copy(mN[lane + i * 32, None], nv)
                for j in cutlass.range_constexpr(vec):
                    xn[j] = (xv[i, j].to(Float32) * rstd * nv[j].to(Float32)).to(mX.element_type)
                for j in cutlass.range_constexpr(vec):
                    acc = acc + wall[i, j].to(Float32) * xn[j].to(Float32)
            tot = cute.arch.warp_reduction_sum(acc)
            if col < self.cfg.n:
                if lane == 0:
                    mO[r, col] = tot.to(mO.element_type)


def compile_for(cfg: GemvConfig) -> object:
    """The compiled kernel for `cfg` (cached)."""
    def build() -> object:
        bf = dummy_ptr(torch.bfloat16)
        return cute.compile(Gemv(cfg), bf, bf, bf, current_stream(), options=compile_options())
    return compiled(("gemv", cfg), build)


def compile_norm(cfg: GemvConfig) -> object:
    """The compiled gemv_rmsnorm kernel for `cfg` (cached)."""
    def build() -> object:
        bf = dummy_ptr(torch.bfloat16)
        return cute.compile(GemvRMSNorm(cfg), bf, bf, bf, bf, current_stream(), options=compile_options())
    return compiled(("gemv_rmsnorm", cfg), build)


def _out_for(m: int, n: int, like: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(m, n, dtype=torch.bfloat16, device=like.device)
    if (tuple(out.shape) != (m, n) or out.dtype != torch.bfloat16 or not out.is_contiguous()
            or out.device != like.device):
        raise ValueError(f"gemv out must be a contiguous [{m}, {n}] bf16 tensor on {like.device}, "
                         f"got {tuple(out.shape)} {out.dtype} contiguous={out.is_contiguous()} {out.device}")
    return out


# kernel "gemv_tuned": per-shape configurations used at M = 1 while the kernel is enabled
# (fused.enable() calls set_tuned), each the fastest of the device sweep (check_sweep on the
# H200 at c70b123, 2026-12-02 22:24 UTC, cold weights, one pass; every config there checked
# equal to the default, split-K within bf16 tolerance; its table is in bench/fused_runs.md, the
# same check at 801b1da in bench/fused_correctness.md). gemv(): key (N, K) of the weight;
# gemv_multi: key (K, segment N's, with router). Shapes not listed keep the default layout
# (q_b runs gemv_rmsnorm at M = 1 under mla_norm_fold, which these tables do not touch).
TUNED: dict[tuple[int, int], dict[str, object]] = {
    (3216, 7168): {"cols": 4, "kwarps": 4},   # in_proj: sk4w4 12.86 us vs 13.64 (u7 13.27)
    (7168, 768): {"hint": "no_allocate"},                          # o_proj: na 4.30 us vs 4.53
}
TUNED_MULTI: dict[tuple[int, tuple[int, ...], bool], dict[str, object]] = {
    (7168, (3584, 768), True): {"hint": "evict_first"},   # MoE front: ef 21.04 us vs 22.43 (na 21.07)
    (7168, (2112, 768), False): {"unroll": 7},            # MLA front: u7 12.23 us vs 12.81 (ef 12.52)
}
# The configurations check_sweep times (name -> GemvConfig field overrides of the plain kernel).
# Every one keeps each column's fp32 FMA order and its butterfly, so all are bit-identical to
# the default (the sweep asserts torch.equal). "full" (unroll = all slices) only where K is at
# most FULL_MAX_SLICES slices per lane.
# Unroll depths that do not divide the lane's slice count leave a conditional exit inside the
# unrolled body (PTX at K = 7168, 28 slices, unroll 8: 4 loads, a branch, 4 loads), and ptxas
# does not hoist loads above it: "u8" keeps ~4 in flight at K = 7168; "u7" / "u14" divide 28.
TUNE_CONFIGS: dict[str, dict[str, object]] = {
    "default": {},
    "u7": {"unroll": 7},
    "u8": {"unroll": 8},
    "u14": {"unroll": 14},
    "p2": {"per_warp": 2},
    "p2u7": {"per_warp": 2, "unroll": 7},
    "p4": {"per_warp": 4},
    "w4": {"warps": 4},
    "p2w4": {"per_warp": 2, "warps": 4},
    "na": {"hint": "no_allocate"},
    "p2na": {"per_warp": 2, "hint": "no_allocate"},
    "ef": {"hint": "evict_first"},
    "full": {"unroll": 0},          # 0: resolved to the lane's slice count (tune_fields)
    # the split-K layout at M = 1 (gemv() runs it from M = 2): each row's K split over the
    # CTA's warps, 2x-4x the warps per SM of the plain layout; ANOTHER fp32 summation order,
    # so within bf16 tolerance of the default, not bit-identical (check_sweep holds it to that)
    "sk4": {"cols": 4},
    "sk4w4": {"cols": 4, "kwarps": 4},
    "sk2": {"cols": 2},
}
FULL_MAX_SLICES = 8
# PDL chain: rounds of the split-K layout whose weights are loaded before the wait (16
# registers each at C = 4; in_proj's 804 CTAs of 4 warps stay one wave at ≤ 73 registers)
CHAIN_PEEL = 1
# With the router (gemv_multi's MoE front: ≤ 64 registers, 4 CTAs per SM) a lane's unrolled
# body holds at most this many 128-bit loads (weight + x; 4 registers each).
ROUTER_MAX_LOADS = 12
_tuned_on = False


def set_tuned(on: bool) -> None:
    """Use the TUNED / TUNED_MULTI tables at M = 1 (kernel "gemv_tuned" enabled) or not."""
    global _tuned_on
    _tuned_on = bool(on)


def tuned_on() -> bool:
    return _tuned_on


def tune_fields(fields: dict[str, object] | None, k: int) -> dict[str, object]:
    """A table/sweep entry as GemvConfig overrides: unroll 0 means the lane's whole row
    (K / 256 slices: every weight load of the lane issued up front)."""
    f = dict(fields or {})
    if f.get("unroll") == 0:
        f["unroll"] = max(1, k // (VEC * 32))
    return f


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
         splitk_warps: int = SPLITK_WARPS, unroll: int | None = None,
         tune: dict[str, object] | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]ᵀ on the current stream; both contiguous bf16; returns [M, N] bf16,
    written into `out` when given (a contiguous [M, N] bf16 tensor, e.g. buf[rank]).
    M = 1: K a multiple of 256 runs the original 128-bit kernel, a multiple of 128 the 64-bit
    one; 2 ≤ M ≤ SPLITK_MAX_ROWS: the split-K layout (SPLITK_COLS columns per CTA of
    `splitk_warps` warps, 4 or 8). `tune` (GemvConfig overrides, e.g. TUNE_CONFIGS["p2"]) picks
    a plain-layout configuration at M = 1 with K % 256 == 0; without it, TUNED[(N, K)] when
    set_tuned(True) (kernel "gemv_tuned"), else the default. All are bit-identical."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or not can_implement(m, n, k, (x.dtype, w.dtype), k_multiple=VEC_NARROW * 32,
                                            max_rows=SPLITK_MAX_ROWS):
        raise ValueError(f"gemv kernel cannot run M={m} N={n} K={k}")
    out = _out_for(m, n, x, out)
    vec = vec_for(k)
    unroll = GEMV_UNROLL if unroll is None else unroll
    if m >= SPLITK_MIN_ROWS:
        cfg = GemvConfig(n, k, m, vec=vec, cols=SPLITK_COLS, kwarps=splitk_warps)
    elif vec == VEC:
        if tune is None and _tuned_on:
            tune = TUNED.get((n, k))
        cfg = GemvConfig(n, k, m, **{"unroll": unroll, **tune_fields(tune, k)})
        if chain.early_release(m):
            cfg = replace(cfg, early=True)   # acted on by the preloaded short row (o_proj) only
    else:
        cfg = GemvConfig(n, k, m, vec=vec, unroll=unroll)
    compile_for(cfg)(ptr(x), ptr(w), ptr(out), current_stream())
    return out


def gemv_situ(h: torch.Tensor, w: torch.Tensor, inter: int, beta: float, lin_beta: float,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16(SiTU(h[:, :inter], h[:, inter:2·inter])) @ w[N, inter]ᵀ in one kernel (the shared
    expert's situ_glu + shared_down); h [M, 2·inter] and w contiguous bf16; returns [M, N] bf16
    (into `out` when given). Equals stock_ops.situ_glu(h, inter, β, β_lin) @ wᵀ up to the fp32
    summation order."""
    m = h.shape[0]
    n = w.shape[0]
    if (h.dim() != 2 or h.shape[1] != 2 * inter or w.dim() != 2 or w.shape[1] != inter
            or not can_implement_situ(m, n, inter, (h.dtype, w.dtype), max_rows=SPLITK_MAX_ROWS)):
        raise ValueError(f"gemv_situ cannot run h {tuple(h.shape)} w {tuple(w.shape)} inter={inter}")
    out = _out_for(m, n, h, out)
    cfg = GemvConfig(n, inter, m, vec=vec_for(inter), situ=True, beta=float(beta), lin_beta=float(lin_beta))
    compile_for(cfg)(ptr(h), ptr(w), ptr(out), current_stream())
    return out


def gemv_rmsnorm(a: torch.Tensor, w_norm: torch.Tensor, w: torch.Tensor, k: int, eps: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16(RMSNorm(a[:, :k]; w_norm, eps)) @ w[N, k]ᵀ in one kernel (MLA: qkv_norm's q half +
    q_b_proj); a [M, A ≥ k] contiguous bf16 (only its first k columns are read), w_norm [k],
    w [N, k]; returns [M, N] bf16 (into `out` when given). At M = 1 bit-identical to
    gemv(qa, w) for qa = the kernel's normalised row; qa equals stock's mla_norms output
    except where rstd's last fp32 bits move a product across a bf16 rounding boundary."""
    m, A = a.shape
    n = w.shape[0]
    if (a.dim() != 2 or w.dim() != 2 or w.shape[1] != k or tuple(w_norm.shape) != (k,)
            or not can_implement_norm(m, n, k, A, (a.dtype, w_norm.dtype, w.dtype), max_rows=SPLITK_MAX_ROWS)):
        raise ValueError(f"gemv_rmsnorm cannot run a {tuple(a.shape)} w {tuple(w.shape)} k={k}")
    out = _out_for(m, n, a, out)
    cfg = GemvConfig(n, k, m, eps=float(eps), x_stride=A)
    compile_norm(cfg)(ptr(a), ptr(w_norm), ptr(w), ptr(out), current_stream())
    return out


def reference_rmsnorm(x: torch.Tensor, w_norm: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x; w_norm, eps) in float64, unrounded: x / sqrt(mean(x²) + eps) · w_norm."""
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w_norm.double()


def emulate_rmsnorm(x: torch.Tensor, w_norm: torch.Tensor, eps: float) -> torch.Tensor:
    """The prologue's rounding in torch: fp32 Σx², rstd = rsqrt(Σx²/K + eps), bf16((x·rstd)·w)
    (the kernel's rsqrt is rsqrt.approx and its Σ order differs: equal up to rstd's last bits)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) / x.shape[-1] + eps)
    return (xf * rstd * w_norm.float()).to(x.dtype)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ wᵀ in float64 (the formula; no roundings)."""
    return x.double() @ w.double().t()


def reference_situ_act(h: torch.Tensor, inter: int, beta: float, lin_beta: float) -> torch.Tensor:
    """SiTU(h[:, :inter], h[:, inter:2·inter]) in float64: [β·tanh(g/β)·σ(g)]·[β_lin·tanh(u/β_lin)]."""
    g, u = h[..., :inter].double(), h[..., inter:2 * inter].double()
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (lin_beta * torch.tanh(u / lin_beta))


def reference_situ(h: torch.Tensor, w: torch.Tensor, inter: int, beta: float, lin_beta: float) -> torch.Tensor:
    """gemv_situ's formula in float64: SiTU(gate, up) @ wᵀ (no bf16 rounding of the activation)."""
    return reference_situ_act(h, inter, beta, lin_beta) @ w.double().t()


def check_variants(rows: tuple[int, ...] = (1, 3, 8), timing: bool = True) -> list[dict]:
    """The variants vs the stock ops on K3 TP16 shapes (kernel "gemv_variants"):
    - "out_slot": gemv(x, o_proj, out=buf[rank]) into a slot of a [16, M, N] buffer (the
      SimComm all-reduce buffer): returns that very slot, equals torch's x @ wᵀ, and every
      other slot is bit-for-bit unchanged;
    - "k384": gemv with K = 384 (shared_down [7168, 384], the 64-bit-load variant) vs x @ wᵀ;
    - "situ": gemv_situ(h, shared_down, 384, β, β_lin, out=buf[rank]) vs the stock
      situ_glu (fp32 SiTU rounded to bf16) then torch's matmul (rounded to bf16), other
      slots unchanged;
    - "in_proj": gemv on the KDA in_proj shape [3216, 7168] (at M ≥ 2 the split-K layout: the
      per-M table decision, M = 8 was 33 µs vs torch's 13.8 µs with the one-warp-per-column
      kernel); at M ≥ 2 also "in_proj_kw4": split-K with 4 warps per CTA instead of 8.
    At M ≥ 2 every gemv case runs the split-K kernel and gemv_situ its M-row prologue.
    Errors against stock ≤ 1e-2 and against float64 ≤ stock's own × 1.5 + 1e-3 (checks.py)."""
    from kimi_decode import stock_ops
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels import checks
    dev = torch.device(checks.DEVICE)
    out = []
    for m in rows:
        cfg = k3_tp16(batch=m, spec_tokens=0)
        D, Is = cfg.hidden, cfg.shared_local_inter                     # 7168, 384
        beta, lin = cfg.situ_beta, cfg.situ_linear_beta
        gen = torch.Generator(device=dev).manual_seed(1000 + m)
        world, rank = 16, 3
        cases = [("out_slot", (D, 768)), ("k384", (D, Is)), ("situ", (D, Is)), ("in_proj", (3216, D))]
        if m >= SPLITK_MIN_ROWS:
            cases.append(("in_proj_kw4", (3216, D)))          # split-K over 4 warps per CTA
        for case, (n, k) in cases:
            w = (torch.randn(n, k, generator=gen, device=dev) * k ** -0.5).bfloat16()
            buf = torch.randn(world, m, n, generator=gen, device=dev).bfloat16()
            before = buf.clone()
            slot = buf[rank]
            if case == "situ":
                h = (torch.randn(m, 2 * Is, generator=gen, device=dev) * 3.0).bfloat16()

                def stock_call(h=h, w=w) -> torch.Tensor:
                    return stock_ops.situ_glu(h, Is, beta, lin) @ w.t()

                def kernel_call(h=h, w=w, slot=slot) -> torch.Tensor:
                    return gemv_situ(h, w, Is, beta, lin, out=slot)
                ref = reference_situ(h, w, Is, beta, lin)
            else:
                x = torch.randn(m, k, generator=gen, device=dev).bfloat16()

                def stock_call(x=x, w=w) -> torch.Tensor:
                    return x @ w.t()

                if case == "out_slot":
                    def kernel_call(x=x, w=w, slot=slot) -> torch.Tensor:
                        return gemv(x, w, out=slot)
                elif case == "in_proj_kw4":
                    def kernel_call(x=x, w=w) -> torch.Tensor:
                        return gemv(x, w, splitk_warps=4)
                else:
                    def kernel_call(x=x, w=w) -> torch.Tensor:
                        return gemv(x, w)
                ref = reference(x, w)
            with torch.no_grad():
                y_s = stock_call()
                y_k = kernel_call()
            checks._sync()
            e_ks, e_k, e_s = checks.rel(y_k, y_s), checks.rel(y_k, ref), checks.rel(y_s, ref)
            layout = "situ" if case == "situ" else ("split_k" if m >= SPLITK_MIN_ROWS else "warp_per_col")
            if case == "in_proj_kw4":
                layout = "split_k_4warps"
            r = {"kernel": "gemv_variants", "case": case, "layout": layout, "M": m, "N": n, "K": k,
                 "rel_vs_stock": e_ks, "rel_vs_f64": e_k, "stock_rel_vs_f64": e_s}
            ok = (tuple(y_k.shape) == (m, n) and y_k.dtype == torch.bfloat16
                  and e_ks <= 1e-2 and e_k <= 1.5 * e_s + 1e-3)
            if case in ("out_slot", "situ"):
                others = [i for i in range(world) if i != rank]
                r["wrote_into_slot"] = y_k.data_ptr() == slot.data_ptr() and torch.equal(buf[rank], y_k)
                r["other_slots_untouched"] = torch.equal(buf[others], before[others])
                ok = ok and r["wrote_into_slot"] and r["other_slots_untouched"]
            r["ok"] = bool(ok)
            if timing:
                r["stock_us"] = checks.time_us(stock_call)
                r["kernel_us"] = checks.time_us(kernel_call)
                r["kernel_tbs"] = n * k * 2 / (r["kernel_us"] * 1e-6) / 1e12
            out.append(r)
    if timing:
        out += time_cold()
    return out


def time_cold(rows: int = 1, unrolls: tuple[int, ...] = (4, 8), copies: int = 4) -> list[dict]:
    """The plain GEMV at M = `rows` on the two largest K3 projections with the weight cycling
    through `copies` copies (≥ 184 MB, beyond the 50 MB L2, as in the step where each weight is
    read once), per unroll depth, against torch's matmul on the same cold weights; outputs of
    every depth must be bit-identical to the default's."""
    import itertools
    from kimi_decode.kernels import checks
    dev = torch.device(checks.DEVICE)
    out = []
    for name, (n, k) in {"in_proj": (3216, 7168), "latent_down": (3584, 7168)}.items():
        gen = torch.Generator(device=dev).manual_seed(n)
        ws = [(torch.randn(n, k, generator=gen, device=dev) * k ** -0.5).bfloat16() for _ in range(copies)]
        x = torch.randn(rows, k, generator=gen, device=dev).bfloat16()
        base = gemv(x, ws[0])
        cyc = itertools.cycle(ws)
        r = {"kernel": "gemv_variants", "case": f"cold_{name}", "M": rows, "N": n, "K": k,
             "torch_us": checks.time_us(lambda: x @ next(cyc).t())}
        ok = True
        for u in unrolls:
            ok = ok and torch.equal(gemv(x, ws[0], unroll=u), base)
            cyc = itertools.cycle(ws)
            t = checks.time_us(lambda u=u: gemv(x, next(cyc), unroll=u))
            r[f"unroll{u}_us"] = t
            r[f"unroll{u}_tbs"] = n * k * 2 / (t * 1e-6) / 1e12
        r["ok"] = bool(ok)
        out.append(r)
    return out


COLD_BYTES = 160 * 2 ** 20   # the timed calls cycle through ≥ this much weight (L2: 50 MB)


def exact(fields: dict[str, object]) -> bool:
    """Whether a TUNE_CONFIGS entry is bit-identical to the default (every plain-layout entry;
    not the split-K ones, cols > 0)."""
    return not fields.get("cols")


def sweep_configs(k: int, router: bool = False, multi: bool = False) -> dict[str, dict[str, object]]:
    """TUNE_CONFIGS applicable at reduction K (gemv_multi: the plain layout only; with the MoE
    front's router CTAs, whose 256-thread CTAs fix 8 warps per CTA, also at most
    ROUTER_MAX_LOADS loads per unrolled body): "full" only for K ≤ FULL_MAX_SLICES slices per
    lane; entries that resolve to the same kernel as an earlier one are left out."""
    out, seen = {}, set()
    slices = k // (VEC * 32)
    for name, f in TUNE_CONFIGS.items():
        g = tune_fields(f, k)
        if g.get("cols"):
            if not (multi or router):
                out[name] = f
            continue
        u = min(int(g.get("unroll", GEMV_UNROLL)), slices)     # unroll ≥ slices: all of them
        key = (u, g.get("per_warp", 1), g.get("warps", WARPS), g.get("hint", ""))
        if name == "full" and slices > FULL_MAX_SLICES:
            continue
        if key[1] == 4 and slices % u:        # 4 columns with a remainder loop: ptxas spills (q_b)
            continue
        if router and (key[2] != WARPS or u * (key[1] + 1) > ROUTER_MAX_LOADS):
            continue
        if key in seen:                                        # same kernel as an earlier entry
            continue
        seen.add(key)
        out[name] = f
    return out


def check_sweep(timing: bool = True) -> list[dict]:
    """Kernel "gemv_tuned": every TUNE_CONFIGS entry at M = 1 on the K3 TP16 shapes that run
    the plain GEMV layout (gemv: in_proj, o_proj, q_b; gemv_multi: the MoE front with the
    router, latent_down + shared gate/up; the MLA front, qkv_a + g_proj). Each config's outputs
    must equal the default's bit for bit (torch.equal; the router's ids and weights too), the
    default within bf16 tolerance of torch's matmul. With timing, each config on COLD weights
    (the calls cycle through copies totalling ≥ COLD_BYTES, beyond the 50 MB L2, as in the step
    where every weight is read once): "<config>_us", plus "best" / "best_us" / "default_us".
    One row per shape; TUNED / TUNED_MULTI take the winners (one line per shape)."""
    import itertools
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels import checks
    from kimi_decode.kernels import gemv_multi as gm
    dev = torch.device(checks.DEVICE)
    cfg = k3_tp16()
    D = cfg.hidden
    out = []

    def copies_for(nbytes: int) -> int:
        return max(2, -(-COLD_BYTES // nbytes))

    def finish(r: dict, times: dict[str, float], nbytes: int) -> None:
        for name, t in times.items():
            r[f"{name}_us"] = t
        best = min(times, key=times.get)
        r.update(best=best, best_us=times[best], default_us=times["default"],
                 best_tbs=nbytes / (times[best] * 1e-6) / 1e12, default_tbs=nbytes / (times["default"] * 1e-6) / 1e12)

    gen = torch.Generator(device=dev).manual_seed(4242)
    for name in ("in_proj", "o_proj", "q_b"):
        n, k = checks.GEMV_SHAPES[name]
        ws = [(torch.randn(n, k, generator=gen, device=dev) * k ** -0.5).bfloat16()]
        x = torch.randn(1, k, generator=gen, device=dev).bfloat16()
        with torch.no_grad():
            base = gemv(x, ws[0], tune={})
            e = checks.rel(base, x @ ws[0].t())
        r = {"kernel": "gemv_tuned", "case": name, "M": 1, "N": n, "K": k, "rel_default_vs_stock": e}
        ok = e <= 1e-2
        confs = sweep_configs(k)
        for c, f in confs.items():
            with torch.no_grad():
                y = gemv(x, ws[0], tune=f)
            if exact(f):
                eq = torch.equal(y, base)
                r[f"equal_{c}"] = eq
            else:                      # split-K: another summation order, bf16 tolerance
                e_c = checks.rel(y, base)
                r[f"rel_{c}_vs_default"] = e_c
                eq = e_c <= 1e-2 and checks.rel(y, reference(x, ws[0])) <= 1.5 * checks.rel(base, reference(x, ws[0])) + 1e-3
            ok = ok and eq
        checks._sync()
        r["ok"] = bool(ok)
        if timing:
            ws += [w.clone() for w in ws for _ in range(copies_for(n * k * 2) - 1)]
            times = {}
            for c, f in confs.items():
                cyc = itertools.cycle(ws)
                times[c] = checks.time_us(lambda f=f, cyc=cyc: gemv(x, next(cyc), tune=f))
            finish(r, times, n * k * 2)
        out.append(r)

    # the two gemv_multi groupings (fused.py's moe_front and qkv_a_g ops)
    y = torch.nn.functional.rms_norm(torch.randn(1, D, generator=gen, device=dev), (D,)).bfloat16()

    def w(n: int) -> torch.Tensor:
        return (torch.randn(n, D, generator=gen, device=dev) * D ** -0.5).bfloat16()

    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    bias = torch.randn(cfg.num_experts, generator=gen, device=dev) * 0.02
    front = (w(cfg.num_experts), w(cfg.latent_dim), w(2 * cfg.shared_local_inter))
    mla = (w(cfg.qkv_a_rows), w(cfg.mla_local_heads * cfg.v_head_dim))

    def run_front(ws: tuple[torch.Tensor, ...], f: dict[str, object]) -> tuple:
        ids, wt, outs = gm.route_and_project(y, ws[0], bias, cfg.top_k, cfg.routed_scaling, counter,
                                             list(ws[1:]), tune=f)
        return (ids, wt, *outs)

    def run_mla(ws: tuple[torch.Tensor, ...], f: dict[str, object]) -> tuple:
        return tuple(gm.gemv_multi(y, list(ws), tune=f))

    for case, ws, fn, router in (("moe_front", front, run_front, True), ("mla_front", mla, run_mla, False)):
        nbytes = sum(t.numel() for t in ws) * 2
        with torch.no_grad():
            base = fn(ws, {})
            stock = [y @ t.t() for t in ws[1:]] if router else [y @ t.t() for t in ws]
            projs = base[2:] if router else base
            e = max(checks.rel(a, b) for a, b in zip(projs, stock))
        segs = tuple(t.shape[0] for t in (ws[1:] if router else ws))
        r = {"kernel": "gemv_tuned", "case": case, "M": 1, "K": D, "segs": segs, "router": router,
             "rel_default_vs_stock": e}
        ok = e <= 1e-2
        confs = sweep_configs(D, router, multi=True)
        for c, f in confs.items():
            eq = all(torch.equal(a, b) for a, b in zip(fn(ws, f), base))
            r[f"equal_{c}"] = eq
            ok = ok and eq
        checks._sync()
        r["counter_zero"] = int(counter.item()) == 0
        r["ok"] = bool(ok and r["counter_zero"])
        if timing:
            sets = [ws] + [tuple(t.clone() for t in ws) for _ in range(copies_for(nbytes) - 1)]
            times = {}
            for c, f in confs.items():
                cyc = itertools.cycle(sets)
                times[c] = checks.time_us(lambda f=f, cyc=cyc: fn(next(cyc), f))
            finish(r, times, nbytes)
            r["counter_zero_after_replays"] = int(counter.item()) == 0
            r["ok"] = r["ok"] and r["counter_zero_after_replays"]
        out.append(r)
    return out


def main_variants() -> None:
    from kimi_decode.kernels.checks import _print
    _print(check_variants())

if __name__ == "__main__":
    from kimi_decode.kernels.checks import main_gemv
    import sys
    if "--sweep" in sys.argv:
        from kimi_decode.kernels.checks import _print
        _print(check_sweep())
    else:
        main_gemv()
        main_variants()
