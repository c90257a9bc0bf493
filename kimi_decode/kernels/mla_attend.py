"""Absorbed MLA decode attention in one launch (replaces the stock op `mla_decode`,
stock_ops.mla_attend: bmm, mask, softmax, cast, bmm = 5 kernels under torch.compile).

Per sequence b, query row r = t·H + h (R = T·H rows, all heads share the latent cache),
cache row j (576 = c + rope bf16 values), scale = (nope + rope)^-½:
    s[r, j]  = bf16( Σ_d q[b, r, d] · cache[b, j, d] ) · scale        fp32 accumulation, then
                                                                       rounded to bf16 (as the
                                                                       stock bf16 bmm), × scale in fp32
    valid    = j ≤ last[t]                                             last: int64 [T] on the GPU
    p[r, j]  = exp(s − max) / Σ exp(s − max)   over valid j            fp32
    o[b, r]  = bf16( Σ_j p[r, j] · cache[b, j, :c] )                   fp32 accumulation
Rounding difference to stock: stock rounds the normalised p to bf16 before its second bmm;
a flash (online-softmax) kernel never holds the normalised p, so this kernel keeps the
unnormalised exp(s − m) in fp32 and divides the fp32 sum once at the end (more accurate than
stock: it drops stock's bf16 rounding of p, ~2⁻⁹ relative per probability). The scores are
rounded at the same point as stock, so the masks and maxima agree.

Layout: grid (splits, B), 256 threads. Split s owns `tiles_per_split` tiles of TILE = 32 cache
positions; positions past min(C, max_t last[t] + 1) are never read (a tile's tail rows clamp
their loads to the last valid row and are masked). Per CTA:
  - q[b] (R × 576 bf16) is converted once to fp32 into shared memory, split in two planes of 4
    values so that a warp's 128-bit reads of 8 consecutive vectors are conflict-free;
  - per tile: the 32 × 576 cache rows are read from HBM with 128-bit loads (9 per thread) into
    registers one tile ahead (software pipeline: the next tile's loads fly during this tile's
    math; for R > 24 the registers go to the accumulators and the tile loads just before its
    math) and stored to shared memory; every cache row is read once per CTA for all R rows;
  - scores: thread (token j = tid / 8, dim group g = tid % 8) dots vectors g, g+8, ... (9 of
    72) with all R query rows (R fp32 accumulators), a 3-step shuffle sums the 8 groups;
  - online softmax: warp w owns rows w, w+8, ...; lane = token; running max m and sum l in
    registers; p and the rescale factor α go to shared memory;
  - P·V: thread tid owns latent columns 2·tid, 2·tid+1 for all R rows (2R fp32 registers),
    reads p as 4-token vectors (broadcast) and V pairs (conflict-free);
  - the partial (m, l, o unnormalised fp32) goes to the scratch buffer.
Combine without a second launch, in two levels of the grid-completion counter of router.py:
splits are grouped `group` at a time; the last CTA of a group to finish (atomic counter,
acq_rel at GPU scope) merges the group's partials (M = max m, L = Σ l·e^{m−M},
O = Σ o·e^{m−M}); with one group it writes o_lat = bf16(O / L), otherwise it writes a group
partial and bumps the per-sequence counter, and the last group merges the group partials.
Each merging CTA resets the counter it won to 0 (CUDA-graph replays find zeros). Two levels
keep every merge small (≤ 16 partials of R × 2 KB, read from L2 with 128-bit loads, all 16
in flight) while ~130 CTAs stream the cache at B = 1.

Why it should reach ≲ 6 µs at B = 1, k = 0 (C = 4160, R = 6): 130 CTAs each read one 36 KB
tile (4.8 MB in all: 1.3 µs at HBM rate, about one load latency per CTA, overlapped with the
q load), do ~1.3 µs of fp32 math (110 K MACs for scores and 98 K for P·V per tile on 256
threads: ~1.2 K instructions per thread), then two merges of ≤ 12 partials × 12 KB from L2
(~0.8 µs each): ~5-6 µs with the launch. Large B·T is compute-bound on CUDA cores (no tensor
cores here): R = 48 does 8× the math per tile (~8 µs per tile), so B = 64, k = 7 is several
times slower than stock's tensor-core bmm; see `profitable`. The split plan is host-side
(`make_scratch(..., sms=n)`), so it can be tuned from device timings without recompiling.
Compile time on one CPU core: ~5 s for T = 1, ~35-80 s for T = 8 (R = 48 unrolls far more).

uv mode (kernel name `mla_attend_uv`, MLAConfig.uv_rows = M = B·T > 0; `mla_attend_uv`):
the same launch also does kernels/mla_glue.py's `uv_gate` on the o_lat it writes,
    o[m, h·vd + j] = gated( Σ_k o_lat[m·H + h, k] · w_uv[h, k, j], g[m, h·vd + j] )
with mla_glue's own code (MLAGlue.load_w / gemm_tile, then `gated`: bf16(o_lat) as written
above, the bmm's bf16 rounding, the bf16 sigmoid, the bf16 multiply), so o equals
uv_gate(o_lat, w_uv, g) bit for bit and has the stock rounding points of uv_bmm + gate_mul.
Why not "the combining CTA applies W_UV": one CTA merges all R = 6 rows of a sequence (the
last group to finish), and all heads' W_UV is 768 KB: one SM streams ~100-150 GB/s
(Little: ~64 KB in flight / ~0.6 µs latency), i.e. 5-8 µs, more than the launch it removes.
So the W_UV work keeps uv_gate's 48 tiles (one per head h and 16-column tile: 16 KB of
weight, 4 128-bit loads per thread) and gives them to the grid's first NW = H·vd/16 = 48
CTAs (linear index b·splits + s < NW, "workers"): after writing its split partial (before the
group counter), a worker issues its tile's weight loads and its g value, does any merge it
wins, then thread 0 spins (ld.acquire.gpu) on a ready counter that each sequence's final
merge bumps after its o_lat is written (fence, barrier, acq_rel atomic: the pattern of the
merge counters); once all B sequences are ready the worker stages o_lat (B·T·H × c bf16,
from L2) and runs the uv tile. The last worker to pass the wait (a second counter) re-zeroes
both, so replays find zeros. Deadlock freedom: a worker waits only for CTAs that never wait
(non-workers and merges), and workers hold at most NW < SMs slots, so every other CTA finds
a free SM (at B = 1: 130 CTAs ≤ 132 SMs, one CTA per SM at 158 registers, all resident).
Registers stay 158 (ptxas, CPU test), no spills; shared memory + 2.5 KB (s_x, red).
Expected at B = 1, k = 0: the attention part unchanged (its code and plan are the same); the
uv part after the final merge costs a flag round trip (~1 µs: release atomic + acquire poll
through L2), o_lat staging from L2 (~0.5 µs, 2 loads per thread) and the tile's 192 FMAs, 192
shuffles and one barrier per thread (~0.3 µs): ~1.5-2 µs added to mla_attend, against
uv_gate's 2.4 µs (graph replays, bench/fused_correctness.md) + the launch gap between the
two kernels in the step (~1 µs): ~1-2 µs saved per MLA layer and one launch fewer. An
expectation until the device check (check_uv) times both.
Measured (H200, check_uv at 801b1da, bench/fused_correctness.md; cold): 22.0 µs vs 19.7 µs
for mla_attend + uv_gate (stock 19.9), i.e. the expectation above was wrong: the uv part
costs ~5.8 µs after the attention instead of ~1.5-2 (o and o_lat bit-equal to the two
launches, counters zero after replays). Other merge group sizes (group 9, 16): 22.0 / 22.4 µs.
In the B = 1 step the MLA layer takes 113.8 µs with it, 111.2 µs without (bench/fused_runs.md). It stays in use at B = 1 for
the kernel count (fused.MAX_ROWS notes); where the extra time goes is not yet known.

Grid merge (MLAConfig.grid; the default where grid_ok allows it: B = 1, k = 0). A probe of
the CTAs' phases (MLAConfig.probe, bench/mla_phases.py; bench/fused_runs.md) showed where the
16-17 µs went: the two merges took 5.6 + 3.4 µs, each run by one CTA reading ~140 KB of
partials from L2, after 6.6 µs of attention. In the grid merge every CTA, once its partial is
written, arrives on a per-sequence barrier (sense reversal: thread 0 reads the sequence's
epoch, arrives on a counter; the last to arrive re-zeroes it and bumps the epoch, the others
poll the epoch), then merges latent column quads s, s + splits, ... of all R rows, one partial
per thread, reduced across the CTA: each SM reads 1/splits of the partial bytes. It needs
every CTA of the launch resident at once (B·splits ≤ SMs at one CTA per SM; a CTA waits only
after writing its partial, so the others never need it) and enough splits to share the work
(≥ GRID_MIN_SPLITS). Measured (H200, 9f04320, cold): 11.6 µs vs 16.8 with the two-level merge
(stock's compiled op 13.7), uv mode 16.0 vs 22.3; o_lat bit-equal to the two-level merge at
this shape; the barrier takes 2.2 µs and the merge 2.7 of the remaining 10.8.

Check on the GPU (against stock_ops.mla_attend, eager and torch.compile'd; times both):
    python -m kimi_decode.kernels.mla_attend
    python -m kimi_decode.kernels.mla_attend uv     (mla_attend_uv: check_uv)
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

from kimi_decode.kernels import chain
from kimi_decode.kernels._common import (H200_SMS, compile_options, compiled, current_stream, dummy_ptr,
                                         grid_arrive_and_wait, ptr, sm_count)
from kimi_decode.kernels.mla_glue import UV_COLS, MLAGlue, can_implement_uv as glue_can_uv, config_uv, gated

TILE = 32        # cache positions per tile (one per lane in the softmax)
THREADS = 256
WARPS = THREADS // 32
VEC = 8          # bf16 per 128-bit load
DG = 8           # dim groups per token in the score phase (threads per token)
GMAX = 16        # most partials one merge reads (splits per group, groups per sequence)
MAX_ROWS = 48    # R = T·H: registers (2R accumulators for P·V, R for the scores)
PREFETCH_MAX_ROWS = 24
NEG = -1.0e30    # "minus infinity" that keeps exp(NEG - NEG) finite
VALID = -1.0e29  # a score above this is a real (unmasked) score
SMS = H200_SMS
# Phase probe (MLAConfig.probe): thread 0 of every CTA stamps %globaltimer at these points and
# writes them to probe[b·splits + s, :] at its end (0 = not reached, e.g. merges it lost).
# Each stamp after a barrier, so it marks the whole CTA's progress, not thread 0's.
# Grid merge: "counter" is the sequence barrier passed, "merge" the CTA's share of the merge.
PROBE_PHASES = ("entry", "waited", "tile_in_smem", "scores", "softmax", "pv", "partial_written",
                "counter", "merge", "counter2", "merge2", "end")
GRID_MAX_ROWS = 8  # grid merge: a thread holds one partial's R rows (R m, l and 4R o values)
GRID_MIN_SPLITS = 32  # grid merge: each CTA merges ≤ c / 4 / 32 = 4 column quads (a CTA-wide
                      # reduction each); with few splits the two-level merge is short anyway


class AttendShape:
    """Sizes derived from an attention config's fields (heads, tokens, kv_rank, rope,
    uv_rows): this module's MLAConfig and mla_attend_mma.MMAConfig."""

    @property
    def uv(self) -> bool:
        return self.uv_rows > 0

    @property
    def rows(self) -> int:
        return self.heads * self.tokens

    @property
    def dim(self) -> int:
        return self.kv_rank + self.rope


