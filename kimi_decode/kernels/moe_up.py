"""MoE tail in one kernel: finish the all-reduce of the routed latent and the reduce-scatter of
the shared expert, latent RMSNorm, this rank's rows of the up-projection, + shared
(KIMI_K3.md §1.6 steps 4-5; the stock path issues copy + sum for each collective, then the
up-projection skinny GEMM: stock moe_tail 9.8 µs + up_proj 13.8 µs at B = 1 on the H200).

The producers write their partials straight into slot `rank` of the collective buffers (the
experts kernel writes r into r_slots[rank]; the shared expert's down-projection leaves its full
partial sh_full [M, D]), so no copy kernel runs and this consumer does the sums:

    r[m, k]      = bf16( Σ_{s<world} r_slots[s, m, k] )                       fp32 sum  [M, L]
    shared[m, j] = bf16( Σ_{s≠rank} sh_slots[s, m, j] + sh_full[m, rank·n + j] ) fp32 [M, n]
    rstd[m]      = 1 / sqrt( Σ_k r[m, k]² / L + eps )                        fp32
    xn[m, k]     = bf16( r[m, k] · rstd[m] · norm[k] )                        fp32 → bf16
    y[m, j]      = bf16( Σ_k xn[m, k] · up_rows[j, k] )                       fp32 acc → bf16
    out[m, j]    = bf16( y[m, j] + shared[m, j] )                             fp32 add → bf16

Every bf16 rounding above is one the stock path makes: buf.sum(0) of SimComm (fp32
accumulation, bf16 out) for r and shared, F.rms_norm in bf16 (fp32 inside, bf16 out; the
Triton skinny GEMM's norm prologue rounds the same way), the bf16 matmul output, then the bf16
add `... + shared`. Slot `rank` of sh_slots is never read (this rank's contribution is its own
column slice of sh_full).

Layout: one warp per output column j (a row of up_rows [n, L]); grid = n / warps CTAs of `warps`
warps (default 8; K3 TP16: n = 448 → 56 CTAs, every warp valid; check() also verifies and
times 4 and 16 warps: 112 / 28 CTAs). Per warp:
  1. Lane l issues all of its weight loads at once: the 128-bit slices l, l+32, ... of
     up_rows[j] (L/256 = 14 slices, 56 registers), so the whole 3.2 MB weight is in flight
     from HBM while the CTA does the collective sums (the load latency hides under them).
  2. Lane s < world loads its shared partial for every row m (slot s, or sh_full for s = rank).
  3. CTA prologue, per chunk of ≤ CHUNK = 2 rows: each thread sums the world slots of its 128-bit
     vectors of r for every row of the chunk (straight-line code meant to keep all slot loads
     of the chunk in flight; written load-add-load, ptxas kept that order, so since
     SLOT_LOADS_FIRST each r vector's world slot loads are issued before its first add),
     rounds to bf16 and keeps them in registers; then per row
     block_sum gives Σr², and the thread writes xn = bf16(r·rstd·norm) into shared memory
     [chunk, L] bf16 (≤ 14 KB); barrier.
  4. Dot products from registers (weights) × shared memory (xn, conflict-free 512-byte warp
     reads), a butterfly per row, lane 0 writes out[m, j]. Later chunks reuse the weights
     already in registers, so the weight is read once for any M ≤ 8.
Why it should reach ≤ 5 µs at M = 1: the weight stream (3.2 MB, ~0.8-1 µs at HBM speed) is
issued before and overlaps the prologue; the prologue reads 16 × 7 KB = 114 KB of slots per CTA
from L2 (56 CTAs: 6.4 MB of L2 reads in all, ~1-1.5 µs at per-SM L2 bandwidth); one launch.
At M = 8 the prologue is M times larger (912 KB of slot reads per CTA, 51 MB in all): expect
several µs there (L2 bandwidth bound); the per-M table may prefer the stock path at large M.

Check on the GPU (against SimComm's collectives + stock_ops.latent_up / OpSet.up; times both):
    python -m kimi_decode.kernels.moe_up
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

from dataclasses import dataclass
from typing import Callable, Iterator

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from kimi_decode.kernels import chain
from kimi_decode.kernels._common import block_sum, compile_options, compiled, current_stream, dummy_ptr, ptr

VEC = 8          # bf16 elements per 128-bit vector
WARPS = 8        # warps (output columns) per CTA: the default (alternatives timed by check())
CHUNK = 2        # at most this many rows per prologue chunk (xn in shared memory: 2 × 7 KB at L = 3584)
MAX_ROWS = 8
ALT_WARPS = (4, 16)   # CTA sizes check() also verifies and times (112 / 28 CTAs at n = 448)
# Step 3a's world slot vectors of one r vector loaded before the first add (False: the first
# build's load-add order, one or two loads per dependent round trip: ncu at 3582044 showed
# that pattern in moe_up_grid's copy of this loop and in attn_res_mc's slot sums)
SLOT_LOADS_FIRST = True


@dataclass(frozen=True)
class MoeUpConfig:
    """Compile-time sizes: rows M, latent L, rows of up this rank owns n, TP world."""

    rows: int
    latent: int
    n: int
    world: int
    warps: int = WARPS
    # PDL chain: release the successor (the next layer's AttnRes) at the kernel's start
    # (kernels/chain.py, early release; moe_up() sets it from chain.early_release(M))
    early: bool = False


def can_implement(m: int, latent: int, n: int, world: int, dtypes: tuple[torch.dtype, ...],
                  warps: int = WARPS) -> bool:
    """M ≤ 8, L a multiple of 256 (8 elements × 32 lanes), n a multiple of the warps per CTA
    (every warp owns a column: no partial CTAs), world ≤ 32 (one shared partial per lane),
    all bf16."""
    return (1 <= m <= MAX_ROWS and latent % (VEC * 32) == 0 and latent > 0 and warps in (4, 8, 16)
            and n % warps == 0 and n > 0 and 1 <= world <= 32 and all(d == torch.bfloat16 for d in dtypes))


class MoeUp:
    """See the module docstring."""

    def __init__(self, cfg: MoeUpConfig) -> None:
        self.cfg = cfg
        self.warps = cfg.warps
        self.threads = cfg.warps * 32
        self.nv = cfg.latent // VEC                        # 128-bit vectors per latent row
        self.nv_lane = self.nv // 32                       # weight slices per lane (14)
        self.it = (self.nv + self.threads - 1) // self.threads   # prologue vectors per thread (2)
        # rows per chunk: ≤ CHUNK, and ≤ 8 vectors of r kept in registers per thread
        self.chunk = min(cfg.rows, CHUNK, max(1, 8 // self.it))
        self.chunks = (cfg.rows + self.chunk - 1) // self.chunk

    @cute.jit
    def __call__(self, r_slots: cute.Pointer, sh_slots: cute.Pointer, sh_full: cute.Pointer,
                 norm: cute.Pointer, up_rows: cute.Pointer, out: cute.Pointer, rank: Int32,
                 eps: Float32, stream: cuda.CUstream):
        mR, mS, mF, mN, mW, mO = self.views(r_slots, sh_slots, sh_full, norm, up_rows, out)
        self.kernel(mR, mS, mF, mN, mW, mO, rank, eps).launch(
            grid=[self.cfg.n // self.warps, 1, 1], block=[self.threads, 1, 1], stream=stream,
            use_pdl=chain.chain_on())

    def views(self, r_slots: cute.Pointer, sh_slots: cute.Pointer, sh_full: cute.Pointer,
              norm: cute.Pointer, up_rows: cute.Pointer, out: cute.Pointer) -> tuple[cute.Tensor, ...]:
        """The kernel's tensors (mR, mS, mF, mN, mW, mO) over the raw pointers (plain Python, run
        while __call__ traces; also moe_up_grid's)."""
        m, L, n, world = self.cfg.rows, self.cfg.latent, self.cfg.n, self.cfg.world
        nv = self.nv
        return (cute.make_tensor(r_slots, cute.make_layout((world, m, nv, VEC), stride=(m * L, L, VEC, 1))),
                cute.make_tensor(sh_slots, cute.make_layout((world, m, n), stride=(m * n, n, 1))),
                cute.make_tensor(sh_full, cute.make_layout((m, world * n), stride=(world * n, 1))),
                cute.make_tensor(norm, cute.make_layout((nv, VEC), stride=(VEC, 1))),
                cute.make_tensor(up_rows, cute.make_layout((n, nv, VEC), stride=(L, VEC, 1))),
                cute.make_tensor(out, cute.make_layout((m, n), stride=(n, 1))))

    @cute.kernel
    def kernel(self, mR: cute.Tensor, mS: cute.Tensor, mF: cute.Tensor, mN: cute.Tensor,
               mW: cute.Tensor, mO: cute.Tensor, rank: Int32, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()          # all 32 lanes (a full-warp shuffle)
        lane = cute.arch.lane_idx()
        col = bidx * self.warps + warp       # < n: the grid is exactly n / warps CTAs
        M, n, world = self.cfg.rows, self.cfg.n, self.cfg.world
        C = self.chunk
        bf16 = mW.element_type

        smem = cutlass.memory.SmemAllocator()
        sX = smem.allocate_tensor(bf16, cute.make_layout((C, self.nv, VEC), stride=(self.nv * VEC, VEC, 1)),
                                  byte_alignment=16)
        red = smem.allocate_tensor(Float32, cute.make_layout((M, self.warps), stride=(self.warps, 1)),
                                   byte_alignment=16)

        wv = cute.make_rmem_tensor(cute.make_layout((self.nv_lane, VEC), stride=(VEC, 1)), bf16)
        shp = cute.make_rmem_tensor(cute.make_layout(M), Float32)
        self.row_and_shared(mS, mF, mW, wv, shp, col, lane, rank)

        buf = cute.make_rmem_tensor(cute.make_layout(VEC), bf16)
        nbuf = cute.make_rmem_tensor(cute.make_layout(VEC), mN.element_type)
        xb = cute.make_rmem_tensor(cute.make_layout(VEC), bf16)
        acc8 = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
        rv = cute.make_rmem_tensor(cute.make_layout((C, self.it, VEC), stride=(self.it * VEC, VEC, 1)), Float32)
        acc = cute.make_rmem_tensor(cute.make_layout(C), Float32)
        raw = cute.make_rmem_tensor(cute.make_layout((world, VEC), stride=(VEC, 1)), bf16)
        for ch in cutlass.range_constexpr(self.chunks):
            m0 = ch * C
            rows = min(C, M - m0)
            if cutlass.const_expr(ch > 0):
                cute.arch.sync_threads()     # every warp has finished reading the previous chunk's xn
            # 3a. r = bf16(sum over slots) for this thread's vectors of every row of the chunk:
            # no branch and no barrier between the loads, so all rows' slot loads can be in
            # flight together (a thread past the row end reads vector c mod nv, a valid
            # duplicate that 3b ignores)
            for j in cutlass.range_constexpr(rows):
                for i in cutlass.range_constexpr(self.it):
                    c = tidx + i * self.threads
                    if cutlass.const_expr((i + 1) * self.threads > self.nv):
                        c = c % self.nv
                    acc8.fill(0.0)
                    if cutlass.const_expr(SLOT_LOADS_FIRST):
                        # the world slot vectors in flight together, then the same adds in
                        # the same order (the first build's load-add-load order kept one or
                        # two loads per dependent round trip)
                        for s in cutlass.range_constexpr(world):
                            cute.autovec_copy(mR[s, m0 + j, c, None], raw[s, None])
                        for s in cutlass.range_constexpr(world):
                            for e in cutlass.range_constexpr(VEC):
                                acc8[e] = acc8[e] + raw[s, e].to(Float32)
                    else:
                        for s in cutlass.range_constexpr(world):
                            cute.autovec_copy(mR[s, m0 + j, c, None], buf)
                            for e in cutlass.range_constexpr(VEC):
                                acc8[e] = acc8[e] + buf[e].to(Float32)
                    for e in cutlass.range_constexpr(VEC):
                        rv[j, i, e] = acc8[e].to(bf16).to(Float32)
            # 3b. per row: Σ r² over the CTA, rstd, xn = bf16(r · rstd · norm) into shared memory
            for j in cutlass.range_constexpr(rows):
                ss = Float32(0.0)
                for i in cutlass.range_constexpr(self.it):
                    if tidx + i * self.threads < self.nv:
                        for e in cutlass.range_constexpr(VEC):
                            ss += rv[j, i, e] * rv[j, i, e]
                tot = block_sum(ss, red, m0 + j, self.warps)
                rstd = cute.math.rsqrt(tot / Float32(self.cfg.latent) + eps)
                for i in cutlass.range_constexpr(self.it):
                    c = tidx + i * self.threads
                    if c < self.nv:
                        cute.autovec_copy(mN[c, None], nbuf)
                        for e in cutlass.range_constexpr(VEC):
                            xb[e] = (rv[j, i, e] * rstd * nbuf[e].to(Float32)).to(bf16)
                        cute.autovec_copy(xb, sX[j, c, None])
            cute.arch.sync_threads()
            # 4. dot products: weights from registers, xn from shared memory
            self.dots_and_store(mO, wv, sX, shp, acc, xb, m0, rows, col, lane)

    @cute.jit
    def row_and_shared(self, mS: cute.Tensor, mF: cute.Tensor, mW: cute.Tensor, wv: cute.Tensor,
                       shp: cute.Tensor, col: Int32, lane: Int32, rank: Int32):
        """Steps 1-2: the warp's whole weight row into registers wv (all loads in flight at
        once), the PDL chain's wait (the weights before it; the slots after it are this step's),
        then lane s < world holds slot s's shared partial for every row in shp (own slot:
        sh_full). Also moe_up_grid's first steps."""
        M, n, world = self.cfg.rows, self.cfg.n, self.cfg.world
        chain.begin(self.cfg.early)        # early release: its successor reads only constants first
        for i in cutlass.range_constexpr(self.nv_lane):
            cute.autovec_copy(mW[col, lane + i * 32, None], wv[i, None])
        chain.enter_or_wait(self.cfg.early)
        shp.fill(0.0)
        for mm in cutlass.range_constexpr(M):
            if lane < world:
                if lane == rank:
                    shp[mm] = mF[mm, rank * n + col].to(Float32)
                else:
                    shp[mm] = mS[lane, mm, col].to(Float32)

    @cute.jit
    def dots_and_store(self, mO: cute.Tensor, wv: cute.Tensor, sX: cute.Tensor, shp: cute.Tensor,
                       acc: cute.Tensor, xb: cute.Tensor, m0: cutlass.Constexpr[int],
                       rows: cutlass.Constexpr[int], col: Int32, lane: Int32):
        """Step 4 for rows m0 .. m0 + rows - 1 of a chunk (xn in sX): the warp's dot products
        (weights from registers), butterflies, then out = bf16(bf16(y) + bf16(shared)) by lane 0.
        Also moe_up_grid's last step."""
        bf16 = wv.element_type
        acc.fill(0.0)
        for i in cutlass.range_constexpr(self.nv_lane):
            c = lane + i * 32
            for j in cutlass.range_constexpr(rows):
                cute.autovec_copy(sX[j, c, None], xb)
                for e in cutlass.range_constexpr(VEC):
                    acc[j] = acc[j] + wv[i, e].to(Float32) * xb[e].to(Float32)
        for j in cutlass.range_constexpr(rows):
            y = cute.arch.warp_reduction_sum(acc[j])
            sh = cute.arch.warp_reduction_sum(shp[m0 + j])
            if lane == 0:
                shared = sh.to(bf16).to(Float32)
                mO[m0 + j, col] = (y.to(bf16).to(Float32) + shared).to(mO.element_type)


def compile_for(cfg: MoeUpConfig) -> object:
    """The compiled kernel for `cfg` (cached; compiles to sm_90a PTX even without a GPU)."""
    def build() -> object:
        bf = dummy_ptr(torch.bfloat16)
        return cute.compile(MoeUp(cfg), bf, bf, bf, bf, bf, bf, Int32(0), Float32(1e-5),
                            current_stream(), options=compile_options())
    return compiled(("moe_up", cfg, SLOT_LOADS_FIRST), build)


def checked_args(name: str, can: Callable[..., bool], r_slots: torch.Tensor, sh_slots: torch.Tensor,
                 sh_full: torch.Tensor, rank: int, latent_norm: torch.Tensor, up_rows: torch.Tensor,
                 out: torch.Tensor | None, warps: int) -> tuple[int, int, int, int, torch.Tensor]:
    """(M, L, n, world, out) of a MoE-tail launch (moe_up, moe_up_grid, moe_up_cluster: same
    arguments), `out` allocated where None; ValueError naming kernel `name` where the shapes
    do not match each other or `can` (that kernel's can_implement) refuses them."""
    world, m, L = r_slots.shape
    n = up_rows.shape[0]
    dtypes = (r_slots.dtype, sh_slots.dtype, sh_full.dtype, latent_norm.dtype, up_rows.dtype)
    if (tuple(sh_slots.shape) != (world, m, n) or tuple(sh_full.shape) != (m, world * n)
            or tuple(latent_norm.shape) != (L,) or tuple(up_rows.shape) != (n, L)
            or not 0 <= rank < world or not can(m, L, n, world, dtypes, warps)):
        raise ValueError(f"{name} kernel cannot run M={m} L={L} n={n} world={world} rank={rank}")
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=r_slots.device)
    elif tuple(out.shape) != (m, n) or out.dtype != torch.bfloat16:
        raise ValueError("out must be [M, n] bf16")
    return m, L, n, world, out


