"""AttnRes mix + RMSNorm in one kernel (KIMI_K3.md §1.3; vLLM's `kimi_k3_attn_res`).

What it fuses, for each row m (a token) of the step:
    prefix' = prefix + delta                       (optional: the previous sublayer's output)
    blocks[slot] = prefix'                         (optional: a new AttnRes block starts)
    sources v_0..v_nb = [blocks[0:nb]..., prefix']
    score_s = <v_s / rms(v_s), w_norm ⊙ w_proj>    rms(v) = sqrt(mean(v²) + eps), fp32
    p = softmax(score)                             over the nb + 1 sources
    h = Σ_s p_s v_s                                the RAW sources, fp32
    out = RMSNorm(h; norm_weight, eps)             bf16
The stock path issues this as a dozen torch kernels (stack, norm, product, softmax, weighted
sum, RMSNorm, casts); here it is one launch.

Layout: one CTA per row; D/8 vectors of 8 elements per row, VPT vectors per thread (so
threads = D / (8·VPT), a multiple of 32; at D = 7168 VPT = 4 gives 224 threads). w (=
w_norm ⊙ w_proj, fp32, folded once at load time) and the RMSNorm weight are loaded once, up
front. Pass 1 streams every source once and accumulates this thread's Σv² and Σv·w per
source with no barrier in between (all sources' loads in flight together), then ONE CTA
reduction of all 2·(nb+1) sums (`block_sums`: a butterfly per sum, one barrier, a second
butterfly across the warp sums, one barrier). Pass 2 re-reads the sources (L1/L2-resident: at
most 9 × 14 KB per row), keeps h in registers (8·VPT floats), reduces Σh² (the same way) and
writes the normalised row with 128-bit stores. Four CTA barriers in all, whatever nb; the first
version reduced each sum on its own (2·(nb+1) + 1 barriers, each source's loads issued only
after the previous source's barriers, and every thread re-reading all warp sums each time:
4.4 us at nb = 1, 11.4 us at nb = 8 for one row on the H200).
score_s uses <v/rms, w> = <v, w> / rms, which needs no normalised copy of v.

attn_res_ar mode (config `world` > 0; wrapper keyword `delta_slots`): the kernel also finishes
the all-reduce in front of it (KIMI_K3.md: o_proj + all-reduce + AttnRes + RMSNorm). `delta`
is then the all-reduce buffer [world, M, D] (the o_proj GEMV writes this rank's partial into
slot `rank`; in real TP the peers write theirs into the other slots, as a one-shot NVLink
all-reduce does; in the SimComm simulation they stay zero) and every rounding matches the stock
path (SimComm.all_reduce = bf16 buf.sum(0), then stock res_mix):
    delta   = bf16( Σ_{r=0..world-1} fp32(slot_r[m]) )   fp32 adds in slot order, one rounding
    prefix' = delta                         (reset: a new block; prefix is not read)
            = bf16( fp32(prefix) + fp32(delta) )          (otherwise; one rounding, as torch)
    then the mix and RMSNorm above with v_nb = fp32(prefix'), out rounded once to bf16.
prefix' is written (a new tensor; also to blocks[m, write_slot] when asked) and kept in
registers (8·VPT floats) for pass 2, so the slots are read once. The buffer is seen as world·M
rows (row r·M + m, M = gridDim.x) so all strides are static and every load is one 128-bit
ld.global.v4: per thread world × VPT = 64 independent loads at TP16 (only the adds chain).
Bytes per row: world × 14 KB (229 KB at TP16; slot `rank` L2-resident after the GEMV wrote it)
+ the usual sources. Expected at M = 1 (one CTA, latency-bound like the plain kernel: 4.4 us at
nb = 1, 11.4 us at nb = 8 on the H200): about +2-4 us for the slot loads, i.e. ~7 us (nb = 1)
/ ~14 us (nb = 8) against stock's copy + sum kernels + the res_mix op chain (~30-40 us eager).
Without world (the default) the generated code is byte-identical to the plain kernel's.

attn_res_ag mode (config `gather` = n > 0; wrapper keyword `delta_gather`): the kernel also
finishes the all-gather in front of it (the MoE block's moe_up writes this rank's slice
[M, n = D/world] into slot `rank` of the all-gather buffer ag [world, M, n]; the next layer's
attention AttnRes consumes the gathered row m = [ag[0] | ag[1] | ..] as its delta). Instead of
a concatenation kernel, the delta is read in place, pure addressing:
    delta[m, s·n + j] = ag[s, m, j];  for the 128-bit vector c (columns 8c .. 8c+7):
    s = c // (n/8), j = 8·(c % (n/8))     (n % 8 == 0, so a vector never straddles two slots)
the buffer seen as world·M rows of n/8 vectors (row s·M + m, M = gridDim.x; strides static,
so each vector is one ld.global.v4). Then exactly the plain has_delta math, same roundings:
    prefix' = bf16( fp32(prefix) + fp32(delta) )   (one rounding, as torch's bf16 add; no reset)
    (blocks[m, write_slot] = prefix' when asked), the mix and RMSNorm with v_nb = fp32(prefix').
The only added work is the integer index (c // 56 and c % 56 at n = 448: a multiply-high).
Expected at M = 1: the plain has_delta kernel's time (4.4 us nb = 1, 11.4 us nb = 8 on the
H200), minus the concatenation launch (~2-3 us in a graph) that stock / today's fused path run
in front of it. With gather = 0 (the default) the generated code is byte-identical.

Check on the GPU (compares with the stock path's own ops and times both):
    python -m kimi_decode.kernels.attn_res          (attn_res)
    python -m kimi_decode.kernels.attn_res ar       (attn_res_ar: check_ar)
    python -m kimi_decode.kernels.attn_res ag       (attn_res_ag: check_ag)
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from kimi_decode.kernels._common import (compile_options, TORCH_TO_CUTE, compiled, current_stream,
                                         dummy_ptr, ptr)

VEC = 8          # elements per 128-bit bf16 vector
MAX_SOURCES = 9  # 8 stored blocks + the live prefix (K3: ceil(93 / 12) = 8)
MAX_WORLD = 32   # attn_res_ar: all-reduce slots summed (unrolled loads; K3 TP16: 16)


@dataclass(frozen=True)
class AttnResConfig:
    """Compile-time choices: sizes, dtypes, and which optional steps the call performs."""

    hidden: int
    num_blocks: int              # nb: stored blocks mixed (the prefix is one more source)
    slots: int                   # blocks buffer holds [M, slots, hidden]
    has_delta: bool              # prefix' = prefix + delta (and prefix' written back)
    has_write: bool              # blocks[m, write_slot] = prefix'
    source_dtype: torch.dtype = torch.bfloat16   # blocks, prefix, delta
    out_dtype: torch.dtype = torch.bfloat16
    vec_per_thread: int = 4
    # attn_res_ar mode (world > 0): `delta` is the all-reduce buffer [world, M, D] and the kernel
    # sums its slots itself, delta = bf16(Σ_r slot_r) in slot order (needs has_delta)
    world: int = 0
    reset: bool = False          # (world > 0 only) prefix' = delta: a new block, prefix not read
    # attn_res_ag mode (gather > 0): `delta` is the all-gather buffer [D / gather, M, gather]
    # (slot s holds columns s·gather .. (s+1)·gather of the delta row); needs has_delta, world 0
    gather: int = 0

    @property
    def threads(self) -> int:
        return self.hidden // (VEC * self.vec_per_thread)


def can_implement(hidden: int, num_blocks: int, slots: int, dtypes: tuple[torch.dtype, ...],
                  vec_per_thread: int = 4, world: int = 0, gather: int = 0) -> bool:
    """Shapes and dtypes this kernel supports (checked before compiling); `world` > 0: the
    attn_res_ar mode's number of all-reduce slots (unrolled, so bounded); `gather` > 0: the
    attn_res_ag mode's slot width n (a multiple of 8 dividing hidden: no vector straddles two
    slots; not together with world)."""
    threads = hidden // (VEC * vec_per_thread)
    return (hidden % (VEC * vec_per_thread) == 0 and threads % 32 == 0 and 32 <= threads <= 1024
            and 0 <= num_blocks <= slots and num_blocks + 1 <= MAX_SOURCES
            and 0 <= world <= MAX_WORLD
            and gather >= 0 and (gather == 0 or (gather % VEC == 0 and hidden % gather == 0
                                                 and world == 0))
            and all(d in (torch.bfloat16, torch.float16, torch.float32) for d in dtypes))


class AttnResRMSNorm:
    """out = RMSNorm(AttnRes mix of [blocks[0:nb], prefix(+delta)]); see the module docstring."""

    def __init__(self, cfg: AttnResConfig) -> None:
        self.cfg = cfg
        self.D = cfg.hidden
        self.nv = cfg.hidden // VEC
        self.vpt = cfg.vec_per_thread
        self.threads = cfg.threads
        self.warps = self.threads // 32
        self.nsrc = cfg.num_blocks + 1
        self.src_t = TORCH_TO_CUTE[cfg.source_dtype]
        self.out_t = TORCH_TO_CUTE[cfg.out_dtype]

    def _rows(self, p: cute.Pointer, m: Int32) -> cute.Tensor:
        return cute.make_tensor(p, cute.make_layout((m, self.nv, VEC), stride=(self.D, VEC, 1)))

    def _views(self, blocks: cute.Pointer, delta: cute.Pointer, w_mix: cute.Pointer,
               norm_w: cute.Pointer, m: Int32) -> tuple[cute.Tensor, ...]:
        """The kernel's views of blocks, delta, w_mix and norm_w (mBlk, mDel, mW, mN); plain
        Python run while __call__ traces (shared with attn_res_mc.AttnResMC.__call__)."""
        slots = self.cfg.slots
        mBlk = cute.make_tensor(blocks, cute.make_layout((m, slots, self.nv, VEC),
                                                         stride=(slots * self.D, self.D, VEC, 1)))
        mW = cute.make_tensor(w_mix, cute.make_layout((self.nv, VEC), stride=(VEC, 1)))
        mN = cute.make_tensor(norm_w, cute.make_layout((self.nv, VEC), stride=(VEC, 1)))
        # attn_res_ar: the all-reduce buffer [world, M, D] seen as world·M rows (row r·M + m),
        # so every stride stays static and the 128-bit alignment of each vector is known
        n_del = m
        if self.cfg.world > 0:
            n_del = m * self.cfg.world
        if self.cfg.gather > 0:
            # attn_res_ag: the all-gather buffer [D/n, M, n] seen as (D/n)·M rows of n/8
            # vectors (row s·M + m); strides static, every vector 16-byte aligned (n % 8 == 0)
            g = self.cfg.gather
            mDel = cute.make_tensor(delta, cute.make_layout((m * (self.D // g), g // VEC, VEC),
                                                            stride=(g, VEC, 1)))
        else:
            mDel = self._rows(delta, n_del)
        return mBlk, mDel, mW, mN

    @cute.jit
    def __call__(self, out: cute.Pointer, blocks: cute.Pointer, prefix: cute.Pointer,
                 delta: cute.Pointer, prefix_out: cute.Pointer, w_mix: cute.Pointer,
                 norm_w: cute.Pointer, m: Int32, write_slot: Int32, eps: Float32,
                 stream: cuda.CUstream):
        mBlk, mDel, mW, mN = self._views(blocks, delta, w_mix, norm_w, m)
        self.kernel(self._rows(out, m), mBlk, self._rows(prefix, m), mDel,
                    self._rows(prefix_out, m), mW, mN, write_slot, eps).launch(
            grid=[m, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.jit
    def load_source(self, s: cutlass.Constexpr[int], row: Int32, c: Int32, mBlk: cute.Tensor,
                    mP: cute.Tensor, mDel: cute.Tensor, buf: cute.Tensor, acc: cute.Tensor,
                    nrows: Int32 | None = None):
        """acc[0:8] = source s at vector c of `row`, in fp32 (prefix' = prefix + delta). M (the
        all-gather buffer's row count) is read from gridDim.x unless `nrows` is given (the
        cluster kernel, attn_res_mc, passes gridDim.y)."""
        if cutlass.const_expr(s < self.cfg.num_blocks):
            cute.autovec_copy(mBlk[row, s, c, None], buf)
            for j in cutlass.range_constexpr(VEC):
                acc[j] = buf[j].to(Float32)
        else:
            cute.autovec_copy(mP[row, c, None], buf)
            for j in cutlass.range_constexpr(VEC):
                acc[j] = buf[j].to(Float32)
            if cutlass.const_expr(self.cfg.has_delta):
                # prefix' is stored in the source dtype, and the mix reads the stored value
                if cutlass.const_expr(self.cfg.gather > 0):
                    # attn_res_ag: delta[row, 8c .. 8c+7] = ag[s, row, 8jv ..] with
                    # s = 8c // n = c // (n/8), jv = c % (n/8); buffer row s·M + row
                    nvs = self.cfg.gather // VEC
                    if cutlass.const_expr(nrows is None):
                        nrows, _, _ = cute.arch.grid_dim()      # M (one CTA per row)
                    cute.autovec_copy(mDel[(c // nvs) * nrows + row, c % nvs, None], buf)
                else:
                    cute.autovec_copy(mDel[row, c, None], buf)
                for j in cutlass.range_constexpr(VEC):
                    acc[j] = (acc[j] + buf[j].to(Float32)).to(self.src_t).to(Float32)

    @cute.jit
    def sum_slots(self, row: Int32, write_slot: Int32, mBlk: cute.Tensor, mP: cute.Tensor,
                  mDel: cute.Tensor, mPOut: cute.Tensor, buf: cute.Tensor, pv: cute.Tensor):
        """attn_res_ar: pv[i, :] = prefix' at this thread's vector i (fp32 of the stored value):
        delta = bf16(Σ_{r<world} slot_r) summed in fp32 in slot order r = 0, 1, ..; prefix' =
        delta (reset) or bf16(prefix + delta); prefix' written to mPOut (and the block slot)."""
        tidx, _, _ = cute.arch.thread_idx()
        nrows, _, _ = cute.arch.grid_dim()          # M (one CTA per row)
        pv.fill(0.0)
        # all world·vpt 128-bit loads are independent (only the adds chain), so they overlap
        for r in cutlass.range_constexpr(self.cfg.world):
            for i in cutlass.range_constexpr(self.vpt):
                c = tidx + i * self.threads
                cute.autovec_copy(mDel[r * nrows + row, c, None], buf)
                for j in cutlass.range_constexpr(VEC):
                    pv[i, j] = pv[i, j] + buf[j].to(Float32)
        for i in cutlass.range_constexpr(self.vpt):
            c = tidx + i * self.threads
            for j in cutlass.range_constexpr(VEC):
                pv[i, j] = pv[i, j].to(self.src_t).to(Float32)          # delta: the all-reduce output
            if cutlass.const_expr(not self.cfg.reset):
                cute.autovec_copy(mP[row, c, None], buf)
                for j in cutlass.range_constexpr(VEC):
                    pv[i, j] = (buf[j].to(Float32) + pv[i, j]).to(self.src_t).to(Float32)
            for j in cutlass.range_constexpr(VEC):
                buf[j] = pv[i, j].to(self.src_t)
            cute.autovec_copy(buf, mPOut[row, c, None])
            if cutlass.const_expr(self.cfg.has_write):
                cute.autovec_copy(buf, mBlk[row, write_slot, c, None])

    @cute.jit
    def col(self, q: Int32, tidx: Int32, i: cutlass.Constexpr[int]) -> Int32:
        """The vector index of this thread's i-th vector (one CTA per row: q, the CTA's column
        block, is 0 and unused; attn_res_mc overrides this for its column split)."""
        return tidx + i * self.threads

    @cute.jit
    def sum_squares(self, h: cute.Tensor, a_h: cute.Tensor):
        """a_h[0] = this thread's Σ h² (shared with attn_res_mc)."""
        a_h[0] = Float32(0.0)
        for i in cutlass.range_constexpr(self.vpt):
            for j in cutlass.range_constexpr(VEC):
                a_h[0] += h[i, j] * h[i, j]

    @cute.jit
    def store_out(self, h: cute.Tensor, nv: cute.Tensor, r: Float32, mOut: cute.Tensor, row: Int32,
                  q: Int32, tidx: Int32):
        """out[row, col(q, tidx, i)] = h[i] · r · norm_w (rounded to the out dtype) for this
        thread's vectors (shared with attn_res_mc)."""
        obuf = cute.make_rmem_tensor(cute.make_layout(VEC), self.out_t)
        for i in cutlass.range_constexpr(self.vpt):
            c = self.col(q, tidx, i)
            for j in cutlass.range_constexpr(VEC):
                obuf[j] = (h[i, j] * r * nv[i, j].to(Float32)).to(self.out_t)
            cute.autovec_copy(obuf, mOut[row, c, None])

    @cute.jit
    def softmax(self, part: cute.Tensor, score: cute.Tensor, eps: Float32):
        """score[s] = softmax over sources of part[2s+1] · rsqrt(part[2s] / D + eps), i.e. of
        <v_s, w> / rms(v_s), from the reduced pass-1 sums (shared with attn_res_mc)."""
        best = Float32(-3.0e38)
        for s in cutlass.range_constexpr(self.nsrc):
            score[s] = part[2 * s + 1] * cute.math.rsqrt(part[2 * s] / self.D + eps)
            best = cute.arch.fmax(best, score[s])
        total = Float32(0.0)
        for s in cutlass.range_constexpr(self.nsrc):
            score[s] = cute.math.exp(score[s] - best)
            total += score[s]
        for s in cutlass.range_constexpr(self.nsrc):
            score[s] = score[s] / total

    @cute.jit
    def block_sums(self, vals: cute.Tensor, n: cutlass.Constexpr[int], base: cutlass.Constexpr[int],
                   red: cute.Tensor, tot: cute.Tensor, warp: Int32, lane: Int32):
        """vals[0:n] ← their sums over the CTA, all n at once: a butterfly per value in every
        warp (n independent chains), one barrier, then warp w reduces values w, w + warps, ..
        across the ≤ 32 warp sums (a second butterfly), a barrier, and every thread reads the
        n totals. Rows base .. base+n-1 of `red` [rows, warps] and `tot` [rows] are used.
        One pass for all sources instead of one barrier-separated block_sum per value: the
        old kernel's 2·(nb+1) + 1 CTA reductions serialised the loads of consecutive sources
        behind barriers and cost every thread (nb+1)·2·warps shared-memory reads (7.2 us at
        nb = 1 and 15 us at nb = 8 for one row on the H200, bench/fused_correctness.md)."""
        W = self.warps
        for k in cutlass.range_constexpr(n):
            vals[k] = cute.arch.warp_reduction_sum(vals[k])
        if lane == 0:
            for k in cutlass.range_constexpr(n):
                red[base + k, warp] = vals[k]
        cute.arch.sync_threads()
        for r in cutlass.range_constexpr((n + W - 1) // W):
            k = warp + r * W                         # warp-uniform
            v = Float32(0.0)
            if lane < W:
                if k < n:
                    v = red[base + k, lane]
            v = cute.arch.warp_reduction_sum(v)      # all lanes, outside any branch
            if lane == 0:
                if k < n:
                    tot[base + k] = v
        cute.arch.sync_threads()
        for k in cutlass.range_constexpr(n):
            vals[k] = tot[base + k]

    @cute.kernel
    def kernel(self, mOut: cute.Tensor, mBlk: cute.Tensor, mP: cute.Tensor, mDel: cute.Tensor,
               mPOut: cute.Tensor, mW: cute.Tensor, mN: cute.Tensor, write_slot: Int32,
               eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()          # all lanes, top level (a full-warp shuffle)
        lane = cute.arch.lane_idx()
        nred = 2 * self.nsrc + 1
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout((nred, self.warps), stride=(self.warps, 1)))
        tot = smem.allocate_tensor(Float32, cute.make_layout(nred))
        buf = cute.make_rmem_tensor(cute.make_layout(VEC), self.src_t)
        acc = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
        part = cute.make_rmem_tensor(cute.make_layout(2 * self.nsrc), Float32)
        score = cute.make_rmem_tensor(cute.make_layout(self.nsrc), Float32)
        # w = w_norm ⊙ w_proj and the RMSNorm weight of this thread's vectors, loaded once up
        # front (their latency overlaps the sources')
        wv = cute.make_rmem_tensor(cute.make_layout((self.vpt, VEC), stride=(VEC, 1)), Float32)
        nv = cute.make_rmem_tensor(cute.make_layout((self.vpt, VEC), stride=(VEC, 1)), mN.element_type)
        for i in cutlass.range_constexpr(self.vpt):
            c = tidx + i * self.threads
            cute.autovec_copy(mW[c, None], wv[i, None])
            cute.autovec_copy(mN[c, None], nv[i, None])

        # attn_res_ar: prefix' of this thread's vectors, kept in registers for both passes
        pv = None
        if cutlass.const_expr(self.cfg.world > 0):
            pv = cute.make_rmem_tensor(cute.make_layout((self.vpt, VEC), stride=(VEC, 1)), Float32)

        # Pass 1: per source, this thread's sum of squares and dot with w (and prefix' written
        # once); no barrier between sources, so all their loads are in flight together.
        for s in cutlass.range_constexpr(self.nsrc):
            a_ss = Float32(0.0)
            a_dw = Float32(0.0)
            if cutlass.const_expr(self.cfg.world > 0 and s == self.nsrc - 1):
                self.sum_slots(row, write_slot, mBlk, mP, mDel, mPOut, buf, pv)
                for i in cutlass.range_constexpr(self.vpt):
                    for j in cutlass.range_constexpr(VEC):
                        a_ss += pv[i, j] * pv[i, j]
                        a_dw += pv[i, j] * wv[i, j]
            else:
                for i in cutlass.range_constexpr(self.vpt):
                    c = tidx + i * self.threads
                    self.load_source(s, row, c, mBlk, mP, mDel, buf, acc)
                    for j in cutlass.range_constexpr(VEC):
                        a_ss += acc[j] * acc[j]
                        a_dw += acc[j] * wv[i, j]
                    if cutlass.const_expr(s == self.nsrc - 1 and self.cfg.has_delta):
                        for j in cutlass.range_constexpr(VEC):
                            buf[j] = acc[j].to(self.src_t)
                        cute.autovec_copy(buf, mPOut[row, c, None])
                        if cutlass.const_expr(self.cfg.has_write):
                            cute.autovec_copy(buf, mBlk[row, write_slot, c, None])
            part[2 * s] = a_ss
            part[2 * s + 1] = a_dw
        self.block_sums(part, 2 * self.nsrc, 0, red, tot, warp, lane)

        # Softmax over sources of <v, w> / rms(v) (every thread, redundantly: nsrc <= 9).
        self.softmax(part, score, eps)

        # Pass 2: h = sum_s p_s v_s kept in registers (sources re-read from L1/L2), then RMSNorm.
        h = cute.make_rmem_tensor(cute.make_layout((self.vpt, VEC), stride=(VEC, 1)), Float32)
        h.fill(0.0)
        for s in cutlass.range_constexpr(self.nsrc):
            if cutlass.const_expr(self.cfg.world > 0 and s == self.nsrc - 1):
                for i in cutlass.range_constexpr(self.vpt):
                    for j in cutlass.range_constexpr(VEC):
                        h[i, j] = h[i, j] + score[s] * pv[i, j]
            else:
                for i in cutlass.range_constexpr(self.vpt):
                    c = tidx + i * self.threads
                    self.load_source(s, row, c, mBlk, mP, mDel, buf, acc)
                    for j in cutlass.range_constexpr(VEC):
                        h[i, j] = h[i, j] + score[s] * acc[j]
        a_h = cute.make_rmem_tensor(cute.make_layout(1), Float32)
        self.sum_squares(h, a_h)
        self.block_sums(a_h, 1, 2 * self.nsrc, red, tot, warp, lane)
        r = cute.math.rsqrt(a_h[0] / self.D + eps)
        self.store_out(h, nv, r, mOut, row, Int32(0), tidx)


def compile_for(cfg: AttnResConfig, norm_dtype: torch.dtype, kernel: type = AttnResRMSNorm,
                name: str = "attn_res") -> object:
    """The compiled kernel for `cfg` (cached under `name`; compiles to sm_90a PTX even without
    a GPU). attn_res_mc passes its AttnResMC class and name."""
    def build() -> object:
        src = dummy_ptr(cfg.source_dtype)
        return cute.compile(kernel(cfg), dummy_ptr(cfg.out_dtype), src, src, src, src,
                            dummy_ptr(torch.float32), dummy_ptr(norm_dtype), Int32(1), Int32(0),
                            Float32(1e-5), current_stream(), options=compile_options())
    return compiled((name, cfg, norm_dtype), build)


def attn_res_rmsnorm(blocks: torch.Tensor, num_blocks: int, prefix: torch.Tensor | None,
                     w_mix: torch.Tensor, norm_w: torch.Tensor, eps: float,
                     delta: torch.Tensor | None = None, write_slot: int | None = None,
                     out: torch.Tensor | None = None, *, delta_slots: torch.Tensor | None = None,
                     reset: bool = False, delta_gather: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch on the current stream. blocks [M, slots, D]; prefix, delta [M, D]; w_mix [D] fp32
    (w_norm ⊙ w_proj); norm_w [D]. Returns (out [M, D] bf16, prefix' [M, D]); with a delta,
    prefix' is a new tensor (and blocks[:, write_slot] is overwritten by it when asked).

    attn_res_ar: `delta_slots` [world, M, D] (contiguous, the all-reduce buffer: every rank's
    partial in its slot) instead of `delta`: delta = bf16(Σ_r delta_slots[r]) summed in fp32 in
    slot order, prefix' = delta if `reset` (then `prefix` is not read and may be None) else
    bf16(prefix + delta); prefix' is a new tensor.

    attn_res_ag: `delta_gather` [world, M, n] (contiguous, the all-gather buffer, world·n = D)
    instead of `delta`: delta[m, s·n + j] = delta_gather[s, m, j] is read in place (no
    concatenation kernel), prefix' = bf16(prefix + delta) (a new tensor; no reset)."""
    if delta_gather is not None:
        return _attn_res_ag(blocks, num_blocks, prefix, w_mix, norm_w, eps, delta, write_slot, out,
                            delta_slots, reset, delta_gather)
    if delta_slots is not None:
        return _attn_res_ar(blocks, num_blocks, prefix, w_mix, norm_w, eps, delta, write_slot, out,
                            delta_slots, reset)
    if reset:
        raise ValueError("reset=True needs delta_slots (without them pass prefix=delta, no delta)")
    m, slots, d = blocks.shape
    if write_slot is not None and delta is None:  # nothing to compute: prefix' is prefix
        blocks[:, write_slot].copy_(prefix)
        write_slot = None
    cfg = AttnResConfig(d, num_blocks, slots, delta is not None, write_slot is not None,
                        prefix.dtype)
    if not can_implement(d, num_blocks, slots, (prefix.dtype, blocks.dtype, norm_w.dtype)):
        raise ValueError(f"attn_res kernel cannot run hidden={d} nb={num_blocks} slots={slots}")
    if blocks.dtype != prefix.dtype or (delta is not None and delta.dtype != prefix.dtype):
        raise ValueError("blocks, prefix and delta must share one dtype")
    if w_mix.dtype != torch.float32:
        raise ValueError("w_mix must be fp32")
    out = torch.empty(m, d, dtype=torch.bfloat16, device=prefix.device) if out is None else out
    new_prefix = torch.empty_like(prefix) if delta is not None else prefix
    fn = compile_for(cfg, norm_w.dtype)
    fn(ptr(out), ptr(blocks), ptr(prefix), ptr(delta if delta is not None else prefix),
       ptr(new_prefix), ptr(w_mix), ptr(norm_w), Int32(m), Int32(write_slot or 0), Float32(eps),
       current_stream())
    return out, new_prefix


# Per-M table of the attn_res_ar variant: vectors per thread. One CTA per row reads world × D
# values; at M = 1 that CTA alone streams 229 KB of slots, and with VPT = 4 (224 threads, 64
# loads each, too many to keep in flight) the device measured 14.4 us in the fused step
# (traces/k3_fused_b1_k0_graph.json.gz, op mlp_res). VPT = 1 gives 896 threads per row, 16
# independent loads each, all in flight (ptxas: 41 registers, no spills, for sm_90a); many rows
# (M > 8) fill the GPU with CTAs anyway and keep the verified VPT = 4.
AR_VPT_SMALL_M, AR_SMALL_M = 1, 8


def ar_vec_per_thread(m: int, hidden: int) -> int:
    """Vectors per thread of the attn_res_ar kernel for M rows (the per-M table above)."""
    vpt = AR_VPT_SMALL_M if m <= AR_SMALL_M else 4
    return vpt if hidden % (VEC * vpt) == 0 and (hidden // (VEC * vpt)) % 32 == 0 else 4


def _attn_res_ar(blocks: torch.Tensor, num_blocks: int, prefix: torch.Tensor | None,
                 w_mix: torch.Tensor, norm_w: torch.Tensor, eps: float, delta: torch.Tensor | None,
                 write_slot: int | None, out: torch.Tensor | None, delta_slots: torch.Tensor,
                 reset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """attn_res_rmsnorm with delta_slots (the attn_res_ar variant); shapes checked here."""
    m, slots, d = blocks.shape
    dt = delta_slots.dtype
    world = delta_slots.shape[0] if delta_slots.dim() == 3 else 0
    if delta is not None:
        raise ValueError("pass delta or delta_slots, not both")
    if world < 1 or tuple(delta_slots.shape[1:]) != (m, d):
        raise ValueError(f"delta_slots must be [world, {m}, {d}], got {tuple(delta_slots.shape)}")
    if blocks.dtype != dt or (not reset and (prefix is None or prefix.dtype != dt
                                             or tuple(prefix.shape) != (m, d))):
        raise ValueError("blocks, prefix and delta_slots must share one dtype (prefix [M, D])")
    if not can_implement(d, num_blocks, slots, (dt, norm_w.dtype), vec_per_thread=ar_vec_per_thread(m, d),
                         world=world):
        raise ValueError(f"attn_res_ar kernel cannot run hidden={d} nb={num_blocks} slots={slots} "
                         f"world={world}")
    if world * m * d >= 2 ** 31:  # row index r·M + m times D stays in int32
        raise ValueError("attn_res_ar: world · M · D must be < 2^31")
    if write_slot is not None and not num_blocks <= write_slot < slots:
        raise ValueError("write_slot must be in [num_blocks, slots): the mix reads blocks[:nb]")
    if w_mix.dtype != torch.float32:
        raise ValueError("w_mix must be fp32")
    vpt = ar_vec_per_thread(m, d)
    cfg = AttnResConfig(d, num_blocks, slots, True, write_slot is not None, dt, world=world,
                        reset=reset, vec_per_thread=vpt)
    out = torch.empty(m, d, dtype=torch.bfloat16, device=blocks.device) if out is None else out
    new_prefix = torch.empty(m, d, dtype=dt, device=blocks.device)
    fn = compile_for(cfg, norm_w.dtype)
    fn(ptr(out), ptr(blocks), ptr(new_prefix if reset else prefix), ptr(delta_slots),
       ptr(new_prefix), ptr(w_mix), ptr(norm_w), Int32(m), Int32(write_slot or 0), Float32(eps),
       current_stream())
    return out, new_prefix


def _attn_res_ag(blocks: torch.Tensor, num_blocks: int, prefix: torch.Tensor | None,
                 w_mix: torch.Tensor, norm_w: torch.Tensor, eps: float, delta: torch.Tensor | None,
                 write_slot: int | None, out: torch.Tensor | None, delta_slots: torch.Tensor | None,
                 reset: bool, delta_gather: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """attn_res_rmsnorm with delta_gather (the attn_res_ag variant); shapes checked here."""
    m, slots, d = blocks.shape
    dt = delta_gather.dtype
    if delta is not None or delta_slots is not None:
        raise ValueError("pass one of delta, delta_slots, delta_gather")
    if reset:
        raise ValueError("attn_res_ag has no reset (prefix' = prefix + gathered delta)")
    if delta_gather.dim() != 3 or delta_gather.shape[1] != m or \
            delta_gather.shape[0] * delta_gather.shape[2] != d:
        raise ValueError(f"delta_gather must be [world, {m}, n] with world·n = {d}, "
                         f"got {tuple(delta_gather.shape)}")
    world, n = delta_gather.shape[0], delta_gather.shape[2]
    if blocks.dtype != dt or prefix is None or prefix.dtype != dt or tuple(prefix.shape) != (m, d):
        raise ValueError("blocks, prefix and delta_gather must share one dtype (prefix [M, D])")
    if not can_implement(d, num_blocks, slots, (dt, norm_w.dtype), gather=n):
        raise ValueError(f"attn_res_ag kernel cannot run hidden={d} nb={num_blocks} slots={slots} "
                         f"world={world} n={n}")
    if m * d >= 2 ** 31:  # buffer row s·M + m times n stays in int32
        raise ValueError("attn_res_ag: M · D must be < 2^31")
    if write_slot is not None and not num_blocks <= write_slot < slots:
        raise ValueError("write_slot must be in [num_blocks, slots): the mix reads blocks[:nb]")
    if w_mix.dtype != torch.float32:
        raise ValueError("w_mix must be fp32")
    cfg = AttnResConfig(d, num_blocks, slots, True, write_slot is not None, dt, gather=n)
    out = torch.empty(m, d, dtype=torch.bfloat16, device=blocks.device) if out is None else out
    new_prefix = torch.empty(m, d, dtype=dt, device=blocks.device)
    fn = compile_for(cfg, norm_w.dtype)
    fn(ptr(out), ptr(blocks), ptr(prefix), ptr(delta_gather), ptr(new_prefix), ptr(w_mix),
       ptr(norm_w), Int32(m), Int32(write_slot or 0), Float32(eps), current_stream())
    return out, new_prefix


def gather_cols(delta_gather: torch.Tensor) -> torch.Tensor:
    """The all-gather result the attn_res_ag kernel reads in place: [ag[0] | ag[1] | ..] [M, D]
    (SimComm.gather_slots' concatenation)."""
    return torch.cat(delta_gather.unbind(0), dim=1)


def slot_sum(delta_slots: torch.Tensor) -> torch.Tensor:
    """The all-reduce output the attn_res_ar kernel computes: Σ_r delta_slots[r] in fp32, slot
    order r = 0, 1, .., rounded once to the slots' dtype."""
    acc = torch.zeros(delta_slots.shape[1:], dtype=torch.float32, device=delta_slots.device)
    for r in range(delta_slots.shape[0]):
        acc = acc + delta_slots[r].float()
    return acc.to(delta_slots.dtype)


def prefix_reference(prefix: torch.Tensor | None, delta_slots: torch.Tensor, reset: bool) -> torch.Tensor:
    """prefix' of the attn_res_ar kernel, exactly (stored dtype): delta or prefix + delta."""
    delta = slot_sum(delta_slots)
    return delta if reset else prefix + delta


def reference(blocks: torch.Tensor, num_blocks: int, prefix: torch.Tensor | None, w_mix: torch.Tensor,
              norm_w: torch.Tensor, eps: float, delta: torch.Tensor | None = None, *,
              delta_slots: torch.Tensor | None = None, reset: bool = False,
              delta_gather: torch.Tensor | None = None) -> torch.Tensor:
    """float64 statement of the formula in the module docstring (for the kernel check only;
    the parity check against stock lives in the fused-vs-stock test). With `delta_slots`
    (attn_res_ar) prefix' is prefix_reference(prefix, delta_slots, reset); with `delta_gather`
    (attn_res_ag) delta is gather_cols(delta_gather)."""
    if delta_gather is not None:
        delta = gather_cols(delta_gather)
    if delta_slots is not None:
        prefix, delta = prefix_reference(prefix, delta_slots, reset), None
    p = prefix if delta is None else prefix + delta     # stored in prefix's dtype first
    p = p.double()
    v = torch.cat([blocks[:, :num_blocks].double(), p[:, None]], dim=1)      # [M, S, D]
    rms = (v.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    prob = ((v / rms) @ w_mix.double()).softmax(-1)                          # [M, S]
    h = (prob[..., None] * v).sum(1)
    return h * (h.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * norm_w.double()


def check_ar(timing: bool = True, rows: tuple[int, ...] = (1, 8, 64), nbs: tuple[int, ...] = (1, 8),
             world: int = 16) -> list[dict]:
    """attn_res_ar kernel vs stock: SimComm(world).all_reduce(x) then the stock
    AttnRes.update_and_mix (reset False and True, with and without a block write), at K3 width.
    fill "zero": the simulation's buffer (this rank's partial, other slots zero): prefix' and
    blocks equal stock's. fill "random": every other slot random too (the real TP case):
    prefix' and blocks equal the slot-order torch sum (prefix_reference); stock's buf.sum(0)
    may round a few elements differently (its fp32 summation order is its own), so those are
    counted (`prefix_mismatch_vs_stock`, ≤ 1e-3 of the elements). The mix: rel ≤ 1e-2 vs stock
    and ≤ 1.5 × stock's + 1e-3 vs float64. Timing (fill zero, no write): stock all_reduce +
    update_and_mix vs the kernel alone (the o_proj GEMV writes slot `rank` itself) and vs
    slot copy + kernel (`kernel_copy_us`, if the GEMV cannot write into the slot)."""
    from kimi_decode.comm import SimComm
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels import checks
    from kimi_decode.kernels.checks import _sync, rel, time_us
    from kimi_decode.stock import AttnRes
    from kimi_decode.weights import Seeder
    cfg = k3_tp16()
    dev = torch.device(checks.DEVICE)
    D, n_slots = cfg.hidden, cfg.attn_res_slots
    mod = AttnRes(cfg, Seeder(cfg, dev).sub("check.attn_res_ar"))
    out = []
    for fill in ("zero", "random"):
        comm = SimComm(dev, world)                     # fresh (zeroed) buffers per fill
        for m in rows:
            for nb in nbs:
                for reset in (False, True):
                    for write in (False, True):
                        slot = nb if write else None
                        if slot is not None and slot >= n_slots:
                            continue
                        gen = torch.Generator(device=dev).manual_seed(1000 * m + 10 * nb + 2 * reset + write)
                        blocks = torch.randn(m, n_slots, D, generator=gen, device=dev).bfloat16()
                        base = torch.randn(m, D, generator=gen, device=dev).bfloat16()
                        x = torch.randn(m, D, generator=gen, device=dev).bfloat16()  # this rank's partial
                        buf = comm._buf("ar", (world, m, D), x)
                        if fill == "random":
                            buf.copy_(0.25 * torch.randn(world, m, D, generator=gen, device=dev))
                        buf[comm.rank].copy_(x)               # what the o_proj GEMV writes
                        b_s, b_k, b_r = blocks.clone(), blocks.clone(), blocks.clone()
                        with torch.no_grad():
                            ar = comm.all_reduce(x)
                            p_s, x_s = mod.update_and_mix(base, ar, b_s, nb, reset)
                            if slot is not None:
                                b_s[:, slot].copy_(p_s)
                            x_k, p_k = attn_res_rmsnorm(b_k, nb, base, mod.w, mod.norm, cfg.rms_eps,
                                                        write_slot=slot, delta_slots=buf, reset=reset)
                        _sync()
                        p_r = prefix_reference(base, buf, reset)
                        if slot is not None:
                            b_r[:, slot].copy_(p_r)
                        ref = reference(blocks, nb, base, mod.w, mod.norm, cfg.rms_eps,
                                        delta_slots=buf, reset=reset)
                        e_ks, e_k, e_s = rel(x_k, x_s), rel(x_k, ref), rel(x_s, ref)
                        mism = float((p_k != p_s).double().mean())
                        ok = (e_ks <= 1e-2 and e_k <= 1.5 * e_s + 1e-3 and torch.equal(p_k, p_r)
                              and torch.equal(b_k, b_r)
                              and (mism <= 1e-3 if fill == "random"
                                   else torch.equal(p_k, p_s) and torch.equal(b_k, b_s)))
                        r = {"kernel": "attn_res_ar", "M": m, "nb": nb, "reset": reset,
                             "write": slot is not None, "fill": fill, "world": world,
                             "rel_vs_stock": e_ks, "rel_vs_f64": e_k, "stock_rel_vs_f64": e_s,
                             "prefix_equal_ref": torch.equal(p_k, p_r),
                             "prefix_mismatch_vs_stock": mism, "ok": ok}
                        if timing and fill == "zero" and slot is None:
                            def stock_call() -> None:
                                mod.update_and_mix(base, comm.all_reduce(x), b_s, nb, reset)

                            def kernel_call() -> None:
                                attn_res_rmsnorm(b_k, nb, base, mod.w, mod.norm, cfg.rms_eps,
                                                 delta_slots=buf, reset=reset)

                            def copy_kernel_call() -> None:
                                buf[comm.rank].copy_(x)
                                kernel_call()
                            r["stock_us"] = time_us(stock_call)
                            r["kernel_us"] = time_us(kernel_call)
                            r["kernel_copy_us"] = time_us(copy_kernel_call)
                        out.append(r)
    return out


def check_ag(timing: bool = True, rows: tuple[int, ...] = (1, 8, 64), nbs: tuple[int, ...] = (1, 8),
             world: int = 16) -> list[dict]:
    """attn_res_ag kernel vs stock: SimComm(world).all_gather_cols(x) of this rank's slice
    x [M, D/world], then the stock AttnRes.update_and_mix (reset False; with and without a
    block write), at K3 width. fill "zero": the simulation's buffer (rank 0, other slots zero).
    fill "random": every other slot random too (the real TP case; rank 3): stock's
    all_gather_cols concatenates the same persistent buffer, so in both fills prefix' and the
    blocks equal stock's AND base + torch.cat(slots) (gather_cols) exactly. The mix: rel ≤
    1e-2 vs stock and ≤ 1.5 × stock's + 1e-3 vs float64. M = 1 cannot tell a kernel that reads
    the buffer as a plain [M, D] row from the right one ([world, 1, n] is [1, D] in memory);
    M > 1 with random slots can. Timing (fill zero, no write): stock = the concatenation
    (gather_slots, what the fused path runs today) + stock update_and_mix, vs the kernel
    alone, and `cat_kernel_us` = concatenation + the plain attn_res kernel (today's fused)."""
    from kimi_decode.comm import SimComm
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels import checks
    from kimi_decode.kernels.checks import _sync, rel, time_us
    from kimi_decode.stock import AttnRes
    from kimi_decode.weights import Seeder
    cfg = k3_tp16()
    dev = torch.device(checks.DEVICE)
    D, n_slots = cfg.hidden, cfg.attn_res_slots
    n = D // world
    mod = AttnRes(cfg, Seeder(cfg, dev).sub("check.attn_res_ag"))
    out = []
    for fill in ("zero", "random"):
        comm = SimComm(dev, world, rank=0 if fill == "zero" else 3)   # fresh (zeroed) buffers
        for m in rows:
            for nb in nbs:
                for write in (False, True):
                    slot = nb if write else None
                    if slot is not None and slot >= n_slots:
                        continue
                    gen = torch.Generator(device=dev).manual_seed(1000 * m + 10 * nb + write)
                    blocks = torch.randn(m, n_slots, D, generator=gen, device=dev).bfloat16()
                    base = torch.randn(m, D, generator=gen, device=dev).bfloat16()
                    x = torch.randn(m, n, generator=gen, device=dev).bfloat16()   # this rank's slice
                    buf = comm.ag_slots((m, n), x)
                    if fill == "random":
                        buf.copy_(torch.randn(world, m, n, generator=gen, device=dev))
                    b_s, b_k, b_r = blocks.clone(), blocks.clone(), blocks.clone()
                    with torch.no_grad():
                        g = comm.all_gather_cols(x)           # writes slot `rank`, concatenates
                        p_s, x_s = mod.update_and_mix(base, g, b_s, nb, False)
                        if slot is not None:
                            b_s[:, slot].copy_(p_s)
                        x_k, p_k = attn_res_rmsnorm(b_k, nb, base, mod.w, mod.norm, cfg.rms_eps,
                                                    write_slot=slot, delta_gather=buf)
                    _sync()
                    p_r = base + gather_cols(buf)
                    if slot is not None:
                        b_r[:, slot].copy_(p_r)
                    ref = reference(blocks, nb, base, mod.w, mod.norm, cfg.rms_eps, delta_gather=buf)
                    e_ks, e_k, e_s = rel(x_k, x_s), rel(x_k, ref), rel(x_s, ref)
                    ok = (e_ks <= 1e-2 and e_k <= 1.5 * e_s + 1e-3 and torch.equal(p_k, p_s)
                          and torch.equal(p_k, p_r) and torch.equal(b_k, b_s) and torch.equal(b_k, b_r))
                    r = {"kernel": "attn_res_ag", "M": m, "nb": nb, "write": slot is not None,
                         "fill": fill, "world": world, "rel_vs_stock": e_ks, "rel_vs_f64": e_k,
                         "stock_rel_vs_f64": e_s, "prefix_equal_stock": torch.equal(p_k, p_s),
                         "prefix_equal_ref": torch.equal(p_k, p_r), "ok": ok}
                    if timing and fill == "zero" and slot is None:
                        def stock_call() -> None:
                            mod.update_and_mix(base, comm.gather_slots(buf), b_s, nb, False)

                        def kernel_call() -> None:
                            attn_res_rmsnorm(b_k, nb, base, mod.w, mod.norm, cfg.rms_eps,
                                             delta_gather=buf)

                        def cat_kernel_call() -> None:
                            attn_res_rmsnorm(b_k, nb, base, mod.w, mod.norm, cfg.rms_eps,
                                             delta=comm.gather_slots(buf))
                        r["stock_us"] = time_us(stock_call)
                        r["kernel_us"] = time_us(kernel_call)
                        r["cat_kernel_us"] = time_us(cat_kernel_call)
                    out.append(r)
    return out


if __name__ == "__main__":
    import sys

    from kimi_decode.kernels.checks import _print, main_attn_res
    if sys.argv[1:] == ["ar"]:     # python -m kimi_decode.kernels.attn_res ar
        _print(check_ar())
    elif sys.argv[1:] == ["ag"]:   # python -m kimi_decode.kernels.attn_res ag
        _print(check_ag())
    else:
        main_attn_res()
