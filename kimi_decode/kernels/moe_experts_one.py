"""Routed experts in ONE persistent launch (kernel name `experts_one`): moe_experts.py's FC1
(+ SiTU GLU) and FC2 v2 (+ the weighted top-k reduce) as work items of one grid, FC2 items
waiting on a grid-wide completion counter instead of a kernel boundary.

Math and rounding points: exactly moe_experts.py's (h, a, e, r). Each work item runs the
code of its kernel unchanged (the same loads, FMA order, butterflies and shuffles per warp),
so the result equals `experts(..., v2=True)` bit for bit; the check asserts torch.equal.

Work items (K3 TP16, M = 1: K = 16, I = 192, L = 3584):
- FC1 item t < N1 = M·K·I/4: 4 warps, warp g = 4t + w is ExpertsFC1's warp g (pair
  p = g // I, column c = g % I): 768 items of 57 KB of w13 each. It writes its 4 values of
  `a`, then publishes them: every thread fence.acq_rel.gpu, bar.sync, thread 0 fence +
  atom.add.acq_rel.gpu on the completion counter (router_fast's / mla_attend's pattern).
- FC2 item u = t - N1 < N2 = M·ceil(L/4): ExpertsFC2v2's CTA u (row u % M, columns
  4·(u // M) .. +3): 896 items. It issues its 12 w2 loads per lane and the row's ids/weights
  (none depends on FC1), then griddepcontrol.wait (a no-op without PDL; kept as FC2v2's
  scheduling fence so ptxas does not sink the loads), then thread 0 spins with
  ld.acquire.gpu until the completion counter reaches N1 while the others wait at a
  barrier, every thread fences (acq_rel, gpu), and the item stages `a` and finishes as FC2v2.
Scheduling: thread 0 takes tickets t from an atomic counter (barrier, atom, barrier: the
ticket is broadcast through shared memory); tickets below N1 are FC1 items, then FC2 items,
then exit. Deadlock freedom does not depend on residency (the side stream's shared expert
runs beside this kernel in the step, so not every CTA need be resident): tickets are handed
out in counter order, so when a CTA holds an FC2 ticket every FC1 ticket is already held by
a running CTA, and FC1 items never wait.
Counters (a caller-kept zeroed int32 [64] buffer: ticket and CTAs-exited in words 0, 1, FC1
items done in word 32, its own 128-byte line, so that up to ~900 polling CTAs and the ticket
atomics do not queue on one L2 line): each CTA, after its last (failing) ticket, bumps the
exit counter; the CTA that reads gridDim - 1 is the last:
every other CTA has finished every ticket fetch and every wait, so it re-zeroes all three
(mla_attend uv mode's pattern), and CUDA-graph replays find zeros.

Grid and registers: 4 warps per CTA (FC2v2's CTA; FC1 items use 4 of FC1's 8-warp CTA's warp
indices). FC1 alone needs ~40 registers, FC2v2 72 (capped); the kernel's count is the max, so
min_blocks_per_mp = 7 caps ptxas at 72: 7 CTAs x 128 threads x 72 = 64,512 ≤ 65,536
registers, 7 x 6.2 KB shared memory, 896 threads per SM. The grid is 7 x SMs CTAs (924 on
the H200's 132 SMs: SM count queried from torch when the wrapper runs), all resident when
nothing else runs. (With I = Ip = 256, FC2v2 holds 16 slices and caps at 4 CTAs per SM /
128 registers; the grid follows: 4 x SMs.) ptxas (CUDA 13.0, CPU test): 72 registers, 94 B
spill stores / 120 B loads per thread (FC2v2 alone: 20 / 32), none in FC1's load loop and
none of the 48 w2 load destinations (read in the SASS); with a cap of 80 (6 CTAs per SM) it
is 40 / 52 B, kept as the fallback should the spill show on the device. The acquire poll
compiles to LDG.E.STRONG.GPU + CCTL.IVALL (L1 invalidated before `a` is read).
Risk to watch on the device: near the end of the FC1 phase up to ~900 CTAs poll one word
through L2 (one outstanding load each, ~0.7 us round trip: ~1.3 polls/ns) beside the last
completion atomics; the DSL has no nanosleep for a back-off.

Expectation (not measured; the device check times it): FC1 + FC2v2 with PDL took 23.5 us at
M = 1 (cold weights, graph replays; 66 MB: 2.8 TB/s); the copy floor is ~17.5 us. One launch
removes one launch overhead and the FC1 -> FC2 drain/ramp (FC2 items of CTAs that finish FC1
early stream w2 while other CTAs still run FC1): ~1-3 us, i.e. ~20.5-22.5 us expected, at
the cost of ~2.6 K same-address atomics (tickets + completions, spread over the run) and a
flag round trip (~1 us) that FC2 items hide behind their w2 loads. KDA 10 -> 9 and MLA
13 -> 12 kernels per layer.
Measured (H200, check at 801b1da, bench/fused_correctness.md; cold weights): M = 1 29.0 µs
vs 23.6 for FC1 + FC2v2 with PDL (M = 8: 163.0 vs 142.9), bit-equal to them, counters zero
after replays; the B = 1 step was slower with it (bench/fused_runs.md). Slower, so the
expectation above was wrong (likely suspects, unverified: the ~900 pollers above, the spill
under the 72-register cap); fused.OPT_IN keeps it out of the default kernel set.

Check on the GPU (`check`: vs experts(v2=True) bit for bit, stock, float64; counters back to
zero; one launch vs FC1 + FC2v2 with PDL vs stock, cold weights):
    python -m kimi_decode.kernels.moe_experts_one
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

import itertools

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from kimi_decode.kernels._common import compile_options, compiled, current_stream, dummy_ptr, ptr, sm_count
from kimi_decode.kernels.moe_experts import (V2_GROUP_LANES, V2_GROUPS, VEC, ExpertsConfig,
                                             can_implement_v2, fc1_warp, prepare, v2_finish, v2_issue)

ONE_WARPS = 4          # warps per CTA (FC2v2's CTA; an FC1 item is 4 of FC1's warps)
# counter words: the ticket and exit counters share one 128-byte line, the FC1 completion
# counter (polled by every waiting FC2 item) has its own, so polls and ticket atomics do not
# queue on the same L2 line
COUNTERS = 64          # int32 words of the counter buffer (256 bytes)
TICKET, EXITED, DONE = 0, 1, 32
ONE_CTAS = 7
ONE_FC1_UNROLL = 7     # FC1 items' L-loop slices per trip. ExpertsFC1 runs all 14 in one trip
                       # (moe_experts.FC1_UNROLL); this opt-in kernel was measured at 7, and at
                       # 14 its FC1 branch holds the butterflies outside any loop


def ctas_per_sm(cfg: ExpertsConfig) -> int:
    """Resident CTAs per SM the register cap allows (FC2v2's min_blocks): 7 (≤ 72 registers)
    when K/4·I/64 ≤ 12 slices of w2 sit in registers, else 4 (≤ 128)."""
    return ONE_CTAS if (cfg.top_k // V2_GROUPS) * (cfg.inter // (VEC * V2_GROUP_LANES)) <= 12 else 4


class ExpertsOne:
    """FC1 + FC2v2 work items in one persistent grid (module docstring)."""

    def __init__(self, cfg: ExpertsConfig) -> None:
        self.cfg = cfg
        self.fc1_slices = cfg.latent // (VEC * 32)
        self.fc1_unroll = ONE_FC1_UNROLL if self.fc1_slices % ONE_FC1_UNROLL == 0 else 1
        self.per_group = cfg.top_k // V2_GROUPS
        self.slices = cfg.inter // (VEC * V2_GROUP_LANES)
        self.min_blocks = ctas_per_sm(cfg)

    @cute.jit
    def __call__(self, z: cute.Pointer, idx: cute.Pointer, w: cute.Pointer, w13: cute.Pointer,
                 w2: cute.Pointer, act: cute.Pointer, out: cute.Pointer, counters: cute.Pointer,
                 m: Int32, nctas: Int32, beta: Float32, lin_beta: Float32, stream: cuda.CUstream):
        L, Ip, K, E = self.cfg.latent, self.cfg.inter_padded, self.cfg.top_k, self.cfg.experts
        nv = L // VEC
        ni = Ip // VEC
        mZ = cute.make_tensor(z, cute.make_layout((m, nv, VEC), stride=(L, VEC, 1)))
        mIdx = cute.make_tensor(idx, cute.make_layout((m, K), stride=(K, 1)))
        mWt = cute.make_tensor(w, cute.make_layout((m, K), stride=(K, 1)))
        mW13 = cute.make_tensor(w13, cute.make_layout((E, 2 * Ip, nv, VEC), stride=(2 * Ip * L, L, VEC, 1)))
        mW2 = cute.make_tensor(w2, cute.make_layout((E, L, ni, VEC), stride=(L * Ip, Ip, VEC, 1)))
        mA1 = cute.make_tensor(act, cute.make_layout((m * K, Ip), stride=(Ip, 1)))            # FC1's view
        mA2 = cute.make_tensor(act, cute.make_layout((m * K, ni, VEC), stride=(Ip, VEC, 1)))  # FC2's view
        mO = cute.make_tensor(out, cute.make_layout((m, L), stride=(L, 1)))
        mCnt = cute.make_tensor(counters, cute.make_layout(COUNTERS))
        self.kernel(mZ, mIdx, mWt, mW13, mW2, mA1, mA2, mO, mCnt, m, beta, lin_beta).launch(
            grid=[nctas, 1, 1], block=[ONE_WARPS * 32, 1, 1], stream=stream,
            min_blocks_per_mp=self.min_blocks, preferred_smem_carveout=-1)

    @cute.kernel
    def kernel(self, mZ: cute.Tensor, mIdx: cute.Tensor, mWt: cute.Tensor, mW13: cute.Tensor,
               mW2: cute.Tensor, mA1: cute.Tensor, mA2: cute.Tensor, mO: cute.Tensor, mCnt: cute.Tensor,
               m: Int32, beta: Float32, lin_beta: Float32):
        L, I, K = self.cfg.latent, self.cfg.inter, self.cfg.top_k
        nq = I // VEC
        tidx, _, _ = cute.arch.thread_idx()
        nctas, _, _ = cute.arch.grid_dim()
        warp = cute.arch.warp_idx()          # all 32 lanes, outside any branch
        lane = cute.arch.lane_idx()
        smem = cutlass.memory.SmemAllocator()
        sA = smem.allocate_tensor(mA2.element_type, cute.make_layout((K, nq, VEC), stride=(nq * VEC, VEC, 1)),
                                  byte_alignment=16)
        sW = smem.allocate_tensor(Float32, cute.make_layout(K), byte_alignment=16)
        sT = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=16)
        n1 = m * (K * I // ONE_WARPS)                    # FC1 items
        n2 = m * ((L + ONE_WARPS - 1) // ONE_WARPS)      # FC2 items
        total = n1 + n2
        t = self.ticket(mCnt, sT, tidx)
        while t < total:                                  # CTA-uniform
            if t < n1:
                self.fc1_item(mZ, mIdx, mW13, mA1, mCnt, m, beta, lin_beta, t, tidx, warp, lane)
            else:
                self.fc2_item(mA2, mIdx, mWt, mW2, mO, mCnt, sA, sW, m, n1, t - n1, tidx, warp, lane)
            t = self.ticket(mCnt, sT, tidx)
        # the last CTA out (every other has fetched its last ticket and passed every wait)
        # re-zeroes the counters for the next call / graph replay
        if tidx == 0:
            old = cute.arch.atomic_add(mCnt.iterator + EXITED, Int32(1), sem="acq_rel", scope="gpu")
            if old == nctas - 1:
                mCnt[TICKET] = Int32(0)
                mCnt[EXITED] = Int32(0)
                mCnt[DONE] = Int32(0)

    @cute.jit
    def ticket(self, mCnt: cute.Tensor, sT: cute.Tensor, tidx: Int32) -> Int32:
        """The CTA's next work item: thread 0 takes it from the ticket counter, shared memory
        broadcasts it. The first barrier keeps thread 0 from overwriting the previous ticket
        (and the next item from overwriting sA) before every thread is done with it."""
        cute.arch.sync_threads()
        if tidx == 0:
            sT[0] = cute.arch.atomic_add(mCnt.iterator + TICKET, Int32(1), sem="acq_rel", scope="gpu")
        cute.arch.sync_threads()
        return sT[0]

    @cute.jit
    def fc1_item(self, mZ: cute.Tensor, mIdx: cute.Tensor, mW: cute.Tensor, mA: cute.Tensor,
                 mCnt: cute.Tensor, m: Int32, beta: Float32, lin_beta: Float32, item: Int32,
                 tidx: Int32, warp: Int32, lane: Int32):
        """ExpertsFC1's warp g = 4·item + warp (its code, line for line), then the publish of
        the item's `a` values: fence, barrier, thread 0 fence + release increment."""
        Ip, I, K, E = self.cfg.inter_padded, self.cfg.inter, self.cfg.top_k, self.cfg.experts
        g = item * ONE_WARPS + warp
        fc1_warp(mZ, mIdx, mW, mA, m, beta, lin_beta, g, lane, Ip, I, K, E, self.fc1_slices, self.fc1_unroll)
        cute.arch.fence_acq_rel_gpu()        # this thread's `a` before the counter bump
        cute.arch.sync_threads()
        if tidx == 0:
            cute.arch.fence_acq_rel_gpu()
            cute.arch.atomic_add(mCnt.iterator + DONE, Int32(1), sem="acq_rel", scope="gpu")

    @cute.jit
    def fc2_item(self, mA: cute.Tensor, mIdx: cute.Tensor, mWt: cute.Tensor, mW2: cute.Tensor,
                 mO: cute.Tensor, mCnt: cute.Tensor, sA: cute.Tensor, sW: cute.Tensor, m: Int32,
                 n1: Int32, item: Int32, tidx: Int32, warp: Int32, lane: Int32):
        """ExpertsFC2v2's CTA `item` (its code, line for line), griddepcontrol.wait followed by
        the wait for all n1 FC1 items (thread 0 polls with acquire loads; barrier; fence)."""
        L, I, K, E = self.cfg.latent, self.cfg.inter, self.cfg.top_k, self.cfg.experts
        kpg, nsl = self.per_group, self.slices
        threads = ONE_WARPS * 32
        grp = lane // V2_GROUP_LANES         # the group's experts: j = grp + 4·t
        r = lane - grp * V2_GROUP_LANES      # the lane's slices of a row: q = r + 8·i
        cb = item // m
        row = item - cb * m
        col = cb * ONE_WARPS + warp
        cc = col
        if col >= L:
            cc = L - 1
        wv = cute.make_rmem_tensor(cute.make_layout((VEC, nsl, kpg)), mW2.element_type)
        av = cute.make_rmem_tensor(cute.make_layout(VEC), mA.element_type)
        ev = cute.make_rmem_tensor(cute.make_layout(kpg), Int32)
        ex = cute.make_rmem_tensor(cute.make_layout(kpg), Float32)
        v2_issue(mIdx, mWt, mW2, sW, ev, wv, row, cc, r, grp, tidx, K, E, kpg, nsl)
        # FC2v2's scheduling fence after the w2 loads (a no-op: this kernel is not a PDL launch)
        cute.arch.griddepcontrol_wait()
        # every FC1 item has published its `a`: thread 0 polls, the CTA waits at the barrier
        if tidx == 0:
            seen = cute.arch.load((mCnt.iterator + DONE).llvm_ptr, Int32, sem="acquire", scope="gpu")
            while seen < n1:
                seen = cute.arch.load((mCnt.iterator + DONE).llvm_ptr, Int32, sem="acquire", scope="gpu")
        cute.arch.sync_threads()
        cute.arch.fence_acq_rel_gpu()
        v2_finish(mA, mO, sA, sW, av, wv, ex, row, col, r, grp, tidx, lane, K, L, kpg, nsl, threads)


def can_implement_one(m: int, k: int, latent: int, inter_padded: int, dtypes: tuple[torch.dtype, ...],
                      inter: int | None = None) -> bool:
    """FC2 v2's rules (moe_experts.can_implement_v2: M ≤ 8, K % 4 == 0, I % 64 == 0, ...);
    FC1 items of 4 warps are then exact (K·I/4 an integer)."""
    return can_implement_v2(m, k, latent, inter_padded, dtypes, inter)


def compile_for(cfg: ExpertsConfig) -> object:
    """The compiled one-launch kernel for `cfg` (cached; `pdl` plays no part)."""
    def build() -> object:
        bf = dummy_ptr(torch.bfloat16)
        return cute.compile(ExpertsOne(cfg), bf, dummy_ptr(cfg.idx_dtype), dummy_ptr(torch.float32), bf, bf, bf, bf,
                            dummy_ptr(torch.int32), Int32(1), Int32(924), Float32(4.0), Float32(25.0),
                            current_stream(), options=compile_options())
    return compiled(("experts_one", cfg), build)


def make_counters(device: torch.device) -> torch.Tensor:
    """The zeroed int32 [COUNTERS] counter buffer `experts_one` needs (the caller keeps it; every
    launch leaves it zeroed)."""
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


def experts_one(z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                beta: float, lin_beta: float, counters: torch.Tensor, out: torch.Tensor | None = None, *,
                inter: int | None = None) -> torch.Tensor:
    """moe_experts.experts(..., v2=True) in one launch, equal to it bit for bit; the same
    arguments plus `counters` (make_counters: zeroed int32 [COUNTERS], left zeroed). CUDA-graph safe
    (no host syncs). Returns out [M, L]."""
    if counters.dtype != torch.int32 or counters.numel() != COUNTERS or not counters.is_contiguous():
        raise ValueError(f"counters must be a contiguous int32 [{COUNTERS}] buffer")
    (m, k, L, E, ip, i), idx, w, out, act = prepare(z, idx, w, w13, w2, out, inter, can_implement_one,
                                                     "experts_one")
    cfg = ExpertsConfig(L, ip, i, k, E, idx.dtype)
    nctas = ctas_per_sm(cfg) * sm_count(z.device)
    compile_for(cfg)(ptr(z), ptr(idx), ptr(w), ptr(w13), ptr(w2), ptr(act), ptr(out), ptr(counters),
                     Int32(m), Int32(nctas), Float32(beta), Float32(lin_beta), current_stream())
    return out


def _cycling(call, routings: list) -> object:
    """A no-argument function running call(idx, w) with the next routing each time (captured
    call by call into time_us's CUDA graph, so its replays cycle too: cold weights)."""
    n = itertools.count()
    return lambda: call(*routings[next(n) % len(routings)])


def check(timing: bool = True, rows: tuple[int, ...] = (1, 8)) -> list[dict]:
    """Kernel `experts_one` vs the verified two-kernel path experts(..., v2=True) (torch.equal),
    stock_ops.experts_grouped (1e-2) and the float64 reference (≤ 1.5x stock's error + 1e-3),
    on the real LatentMoE weights at K3 TP16 shapes, for M in `rows`, with the padding skip
    (inter=I, the step's case) and without it (M = 1); int32 ids equal, nothing written
    outside `out`, a repeat call equal and the counters back to zero. With timing (CUDA-graph
    replays, cold weights cycling 4 routings as moe_experts.check): `kernel_us` (one launch)
    vs `v2_pdl_us` (FC1 + FC2v2 with PDL, the current path) vs `stock_us`; `*_same_us`
    repeat one routing; the counters must be zero after the replays."""
    from kimi_decode import stock_ops
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels import moe_experts
    from kimi_decode.kernels.checks import DEVICE, _sync, rel, time_us
    dev = torch.device(DEVICE)
    cfg0, w13, w2 = moe_experts.check_weights(dev)
    beta, lin_beta = cfg0.situ_beta, cfg0.situ_linear_beta
    I, K, L = cfg0.expert_local_inter, cfg0.top_k, cfg0.latent_dim
    counters = make_counters(dev)
    out = []
    cases = [(m, True) for m in rows] + [(rows[0], False)]
    for m, skip in cases:
        inter = I if skip else None
        z, routings = moe_experts.check_inputs(cfg0, m, 1000 + m, dev)
        idx, w = routings[0]
        r = {"kernel": "experts_one", "M": m, "skip_pad": skip}
        with torch.no_grad():
            r_s = stock_ops.experts_grouped(z, idx, w, w13, w2, beta, lin_beta)
            ref = moe_experts.reference(z, idx, w, w13, w2, beta, lin_beta)
            buf = torch.full((m + 1, L), float("nan"), dtype=torch.bfloat16, device=dev)
            r_k = experts_one(z, idx, w, w13, w2, beta, lin_beta, counters, out=buf[1:], inter=inter)
            r_k2 = experts_one(z, idx, w, w13, w2, beta, lin_beta, counters, inter=inter)   # counters reset?
            r_k32 = experts_one(z, idx.int(), w, w13, w2, beta, lin_beta, counters, inter=inter)
            r_v2 = moe_experts.experts(z, idx, w, w13, w2, beta, lin_beta, inter=inter, v2=True)
        _sync()
        e_ks, e_k, e_s = rel(r_k, r_s), rel(r_k, ref), rel(r_s, ref)
        r.update(equal_v2=torch.equal(r_k, r_v2), rel_vs_v2=rel(r_k, r_v2), rel_vs_stock=e_ks, rel_vs_f64=e_k,
                 stock_rel_vs_f64=e_s, repeat_equal=torch.equal(r_k, r_k2), int32_idx_equal=torch.equal(r_k, r_k32),
                 out_bounds_ok=bool(torch.isnan(buf[0]).all()), counters_zero=int(counters.abs().sum()) == 0)
        r["ok"] = (r["equal_v2"] and r["repeat_equal"] and r["int32_idx_equal"] and r["out_bounds_ok"]
                   and r["counters_zero"] and e_ks <= 1e-2 and e_k <= 1.5 * e_s + 1e-3
                   and bool(torch.isfinite(r_k).all()))
        if timing:
            ops = stock_ops.OpSet(k3_tp16(batch=m))
            dst = torch.empty(m, L, dtype=torch.bfloat16, device=dev)
            calls = [("stock", lambda i_, w_: ops.experts(z, i_, w_, w13, w2, beta, lin_beta)),
                     ("kernel", lambda i_, w_: experts_one(z, i_, w_, w13, w2, beta, lin_beta, counters, out=dst,
                                                           inter=inter)),
                     ("v2_pdl", lambda i_, w_: moe_experts.experts(z, i_, w_, w13, w2, beta, lin_beta, out=dst,
                                                                   inter=inter, pdl=True, v2=True))]
            for what, call in calls:
                r[f"{what}_us"] = time_us(_cycling(call, routings))
                r[f"{what}_same_us"] = time_us(_cycling(call, routings[:1]))
            r["counters_zero_after_replays"] = int(counters.abs().sum()) == 0
            r["ok"] = r["ok"] and r["counters_zero_after_replays"]
            nbytes = m * K * 3 * (I if skip else w2.shape[-1]) * L * 2
            r["kernel_tbs"] = nbytes / (r["kernel_us"] * 1e-6) / 1e12
        out.append(r)
    del w13, w2
    return out


if __name__ == "__main__":
    for row in check():
        print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
