"""AttnRes mix + RMSNorm with one row spread over a CLUSTER of C CTAs (kernel "attn_res_mc").

Same formula, modes and rounding points as kernels/attn_res.py (read its docstring first):
plain (prefix' = prefix + delta, or no delta), attn_res_ar (delta = bf16(Σ_r slot_r), reset or
not), attn_res_ag (delta read in place from the all-gather slots), optional block write. What
changes is the layout. The one-CTA kernel puts a whole row on ONE SM: at B = 1 (M = 1) the
`attn_res` op (224 threads) runs 5.0 us in the CUDA-graph step and `mlp_res` (attn_res_ar,
896 threads, 16 slots × 14 KB = 229 KB through one SM) 5.7 us, both at ~1% of DRAM peak
(bench/ncu_fused_b1.md): latency and one-SM bandwidth bound, on 1 SM of 132.

Layout: grid (C, M), cluster (C, 1, 1): the C CTAs of cluster m share row m, CTA q owns the
columns of vectors q·T·VPT .. (q+1)·T·VPT - 1 (T threads, VPT vectors of 8 per thread; thread
t's vector i is c = q·T·VPT + t + i·T). At K3 (D = 7168, 896 vectors) C = 7, T = 128, VPT = 1:
7 is the largest portable cluster size (≤ 8) for which the vectors split into whole warps
(896 = 7 · 128; C = 8 gives 112 vectors per CTA, 3.5 warps, a partial warp whose full-mask
shuffles are undefined; C = 14 needs a non-portable cluster that the scheduler may not place
beside other kernels' CTAs). Every thread keeps all nb + 1 sources of its columns in
registers between the passes (fp32, (nb+1)·8·VPT values: 72 at nb = 8, VPT = 1; the one-CTA
kernel re-reads the block sources from L1/L2 in pass 2), so each source byte is read from
global memory once in the whole grid, and the 16 slot rows are read by 7 SMs in parallel.

Cross-CTA reductions through the cluster's distributed shared memory (option (a) of the task;
chosen over global scratch + an atomic grid barrier because the DSL exposes it cleanly:
`cute.arch.map_dsmem_ptr` (mapa.shared::cluster), an LLVM store to that pointer
(st.shared::cluster), `cluster_arrive` / `cluster_wait` (barrier.cluster.arrive, .release by
default / barrier.cluster.wait, .acquire by default), `launch(cluster=[C, 1, 1])`; it needs no
scratch buffer, no counter that must survive CUDA-graph replays, and no spin loop):
    1. pass 1 as in the one-CTA kernel, then the CTA reduction of all 2·(nb+1) sums
       (`block_sums`: 2 bar.sync), totals in the CTA's shared `tot`;
    2. PUSH: thread t < 2·(nb+1)·C stores total k = t // C into CTA (t % C)'s `xred[k, q]`
       (st.shared::cluster); barrier.cluster arrive/wait; every thread sums xred[k, 0..C-1] of
       its own shared memory in rank order 0, 1, .., C-1. Every CTA adds the same C fp32 values
       in the same order, so all C CTAs get bit-identical softmax weights;
    3. pass 2 as before, Σh² reduced the same way (row 2·(nb+1) of xred: no reuse, no WAR).
A cluster_arrive_relaxed at the very start and its cluster_wait before the first remote
store make sure every CTA of the cluster has started before its shared memory is written
(the CUDA guide's rule for DSMEM); after the last barrier no CTA touches another's shared
memory, so no trailing barrier is needed before exit. Barriers: 4 bar.sync + 3 cluster
arrive/wait pairs, whatever nb.

Loads first (LOADS_FIRST, the default): right after the chain's wait every thread issues all of
its pass-1 loads (the nb block vectors, the prefix unless reset, the delta or the world slot
vectors) into registers as stored, then mixes them in exactly as before (the same conversions,
adds and roundings in the same order, so every output bit is unchanged). Why: the first build
loaded each source where it was mixed in, and ptxas kept that order, one or two loads per
dependent round trip: ncu on the B = 1, k = 7 step at 3582044 (cold) had mlp_res (attn_res_ar,
16 slots, M = 8) at 7.9 us with eight such stalls after its wait (~half its warp-state samples)
and attn_res (ag) at 4.5 us. Register cost: ~8 more per thread at nb = 4 (83 vs 75, ptxas).

Rounding points: exactly the one-CTA kernel's (fp32 accumulation; prefix' = bf16 of the same
fp32 expression per element, delta = bf16(Σ slots in slot order); out rounded once to bf16).
prefix' and the block write are therefore bit-equal to the one-CTA kernel's; only the fp32
summation order of the 2·(nb+1) + 1 row sums changes (thread → warp butterfly → CTA → C CTAs
in rank order), so `out` may differ from the one-CTA kernel's in the last bf16 bit of a few
elements. The check's tolerance is the existing one vs stock: rel L2 ≤ 1e-2 vs stock and vs
the one-CTA kernel, and ≤ 1.5 × stock's + 1e-3 vs the float64 statement.

Expected at M = 1 (not measured: the device check times it; arithmetic):
- mlp_res (ar, 16 slots): bytes per SM 229 KB / 7 = 33 KB of slots + (nb+1)·14 KB / 7 of
  sources, instead of 229 KB + (nb+1)·14 KB on one SM. One SM streamed ~250 KB in ~5.7 us
  (~44 B/ns); at that per-SM rate 35 KB take ~0.8 us, so what remains is the fixed part
  (launch, the dependent load round trips, 4 CTA + 3 cluster barriers): expected ~2.5-3.5 us
  in the step instead of 5.7.
- attn_res (plain/ag, nb = 1..8): ~(nb + 3)·14 KB on one SM at 5.0 us, mostly latency; 7 SMs
  cut each thread's loads from 4·(nb+3) to (nb+3) vectors (one round trip's worth), expected
  ~2.5-3.5 us. Together ~4-5 us of the two ops' 10.7 us per layer, if the cluster barriers
  cost what a CTA barrier round through shared memory does (~0.1-0.3 us each; unmeasured).
Measured (H200, check at 801b1da, bench/fused_correctness.md; CUDA-graph replays, M = 1, no
block write): ar nb = 1 3.54 us vs 5.19 for the one-CTA kernel (nb = 8: 4.85 vs 8.97); plain
nb = 1 3.00 vs 3.81 (nb = 8: 4.40 vs 7.21); ag nb = 1 3.02 vs 3.90; stock's op chain 25-32 us. Every mode
passed (prefix' and blocks equal to the one-CTA kernel and stock).

Check on the GPU (vs the one-CTA kernel and stock, every mode, timing both):
    python -m kimi_decode.kernels.attn_res_mc
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

from kimi_decode.kernels import attn_res, chain
from kimi_decode.kernels._common import current_stream, ptr
from kimi_decode.kernels.attn_res import VEC, AttnResConfig, AttnResRMSNorm
from kimi_decode.kernels.attn_res import can_implement as one_cta_can_implement

MAX_CTAS = 8     # the portable cluster size on sm_90 (no non-portable opt-in needed)
# Every global load of pass 1 (the block sources, the prefix, the delta or the world slots)
# issued into registers before the first conversion (module docstring, "Loads first"). False:
# the first build's order (each source loaded where it is mixed in), which ptxas scheduled as
# one or two loads per dependent round trip: ncu at 3582044 (mlp_res at M = 8, 16 slots) had
# eight such stalls, ~half the kernel's 7.9 us.
LOADS_FIRST = True


@dataclass(frozen=True)
class AttnResMCConfig(AttnResConfig):
    """AttnResConfig plus the cluster size: `ctas` CTAs per row, each owning hidden / ctas
    columns (vec_per_thread vectors of 8 per thread)."""

    ctas: int = 7
    # PDL chain: release the successor at the kernel's start (kernels/chain.py, early
    # release; the wrapper sets it from chain.early_release(M))
    early: bool = False

    @property
    def threads(self) -> int:
        return self.hidden // (VEC * self.vec_per_thread * self.ctas)


def pick_ctas(hidden: int, vec_per_thread: int = 1) -> int:
    """The cluster size for `hidden`: the largest C ≤ 8 whose column split gives whole warps
    (hidden / (8·VPT·C) a multiple of 32, at most 1024 threads); 0 if none (K3: 7)."""
    for c in range(MAX_CTAS, 0, -1):
        t, rem = divmod(hidden, VEC * vec_per_thread * c)
        if rem == 0 and t % 32 == 0 and 32 <= t <= 1024:
            return c
    return 0


def can_implement(hidden: int, num_blocks: int, slots: int, dtypes: tuple[torch.dtype, ...],
                  ctas: int, vec_per_thread: int = 1, world: int = 0, gather: int = 0) -> bool:
    """The one-CTA kernel's limits with the row split over `ctas` CTAs (1 ≤ ctas ≤ 8, every
    CTA a whole number of warps): the one-CTA rule applied to hidden / ctas columns per CTA is
    the one-CTA rule with ctas·VPT vectors per thread."""
    return (1 <= ctas <= MAX_CTAS and vec_per_thread >= 1
            and one_cta_can_implement(hidden, num_blocks, slots, dtypes,
                                      vec_per_thread=vec_per_thread * ctas, world=world, gather=gather))


class AttnResMC(AttnResRMSNorm):
    """out = RMSNorm(AttnRes mix), one row per cluster of C CTAs; see the module docstring.
    Reuses the one-CTA class's views (`_views`), `load_source` (with M = gridDim.y passed in),
    `softmax`, `block_sums`, `sum_squares` and `store_out` (through its own `col`);
    sum_slots and the column index are re-written for the split."""

    def __init__(self, cfg: AttnResMCConfig) -> None:
        super().__init__(cfg)
        self.ctas = cfg.ctas
        self.cta_vecs = self.threads * self.vpt          # vectors owned by one CTA
        self.nred = 2 * self.nsrc + 1                    # pass-1 sums, then Σh²
        self.xcols = (cfg.ctas + 3) // 4 * 4             # xred row padded to 16 bytes
        self.loads_first = LOADS_FIRST
        # raw vectors per thread vector: the nb blocks, the prefix (unless reset), the delta
        # (1) or the world slots
        self.has_prefix = not (cfg.world > 0 and cfg.reset)
        self.ndel = cfg.world if cfg.world > 0 else (1 if cfg.has_delta else 0)

    @cute.jit
    def __call__(self, out: cute.Pointer, blocks: cute.Pointer, prefix: cute.Pointer,
                 delta: cute.Pointer, prefix_out: cute.Pointer, w_mix: cute.Pointer,
                 norm_w: cute.Pointer, m: Int32, write_slot: Int32, eps: Float32,
                 stream: cuda.CUstream):
        mBlk, mDel, mW, mN = self._views(blocks, delta, w_mix, norm_w, m)   # as the one-CTA kernel
        self.kernel(self._rows(out, m), mBlk, self._rows(prefix, m), mDel,
                    self._rows(prefix_out, m), mW, mN, write_slot, eps).launch(
            grid=[self.ctas, m, 1], block=[self.threads, 1, 1], cluster=[self.ctas, 1, 1],
            stream=stream, use_pdl=chain.chain_on())

    @cute.jit
    def col(self, q: Int32, tidx: Int32, i: cutlass.Constexpr[int]) -> Int32:
        """The vector index of this thread's i-th vector: CTA q owns cta_vecs consecutive ones."""
        return q * self.cta_vecs + tidx + i * self.threads

    @cute.jit
    def sum_slots(self, row: Int32, q: Int32, nrows: Int32, write_slot: Int32, mBlk: cute.Tensor,
                  mP: cute.Tensor, mDel: cute.Tensor, mPOut: cute.Tensor, buf: cute.Tensor,
                  vr: cute.Tensor):
        """attn_res_ar: vr[nb, i, :] = prefix' at this thread's vector i, exactly the one-CTA
        kernel's sum_slots (delta = bf16(Σ_r slot_r) in slot order; prefix' = delta or
        bf16(prefix + delta); written to mPOut and the block slot) on this CTA's columns."""
        tidx, _, _ = cute.arch.thread_idx()
        S = self.nsrc - 1                                # prefix' is the last source
        for i in cutlass.range_constexpr(self.vpt):
            for j in cutlass.range_constexpr(VEC):
                vr[S, i, j] = Float32(0.0)
        for r in cutlass.range_constexpr(self.cfg.world):
            for i in cutlass.range_constexpr(self.vpt):
                cute.autovec_copy(mDel[r * nrows + row, self.col(q, tidx, i), None], buf)
                for j in cutlass.range_constexpr(VEC):
                    vr[S, i, j] = vr[S, i, j] + buf[j].to(Float32)
        for i in cutlass.range_constexpr(self.vpt):
            c = self.col(q, tidx, i)
            for j in cutlass.range_constexpr(VEC):
                vr[S, i, j] = vr[S, i, j].to(self.src_t).to(Float32)
            if cutlass.const_expr(not self.cfg.reset):
                cute.autovec_copy(mP[row, c, None], buf)
                for j in cutlass.range_constexpr(VEC):
                    vr[S, i, j] = (buf[j].to(Float32) + vr[S, i, j]).to(self.src_t).to(Float32)
            for j in cutlass.range_constexpr(VEC):
                buf[j] = vr[S, i, j].to(self.src_t)
            cute.autovec_copy(buf, mPOut[row, c, None])
            if cutlass.const_expr(self.cfg.has_write):
                cute.autovec_copy(buf, mBlk[row, write_slot, c, None])

    @cute.jit
    def issue_loads(self, row: Int32, q: Int32, nrows: Int32, mBlk: cute.Tensor, mP: cute.Tensor,
                    mDel: cute.Tensor, rawb: cute.Tensor, rawd: cute.Tensor):
        """Loads first: every source vector of this thread as stored, no arithmetic between
        the loads (so all of them are in flight together): rawb[s] = block s (s < nb), rawb[nb]
        = the prefix (unless reset); rawd[r] = slot r (attn_res_ar) or rawd[0] = the delta
        (plain, or the all-gather slot's vector in attn_res_ag; load_source's indexing)."""
        tidx, _, _ = cute.arch.thread_idx()
        nb = self.cfg.num_blocks
        for i in cutlass.range_constexpr(self.vpt):
            c = self.col(q, tidx, i)
            for s in cutlass.range_constexpr(nb):
                cute.autovec_copy(mBlk[row, s, c, None], rawb[s, i, None])
            if cutlass.const_expr(self.has_prefix):
                cute.autovec_copy(mP[row, c, None], rawb[nb, i, None])
            if cutlass.const_expr(self.cfg.world > 0):
                for r in cutlass.range_constexpr(self.cfg.world):
                    cute.autovec_copy(mDel[r * nrows + row, c, None], rawd[r, i, None])
            elif cutlass.const_expr(self.cfg.has_delta):
                if cutlass.const_expr(self.cfg.gather > 0):
                    nvs = self.cfg.gather // VEC
                    cute.autovec_copy(mDel[(c // nvs) * nrows + row, c % nvs, None], rawd[0, i, None])
                else:
                    cute.autovec_copy(mDel[row, c, None], rawd[0, i, None])

    @cute.jit
    def source_from_raw(self, s: cutlass.Constexpr[int], i: cutlass.Constexpr[int], rawb: cute.Tensor,
                        rawd: cute.Tensor, acc: cute.Tensor):
        """acc[0:8] = source s at this thread's vector i from the loaded raws, load_source's
        arithmetic (prefix' = bf16(prefix + delta) where there is a delta; the ar mode's
        prefix' is sum_slots_from_raw's)."""
        for j in cutlass.range_constexpr(VEC):
            acc[j] = rawb[s, i, j].to(Float32)
        if cutlass.const_expr(s == self.cfg.num_blocks and self.cfg.has_delta):
            for j in cutlass.range_constexpr(VEC):
                acc[j] = (acc[j] + rawd[0, i, j].to(Float32)).to(self.src_t).to(Float32)

    @cute.jit
    def sum_slots_from_raw(self, rawb: cute.Tensor, rawd: cute.Tensor, vr: cute.Tensor):
        """attn_res_ar from the loaded raws: vr[nb, i, :] = prefix', sum_slots' arithmetic
        (delta = bf16(Σ_r slot_r) in slot order; prefix' = delta, or bf16(prefix + delta))."""
        S = self.nsrc - 1
        for i in cutlass.range_constexpr(self.vpt):
            for j in cutlass.range_constexpr(VEC):
                vr[S, i, j] = Float32(0.0)
            for r in cutlass.range_constexpr(self.cfg.world):
                for j in cutlass.range_constexpr(VEC):
                    vr[S, i, j] = vr[S, i, j] + rawd[r, i, j].to(Float32)
            for j in cutlass.range_constexpr(VEC):
                vr[S, i, j] = vr[S, i, j].to(self.src_t).to(Float32)
            if cutlass.const_expr(not self.cfg.reset):
                for j in cutlass.range_constexpr(VEC):
                    vr[S, i, j] = (rawb[S, i, j].to(Float32) + vr[S, i, j]).to(self.src_t).to(Float32)

    @cute.jit
    def store_prefix(self, row: Int32, q: Int32, write_slot: Int32, mBlk: cute.Tensor,
                     mPOut: cute.Tensor, buf: cute.Tensor, vr: cute.Tensor):
        """prefix' (vr's last source) to mPOut and, with a block write, to the block slot."""
        tidx, _, _ = cute.arch.thread_idx()
        S = self.nsrc - 1
        for i in cutlass.range_constexpr(self.vpt):
            c = self.col(q, tidx, i)
            for j in cutlass.range_constexpr(VEC):
                buf[j] = vr[S, i, j].to(self.src_t)
            cute.autovec_copy(buf, mPOut[row, c, None])
            if cutlass.const_expr(self.cfg.has_write):
                cute.autovec_copy(buf, mBlk[row, write_slot, c, None])

    @cute.jit
    def cluster_sums(self, vals: cute.Tensor, n: cutlass.Constexpr[int], base: cutlass.Constexpr[int],
                     tot: cute.Tensor, xred: cute.Tensor, rank: Int32):
        """vals[0:n] ← their sums over the cluster. On entry tot[base .. base+n-1] holds this
        CTA's totals (block_sums). Thread t < n·C pushes total k = t // C into CTA d = t % C's
        xred[base + k, rank] (st.shared::cluster); barrier.cluster arrive (release) / wait
        (acquire); then every thread adds xred[base + k, 0..C-1] in rank order."""
        tidx, _, _ = cute.arch.thread_idx()
        C = self.ctas
        for r in cutlass.range_constexpr((n * C + self.threads - 1) // self.threads):
            idx = tidx + r * self.threads
            if idx < n * C:
                k = idx // C
                dst = idx - k * C
                v = Float32(tot[base + k])
                remote = cute.arch.map_dsmem_ptr(xred.iterator + ((base + k) * self.xcols + rank), dst)
                llvm.store(v.ir_value(), remote.to_llvm_ptr())
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        for k in cutlass.range_constexpr(n):
            s = Float32(0.0)
            for d in cutlass.range_constexpr(C):
                s += xred[base + k, d]
            vals[k] = s

    @cute.kernel
    def kernel(self, mOut: cute.Tensor, mBlk: cute.Tensor, mP: cute.Tensor, mDel: cute.Tensor,
               mPOut: cute.Tensor, mW: cute.Tensor, mN: cute.Tensor, write_slot: Int32,
               eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        q, row, _ = cute.arch.block_idx()            # column block q of row `row`
        _, nrows, _ = cute.arch.grid_dim()           # M
        rank = cute.arch.block_idx_in_cluster()      # == q: cluster (C, 1, 1), grid.x = C
        warp = cute.arch.warp_idx()                  # all lanes, top level (a full-warp shuffle)
        lane = cute.arch.lane_idx()
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout((self.nred, self.warps), stride=(self.warps, 1)))
        tot = smem.allocate_tensor(Float32, cute.make_layout(self.nred))
        xred = smem.allocate_tensor(Float32, cute.make_layout((self.nred, self.xcols), stride=(self.xcols, 1)),
                                    byte_alignment=16)
        # every CTA of the cluster arrives once it runs; the matching wait (before the first
        # remote store) makes sure no CTA's shared memory is written before that CTA started
        cute.arch.cluster_arrive_relaxed()
        chain.begin(self.cfg.early)        # early release: every successor reads only constants first
        buf = cute.make_rmem_tensor(cute.make_layout(VEC), self.src_t)
        acc = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
        part = cute.make_rmem_tensor(cute.make_layout(2 * self.nsrc), Float32)
        score = cute.make_rmem_tensor(cute.make_layout(self.nsrc), Float32)
        wv = cute.make_rmem_tensor(cute.make_layout((self.vpt, VEC), stride=(VEC, 1)), Float32)
        nv = cute.make_rmem_tensor(cute.make_layout((self.vpt, VEC), stride=(VEC, 1)), mN.element_type)
        for i in cutlass.range_constexpr(self.vpt):
            c = self.col(q, tidx, i)
            cute.autovec_copy(mW[c, None], wv[i, None])
            cute.autovec_copy(mN[c, None], nv[i, None])
        # PDL chain: the weights above are constants; every source below was written by
        # earlier kernels of the step
        chain.enter_or_wait(self.cfg.early)
        # every source of this thread's vectors, fp32, kept in registers for pass 2 (no re-read:
        # each source byte is read from global memory once in the whole grid)
        vr = cute.make_rmem_tensor(cute.make_layout((self.nsrc, self.vpt, VEC),
                                                    stride=(self.vpt * VEC, VEC, 1)), Float32)

        # Pass 1 on this CTA's columns (the one-CTA kernel's pass 1); with LOADS_FIRST every
        # source vector is loaded before the first conversion and mixed in from registers
        rawb = cute.make_rmem_tensor(cute.make_layout((self.nsrc, self.vpt, VEC),
                                                      stride=(self.vpt * VEC, VEC, 1)), self.src_t)
        rawd = cute.make_rmem_tensor(cute.make_layout((max(self.ndel, 1), self.vpt, VEC),
                                                      stride=(self.vpt * VEC, VEC, 1)), self.src_t)
        if cutlass.const_expr(self.loads_first):
            self.issue_loads(row, q, nrows, mBlk, mP, mDel, rawb, rawd)
        for s in cutlass.range_constexpr(self.nsrc):
            a_ss = Float32(0.0)
            a_dw = Float32(0.0)
            if cutlass.const_expr(self.loads_first):
                if cutlass.const_expr(self.cfg.world > 0 and s == self.nsrc - 1):
                    self.sum_slots_from_raw(rawb, rawd, vr)
                else:
                    for i in cutlass.range_constexpr(self.vpt):
                        self.source_from_raw(s, i, rawb, rawd, acc)
                        for j in cutlass.range_constexpr(VEC):
                            vr[s, i, j] = acc[j]
                if cutlass.const_expr(s == self.nsrc - 1 and self.cfg.has_delta):
                    self.store_prefix(row, q, write_slot, mBlk, mPOut, buf, vr)
            elif cutlass.const_expr(self.cfg.world > 0 and s == self.nsrc - 1):
                self.sum_slots(row, q, nrows, write_slot, mBlk, mP, mDel, mPOut, buf, vr)
            else:
                for i in cutlass.range_constexpr(self.vpt):
                    c = self.col(q, tidx, i)
                    self.load_source(s, row, c, mBlk, mP, mDel, buf, acc, nrows)
                    for j in cutlass.range_constexpr(VEC):
                        vr[s, i, j] = acc[j]
                    if cutlass.const_expr(s == self.nsrc - 1 and self.cfg.has_delta):
                        for j in cutlass.range_constexpr(VEC):
                            buf[j] = acc[j].to(self.src_t)
                        cute.autovec_copy(buf, mPOut[row, c, None])
                        if cutlass.const_expr(self.cfg.has_write):
                            cute.autovec_copy(buf, mBlk[row, write_slot, c, None])
            for i in cutlass.range_constexpr(self.vpt):
                for j in cutlass.range_constexpr(VEC):
                    a_ss += vr[s, i, j] * vr[s, i, j]
                    a_dw += vr[s, i, j] * wv[i, j]
            part[2 * s] = a_ss
            part[2 * s + 1] = a_dw
        self.block_sums(part, 2 * self.nsrc, 0, red, tot, warp, lane)
        cute.arch.cluster_wait()                     # every CTA of the cluster has started
        self.cluster_sums(part, 2 * self.nsrc, 0, tot, xred, rank)

        # Softmax over sources (every thread of every CTA, from bit-identical sums)
        self.softmax(part, score, eps)

        # Pass 2: h on this CTA's columns (from registers), Σh² over the cluster, RMSNorm
        h = cute.make_rmem_tensor(cute.make_layout((self.vpt, VEC), stride=(VEC, 1)), Float32)
        h.fill(0.0)
        for s in cutlass.range_constexpr(self.nsrc):
            for i in cutlass.range_constexpr(self.vpt):
                for j in cutlass.range_constexpr(VEC):
                    h[i, j] = h[i, j] + score[s] * vr[s, i, j]
        a_h = cute.make_rmem_tensor(cute.make_layout(1), Float32)
        self.sum_squares(h, a_h)
        self.block_sums(a_h, 1, 2 * self.nsrc, red, tot, warp, lane)
        self.cluster_sums(a_h, 1, 2 * self.nsrc, tot, xred, rank)
        r = cute.math.rsqrt(a_h[0] / self.D + eps)
        self.store_out(h, nv, r, mOut, row, q, tidx)


def compile_for(cfg: AttnResMCConfig, norm_dtype: torch.dtype) -> object:
    """The compiled kernel for `cfg` (cached; compiles to sm_90a PTX even without a GPU)."""
    return attn_res.compile_for(cfg, norm_dtype, AttnResMC, ("attn_res_mc", LOADS_FIRST))


def attn_res_mc(blocks: torch.Tensor, num_blocks: int, prefix: torch.Tensor | None,
                w_mix: torch.Tensor, norm_w: torch.Tensor, eps: float,
                delta: torch.Tensor | None = None, write_slot: int | None = None,
                out: torch.Tensor | None = None, *, delta_slots: torch.Tensor | None = None,
                reset: bool = False, delta_gather: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """attn_res.attn_res_rmsnorm's contract (same arguments, modes and results), computed by
    the cluster kernel: one cluster of pick_ctas(D) CTAs per row. Raises ValueError where this
    kernel cannot run (the caller then uses the one-CTA kernel)."""
    m, slots, d = blocks.shape
    ctas = pick_ctas(d)
    modes = (delta is not None) + (delta_slots is not None) + (delta_gather is not None)
    if modes > 1:
        raise ValueError("pass one of delta, delta_slots, delta_gather")
    if reset and delta_slots is None:
        raise ValueError("reset=True needs delta_slots (without them pass prefix=delta, no delta)")
    world, gather, src = 0, 0, delta
    if delta_slots is not None:
        world, src = (delta_slots.shape[0] if delta_slots.dim() == 3 else 0), delta_slots
        if world < 1 or tuple(delta_slots.shape[1:]) != (m, d):
            raise ValueError(f"delta_slots must be [world, {m}, {d}], got {tuple(delta_slots.shape)}")
        if world * m * d >= 2 ** 31:
            raise ValueError("attn_res_mc: world · M · D must be < 2^31")
    if delta_gather is not None:
        if delta_gather.dim() != 3 or delta_gather.shape[1] != m or \
                delta_gather.shape[0] * delta_gather.shape[2] != d:
            raise ValueError(f"delta_gather must be [world, {m}, n] with world·n = {d}, "
                             f"got {tuple(delta_gather.shape)}")
        gather, src = delta_gather.shape[2], delta_gather
        if m * d >= 2 ** 31:
            raise ValueError("attn_res_mc: M · D must be < 2^31")
    dt = blocks.dtype
    if not reset and (prefix is None or prefix.dtype != dt or tuple(prefix.shape) != (m, d)):
        raise ValueError(f"prefix must be [{m}, {d}] of the blocks' dtype")
    if src is not None and src.dtype != dt:
        raise ValueError("blocks, prefix and delta must share one dtype")
    if w_mix.dtype != torch.float32:
        raise ValueError("w_mix must be fp32")
    if not can_implement(d, num_blocks, slots, (dt, norm_w.dtype), ctas, world=world, gather=gather):
        raise ValueError(f"attn_res_mc kernel cannot run hidden={d} nb={num_blocks} slots={slots} "
                         f"world={world} gather={gather}")
    has_delta = src is not None
    if write_slot is not None and not num_blocks <= write_slot < slots:
        raise ValueError("write_slot must be in [num_blocks, slots): the mix reads blocks[:nb]")
    if write_slot is not None and not has_delta:   # nothing to compute: prefix' is prefix
        blocks[:, write_slot].copy_(prefix)
        write_slot = None
    cfg = AttnResMCConfig(d, num_blocks, slots, has_delta, write_slot is not None, dt,
                          vec_per_thread=1, world=world, reset=reset, gather=gather, ctas=ctas,
                          early=chain.early_release(m))
    out = torch.empty(m, d, dtype=torch.bfloat16, device=blocks.device) if out is None else out
    new_prefix = torch.empty(m, d, dtype=dt, device=blocks.device) if has_delta else prefix
    fn = compile_for(cfg, norm_w.dtype)
    fn(ptr(out), ptr(blocks), ptr(new_prefix if reset else prefix), ptr(src if has_delta else prefix),
       ptr(new_prefix), ptr(w_mix), ptr(norm_w), Int32(m), Int32(write_slot or 0), Float32(eps),
       current_stream())
    return out, new_prefix


MODES = ("prefix", "plain", "ar", "ag")   # no delta; delta; all-reduce slots; all-gather slots


def _inputs(mode: str, m: int, nb: int, fill: str, world: int, D: int, n_slots: int,
            dev: torch.device, seed: int) -> dict:
    """Random blocks, prefix and the mode's delta operand (bf16, K3 width). fill "random":
    every slot of the collective buffer random (real TP); "zero": only slot `rank` (0) set,
    as the one-GPU simulation leaves it."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = {"blocks": torch.randn(m, n_slots, D, generator=gen, device=dev).bfloat16(),
         "prefix": torch.randn(m, D, generator=gen, device=dev).bfloat16()}
    if mode == "plain":
        x["delta"] = torch.randn(m, D, generator=gen, device=dev).bfloat16()
    elif mode in ("ar", "ag"):
        shape = (world, m, D) if mode == "ar" else (world, m, D // world)
        buf = torch.randn(*shape, generator=gen, device=dev)
        if fill == "zero":
            buf[1:].zero_()
        x["delta_slots" if mode == "ar" else "delta_gather"] = (0.25 * buf).bfloat16()
    return x


def _stock_delta(mode: str, x: dict) -> torch.Tensor | None:
    """The collective's result stock's res_mix takes as its delta: the slot sum (fp32, slot
    order, one rounding: attn_res.slot_sum) or the concatenated gather (attn_res.gather_cols)."""
    from kimi_decode.kernels.attn_res import gather_cols, slot_sum
    if mode == "ar":
        return slot_sum(x["delta_slots"])
    if mode == "ag":
        return gather_cols(x["delta_gather"])
    return x.get("delta")


def check(timing: bool = True, rows: tuple[int, ...] = (1, 2, 8, 64), nbs: tuple[int, ...] = (1, 8),
          world: int = 16) -> list[dict]:
    """attn_res_mc vs the one-CTA kernel (attn_res.attn_res_rmsnorm, verified) and vs stock
    AttnRes.update_and_mix, every mode the fused step uses: prefix only (has_delta False),
    plain delta, ar (16 slots, reset False/True, fills zero/random), ag (gather 448, fills
    zero/random), each with and without a block write (nb < 8), at K3 width, M = 1, 2, 8 and 64
    (64: B = 64, where the one-CTA kernel puts each row's 16 slot rows, 229 KB, on one SM).
    Stock gets the collective's result (_stock_delta) and the block write is done after it,
    as the fused fallback does. Pass: prefix' and blocks bit-equal to the one-CTA kernel's
    (same rounding points) and to stock's; out rel L2 ≤ 1e-2 vs stock and vs the one-CTA
    kernel (only the fp32 order of the row sums differs), ≤ 1.5 × stock's + 1e-3 vs float64.
    `out_mismatch_vs_one_cta`: the fraction of bf16 outputs not bit-equal to the one-CTA
    kernel's (reported, not gated). Timing (M = 1, 8 and 64, no write, fill zero): stock, the one-CTA
    kernel and this kernel, CUDA-graph replays (checks.time_us)."""
    import kimi_decode.kernels.attn_res as k_ar
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels import checks
    from kimi_decode.kernels.checks import _sync, rel, time_us
    from kimi_decode.stock import AttnRes
    from kimi_decode.weights import Seeder
    cfg = k3_tp16()
    dev = torch.device(checks.DEVICE)
    D, n_slots = cfg.hidden, cfg.attn_res_slots
    mod = AttnRes(cfg, Seeder(cfg, dev).sub("check.attn_res_mc"))
    out = []
    for mode in MODES:
        for fill in (("zero", "random") if mode in ("ar", "ag") else ("random",)):
            for reset in ((False, True) if mode == "ar" else (False,)):
                for m in rows:
                    for nb in nbs:
                        for write in (False, True):
                            slot = nb if write else None
                            if slot is not None and slot >= n_slots:
                                continue
                            seed = 100000 * MODES.index(mode) + 1000 * m + 10 * nb + 4 * reset + 2 * write + (fill == "zero")
                            x = _inputs(mode, m, nb, fill, world, D, n_slots, dev, seed)
                            kw = {k: v for k, v in x.items() if k in ("delta", "delta_slots", "delta_gather")}
                            delta = _stock_delta(mode, x)
                            b_s, b_1, b_k = (x["blocks"].clone() for _ in range(3))
                            with torch.no_grad():
                                if delta is None:     # prefix only: stock's mix of the prefix
                                    p_s, x_s = x["prefix"], mod(x["prefix"], b_s, nb)
                                else:
                                    p_s, x_s = mod.update_and_mix(x["prefix"], delta, b_s, nb, reset)
                                if slot is not None:
                                    b_s[:, slot].copy_(p_s)
                                x_1, p_1 = k_ar.attn_res_rmsnorm(b_1, nb, x["prefix"], mod.w, mod.norm, cfg.rms_eps,
                                                                 write_slot=slot, reset=reset, **kw)
                                x_k, p_k = attn_res_mc(b_k, nb, x["prefix"], mod.w, mod.norm, cfg.rms_eps,
                                                       write_slot=slot, reset=reset, **kw)
                            _sync()
                            ref = k_ar.reference(x["blocks"], nb, x["prefix"], mod.w, mod.norm, cfg.rms_eps,
                                                 reset=reset, **kw)
                            e_ks, e_k1, e_k, e_s = rel(x_k, x_s), rel(x_k, x_1), rel(x_k, ref), rel(x_s, ref)
                            exact = (torch.equal(p_k, p_1) and torch.equal(b_k, b_1) and torch.equal(p_k, p_s)
                                     and torch.equal(b_k, b_s))
                            ok = exact and e_ks <= 1e-2 and e_k1 <= 1e-2 and e_k <= 1.5 * e_s + 1e-3
                            r = {"kernel": "attn_res_mc", "mode": mode, "M": m, "nb": nb, "reset": reset,
                                 "write": slot is not None, "fill": fill, "rel_vs_stock": e_ks,
                                 "rel_vs_one_cta": e_k1, "rel_vs_f64": e_k, "stock_rel_vs_f64": e_s,
                                 "prefix_blocks_equal": exact,
                                 "out_mismatch_vs_one_cta": float((x_k != x_1).double().mean()), "ok": ok}
                            if timing and m in (1, 8, 64) and slot is None and fill == ("zero" if mode in ("ar", "ag") else "random"):
                                def stock_call() -> None:
                                    if delta is None:
                                        mod(x["prefix"], b_s, nb)
                                    else:
                                        mod.update_and_mix(x["prefix"], delta, b_s, nb, reset)

                                def one_cta_call() -> None:
                                    k_ar.attn_res_rmsnorm(b_1, nb, x["prefix"], mod.w, mod.norm, cfg.rms_eps,
                                                          reset=reset, **kw)

                                def mc_call() -> None:
                                    attn_res_mc(b_k, nb, x["prefix"], mod.w, mod.norm, cfg.rms_eps,
                                                reset=reset, **kw)
                                r["stock_us"] = time_us(stock_call)
                                r["one_cta_us"] = time_us(one_cta_call)
                                r["kernel_us"] = time_us(mc_call)
                            out.append(r)
    return out


if __name__ == "__main__":
    from kimi_decode.kernels.checks import _print
    _print(check())
