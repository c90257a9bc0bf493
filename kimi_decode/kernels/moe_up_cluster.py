"""MoE tail for 1 ≤ M ≤ 8 with the slot sums shared over a CLUSTER of CTAs (kernel
"moe_up_cluster"): the same math as moe_up (kernels/moe_up.py, whose docstring states it) and
moe_up_grid (kernels/moe_up_grid.py), with no grid barrier and no global scratch.

Why: the tail is latency-bound at B = 1 (busy per op in the 9f4d4c2 H200 bundle, bench/
fused_runs.md session 35: up_proj 4.3 µs at M = 1 and 6.8-8.4 µs at M = 8 for a 3.2 MB weight,
0.8 µs at the copy rate). moe_up (M ≤ 2) has every one of its 56 CTAs sum all `world` slots of
the whole row (114 KB of L2 reads per CTA per row); moe_up_grid (3 ≤ M ≤ 8) sums each vector
once in the grid but then needs the grid barrier (an atomic arrival and a polled epoch: ~28 % of
its ncu warp-state samples at M = 8, 42 of 56 CTAs waiting there) and a read-back of r through
the L2. Here the 56 CTAs form 7 clusters of CL = 8; the CTAs of a cluster split the row's
vectors between them and share the sums through distributed shared memory, so each CTA reads
1/8 of the slots (14 KB per row at K3), no CTA waits for CTAs outside its cluster, and r never
leaves the SMs.

Layout (K3 TP16: L = 3584, nv = 448 vectors of 8 per row, n = 448 output columns, 8 warps):
grid (n / warps) CTAs, cluster (CL, 1, 1); CTA q = block_idx_in_cluster owns the vectors
q·per .. (q+1)·per − 1 of every row (per = nv / CL = 56). Its threads form row groups of GT =
64 threads (two warps; ≥ per, whole warps); group gi takes rows gi, gi + RG, .. (RG = 4 groups
at 256 threads), its thread cc < per the vector q·per + cc.
  1. the weights (the mma's B fragments, moe_up_grid.fragments_and_shared) and this thread's
     norm vectors into registers, before the PDL chain's wait; after it the shared partials;
  2. phase 1: every slot vector of every row this thread owns issued at once, then r = bf16(Σ_s
     slot_s) (fp32 in slot order, moe_up's rounding) and Σ r² over its 8 elements; a warp's sum
     (butterfly) goes to sPart[row, half];
  3. the cluster's start barrier (arrive at entry, wait here: no CTA's shared memory is written
     before that CTA runs), then each r vector is stored into all CL CTAs' sX[row, c]
     (st.shared::cluster), and, after a CTA barrier, thread k·CL + d pushes this CTA's Σ r² of
     row k (its two halves in order) into CTA d's xss[k, q];
  4. barrier.cluster arrive (release) / wait (acquire): every CTA holds all of r and all CL
     partials; rstd[k] = rsqrt(Σ_d xss[k, d] / L + eps), the partials in rank order, so the CL
     CTAs of a cluster (and the 7 clusters) get bit-identical rstd;
  5. xn = bf16(r · rstd · norm) in place in sX, one barrier, then moe_up_grid's tensor-core dot
     products and epilogue (dots_mma_and_store: + shared, bf16 out).
After the last cluster barrier no CTA touches another's shared memory, so none is needed
before exit. Barriers: 4 bar.sync + 2 cluster arrive/wait pairs, whatever M.

Rounding points are moe_up's (r, shared, xn, y, out); only Σ r²'s fp32 order differs (per
thread 8 elements, a butterfly over 32 vectors, the two halves of a CTA's share, the CL CTAs in
rank order), and y's as moe_up_grid's tensor-core dots: within the checks' 1e-2 of moe_up,
moe_up_grid and the stock ops, not bit-equal. emulate() states the order.

Expected from arithmetic: moe_up_grid's barrier wait (~2 µs at M = 8) and its r read-back
round trip (~0.7 µs) replaced by one cluster barrier (~0.3 µs); at M = 1, moe_up's 114 KB of
slot reads per CTA become 14 KB. Measured (session 37, an H100, b3397af; bench/fused_runs.md):
correct, and alone faster from M = 2 (5.3 / 6.4 / 7.9 µs at M = 2 / 4 / 8 against 6.8 / 7.3 /
8.3 for moe_up / moe_up_grid) but slower at M = 1 (5.2 against moe_up's 4.3); in the step
every layer is 1.4-2.7 µs slower with it (B = 1 k = 0, B = 1 k = 7, B = 8). Not measured: why
the M = 8 gain alone turns into a loss in the chain; a cluster needs 8 free SMs of one GPC at
once, so its CTAs may start later than moe_up_grid's under PDL while FC2 still holds the SMs.
Session 38 (H100, b895496, two ABAB pairs): at M ≥ 2 only (fused.UP_CLUSTER_MIN_ROWS) and with
ALL_PASSES_LOADS_FIRST, the 4-layer step graph 2.3-4.2 µs faster at B = 1, k = 7 and B = 8, the
in-step layers 0.5-1.5 µs, the one-layer graphs a tie (~0.3 % of a step, within the spread
between two H100 machines); so the default tail at 2 ≤ M ≤ 8 (moe_up stays at M = 1), checked
with step parity at cd6f996.

Check on the GPU (against moe_up, moe_up_grid, the stock ops and the float64 reference; repeated
calls and CUDA-graph replays give equal outputs; times all):
    python -m kimi_decode.kernels.moe_up_cluster
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm

from kimi_decode.kernels import chain
from kimi_decode.kernels import moe_up as k_up
from kimi_decode.kernels import moe_up_grid as k_upg
from kimi_decode.kernels._common import compile_options, compiled, current_stream, dummy_ptr, ptr

VEC = k_up.VEC
CL = 8                # CTAs per cluster: the portable maximum on sm_90
MIN_ROWS = 1
MAX_ROWS = k_up.MAX_ROWS
MAX_CTAS = 132        # one CTA per SM at most (clusters of CL must be placed whole)
# Phase 1 at M > RG (two passes of rows per thread): both passes' slot loads issued before the
# first add (one L2 round trip; ptxas: 239 registers at M = 8, ~94 % of an SM's register file,
# so no CTA becomes resident beside a CTA of FC2 still running) or pass by pass (two round
# trips). On since session 38: with it (and the kernel at M ≥ 2 only, fused.UP_CLUSTER_MIN_ROWS)
# the H100 step graph ran 2.3-4.2 us faster per 4-layer step at B = 1, k = 7 and B = 8 in two
# same-machine ABAB pairs, the in-step layers 0.5-1.5 us, the one-layer graphs a tie (bench/fused_runs.md,
# session 38); without it the kernel was slower in the step at every M (session 37).
ALL_PASSES_LOADS_FIRST = True


def shares(nv: int, threads: int, cl: int = CL) -> tuple[int, int, int]:
    """(per, gt, rg): vectors per CTA per row, threads per row group (whole warps, ≥ per), row
    groups per CTA. Plain arithmetic shared by the kernel, can_implement and the tests."""
    per = nv // cl
    gt = 32 * -(-per // 32)
    return per, gt, threads // gt


def can_implement(m: int, latent: int, n: int, world: int, dtypes: tuple[torch.dtype, ...],
                  warps: int = k_up.WARPS) -> bool:
    """moe_up's rules at 1 ≤ M ≤ 8, the tensor-core dots' 8 warps, a grid of whole clusters
    (n / warps a multiple of CL, at most MAX_CTAS), the row split into CL whole shares that a
    row group of whole warps covers, and every row group's rows in at most two passes."""
    if not (MIN_ROWS <= m <= MAX_ROWS and warps == k_upg.MMA_WARPS
            and k_up.can_implement(m, latent, n, world, dtypes, warps)):
        return False
    ctas, nv = n // warps, latent // VEC
    if ctas % CL or ctas > MAX_CTAS or nv % CL or nv % (warps * 4):
        return False
    per, gt, rg = shares(nv, warps * 32)
    return gt <= warps * 32 and (warps * 32) % gt == 0 and -(-m // rg) <= 2


def phase1_item(q, warp, lane, p: int, per: int, wpg: int, rg: int):
    """(row, c, cc) of thread (warp, lane) of cluster rank q in pass p: vector c = q·per + cc of
    row `row`, busy where row < M and cc < per. Plain arithmetic, so the kernel (Int32) and the
    tests (int) call the same function: row group warp // wpg takes rows gi, gi + rg, ..; its
    warps' lanes the vectors cc = 32·(warp mod wpg) + lane of the CTA's share."""
    gi = warp // wpg
    cc = (warp - gi * wpg) * 32 + lane
    return gi + rg * p, q * per + cc, cc


class MoeUpCluster(k_upg.MoeUpGrid):
    """See the module docstring. Reuses moe_up_grid's weight-fragment loads and its
    tensor-core dot products; replaces its phase 1, grid barrier and read-back."""

    def __init__(self, cfg: k_up.MoeUpConfig) -> None:
        k_up.MoeUp.__init__(self, cfg)
        self.ctas = cfg.n // cfg.warps
        self.chunk, self.chunks = cfg.rows, 1
        self.mma = True
        self.vw = self.nv // cfg.warps                   # 128-bit vectors of K per warp (56)
        self.nq = self.vw // 4                           # of them per lane (14)
        self.per, self.gt, self.rg = shares(self.nv, self.threads)
        self.wpg = self.gt // 32                         # warps per row group
        self.passes = -(-cfg.rows // self.rg)
        assert can_implement(cfg.rows, cfg.latent, cfg.n, cfg.world, (torch.bfloat16,), cfg.warps), cfg

    @cute.jit
    def __call__(self, r_slots: cute.Pointer, sh_slots: cute.Pointer, sh_full: cute.Pointer,
                 norm: cute.Pointer, up_rows: cute.Pointer, out: cute.Pointer, rank: Int32,
                 eps: Float32, stream: cuda.CUstream):
        L = self.cfg.latent
        mR, mS, mF, mN, mW, mO = self.views(r_slots, sh_slots, sh_full, norm, up_rows, out)
        mW32 = cute.make_tensor(cute.recast_ptr(up_rows, dtype=Int32),
                                cute.make_layout((self.cfg.n, self.nv, 4), stride=(L // 2, 4, 1)))
        self.kernel_cluster(mR, mS, mF, mN, mW32, mO, rank, eps).launch(
            grid=[self.ctas, 1, 1], block=[self.threads, 1, 1], cluster=[CL, 1, 1], stream=stream,
            use_pdl=chain.chain_on())

    @cute.jit
    def slot_loads(self, mR: cute.Tensor, raw: cute.Tensor, p: cutlass.Constexpr[int], row: Int32,
                   c_own: Int32, cc: Int32):
        """Pass p's world slot vectors of (row, c_own) into raw[p], all issued before any add."""
        if row < self.cfg.rows and cc < self.per:
            for s in cutlass.range_constexpr(self.cfg.world):
                cute.autovec_copy(mR[s, row, c_own, None], raw[p, s, None])

    @cute.kernel
    def kernel_cluster(self, mR: cute.Tensor, mS: cute.Tensor, mF: cute.Tensor, mN: cute.Tensor,
                       mW32: cute.Tensor, mO: cute.Tensor, rank: Int32, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        q = cute.arch.block_idx_in_cluster()
        warp = cute.arch.warp_idx()          # all 32 lanes, top level (a full-warp shuffle)
        lane = cute.arch.lane_idx()
        col = bidx * self.warps + warp       # < n: the grid is exactly n / warps CTAs
        M, world, nv, L = self.cfg.rows, self.cfg.world, self.nv, self.cfg.latent
        P, RG, per = self.passes, self.rg, self.per
        bf16 = mO.element_type

        smem = cutlass.memory.SmemAllocator()
        row_stride = nv * VEC + k_upg.SX_PAD
        sX = smem.allocate_tensor(bf16, cute.make_layout((M, nv, VEC), stride=(row_stride, VEC, 1)),
                                  byte_alignment=16)
        sPart = smem.allocate_tensor(Float32, cute.make_layout((M, self.wpg), stride=(self.wpg, 1)),
                                     byte_alignment=16)
        xss = smem.allocate_tensor(Float32, cute.make_layout((M, CL), stride=(CL, 1)), byte_alignment=16)
        sRstd = smem.allocate_tensor(Float32, cute.make_layout(M), byte_alignment=16)

        # every CTA of the cluster arrives once it runs; the matching wait (before the first
        # remote store) makes sure no CTA's shared memory is written before that CTA started
        cute.arch.cluster_arrive_relaxed()

        # 1. the norm vectors this thread scales in step 5 (a constant: before the wait), the
        #    weight fragments, the chain's wait, the shared partials (moe_up_grid's)
        nbuf = cute.make_rmem_tensor(cute.make_layout((self.it, VEC), stride=(VEC, 1)), mN.element_type)
        for i in cutlass.range_constexpr(self.it):
            c = tidx + i * self.threads
            if c < nv:
                cute.autovec_copy(mN[c, None], nbuf[i, None])
        wq = cute.make_rmem_tensor(cute.make_layout((self.nq, 4), stride=(4, 1)), Int32)
        shb = cute.make_rmem_tensor(cute.make_layout(M), bf16)
        self.fragments_and_shared(mS, mF, mW32, wq, shb, col, warp, lane, rank)

        # 2. phase 1: every slot vector of this thread's (row, vector) items in flight, then
        #    r = bf16(Σ slots) and Σ r² per item; the warp's sums into sPart[row, half]
        gi = warp // self.wpg
        half = warp - gi * self.wpg
        _, c_own, cc = phase1_item(q, warp, lane, 0, per, self.wpg, RG)
        raw = cute.make_rmem_tensor(cute.make_layout((P, world, VEC), stride=(world * VEC, VEC, 1)), bf16)
        rb = cute.make_rmem_tensor(cute.make_layout((P, VEC), stride=(VEC, 1)), bf16)
        acc8 = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
        if cutlass.const_expr(ALL_PASSES_LOADS_FIRST):
            for p in cutlass.range_constexpr(P):
                self.slot_loads(mR, raw, p, phase1_item(q, warp, lane, p, per, self.wpg, RG)[0], c_own, cc)
        for p in cutlass.range_constexpr(P):
            row = phase1_item(q, warp, lane, p, per, self.wpg, RG)[0]
            if cutlass.const_expr(not ALL_PASSES_LOADS_FIRST):
                self.slot_loads(mR, raw, p, row, c_own, cc)
            ss = Float32(0.0)
            if row < M and cc < per:
                acc8.fill(0.0)
                for s in cutlass.range_constexpr(world):
                    for e in cutlass.range_constexpr(VEC):
                        acc8[e] = acc8[e] + raw[p, s, e].to(Float32)
                for e in cutlass.range_constexpr(VEC):
                    rb[p, e] = acc8[e].to(bf16)
                    v = rb[p, e].to(Float32)
                    ss += v * v
            ss = cute.arch.warp_reduction_sum(ss)         # every lane, outside the branch
            if lane == 0:
                if row < M:
                    sPart[row, half] = ss

        # 3. every CTA of the cluster has started; r into all CL CTAs' sX, then (after the
        #    CTA barrier) this CTA's Σ r² per row into every CTA's xss[row, q]
        cute.arch.cluster_wait()
        for p in cutlass.range_constexpr(P):
            row = phase1_item(q, warp, lane, p, per, self.wpg, RG)[0]
            if row < M and cc < per:
                for d in cutlass.range_constexpr(CL):
                    remote = cute.arch.map_dsmem_ptr(sX[row, c_own, None].iterator, d)
                    cute.autovec_copy(rb[p, None], cute.make_tensor(remote, cute.make_layout(VEC)))
        cute.arch.sync_threads()
        if tidx < M * CL:
            k = tidx // CL
            d = tidx - k * CL
            tot = Float32(0.0)
            for h in cutlass.range_constexpr(self.wpg):
                tot += sPart[k, h]
            remote = cute.arch.map_dsmem_ptr(xss.iterator + (k * CL + q), d)
            llvm.store(tot.ir_value(), remote.to_llvm_ptr())

        # 4. all of r and every partial are here (release / acquire); rstd per row, the CL
        #    partials in rank order
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if tidx < M:
            tot = Float32(0.0)
            for d in cutlass.range_constexpr(CL):
                tot += xss[tidx, d]
            sRstd[tidx] = cute.math.rsqrt(tot / Float32(L) + eps)
        cute.arch.sync_threads()

        # 5. xn = bf16(r · rstd · norm) in place, then moe_up_grid's tensor-core dots
        xb = cute.make_rmem_tensor(cute.make_layout(VEC), bf16)
        rv = cute.make_rmem_tensor(cute.make_layout(VEC), bf16)
        for j in cutlass.range_constexpr(M):
            rstd = sRstd[j]
            for i in cutlass.range_constexpr(self.it):
                c = tidx + i * self.threads
                if c < nv:
                    cute.autovec_copy(sX[j, c, None], rv)
                    for e in cutlass.range_constexpr(VEC):
                        xb[e] = (rv[e].to(Float32) * rstd * nbuf[i, e].to(Float32)).to(bf16)
                    cute.autovec_copy(xb, sX[j, c, None])
        cute.arch.sync_threads()
        sX32 = cute.make_tensor(cute.recast_ptr(sX.iterator, dtype=Int32),
                                cute.make_layout((M, nv, 4), stride=(row_stride // 2, 4, 1)))
        self.dots_mma_and_store(mO, wq, sX32, shb, bidx, tidx, warp, lane)


def compile_for(cfg: k_up.MoeUpConfig) -> object:
    """The compiled kernel for `cfg` (cached; compiles to sm_90a PTX even without a GPU)."""
    def build() -> object:
        bf = dummy_ptr(torch.bfloat16)
        return cute.compile(MoeUpCluster(cfg), bf, bf, bf, bf, bf, bf, Int32(0), Float32(1e-5),
                            current_stream(), options=compile_options())
    return compiled(("moe_up_cluster", cfg, CL, ALL_PASSES_LOADS_FIRST), build)


def moe_up_cluster(r_slots: torch.Tensor, sh_slots: torch.Tensor, sh_full: torch.Tensor, rank: int,
                   latent_norm: torch.Tensor, up_rows: torch.Tensor, eps: float,
                   out: torch.Tensor | None = None, *, warps: int = k_up.WARPS) -> torch.Tensor:
    """moe_up (same arguments and result, kernels/moe_up.py) for 1 ≤ M ≤ 8; no scratch."""
    m, L, n, world, out = k_up.checked_args("moe_up_cluster", can_implement, r_slots, sh_slots, sh_full, rank,
                                            latent_norm, up_rows, out, warps)
    compile_for(k_up.MoeUpConfig(m, L, n, world, warps))(
        ptr(r_slots), ptr(sh_slots), ptr(sh_full), ptr(latent_norm), ptr(up_rows), ptr(out),
        Int32(rank), Float32(eps), current_stream())
    return out


def emulate(r_slots: torch.Tensor, sh_slots: torch.Tensor, sh_full: torch.Tensor, rank: int,
            latent_norm: torch.Tensor, up_rows: torch.Tensor, eps: float, warps: int = k_up.WARPS) -> torch.Tensor:
    """The kernel's rounding points in torch (CPU tests): r = bf16(fp32 slot sum); Σ r² per
    CTA share (CL shares of per vectors, each as halves of 32 vectors, added in order), the
    shares in rank order; xn = bf16(r · rstd · norm); y = bf16(fp32 dot); shared = bf16(fp32
    sum); out = bf16(y + shared)."""
    m, L = r_slots.shape[1], r_slots.shape[2]
    nv = L // VEC
    per, _, _ = shares(nv, warps * 32)
    r = r_slots.float().sum(0).bfloat16().float()                          # [M, L]
    sq = (r * r).reshape(m, CL, per * VEC)
    halves = [sq[..., h * 32 * VEC:(h + 1) * 32 * VEC].sum(-1) for h in range(-(-per // 32))]
    share = halves[0]
    for h in halves[1:]:
        share = share + h
    ss = share[:, 0]
    for d in range(1, CL):
        ss = ss + share[:, d]
    return k_up.emulate_tail(r, ss, sh_slots, sh_full, rank, latent_norm, up_rows, eps)


def check(timing: bool = True) -> list[dict]:
    """Kernel vs moe_up (M ≤ 2) or moe_up_grid (M ≥ 3) — the kernels it would replace in the
    per-M table — and vs moe_up at every M, the stock ops and the float64 reference at K3 TP16
    shapes, M ∈ {1, 2, 4, 8}, rank ∈ {0, 5}, both slot cases of moe_up's check; `out=` into an
    all-gather slot leaves the other slots untouched; 3 repeated calls and 3 CUDA-graph replays
    give the same output. Timing (simcomm, rank 0): stock collectives + OpSet.up, the kernel it
    would replace, and this kernel."""
    from kimi_decode.comm import SimComm
    from kimi_decode.kernels.checks import DEVICE, _sync, rel, time_us
    dev = torch.device(DEVICE)
    out = []
    grid_scratch: dict[int, k_upg.MoeUpGridScratch] = {}
    for c in k_up.check_cases((1, 2, 4, 8), 3000, dev):
        m, rank, case, args = c.m, c.rank, c.case, c.args
        if m >= k_upg.MIN_ROWS and m not in grid_scratch:
            grid_scratch[m] = k_upg.make_scratch(m, c.r_slots.shape[-1], dev)

        def replaced(dst: torch.Tensor | None = None) -> torch.Tensor:
            if m < k_upg.MIN_ROWS:
                return k_up.moe_up(*args, out=dst)
            return k_upg.moe_up_grid(*args, grid_scratch[m], out=dst)

        with torch.no_grad():
            y_s = k_up.stock(*args)
            y_op = k_up.stock(*args, c.ops.up)
            y_one = k_up.moe_up(*args)
            y_rep = replaced()
            y_k = moe_up_cluster(*args)
            reps = [moe_up_cluster(*args) for _ in range(3)]
            dst = torch.full((c.world, m, c.n), 7.0, dtype=torch.bfloat16, device=dev)
            moe_up_cluster(*args, out=dst[rank])
        _sync()
        ref = k_up.reference(*args)
        e_ks, e_kop, e_k, e_s = rel(y_k, y_s), rel(y_k, y_op), rel(y_k, ref), rel(y_s, ref)
        others = torch.cat([dst[:rank], dst[rank + 1:]])
        row = {"kernel": "moe_up_cluster", "M": m, "rank": rank, "case": case,
               "rel_vs_stock": e_ks, "rel_vs_stock_op": e_kop, "rel_vs_moe_up": rel(y_k, y_one),
               "rel_vs_replaced": rel(y_k, y_rep), "rel_vs_f64": e_k, "stock_rel_vs_f64": e_s,
               "repeat_equal": all(torch.equal(y, y_k) for y in reps),
               "out_slot_ok": torch.equal(dst[rank], y_k) and bool((others == 7.0).all())}
        if DEVICE == "cuda" and case == "all_slots" and rank == 5:
            row["graph_replays_equal"] = k_up.graph_replays_equal(lambda o: moe_up_cluster(*args, out=o), y_k)
        row["ok"] = bool(e_ks <= 1e-2 and e_kop <= 1e-2 and row["rel_vs_moe_up"] <= 1e-2
                         and row["rel_vs_replaced"] <= 1e-2 and e_k <= 1.5 * e_s + 1e-3
                         and row["repeat_equal"] and row["out_slot_ok"]
                         and row.get("graph_replays_equal", True))
        if timing and case == "simcomm" and rank == 0 and DEVICE == "cuda":
            comm = SimComm(dev, c.world, rank)
            with torch.no_grad():
                row["stock_us"] = time_us(lambda: c.stock_call(comm))
                row["replaced_us"] = time_us(lambda: replaced(dst[rank]))
                row["kernel_us"] = time_us(lambda: moe_up_cluster(*args, out=dst[rank]))
        out.append(row)
    return out


if __name__ == "__main__":
    for r in check():
        print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()})
