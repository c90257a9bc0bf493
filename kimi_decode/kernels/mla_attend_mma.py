"""Absorbed MLA decode attention on the tensor cores, in one launch (kernel "mla_attend_mma"):
the stock op `mla_decode` (stock_ops.mla_attend: bmm, mask, softmax, cast, bmm; 3-4 kernels
under torch.compile / cuBLAS) and kernels/mla_attend.py.

Why: mla_attend.py does the same math on the CUDA cores and runs only at B = 1, k = 0 (at 48
rows its FMA work and its one-CTA merges of 98 KB partials took 43-330 µs against 15-30 µs for
stock's chain). In the ccfc99b traces stock's chain is 4 kernels and ~17 µs for 4.8 MB of
cache at B = 1, k = 7 (R = T·H = 48 rows per sequence), 3 kernels and ~24 µs for 38 MB at
B = 8. Here every product is an mma.sync.m16n8k16 (bf16 in, fp32 accumulation). Where it is
faster (measured below): R ≤ 6 rows per sequence (B = 1, 8, 64 at k = 0), and R = 48 at B = 1
(k = 7) in row groups; fused.py uses it there only.

Math (as mla_attend.py; per sequence b, query row r = t·H + h, cache row j of D = c + rope
bf16 values, scale = (nope + rope)^-½):
    s[r, j]  = bf16( Σ_d q[b, r, d] · cache[b, j, d] ) · scale      fp32 accumulation, rounded
                                                                     to bf16 as stock's bmm
    valid    = j ≤ last[t]
    p̃[r, j]  = bf16( exp(s − m) )        m: the running maximum (online softmax, per split)
    o[b, r]  = bf16( Σ_j p̃ · cache[b, j, :c] / Σ_j p̃ )              fp32 sums
Rounding difference to stock: stock rounds the normalised p to bf16 before its second bmm;
here the unnormalised p̃ is rounded (the mma takes bf16), and the denominator sums the same
rounded values, so numerator and denominator agree; relative error per probability ~2⁻⁹ as
stock's. Scores are rounded at stock's point, so masks and maxima agree.

Layout. Grid (splits, B·G), 256 threads (8 warps), one CTA per SM (every CTA must be resident:
grid merge below). G = row_groups(R, B) row groups (1 at R ≤ 16; 3 of 16 rows at R = 48 where
each group keeps ≥ GROUP_MIN_SPLITS splits: B = 1, k = 7, not B = 8): CTA
(s, b·G + i) takes rows i·R/G .. (i + 1)·R/G − 1 of sequence b, and each (sequence, group) pair
is below what a sequence is without groups (its own splits, partials, barrier and merge; its
rows' mask taken at their global row, token (i·R/G + r) / H; R below: a group's rows). The
valid tiles of TILE = 32 positions (up to min(C, max_t last[t] + 1), read on the device) are
shared out evenly, split s taking tiles ⌊s·n/S⌋ .. ⌊(s+1)·n/S⌋ − 1; nothing past them is read
(a tail tile's rows clamp to the last valid row and are masked).
Rows are padded to RP = 16·MT (MT = ⌈R / 16⌉ m-tiles; padded rows are zero and never written).
Per tile:
  1. scores: warp w = (n-tile nq = w % 4: positions 8nq .. 8nq + 7, k-half kh = w / 4: dims
     kh·D/2 .. +D/2). Lane (g = lane / 4, t = lane % 4) loads its B fragments straight from
     HBM: cache row (8nq + g), 128 bits at dim kh·D/2 + 32c + 8t for the D/64 chunks c (9 at
     D = 576), issued NBUF tiles ahead (registers: 2 at one m-tile, else 1). The k order inside a chunk is permuted as in
     gemv_mma.py (logical k 2t + j of mma step u is physical 32c + 8t + 4u + j), so A (q, from
     shared memory, rows padded by 32 bf16 against bank conflicts) and B each come from one
     128-bit load. Two mma per chunk and m-tile (two independent accumulator chains at one
     m-tile); the two k-halves' fp32 partials meet in shared memory (sS).
  2. V staging: the same registers hold the tile's value columns (dims < c). The P·V mma needs
     B = V[k = position][n = column] as packed pairs of two positions of one column, the
     transpose of the cache layout: lanes g and g ^ 1 (positions 2i, 2i + 1) swap half their
     words (2 shuffles per chunk) and build 4 pair words each with prmt, stored 128 bits at
     once into sV[pair][column] (32 KB per tile).
  3. online softmax (fp32): TPR threads per row (4 at R = 48, 16 at R = 6), PPT = 32 / TPR
     positions each, maxima and sums over log2(TPR) shuffles (a whole warp per row, 6 rows in
     a row, cost ~1 µs per tile in the first build); the bf16 p̃ and the rescale factor α go to
     shared memory; l sums the rounded p̃.
  4. P·V: warp w owns value columns 64w .. 64w + 63 for all rows: A = p̃ (32-bit shared loads
     in the natural order: positions 16u + 2t, +1 and 16u + 2t + 8, +9), B = two 128-bit loads
     of sV per k step and 4 n-tiles: n-tile jj of column group J holds column 32J + 4g + jj,
     so a lane's accumulators are 8 consecutive columns 32J + 8t .. +7 of rows g and g + 8.
  The split's partial (m, l per row; o unnormalised fp32 [R, c]) goes to the scratch buffer.
Merge (grid merge, in the same launch): every CTA arrives on its sequence's barrier
(_common.grid_arrive_and_wait, sense reversal), then CTA s merges items s, s + splits, ...:
item = (row r, block of QB = c / 4 / KQ column quads). Thread = (quad q = tid % QB, split group
sg = tid / QB); it issues all its o-quad loads at once (the partials s ≡ sg mod SG, NL ≤
MAX_NL per thread) while thread i < splits loads split i's (m, l); the CTA reduces M = max m
and L = Σ l·e^{m−M} and leaves w_i = e^{m_i−M} in shared memory; each thread weights its
quads, and the SG groups' sums are added in group order and written as bf16(O / L). One
round trip of loads per item. The partials reach the merging CTAs through the barrier (a CTA
barrier, then thread 0's fence.acq_rel.gpu and arrival: CUTLASS's semaphore pattern).

Deadlock freedom of the barrier: B·splits ≤ SMs and one CTA per SM (registers), and a CTA
waits only after writing its partial; CTAs of the next kernel (PDL) become resident only once
every CTA of this one has passed its griddepcontrol.wait, i.e. is resident.

uv mode (MMAConfig.uv_rows = M = B·T > 0; `mla_attend_mma_uv`): the launch also does
kernels/mla_glue.py's uv_gate on the o_lat it writes, exactly as mla_attend.py's uv mode and
with its code (mla_attend.UVTiles: publish, uv_tile; mla_glue's load_w / gemm_tile / gated): the first
NW = H·vd/16 CTAs issue their W_UV tile's loads and gate value before the barrier, every CTA
publishes its merged share of o_lat on a ready counter, and the workers wait for all B·splits
shares, then run the tile. So o equals uv_gate(o_lat) bit for bit.

Measured (H200, CUDA-graph replays, 2026-12-03, bench/fused_correctness.md; warm unless
said): B = 1, k = 0 7.6-8.0 µs vs 11.2 for mla_attend and 13.3-13.5 for stock's compiled op;
uv mode 12.1 µs cold vs 15.3 for mla_attend_uv (stock 19.7), at B = 8 28.0 vs 33.1 stock;
B = 8 20.2-20.4 vs 20.1-20.4 (a tie); B = 64 116-117 vs 145-146. At R = 48 (B = 1, k = 7) it
lost ungrouped: 17.9 µs at 132 splits, 16.7 at 72, vs 14.4 for stock. ncu there (one CTA per
SM, 8 warps): 0.19 instructions issued per scheduler per cycle, stalls spread over barriers,
the load queue and fixed-latency dependencies; the fp32 partials are 96 KB per CTA (13 MB each
way through the L2 at 132 splits). In row groups (row_groups; H100, 2026-12-06, session 23 of
bench/fused_runs.md) it wins there: 14.8 µs vs 19.6 ungrouped and 15.3 for stock, 20.4 cold in
uv mode vs 24.8 for stock + uv_gate, and the k = 7 MLA layer 1 µs faster in 4 kernels fewer. At
B = 8, k = 7 it still loses (41.4 vs 35.4). So fused.py uses it at R ≤ 6 rows per sequence
and at R = 48 with one sequence.

Check on the GPU (against stock_ops.mla_attend, eager and torch.compile'd, and the float64
reference; both modes; times all): python -m kimi_decode.kernels.mla_attend_mma
Where a call's time goes, phase by phase and CTA by CTA (the probe build, PROBE_PHASES):
python -m bench.mla_mma_phases --out DIR
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

import math
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T as IR

from kimi_decode.kernels import chain
from kimi_decode.kernels._common import (H200_SMS, compile_options, compiled, current_stream, dummy_ptr,
                                         grid_arrive_and_wait, ptr, sm_count)
from kimi_decode.kernels.gemv_mma import MMA_PTX
from kimi_decode.kernels.mla_attend import (AttendShape, MLAAttend, UVTiles, attend_shapes, uv_launch_ok,
                                            uv_shapes_ok, uv_workers)

TILE = 32          # cache positions per tile (one per lane in the softmax)
THREADS = 256
WARPS = THREADS // 32
NQ = TILE // 8     # score n-tiles (8 positions each) = warps per k-half
KH = WARPS // NQ   # k-halves of the score reduction
QPAD = 32          # bf16 of padding per q row in shared memory (bank-conflict-free A loads)
SROW = TILE + 8    # fp32 per score row in shared memory
PROW = TILE + 8    # bf16 per p̃ row in shared memory (20 words: conflict-free A loads)
VPAD = 8           # words of padding per sV pair row (the 4 t-lanes of a load phase hit 4 bank groups)
MAX_ROWS = 48      # R = T·H (3 m-tiles; P·V accumulators 3·8·4 = 96 registers)
GROUP_ROWS = 16    # rows per CTA at most when the rows are split into groups (row_groups); 0: never
GROUP_MIN_SPLITS = 16   # ... and only where every (sequence, group) pair keeps this many splits
MAX_NL = 20        # merge: partials one thread loads at once (6 registers each)
NEG = -1.0e30      # "minus infinity" that keeps exp(NEG - NEG) finite
VALID = -1.0e29    # a score (or partial maximum) above this is real
SEL_LO = 0x5410    # prmt: (a.lo, b.lo) -> one word
SEL_HI = 0x7632    # prmt: (a.hi, b.hi) -> one word
# PDL chain: the query positions and the first NBUF tiles' cache words loaded BEFORE
# griddepcontrol.wait (off: after it, as before). Why: only uk_insert, the kernel before this
# one, writes the cache, and only the rows of this step's tokens (last[0] .. last[T-1]);
# every other row is state of earlier steps, and `last` is written at the end of the previous
# step (FusedDecoder.forward), so both are pre-wait reads under kernels/chain.py's protocol.
# After the wait a lane re-loads its row only where that row is one of this step's (row ≥
# min_t last[t]: at most T rows per sequence, in the last split's tile, already in the L2).
# In the B = 1, k = 0 step the CTAs are resident ~1 µs before uk_insert ends (the H200 trace
# at 421b9f0), and after the wait the kernel had two dependent round trips before its first
# barrier (last, then the cache tile from HBM); with the switch, one (q and the new rows, from
# the L2). ncu (H100, a0aba42, cold): ~13 % of the uv build's stall samples before the first
# barrier. Part of the compile key (compile_for); only where the chain is on. On since
# session 26: H200 (a8626de, 20:50-20:53 UTC, fused_ab, base / prewait twice each) MLA layer
# 93.8 / 93.6 -> 93.0 / 93.0 µs at B = 1, k = 0; 212.2 / 212.2 -> 210.2 / 210.3 at k = 7;
# 219.9 / 220.2 -> 217.0 / 217.1 at B = 8; KDA layers unchanged. check_pre_wait's race oracle
# passed at B = 1, k = 0 (plain and uv, control non-finite); at B = 1, k = 7 and B = 8 its
# pre_wait_positions placement has not yet run on a device; step parity and pdl_chain passed
# with the switch at all three (bench/fused_runs.md, session 26).
PRE_WAIT_TILES = True
# The re-load above (True). False only for check_pre_wait's negative control: the build that
# reads this step's rows before the wait alone, which a late writer must catch.
RELOAD_NEW = True
# Phase probe (MMAConfig.probe; bench/mla_mma_phases.py): thread 0 of every CTA stamps
# %globaltimer at these points and writes them to probe[lin, :] at its end (lin = v·splits + s;
# 0 = not reached). Each stamp stands right after a CTA barrier (the build's own, or one the
# probe adds), so it marks the whole CTA's progress, not thread 0's; "waited" is thread 0's
# return from griddepcontrol.wait. "tile1": the CTA's first tile done (its cache words' HBM
# latency included); "scores" / "softmax" / "pv": the barriers after steps 1-2, 3 and 4 of the
# CTA's last tile; "barrier": the (sequence, row group) barrier passed; "merged": its share of
# the merge done; "published": its share of o_lat published (uv mode); "end": the uv tile done
# (uv mode) or the merge. Why: at R = 48 (B = 1, k = 7) the kernel ends ~17 µs after mla_glue
# in the step for ~1.2 µs of cache bytes, and ncu's totals do not say which phase holds it.
PROBE_PHASES = ("entry", "waited", "q_staged", "tile1", "scores", "softmax", "pv", "partial_written",
                "barrier", "merged", "published", "end")


@dataclass(frozen=True)
class MMAConfig(AttendShape):
    """Compile-time sizes: local heads H, tokens per sequence T, latent rank c, rope dims, the
    score scale; the merge's quad blocks per row KQ and loads per thread NL (plan())."""

    heads: int
    tokens: int
    kv_rank: int = 512
    rope: int = 64
    scale: float = 192 ** -0.5
    kq: int = 4
    nl: int = 16
    uv_rows: int = 0          # uv mode (mla_attend_mma_uv): M = B·T rows of o; 0 = o_lat only
    v_dim: int = 128          # uv mode: W_UV's columns per head
    groups: int = 1           # row groups G (row_groups): CTA (s, b·G + i) takes rows i·R/G .. + R/G
    probe: bool = False       # phase probe (PROBE_PHASES): %globaltimer stamps per CTA


