"""The MoE front at 2 ≤ M ≤ 8 in one grid on the tensor cores (kernel "front_mma"): the router
(fp32 logits + sigmoid + correction-bias top-k + renormalise), the latent down-projection and,
optionally, the shared expert's gate/up, all of y, as one launch.

Why: at M = 1 the front is one grid (gemv_multi: 24-25 µs in the step for 75 MB where the
separate kernels took 39.8), but at M = 8 it was still three: router_mma (56 CTAs of 16 warps,
main stream), latent_down (gemv_mma, 224 CTAs, side stream) beside it, and the shared gate/up
after the router on the side stream. In the bundled B = 1, k = 7 trace (KDA layer L5,
bench/fused_runs.md session 15) router_mma and latent_down end 17.2 / 20.4 µs after mlp_res for
64.2 MB: 3.1 TB/s, where the copy rate would take 15.2 µs; and the MLA layer is 7 kernels over
the issue's 13 at M = 8 (this removes one, two with the shared gate/up).

Layout: grid = [router tiles][latent_down tiles][shared gate/up tiles], every CTA `warps` warps
running one gemv_mma tile (kernels/gemv_mma.py, whose docstring this module assumes:
GemvMma.tile_partials, 16 weight rows over the whole K). The block scheduler hands out CTAs in
index order, so the router's 56 tiles start first. A router tile stores its 16 × M fp32 sums in
a [M, E] scratch and arrives on a counter (router_mma's grid completion, counted over the router
tiles only); the last router tile to arrive copies the logits and the bias into shared memory
and runs router_fast's top-k (one warp per row) while the projection tiles still stream, then
re-zeroes the counter. The projection tiles store bf16 as gemv_mma does. Every CTA loads its
first round of weights before the PDL chain's wait; none releases the next kernel (FC1) before
its own loop has ended: with RELEASE_AT_END each CTA releases once its mma loop is done (FC1's
CTAs become resident only as this grid's last wave drains), without it FC1 launches when the
grid has completed. FC1 waits (griddepcontrol.wait) for the whole grid either way. With TAIL_SPLIT (an A/B, off)
the grid's last `tail` projection tiles, the ones past its last full wave, run as pairs of
half-K CTAs whose second arrival adds the halves (TAIL_SPLIT's note, split_aware, half_tile).

Math: each tile is gemv_mma's at `warps` warps (its loads, mma order, warp-order sum), so at
16 warps (the default) the router's logits are router_mma's own (the same tile, S = 1, 16 warps:
the same expert sets) and the shared gate/up bit-equal to gemv_mma (warps_for picks 16 for its
48-CTA grid), latent_down equal to gemv_mma within bf16 rounding (8 warps there: another split
of K); at 8 warps latent_down is bit-equal and the router's sums differ from router_mma's in
fp32 order, so an expert set can differ from its only on a near-tie.

Measured (an H100, bench/fused_runs.md session 22; the H200 not yet): cold at M = 8, 30.0 µs at
16 warps with the shared gate/up against 33.2 for the three kernels on two streams as the step
issued them (36.7 at 8 warps); in the step a tie (B = 1, k = 7: 260.0-264.2 / 279.7 µs per
KDA / MLA layer against 259.9-264.3 / 279.8; B = 8: 256.2-260.3 / 287.4 against 256.1-261.0 /
286.5) with two kernels fewer per MoE layer, so the default at 2 ≤ M ≤ 8 (fused.MAX_ROWS).

Check on the GPU (against router_mma, gemv_mma, the stock ops and float64; cold-weight timing of
the three kernels as the step issued them, on two streams, and of this one):
    python -m kimi_decode.kernels.front_mma
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
from cutlass import Float32, Int32

from kimi_decode.kernels import chain
from kimi_decode.kernels import gemv_mma as gm
from kimi_decode.kernels import router_fast as rf
from kimi_decode.kernels import router_mma as rm
from kimi_decode.kernels._common import (arrive_count, compile_options, compiled, current_stream, dummy_ptr, ptr,
                                          sm_count)

# Warps per CTA of the whole grid (8 or 16). 16 is router_mma's and the shared gate/up's own
# choice; 8 is latent_down's (bit-equal to gemv_mma there) but measured slower: on an H100
# (fc0e2b9, 2026-12-06, bench/fused_runs.md session 22) 36.7 µs cold at M = 8 with the shared
# gate/up against 30.0 at 16 warps and 33.2 for the three kernels on two streams, and in the
# step 6-7 µs slower per layer than the three kernels where 16 warps tied. Read by
# route_and_project() when called, so `bench/fused_device.py --patch` can A/B it in the step.
WARPS = 16
# True: every CTA releases the next kernel (PDL) once its own mma loop is done; False: none
# does (FC1 launches once the grid has completed): ~1 µs per layer slower at 8 warps (session
# 22). Read when called, as WARPS.
RELEASE_AT_END = True
# CTAs per SM the registers must allow (ptxas's cap), per warp count. At 8 warps, uncapped, the
# top-k branch takes 127 registers (2 CTAs per SM: 264 slots for the 328 CTAs, a second wave);
# 3 (80 registers, no spills) lets every CTA be resident at once (396 slots; ~54 KB of shared
# memory each at M = 8: the top-k's staged logits and candidates); the tiles alone need 50
# (gemv_mma). At 16 warps 1 (128 registers, no spills); 2 would cap it at 64 and spill ~80
# bytes. Read when called (part of the compile key), so `--patch` can A/B it.
MIN_CTAS = {8: 3, 16: 1}
# The grid's last partial wave as K halves (opt-in A/B, not yet run on a device). At 16 warps one
# CTA per SM runs 328 tiles of 229 KB on 132 SMs: 2.48 waves, and both bundled traces' fronts
# (H200, 21.8 us for 75.2 MB; H100 alone, 30.0 us) take three full-wave times, as if the last 64
# tiles ran no faster with half the SMs idle (bench/fused_runs.md, session 38). With this on,
# route_and_project runs the last `tail` projection tiles (tail = the grid's CTAs modulo its
# resident slots, where 2·tail fits in one wave) as two CTAs each over half of K: each writes
# its fp32 tile sums to a scratch behind the counter, arrives on the tile's own counter, and
# the second to arrive adds the two halves (a + b: the same bits whichever half comes first)
# and stores bf16, then re-zeroes that counter. The sum order is no longer gemv_mma's (the two
# halves' warp sums, then their sum), so the split tiles are equal to it within fp32 rounding,
# not bit-equal. Needs a counter of split_counter_words(tail) int32 (fused.enable makes it
# when this is on). Read when called, so `--patch` A/Bs it.
TAIL_SPLIT = False
MAX_TAIL = 256     # the most split tiles a counter made by split_counter_words(MAX_TAIL) serves


def split_counter_words(tail: int) -> int:
    """int32 words of the counter buffer with `tail` split tiles: the router's counter, MAX_TAIL
    split-tile counters (a fixed place, so the words that must stay zero are always the first
    1 + MAX_TAIL), then the fp32 halves [2, tail, 128] (int32-sized)."""
    return 1 + MAX_TAIL + 2 * tail * gm.TILE * 8 if tail else 1


def half_k_words(k: int) -> int:
    """Where half 1 of a row starts in gemv_mma's int32 word view ([rows, K / 8, 4]): K / 2 bf16
    are K / 4 words (half_tile's view offset; the CPU test holds it to the columns)."""
    return k // 4


def tail_tiles(ctas: int, projection_tiles: int, slots: int) -> int:
    """How many of the grid's last projection tiles to split: the CTAs past the last full wave
    of `slots` resident CTAs, where their halves still fit in one wave; else 0."""
    rem = ctas % slots
    return rem if 0 < rem <= projection_tiles and 2 * rem <= slots else 0


@dataclass(frozen=True)
class FrontMmaConfig:
    """Compile-time sizes: hidden D, experts E, top_k, rows M (2..8), routed scaling, the
    projections' output columns (latent_down's N1; the shared gate/up's N2, 0 = none), warps per
    CTA, and whether each CTA releases the next kernel at its loop's end."""

    hidden: int
    experts: int
    top_k: int
    rows: int
    scaling: float
    n1: int
    n2: int = 0
    warps: int = WARPS
    release_end: bool = RELEASE_AT_END
    min_ctas: int = 1          # .minnctapersm (MIN_CTAS[warps] as route_and_project reads it)
    tail: int = 0              # the last projection tiles run as two K halves (TAIL_SPLIT)


def can_implement(m: int, hidden: int, experts: int, top_k: int, ns: tuple[int, ...],
                  dtypes: tuple[torch.dtype, ...], warps: int | None = None) -> bool:
    """router_mma's rules at S = 1 with `warps` warps (WARPS as it is when called), one or two
    projections of the same K, bf16."""
    warps = WARPS if warps is None else warps
    return (1 <= len(ns) <= 2 and all(n >= 1 for n in ns)
            and rm.can_implement(m, hidden, experts, top_k, dtypes, splits=1, warps=warps))


class FrontMma:
    """See the module docstring."""

    def __init__(self, cfg: FrontMmaConfig) -> None:
        self.cfg = cfg
        D, W = cfg.hidden, cfg.warps
        # router_mma's pieces at one K slice: its tile (fp32 out), slice sum and router_fast's top-k
        self.rt = rm.RouterMma(rm.RouterMmaConfig(D, cfg.experts, cfg.top_k, cfg.rows, cfg.scaling, splits=1, warps=W))
        self.down = gm.GemvMma(gm.GemvMmaConfig(cfg.n1, D, cfg.rows, W))
        self.shared = gm.GemvMma(gm.GemvMmaConfig(cfg.n2, D, cfg.rows, W)) if cfg.n2 else None
        self.t_r = self.rt.tiles
        self.t_d = self.down.ctas
        self.t_p = self.t_d + (self.shared.ctas if self.shared else 0)     # projection tiles
        # a split needs each half's K / 2 in whole chunks shared evenly by the warps
        assert cfg.tail == 0 or (cfg.tail <= min(self.t_p, MAX_TAIL) and (D // 2) % (gm.CHUNK * W) == 0), \
            (cfg.tail, self.t_p, D, W)
        self.ctas = self.t_r + self.t_p + cfg.tail                         # a split tile is 2 CTAs
        # the half-K tiles (TAIL_SPLIT): gemv_mma's tile over K / 2, on views offset by K / 2
        self.down_h = gm.GemvMma(gm.GemvMmaConfig(cfg.n1, D // 2, cfg.rows, W)) if cfg.tail else None
        self.shared_h = gm.GemvMma(gm.GemvMmaConfig(cfg.n2, D // 2, cfg.rows, W)) if cfg.tail and cfg.n2 else None

    @cute.jit
    def __call__(self, y: cute.Pointer, w_gate: cute.Pointer, bias: cute.Pointer, logits: cute.Pointer,
                 counter: cute.Pointer, ids: cute.Pointer, weights: cute.Pointer, w1: cute.Pointer,
                 o1: cute.Pointer, w2: cute.Pointer, o2: cute.Pointer, stream: cuda.CUstream):
        D, E, K, m = self.cfg.hidden, self.cfg.experts, self.cfg.top_k, self.cfg.rows
        n1, n2 = self.cfg.n1, max(self.cfg.n2, 1)

        def words(p: cute.Pointer, rows: int) -> cute.Tensor:
            # gemv_mma's [rows, K / 8, 4] int32 view (one 128-bit load per lane and chunk)
            return cute.make_tensor(cute.recast_ptr(p, dtype=Int32),
                                    cute.make_layout((rows, D // 8, 4), stride=(D // 2, 4, 1)))
        mX, mWr, mW1, mW2 = words(y, m), words(w_gate, E), words(w1, n1), words(w2, n2)
        mB = cute.make_tensor(bias, cute.make_layout(E))
        mL = cute.make_tensor(logits, cute.make_layout((1, m, E), stride=(m * E, E, 1)))
        mC = cute.make_tensor(counter, cute.make_layout(1))
        mI = cute.make_tensor(ids, cute.make_layout((m, K), stride=(K, 1)))
        mO = cute.make_tensor(weights, cute.make_layout((m, K), stride=(K, 1)))
        mO1 = cute.make_tensor(o1, cute.make_layout((m, n1), stride=(n1, 1)))
        mO2 = cute.make_tensor(o2, cute.make_layout((m, n2), stride=(n2, 1)))
        self.kernel(mX, mWr, mB, mL, mC, mI, mO, mW1, mO1, mW2, mO2).launch(
            grid=[self.ctas, 1, 1], block=[self.cfg.warps * 32, 1, 1], stream=stream, use_pdl=chain.chain_on(),
            min_blocks_per_mp=self.cfg.min_ctas, preferred_smem_carveout=-1)

    @cute.jit
    def store_tile(self, red: cute.Tensor, mO: cute.Tensor, tile: Int32, n: cutlass.Constexpr[int],
                   tidx: Int32):
        """gemv_mma's finish: thread tidx < 128 writes output (row, 16·tile + column)."""
        if tidx < gm.TILE * 8:
            c, r, tot = self.down.tile_sum(red, tidx)
            col = tile * gm.TILE + c
            if r < self.cfg.rows:
                if col < n:
                    mO[r, col] = tot.to(mO.element_type)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mWr: cute.Tensor, mB: cute.Tensor, mL: cute.Tensor, mC: cute.Tensor,
               mI: cute.Tensor, mO: cute.Tensor, mW1: cute.Tensor, mO1: cute.Tensor, mW2: cute.Tensor,
               mO2: cute.Tensor):
        E, m = self.cfg.experts, self.cfg.rows
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()                     # all 32 lanes, before any branch
        lane = cute.arch.lane_idx()
        red = self.down.smem_red()                      # (warps, 32, 4): the same for every tile kind
        flag, cK, cI, selI, selS, sL, sB = self.rt.smem_tail()     # router_mma's top-k buffers
        if bidx < self.t_r:                             # CTA-uniform: a router tile
            self.rt.mma.tile_partials(mX, mWr, red, bidx, tidx, warp, lane, release=False)
            if cutlass.const_expr(self.cfg.release_end):
                chain.release()
            if tidx < gm.TILE * 8:
                c, r, tot = self.rt.mma.tile_sum(red, tidx)
                col = bidx * gm.TILE + c
                if r < m:
                    if col < E:
                        mL[0, r, col] = tot
                cute.arch.fence_acq_rel_gpu()   # this thread's logits before the CTA's counter bump
            arrive_count(mC, flag, tidx)
            if flag[0] == self.t_r - 1:                 # CTA-uniform: the last router tile
                cute.arch.fence_acq_rel_gpu()
                self.rt.sum_slices(mL, mB, sL, sB, tidx)
                cute.arch.sync_threads()                # the logits, seen by every warp
                for row in range(warp, m, rf.WARPS):    # warp-uniform: warps 0 .. M-1
                    self.rt.sel.topk_row(sL, sB, mI, mO, cK, cI, selI, selS, row, warp, lane)
                if tidx == 0:
                    mC[0] = Int32(0)
        else:
            if cutlass.const_expr(self.cfg.tail > 0):   # TAIL_SPLIT: whole tiles, then the halves
                self.split_aware(mX, mC, flag, red, mW1, mO1, mW2, mO2, bidx - self.t_r, tidx, warp, lane)
            else:
                self.whole_tiles(mX, red, mW1, mO1, mW2, mO2, bidx - self.t_r, tidx, warp, lane)

    @cute.jit
    def whole_tiles(self, mX: cute.Tensor, red: cute.Tensor, mW1: cute.Tensor, mO1: cute.Tensor,
                    mW2: cute.Tensor, mO2: cute.Tensor, q: Int32, tidx: Int32, warp: Int32, lane: Int32):
        """Projection tile q (0-based after the router tiles): latent_down's, then the shared
        gate/up's, each gemv_mma's tile over the whole K."""
        if q < self.t_d:                                # a latent_down tile
            self.down.tile_partials(mX, mW1, red, q, tidx, warp, lane, release=False)
            if cutlass.const_expr(self.cfg.release_end):
                chain.release()
            self.store_tile(red, mO1, q, self.cfg.n1, tidx)
        else:
            if cutlass.const_expr(self.shared is not None):    # a shared gate/up tile
                self.shared.tile_partials(mX, mW2, red, q - self.t_d, tidx, warp, lane, release=False)
                if cutlass.const_expr(self.cfg.release_end):
                    chain.release()
                self.store_tile(red, mO2, q - self.t_d, self.cfg.n2, tidx)

    @cute.jit
    def split_aware(self, mX: cute.Tensor, mC: cute.Tensor, flag: cute.Tensor, red: cute.Tensor,
                    mW1: cute.Tensor, mO1: cute.Tensor, mW2: cute.Tensor, mO2: cute.Tensor, q: Int32,
                    tidx: Int32, warp: Int32, lane: Int32):
        """Projection CTA q (0-based after the router tiles) of a TAIL_SPLIT grid: the first
        t_p - tail are whole tiles as without the split (latent_down, then the shared gate/up);
        the rest are pairs of half-K CTAs, CTA 2j + h of the pairs running half h of split tile j."""
        full = self.t_p - self.cfg.tail
        if q < full:
            self.whole_tiles(mX, red, mW1, mO1, mW2, mO2, q, tidx, warp, lane)
        else:
            u = q - full
            j = u // 2
            h = u - j * 2
            p = full + j
            if p < self.t_d:
                self.half_tile(mX, mC, flag, red, mW1, mO1, False, p, j, h, self.cfg.n1, tidx, warp, lane)
            else:
                if cutlass.const_expr(self.shared_h is not None):
                    self.half_tile(mX, mC, flag, red, mW2, mO2, True, p - self.t_d, j, h, self.cfg.n2,
                                   tidx, warp, lane)

    @cute.jit
    def half_tile(self, mX: cute.Tensor, mC: cute.Tensor, flag: cute.Tensor, red: cute.Tensor,
                  mW: cute.Tensor, mO: cute.Tensor, shared: cutlass.Constexpr[bool], tile: Int32, j: Int32, h: Int32,
                  n: cutlass.Constexpr[int], tidx: Int32, warp: Int32, lane: Int32):
        """Half h of split tile j (output tile `tile` of mO): gemv_mma's tile over K / 2 on the
        views offset by h·K / 2, its 16 × 8 fp32 sums to the scratch, the tile's arrival; the
        second CTA to arrive adds both halves, stores bf16 and re-zeroes the tile's counter."""
        D, S, T = self.cfg.hidden, self.cfg.tail, gm.TILE * 8
        off = h * half_k_words(D)                       # int32 words: K / 2 bf16 of a row
        lay_x = cute.make_layout((self.cfg.rows, D // 16, 4), stride=(D // 2, 4, 1))
        lay_w = cute.make_layout((n, D // 16, 4), stride=(D // 2, 4, 1))
        mXh = cute.make_tensor(mX.iterator + off, lay_x)
        mWh = cute.make_tensor(mW.iterator + off, lay_w)
        if cutlass.const_expr(shared):                  # gemv_mma's tile over K / 2
            self.shared_h.tile_partials(mXh, mWh, red, tile, tidx, warp, lane, release=False)
        else:
            self.down_h.tile_partials(mXh, mWh, red, tile, tidx, warp, lane, release=False)
        if cutlass.const_expr(self.cfg.release_end):
            chain.release()
        mCnt = cute.make_tensor(mC.iterator + 1 + j, cute.make_layout(1))
        mS = cute.make_tensor(cute.recast_ptr(mC.iterator + 1 + MAX_TAIL, dtype=Float32),
                              cute.make_layout((2, S, T), stride=(S * T, T, 1)))
        if tidx < T:
            _, _, tot = self.down.tile_sum(red, tidx)     # (the warp count's sum, any tile kind)
            mS[h, j, tidx] = tot
            cute.arch.fence_acq_rel_gpu()       # this thread's half before the CTA's arrival
        arrive_count(mCnt, flag, tidx)
        if flag[0] == 1:                        # CTA-uniform: the second half to arrive
            cute.arch.fence_acq_rel_gpu()
            if tidx < T:
                c, r, tot = self.down.tile_sum(red, tidx)
                total = tot + mS[1 - h, j, tidx]        # a + b = b + a: the same bits either way
                col = tile * gm.TILE + c
                if r < self.cfg.rows:
                    if col < n:
                        mO[r, col] = total.to(mO.element_type)
            if tidx == 0:
                mCnt[0] = Int32(0)


@functools.lru_cache(maxsize=None)
def split_tail(cfg: FrontMmaConfig, slots: int) -> int:
    """tail_tiles of `cfg`'s grid at `slots` resident CTAs. Cached per shape: the grid's sizes
    come from building the kernel object (host arithmetic only), which an eager step would
    otherwise repeat on every call of route_and_project."""
    kern = FrontMma(cfg)
    return tail_tiles(kern.ctas, kern.t_p, slots)


def compile_for(cfg: FrontMmaConfig) -> object:
    """The compiled kernel for `cfg` (cached)."""
    def build() -> object:
        bf, f32 = dummy_ptr(torch.bfloat16), dummy_ptr(torch.float32)
        i32, i64 = dummy_ptr(torch.int32), dummy_ptr(torch.int64)
        return cute.compile(FrontMma(cfg), bf, bf, f32, f32, i32, i64, f32, bf, bf, bf, bf, current_stream(),
                            options=compile_options())
    return compiled(("front_mma", cfg), build)


def route_and_project(y: torch.Tensor, w_gate: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
                      counter: torch.Tensor, ws: list[torch.Tensor], *, warps: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """gemv_multi.route_and_project's contract for 2 ≤ M ≤ 8: (ids [M, k] int64, weights [M, k]
    fp32, [y @ w.t() for w in ws] bf16) in one launch; y [M, D] bf16, w_gate [E, D] bf16, bias
    [E] fp32, ws one or two [N, D] bf16 projections, counter a zeroed int32 [1] buffer (left
    zeroed). `warps`: per CTA, else WARPS as it is when called; RELEASE_AT_END and MIN_CTAS
    likewise."""
    warps = WARPS if warps is None else warps
    m, d = y.shape
    e = w_gate.shape[0]
    ns = tuple(w.shape[0] for w in ws)
    tensors = (y, w_gate, *ws)
    if (not can_implement(m, d, e, top_k, ns, tuple(t.dtype for t in tensors), warps)
            or any(t.shape[1] != d or not t.is_contiguous() for t in tensors)
            or bias.dtype != torch.float32 or bias.numel() != e):
        raise ValueError(f"front_mma cannot run M={m} D={d} E={e} k={top_k} projections {ns} (warps {warps})")
    cfg = FrontMmaConfig(d, e, top_k, m, float(scaling), ns[0], ns[1] if len(ns) > 1 else 0, warps, RELEASE_AT_END,
                         MIN_CTAS[warps])
    if TAIL_SPLIT and y.is_cuda and (d // 2) % (gm.CHUNK * warps) == 0:
        tail = split_tail(cfg, sm_count(y.device) * MIN_CTAS[warps])
        if counter.numel() < split_counter_words(tail):
            raise ValueError(f"front_mma: TAIL_SPLIT needs a counter of {split_counter_words(tail)} int32 words "
                             f"(split_counter_words), got {counter.numel()}")
        cfg = dataclasses.replace(cfg, tail=tail)
    dev = y.device
    outs = [torch.empty(m, n, dtype=torch.bfloat16, device=dev) for n in ns]
    logits = torch.empty(m, e, dtype=torch.float32, device=dev)
    ids = torch.empty(m, top_k, dtype=torch.int64, device=dev)
    weights = torch.empty(m, top_k, dtype=torch.float32, device=dev)
    w2, o2 = (ws[1], outs[1]) if len(ws) > 1 else (ws[0], outs[0])     # unused without a second projection
    compile_for(cfg)(ptr(y), ptr(w_gate), ptr(bias), ptr(logits), ptr(counter), ptr(ids), ptr(weights),
                     ptr(ws[0]), ptr(outs[0]), ptr(w2), ptr(o2), current_stream())
    return ids, weights, outs


def check(timing: bool = True, rows: tuple[int, ...] = (2, 4, 8)) -> list[dict]:
    """On K3 TP16's router, latent_down [3584, 7168] and shared gate/up [768, 7168], per M and
    with / without the shared gate/up: ids and weights against router_mma (the step's router
    before this kernel) and the float64 reference (every row but a near-tie has the same expert
    set, weights within 1e-3), router_fast.selection_facts (repeat bit-equal, dtypes, descending
    keys), the counter zero; latent_down bit-equal to gemv_mma where the warp counts agree (8),
    the shared gate/up within 1e-2 of gemv_mma; each projection within 1e-2 of the stock GEMM
    and no further from float64 than 1.5x stock's error. With timing (cold weights, the calls
    cycling through copies ≥ 160 MB; CUDA-graph replays): three_us (router_mma on the main
    stream, latent_down then the shared gate/up on a side stream, joined: the step before this
    kernel), two_us (the same without the shared gate/up), kernel_us (this kernel, with the
    shared gate/up), kernel_two_us (without), kernel_w{8|16}_us (the other warp count, with).
    Bit-equality with gemv_mma is asserted for the projection whose gemv_mma warp count is the
    kernel's (latent_down at 8 warps, the shared gate/up at 16)."""
    import itertools

    from kimi_decode import stock_ops
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels import checks
    from kimi_decode.kernels.router import reference
    cfg = k3_tp16()
    dev = torch.device(checks.DEVICE)
    ops = stock_ops.OpSet(cfg)
    w_gate, bias = checks.router_weights(cfg, dev, "check.front_mma")
    # with TAIL_SPLIT (an A/B) the counter also holds the split tiles' counters and halves
    counter = torch.zeros(split_counter_words(MAX_TAIL) if TAIL_SPLIT else 1, dtype=torch.int32, device=dev)
    counters = counter[:1 + MAX_TAIL] if TAIL_SPLIT else counter      # the words left zeroed
    counter_rm = torch.zeros(1, dtype=torch.int32, device=dev)
    K, sc, E, D = cfg.top_k, cfg.routed_scaling, cfg.num_experts, cfg.hidden
    n1, n2 = cfg.latent_dim, 2 * cfg.shared_local_inter
    out = []
    for m in rows:
        gen = torch.Generator(device=dev).manual_seed(4100 + m)

        def proj() -> tuple[torch.Tensor, torch.Tensor]:
            return ((torch.randn(n1, D, generator=gen, device=dev) * D ** -0.5).bfloat16(),
                    (torch.randn(n2, D, generator=gen, device=dev) * D ** -0.5).bfloat16())
        down, gate_up = proj()
        y = torch.nn.functional.rms_norm(torch.randn(m, D, generator=gen, device=dev), (D,)).bfloat16()
        for shared in (True, False):
            ws = [down, gate_up] if shared else [down]
            with torch.no_grad():
                ids_k, w_k, o_k = route_and_project(y, w_gate, bias, K, sc, counter, ws)
                ids_k2, w_k2, o_k2 = route_and_project(y, w_gate, bias, K, sc, counter, ws)
                ids_m, w_m = rm.route(y, w_gate, bias, K, sc, counter_rm)
                g = [gm.gemv_mma(y, w) for w in ws]
                s = [ops.linear(y, w) for w in ws]
            checks._sync()
            ids_r, w_r, key_r = reference(y.cpu(), w_gate.cpu(), bias.cpu(), K, sc)
            agree, werr = rf.agreement(ids_k, w_k, ids_m, w_m)
            agree_r, werr_r = rf.agreement(ids_k, w_k, ids_r, w_r)
            f = [y.double() @ w.double().t() for w in ws]
            r = {"kernel": "front_mma", "M": m, "shared": shared, "warps": WARPS,
                 "rows_same_as_router_mma": agree, "max_weight_err_vs_router_mma": werr,
                 "rows_same_experts_f64": agree_r, "max_weight_err_f64": werr_r,
                 **rf.selection_facts(ids_k, w_k, ids_k2, w_k2, key_r, K),
                 "down_equal_gemv_mma": bool(torch.equal(o_k[0], g[0])),
                 "shared_equal_gemv_mma": bool(shared and torch.equal(o_k[1], g[1])),
                 "rel_vs_gemv_mma": max(checks.rel(a, b) for a, b in zip(o_k, g)),
                 "rel_vs_stock": max(checks.rel(a, b) for a, b in zip(o_k, s)),
                 "rel_vs_f64": max(checks.rel(a, b) for a, b in zip(o_k, f)),
                 "stock_rel_vs_f64": max(checks.rel(a, b) for a, b in zip(s, f)),
                 "repeat_outputs_equal": all(torch.equal(a, b) for a, b in zip(o_k, o_k2)),
                 "counter_zero": not bool(counters.any()), "tail_split": TAIL_SPLIT}
            floor = 1.0 - r["near_ties_f64"] / m - 1e-9       # every row but a near-tie agrees
            equal_ok = ((r["down_equal_gemv_mma"] or gm.warps_for(n1, D) != WARPS)
                        and (not shared or r["shared_equal_gemv_mma"] or gm.warps_for(n2, D) != WARPS))
            if TAIL_SPLIT:      # the split tiles sum their halves in another order: fp32 rounding only
                equal_ok = r["rel_vs_gemv_mma"] <= 1e-4
            r["ok"] = bool(agree_r >= floor and werr_r <= 1e-3 and agree >= floor and werr <= 1e-3
                           and r["repeat_equal"] and r["dropin_types"] and r["descending"] and r["counter_zero"]
                           and equal_ok and r["rel_vs_gemv_mma"] <= 1e-2
                           and r["rel_vs_stock"] <= 1e-2 and r["repeat_outputs_equal"]
                           and r["rel_vs_f64"] <= 1.5 * r["stock_rel_vs_f64"] + 1e-3)
            out.append(r)
        if timing:
            row = out[-2]                                  # the shared row of this M
            per = (E + n1 + n2) * D * 2
            copies = max(2, -(-(160 << 20) // per))
            sets = [(w_gate, down, gate_up)] + [
                ((torch.randn(E, D, device=dev) * D ** -0.5).bfloat16(), *proj()) for _ in range(copies - 1)]
            side = torch.cuda.Stream()

            def separate(with_shared: bool) -> None:
                wg, dn, gu = next(cyc)
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                rm.route(y, wg, bias, K, sc, counter_rm)
                with torch.cuda.stream(side):
                    gm.gemv_mma(y, dn)
                    if with_shared:
                        gm.gemv_mma(y, gu)
                main.wait_stream(side)
            cyc = itertools.cycle(sets)
            row["three_us"] = checks.time_us(lambda: separate(True))
            cyc = itertools.cycle(sets)
            row["two_us"] = checks.time_us(lambda: separate(False))
            def kernel(with_shared: bool = True, warps: int | None = None) -> None:
                wg, dn, gu = next(cyc)
                route_and_project(y, wg, bias, K, sc, counter, [dn, gu] if with_shared else [dn], warps=warps)
            cyc = itertools.cycle(sets)
            row["kernel_us"] = checks.time_us(kernel)
            cyc = itertools.cycle(sets)
            row["kernel_two_us"] = checks.time_us(lambda: kernel(False))
            other = 8 if WARPS == 16 else 16
            cyc = itertools.cycle(sets)
            row[f"kernel_w{other}_us"] = checks.time_us(lambda: kernel(True, other))
            row["kernel_tbs"] = per / (row["kernel_us"] * 1e-6) / 1e12
            row["counter_zero_after_replays"] = not bool(counters.any())
            row["ok"] = row["ok"] and row["counter_zero_after_replays"]
            del sets
    return out


if __name__ == "__main__":
    for row in check():
        print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
