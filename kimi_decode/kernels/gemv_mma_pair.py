"""Two skinny GEMMs of the same x in one grid on the tensor cores, 2 ≤ M ≤ 8 (kernel
"gemv_mma_pair"): out1 = x @ W1ᵀ and out2 = x @ W2ᵀ, bf16 in and out, each weight streamed
once. The MLA layer's qkv_a and g_proj at M = 2..8 (B = 8, or B = 1 with k = 7).

Why: at M = 1 gemv_multi already runs qkv_a and g_proj as one launch (op `qkv_a_g`); from
M = 2 they were two gemv_mma launches, g_proj on the side stream beside qkv_a (30.3 MB and
11.0 MB of weights, 14.2 and 11.6-12.4 µs in the B = 1, k = 7 and B = 8 traces of 6c4ee16):
two grids competing for the SMs, the side stream's fork and join, and one kernel per MLA
layer more than the issue's budget allows. One grid of 132 + 48 CTAs streams both.

Layout: gemv_mma's (kernels/gemv_mma.py, whose docstring this module assumes) per CTA: CTA
b < T1 = ceil(N1 / 16) is tile b of W1, CTA b ≥ T1 tile b − T1 of W2; both halves run with
the warps warps_for picks for the combined grid (8 at K3), so a tile of W1 runs exactly as
gemv_mma runs it at that warp count (the same loads, mma order and warp-order sum: bit-equal
to gemv_mma(x, W1) when warps_for(N1, K) is the same, as at K3), and a tile of W2 as gemv_mma
at 8 warps (standalone g_proj takes 16: another split of K over the warps, so equal to it
within bf16 rounding, not bit for bit). The branch on the block index is CTA-uniform.

PDL chain: as gemv_mma, each CTA loads its first round of weights before the wait.

SIGNAL (an A/B, off; CPU-tested only): q_b (the RMSNorm-prologue GEMV after this grid, fused's
fold mode "mma") needs only qkv_a's output, but griddepcontrol.wait makes it wait for the whole
grid, g_proj's 11 MB included; g_proj's output is read only by the attention's uv tiles three
kernels later. With SIGNAL the two kernels launch as GemvMmaPairSignal and GemvMmaNormAfter
over a two-word int32 counter (zero between calls, pair_counter()):
  - each qkv_a CTA signals its tile written (_common.signal_count: CTA barrier, fence, atom.add
    release on word 0);
  - g_proj's CTAs, with G_AFTER_QKV, after their chain step wait until all T1 qkv_a CTAs have
    signalled (_common.wait_count), so qkv_a streams alone first (all 180 CTAs are resident at
    once at 8 warps, and CTAs with equal loads in flight progress at equal rates: without the
    wait qkv_a ends with g_proj);
  - q_b's CTAs load their first weights, release the next kernel (mla_glue, whose pre-wait part
    reads only W_UK), wait until the T1 qkv_a CTAs have signalled, normalise and multiply, and
    only then wait for this grid (griddepcontrol.wait, thread 0, after their stores): so q_b's
    completion still implies the pair's, and every later kernel's wait still covers g_proj
    (mla_glue's wait covers q_b, the attention's covers mla_glue). Thread 0 then arrives on word
    1; the last q_b CTA to arrive re-zeroes both words (every consumer of word 0 has passed:
    the q_b CTAs have, and the g_proj CTAs have since the pair is complete).
No deadlock: q_b's CTAs launch only once every pair CTA has started (PDL), and a qkv_a CTA
waits on nothing but its own chain wait. Expected (arithmetic, not measured): q_b starts
after qkv_a's 30.3 MB instead of the pair's 41.3, up to ~2.6 µs per M = 8 MLA layer at the
H200's copy rate, if g_proj's 48-CTA tail (on 48 SMs) ends before the attention needs those SMs
(~6 µs later). Outputs are the default build's bit for bit (the same tiles; only when each
kernel may start moves).

Check on the GPU (M = 2, 4, 8 at K3's qkv_a and g_proj: against the stock GEMMs, gemv_mma and
float64; cold-weight timing of the stock pair, the two gemv_mma launches and this kernel):
    python -m kimi_decode.kernels.gemv_mma_pair
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

import dataclasses
import functools
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from kimi_decode.kernels import chain
from kimi_decode.kernels._common import compile_options, compiled, current_stream, dummy_ptr, ptr, signal_count
from kimi_decode.kernels.gemv_mma import (CHUNK, TILE, UNROLL, WARP_CHOICES, GemvMma, GemvMmaConfig, GemvMmaNorm,
                                          norm_config, warps_for)
from kimi_decode.kernels.gemv_mma import can_implement as mma_can_implement


@dataclass(frozen=True)
class GemvMmaPairConfig:
    """Compile-time sizes: the two outputs' columns N1, N2, the shared K and M, warps per CTA
    (both halves) and the unroll depth."""

    n1: int
    n2: int
    k: int
    rows: int
    warps: int
    unroll: int = UNROLL
    signal: bool = False       # GemvMmaPairSignal (SIGNAL)
    g_after: bool = False      # ... and g_proj's CTAs wait for qkv_a's (G_AFTER_QKV)


def can_implement(m: int, n1: int, n2: int, k: int, dtypes: tuple[torch.dtype, ...]) -> bool:
    """gemv_mma's rules for the combined [N1 + N2, K] weight (the warp count of the grid) and
    for each half."""
    return (n2 >= 1 and mma_can_implement(m, n1 + n2, k, dtypes)
            and mma_can_implement(m, n1, k, dtypes) and mma_can_implement(m, n2, k, dtypes))


# Warps per CTA of the pair's grid: None = gemv_mma's warps_for on the combined weight (8 at K3:
# 180 CTAs); the check also times 16.
WARPS: int | None = None
# The qkv_a-first signal to q_b (module docstring, "SIGNAL"); read by fused when it enables the
# MLA layers (the counter is allocated there) and by check(). An A/B: off.
SIGNAL = False
# With SIGNAL: g_proj's CTAs start streaming only once qkv_a's have all signalled.
G_AFTER_QKV = True
COUNTER_WORDS = 2       # qkv_a CTAs signalled; q_b CTAs done (the last re-zeroes both)


def config_for(m: int, n1: int, n2: int, k: int, unroll: int = UNROLL,
               warps: int | None = None) -> GemvMmaPairConfig:
    w = warps or WARPS or warps_for(n1 + n2, k)
    if w not in WARP_CHOICES or (k // CHUNK) % w:
        raise ValueError(f"gemv_mma_pair cannot split K = {k} over {w} warps")
    return GemvMmaPairConfig(n1, n2, k, m, w, unroll)


class GemvMmaPair:
    """See the module docstring: gemv_mma's tile body for W1 on the first T1 CTAs, for W2 on the
    rest."""

    def __init__(self, cfg: GemvMmaPairConfig) -> None:
        self.cfg = cfg
        self.first = GemvMma(GemvMmaConfig(cfg.n1, cfg.k, cfg.rows, cfg.warps, cfg.unroll))
        self.second = GemvMma(GemvMmaConfig(cfg.n2, cfg.k, cfg.rows, cfg.warps, cfg.unroll))
        self.t1 = self.first.ctas
        self.ctas = self.first.ctas + self.second.ctas

    @cute.jit
    def views(self, x: cute.Pointer, w1: cute.Pointer, w2: cute.Pointer, o1: cute.Pointer, o2: cute.Pointer):
        """x and the weights as int32 words [rows, K / 8, 4], the outputs [M, N]."""
        n1, n2, k, m = self.cfg.n1, self.cfg.n2, self.cfg.k, self.cfg.rows
        words = cute.make_layout((m, k // 8, 4), stride=(k // 2, 4, 1))
        mX = cute.make_tensor(cute.recast_ptr(x, dtype=Int32), words)
        mW1 = cute.make_tensor(cute.recast_ptr(w1, dtype=Int32),
                               cute.make_layout((n1, k // 8, 4), stride=(k // 2, 4, 1)))
        mW2 = cute.make_tensor(cute.recast_ptr(w2, dtype=Int32),
                               cute.make_layout((n2, k // 8, 4), stride=(k // 2, 4, 1)))
        mO1 = cute.make_tensor(o1, cute.make_layout((m, n1), stride=(n1, 1)))
        mO2 = cute.make_tensor(o2, cute.make_layout((m, n2), stride=(n2, 1)))
        return mX, mW1, mW2, mO1, mO2

    @cute.jit
    def __call__(self, x: cute.Pointer, w1: cute.Pointer, w2: cute.Pointer, o1: cute.Pointer,
                 o2: cute.Pointer, stream: cuda.CUstream):
        mX, mW1, mW2, mO1, mO2 = self.views(x, w1, w2, o1, o2)
        self.kernel(mX, mW1, mW2, mO1, mO2).launch(grid=[self.ctas, 1, 1], block=[self.cfg.warps * 32, 1, 1],
                                                   stream=stream, use_pdl=chain.chain_on())

    @cute.jit
    def store_tile(self, red: cute.Tensor, mO: cute.Tensor, tile: Int32, n: cutlass.Constexpr[int],
                   tidx: Int32):
        """gemv_mma's finish: thread tidx < 128 writes output (row, 16·tile + column)."""
        if tidx < TILE * 8:
            c, r, tot = self.first.tile_sum(red, tidx)
            col = tile * TILE + c
            if r < self.cfg.rows:
                if col < n:
                    mO[r, col] = tot.to(mO.element_type)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW1: cute.Tensor, mW2: cute.Tensor, mO1: cute.Tensor,
               mO2: cute.Tensor):
        self.body(mX, mW1, mW2, mO1, mO2, None)

    @cute.jit
    def body(self, mX: cute.Tensor, mW1: cute.Tensor, mW2: cute.Tensor, mO1: cute.Tensor, mO2: cute.Tensor,
             mC: cute.Tensor | None):
        """The grid: tile b < T1 of W1, else tile b − T1 of W2. With the SIGNAL counter `mC`: a
        W1 tile signals once written, and (g_after) a W2 tile streams only once all T1 have."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()                     # all 32 lanes, before any branch
        lane = cute.arch.lane_idx()
        red = self.first.smem_red()
        if bidx < self.t1:                              # CTA-uniform
            self.first.tile_partials(mX, mW1, red, bidx, tidx, warp, lane)
            self.store_tile(red, mO1, bidx, self.cfg.n1, tidx)
            if cutlass.const_expr(mC is not None):
                signal_count(mC, tidx)                  # qkv_a tile written
        else:
            if cutlass.const_expr(mC is not None and self.cfg.g_after):
                self.second.tile_partials(mX, mW2, red, bidx - self.t1, tidx, warp, lane, after=mC,
                                          after_target=self.t1)
            else:
                self.second.tile_partials(mX, mW2, red, bidx - self.t1, tidx, warp, lane)
            self.store_tile(red, mO2, bidx - self.t1, self.cfg.n2, tidx)


class GemvMmaPairSignal(GemvMmaPair):
    """The pair with SIGNAL (module docstring): qkv_a's CTAs signal on counter word 0; with
    g_after, g_proj's CTAs wait for all T1 of them after their chain step."""

    @cute.jit
    def __call__(self, x: cute.Pointer, w1: cute.Pointer, w2: cute.Pointer, o1: cute.Pointer,
                 o2: cute.Pointer, counter: cute.Pointer, stream: cuda.CUstream):
        mX, mW1, mW2, mO1, mO2 = self.views(x, w1, w2, o1, o2)
        mC = cute.make_tensor(counter, cute.make_layout(COUNTER_WORDS))
        self.kernel_signal(mX, mW1, mW2, mO1, mO2, mC).launch(
            grid=[self.ctas, 1, 1], block=[self.cfg.warps * 32, 1, 1], stream=stream, use_pdl=chain.chain_on())

    @cute.kernel
    def kernel_signal(self, mX: cute.Tensor, mW1: cute.Tensor, mW2: cute.Tensor, mO1: cute.Tensor,
                      mO2: cute.Tensor, mC: cute.Tensor):
        self.body(mX, mW1, mW2, mO1, mO2, mC)