def can_implement(heads: int, tokens: int, kv_rank: int, rope: int, dtypes: tuple[torch.dtype, ...]) -> bool:
    """c = 64 columns per warp (P·V: 2 groups of 32), D = c + rope a multiple of 64 (two
    k-halves of whole 32-dim chunks), R = T·H ≤ MAX_ROWS, bf16 operands."""
    d = kv_rank + rope
    return (kv_rank == 64 * WARPS and d % 64 == 0 and 1 <= heads * tokens <= MAX_ROWS
            and all(dt == torch.bfloat16 for dt in dtypes))


def row_groups(rows: int, batch: int = 1, sms: int = H200_SMS) -> int:
    """G, the row groups a sequence's R = T·H query rows are split into, each its own set of
    splits (its own CTAs, partials and merge): the fewest groups of at most GROUP_ROWS rows
    that divide R evenly, where the B·G pairs still get GROUP_MIN_SPLITS splits each out of
    the SMs; else 1 (also where R ≤ GROUP_ROWS or GROUP_ROWS is 0).

    Why: every CTA of a split computes the scores and P·V of all its rows, so at R = 48 (three
    m-tiles) one 32-position tile is ~816 mma and ~3 µs at one CTA per SM, and each CTA writes
    96 KB of fp32 partials (13 MB each way through the L2 at 132 splits; session 10 in
    bench/fused_runs.md). In groups of 16 rows each CTA does a third of the work per tile over
    three times the tiles (the cache it re-reads is one L2-resident 4.8 MB), its partial is a
    third, and its q staging is a third; the splits per group are a third (B·G·splits ≤ SMs).
    Measured on an H100 (2026-12-06, bench/fused_runs.md session 23, CUDA-graph replays): B = 1,
    k = 7 (44 splits per group) 14.8 µs against 19.6 ungrouped (132 splits) and 15.3 for
    stock's compiled chain; B = 8, k = 7 (5 splits per group, 29 tiles each) 52.4 against 41.4
    ungrouped (16 splits): too few splits leave the cache's latency unhidden, hence
    GROUP_MIN_SPLITS (between 5 and 44 untested)."""
    if GROUP_ROWS <= 0 or rows <= GROUP_ROWS:
        return 1
    g = (rows + GROUP_ROWS - 1) // GROUP_ROWS
    while rows % g:
        g += 1
    return g if sms // (batch * g) >= GROUP_MIN_SPLITS else 1


def _groups(rows: int, batch: int, sms: int, groups: int | None) -> int | None:
    """`groups`, or row_groups' choice where None; None where it does not divide the rows
    (fits() then refuses, make_scratch() raises)."""
    g = row_groups(rows, batch, sms) if groups is None else groups
    return g if g >= 1 and rows % g == 0 else None


