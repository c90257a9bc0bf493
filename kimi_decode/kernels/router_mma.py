"""MoE router for 2 ≤ M ≤ 8 in one launch (kernel "router_mma"): fp32 logits on the tensor
cores, split over K, then sigmoid + correction-bias top-k + renormalise in the last CTA.

Why: in the B = 1, k = 7 step the router took two kernels on the MoE front's critical path:
gemv_mma's fp32 logits (17.1 µs beside latent_down and the shared gate/up in the a40ffe1
trace), then stock's Triton routing kernel (10.3-11.4 µs for 8 rows of 896 scores), so the
routed experts started ~5 µs after latent_down had finished. router_fast's top-k (one warp per
row, candidate ranks) finishes the GEMV grid in its last CTA; its own GEMV loses at M = 8
(CUDA-core FMAs: 50 µs in the step, fused.MAX_ROWS), gemv_mma's does not.

Measured (H200, cold weights, bench/fused_correctness.md and fused_runs.md): at 4 K slices of 8
warps 11.4 / 12.7 / 14.2 µs at M = 2 / 4 / 8 (7efa548), of which the GEMV grid alone 7.4 / 9.2 /
10.1; but in the B = 1, k = 7 step that build was not faster than gemv_mma's logits + a
separate selection kernel: issued first, its 224-CTA grid slowed latent_down beside it, which
then finished last. At one slice of 16 warps (gemv_mma's own 56-CTA logits grid; 13.0 / 13.6 /
14.5 µs at 421b9f0, the grid alone 10.0-10.1) with the shared expert issued after it
(fused.SHARED_AFTER_ROUTER_MMA) and FC1 released on the last CTA's arrival
(RELEASE_AFTER_ARRIVAL), FC1 starts 0.4-0.8 µs after latent_down in every M = 8 layer of the
step graph, where the two-kernel router left it 3.9-6.7 µs late in most KDA layers: the 4-layer
step 823-829 µs against 838-842 at B = 1, k = 7, one kernel fewer per MoE layer, within the
run-to-run spread in the one-layer bench (sessions 14-15). That build is the default since
session 15.

Math (as router_fast / router.py, every intermediate fp32):
    logits[m, e] = Σ_s part[s, m, e],  s = 0 .. S-1 in order,  part[s] = x[:, K_s] @ W[:, K_s]ᵀ
                   (K_s the s-th of S equal slices of D; each partial gemv_mma's tensor-core
                   fp32 accumulation and in-order warp sum, unrounded)
    s = σ(logits), key = s + bias; ids = top-k by key (ties → lower index); w = s[ids] /
    Σ_j s[ids_j] · routed_scaling (j in output order)
Only the fp32 summation order differs from gemv_mma's one-slice logits (and from stock's GEMM,
which also rounds them to bf16), so an expert set can differ from theirs on a near-tie.

Layout: grid (E / 16 tiles, S slices): CTA (tile, s) runs gemv_mma's tile over K_s
(GemvMma.tile_partials on views offset by s·D/S; 8 warps, D/S/32 chunks split over them) and
stores its 16 × M partial sums to part[s] (a [S, M, E] fp32 scratch). Then router_fast's grid
completion: each storing thread fences (fence.acq_rel.gpu), a CTA barrier, thread 0 fences
and bumps the counter (atom.add.acq_rel.gpu); the CTA that reads gridDim − 1 sums the S
partials in slice order into shared memory (all loads independent: one L2 round trip) and
copies the bias there, a barrier, then one warp per row runs RouterFast.topk_row on them
(router_fast's staged path), and thread 0 re-zeroes the counter (CUDA-graph replays find it
zero). S = 1 at K3 by default (56 CTAs of 16 warps, 14 chunks per warp); S = 4 (224 CTAs of 8
warps: more SMs stream the 12.8 MB, but beside latent_down) stays selectable.

PDL chain (kernels/chain.py): launched with PDL when the chain is on; tile_partials loads its
first round of weights before the wait. With RELEASE_AFTER_ARRIVAL (the default) the last CTA
releases the next kernel (FC1) on arrival (every other CTA has exited by then), so FC1's CTAs
are resident while it sums and selects; without it FC1 starts once this grid has completed, as
after stock's routing kernel. (A release from every CTA is not an option: FC1's waiting CTAs
then take the SMs this grid still needs.) Either way FC1 waits before it reads the ids
(moe_experts.ExpertsFC1), and FC2 reads them only once FC1's CTAs have all passed their wait,
i.e. after this grid has completed.

Check on the GPU (against stock's GEMM + routing op, gemv_mma's logits + that op, router_fast
and the float64 reference; times stock's two kernels, gemv_mma + stock routing and this one
on cold weights):
    python -m kimi_decode.kernels.router_mma
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from kimi_decode.kernels import chain
from kimi_decode.kernels import gemv_mma as gm
from kimi_decode.kernels import router_fast as rf
from kimi_decode.kernels._common import arrive_count, compile_options, compiled, current_stream, dummy_ptr, ptr

WARPS = 16         # per CTA, 8 or 16 (gemv_mma's layout; the top-k uses warps 0 .. M-1)
SPLITS = 1         # K slices (1: gemv_mma's own 56-CTA grid at K3; 4 measured 3-6 µs slower)
# route() and can_implement() read both when called, so `bench/fused_device.py --patch` can A/B
# them in the step (S = 1 with 16 warps is gemv_mma's own 56-CTA logits grid plus the tail).

# True: the last CTA releases FC1 (griddepcontrol.launch_dependents) as soon as it has arrived,
# so FC1's CTAs are resident and waiting while it sums and selects (every other CTA has exited,
# so the release takes effect at once; FC1 still reads the ids only after its wait, i.e. after
# this grid has completed). Why a setting: with the two-kernel router the MLA layer's FC1 starts
# ~2 us before latent_down ends through its programmatic edge, which router_mma, releasing
# nothing, loses (bench/fused_runs.md session 14); with it on that FC1 starts 0.4-0.5 µs after
# latent_down's end instead of 1.6-2.7 (session 15's step graphs). Read by route() when called.
RELEASE_AFTER_ARRIVAL = True


@dataclass(frozen=True)
class RouterMmaConfig:
    """Compile-time sizes: hidden D, experts E, top_k, rows M (2..8), routed scaling, K slices."""

    hidden: int
    experts: int
    top_k: int
    rows: int
    scaling: float = 1.0
    splits: int = SPLITS
    # False: the last CTA only re-zeroes the counter (no sum, no top-k): the check times this
    # build to split the kernel's time into the GEMV grid and the one-CTA tail
    tail: bool = True
    # False (timing only, with tail): the last CTA sums the slices but runs no top-k
    topk: bool = True
    warps: int = WARPS   # per CTA: 8, or 16 (gemv_mma's choice for its 56-CTA logits grid)
    # the last CTA releases the next kernel (PDL) on arrival, before its slice sums and top-k
    release_tail: bool = False


def can_implement(m: int, hidden: int, experts: int, top_k: int, dtypes: tuple[torch.dtype, ...],
                  splits: int | None = None, warps: int | None = None) -> bool:
    """gemv_mma's rows (2..8); D in `splits` slices of whole chunks that `warps` warps share
    evenly (8 or 16); router_fast's top-k limits (E a multiple of 32, ≤ 2048; k ≤ 32). `splits`
    defaults to SPLITS as it is when called (so `--patch` A/Bs reach the step's router)."""
    splits = SPLITS if splits is None else splits
    warps = WARPS if warps is None else warps
    chunks = hidden // gm.CHUNK
    return (gm.MIN_ROWS <= m <= gm.MAX_ROWS and hidden % gm.CHUNK == 0 and chunks % splits == 0
            and warps in (8, 16) and (chunks // splits) % warps == 0 and experts % 32 == 0 and 1 <= experts // 32 <= 64
            and 1 <= top_k <= 32 and top_k <= experts and all(d == torch.bfloat16 for d in dtypes))


class RouterMma:
    """See the module docstring."""

    def __init__(self, cfg: RouterMmaConfig) -> None:
        self.cfg = cfg
        self.ks = cfg.hidden // cfg.splits
        # one K slice of gemv_mma's tile (its loads, mma rounds, warp sums)
        self.mma = gm.GemvMma(gm.GemvMmaConfig(cfg.experts, self.ks, cfg.rows, warps=cfg.warps, out_f32=True))
        # router_fast's top-k (topk_row: one warp per row); its GEMV is not used
        self.sel = rf.RouterFast(rf.RouterFastConfig(cfg.hidden, cfg.experts, cfg.top_k, cfg.rows, cfg.scaling))
        self.tiles = (cfg.experts + gm.TILE - 1) // gm.TILE

    @cute.jit
    def __call__(self, y: cute.Pointer, w_gate: cute.Pointer, bias: cute.Pointer, part: cute.Pointer,
                 counter: cute.Pointer, ids: cute.Pointer, weights: cute.Pointer, stream: cuda.CUstream):
        D, E, K, m, S = self.cfg.hidden, self.cfg.experts, self.cfg.top_k, self.cfg.rows, self.cfg.splits
        # gemv_mma's word views with the K slice as a mode: [rows, S, K/S / 8, 4] (the kernel
        # takes its slice; a static stride keeps the 128-bit alignment known, so the loads stay
        # ld.global.v4)
        mX = cute.make_tensor(cute.recast_ptr(y, dtype=Int32),
                              cute.make_layout((m, S, self.ks // 8, 4), stride=(D // 2, self.ks // 2, 4, 1)))
        mW = cute.make_tensor(cute.recast_ptr(w_gate, dtype=Int32),
                              cute.make_layout((E, S, self.ks // 8, 4), stride=(D // 2, self.ks // 2, 4, 1)))
        mB = cute.make_tensor(bias, cute.make_layout(E))
        mP = cute.make_tensor(part, cute.make_layout((S, m, E), stride=(m * E, E, 1)))
        mC = cute.make_tensor(counter, cute.make_layout(1))
        mI = cute.make_tensor(ids, cute.make_layout((m, K), stride=(K, 1)))
        mO = cute.make_tensor(weights, cute.make_layout((m, K), stride=(K, 1)))
        self.kernel(mX, mW, mB, mP, mC, mI, mO).launch(
            grid=[self.tiles, S, 1], block=[self.cfg.warps * 32, 1, 1], stream=stream, use_pdl=chain.chain_on())

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mB: cute.Tensor, mP: cute.Tensor,
               mC: cute.Tensor, mI: cute.Tensor, mO: cute.Tensor):
        E, m, S = self.cfg.experts, self.cfg.rows, self.cfg.splits
        tidx, _, _ = cute.arch.thread_idx()
        tile, split, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()                     # all 32 lanes, before any branch
        lane = cute.arch.lane_idx()
        red = self.mma.smem_red()
        flag, cK, cI, selI, selS, sL, sB = self.smem_tail()
        # this CTA's K slice
        self.mma.tile_partials(mX[None, split, None, None], mW[None, split, None, None], red, tile, tidx,
                               warp, lane, release=False)
        if tidx < gm.TILE * 8:
            c, r, tot = self.mma.tile_sum(red, tidx)
            col = tile * gm.TILE + c
            if r < m:
                if col < E:
                    mP[split, r, col] = tot
            cute.arch.fence_acq_rel_gpu()   # this thread's partials before the CTA's counter bump
        # grid completion: the last CTA to arrive sums and selects
        arrive_count(mC, flag, tidx)
        # no chain release: FC1 (next on the stream) starts when this grid has completed, as it
        # did after stock's routing kernel (released at the wait, FC1's waiting CTAs took the
        # SMs the grid and the other stream's GEMVs needed: bench/fused_runs.md)
        if flag[0] == self.tiles * S - 1:               # CTA-uniform: the last CTA
            cute.arch.fence_acq_rel_gpu()
            if cutlass.const_expr(self.cfg.release_tail):
                chain.release()                         # FC1 may become resident (RELEASE_AFTER_ARRIVAL)
            if cutlass.const_expr(self.cfg.tail):
                self.sum_slices(mP, mB, sL, sB, tidx)
                cute.arch.sync_threads()                # the summed logits, seen by every warp
                if cutlass.const_expr(self.cfg.topk):
                    for row in range(warp, m, rf.WARPS):    # warp-uniform: warps 0 .. M-1
                        self.sel.topk_row(sL, sB, mI, mO, cK, cI, selI, selS, row, warp, lane)
            if tidx == 0:
                mC[0] = Int32(0)

    def smem_tail(self) -> tuple:
        """The grid completion's flag and the last CTA's top-k buffers in shared memory
        (allocated inside a kernel, after smem_red; front_mma's kernel uses them too): flag, the
        candidate keys and ids and the selection (router_fast's), then the summed logits sL
        [M, E] and the bias sB, which the top-k reads from shared memory (read from global it took
        8 us of the kernel's 18 at M = 8, bench/fused_runs.md); ~50 KB at M = 8 (the DSL opts
        every kernel into the device's dynamic shared-memory maximum)."""
        m, E = self.cfg.rows, self.cfg.experts
        smem = cutlass.memory.SmemAllocator()
        flag = smem.allocate_tensor(Int32, cute.make_layout(1), 16)
        cK = smem.allocate_tensor(Float32, cute.make_layout((rf.WARPS, rf.CAP), stride=(rf.CAP, 1)), 16)
        cI = smem.allocate_tensor(Int32, cute.make_layout((rf.WARPS, rf.CAP), stride=(rf.CAP, 1)), 16)
        selI = smem.allocate_tensor(Int32, cute.make_layout((rf.WARPS, 32), stride=(32, 1)), 16)
        selS = smem.allocate_tensor(Float32, cute.make_layout((rf.WARPS, 32), stride=(32, 1)), 16)
        sL = smem.allocate_tensor(Float32, cute.make_layout((m, E), stride=(E, 1)), 16)
        sB = smem.allocate_tensor(Float32, cute.make_layout(E), 16)
        return flag, cK, cI, selI, selS, sL, sB

    @cute.jit
    def sum_slices(self, mP: cute.Tensor, mB: cute.Tensor, sL: cute.Tensor, sB: cute.Tensor, tidx: Int32):
        """logits = Σ_s part[s] in slice order into shared memory sL, and the bias into sB, by
        the last CTA: every load independent (one L2 round trip), indices clamped instead of
        branched."""
        E, m, S = self.cfg.experts, self.cfg.rows, self.cfg.splits
        nt = self.cfg.warps * 32
        n_l = m * E
        for i in cutlass.range_constexpr((n_l + nt - 1) // nt):
            t = tidx + i * nt
            tc = cutlass.min(t, Int32(n_l - 1))
            r_ = tc // E
            e_ = tc - r_ * E
            v = mP[0, r_, e_]
            for sp in cutlass.range_constexpr(1, S):
                v = v + mP[sp, r_, e_]
            if t < n_l:
                sL[r_, e_] = v
        for i in cutlass.range_constexpr((E + nt - 1) // nt):
            t = tidx + i * nt
            if t < E:
                sB[t] = mB[t]


def compile_for(cfg: RouterMmaConfig) -> object:
    """The compiled kernel for `cfg` (cached)."""
    def build() -> object:
        bf, f32 = dummy_ptr(torch.bfloat16), dummy_ptr(torch.float32)
        i32, i64 = dummy_ptr(torch.int32), dummy_ptr(torch.int64)
        return cute.compile(RouterMma(cfg), bf, bf, f32, f32, i32, i64, f32, current_stream(),
                            options=compile_options())
    return compiled(("router_mma", cfg), build)


def route(y: torch.Tensor, w_gate: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
          counter: torch.Tensor, splits: int | None = None, tail: bool = True,
          topk: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """router.route's contract for 2 ≤ M ≤ 8: y [M, D] bf16, w_gate [E, D] bf16, bias [E]
    fp32, counter a zeroed int32 [1] buffer (left zeroed). Returns (ids [M, k] int64,
    weights [M, k] fp32), ordered by biased score, descending. `tail=False` (timing only):
    the GEMV grid alone, ids and weights left unwritten; `topk=False` (timing only): the grid
    and the last CTA's slice sums, no top-k. `splits`: SPLITS as it is when called."""
    splits = SPLITS if splits is None else splits
    m, d = y.shape
    e = w_gate.shape[0]
    if (not can_implement(m, d, e, top_k, (y.dtype, w_gate.dtype), splits, WARPS) or w_gate.shape[1] != d
            or bias.dtype != torch.float32 or bias.numel() != e or not y.is_contiguous()):
        raise ValueError(f"router_mma cannot run M={m} D={d} E={e} k={top_k} splits={splits}")
    cfg = RouterMmaConfig(d, e, top_k, m, float(scaling), splits, tail, topk, WARPS, RELEASE_AFTER_ARRIVAL)
    part = torch.empty(splits, m, e, dtype=torch.float32, device=y.device)
    ids = torch.empty(m, top_k, dtype=torch.int64, device=y.device)
    weights = torch.empty(m, top_k, dtype=torch.float32, device=y.device)
    compile_for(cfg)(ptr(y), ptr(w_gate), ptr(bias), ptr(part), ptr(counter), ptr(ids), ptr(weights),
                     current_stream())
    return ids, weights


def emulate_logits(y: torch.Tensor, w_gate: torch.Tensor, splits: int = SPLITS) -> torch.Tensor:
    """The kernel's logits in float64 through gemv_mma's fragment replay, slice by slice, the
    slices added in order (CPU tests: equal to y @ Wᵀ)."""
    d = y.shape[1]
    ks = d // splits
    tot = None
    for s in range(splits):
        p = gm.emulate(y[:, s * ks:(s + 1) * ks], w_gate[:, s * ks:(s + 1) * ks], WARPS)
        tot = p if tot is None else tot + p
    return tot


def check(timing: bool = True, rows: tuple[int, ...] = (2, 4, 8)) -> list[dict]:
    """On the H200, per M: ids/weights against the step's routing op (stock's) on exact fp32
    logits (torch.mm in fp32) and against the float64 reference: every row whose 16th and 17th
    float64 keys are not within 1e-5 (a near-tie, counted) has the same expert set, and the
    weights of equal rows agree within 1e-3; reported besides: the routing op on gemv_mma's
    logits, router_fast; its own repeat bit-equal (the sums have a fixed order); router.route's dtypes and shapes, ids in
    descending key order, the counter zero after calls and CUDA-graph replays. With timing (cold
    weights, the calls cycling through copies ≥ 160 MB): stock_us (GEMM + routing op),
    mma_stock_us (gemv_mma's logits + the routing op, the step before this kernel), kernel_us,
    grid_only_us (the build without the one-CTA tail: the GEMV grid's share), sum_only_us (the
    grid and the slice sums, no top-k), routing_op_us (stock's routing op alone on warm
    logits), kernel_s2_us (2 K slices instead of 4)."""
    import itertools

    from kimi_decode import stock_ops
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels.checks import DEVICE, _sync, router_weights, time_us
    from kimi_decode.kernels.router import reference
    cfg = k3_tp16()
    dev = torch.device(DEVICE)
    ops = stock_ops.OpSet(cfg)
    w_gate, bias = router_weights(cfg, dev, "check.router_mma")
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    counter_rf = torch.zeros(1, dtype=torch.int32, device=dev)
    K, sc, E = cfg.top_k, cfg.routed_scaling, cfg.num_experts
    out = []
    for m in rows:
        y = torch.randn(m, cfg.hidden, generator=torch.Generator(device=dev).manual_seed(100 + m), device=dev)
        y = torch.nn.functional.rms_norm(y, (cfg.hidden,)).bfloat16()
        with torch.no_grad():
            # the routing op on exact fp32 logits (router_fast's check) and on gemv_mma's
            ids_s, w_s = ops.route(torch.mm(y.float(), w_gate.float().t()), bias, K, sc)
            ids_g, w_g = ops.route(gm.gemv_mma(y, w_gate, out_dtype=torch.float32), bias, K, sc)
            ids_k, w_k = route(y, w_gate, bias, K, sc, counter)
            ids_k2, w_k2 = route(y, w_gate, bias, K, sc, counter)
            ids_f, w_f = rf.route(y, w_gate, bias, K, sc, counter_rf)
        _sync()
        ids_r, w_r, key_r = reference(y.cpu(), w_gate.cpu(), bias.cpu(), K, sc)

        agree, werr = rf.agreement(ids_k, w_k, ids_s, w_s)
        agree_g, werr_g = rf.agreement(ids_k, w_k, ids_g, w_g)
        agree_r, werr_r = rf.agreement(ids_k, w_k, ids_r, w_r)
        agree_f, werr_f = rf.agreement(ids_k, w_k, ids_f, w_f)
        r = {"kernel": "router_mma", "M": m, "rows_same_experts": agree, "max_weight_err": werr,
             "rows_same_as_mma_logits": agree_g, "max_weight_err_vs_mma_logits": werr_g,
             "rows_same_experts_f64": agree_r, "max_weight_err_f64": werr_r,
             "rows_same_as_router_fast": agree_f, "max_weight_err_vs_router_fast": werr_f,
             **rf.selection_facts(ids_k, w_k, ids_k2, w_k2, key_r, K),
             "counter_zero": int(counter.item()) == 0}
        floor = 1.0 - r["near_ties_f64"] / m - 1e-9       # every row but a near-tie agrees
        r["ok"] = bool(agree_r >= floor and werr_r <= 1e-3 and agree >= floor and werr <= 1e-3
                       and r["repeat_equal"] and r["dropin_types"] and r["descending"] and r["counter_zero"])
        if timing:
            copies = max(2, -(-(160 << 20) // (E * cfg.hidden * 2)))
            ws = [w_gate] + [(torch.randn(E, cfg.hidden, device=dev) * cfg.hidden ** -0.5).bfloat16()
                             for _ in range(copies - 1)]
            cyc = itertools.cycle(ws)
            r["stock_us"] = time_us(lambda: ops.route(ops.linear(y, next(cyc), torch.float32), bias, K, sc))
            cyc = itertools.cycle(ws)
            r["mma_stock_us"] = time_us(lambda: ops.route(gm.gemv_mma(y, next(cyc), out_dtype=torch.float32),
                                                        bias, K, sc))
            cyc = itertools.cycle(ws)
            r["kernel_us"] = time_us(lambda: route(y, next(cyc), bias, K, sc, counter))
            cyc = itertools.cycle(ws)
            r["grid_only_us"] = time_us(lambda: route(y, next(cyc), bias, K, sc, counter, tail=False))
            cyc = itertools.cycle(ws)
            r["sum_only_us"] = time_us(lambda: route(y, next(cyc), bias, K, sc, counter, topk=False))
            # the top-k alone on the summed logits, as a standalone router_fast-style pass: the
            # routing op the step would keep if the tail moved out of this kernel
            lg = gm.gemv_mma(y, w_gate, out_dtype=torch.float32)
            r["routing_op_us"] = time_us(lambda: ops.route(lg, bias, K, sc))
            for s in (2, 8):
                if can_implement(m, cfg.hidden, E, K, (torch.bfloat16,), s):
                    cyc = itertools.cycle(ws)
                    r[f"kernel_s{s}_us"] = time_us(lambda: route(y, next(cyc), bias, K, sc, counter, splits=s))
            r["counter_zero_after_replays"] = int(counter.item()) == 0
            r["ok"] = r["ok"] and r["counter_zero_after_replays"]
            del ws
        out.append(r)
    return out


if __name__ == "__main__":
    for row in check():
        print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