class GemvMmaNormAfter(GemvMmaNorm):
    """q_b after GemvMmaPairSignal (module docstring, "SIGNAL"): GemvMmaNorm's tile, entered on
    the qkv_a CTAs' signal instead of the pair's completion, the pair's completion waited for
    at the end, and the counter re-zeroed by the last CTA. cfg.after = T1, the signals to wait
    for."""

    @cute.jit
    def __call__(self, a: cute.Pointer, w_norm: cute.Pointer, w: cute.Pointer, out: cute.Pointer,
                 counter: cute.Pointer, stream: cuda.CUstream):
        mA, mNw, mW, mO = self.norm_views(a, w_norm, w, out)
        mC = cute.make_tensor(counter, cute.make_layout(COUNTER_WORDS))
        self.kernel_after(mA, mNw, mW, mO, mC).launch(grid=[self.ctas, 1, 1], block=[self.cfg.warps * 32, 1, 1],
                                                      stream=stream, use_pdl=chain.chain_on())

    @cute.kernel
    def kernel_after(self, mA: cute.Tensor, mNw: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor, mC: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()                     # all 32 lanes, before any branch
        lane = cute.arch.lane_idx()
        red = self.smem_red()
        self.tile_partials(mA, mW, red, bidx, tidx, warp, lane, True, mNw, after=mC, after_target=self.cfg.after,
                           wait_now=False)
        self.store_out(red, mO, bidx, tidx)
        if tidx == 0:                                   # the pair complete (g_proj), then the re-zeroing
            chain.wait()
            old = cute.arch.atomic_add(mC.iterator + 1, Int32(1), sem="acq_rel", scope="gpu")
            if old == self.ctas - 1:                    # the last q_b CTA: no consumer of word 0 left
                mC[0] = Int32(0)
                mC[1] = Int32(0)


def compile_for(cfg: GemvMmaPairConfig) -> object:
    """The compiled kernel for `cfg` (cached)."""
    def build() -> object:
        bf = dummy_ptr(torch.bfloat16)
        if cfg.signal:
            return cute.compile(GemvMmaPairSignal(cfg), bf, bf, bf, bf, bf, dummy_ptr(torch.int32), current_stream(),
                                options=compile_options())
        return cute.compile(GemvMmaPair(cfg), bf, bf, bf, bf, bf, current_stream(), options=compile_options())
    return compiled(("gemv_mma_pair", cfg), build)


def compile_norm_after(cfg: GemvMmaConfig) -> object:
    """The compiled GemvMmaNormAfter for `cfg` (cached)."""
    def build() -> object:
        bf = dummy_ptr(torch.bfloat16)
        return cute.compile(GemvMmaNormAfter(cfg), bf, bf, bf, bf, dummy_ptr(torch.int32), current_stream(),
                            options=compile_options())
    return compiled(("gemv_mma_norm_after", cfg), build)


def pair_counter(device: torch.device | str) -> torch.Tensor:
    """The zeroed counter words one MLA layer's signalled pair and q_b share (SIGNAL)."""
    return torch.zeros(COUNTER_WORDS, dtype=torch.int32, device=device)


def _check_counter(counter: torch.Tensor) -> None:
    if counter.dtype != torch.int32 or counter.numel() != COUNTER_WORDS or not counter.is_contiguous():
        raise ValueError(f"gemv_mma_pair: the signal counter must be {COUNTER_WORDS} contiguous int32 words "
                         f"(pair_counter), not {counter.dtype} {tuple(counter.shape)}")


def gemv_mma_rmsnorm_after(a: torch.Tensor, w_norm: torch.Tensor, w: torch.Tensor, k: int, eps: float,
                           counter: torch.Tensor, producers: int) -> torch.Tensor:
    """gemv_mma.gemv_mma_rmsnorm right after gemv_mma_pair(..., counter=counter) on the same
    stream (SIGNAL): the same result bit for bit, entered on the `producers` (the pair's T1)
    qkv_a CTAs' signal. It re-zeroes the counter; the pair must have been launched with it."""
    _check_counter(counter)
    cfg = dataclasses.replace(norm_config(a, w_norm, w, k, eps), after=int(producers))
    out = torch.empty(a.shape[0], cfg.n, dtype=torch.bfloat16, device=a.device)
    compile_norm_after(cfg)(ptr(a), ptr(w_norm), ptr(w), ptr(out), ptr(counter), current_stream())
    return out


@functools.lru_cache(maxsize=None)
def producers(m: int, n1: int, n2: int, k: int) -> int:
    """T1: the qkv_a CTAs of the pair's grid at these shapes (the signals q_b waits for)."""
    return GemvMmaPair(config_for(m, n1, n2, k)).t1


def gemv_mma_pair(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *, unroll: int = UNROLL,
                  warps: int | None = None, counter: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ w1ᵀ, x @ w2ᵀ) in one launch on the current stream for 2 ≤ M ≤ 8; x [M, K], w1
    [N1, K], w2 [N2, K] contiguous bf16; returns two contiguous [M, N1], [M, N2] bf16 tensors.
    `unroll`, `warps`: the grid's configuration (config_for's defaults otherwise). `counter`
    (SIGNAL, pair_counter): launch GemvMmaPairSignal; gemv_mma_rmsnorm_after must follow."""
    m, k = x.shape
    n1, n2 = w1.shape[0], w2.shape[0]
    if (w1.shape[1] != k or w2.shape[1] != k or not all(t.is_contiguous() for t in (x, w1, w2))
            or not can_implement(m, n1, n2, k, (x.dtype, w1.dtype, w2.dtype))):
        raise ValueError(f"gemv_mma_pair cannot run x {tuple(x.shape)} w1 {tuple(w1.shape)} "
                         f"w2 {tuple(w2.shape)} ({x.dtype}, {w1.dtype}, {w2.dtype})")
    o1 = torch.empty(m, n1, dtype=torch.bfloat16, device=x.device)
    o2 = torch.empty(m, n2, dtype=torch.bfloat16, device=x.device)
    cfg = config_for(m, n1, n2, k, unroll, warps)
    if counter is None:
        compile_for(cfg)(ptr(x), ptr(w1), ptr(w2), ptr(o1), ptr(o2), current_stream())
    else:
        _check_counter(counter)
        cfg = dataclasses.replace(cfg, signal=True, g_after=G_AFTER_QKV)
        compile_for(cfg)(ptr(x), ptr(w1), ptr(w2), ptr(o1), ptr(o2), ptr(counter), current_stream())
    return o1, o2


def reference(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 statement: (x @ w1ᵀ, x @ w2ᵀ), not rounded."""
    xd = x.double()
    return xd @ w1.double().t(), xd @ w2.double().t()