def plan(batch: int, rows: int, cache_len: int, kv_rank: int, sms: int = H200_SMS,
         tiles_per_split: int | None = None, groups: int = 1) -> tuple[int, int, int, int]:
    """(splits, tiles_per_split, kq, nl): one CTA per SM in all (B·splits ≤ sms: the grid
    merge needs every CTA resident), at most one split per cache tile; or, to tune, the
    splits that give `tiles_per_split` tiles of the capacity C each. The kernel shares the
    valid tiles (up to max last + 1, known only on the device) evenly over the splits, so
    tiles_per_split here is the capacity's figure, the most a split can get. Then the merge's
    quad blocks per row KQ (doubled while the R·KQ items of a sequence are fewer than its
    splits, or a thread would load more than MAX_NL partials; blocks of at least 32 quads)
    and its loads per thread NL = ⌈splits / SG⌉, SG = THREADS / (c / 4 / KQ) split groups.
    With `groups` G (row_groups), each of the B·G (sequence, row group) pairs has its own
    splits: the figures are per pair, for its R / G rows."""
    n_tiles = (cache_len + TILE - 1) // TILE
    rows = rows // groups
    batch = batch * groups
    if tiles_per_split is None:
        splits = max(1, min(n_tiles, sms // batch))
    else:
        splits = (n_tiles + max(1, tiles_per_split) - 1) // max(1, tiles_per_split)
    tps = (n_tiles + splits - 1) // splits
    quads = kv_rank // 4
    kq = 1
    while kq < quads // 32 and (rows * kq < splits or math.ceil(splits / (THREADS * kq // quads)) > MAX_NL):
        kq *= 2
    sg = THREADS * kq // quads
    nl = math.ceil(splits / sg)
    return splits, tps, kq, nl


def fits(batch: int, rows: int, cache_len: int, kv_rank: int, sms: int = H200_SMS,
         tiles_per_split: int | None = None, groups: int | None = None) -> bool:
    """Whether plan() gives a launch the kernel can run: every CTA resident (B·G·splits ≤
    SMs), one split per thread in the merge's weights (splits ≤ THREADS), NL ≤ MAX_NL; G
    row_groups' unless given (it must divide R)."""
    g = _groups(rows, batch, sms, groups)
    if g is None:
        return False
    splits, _, _, nl = plan(batch, rows, cache_len, kv_rank, sms, tiles_per_split, g)
    return batch * g * splits <= sms and splits <= THREADS and nl <= MAX_NL


@dataclass
class MMAScratch:
    """Persistent partials and barrier words for one (B, R, C, c); the caller keeps it. With
    row groups (G > 1) every (sequence, row group) pair is a sequence of R / G rows here."""

    batch: int
    rows: int
    cache_len: int
    kv_rank: int
    splits: int
    tiles_per_split: int
    kq: int
    nl: int
    part_o: torch.Tensor      # [B·G·S, R/G, c] fp32 (unnormalised o of each split)
    part_ml: torch.Tensor     # [B·G·S, 2, R/G] fp32 (m, l)
    counters: torch.Tensor    # [2·B·G + 2] int32: arrival counter per (sequence, group), then its epoch
                              # (_common.grid_arrive_and_wait: the counters are zero between
                              # calls, the epochs only grow); the last two: the uv mode's
                              # ready and pass counters (zero between calls)
    groups: int = 1           # G (row_groups)

    @property
    def units(self) -> int:
        """B·G: the (sequence, row group) pairs, each with its own splits and barrier."""
        return self.batch * self.groups


def make_scratch(batch: int, rows: int, cache_len: int, kv_rank: int, device: torch.device | str,
                 sms: int | None = None, tiles_per_split: int | None = None,
                 groups: int | None = None) -> MMAScratch:
    """Buffers for plan()'s launch; `groups` None: row_groups (the default build)."""
    if sms is None:
        sms = sm_count(device)
    g = _groups(rows, batch, sms, groups)
    if g is None:
        raise ValueError(f"mla_attend_mma: {groups} row groups do not divide {rows} rows")
    splits, tps, kq, nl = plan(batch, rows, cache_len, kv_rank, sms, tiles_per_split, g)
    f32 = dict(dtype=torch.float32, device=device)
    rg = rows // g
    return MMAScratch(batch, rows, cache_len, kv_rank, splits, tps, kq, nl,
                      part_o=torch.empty(batch * g * splits, rg, kv_rank, **f32),
                      part_ml=torch.empty(batch * g * splits, 2, rg, **f32),
                      counters=torch.zeros(2 * batch * g + 2, dtype=torch.int32, device=device), groups=g)


@cute.jit
def prmt(a: Int32, b: Int32, sel: cutlass.Constexpr[int]) -> Int32:
    """prmt.b32 with selector `sel` (SEL_LO: (a.lo, b.lo); SEL_HI: (a.hi, b.hi))."""
    return Int32(llvm.inline_asm(IR.i32(), [Int32(a).ir_value(), Int32(b).ir_value()],
                                 f"prmt.b32 $0, $1, $2, {sel};", "=r,r,r",
                                 has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def mma_at(acc: cute.Tensor, i: cutlass.Constexpr[int], j: cutlass.Constexpr[int], a0: Int32, a1: Int32,
           a2: Int32, a3: Int32, b0: Int32, b1: Int32):
    """acc[i, j, 0:4] += A·B for one m16n8k16 bf16 mma (fragments as packed bf16x2 words)."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([IR.f32(), IR.f32(), IR.f32(), IR.f32()]),
        [Int32(a0).ir_value(), Int32(a1).ir_value(), Int32(a2).ir_value(), Int32(a3).ir_value(),
         Int32(b0).ir_value(), Int32(b1).ir_value(),
         Float32(acc[i, j, 0]).ir_value(), Float32(acc[i, j, 1]).ir_value(), Float32(acc[i, j, 2]).ir_value(),
         Float32(acc[i, j, 3]).ir_value()],
        MMA_PTX, "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    for k in cutlass.range_constexpr(4):
        acc[i, j, k] = Float32(llvm.extractvalue(IR.f32(), res, [k]))


class MLAAttendMMA(UVTiles):
    """See the module docstring."""

    def __init__(self, cfg: MMAConfig) -> None:
        assert can_implement(cfg.heads, cfg.tokens, cfg.kv_rank, cfg.rope, (torch.bfloat16,)), cfg
        assert cfg.groups >= 1 and cfg.rows % cfg.groups == 0, cfg
        self.cfg = cfg
        self.G = cfg.groups                        # row groups: R below is one group's rows
        self.H, self.T, self.RF, self.R = cfg.heads, cfg.tokens, cfg.rows, cfg.rows // cfg.groups
        self.C, self.D = cfg.kv_rank, cfg.dim
        self.MT = (self.R + 15) // 16
        self.RP = 16 * self.MT
        self.RW = self.RP // WARPS                 # softmax rows per warp
        self.KC = self.D // 2 // 32                # 32-dim chunks per k-half
        self.JW = self.C // 32 // WARPS            # P·V column groups (32 columns) per warp
        self.DS = self.D + QPAD                    # bf16 per q row in shared memory
        self.Q4 = self.C // 4                      # column quads per row
        self.NBUF = 2 if self.MT == 1 else 1       # tiles of cache words in flight (registers)
        self.NCH = 2 if self.MT == 1 else 1        # independent score accumulator chains per m-tile
        tpr = 1                                    # softmax: threads per row (a power of 2, ≤ 32)
        while tpr < 32 and self.RP * tpr * 2 <= THREADS:
            tpr *= 2
        self.TPR, self.TPR_LOG, self.PPT = tpr, tpr.bit_length() - 1, TILE // tpr
        self.ACT = self.RP * tpr                   # softmax threads (a multiple of 32)
        self.QB = self.Q4 // cfg.kq                # merge: quads per item
        self.SG = THREADS // self.QB               # merge: split groups
        assert self.QB * self.SG == THREADS and self.QB >= 32, cfg
        if cfg.uv:     # mla_glue's uv_gate tiles, run by the first NW CTAs (module docstring)
            self.init_uv(cfg.uv_rows, self.H, self.C, cfg.v_dim)

    @cute.jit
    def __call__(self, q: cute.Pointer, cache: cute.Pointer, last: cute.Pointer, out: cute.Pointer,
                 part_o: cute.Pointer, part_ml: cute.Pointer, counters: cute.Pointer, w_uv: cute.Pointer,
                 g: cute.Pointer, o_uv: cute.Pointer, probe: cute.Pointer, batch: Int32, cache_len: Int32,
                 splits: Int32, stream: cuda.CUstream):
        """uv mode: w_uv [H, c, vd], g [M, H·vd], o_uv [M, H·vd] (bf16); otherwise unused.
        probe mode: probe [B·G·splits, len(PROBE_PHASES)] int64; otherwise unused."""
        R, RF, D, C, G = self.R, self.RF, self.D, self.C, self.G
        mQ = cute.make_tensor(q, cute.make_layout((batch, RF, D // 8, 8), stride=(RF * D, D, 8, 1)))
        mK = cute.make_tensor(cute.recast_ptr(cache, dtype=Int32),
                              cute.make_layout((batch * cache_len, D // 8, 4), stride=(D // 2, 4, 1)))
        mL = cute.make_tensor(last, cute.make_layout(self.T))
        mO = cute.make_tensor(out, cute.make_layout((batch, RF, C // 4, 4), stride=(RF * C, C, 4, 1)))
        mPo = cute.make_tensor(part_o, cute.make_layout((batch * G * splits, R, C // 4, 4),
                                                        stride=(R * C, C, 4, 1)))
        mPml = cute.make_tensor(part_ml, cute.make_layout((batch * G * splits, 2, R), stride=(2 * R, R, 1)))
        mCnt = cute.make_tensor(counters, cute.make_layout(2 * batch * G + 2))
        mT = cute.make_tensor(probe, cute.make_layout((batch * G * splits, len(PROBE_PHASES)),
                                                      stride=(len(PROBE_PHASES), 1)))
        if cutlass.const_expr(self.cfg.uv):
            mX, mW, mG, mU = self.uv_views(out, w_uv, g, o_uv)
        else:
            mX, mW, mG, mU = mO, mO, mO, mO
        self.kernel(mQ, mK, mL, mO, mPo, mPml, mCnt, mX, mW, mG, mU, mT, batch, cache_len, splits).launch(
            grid=[splits, batch * G, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=chain.chain_on())

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mL: cute.Tensor, mO: cute.Tensor, mPo: cute.Tensor,
               mPml: cute.Tensor, mCnt: cute.Tensor, mX: cute.Tensor, mW: cute.Tensor, mG: cute.Tensor,
               mU: cute.Tensor, mT: cute.Tensor, batch: Int32, cache_len: Int32, splits: Int32):
        R, C, RP, MT, KC, JW, DS = self.R, self.C, self.RP, self.MT, self.KC, self.JW, self.DS
        tid, _, _ = cute.arch.thread_idx()
        stamps = cute.make_rmem_tensor(cute.make_layout(len(PROBE_PHASES)), cutlass.Int64)
        if cutlass.const_expr(self.cfg.probe):
            stamps.fill(0)
            stamps[0] = cute.arch.globaltimer()
        s, v, _ = cute.arch.block_idx()      # v = b·G + i: sequence b, row group i (rows roff ..)
        b = v // self.G
        roff = (v - b * self.G) * R
        nv = batch * self.G                   # (sequence, row group) pairs: barriers, uv counters
        warp = cute.arch.warp_idx()          # full-warp shuffle: here, before every branch
        lane = cute.arch.lane_idx()
        g = lane // 4
        t = lane - g * 4
        nq = warp % NQ                        # score n-tile of this warp
        kh = warp // NQ                       # and its k-half

        smem = cutlass.memory.SmemAllocator()
        sQ = smem.allocate_tensor(BFloat16, cute.make_layout((RP, DS // 8, 8), stride=(DS, 8, 1)),
                                  byte_alignment=16)
        sV = smem.allocate_tensor(Int32, cute.make_layout((TILE // 2, C // 4, 4), stride=(C + VPAD, 4, 1)),
                                  byte_alignment=16)
        sS = smem.allocate_tensor(Float32, cute.make_layout((KH, RP, SROW), stride=(RP * SROW, SROW, 1)),
                                  byte_alignment=16)
        sP = smem.allocate_tensor(BFloat16, cute.make_layout((RP, PROW), stride=(PROW, 1)), byte_alignment=16)
        sA = smem.allocate_tensor(Float32, cute.make_layout(RP), byte_alignment=16)
        sRed = smem.allocate_tensor(Float32, cute.make_layout((self.SG, self.QB, 4), stride=(self.QB * 4, 4, 1)),
                                    byte_alignment=16)
        sW = smem.allocate_tensor(Float32, cute.make_layout(THREADS), byte_alignment=16)
        sBlk = smem.allocate_tensor(Float32, cute.make_layout((2, WARPS), stride=(WARPS, 1)), byte_alignment=16)
        if cutlass.const_expr(self.cfg.uv):        # mla_glue.gemm_tile's staging and warp sums
            s_x, red = self.uv_smem(smem)
        sQw = cute.make_tensor(cute.recast_ptr(sQ.iterator, dtype=Int32),
                               cute.make_layout((RP, DS // 8, 4), stride=(DS // 2, 4, 1)))
        sPw = cute.make_tensor(cute.recast_ptr(sP.iterator, dtype=Int32),
                               cute.make_layout((RP, PROW // 2), stride=(PROW // 2, 1)))

        # PDL chain (kernels/chain.py): q and the cache rows uk_insert wrote are read below;
        # with PRE_WAIT_TILES the positions and the first tiles' old rows are read before the wait
        pre = PRE_WAIT_TILES and chain.chain_on()
        if cutlass.const_expr(not pre):
            chain.enter()
            self.stamp(stamps, 1, tid, False)

        # Positions this CTA reads: [t0, end), end ≤ max_t last[t] + 1 and ≤ C.
        lastv = cute.make_rmem_tensor(cute.make_layout(self.T), Int32)
        maxlast = Int32(-1)
        minlast = cache_len                   # the first row this step's tokens write
        for tt in cutlass.range_constexpr(self.T):
            lv = mL[tt].to(Int32)
            lastv[tt] = lv
            if lv > maxlast:
                maxlast = lv
            if lv < minlast:
                minlast = lv
        # The valid tiles (positions ≤ max_t last[t], inside the cache) shared out evenly:
        # split s takes tiles ⌊s·n/S⌋ .. ⌊(s+1)·n/S⌋ - 1 (at most one more than any other).
        valid = maxlast + 1
        if valid > cache_len:
            valid = cache_len
        n_valid = (valid + TILE - 1) // TILE
        t_lo = s * n_valid // splits
        t_hi = (s + 1) * n_valid // splits
        t0 = t_lo * TILE
        end = t_hi * TILE
        if end > valid:
            end = valid
        ntile = t_hi - t_lo
        row0 = b * cache_len

        # The first tiles' cache words (B fragments and value columns), in flight during q's staging.
        kA = cute.make_rmem_tensor(cute.make_layout((KC, 4), stride=(4, 1)), Int32)
        kB = kA
        if cutlass.const_expr(self.NBUF == 2):
            kB = cute.make_rmem_tensor(cute.make_layout((KC, 4), stride=(4, 1)), Int32)
        if ntile > 0:
            self.load_k(mK, kA, row0, t0, end, nq, kh, g, t)
        if cutlass.const_expr(self.NBUF == 2):
            if ntile > 1:
                self.load_k(mK, kB, row0, t0 + TILE, end, nq, kh, g, t)
        if cutlass.const_expr(pre):            # the wait, then this step's rows again
            chain.enter()
            self.stamp(stamps, 1, tid, False)
        if cutlass.const_expr(pre and RELOAD_NEW):
            if ntile > 0:
                self.reload_new(mK, kA, row0, t0, end, nq, kh, g, t, minlast)
            if cutlass.const_expr(self.NBUF == 2):
                if ntile > 1:
                    self.reload_new(mK, kB, row0, t0 + TILE, end, nq, kh, g, t, minlast)
        self.stage_q(mQ, sQ, b, roff, tid)

        mreg = cute.make_rmem_tensor(cute.make_layout(1), Float32)   # softmax state of row tid / TPR
        lreg = cute.make_rmem_tensor(cute.make_layout(1), Float32)
        mreg.fill(NEG)
        lreg.fill(0.0)
        acc = cute.make_rmem_tensor(cute.make_layout((MT, 4 * JW, 4), stride=(16 * JW, 4, 1)), Float32)
        acc.fill(0.0)
        cute.arch.sync_threads()
        self.stamp(stamps, 2, tid, False)

        if cutlass.const_expr(self.NBUF == 1):
            for it in range(ntile):
                self.tile(mK, kA, sQw, sV, sS, sP, sPw, sA, acc, mreg, lreg, lastv, row0, t0, end, ntile, it,
                          roff, tid, warp, g, t, nq, kh, stamps)
        else:                                  # two tiles in flight: buffers alternate
            for it2 in range(0, ntile, 2):
                self.tile(mK, kA, sQw, sV, sS, sP, sPw, sA, acc, mreg, lreg, lastv, row0, t0, end, ntile, it2,
                          roff, tid, warp, g, t, nq, kh, stamps)
                if it2 + 1 < ntile:
                    self.tile(mK, kB, sQw, sV, sS, sP, sPw, sA, acc, mreg, lreg, lastv, row0, t0, end, ntile,
                              it2 + 1, roff, tid, warp, g, t, nq, kh, stamps)

        # This split's partial (written even when it saw no valid position: m = NEG, l = 0, o = 0).
        srow = v * splits + s
        o4 = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        for mt in cutlass.range_constexpr(MT):
            for half in cutlass.range_constexpr(2):
                row = 16 * mt + g + 8 * half
                if row < R:
                    for jw in cutlass.range_constexpr(JW):
                        qd = (warp * JW + jw) * 8 + 2 * t      # columns 32J + 8t .. + 7
                        for e in cutlass.range_constexpr(2):
                            for jj in cutlass.range_constexpr(4):
                                o4[jj] = acc[mt, 4 * jw + jj, 2 * half + e]
                            cute.autovec_copy(o4, mPo[srow, row, qd + e, None])
        r = tid // self.TPR
        if tid < self.ACT:
            if tid % self.TPR == 0:
                if r < R:
                    mPml[srow, 0, r] = mreg[0]
                    mPml[srow, 1, r] = lreg[0]
        # uv mode: worker CTA `lin` < NW owns W_UV tile (head wh, column tile wct); its weight
        # loads and gate value are issued now, in flight during the barrier and the merge.
        lin = v * splits + s
        wh = Int32(0)
        wct = Int32(0)
        gate = Float32(0.0)
        if cutlass.const_expr(self.cfg.uv):
            wbuf = cute.make_rmem_tensor(cute.make_layout((self.glue.P, 8), stride=(8, 1)), BFloat16)
            wh, wct, gate = self.uv_loads(mW, mG, wbuf, lin, tid, warp, lane)

        # The partials reach the other CTAs through the barrier: CTA barrier, then thread 0's
        # fence.acq_rel.gpu and arrival (grid_arrive_and_wait), CUTLASS's semaphore pattern; no
        # per-thread fence (ncu: a membar stall of every thread behind its 96 KB of stores).
        cute.arch.sync_threads()
        self.stamp(stamps, 7, tid, False)
        if tid == 0:                           # every split of pair v has written its partial
            grid_arrive_and_wait(mCnt, v, nv + v, splits)
        cute.arch.sync_threads()
        self.stamp(stamps, 8, tid, False)
        cute.arch.fence_acq_rel_gpu()
        self.merge(mPo, mPml, mO, sRed, sW, sBlk, v, b, roff, s, splits, tid, warp, lane)
        self.stamp(stamps, 9, tid, True)
        if cutlass.const_expr(self.cfg.uv):     # mla_attend.py's uv mode: publish, then the tiles
            self.publish(mCnt, 2 * nv, tid)
            self.stamp(stamps, 10, tid, True)
            if lin < self.NW:                   # CTA-uniform
                self.uv_tile(mCnt, mX, mW, mU, s_x, red, wbuf, 2 * nv, nv * splits, wh, wct, gate, tid,
                             warp, lane)
        if cutlass.const_expr(self.cfg.probe):
            self.stamp(stamps, 11, tid, True)
            if tid == 0:
                for i in cutlass.range_constexpr(len(PROBE_PHASES)):
                    mT[lin, i] = stamps[i]

    # Probe mode's stamp (thread 0 records %globaltimer as phase i, after a CTA barrier when
    # asked; nothing otherwise): mla_attend's method, which reads the same cfg.probe field.
    stamp = MLAAttend.stamp

    @cute.jit
    def stage_q(self, mQ: cute.Tensor, sQ: cute.Tensor, b: Int32, roff: Int32, tid: Int32):
        """q[b] rows roff .. roff + R - 1 (this CTA's row group) -> shared memory (rows R .. RP - 1
        zero): every load of a thread issued before its stores (one round trip, not one per
        vector)."""
        NV = self.D // 8
        total = self.RP * NV
        n = (total + THREADS - 1) // THREADS
        qv = cute.make_rmem_tensor(cute.make_layout((n, 8), stride=(8, 1)), BFloat16)
        qv.fill(0.0)
        for j in cutlass.range_constexpr(n):
            i = tid + j * THREADS
            r = i // NV
            if r < self.R:
                cute.autovec_copy(mQ[b, roff + r, i - r * NV, None], qv[j, None])
        for j in cutlass.range_constexpr(n):
            i = tid + j * THREADS
            r = i // NV
            if i < total:
                cute.autovec_copy(qv[j, None], sQ[r, i - r * NV, None])

    @cute.jit
    def tile(self, mK: cute.Tensor, kreg: cute.Tensor, sQw: cute.Tensor, sV: cute.Tensor, sS: cute.Tensor,
             sP: cute.Tensor, sPw: cute.Tensor, sA: cute.Tensor, acc: cute.Tensor, mreg: cute.Tensor,
             lreg: cute.Tensor, lastv: cute.Tensor, row0: Int32, t0: Int32, end: Int32, ntile: Int32, it: Int32,
             roff: Int32, tid: Int32, warp: Int32, g: Int32, t: Int32, nq: Int32, kh: Int32,
             stamps: cute.Tensor):
        """One tile (module docstring, steps 1-4); `kreg` holds its cache words and is reloaded
        with tile it + NBUF's once consumed. `stamps`: the probe's (PROBE_PHASES 3-6)."""
        MT, KC, JW, NCH, TPR, PPT = self.MT, self.KC, self.JW, self.NCH, self.TPR, self.PPT
        tstart = t0 + it * TILE
        # 1-2. value columns into sV (transposed to position pairs), scores over this k-half
        self.stage_v(kreg, sV, kh, nq, g, t)
        sacc = cute.make_rmem_tensor(cute.make_layout((MT, NCH, 4), stride=(4 * NCH, 4, 1)), Float32)
        sacc.fill(0.0)
        qa = cute.make_rmem_tensor(cute.make_layout((2, 4), stride=(4, 1)), Int32)
        for c in cutlass.range_constexpr(KC):
            v = kh * (self.D // 16) + 4 * c + t
            for mt in cutlass.range_constexpr(MT):
                cute.autovec_copy(sQw[16 * mt + g, v, None], qa[0, None])
                cute.autovec_copy(sQw[16 * mt + g + 8, v, None], qa[1, None])
                mma_at(sacc, mt, c % NCH, qa[0, 0], qa[1, 0], qa[0, 1], qa[1, 1], kreg[c, 0], kreg[c, 1])
                mma_at(sacc, mt, c % NCH, qa[0, 2], qa[1, 2], qa[0, 3], qa[1, 3], kreg[c, 2], kreg[c, 3])
        for mt in cutlass.range_constexpr(MT):
            for e in cutlass.range_constexpr(4):
                for ch in cutlass.range_constexpr(1, NCH):
                    sacc[mt, 0, e] = sacc[mt, 0, e] + sacc[mt, ch, e]
            sS[kh, 16 * mt + g, 8 * nq + 2 * t] = sacc[mt, 0, 0]
            sS[kh, 16 * mt + g, 8 * nq + 2 * t + 1] = sacc[mt, 0, 1]
            sS[kh, 16 * mt + g + 8, 8 * nq + 2 * t] = sacc[mt, 0, 2]
            sS[kh, 16 * mt + g + 8, 8 * nq + 2 * t + 1] = sacc[mt, 0, 3]
        if it + self.NBUF < ntile:             # the words of tile it + NBUF fly from here on
            self.load_k(mK, kreg, row0, tstart + self.NBUF * TILE, end, nq, kh, g, t)
        cute.arch.sync_threads()
        self.stamp(stamps, 4, tid, False)

        # 3. online softmax: TPR threads per row, PPT positions each.
        if tid < self.ACT:                     # warp-uniform (ACT is a multiple of 32)
            r = tid // TPR
            j0 = (tid - r * TPR) * PPT
            tr = (roff + r) // self.H          # the query token of this row (its mask)
            lr = lastv[0]
            for tt in cutlass.range_constexpr(1, self.T):
                if tr == tt:
                    lr = lastv[tt]
            sv = cute.make_rmem_tensor(cute.make_layout(PPT), Float32)
            mx = Float32(NEG)
            for j in cutlass.range_constexpr(PPT):
                x = (sS[0, r, j0 + j] + sS[1, r, j0 + j]).to(BFloat16).to(Float32) * Float32(self.cfg.scale)
                pos = tstart + j0 + j
                if pos >= end:
                    x = Float32(NEG)
                if pos > lr:
                    x = Float32(NEG)
                if r >= self.R:
                    x = Float32(NEG)
                sv[j] = x
                mx = cute.arch.fmax(mx, x)
            for sh in cutlass.range_constexpr(self.TPR_LOG):
                mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1 << sh))
            m_old = mreg[0]
            m_new = cute.arch.fmax(m_old, mx)
            alpha = cute.math.exp(m_old - m_new)
            ps = Float32(0.0)
            for j in cutlass.range_constexpr(PPT):
                p = Float32(0.0)
                if sv[j] > Float32(VALID):
                    p = cute.math.exp(sv[j] - m_new)
                pb = p.to(BFloat16)
                sP[r, j0 + j] = pb
                ps += pb.to(Float32)
            for sh in cutlass.range_constexpr(self.TPR_LOG):
                ps += cute.arch.shuffle_sync_bfly(ps, offset=1 << sh)
            lreg[0] = lreg[0] * alpha + ps
            mreg[0] = m_new
            if j0 == 0:
                sA[r] = alpha
        cute.arch.sync_threads()
        self.stamp(stamps, 5, tid, False)

        # 4. P·V: columns 64·warp .. + 63 of every row.
        pa = cute.make_rmem_tensor(cute.make_layout((MT, 4), stride=(4, 1)), Int32)
        bv = cute.make_rmem_tensor(cute.make_layout((2, 4), stride=(4, 1)), Int32)
        for mt in cutlass.range_constexpr(MT):
            a_lo = sA[16 * mt + g]
            a_hi = sA[16 * mt + g + 8]
            for n in cutlass.range_constexpr(4 * JW):
                acc[mt, n, 0] = acc[mt, n, 0] * a_lo
                acc[mt, n, 1] = acc[mt, n, 1] * a_lo
                acc[mt, n, 2] = acc[mt, n, 2] * a_hi
                acc[mt, n, 3] = acc[mt, n, 3] * a_hi
        for u in cutlass.range_constexpr(TILE // 16):
            for mt in cutlass.range_constexpr(MT):
                pa[mt, 0] = sPw[16 * mt + g, 8 * u + t]
                pa[mt, 1] = sPw[16 * mt + g + 8, 8 * u + t]
                pa[mt, 2] = sPw[16 * mt + g, 8 * u + t + 4]
                pa[mt, 3] = sPw[16 * mt + g + 8, 8 * u + t + 4]
            for jw in cutlass.range_constexpr(JW):
                cg = (warp * JW + jw) * 8 + g          # 128-bit vector: columns 4·cg .. + 3
                cute.autovec_copy(sV[8 * u + t, cg, None], bv[0, None])
                cute.autovec_copy(sV[8 * u + t + 4, cg, None], bv[1, None])
                for mt in cutlass.range_constexpr(MT):
                    for jj in cutlass.range_constexpr(4):
                        mma_at(acc, mt, 4 * jw + jj, pa[mt, 0], pa[mt, 1], pa[mt, 2], pa[mt, 3],
                               bv[0, jj], bv[1, jj])
        cute.arch.sync_threads()               # sV, sS, sP, sA free for the next tile
        self.stamp(stamps, 6, tid, False)
        if cutlass.const_expr(self.cfg.probe):
            if it == 0:
                self.stamp(stamps, 3, tid, False)

    @cute.jit
    def load_k(self, mK: cute.Tensor, kreg: cute.Tensor, row0: Int32, tstart: Int32, end: Int32, nq: Int32,
               kh: Int32, g: Int32, t: Int32):
        """kreg[c] = the 128 bits of cache row (tstart + 8nq + g) at dim kh·D/2 + 32c + 8t; rows at
        or past `end` read row end − 1 instead (masked later, never garbage)."""
        pos = tstart + 8 * nq + g
        if pos > end - 1:
            pos = end - 1
        for c in cutlass.range_constexpr(self.KC):
            cute.autovec_copy(mK[row0 + pos, kh * (self.D // 16) + 4 * c + t, None], kreg[c, None])

    @cute.jit
    def reload_new(self, mK: cute.Tensor, kreg: cute.Tensor, row0: Int32, tstart: Int32, end: Int32, nq: Int32,
                   kh: Int32, g: Int32, t: Int32, first_new: Int32):
        """load_k again, after the chain's wait, for a lane whose row (clamped as load_k clamps
        it) is one this step writes (≥ first_new = min_t last[t]): its pre-wait words may be
        the previous content of that row (PRE_WAIT_TILES)."""
        pos = tstart + 8 * nq + g
        if pos > end - 1:
            pos = end - 1
        if pos >= first_new:
            for c in cutlass.range_constexpr(self.KC):
                cute.autovec_copy(mK[row0 + pos, kh * (self.D // 16) + 4 * c + t, None], kreg[c, None])

    @cute.jit
    def stage_v(self, kreg: cute.Tensor, sV: cute.Tensor, kh: Int32, nq: Int32, g: Int32, t: Int32):
        """The value columns (dims < c) of this lane's cache row into sV as position-pair words:
        sV[pair i][column n] = (V[2i][n], V[2i + 1][n]) (low half: the even position). Lane g
        (position 8nq + g) and lane g ^ 1 swap two words per chunk; the even lane writes the
        chunk's first 4 columns, the odd lane the last 4."""
        odd = g % 2
        pair = 4 * nq + g // 2
        for c in cutlass.range_constexpr(self.KC):
            d0 = kh * (self.D // 2) + 32 * c          # warp-uniform
            if d0 + 32 <= self.C:
                send0 = kreg[c, 2]
                send1 = kreg[c, 3]
                if odd == 1:
                    send0 = kreg[c, 0]
                    send1 = kreg[c, 1]
                recv0 = cute.arch.shuffle_sync_bfly(send0, offset=4)
                recv1 = cute.arch.shuffle_sync_bfly(send1, offset=4)
                x0 = kreg[c, 0]                       # even lane: own words 0, 1 (columns +0..3),
                x1 = kreg[c, 1]                       # the odd neighbour's words 0, 1
                y0 = recv0
                y1 = recv1
                if odd == 1:                          # odd lane: the even neighbour's words 2, 3,
                    x0 = recv0                        # own words 2, 3 (columns +4..7)
                    x1 = recv1
                    y0 = kreg[c, 2]
                    y1 = kreg[c, 3]
                w4 = cute.make_rmem_tensor(cute.make_layout(4), Int32)
                w4[0] = prmt(x0, y0, SEL_LO)
                w4[1] = prmt(x0, y0, SEL_HI)
                w4[2] = prmt(x1, y1, SEL_LO)
                w4[3] = prmt(x1, y1, SEL_HI)
                cv = (d0 + 8 * t) // 4 + odd          # 128-bit vector of 4 columns
                cute.autovec_copy(w4, sV[pair, cv, None])

    @cute.jit
    def merge(self, mPo: cute.Tensor, mPml: cute.Tensor, mO: cute.Tensor, sRed: cute.Tensor, sW: cute.Tensor,
              sBlk: cute.Tensor, v: Int32, b: Int32, roff: Int32, s: Int32, splits: Int32, tid: Int32,
              warp: Int32, lane: Int32):
        """Items s, s + splits, ... of pair v = (sequence b, the row group from row roff) (module
        docstring): item = (row r, quad block jq). Thread (quad qd = tid % QB, group sg = tid / QB) issues the loads of its partials'
        o quads (sg, sg + SG, ...: all NL at once); meanwhile thread i < splits loads split i's
        (m, l), the CTA reduces M = max m and L = Σ l·e^{m−M} and leaves w_i = e^{m_i−M} in
        sW; each thread weights its quads, the SG groups' sums meet in sRed (added in group
        order) and o_lat[b, r, quads] = bf16(O / L)."""
        NL, QB, SG, KQ = self.cfg.nl, self.QB, self.SG, self.cfg.kq
        qd = tid % QB
        sg = tid // QB
        vo = cute.make_rmem_tensor(cute.make_layout((NL, 4), stride=(4, 1)), Float32)
        o4 = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        ob = cute.make_rmem_tensor(cute.make_layout(4), BFloat16)
        base = v * splits
        for item in range(s, self.R * KQ, splits):
            r = item // KQ
            quad = (item - r * KQ) * QB + qd
            for u in cutlass.range_constexpr(NL):
                i = sg + u * SG
                for e in cutlass.range_constexpr(4):
                    vo[u, e] = Float32(0.0)
                if i < splits:
                    cute.autovec_copy(mPo[base + i, r, quad, None], vo[u, None])
            mi = Float32(NEG)
            li = Float32(0.0)
            if tid < splits:
                mi = mPml[base + tid, 0, r]
                li = mPml[base + tid, 1, r]
            wmax = cute.arch.warp_reduction_max(mi)
            if lane == 0:
                sBlk[0, warp] = wmax
            cute.arch.sync_threads()
            big = sBlk[0, 0]
            for w in cutlass.range_constexpr(1, WARPS):
                big = cute.arch.fmax(big, sBlk[0, w])
            wi = Float32(0.0)
            if mi > Float32(VALID):
                wi = cute.math.exp(mi - big)
            sW[tid] = wi
            wsum = cute.arch.warp_reduction_sum(li * wi)
            if lane == 0:
                sBlk[1, warp] = wsum
            cute.arch.sync_threads()
            tot = Float32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                tot += sBlk[1, w]
            o4.fill(0.0)
            for u in cutlass.range_constexpr(NL):
                i = sg + u * SG
                if i < splits:
                    wt = sW[i]
                    for e in cutlass.range_constexpr(4):
                        o4[e] = o4[e] + vo[u, e] * wt
            for e in cutlass.range_constexpr(4):
                sRed[sg, qd, e] = o4[e]
            cute.arch.sync_threads()
            if sg == 0:
                for e in cutlass.range_constexpr(4):
                    o4[e] = Float32(0.0)
                for w in cutlass.range_constexpr(SG):
                    for e in cutlass.range_constexpr(4):
                        o4[e] = o4[e] + sRed[w, qd, e]
                inv = Float32(0.0)
                if tot > Float32(0.0):
                    inv = Float32(1.0) / tot
                for e in cutlass.range_constexpr(4):
                    ob[e] = (o4[e] * inv).to(BFloat16)
                cute.autovec_copy(ob, mO[b, roff + r, quad, None])
            cute.arch.sync_threads()           # sBlk, sW, sRed free for the next item


def compile_for(cfg: MMAConfig) -> object:
    """The compiled kernel for `cfg` (cached)."""
    def build() -> object:
        bf, f32 = dummy_ptr(torch.bfloat16), dummy_ptr(torch.float32)
        return cute.compile(MLAAttendMMA(cfg), bf, bf, dummy_ptr(torch.int64), bf, f32, f32,
                            dummy_ptr(torch.int32), bf, bf, bf, dummy_ptr(torch.int64), Int32(1), Int32(1),
                            Int32(1), current_stream(),
                            options=compile_options())
    return compiled(("mla_attend_mma", cfg, PRE_WAIT_TILES, RELOAD_NEW), build)


def mla_attend_mma(q_full: torch.Tensor, cache: torch.Tensor, last: torch.Tensor, heads: int, kv_rank: int,
                   scale: float, scratch: MMAScratch | None = None,
                   probe: torch.Tensor | None = None) -> torch.Tensor:
    """Launch on the current stream. q_full [B, T·H, c + rope] bf16, cache [B, C, c + rope]
    bf16, last [T] int64 (on the GPU; read by the kernel), scratch from make_scratch (kept by
    the caller across calls; its counters are zero between calls). Returns o_lat [B, T·H, c]
    bf16. `probe` (int64 [B·G·splits, len(PROBE_PHASES)], probe_buffer): run the probe build,
    which stamps each CTA's phases there (bench/mla_mma_phases.py)."""
    B, R, D, C, T = attend_shapes("mla_attend_mma", q_full, cache, last, heads, kv_rank, can_implement)
    if scratch is None:
        scratch = make_scratch(B, R, C, kv_rank, q_full.device)
    sc = scratch
    if (sc.batch, sc.rows, sc.cache_len, sc.kv_rank) != (B, R, C, kv_rank):
        raise ValueError("mla_attend_mma: scratch was made for other shapes")
    if sc.units * sc.splits > sm_count(q_full.device) or sc.splits > THREADS or sc.nl > MAX_NL:
        raise ValueError(f"mla_attend_mma: B={B} x {sc.groups} row groups x {sc.splits} splits cannot all be "
                         f"resident (or {sc.nl} partials per merge thread > {MAX_NL})")
    cfg = MMAConfig(heads, T, kv_rank, D - kv_rank, float(scale), sc.kq, sc.nl, groups=sc.groups,
                    probe=probe is not None)
    out = torch.empty(B, R, kv_rank, dtype=torch.bfloat16, device=q_full.device)
    o = ptr(out)           # w_uv, g, o_uv: unused without the uv mode
    compile_for(cfg)(ptr(q_full), ptr(cache), ptr(last), o, ptr(sc.part_o), ptr(sc.part_ml),
                     ptr(sc.counters), o, o, o, _probe_ptr(probe, sc), Int32(B), Int32(C), Int32(sc.splits),
                     current_stream())
    return out


def probe_buffer(scratch: MMAScratch) -> torch.Tensor:
    """A zeroed stamp buffer for the probe build of `scratch`'s launch: one row per CTA
    (B·G·splits), one int64 nanosecond stamp per PROBE_PHASES entry."""
    return torch.zeros(scratch.units * scratch.splits, len(PROBE_PHASES), dtype=torch.int64,
                       device=scratch.counters.device)


def _probe_ptr(probe: torch.Tensor | None, scratch: MMAScratch) -> object:
    """The probe buffer's pointer (shape-checked against the launch), or a placeholder."""
    if probe is None:
        return dummy_ptr(torch.int64)
    want = (scratch.units * scratch.splits, len(PROBE_PHASES))
    if tuple(probe.shape) != want or probe.dtype != torch.int64 or not probe.is_contiguous():
        raise ValueError(f"mla_attend_mma: probe must be contiguous int64 {want} (probe_buffer), "
                         f"not {probe.dtype} {tuple(probe.shape)}")
    return ptr(probe)


def can_implement_uv(batch: int, heads: int, tokens: int, kv_rank: int, rope: int, v_dim: int,
                     splits: int, dtypes: tuple[torch.dtype, ...], sms: int = H200_SMS, groups: int = 1) -> bool:
    """uv mode: this kernel's rules and mla_attend's uv rules (the same uv code runs; its
    workers are among the B·G·splits CTAs, so a sequence's CTAs count G·splits)."""
    return (can_implement(heads, tokens, kv_rank, rope, dtypes)
            and uv_launch_ok(batch, heads, tokens, kv_rank, v_dim, splits * groups, dtypes, sms))


def mla_attend_mma_uv(q_full: torch.Tensor, cache: torch.Tensor, last: torch.Tensor, heads: int, kv_rank: int,
                      scale: float, w_uv: torch.Tensor, g: torch.Tensor, scratch: MMAScratch,
                      probe: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """mla_attend_mma, then mla_glue.uv_gate on its o_lat, in one launch (uv mode: the W_UV
    tiles run by the first CTAs once every CTA has published its share of o_lat, as
    mla_attend.mla_attend_uv). w_uv [H, c, vd], g [M, H·vd] bf16 (M = B·T). Returns
    (o [M, H·vd], o_lat [B, T·H, c]) bf16; o equals mla_glue.uv_gate(o_lat, w_uv, g) bit for
    bit by design (mla_glue's own tile code and rounding points). `probe`: as mla_attend_mma's."""
    B, R, D = q_full.shape
    C = cache.shape[1]
    T = last.shape[0]
    H, c, vd = w_uv.shape
    M = B * T
    sc = scratch
    if (not uv_shapes_ok(q_full, cache, last, heads, kv_rank, w_uv, g, sc)
            or sc.units * sc.splits > sm_count(q_full.device) or sc.splits > THREADS or sc.nl > MAX_NL
            or not can_implement_uv(B, heads, T, kv_rank, D - kv_rank, vd, sc.splits,
                                    (q_full.dtype, cache.dtype, w_uv.dtype, g.dtype), sm_count(q_full.device),
                                    sc.groups)):
        raise ValueError(f"mla_attend_mma_uv cannot run q {tuple(q_full.shape)} g {tuple(g.shape)}")
    cfg = MMAConfig(heads, T, kv_rank, D - kv_rank, float(scale), sc.kq, sc.nl, uv_rows=M, v_dim=vd,
                    groups=sc.groups, probe=probe is not None)
    o_lat = torch.empty(B, R, kv_rank, dtype=torch.bfloat16, device=q_full.device)
    o = torch.empty(M, H * vd, dtype=torch.bfloat16, device=q_full.device)
    compile_for(cfg)(ptr(q_full), ptr(cache), ptr(last), ptr(o_lat), ptr(sc.part_o), ptr(sc.part_ml),
                     ptr(sc.counters), ptr(w_uv), ptr(g), ptr(o), _probe_ptr(probe, sc), Int32(B), Int32(C),
                     Int32(sc.splits), current_stream())
    return o, o_lat


def arrivals_zero(scratch: MMAScratch) -> bool:
    """The grid barrier's arrival counters (one per (sequence, row group) pair; not the epochs
    after them) are zero, as every call must leave them."""
    return int(scratch.counters[:scratch.units].abs().sum()) == 0


def check(timing: bool = True, cases: tuple[tuple[int, int], ...] = ((1, 7), (8, 0), (8, 7), (1, 0), (64, 0)),
          tps_sweep: tuple[int, ...] = (2, 4)) -> list[dict]:
    """Kernel vs stock_ops.mla_attend (eager, and the torch.compile'd op stock.MLAAttention
    runs) and the float64 reference (mla_attend.reference) at the K3 TP16 shapes, (B, k) in
    `cases`; `last` inside the cache and the positions past it NaN (a read of them would
    show). A second call must be bit-equal and leave every barrier counter zero. With timing:
    kernel vs stock (compiled and eager) and, at B = 1, k = 0, vs kernels/mla_attend.py; at
    B = 1 other plans (tiles per split in `tps_sweep`, own rows) to tune plan(). Where the
    default build splits the rows into groups (row_groups > 1: R = 48), the ungrouped build
    (G = 1) gets its own row, checked and timed the same way (the A/B of the grouping)."""
    from kimi_decode import stock_ops
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels import mla_attend as k_old
    from kimi_decode.kernels.checks import DEVICE, _sync, rel, time_us
    dev = torch.device(DEVICE)
    compiled_attend = stock_ops.maybe_compiled(stock_ops.mla_attend, True)
    out = []
    for bsz, k in cases:
        cfg = k3_tp16(batch=bsz, spec_tokens=k)
        H, T, c, rope = cfg.mla_local_heads, cfg.tokens_per_seq, cfg.kv_lora_rank, cfg.qk_rope_dim
        C, scale = cfg.cache_len, (cfg.qk_nope_dim + rope) ** -0.5
        if not fits(bsz, T * H, C, c, sm_count(dev)):
            out.append({"kernel": "mla_attend_mma", "B": bsz, "k": k, "skipped": "plan does not fit", "ok": True})
            continue
        x = k_old.check_inputs(cfg, k, 1000 * bsz + k, dev)
        cache, clean, q_full, last = x["cache"], x["clean"], x["q_full"], x["last"]
        scratch = make_scratch(bsz, T * H, C, c, dev)
        with torch.no_grad():
            o_s = stock_ops.mla_attend(q_full, clean, last, H, c, scale)
            o_c = compiled_attend(q_full, clean, last, H, c, scale)
            o_k = mla_attend_mma(q_full, cache, last, H, c, scale, scratch)
            o_k2 = mla_attend_mma(q_full, cache, last, H, c, scale, scratch)
        _sync()
        ref = k_old.reference(q_full, clean, last, H, c, scale)
        e_ks, e_kc, e_k, e_s = rel(o_k, o_s), rel(o_k, o_c), rel(o_k, ref), rel(o_s, ref)
        ok = (e_ks <= 1e-2 and e_kc <= 1e-2 and e_k <= 1.5 * e_s + 1e-3 and torch.equal(o_k, o_k2)
              and bool(torch.isfinite(o_k).all()) and arrivals_zero(scratch))
        r = {"kernel": "mla_attend_mma", "B": bsz, "k": k, "C": C, "groups": scratch.groups, "splits": scratch.splits,
             "tiles_per_split": scratch.tiles_per_split, "kq": scratch.kq, "nl": scratch.nl,
             "rel_vs_stock": e_ks, "rel_vs_compiled": e_kc, "rel_vs_f64": e_k, "stock_rel_vs_f64": e_s,
             "repeat_equal": torch.equal(o_k, o_k2), "ok": ok}
        if timing:
            r["stock_us"] = time_us(lambda: compiled_attend(q_full, clean, last, H, c, scale))
            r["stock_eager_us"] = time_us(lambda: stock_ops.mla_attend(q_full, clean, last, H, c, scale))
            r["kernel_us"] = time_us(lambda: mla_attend_mma(q_full, cache, last, H, c, scale, scratch))
            r["ok"] = r["ok"] and arrivals_zero(scratch)
            if bsz == 1 and k == 0 and k_old.can_implement(H, T, c, rope, (torch.bfloat16,)):
                sc_old = k_old.make_scratch(bsz, T * H, C, c, dev)
                r["mla_attend_us"] = time_us(lambda: k_old.mla_attend(q_full, cache, last, H, c, scale, sc_old))
        out.append(r)
        if scratch.groups > 1 and fits(bsz, T * H, C, c, sm_count(dev), groups=1):
            sc1 = make_scratch(bsz, T * H, C, c, dev, groups=1)
            with torch.no_grad():
                o_1 = mla_attend_mma(q_full, cache, last, H, c, scale, sc1)
            _sync()
            e_1 = rel(o_1, ref)
            r1 = {"kernel": "mla_attend_mma", "B": bsz, "k": k, "C": C, "groups": 1, "splits": sc1.splits,
                  "tiles_per_split": sc1.tiles_per_split, "kq": sc1.kq, "nl": sc1.nl, "rel_vs_f64": e_1,
                  "rel_vs_grouped": rel(o_1, o_k), "ok": e_1 <= 1.5 * e_s + 1e-3 and arrivals_zero(sc1)}
            if timing:
                r1["kernel_us"] = time_us(lambda: mla_attend_mma(q_full, cache, last, H, c, scale, sc1))
                r1["ok"] = r1["ok"] and arrivals_zero(sc1)
            out.append(r1)
            del sc1
        if timing and bsz == 1:
            for n in tps_sweep:
                if not fits(bsz, T * H, C, c, sm_count(dev), n):
                    continue
                sc2 = make_scratch(bsz, T * H, C, c, dev, tiles_per_split=n)
                with torch.no_grad():
                    o_n = mla_attend_mma(q_full, cache, last, H, c, scale, sc2)
                _sync()
                e_n = rel(o_n, ref)
                out.append({"kernel": "mla_attend_mma", "B": bsz, "k": k, "C": C, "groups": sc2.groups,
                            "splits": sc2.splits,
                            "tiles_per_split": n, "kq": sc2.kq, "nl": sc2.nl, "rel_vs_f64": e_n,
                            "ok": e_n <= 1.5 * e_s + 1e-3 and arrivals_zero(sc2),
                            "kernel_us": time_us(lambda: mla_attend_mma(q_full, cache, last, H, c, scale, sc2))})
        del cache, clean, scratch
    return out




def check_uv(timing: bool = True, cases: tuple[tuple[int, int], ...] = ((1, 0), (8, 0), (1, 7)),
             copies: int = 12) -> list[dict]:
    """mla_attend_mma_uv (uv mode) vs the two launches it replaces, mla_attend_mma then
    mla_glue.uv_gate: o and o_lat bit-equal by design; vs the stock ops (stock_ops.mla_attend +
    mla_glue.stock_uv, eager and torch.compile'd): rel ≤ 1e-2; vs the float64 chain: ≤ 1.5 ×
    stock's error + 1e-3. Two calls and the timed replays must leave the sequence and uv
    counters zero. With timing (cold: the calls cycle through `copies` copies of the cache and
    W_UV, beyond the 50 MB L2, as in the step; and warm): this kernel, the two launches,
    kernels/mla_attend.py's uv mode (what the B = 1, k = 0 step ran before) and stock."""
    from kimi_decode import stock_ops
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels import mla_attend as k_old
    from kimi_decode.kernels import mla_glue
    from kimi_decode.kernels.checks import DEVICE, _sync, rel
    dev = torch.device(DEVICE)
    attend_c = stock_ops.maybe_compiled(stock_ops.mla_attend, True)
    gate_c = stock_ops.maybe_compiled(stock_ops.sigmoid_gate, True)
    out = []
    for bsz, k in cases:
        cfg = k3_tp16(batch=bsz, spec_tokens=k)
        H, T, c, rope = cfg.mla_local_heads, cfg.tokens_per_seq, cfg.kv_lora_rank, cfg.qk_rope_dim
        C, vd, scale, M = cfg.cache_len, cfg.v_head_dim, (cfg.qk_nope_dim + rope) ** -0.5, bsz * T
        x = k_old.check_inputs(cfg, k, 2000 * bsz + k, dev, uv=True)
        cache, clean, q_full, last, w_uv, g = x["cache"], x["clean"], x["q_full"], x["last"], x["w_uv"], x["g"]
        sc = make_scratch(bsz, T * H, C, c, dev)
        sc2 = make_scratch(bsz, T * H, C, c, dev)
        if not (fits(bsz, T * H, C, c, sm_count(dev))
                and can_implement_uv(bsz, H, T, c, rope, vd, sc.splits, (torch.bfloat16,), sm_count(dev),
                                     sc.groups)):
            out.append({"kernel": "mla_attend_mma_uv", "B": bsz, "k": k, "ok": False,
                        "why": "can_implement_uv / fits refuses this shape"})
            continue
        with torch.no_grad():
            o_k, lat_k = mla_attend_mma_uv(q_full, cache, last, H, c, scale, w_uv, g, sc)
            o_k2, _ = mla_attend_mma_uv(q_full, cache, last, H, c, scale, w_uv, g, sc)
            lat_t = mla_attend_mma(q_full, cache, last, H, c, scale, sc2)
            o_t = mla_glue.uv_gate(lat_t, w_uv, g)
            o_s = mla_glue.stock_uv(stock_ops.mla_attend(q_full, clean, last, H, c, scale), w_uv, g,
                                    stock_ops.sigmoid_gate)
            o_c = mla_glue.stock_uv(attend_c(q_full, clean, last, H, c, scale), w_uv, g, gate_c)
        _sync()
        ref = mla_glue.reference_uv(k_old.reference(q_full, clean, last, H, c, scale), w_uv, g)
        e_ks, e_kc, e_k, e_s = rel(o_k, o_s), rel(o_k, o_c), rel(o_k, ref), rel(o_s, ref)

        def zero(scr: MMAScratch) -> bool:    # arrival counters and the uv counters (not the epochs)
            return arrivals_zero(scr) and int(scr.counters[2 * scr.units:].abs().sum()) == 0
        r = {"kernel": "mla_attend_mma_uv", "B": bsz, "k": k, "C": C, "groups": sc.groups, "splits": sc.splits,
             "kq": sc.kq,
             "nl": sc.nl, "workers": uv_workers(H, vd), "o_equal_two_launch": torch.equal(o_k, o_t),
             "o_lat_equal_mla_attend_mma": torch.equal(lat_k, lat_t), "rel_vs_stock": e_ks, "rel_vs_compiled": e_kc,
             "rel_vs_f64": e_k, "stock_rel_vs_f64": e_s, "repeat_equal": torch.equal(o_k, o_k2),
             "counters_zero": zero(sc) and zero(sc2)}
        r["ok"] = k_old.uv_verdict(o_k, (e_ks, e_kc, e_k, e_s), r["o_equal_two_launch"],
                                   r["o_lat_equal_mla_attend_mma"], r["repeat_equal"], r["counters_zero"])
        if timing:
            timed = k_old.cold_warm_timer(clean, w_uv, copies)
            new = lambda ca, w: mla_attend_mma_uv(q_full, ca, last, H, c, scale, w, g, sc)  # noqa: E731
            two = lambda ca, w: mla_glue.uv_gate(mla_attend_mma(q_full, ca, last, H, c, scale, sc2), w, g)  # noqa: E731
            stock = lambda ca, w: mla_glue.stock_uv(attend_c(q_full, ca, last, H, c, scale), w, g, gate_c)  # noqa: E731
            r["kernel_us"] = timed(new, True)
            r["two_launch_us"] = timed(two, True)
            r["stock_us"] = timed(stock, True)
            r["kernel_warm_us"] = timed(new, False)
            if T == 1:       # kernels/mla_attend.py's uv mode: what the B = 1, k = 0 step ran before
                sc_old = k_old.make_scratch(bsz, T * H, C, c, dev)
                old = lambda ca, w: k_old.mla_attend_uv(q_full, ca, last, H, c, scale, w, g, sc_old)  # noqa: E731
                r["mla_attend_uv_us"] = timed(old, True)
                r["mla_attend_uv_warm_us"] = timed(old, False)
            sc1 = None
            if sc.groups > 1 and fits(bsz, T * H, C, c, sm_count(dev), groups=1):   # the grouping's A/B
                sc1 = make_scratch(bsz, T * H, C, c, dev, groups=1)
                with torch.no_grad():
                    o_1, _ = mla_attend_mma_uv(q_full, cache, last, H, c, scale, w_uv, g, sc1)
                _sync()
                r["ungrouped_rel_vs_f64"] = rel(o_1, ref)
                one = lambda ca, w: mla_attend_mma_uv(q_full, ca, last, H, c, scale, w, g, sc1)  # noqa: E731
                r["ungrouped_us"] = timed(one, True)
                r["ungrouped_warm_us"] = timed(one, False)
            r["counters_zero_after_replays"] = zero(sc) and zero(sc2) and (sc1 is None or zero(sc1))
            r["ok"] = r["ok"] and r["counters_zero_after_replays"]
            del timed
        out.append(r)
        del cache, clean
    return out


def pre_wait_positions(splits: int, tokens: int, dev: torch.device) -> torch.Tensor:
    """`last` for check_pre_wait: this step's T rows inside one tile, with fewer valid tiles
    than splits, so every split gets at most one tile, the last one holding the new rows, and
    that tile is one the kernel reads before the wait (its first). Rows past max last are
    never read (the tail tile clamps), so check_inputs' NaN there stays unread."""
    pos0 = TILE * (splits // 2) + 3
    if tokens + 3 > TILE:
        raise ValueError(f"pre_wait_positions: {tokens} tokens do not fit one tile")
    return pos0 + torch.arange(tokens, device=dev)


def check_pre_wait(cases: tuple[tuple[int, int], ...] = ((1, 0), (1, 7), (8, 0)),
                   delay_ns: int = 2_000_000) -> list[dict]:
    """PRE_WAIT_TILES under the PDL chain against a late writer (kernels/chain_writer.py):
    this step's cache rows (last[t]) poisoned with NaN, then the writer, released at once,
    puts their values back `delay_ns` later, and the kernel (chained right behind it, so
    resident and past its pre-wait loads long before) must return exactly what it returns on
    the written cache with nothing racing, and finite. Negative control, same setup: the build
    without the re-load (RELOAD_NEW False) must return non-finite values, i.e. its pre-wait
    loads did see the poisoned rows (otherwise the check proved nothing). Per case: the plain
    build, and at B = 1, k = 0 the uv mode (the step's).

    delay_ns is 2 ms, not a kernel's length: the writer starts as soon as it is launched, and the
    host's next launch (this Python wrapper and the CuTe DSL call) takes tens of µs. With 20 µs
    (the first device run, H200, 2026-12-06 20:44 UTC) the rows had landed before the kernel was
    launched at all, and the control came out finite: no race was exercised.

    `last` is placed by pre_wait_positions, not at check_inputs' mid-run position: there the
    new rows sit in a split's last tile, which at B = 1, k = 7 and B = 8 is not among the tiles
    read before the wait (the second device run, 20:50 UTC: controls finite at those shapes,
    non-finite at B = 1, k = 0). A check that cannot see the race proves nothing."""
    global PRE_WAIT_TILES, RELOAD_NEW
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels import chain_writer
    from kimi_decode.kernels import mla_attend as k_old
    from kimi_decode.kernels.checks import DEVICE, _sync
    dev = torch.device(DEVICE)
    saved = (PRE_WAIT_TILES, RELOAD_NEW, chain.chain_on(), chain.key()[1])
    out = []
    try:
        chain.set_chain(True, 0)
        PRE_WAIT_TILES = True
        for bsz, k in cases:
            cfg = k3_tp16(batch=bsz, spec_tokens=k)
            H, T, c, rope = cfg.mla_local_heads, cfg.tokens_per_seq, cfg.kv_lora_rank, cfg.qk_rope_dim
            C, scale = cfg.cache_len, (cfg.qk_nope_dim + rope) ** -0.5
            if not fits(bsz, T * H, C, c, sm_count(dev)):
                out.append({"kernel": "mla_attend_mma_pre_wait", "B": bsz, "k": k, "skipped": "plan does not fit",
                            "ok": True})
                continue
            for uv in ((False, True) if (bsz, k) == (1, 0) else (False,)):
                x = k_old.check_inputs(cfg, k, 3000 * bsz + k, dev, uv=uv)
                cache, q_full = x["cache"], x["q_full"]
                sc = make_scratch(bsz, T * H, C, c, dev)
                last = pre_wait_positions(sc.splits, T, dev)

                def attend(ca: torch.Tensor) -> torch.Tensor:
                    if uv:
                        return mla_attend_mma_uv(q_full, ca, last, H, c, scale, x["w_uv"], x["g"], sc)[0]
                    return mla_attend_mma(q_full, ca, last, H, c, scale, sc)
                new_rows = cache[:, last].contiguous()
                r = {"kernel": "mla_attend_mma_pre_wait", "B": bsz, "k": k, "uv": uv, "delay_ns": delay_ns,
                     "first_new": int(last[0])}
                for reload in (True, False):
                    RELOAD_NEW = reload
                    with torch.no_grad():
                        ref = attend(cache)                 # nothing racing: the rows are there
                        stale = cache.clone()
                        stale[:, last] = float("nan")
                        chain_writer.write_rows_late(new_rows, stale, last, delay_ns)
                        o = attend(stale)
                    _sync()
                    landed = torch.equal(stale[:, last], new_rows)
                    if reload:
                        r.update(equal_to_unraced=torch.equal(o, ref), finite=bool(torch.isfinite(o).all()),
                                 rows_landed=landed)
                    else:
                        r.update(control_nonfinite=not bool(torch.isfinite(o).all()), control_rows_landed=landed)
                r["counters_zero"] = arrivals_zero(sc)
                r["ok"] = all(r[f] for f in ("equal_to_unraced", "finite", "rows_landed", "control_nonfinite",
                                              "control_rows_landed", "counters_zero"))
                out.append(r)
                del cache, stale, sc
    finally:
        PRE_WAIT_TILES, RELOAD_NEW = saved[0], saved[1]
        chain.set_chain(saved[2], saved[3] if saved[2] else None)
    return out


def check_all(timing: bool = True) -> list[dict]:
    """The device check of kernel "mla_attend_mma": both modes (check, check_uv), and where
    PRE_WAIT_TILES is on (`fused_device --patch`) the pre-wait tiles against a late writer
    (check_pre_wait): an off switch that has not yet run on a device must not fail the
    default kernel's check."""
    return check(timing=timing) + check_uv(timing=timing) + (check_pre_wait() if PRE_WAIT_TILES else [])


if __name__ == "__main__":
    from kimi_decode.kernels.checks import _print
    _print(check_all())