@dataclass(frozen=True)
class MLAConfig(AttendShape):
    """Compile-time sizes: local heads H, tokens per sequence T, latent rank c, rope dims."""

    heads: int
    tokens: int
    kv_rank: int = 512
    rope: int = 64
    scale: float = 192 ** -0.5
    uv_rows: int = 0          # uv mode (mla_attend_uv): M = B·T rows of o; 0 = o_lat only
    v_dim: int = 128          # uv mode: W_UV's columns per head
    probe: bool = False       # phase probe (bench/mla_phases.py): %globaltimer stamps per CTA
    grid: bool = False        # one-level merge by all CTAs after a per-sequence barrier (grid_ok)


def can_implement(heads: int, tokens: int, kv_rank: int, rope: int,
                  dtypes: tuple[torch.dtype, ...]) -> bool:
    """c = 512 (2 latent columns per thread), c + rope a multiple of 64 (8 dim groups × 8),
    R = T·H ≤ 48 (register budget), bf16 operands."""
    d = kv_rank + rope
    return (kv_rank == 2 * THREADS and d % (DG * VEC) == 0 and (d // VEC) * TILE % THREADS == 0
            and 1 <= heads * tokens <= MAX_ROWS and all(dt == torch.bfloat16 for dt in dtypes))


def grid_ok(batch: int, rows: int, splits: int, sms: int = SMS) -> bool:
    """Where the grid merge (MLAConfig.grid) may run: R ≤ GRID_MAX_ROWS (a thread holds a
    partial's rows), one partial per thread (splits ≤ THREADS), and every CTA resident at
    once (B·splits ≤ SMs at one CTA per SM: 158 registers × 256 threads), since each waits
    for its sequence's other CTAs; a CTA waits only after its own partial is written, so
    the others need nothing from it and, once resident, finish. And splits ≥ GRID_MIN_SPLITS:
    each CTA reduces c / 4 / splits column quads one after the other."""
    return (rows <= GRID_MAX_ROWS and GRID_MIN_SPLITS <= splits <= THREADS and batch * splits <= sms)


def profitable(batch: int, tokens: int, heads: int) -> bool:
    """Where the kernel is expected to beat the stock op (tensor-core bmm): few query rows in
    all. An estimate until the device check's timings say otherwise."""
    return batch * tokens * heads <= 48


@dataclass
class MLAScratch:
    """Persistent partial buffers and counters for one (B, R, C, c); the caller keeps it."""

    batch: int
    rows: int
    cache_len: int
    kv_rank: int
    splits: int
    group: int
    groups: int
    tiles_per_split: int
    part_o: torch.Tensor      # [B·S, R, c] fp32
    part_ml: torch.Tensor     # [B·S, 2, R] fp32 (m, l)
    grp_o: torch.Tensor       # [B·G, R, c] fp32
    grp_ml: torch.Tensor      # [B·G, 2, R] fp32
    counters: torch.Tensor    # [B·G + B + 2] int32, zero between calls (the last two: uv mode)
    epochs: torch.Tensor      # [B] int32 right after `counters` (one buffer): the grid merge's
                              # barrier generations, bumped once per call (never re-zeroed)


def plan(batch: int, cache_len: int, sms: int = SMS, group: int | None = None) -> tuple[int, int, int, int]:
    """(splits, group, groups, tiles_per_split): about `sms` CTAs in all, whole tiles per
    split, group ≈ √splits (or the `group` asked for, raised until groups ≤ GMAX) so both
    merge levels read ≤ GMAX partials."""
    n_tiles = (cache_len + TILE - 1) // TILE
    target = max(1, min(n_tiles, sms // batch))
    tps = (n_tiles + target - 1) // target
    splits = (n_tiles + tps - 1) // tps
    group = min(GMAX, max(1, math.ceil(math.sqrt(splits)) if group is None else group))
    groups = (splits + group - 1) // group
    while groups > GMAX:          # not reached for splits ≤ 256
        group += 1
        groups = (splits + group - 1) // group
    return splits, group, groups, tps


def make_scratch(batch: int, rows: int, cache_len: int, kv_rank: int,
                 device: torch.device | str, sms: int = SMS, group: int | None = None) -> MLAScratch:
    splits, group, groups, tps = plan(batch, cache_len, sms, group)
    f32 = dict(dtype=torch.float32, device=device)
    n_cnt = batch * groups + batch + 2
    sync = torch.zeros(n_cnt + batch, dtype=torch.int32, device=device)
    return MLAScratch(
        batch, rows, cache_len, kv_rank, splits, group, groups, tps,
        part_o=torch.empty(batch * splits, rows, kv_rank, **f32),
        part_ml=torch.empty(batch * splits, 2, rows, **f32),
        grp_o=torch.empty(batch * groups, rows, kv_rank, **f32),
        grp_ml=torch.empty(batch * groups, 2, rows, **f32),
        counters=sync[:n_cnt], epochs=sync[n_cnt:])


class UVTiles:
    """The uv mode's worker tiles (module docstring, "uv mode"): mla_glue's uv_gate tiles run
    by the first NW CTAs of an attention launch once every CTA has published its o_lat. Shared
    by MLAAttend and mla_attend_mma.MLAAttendMMA (their kernels call these in the same places:
    views, shared memory, the early loads before their merge, publish and the tile after it)."""

    def init_uv(self, uv_rows: int, heads: int, kv_rank: int, v_dim: int) -> None:
        self.glue = MLAGlue(config_uv(uv_rows, heads, kv_rank, v_dim))
        self.UM, self.VD = uv_rows, v_dim
        self.CT = v_dim // UV_COLS                    # column tiles per head
        self.NW = heads * self.CT                     # worker CTAs (tiles of W_UV)

    @cute.jit
    def uv_views(self, out: cute.Pointer, w_uv: cute.Pointer, g: cute.Pointer, o_uv: cute.Pointer):
        """(mX, mW, mG, mU): o_lat [M, H, c] as 128-bit vectors, W_UV [H, c, vd], g and o [M, H·vd]."""
        M, H, N, C = self.UM, self.H, self.VD, self.C
        mX = cute.make_tensor(out, cute.make_layout((M, H, C // VEC, VEC), stride=(H * C, C, VEC, 1)))
        mW = cute.make_tensor(w_uv, cute.make_layout((H, C, N // VEC, VEC), stride=(C * N, N, VEC, 1)))
        mG = cute.make_tensor(g, cute.make_layout((M, H * N), stride=(H * N, 1)))
        mU = cute.make_tensor(o_uv, cute.make_layout((M, H * N), stride=(H * N, 1)))
        return mX, mW, mG, mU

    def uv_smem(self, smem: object) -> tuple:
        """mla_glue.gemm_tile's staging (M × c fp32) and warp sums, in the kernel's shared memory."""
        s_x = smem.allocate_tensor(Float32, cute.make_layout((self.UM, self.C), stride=(self.C, 1)),
                                   byte_alignment=16)
        red = smem.allocate_tensor(Float32, cute.make_layout((WARPS, self.UM, UV_COLS),
                                                             stride=(self.UM * UV_COLS, UV_COLS, 1)),
                                   byte_alignment=16)
        return s_x, red

    @cute.jit
    def uv_loads(self, mW: cute.Tensor, mG: cute.Tensor, wbuf: cute.Tensor, lin: Int32, tid: Int32,
                 warp: Int32, lane: Int32):
        """Worker CTA `lin` < NW owns W_UV tile (head wh, column tile wct): its weight loads
        into wbuf and its gate value, issued before the merge so they fly during it. Returns
        (wh, wct, gate)."""
        wh = Int32(0)
        wct = Int32(0)
        gate = Float32(0.0)
        if lin < self.NW:                   # CTA-uniform
            wh = lin // self.CT
            wct = lin - wh * self.CT
            self.glue.load_w(mW, wbuf, wh, wct, warp, lane)
            if tid < self.UM * UV_COLS:
                gm = tid // UV_COLS
                gate = mG[gm, wh * self.VD + wct * UV_COLS + (tid - gm * UV_COLS)].to(Float32)
        return wh, wct, gate

    @cute.jit
    def publish(self, mCnt: cute.Tensor, rdy: Int32, tid: Int32):
        """This sequence's o_lat, written by every thread of the CTA, is visible GPU-wide
        before the ready counter mCnt[rdy] is bumped (as the merge counters are)."""
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        if tid == 0:
            cute.arch.fence_acq_rel_gpu()
            cute.arch.atomic_add(mCnt.iterator + rdy, Int32(1), sem="acq_rel", scope="gpu")

    @cute.jit
    def uv_tile(self, mCnt: cute.Tensor, mX: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor,
                s_x: cute.Tensor, red: cute.Tensor, wbuf: cute.Tensor, rdy: Int32, batch: Int32,
                wh: Int32, wct: Int32, gate: Float32, tid: Int32, warp: Int32, lane: Int32):
        """Wait until all `batch` sequences published o_lat (thread 0 spins on mCnt[rdy] with
        acquire loads), then mla_glue's uv_gate tile (wh, wct) on it: o[m, n] =
        gated(Σ_k o_lat[m, wh, k] · w_uv[wh, k, n], g[m, n]) for the UV_COLS columns n of the
        tile; `wbuf` and `gate` were loaded before. The last worker to pass the wait (counter
        mCnt[rdy + 1]) re-zeroes both counters: every other worker has passed it by then."""
        if tid == 0:
            seen = Int32(0)
            while seen < batch:
                seen = cute.arch.load((mCnt.iterator + rdy).llvm_ptr, Int32, sem="acquire", scope="gpu")
            old = cute.arch.atomic_add(mCnt.iterator + (rdy + 1), Int32(1), sem="acq_rel", scope="gpu")
            if old == self.NW - 1:
                mCnt[rdy] = Int32(0)
                mCnt[rdy + 1] = Int32(0)
        cute.arch.sync_threads()
        cute.arch.fence_acq_rel_gpu()
        self.glue.gemm_tile(mX, mW, s_x, red, wh, wct, tid, warp, lane, wbuf)
        if tid < self.UM * UV_COLS:            # kernel_uv's epilogue: warp sums in warp order
            m = tid // UV_COLS
            col = tid - m * UV_COLS
            tot = Float32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                tot += red[w, m, col]
            mU[m, wh * self.VD + wct * UV_COLS + col] = gated(tot, gate)


class MLAAttend(UVTiles):
    """See the module docstring."""

    def __init__(self, cfg: MLAConfig) -> None:
        self.cfg = cfg
        self.H, self.T, self.R = cfg.heads, cfg.tokens, cfg.rows
        self.C, self.D = cfg.kv_rank, cfg.dim
        self.NV = self.D // VEC                       # 72 vectors per cache row
        self.VPT = self.NV // DG                      # 9 vectors per thread (scores)
        self.LPT = self.NV * TILE // THREADS          # 9 vectors per thread (tile load)
        self.RW = (self.R + WARPS - 1) // WARPS       # softmax rows per warp
        # Load the next tile during this tile's math (36 registers) unless R is large
        # (R = 48 needs its registers for the 2R + R accumulators).
        self.prefetch = self.R <= PREFETCH_MAX_ROWS
        if cfg.uv:     # mla_glue's uv_gate tile, run by the worker CTAs (module docstring)
            self.init_uv(cfg.uv_rows, self.H, self.C, cfg.v_dim)

    @cute.jit
    def __call__(self, q: cute.Pointer, cache: cute.Pointer, last: cute.Pointer, out: cute.Pointer,
                 part_o: cute.Pointer, part_ml: cute.Pointer, grp_o: cute.Pointer,
                 grp_ml: cute.Pointer, counters: cute.Pointer, w_uv: cute.Pointer, g: cute.Pointer,
                 o_uv: cute.Pointer, probe: cute.Pointer, batch: Int32, cache_len: Int32,
                 tiles_per_split: Int32, splits: Int32, group: Int32, groups: Int32,
                 stream: cuda.CUstream):
        """uv mode: w_uv [H, c, vd], g [M, H·vd], o_uv [M, H·vd] (bf16); otherwise unused.
        probe mode: probe [B·splits, len(PROBE_PHASES)] int64; otherwise unused."""
        R, D, C, NV = self.R, self.D, self.C, self.NV
        # Only the outermost modes are dynamic, so every 8-vector keeps its 16-byte alignment.
        mQ = cute.make_tensor(q, cute.make_layout((batch, R, NV, VEC), stride=(R * D, D, VEC, 1)))
        mK = cute.make_tensor(cache, cute.make_layout((batch * cache_len, NV, VEC), stride=(D, VEC, 1)))
        mL = cute.make_tensor(last, cute.make_layout(self.T))
        mO = cute.make_tensor(out, cute.make_layout((batch, R, C // 4, 4), stride=(R * C, C, 4, 1)))
        mPo2 = cute.make_tensor(part_o, cute.make_layout((batch * splits, R, C // 2, 2), stride=(R * C, C, 2, 1)))
        mPo4 = cute.make_tensor(part_o, cute.make_layout((batch * splits, R, C // 4, 4), stride=(R * C, C, 4, 1)))
        mPml = cute.make_tensor(part_ml, cute.make_layout((batch * splits, 2, R), stride=(2 * R, R, 1)))
        mGo4 = cute.make_tensor(grp_o, cute.make_layout((batch * groups, R, C // 4, 4), stride=(R * C, C, 4, 1)))
        mGml = cute.make_tensor(grp_ml, cute.make_layout((batch * groups, 2, R), stride=(2 * R, R, 1)))
        mCnt = cute.make_tensor(counters, cute.make_layout(batch * groups + 2 * batch + 2))   # + epochs
        if cutlass.const_expr(self.cfg.uv):
            mX, mW, mG, mU = self.uv_views(out, w_uv, g, o_uv)
        else:
            mX, mW, mG, mU = mO, mO, mO, mO
        mT = cute.make_tensor(probe, cute.make_layout((batch * splits, len(PROBE_PHASES)),
                                                      stride=(len(PROBE_PHASES), 1)))
        self.kernel(mQ, mK, mL, mO, mPo2, mPo4, mPml, mGo4, mGml, mCnt, mX, mW, mG, mU, mT, batch, cache_len,
                    tiles_per_split, splits, group, groups).launch(
            grid=[splits, batch, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=chain.chain_on())

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mL: cute.Tensor, mO: cute.Tensor,
               mPo2: cute.Tensor, mPo4: cute.Tensor, mPml: cute.Tensor, mGo4: cute.Tensor,
               mGml: cute.Tensor, mCnt: cute.Tensor, mX: cute.Tensor, mW: cute.Tensor, mG: cute.Tensor,
               mU: cute.Tensor, mT: cute.Tensor, batch: Int32, cache_len: Int32, tiles_per_split: Int32,
               splits: Int32, group: Int32, groups: Int32):
        R, D, NV, H = self.R, self.D, self.NV, self.H
        tid, _, _ = cute.arch.thread_idx()
        s, b, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()          # full-warp shuffle: here, outside every branch
        lane = cute.arch.lane_idx()
        stamps = cute.make_rmem_tensor(cute.make_layout(len(PROBE_PHASES)), cutlass.Int64)
        if cutlass.const_expr(self.cfg.probe):
            stamps.fill(0)
            stamps[0] = cute.arch.globaltimer()
        # PDL chain (kernels/chain.py): q and the cache row uk_insert wrote are read below
        chain.enter()
        self.stamp(stamps, 1, tid, False)

        smem = cutlass.memory.SmemAllocator()
        s_k = smem.allocate_tensor(BFloat16, cute.make_layout((TILE, NV, VEC), stride=(D, VEC, 1)),
                                   byte_alignment=16)
        s_q = smem.allocate_tensor(Float32, cute.make_layout((R, NV, 2, 4), stride=(NV * 4, 4, R * NV * 4, 1)),
                                   byte_alignment=16)
        s_p = smem.allocate_tensor(Float32, cute.make_layout((R, TILE), stride=(TILE, 1)), byte_alignment=16)
        s_a = smem.allocate_tensor(Float32, cute.make_layout(R), byte_alignment=16)
        s_flag = smem.allocate_tensor(Int32, cute.make_layout(2), byte_alignment=16)
        s_red = s_flag
        if cutlass.const_expr(self.cfg.grid):       # grid merge: per-warp sums of 4 o + l per row
            s_red = smem.allocate_tensor(Float32, cute.make_layout((WARPS, R, 5), stride=(R * 5, 5, 1)),
                                         byte_alignment=16)
        if cutlass.const_expr(self.cfg.uv):        # mla_glue.gemm_tile's staging and warp sums
            s_x, red = self.uv_smem(smem)
        s_k2 = cute.make_tensor(s_k.iterator, cute.make_layout((TILE, D // 2, 2), stride=(D, 2, 1)))
        s_p4 = cute.make_tensor(s_p.iterator, cute.make_layout((R, TILE // 4, 4), stride=(TILE, 4, 1)))

        # Positions this CTA reads: [t0, end), end ≤ max_t last[t] + 1 and ≤ C.
        lastv = cute.make_rmem_tensor(cute.make_layout(self.T), Int32)
        maxlast = Int32(-1)
        for t in cutlass.range_constexpr(self.T):
            lv = mL[t].to(Int32)
            lastv[t] = lv
            if lv > maxlast:
                maxlast = lv
        t0 = s * tiles_per_split * TILE
        end = t0 + tiles_per_split * TILE
        if end > cache_len:
            end = cache_len
        if end > maxlast + 1:
            end = maxlast + 1
        ntile = Int32(0)
        if end > t0:
            ntile = (end - t0 + TILE - 1) // TILE
        row0 = b * cache_len

        # Next tile's cache vectors, in registers (tail rows clamp to the last valid row).
        kbuf = cute.make_rmem_tensor(cute.make_layout((self.LPT, VEC), stride=(VEC, 1)), BFloat16)
        if cutlass.const_expr(self.prefetch):
            if ntile > 0:
                self.load_tile(mK, kbuf, row0, t0, end, tid)

        # q[b] -> fp32 shared memory, two planes of 4.
        qb = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
        for i in range(tid, R * NV, THREADS):
            r = i // NV
            v = i - r * NV
            cute.autovec_copy(mQ[b, r, v, None], qb)
            for e in cutlass.range_constexpr(4):
                s_q[r, v, 0, e] = qb[e].to(Float32)
                s_q[r, v, 1, e] = qb[4 + e].to(Float32)

        mreg = cute.make_rmem_tensor(cute.make_layout(self.RW), Float32)
        lreg = cute.make_rmem_tensor(cute.make_layout(self.RW), Float32)
        mreg.fill(NEG)
        lreg.fill(0.0)
        acc = cute.make_rmem_tensor(cute.make_layout((R, 2), stride=(2, 1)), Float32)
        acc.fill(0.0)
        sacc = cute.make_rmem_tensor(cute.make_layout(R), Float32)
        kv = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
        kf = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
        q0 = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        q1 = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        vb = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)
        vv = cute.make_rmem_tensor(cute.make_layout((4, 2), stride=(2, 1)), Float32)
        p4 = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        jt = tid // DG                     # score phase: token of this thread
        g = tid - jt * DG                  # and its dim group

        for it in range(ntile):
            tstart = t0 + it * TILE
            if cutlass.const_expr(not self.prefetch):
                self.load_tile(mK, kbuf, row0, tstart, end, tid)
            cute.arch.sync_threads()       # last tile's readers of s_k / s_p are done
            for i in cutlass.range_constexpr(self.LPT):
                idx = tid + i * THREADS
                j = idx // NV
                v = idx - j * NV
                cute.autovec_copy(kbuf[i, None], s_k[j, v, None])
            cute.arch.sync_threads()
            self.stamp(stamps, 2, tid, False)
            if cutlass.const_expr(self.prefetch):
                if it + 1 < ntile:
                    self.load_tile(mK, kbuf, row0, tstart + TILE, end, tid)

            # Scores: 8 threads per token, 9 vectors each, all R rows.
            sacc.fill(0.0)
            for i in cutlass.range_constexpr(self.VPT):
                v = g + i * DG
                cute.autovec_copy(s_k[jt, v, None], kv)
                for e in cutlass.range_constexpr(VEC):
                    kf[e] = kv[e].to(Float32)
                for r in cutlass.range_constexpr(R):
                    cute.autovec_copy(s_q[r, v, 0, None], q0)
                    cute.autovec_copy(s_q[r, v, 1, None], q1)
                    a = sacc[r]
                    for e in cutlass.range_constexpr(4):
                        a += kf[e] * q0[e]
                        a += kf[4 + e] * q1[e]
                    sacc[r] = a
            pos = tstart + jt
            for r in cutlass.range_constexpr(R):
                tot = cute.arch.warp_reduction_sum(sacc[r], threads_in_group=DG)
                sc = tot.to(BFloat16).to(Float32) * Float32(self.cfg.scale)
                if pos >= end:
                    sc = Float32(NEG)
                if pos > lastv[r // H]:
                    sc = Float32(NEG)
                if g == 0:
                    s_p[r, jt] = sc
            cute.arch.sync_threads()
            self.stamp(stamps, 3, tid, False)

            # Online softmax: warp w owns rows w, w + 8, ...; lane = token.
            # Warps past the last row compute on row R - 1 and store nothing, so the shuffles
            # never sit inside a branch.
            for i in cutlass.range_constexpr(self.RW):
                r = warp + i * WARPS
                rc = r
                if rc > R - 1:
                    rc = R - 1
                sv = s_p[rc, lane]
                mx = cute.arch.warp_reduction_max(sv)
                m_old = mreg[i]
                m_new = cute.arch.fmax(m_old, mx)
                alpha = cute.math.exp(m_old - m_new)
                p = Float32(0.0)
                if sv > Float32(VALID):
                    p = cute.math.exp(sv - m_new)
                ps = cute.arch.warp_reduction_sum(p)
                lreg[i] = lreg[i] * alpha + ps
                mreg[i] = m_new
                if r < R:                  # warp-uniform, no shuffles inside
                    s_p[r, lane] = p
                    if lane == 0:
                        s_a[r] = alpha
            cute.arch.sync_threads()
            self.stamp(stamps, 4, tid, False)

            # P·V: latent columns 2·tid, 2·tid + 1 for all rows.
            for r in cutlass.range_constexpr(R):
                al = s_a[r]
                acc[r, 0] = acc[r, 0] * al
                acc[r, 1] = acc[r, 1] * al
            for jq in cutlass.range_constexpr(TILE // 4):
                for u in cutlass.range_constexpr(4):
                    cute.autovec_copy(s_k2[jq * 4 + u, tid, None], vb)
                    vv[u, 0] = vb[0].to(Float32)
                    vv[u, 1] = vb[1].to(Float32)
                for r in cutlass.range_constexpr(R):
                    cute.autovec_copy(s_p4[r, jq, None], p4)
                    a0 = acc[r, 0]
                    a1 = acc[r, 1]
                    for u in cutlass.range_constexpr(4):
                        a0 += p4[u] * vv[u, 0]
                        a1 += p4[u] * vv[u, 1]
                    acc[r, 0] = a0
                    acc[r, 1] = a1

        self.stamp(stamps, 5, tid, True)
        # This split's partial (written even when it saw no valid position: m = NEG, l = 0, o = 0).
        srow = b * splits + s
        for i in cutlass.range_constexpr(self.RW):
            r = warp + i * WARPS
            if r < R:
                if lane == 0:
                    mPml[srow, 0, r] = mreg[i]
                    mPml[srow, 1, r] = lreg[i]
        ob = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        for r in cutlass.range_constexpr(R):
            ob[0] = acc[r, 0]
            ob[1] = acc[r, 1]
            cute.autovec_copy(ob, mPo2[srow, r, tid, None])
        if cutlass.const_expr(not self.cfg.grid):
            cute.arch.fence_acq_rel_gpu()   # this thread's partial before the counter bump

        # uv mode: worker CTA `lin` < NW owns W_UV tile (head wh, column tile wct); its weight
        # loads and its gate value are issued now, in flight during the merges and the wait.
        lin = b * splits + s
        wh = Int32(0)
        wct = Int32(0)
        gate = Float32(0.0)
        if cutlass.const_expr(self.cfg.uv):
            wbuf = cute.make_rmem_tensor(cute.make_layout((self.glue.P, VEC), stride=(VEC, 1)), BFloat16)
            wh, wct, gate = self.uv_loads(mW, mG, wbuf, lin, tid, warp, lane)

        if cutlass.const_expr(self.cfg.grid):
            self.grid_barrier_merge(mPml, mPo4, mO, mCnt, s_red, stamps, b, s, batch, splits, groups, tid,
                                    warp, lane)
            if cutlass.const_expr(self.cfg.uv):
                self.publish(mCnt, batch * groups + batch, tid)
        else:
            self.two_level_merge(mPml, mPo4, mO, mGml, mGo4, mCnt, s_flag, stamps, b, s, batch, splits,
                                 group, groups, tid)
        if cutlass.const_expr(self.cfg.uv):
            if lin < self.NW:                   # CTA-uniform
                target = batch
                if cutlass.const_expr(self.cfg.grid):
                    target = batch * splits     # every CTA publishes its share of o_lat
                self.uv_tile(mCnt, mX, mW, mU, s_x, red, wbuf, batch * groups + batch, target, wh, wct,
                             gate, tid, warp, lane)
        if cutlass.const_expr(self.cfg.probe):
            self.stamp(stamps, 11, tid, True)
            if tid == 0:
                for i in cutlass.range_constexpr(len(PROBE_PHASES)):
                    mT[lin, i] = stamps[i]

    @cute.jit
    def grid_barrier_merge(self, mPml: cute.Tensor, mPo4: cute.Tensor, mO: cute.Tensor, mCnt: cute.Tensor,
                           s_red: cute.Tensor, stamps: cute.Tensor, b: Int32, s: Int32, batch: Int32,
                           splits: Int32, groups: Int32, tid: Int32, warp: Int32, lane: Int32):
        """Grid merge (MLAConfig.grid; module docstring): wait until all `splits` CTAs of
        sequence b wrote their partials, then merge latent column quads s, s + splits, ... of
        all R rows: thread t holds partial t (t < splits ≤ THREADS), the CTA reduces over
        its threads. Every CTA reads its column quads of all partials: 1/splits of the
        sequence's partial bytes each, all loads of a thread (m, l and the first quad's o)
        in flight at once.
        The barrier (sense reversal, one atomic per CTA): thread 0 reads the sequence's epoch
        E = epochs[b] (acquire), fences, arrives on mCnt[b]; the last to arrive re-zeroes
        mCnt[b] and bumps the epoch (release), the others poll until it is no longer E. E is
        read before the arrival, and the epoch moves only once all have arrived, so no CTA
        can read the new epoch as its E; the epoch is never re-zeroed (counters stay zero
        between calls, CUDA-graph replays included)."""
        R = self.R
        cute.arch.sync_threads()
        self.stamp(stamps, 6, tid, False)
        if tid == 0:        # the last of the sequence's `splits` CTAs to arrive: all partials written
            grid_arrive_and_wait(mCnt, b, batch * groups + batch + 2 + b, splits)
        cute.arch.sync_threads()
        cute.arch.fence_acq_rel_gpu()
        self.stamp(stamps, 7, tid, False)

        prow = b * splits + tid
        mv = cute.make_rmem_tensor(cute.make_layout(R), Float32)
        lv = cute.make_rmem_tensor(cute.make_layout(R), Float32)
        ov = cute.make_rmem_tensor(cute.make_layout((R, 4), stride=(4, 1)), Float32)
        mv.fill(NEG)
        lv.fill(0.0)
        ov.fill(0.0)
        if tid < splits:
            for r in cutlass.range_constexpr(R):
                mv[r] = mPml[prow, 0, r]
                lv[r] = mPml[prow, 1, r]
            if s < self.C // 4:                 # the first column quad's loads fly with m, l
                for r in cutlass.range_constexpr(R):
                    cute.autovec_copy(mPo4[prow, r, s, None], ov[r, None])
        # Row maxima over the splits: warp, then across warps.
        for r in cutlass.range_constexpr(R):
            wmax = cute.arch.warp_reduction_max(mv[r])
            if lane == 0:
                s_red[warp, r, 0] = wmax
        cute.arch.sync_threads()
        wgt = cute.make_rmem_tensor(cute.make_layout(R), Float32)
        for r in cutlass.range_constexpr(R):
            big = s_red[0, r, 0]
            for w in cutlass.range_constexpr(1, WARPS):
                big = cute.arch.fmax(big, s_red[w, r, 0])
            wgt[r] = Float32(0.0)
            if mv[r] > Float32(VALID):
                wgt[r] = cute.math.exp(mv[r] - big)
        for cq in range(s, self.C // 4, splits):
            cute.arch.sync_threads()            # s_red free (maxima read / last quad written)
            if cq != s:
                ov.fill(0.0)
                if tid < splits:
                    for r in cutlass.range_constexpr(R):
                        cute.autovec_copy(mPo4[prow, r, cq, None], ov[r, None])
            for r in cutlass.range_constexpr(R):
                for e in cutlass.range_constexpr(4):
                    part = cute.arch.warp_reduction_sum(ov[r, e] * wgt[r])
                    if lane == 0:
                        s_red[warp, r, e] = part
                lsum = cute.arch.warp_reduction_sum(lv[r] * wgt[r])
                if lane == 0:
                    s_red[warp, r, 4] = lsum
            cute.arch.sync_threads()
            if tid < R * 4:
                r = tid // 4
                e = tid - r * 4
                o = Float32(0.0)
                tot = Float32(0.0)
                for w in cutlass.range_constexpr(WARPS):
                    o += s_red[w, r, e]
                    tot += s_red[w, r, 4]
                inv = Float32(0.0)
                if tot > Float32(0.0):
                    inv = Float32(1.0) / tot
                mO[b, r, cq, e] = (o * inv).to(BFloat16)
        self.stamp(stamps, 8, tid, True)

    @cute.jit
    def two_level_merge(self, mPml: cute.Tensor, mPo4: cute.Tensor, mO: cute.Tensor, mGml: cute.Tensor,
                        mGo4: cute.Tensor, mCnt: cute.Tensor, s_flag: cute.Tensor, stamps: cute.Tensor,
                        b: Int32, s: Int32, batch: Int32, splits: Int32, group: Int32, groups: Int32,
                        tid: Int32):
        """The two-level merge of the module docstring (groups of `group` splits, then the
        groups); in uv mode the sequence's final merge publishes o_lat."""
        grp = s // group
        gbase = grp * group
        count = splits - gbase
        if count > group:
            count = group
        cute.arch.sync_threads()
        self.stamp(stamps, 6, tid, False)
        if tid == 0:
            cute.arch.fence_acq_rel_gpu()
            old = cute.arch.atomic_add(mCnt.iterator + (b * groups + grp), Int32(1), sem="acq_rel", scope="gpu")
            s_flag[0] = old
        cute.arch.sync_threads()
        self.stamp(stamps, 7, tid, False)
        if s_flag[0] == count - 1:          # CTA-uniform: the group's last CTA
            cute.arch.fence_acq_rel_gpu()
            if groups == 1:
                self.merge(mPml, mPo4, b * splits + gbase, count, mO, mGml, mGo4, b, 0, True, tid)
                self.stamp(stamps, 8, tid, True)
                if cutlass.const_expr(self.cfg.uv):
                    self.publish(mCnt, batch * groups + batch, tid)
            else:
                self.merge(mPml, mPo4, b * splits + gbase, count, mO, mGml, mGo4, b, b * groups + grp,
                           False, tid)
                cute.arch.fence_acq_rel_gpu()
                cute.arch.sync_threads()
                self.stamp(stamps, 8, tid, False)
                if tid == 0:
                    mCnt[b * groups + grp] = Int32(0)
                    cute.arch.fence_acq_rel_gpu()
                    old2 = cute.arch.atomic_add(mCnt.iterator + (batch * groups + b), Int32(1),
                                                sem="acq_rel", scope="gpu")
                    s_flag[1] = old2
                cute.arch.sync_threads()
                self.stamp(stamps, 9, tid, False)
                if s_flag[1] == groups - 1:  # the sequence's last group
                    cute.arch.fence_acq_rel_gpu()
                    self.merge(mGml, mGo4, b * groups, groups, mO, mGml, mGo4, b, 0, True, tid)
                    self.stamp(stamps, 10, tid, True)
                    if tid == 0:
                        mCnt[batch * groups + b] = Int32(0)
                    if cutlass.const_expr(self.cfg.uv):
                        self.publish(mCnt, batch * groups + batch, tid)
            if groups == 1:
                if tid == 0:
                    mCnt[b * groups + grp] = Int32(0)

    @cute.jit
    def stamp(self, stamps: cute.Tensor, i: cutlass.Constexpr[int], tid: Int32,
              barrier: cutlass.Constexpr[bool]):
        """Probe mode: thread 0 records %globaltimer as phase i (after a CTA barrier when
        `barrier`; the other call sites stand right after one). Nothing otherwise."""
        if cutlass.const_expr(self.cfg.probe):
            if cutlass.const_expr(barrier):
                cute.arch.sync_threads()
            if tid == 0:
                stamps[i] = cute.arch.globaltimer()

    @cute.jit
    def load_tile(self, mK: cute.Tensor, kbuf: cute.Tensor, row0: Int32, tstart: Int32, end: Int32,
                  tid: Int32):
        """kbuf[i] = cache vector (j, v) of the tile at tstart, idx = tid + i·THREADS = j·72 + v;
        rows at or past `end` read row end − 1 instead (masked later, never garbage)."""
        for i in cutlass.range_constexpr(self.LPT):
            idx = tid + i * THREADS
            j = idx // self.NV
            v = idx - j * self.NV
            pos = tstart + j
            if pos > end - 1:
                pos = end - 1
            cute.autovec_copy(mK[row0 + pos, v, None], kbuf[i, None])

    @cute.jit
    def merge(self, mSml: cute.Tensor, mSo4: cute.Tensor, base: Int32, count: Int32, mO: cute.Tensor,
              mDml: cute.Tensor, mDo4: cute.Tensor, b: Int32, dst: Int32, final: cutlass.Constexpr[bool],
              tid: Int32):
        """Merge partials base .. base + count − 1 (count ≤ GMAX): thread owns 4 latent columns
        (tid mod 128) of every other row (tid div 128); all loads of a row are in flight at once."""
        c4 = tid % (THREADS // 2)
        half = tid // (THREADS // 2)
        mv = cute.make_rmem_tensor(cute.make_layout(GMAX), Float32)
        lv = cute.make_rmem_tensor(cute.make_layout(GMAX), Float32)
        ov = cute.make_rmem_tensor(cute.make_layout((GMAX, 4), stride=(4, 1)), Float32)
        o = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        ob = cute.make_rmem_tensor(cute.make_layout(4), BFloat16)
        for rp in range((self.R + 1) // 2):
            r = rp * 2 + half
            if r < self.R:                      # warp-uniform (warps 0-3 vs 4-7)
                for i in cutlass.range_constexpr(GMAX):
                    mv[i] = Float32(NEG)
                    lv[i] = Float32(0.0)
                    if i < count:
                        mv[i] = mSml[base + i, 0, r]
                        lv[i] = mSml[base + i, 1, r]
                        cute.autovec_copy(mSo4[base + i, r, c4, None], ov[i, None])
                    else:
                        for e in cutlass.range_constexpr(4):
                            ov[i, e] = Float32(0.0)
                big = mv[0]
                for i in cutlass.range_constexpr(1, GMAX):
                    big = cute.arch.fmax(big, mv[i])
                tot = Float32(0.0)
                o.fill(0.0)
                for i in cutlass.range_constexpr(GMAX):
                    w = cute.math.exp(mv[i] - big)
                    tot += lv[i] * w
                    for e in cutlass.range_constexpr(4):
                        o[e] = o[e] + ov[i, e] * w
                if cutlass.const_expr(final):
                    inv = Float32(0.0)
                    if tot > Float32(0.0):
                        inv = Float32(1.0) / tot
                    for e in cutlass.range_constexpr(4):
                        ob[e] = (o[e] * inv).to(BFloat16)
                    cute.autovec_copy(ob, mO[b, r, c4, None])
                else:
                    cute.autovec_copy(o, mDo4[dst, r, c4, None])
                    if c4 == 0:
                        mDml[dst, 0, r] = big
                        mDml[dst, 1, r] = tot


def compile_for(cfg: MLAConfig) -> object:
    """The compiled kernel for `cfg` (cached)."""
    def build() -> object:
        bf, f32 = dummy_ptr(torch.bfloat16), dummy_ptr(torch.float32)
        i32, i64 = dummy_ptr(torch.int32), dummy_ptr(torch.int64)
        return cute.compile(MLAAttend(cfg), bf, bf, i64, bf, f32, f32, f32, f32, i32, bf, bf, bf, i64, Int32(1),
                            Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), current_stream(),
                            options=compile_options())
    return compiled(("mla_attend", cfg), build)


def attend_shapes(name: str, q_full: torch.Tensor, cache: torch.Tensor, last: torch.Tensor, heads: int,
                  kv_rank: int, can: object) -> tuple[int, int, int, int, int]:
    """(B, R, D, C, T) of an attention call, after the wrappers' shape rules (this module's and
    mla_attend_mma's): q_full [B, T·H, D], cache [B, C, D], last int64 [T], and the kernel's
    `can(heads, T, c, rope, dtypes)`; a ValueError naming `name` otherwise."""
    B, R, D = q_full.shape
    C, T = cache.shape[1], last.shape[0]
    if (tuple(cache.shape) != (B, C, D) or R != T * heads or last.dtype != torch.int64
            or not can(heads, T, kv_rank, D - kv_rank, (q_full.dtype, cache.dtype))):
        raise ValueError(f"{name} cannot run q {tuple(q_full.shape)} cache {tuple(cache.shape)}")
    return B, R, D, C, T


def mla_attend(q_full: torch.Tensor, cache: torch.Tensor, last: torch.Tensor, heads: int,
               kv_rank: int, scale: float, scratch: MLAScratch | None = None,
               probe: torch.Tensor | None = None, grid: bool | None = None) -> torch.Tensor:
    """Launch on the current stream. q_full [B, T·H, c + rope] bf16, cache [B, C, c + rope]
    bf16, last [T] int64 (on the GPU; read by the kernel), scratch from make_scratch (the
    caller keeps it across calls; its counters stay zeroed between calls). Returns o_lat
    [B, T·H, c] bf16. `probe` (int64 [B·splits, len(PROBE_PHASES)]): run the probe build,
    which stamps each CTA's phases there (bench/mla_phases.py). `grid`: the grid merge
    (None: wherever grid_ok allows it)."""
    B, R, D, C, T = attend_shapes("mla_attend kernel", q_full, cache, last, heads, kv_rank, can_implement)
    if scratch is None:
        scratch = make_scratch(B, R, C, kv_rank, q_full.device)
    if (scratch.batch, scratch.rows, scratch.cache_len, scratch.kv_rank) != (B, R, C, kv_rank):
        raise ValueError("mla_attend: scratch was made for other shapes")
    if grid is None:
        grid = grid_ok(B, R, scratch.splits, sm_count(q_full.device))
    elif grid and not grid_ok(B, R, scratch.splits, sm_count(q_full.device)):
        raise ValueError(f"mla_attend: grid merge cannot run B={B} R={R} splits={scratch.splits}")
    cfg = MLAConfig(heads, T, kv_rank, D - kv_rank, float(scale), probe=probe is not None, grid=grid)
    out = torch.empty(B, R, kv_rank, dtype=torch.bfloat16, device=q_full.device)
    sc = scratch
    o = ptr(out)       # w_uv, g, o_uv: unused without the uv mode
    pr = ptr(probe) if probe is not None else dummy_ptr(torch.int64)
    compile_for(cfg)(ptr(q_full), ptr(cache), ptr(last), o, ptr(sc.part_o), ptr(sc.part_ml),
                     ptr(sc.grp_o), ptr(sc.grp_ml), ptr(sc.counters), o, o, o, pr, Int32(B), Int32(C),
                     Int32(sc.tiles_per_split), Int32(sc.splits), Int32(sc.group), Int32(sc.groups),
                     current_stream())
    return out


def uv_workers(heads: int, v_dim: int) -> int:
    """Worker CTAs of the uv mode: one per mla_glue uv_gate tile (UV_COLS columns of a head)."""
    return heads * (v_dim // UV_COLS)


def uv_launch_ok(batch: int, heads: int, tokens: int, kv_rank: int, v_dim: int, splits: int,
                 dtypes: tuple[torch.dtype, ...], sms: int = SMS) -> bool:
    """The uv mode's own rules (this kernel's and mla_attend_mma's, which share its code):
    mla_glue's uv_gate rules at M = B·T (M·UV_COLS ≤ THREADS: one epilogue value per thread),
    one worker per uv tile among the B·splits CTAs, and fewer workers than SMs (the workers
    wait for CTAs that may not have started: those must find a free SM; module docstring)."""
    m = batch * tokens
    nw = uv_workers(heads, v_dim) if v_dim % UV_COLS == 0 else 0
    return (glue_can_uv(m, heads, kv_rank, v_dim, dtypes) and m * UV_COLS <= THREADS
            and 1 <= nw <= batch * splits and nw < sms)


def uv_shapes_ok(q_full: torch.Tensor, cache: torch.Tensor, last: torch.Tensor, heads: int, kv_rank: int,
                 w_uv: torch.Tensor, g: torch.Tensor, scratch: object) -> bool:
    """The uv wrappers' shape rules (this module's and mla_attend_mma's): q_full [B, T·H, D],
    cache [B, C, D], last int64 [T], w_uv [H, c, vd], g [B·T, H·vd], and a scratch made for
    (B, T·H, C, c)."""
    B, R, D = q_full.shape
    C, T = cache.shape[1], last.shape[0]
    H, c, vd = w_uv.shape
    sc = scratch
    return (tuple(cache.shape) == (B, C, D) and R == T * heads and H == heads and c == kv_rank
            and last.dtype == torch.int64 and tuple(g.shape) == (B * T, H * vd)
            and (sc.batch, sc.rows, sc.cache_len, sc.kv_rank) == (B, R, C, kv_rank))


def can_implement_uv(batch: int, heads: int, tokens: int, kv_rank: int, rope: int, v_dim: int,
                     splits: int, dtypes: tuple[torch.dtype, ...], sms: int = SMS) -> bool:
    """uv mode: the attention's rules and uv_launch_ok's."""
    return (can_implement(heads, tokens, kv_rank, rope, dtypes)
            and uv_launch_ok(batch, heads, tokens, kv_rank, v_dim, splits, dtypes, sms))


def mla_attend_uv(q_full: torch.Tensor, cache: torch.Tensor, last: torch.Tensor, heads: int,
                  kv_rank: int, scale: float, w_uv: torch.Tensor, g: torch.Tensor,
                  scratch: MLAScratch, probe: torch.Tensor | None = None,
                  grid: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """mla_attend, then mla_glue.uv_gate on its o_lat, in one launch (uv mode, module
    docstring). w_uv [H, c, vd], g [M, H·vd] bf16 (M = B·T). Returns (o [M, H·vd], o_lat
    [B, T·H, c]) bf16; o equals mla_glue.uv_gate(o_lat, w_uv, g) bit for bit by design."""
    B, R, D = q_full.shape
    C = cache.shape[1]
    T = last.shape[0]
    H, c, vd = w_uv.shape
    M = B * T
    sc = scratch
    if (not uv_shapes_ok(q_full, cache, last, heads, kv_rank, w_uv, g, sc)
            or not can_implement_uv(B, heads, T, kv_rank, D - kv_rank, vd, sc.splits,
                                    (q_full.dtype, cache.dtype, w_uv.dtype, g.dtype))):
        raise ValueError(f"mla_attend_uv kernel cannot run q {tuple(q_full.shape)} g {tuple(g.shape)}")
    if grid is None:
        grid = grid_ok(B, R, sc.splits, sm_count(q_full.device))
    elif grid and not grid_ok(B, R, sc.splits, sm_count(q_full.device)):
        raise ValueError(f"mla_attend_uv: grid merge cannot run B={B} R={R} splits={sc.splits}")
    cfg = MLAConfig(heads, T, kv_rank, D - kv_rank, float(scale), uv_rows=M, v_dim=vd,
                    probe=probe is not None, grid=grid)
    o_lat = torch.empty(B, R, kv_rank, dtype=torch.bfloat16, device=q_full.device)
    o = torch.empty(M, H * vd, dtype=torch.bfloat16, device=q_full.device)
    compile_for(cfg)(ptr(q_full), ptr(cache), ptr(last), ptr(o_lat), ptr(sc.part_o), ptr(sc.part_ml),
                     ptr(sc.grp_o), ptr(sc.grp_ml), ptr(sc.counters), ptr(w_uv), ptr(g), ptr(o),
                     ptr(probe) if probe is not None else dummy_ptr(torch.int64), Int32(B), Int32(C),
                     Int32(sc.tiles_per_split), Int32(sc.splits), Int32(sc.group), Int32(sc.groups),
                     current_stream())
    return o, o_lat


def reference(q_full: torch.Tensor, cache: torch.Tensor, last: torch.Tensor, heads: int,
              kv_rank: int, scale: float) -> torch.Tensor:
    """float64 statement of the module docstring (scores rounded to bf16 as stock and kernel
    do; p and o unrounded). Returns o_lat [B, T·H, c] float64."""
    scores = (q_full.double() @ cache.double().transpose(1, 2)).to(torch.bfloat16).double() * scale
    allowed = torch.arange(cache.shape[1], device=cache.device) <= last.to(cache.device)[:, None]
    scores = scores.masked_fill(~allowed.repeat_interleave(heads, 0), float("-inf"))
    return torch.softmax(scores, -1) @ cache[..., :kv_rank].double()


def check_inputs(cfg: object, k: int, seed: int, dev: torch.device, uv: bool = False) -> dict:
    """The device checks' inputs at config `cfg` (k3_tp16 at B, k): the latent cache (its c
    part RMS-normalised, as kv_a_norm leaves it; positions past the step's last query NaN:
    never to be read) and `clean` (the same, NaN as 0, for the stock ops), q_full (q_lat =
    q_nope @ w_uk absorbed: |q| ~ √c per row, so scores span a few units), `last` (a mid-run
    step: last < C − 1) and, with `uv`, W_UV and the gate input g. Shared by this module's
    checks and mla_attend_mma's; the draw order is fixed (a given seed gives the same data)."""
    bsz, H, T = cfg.batch, cfg.mla_local_heads, cfg.tokens_per_seq
    c, rope, vd = cfg.kv_lora_rank, cfg.qk_rope_dim, cfg.v_head_dim
    gen = torch.Generator(device=dev).manual_seed(seed)
    cache = torch.randn(bsz, cfg.cache_len, c + rope, generator=gen, device=dev)
    cache[..., :c] = torch.nn.functional.rms_norm(cache[..., :c], (c,))
    q_full = (torch.randn(bsz, T * H, c + rope, generator=gen, device=dev) * 0.5).bfloat16()
    out = {}
    if uv:
        out["w_uv"] = (torch.randn(H, c, vd, generator=gen, device=dev) * c ** -0.5).bfloat16()
        out["g"] = (torch.randn(bsz * T, H * vd, generator=gen, device=dev) * 2.0).bfloat16()
    pos0 = cfg.context_len + 5 * (1 + k)
    last = pos0 + torch.arange(T, device=dev)
    cache[:, pos0 + T:] = float("nan")
    cache = cache.bfloat16()
    return {"cache": cache, "clean": cache.nan_to_num(0.0), "q_full": q_full, "last": last, **out}


def cold_warm_timer(cache: torch.Tensor, w_uv: torch.Tensor, copies: int):
    """timed(fn, cold) for the uv checks: checks.time_us of fn(cache, w_uv), cold cycling
    through `copies` copies of both (beyond the 50 MB L2, as the step reads them once per layer)
    or warm on one. The copies live as long as the returned function."""
    import itertools

    from kimi_decode.kernels import checks
    sets = [(cache, w_uv)] + [(cache.clone(), w_uv.clone()) for _ in range(copies - 1)]

    def timed(fn, cold: bool) -> float:
        cyc = itertools.cycle(sets if cold else sets[:1])
        return checks.time_us(lambda: fn(*next(cyc)))
    return timed


def uv_verdict(o_k: torch.Tensor, errors: tuple[float, float, float, float], *exact: bool) -> bool:
    """The uv checks' pass rule: every exact property holds (bit-equal to the two launches,
    o_lat equal, repeat equal, counters zero), o finite, (vs stock, vs compiled) ≤ 1e-2 and
    vs float64 ≤ 1.5 × stock's error + 1e-3; errors = (e_stock, e_compiled, e_f64, stock_f64)."""
    e_ks, e_kc, e_k, e_s = errors
    return bool(all(exact) and e_ks <= 1e-2 and e_kc <= 1e-2 and e_k <= 1.5 * e_s + 1e-3
                and bool(torch.isfinite(o_k).all()))


def check(timing: bool = True, batches: tuple[int, ...] = (1, 8, 64), spec: tuple[int, ...] = (0, 7),
          sms_sweep: tuple[int, ...] = (33, 66)) -> list[dict]:
    """Kernel vs stock_ops.mla_attend (eager, and the torch.compile'd op the stock module runs:
    stock.MLAAttention.fx["attend"] is the same cached torch.compile of that function) and the
    float64 reference at the K3 TP16 shapes, `last` inside the cache (mask matters, positions
    past it hold NaN so a read of them would show). With timing, B = 1 is also timed with
    fewer splits (make_scratch(..., sms=n) for n in sms_sweep) to tune the plan. Where the
    grid merge runs (grid_ok: the default there), the two-level merge is checked beside it
    (`two_level_*` fields: its error, equal repeat, zeroed counters, time)."""
    from kimi_decode import stock_ops
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels.checks import DEVICE, _sync, rel, time_us
    dev = torch.device(DEVICE)
    compiled_attend = stock_ops.maybe_compiled(stock_ops.mla_attend, True)
    out = []
    for bsz in batches:
        for k in spec:
            cfg = k3_tp16(batch=bsz, spec_tokens=k)
            H, T, c, rope = cfg.mla_local_heads, cfg.tokens_per_seq, cfg.kv_lora_rank, cfg.qk_rope_dim
            C, scale = cfg.cache_len, (cfg.qk_nope_dim + rope) ** -0.5
            x = check_inputs(cfg, k, 1000 * bsz + k, dev)
            cache, q_full, last = x["cache"], x["q_full"], x["last"]
            scratch = make_scratch(bsz, T * H, C, c, dev)
            with torch.no_grad():
                o_s = stock_ops.mla_attend(q_full, cache.nan_to_num(0.0), last, H, c, scale)
                o_c = compiled_attend(q_full, cache.nan_to_num(0.0), last, H, c, scale)
                o_k = mla_attend(q_full, cache, last, H, c, scale, scratch)
                o_k2 = mla_attend(q_full, cache, last, H, c, scale, scratch)   # counters reset?
            _sync()
            ref = reference(q_full, cache.nan_to_num(0.0), last, H, c, scale)
            e_ks, e_k, e_s = rel(o_k, o_s), rel(o_k, ref), rel(o_s, ref)
            e_kc = rel(o_k, o_c)
            ok = (e_ks <= 1e-2 and e_kc <= 1e-2 and e_k <= 1.5 * e_s + 1e-3 and torch.equal(o_k, o_k2)
                  and bool(torch.isfinite(o_k).all()) and int(scratch.counters.abs().sum()) == 0)
            grid = grid_ok(bsz, T * H, scratch.splits, sm_count(dev))
            r = {"kernel": "mla_attend", "B": bsz, "k": k, "C": C, "splits": scratch.splits,
                 "groups": scratch.groups, "grid": grid, "rel_vs_stock": e_ks, "rel_vs_compiled": e_kc,
                 "rel_vs_f64": e_k, "stock_rel_vs_f64": e_s, "ok": ok}
            if grid:
                with torch.no_grad():
                    o_t = mla_attend(q_full, cache, last, H, c, scale, scratch, grid=False)
                    o_t2 = mla_attend(q_full, cache, last, H, c, scale, scratch, grid=False)
                _sync()
                e_t = rel(o_t, ref)
                r.update(two_level_rel_vs_f64=e_t, grid_rel_vs_two_level=rel(o_k, o_t),
                         two_level_repeat_equal=torch.equal(o_t, o_t2))
                r["ok"] = bool(ok and e_t <= 1.5 * e_s + 1e-3 and torch.equal(o_t, o_t2)
                               and int(scratch.counters.abs().sum()) == 0)
            if timing:
                clean = cache.nan_to_num(0.0)
                r["stock_us"] = time_us(lambda: compiled_attend(q_full, clean, last, H, c, scale))
                r["stock_eager_us"] = time_us(lambda: stock_ops.mla_attend(q_full, clean, last, H, c, scale))
                r["kernel_us"] = time_us(lambda: mla_attend(q_full, cache, last, H, c, scale, scratch))
                if grid:
                    r["two_level_us"] = time_us(lambda: mla_attend(q_full, cache, last, H, c, scale, scratch,
                                                                   grid=False))
                    r["ok"] = r["ok"] and int(scratch.counters.abs().sum()) == 0
            out.append(r)
            if timing and bsz == 1:
                for n in sms_sweep:
                    sc2 = make_scratch(bsz, T * H, C, c, dev, sms=n)
                    with torch.no_grad():
                        o_n = mla_attend(q_full, cache, last, H, c, scale, sc2)
                    _sync()
                    e_n = rel(o_n, ref)
                    out.append({"kernel": "mla_attend", "B": bsz, "k": k, "C": C, "sms": n,
                                "splits": sc2.splits, "groups": sc2.groups, "rel_vs_f64": e_n,
                                "ok": e_n <= 1.5 * e_s + 1e-3 and int(sc2.counters.abs().sum()) == 0,
                                "kernel_us": time_us(lambda: mla_attend(q_full, cache, last, H, c, scale, sc2))})
            del cache, scratch
    return out


def check_uv(timing: bool = True, cases: tuple[tuple[int, int], ...] = ((1, 0),), copies: int = 12,
             group_sweep: tuple[int, ...] = (9, 16)) -> list[dict]:
    """mla_attend_uv (uv mode) vs the verified two-launch path it replaces, mla_attend then
    mla_glue.uv_gate: o and o_lat bit-equal by design (same code, same rounding points); vs
    the stock ops (stock_ops.mla_attend + mla_glue.stock_uv, eager and torch.compile'd, as
    stock.MLAAttention runs them): rel ≤ 1e-2; vs the float64 chain (reference, then
    mla_glue.reference_uv): ≤ 1.5 × stock's error + 1e-3. K3 TP16 shapes, (B, k) in `cases`:
    B = 1, k = 0 is the one shape the per-M table uses (fused.MAX_ROWS["mla_attend_rows"] = 6).
    A second call and the timed replays must leave every counter zero. With timing: new vs
    old (2 launches) vs stock (compiled), cold (the calls cycle through `copies` copies of the
    cache and W_UV, 12 × 5.6 MB beyond the 50 MB L2, as in the step where both are read once
    per layer) and warm (one copy); and, to tune the host-side plan without recompiling,
    the uv kernel with other merge group sizes (make_scratch(..., group=n), n in
    group_sweep: at 130 splits 9 → 15 groups, 16 → 9 groups vs the default 12 → 11; rows of
    their own, held to the float64 tolerance since the merge order changes; two-level merge, the
    one the group size applies to). Where the grid merge runs, `two_level_us` times the same
    launch with the two-level merge."""
    from kimi_decode import stock_ops
    from kimi_decode.config import k3_tp16
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
        x = check_inputs(cfg, k, 2000 * bsz + k, dev, uv=True)
        cache, clean, q_full, last, w_uv, g = x["cache"], x["clean"], x["q_full"], x["last"], x["w_uv"], x["g"]
        sc_new = make_scratch(bsz, T * H, C, c, dev)
        sc_old = make_scratch(bsz, T * H, C, c, dev)
        if not can_implement_uv(bsz, H, T, c, rope, vd, sc_new.splits, (torch.bfloat16,)):
            out.append({"kernel": "mla_attend_uv", "B": bsz, "k": k, "ok": False,
                        "why": "can_implement_uv refuses this shape"})
            continue
        with torch.no_grad():
            o_k, lat_k = mla_attend_uv(q_full, cache, last, H, c, scale, w_uv, g, sc_new)
            o_k2, _ = mla_attend_uv(q_full, cache, last, H, c, scale, w_uv, g, sc_new)  # counters reset?
            lat_o = mla_attend(q_full, cache, last, H, c, scale, sc_old)
            o_o = mla_glue.uv_gate(lat_o, w_uv, g)
            o_s = mla_glue.stock_uv(stock_ops.mla_attend(q_full, clean, last, H, c, scale), w_uv, g,
                                    stock_ops.sigmoid_gate)
            o_c = mla_glue.stock_uv(attend_c(q_full, clean, last, H, c, scale), w_uv, g, gate_c)
        _sync()
        ref = mla_glue.reference_uv(reference(q_full, clean, last, H, c, scale), w_uv, g)
        e_ks, e_kc, e_k, e_s = rel(o_k, o_s), rel(o_k, o_c), rel(o_k, ref), rel(o_s, ref)
        r = {"kernel": "mla_attend_uv", "B": bsz, "k": k, "C": C, "splits": sc_new.splits,
             "group": sc_new.group, "groups": sc_new.groups, "workers": uv_workers(H, vd), "o_equal_two_launch": torch.equal(o_k, o_o),
             "o_lat_equal_mla_attend": torch.equal(lat_k, lat_o), "rel_vs_two_launch": rel(o_k, o_o),
             "rel_vs_stock": e_ks, "rel_vs_compiled": e_kc, "rel_vs_f64": e_k, "stock_rel_vs_f64": e_s,
             "repeat_equal": torch.equal(o_k, o_k2), "grid": grid_ok(bsz, T * H, sc_new.splits, sm_count(dev)),
             "counters_zero": int(sc_new.counters.abs().sum()) == 0}
        r["ok"] = uv_verdict(o_k, (e_ks, e_kc, e_k, e_s), r["o_equal_two_launch"], r["o_lat_equal_mla_attend"],
                             r["repeat_equal"], r["counters_zero"])
        if timing:
            timed = cold_warm_timer(clean, w_uv, copies)
            new = lambda ca, w: mla_attend_uv(q_full, ca, last, H, c, scale, w, g, sc_new)  # noqa: E731
            old = lambda ca, w: mla_glue.uv_gate(mla_attend(q_full, ca, last, H, c, scale, sc_old), w, g)  # noqa: E731
            stock = lambda ca, w: mla_glue.stock_uv(attend_c(q_full, ca, last, H, c, scale), w, g, gate_c)  # noqa: E731
            r["kernel_us"] = timed(new, True)
            r["two_launch_us"] = timed(old, True)
            r["stock_us"] = timed(stock, True)
            r["kernel_warm_us"] = timed(new, False)
            r["two_launch_warm_us"] = timed(old, False)
            if r["grid"]:      # the same launch with the two-level merge (the default before)
                r["two_level_us"] = timed(lambda ca, w: mla_attend_uv(q_full, ca, last, H, c, scale, w, g,
                                                                      sc_new, grid=False), True)
            r["counters_zero_after_replays"] = int(sc_new.counters.abs().sum()) == 0
            r["ok"] = r["ok"] and r["counters_zero_after_replays"]
            out.append(r)
            for n in group_sweep:
                sc_n = make_scratch(bsz, T * H, C, c, dev, group=n)
                if not can_implement_uv(bsz, H, T, c, rope, vd, sc_n.splits, (torch.bfloat16,)):
                    continue
                with torch.no_grad():
                    o_n, _ = mla_attend_uv(q_full, cache, last, H, c, scale, w_uv, g, sc_n, grid=False)
                _sync()
                e_n = rel(o_n, ref)
                out.append({"kernel": "mla_attend_uv", "B": bsz, "k": k, "C": C, "group": sc_n.group,
                            "groups": sc_n.groups, "rel_vs_f64": e_n,
                            "kernel_us": timed(lambda ca, w: mla_attend_uv(q_full, ca, last, H, c, scale, w, g,
                                                                           sc_n, grid=False)[0], True),
                            "ok": e_n <= 1.5 * e_s + 1e-3 and int(sc_n.counters.abs().sum()) == 0})
            del timed
        else:
            out.append(r)
        del cache, clean
    return out


if __name__ == "__main__":
    import sys
    for row in (check_uv() if sys.argv[1:] == ["uv"] else check()):
        print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