def check(timing: bool = True) -> list[dict]:
    """At M = 2, 4, 8 on K3 TP16's qkv_a [2112, 7168] and g_proj [768, 7168]: both outputs
    against the stock GEMM op (stock_ops.OpSet.linear) and float64 (checks.py's rule: within
    1e-2 of stock, no further from float64 than 1.5x stock's error), against gemv_mma per
    weight ("first_equal_gemv_mma": bit-equal where the warp counts agree, as at K3; the second
    within 1e-2), repeat bit-equal. With timing, on COLD weights (the calls cycle through
    copies ≥ 160 MB): stock_us (the two stock GEMMs in a row), mma_us (two gemv_mma launches in
    a row), kernel_us, kernel_tbs, and kernel_w{warps}_u{unroll}_us for the other grid
    configurations (16 warps per CTA, 8 chunks in flight per lane).
    With SIGNAL on, each row also runs the signalled pair and q_b (K3's q_b [1152, 1536] with its
    RMSNorm prologue on qkv_a's q part) twice in a row: both outputs bit-equal to the plain
    pair's, q bit-equal to gemv_mma_rmsnorm on them, the counter zero after each call
    ("signal_equal", "signal_counter_zero"); with timing, the pair + q_b both ways
    ("pair_qb_us", "signal_pair_qb_us": cold, one stream; the step's overlap needs the chain)."""
    import itertools

    from kimi_decode import stock_ops
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels import checks
    from kimi_decode.kernels import gemv_mma as gm
    from kimi_decode.kernels.gemv_mma import gemv_mma
    dev = torch.device(checks.DEVICE)
    cfg = k3_tp16(batch=8, spec_tokens=0)
    ops = stock_ops.OpSet(cfg)
    D, n1, n2 = cfg.hidden, cfg.qkv_a_rows, cfg.mla_local_heads * cfg.v_head_dim
    out = []
    for m in (2, 4, 8):
        gen = torch.Generator(device=dev).manual_seed(7700 + m)

        def weights() -> tuple[torch.Tensor, torch.Tensor]:
            return ((torch.randn(n1, D, generator=gen, device=dev) * D ** -0.5).bfloat16(),
                    (torch.randn(n2, D, generator=gen, device=dev) * D ** -0.5).bfloat16())
        w1, w2 = weights()
        x = torch.randn(m, D, generator=gen, device=dev).bfloat16()
        with torch.no_grad():
            s1, s2 = ops.linear(x, w1), ops.linear(x, w2)
            k1, k2 = gemv_mma_pair(x, w1, w2)
            g1, g2 = gemv_mma(x, w1), gemv_mma(x, w2)
            r1, r2 = gemv_mma_pair(x, w1, w2)
        checks._sync()
        f1, f2 = reference(x, w1, w2)
        r = {"kernel": "gemv_mma_pair", "M": m, "N1": n1, "N2": n2, "K": D,
             "warps": warps_for(n1 + n2, D), "gemv_mma_warps": [warps_for(n1, D), warps_for(n2, D)],
             "rel_vs_stock": max(checks.rel(k1, s1), checks.rel(k2, s2)),
             "rel_vs_f64": max(checks.rel(k1, f1), checks.rel(k2, f2)),
             "stock_rel_vs_f64": max(checks.rel(s1, f1), checks.rel(s2, f2)),
             "first_equal_gemv_mma": bool(torch.equal(k1, g1)),
             "second_rel_vs_gemv_mma": checks.rel(k2, g2),
             "repeat_equal": bool(torch.equal(r1, k1) and torch.equal(r2, k2))}
        same_warps = warps_for(n1, D) == r["warps"]
        r["ok"] = bool(r["rel_vs_stock"] <= 1e-2 and r["rel_vs_f64"] <= 1.5 * r["stock_rel_vs_f64"] + 1e-3
                       and (r["first_equal_gemv_mma"] or not same_warps)
                       and r["second_rel_vs_gemv_mma"] <= 1e-2 and r["repeat_equal"])
        if SIGNAL:
            qb = (torch.randn(cfg.mla_local_heads * cfg.qk_head_dim, cfg.q_lora_rank, generator=gen, device=dev)
                  * cfg.q_lora_rank ** -0.5).bfloat16()
            nw = (1.0 + 0.1 * torch.randn(cfg.q_lora_rank, generator=gen, device=dev)).bfloat16()
            ql, eps, t1 = cfg.q_lora_rank, cfg.rms_eps, producers(m, n1, n2, D)
            counter = pair_counter(dev)
            with torch.no_grad():
                q_plain = gm.gemv_mma_rmsnorm(k1, nw, qb, ql, eps)
                equal, zero = True, True
                for _ in range(2):
                    a1, a2 = gemv_mma_pair(x, w1, w2, counter=counter)
                    qs = gemv_mma_rmsnorm_after(a1, nw, qb, ql, eps, counter, t1)
                    checks._sync()
                    equal = equal and bool(torch.equal(a1, k1) and torch.equal(a2, k2) and torch.equal(qs, q_plain))
                    zero = zero and not bool(counter.any())
            r.update({"signal_equal": equal, "signal_counter_zero": zero, "signal_producers": t1,
                      "g_after_qkv": G_AFTER_QKV})
            r["ok"] = bool(r["ok"] and equal and zero)
        if timing:
            copies = max(2, -(-(160 << 20) // ((n1 + n2) * D * 2)))
            ws = [(w1, w2)] + [weights() for _ in range(copies - 1)]
            cyc = itertools.cycle(ws)

            def stock_pair() -> None:
                a, b = next(cyc)
                ops.linear(x, a)
                ops.linear(x, b)

            def mma_pair() -> None:
                a, b = next(cyc)
                gemv_mma(x, a)
                gemv_mma(x, b)
            r["stock_us"] = checks.time_us(stock_pair)
            cyc = itertools.cycle(ws)
            r["mma_us"] = checks.time_us(mma_pair)
            cyc = itertools.cycle(ws)
            r["kernel_us"] = checks.time_us(lambda: gemv_mma_pair(x, *next(cyc)))
            r["kernel_tbs"] = (n1 + n2) * D * 2 / (r["kernel_us"] * 1e-6) / 1e12
            for warps, unroll in ((8, 8), (16, 4), (16, 8)):      # the other configurations
                cyc = itertools.cycle(ws)
                r[f"kernel_w{warps}_u{unroll}_us"] = checks.time_us(
                    lambda warps=warps, unroll=unroll: gemv_mma_pair(x, *next(cyc), unroll=unroll, warps=warps))
            if SIGNAL:
                def plain_pair_qb() -> None:
                    a, b = next(cyc)
                    gm.gemv_mma_rmsnorm(gemv_mma_pair(x, a, b)[0], nw, qb, ql, eps)

                def signal_pair_qb() -> None:
                    a, b = next(cyc)
                    gemv_mma_rmsnorm_after(gemv_mma_pair(x, a, b, counter=counter)[0], nw, qb, ql, eps, counter, t1)
                cyc = itertools.cycle(ws)
                r["pair_qb_us"] = checks.time_us(plain_pair_qb)
                cyc = itertools.cycle(ws)
                r["signal_pair_qb_us"] = checks.time_us(signal_pair_qb)
                r["ok"] = bool(r["ok"] and not counter.any())
            del ws
        out.append(r)
    return out


if __name__ == "__main__":
    for row in check():
        print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