def emulate_tail(r: torch.Tensor, ss: torch.Tensor, sh_slots: torch.Tensor, sh_full: torch.Tensor,
                 rank: int, latent_norm: torch.Tensor, up_rows: torch.Tensor, eps: float) -> torch.Tensor:
    """The rounding points after Σ r² (the CPU emulations of moe_up_grid and moe_up_cluster,
    which differ only in that sum's order): rstd from ss [M], xn = bf16(r · rstd · norm),
    y = bf16(fp32 dot), shared = bf16(fp32 slot sum, slot `rank` from sh_full), out =
    bf16(y + shared)."""
    n = up_rows.shape[0]
    L = r.shape[-1]
    rstd = torch.rsqrt(ss / L + eps)
    xn = (r * rstd[:, None] * latent_norm.float()).bfloat16().float()
    y = (xn @ up_rows.float().t()).bfloat16().float()
    sl = sh_slots.float().clone()
    sl[rank] = sh_full[:, rank * n:(rank + 1) * n].float()      # slot `rank` is never read
    return (y + sl.sum(0).bfloat16().float()).bfloat16()


def moe_up(r_slots: torch.Tensor, sh_slots: torch.Tensor, sh_full: torch.Tensor, rank: int,
           latent_norm: torch.Tensor, up_rows: torch.Tensor, eps: float,
           out: torch.Tensor | None = None, *, warps: int = WARPS) -> torch.Tensor:
    """Launch on the current stream. r_slots [world, M, L], sh_slots [world, M, n],
    sh_full [M, world·n] (this rank's full shared partial), latent_norm [L], up_rows [n, L]
    (rows rank·n:(rank+1)·n of up); all contiguous bf16. Writes and returns part [M, n] (into
    `out` when given: contiguous [M, n] bf16, e.g. slot `rank` of the all-gather buffer)."""
    m, L, n, world, out = checked_args("moe_up", can_implement, r_slots, sh_slots, sh_full, rank,
                                       latent_norm, up_rows, out, warps)
    compile_for(MoeUpConfig(m, L, n, world, warps, early=chain.early_release(m)))(ptr(r_slots), ptr(sh_slots), ptr(sh_full), ptr(latent_norm),
                                             ptr(up_rows), ptr(out), Int32(rank), Float32(eps),
                                             current_stream())
    return out


def reference(r_slots: torch.Tensor, sh_slots: torch.Tensor, sh_full: torch.Tensor, rank: int,
              latent_norm: torch.Tensor, up_rows: torch.Tensor, eps: float,
              stored_bf16: bool = True) -> torch.Tensor:
    """float64 statement of the module docstring. The collective results r and shared are
    values the stock path stores in bf16, so they are rounded to bf16 (stored_bf16); the
    norm, the product and the add stay float64."""
    world, m, L = r_slots.shape
    n = up_rows.shape[0]
    r = r_slots.double().sum(0)
    mine = sh_full[:, rank * n:(rank + 1) * n].double()
    shared = sh_slots.double().sum(0) - sh_slots[rank].double() + mine
    if stored_bf16:
        r = r.to(torch.bfloat16).double()
        shared = shared.to(torch.bfloat16).double()
    xn = r * (r.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * latent_norm.double()
    return xn @ up_rows.double().t() + shared


def stock(r_slots: torch.Tensor, sh_slots: torch.Tensor, sh_full: torch.Tensor, rank: int,
          latent_norm: torch.Tensor, up_rows: torch.Tensor, eps: float, up_op=None) -> torch.Tensor:
    """The stock path's ops on the same slots: SimComm's sums (buf.sum(0), slot `rank` holding
    this rank's copied partial) then stock_ops.latent_up (or `up_op`, e.g. OpSet(cfg).up)."""
    from kimi_decode import stock_ops
    n = up_rows.shape[0]
    sh_buf = sh_slots.clone()
    sh_buf[rank].copy_(sh_full[:, rank * n:(rank + 1) * n])
    r, sh = r_slots.sum(0), sh_buf.sum(0)
    return (up_op or stock_ops.latent_up)(r, latent_norm, up_rows, sh, eps)


def check_slots(m: int, L: int, D: int, world: int, rank: int, case: str, gen: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GPU checks' collective inputs (moe_up's and moe_up_grid's): this rank's r [M, L] and
    shared partial [M, D], and the slot buffers r_slots [world, M, L], sh_slots [world, M, D/world]:
    "simcomm" has the other slots zero (SimComm's one-rank simulation), "all_slots" every slot
    random; slot `rank` of r_slots holds r, of sh_slots garbage (1e4: it must never be read)."""
    dev, n = gen.device, D // world
    r_loc = torch.randn(m, L, generator=gen, device=dev).bfloat16()
    sh_loc = torch.randn(m, D, generator=gen, device=dev).bfloat16()
    r_slots = torch.zeros(world, m, L, dtype=torch.bfloat16, device=dev)
    sh_slots = torch.zeros(world, m, n, dtype=torch.bfloat16, device=dev)
    if case == "all_slots":
        r_slots.copy_(torch.randn(world, m, L, generator=gen, device=dev) * 0.25)
        sh_slots.copy_(torch.randn(world, m, n, generator=gen, device=dev) * 0.25)
    r_slots[rank].copy_(r_loc)
    sh_slots[rank].fill_(1.0e4)
    return r_loc, sh_loc, r_slots, sh_slots


@dataclass
class CheckCase:
    """One row's inputs of the MoE-tail checks (moe_up, moe_up_grid, moe_up_cluster): K3 TP16
    shapes at M rows, TP rank `rank`, slot case `case` (check_slots), and the stock run's op
    set; `args` are the kernels' (and stock()'s) positional arguments."""

    m: int
    rank: int
    case: str
    world: int
    n: int
    eps: float
    ops: object
    norm: torch.Tensor
    up_rows: torch.Tensor
    r_loc: torch.Tensor
    sh_loc: torch.Tensor
    r_slots: torch.Tensor
    sh_slots: torch.Tensor
    args: tuple

    def stock_call(self, comm: object) -> None:
        """What a tail kernel replaces in the stock run: the two collectives, then OpSet.up."""
        r_c = comm.all_reduce(self.r_loc)
        sh_c = comm.reduce_scatter_cols(self.sh_loc)
        self.ops.up(r_c, self.norm, self.up_rows, sh_c, self.eps)


def check_cases(ms: tuple[int, ...], seed0: int, dev: torch.device) -> Iterator[CheckCase]:
    """The checks' inputs in their fixed order: per M (generator seeded seed0 + M: the norm,
    the up-projection), rank ∈ {0, 5}, case ∈ {simcomm, all_slots}. The ops are the stock
    run's (compile_ops on: OpSet.up is the Triton skinny GEMM with the RMSNorm prologue and
    the + shared epilogue) on the GPU, eager torch on the CPU (harness tests)."""
    from kimi_decode import stock_ops
    from kimi_decode.config import k3_tp16
    for m in ms:
        cfg = k3_tp16(batch=m)
        assert cfg.rows == m
        world, L, D, eps = cfg.tp, cfg.latent_dim, cfg.hidden, cfg.rms_eps
        n = D // world
        ops = stock_ops.OpSet(k3_tp16(batch=m, compile_ops=dev.type == "cuda"))
        gen = torch.Generator(device=dev).manual_seed(seed0 + m)
        norm = (1.0 + 0.1 * torch.randn(L, generator=gen, device=dev)).bfloat16()
        up = (torch.randn(D, L, generator=gen, device=dev) * L ** -0.5).bfloat16()
        for rank in (0, 5):
            up_rows = up[rank * n:(rank + 1) * n]
            for case in ("simcomm", "all_slots"):
                r_loc, sh_loc, r_slots, sh_slots = check_slots(m, L, D, world, rank, case, gen)
                yield CheckCase(m, rank, case, world, n, eps, ops, norm, up_rows, r_loc, sh_loc, r_slots,
                                sh_slots, (r_slots, sh_slots, sh_loc, rank, norm, up_rows, eps))


def graph_replays_equal(launch: Callable[[torch.Tensor], object], y: torch.Tensor) -> bool:
    """A tail kernel captured in a CUDA graph (launch(out) writes out) replays 3 times to `y`
    (barriers and counters that must survive replays: moe_up_grid's, moe_up_cluster's)."""
    from kimi_decode.kernels.checks import _sync
    g = torch.cuda.CUDAGraph()
    gout = torch.empty_like(y)
    with torch.cuda.graph(g):
        launch(gout)
    ok = True
    for _ in range(3):
        gout.zero_()
        g.replay()
        _sync()
        ok &= torch.equal(gout, y)
    return bool(ok)


def check(timing: bool = True) -> list[dict]:
    """Kernel vs the stock ops it replaces at K3 TP16 shapes, M ∈ {1, 8}, rank ∈ {0, 5}:
    - "simcomm": other slots zero, stock = SimComm(dev, 16, rank).all_reduce(r) +
      reduce_scatter_cols(sh) + stock_ops.latent_up, and also OpSet(cfg).up with compile_ops on
      (the stock run's op: the Triton skinny GEMM with norm prologue and add epilogue);
    - "all_slots": every slot non-zero (stock = the same sums on the same slots + latent_up).
    Both also against the float64 reference (rule of checks.py). Timing (simcomm rows): the
    stock collectives + OpSet.up (what the kernel replaces) vs one kernel launch."""
    from kimi_decode import stock_ops
    from kimi_decode.comm import SimComm
    from kimi_decode.kernels.checks import DEVICE, _sync, rel, time_us
    dev = torch.device(DEVICE)
    out = []
    for c in check_cases((1, 8), 1000, dev):
        m, rank, case, world, n, eps, ops = c.m, c.rank, c.case, c.world, c.n, c.eps, c.ops
        norm, up_rows, r_loc, sh_loc, r_slots, sh_slots = c.norm, c.up_rows, c.r_loc, c.sh_loc, c.r_slots, c.sh_slots
        L = r_loc.shape[-1]
        with torch.no_grad():
            if case == "simcomm":
                comm = SimComm(dev, world, rank)
                r_s = comm.all_reduce(r_loc)
                sh_s = comm.reduce_scatter_cols(sh_loc)
                y_s = stock_ops.latent_up(r_s, norm, up_rows, sh_s, eps)
                y_op = ops.up(r_s, norm, up_rows, sh_s, eps)
            else:
                y_s = stock(r_slots, sh_slots, sh_loc, rank, norm, up_rows, eps)
                y_op = stock(r_slots, sh_slots, sh_loc, rank, norm, up_rows, eps, ops.up)
            y_k = moe_up(r_slots, sh_slots, sh_loc, rank, norm, up_rows, eps)
            dst = torch.full((world, m, n), 7.0, dtype=torch.bfloat16, device=dev)
            moe_up(r_slots, sh_slots, sh_loc, rank, norm, up_rows, eps, out=dst[rank])
            y_alt = {w: moe_up(r_slots, sh_slots, sh_loc, rank, norm, up_rows, eps, warps=w)
                     for w in ALT_WARPS}
        _sync()
        ref = reference(r_slots, sh_slots, sh_loc, rank, norm, up_rows, eps)
        e_ks, e_kop, e_k, e_s = rel(y_k, y_s), rel(y_k, y_op), rel(y_k, ref), rel(y_s, ref)
        others = torch.cat([dst[:rank], dst[rank + 1:]])
        out_ok = torch.equal(dst[rank], y_k) and bool((others == 7.0).all())
        row = {"kernel": "moe_up", "M": m, "rank": rank, "case": case, "rel_vs_stock": e_ks,
               "rel_vs_stock_op": e_kop, "rel_vs_f64": e_k, "stock_rel_vs_f64": e_s,
               "out_slot_ok": out_ok}
        alt_ok = True
        for w, y_w in y_alt.items():   # other CTA sizes: same math, other block_sum order
            row[f"w{w}_rel_vs_stock"] = rel(y_w, y_s)
            alt_ok &= rel(y_w, y_s) <= 1e-2 and rel(y_w, ref) <= 1.5 * e_s + 1e-3
        row["ok"] = (e_ks <= 1e-2 and e_kop <= 1e-2 and e_k <= 1.5 * e_s + 1e-3 and out_ok
                     and alt_ok)
        if timing and case == "simcomm" and rank == 0:
            comm = SimComm(dev, world, rank)

            def stock_call() -> None:
                c.stock_call(comm)

            def stock_up() -> None:
                ops.up(r_s, norm, up_rows, sh_s, eps)

            with torch.no_grad():
                row["stock_us"] = time_us(stock_call)
                row["stock_up_only_us"] = time_us(stock_up)
                row["kernel_us"] = time_us(lambda: moe_up(r_slots, sh_slots, sh_loc, rank, norm,
                                                          up_rows, eps, out=dst[rank]))
                for w in ALT_WARPS:
                    row[f"kernel_us_w{w}"] = time_us(lambda: moe_up(r_slots, sh_slots, sh_loc, rank, norm,
                                                                    up_rows, eps, out=dst[rank], warps=w))
            row["kernel_tbs"] = (n * L * 2) / (row["kernel_us"] * 1e-6) / 1e12
        out.append(row)
    return out


if __name__ == "__main__":
    for r in check():
        print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()})
