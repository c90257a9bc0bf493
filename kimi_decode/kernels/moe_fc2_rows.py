"""FC2 of the routed experts at 2 ≤ M ≤ 8 as a resident grid: each CTA keeps one row and
walks column blocks (kernel `experts_rows`; FC1 stays kernels/moe_experts.ExpertsFC1).

Why: FC2 v2 (moe_experts.ExpertsFC2v2) gives every (row, 4-column block) its own CTA. At
M = 1 that is 896 CTAs, one wave, and it streams well. At M = 8 it is 7,168 CTAs in ~7.8
waves, and every CTA pays the same serial prologue before its 24 KB of w2 are consumed: the
row's expert ids (an L2 round trip before any w2 address is known), the w2 loads, the
staging of the row's `a` (16 x 192 bf16) into shared memory in 3 dependent L2 round trips,
a barrier, then the arithmetic. In the bundled B = 1, k = 7 trace (ba774df) FC2 takes 69-72 µs
for 176 MB of (pair, expert) slices, ~2.5 TB/s, against FC1's 3.3 TB/s and the H200's
4.2-4.3 TB/s copy rate (bench/fused_runs.md).

Layout (the same lanes and arithmetic as FC2 v2, so the result is bit-identical to it):
- a CTA = 4 warps, warp w = column 4·cb + w of a column block cb, its 32 lanes 4 groups of 8
  (group g: experts j = g + 4t; lane r of a group: slices r + 8i of a row), as FC2 v2;
- grid = M · per_row CTAs, CTA b takes row b % M and the column blocks
  cb = b // M, b // M + per_row, ... (`per_row` = ⌊CTA slots / M⌋, capped at the L/4 blocks:
  the whole grid resident at once, e.g. 115 CTAs per row at M = 8 on 132 SMs x 7);
- once per CTA: the row's expert ids (registers), its K routing weights (shared memory),
  the first block's w2 slices in flight, griddepcontrol.wait (with PDL the point past which
  FC1's `a` is complete), the row's `a` staged in shared memory, one barrier;
- per column block: the dot products of the slices in registers (v2_dots), out[row, col],
  then the next block's w2 loads issued (single buffer); with `buffers = 2` the next
  block's loads go to a second register set before the current block's arithmetic (96 data
  registers, so 4 CTAs per SM instead of 7).
Per block nothing but w2 loads and the arithmetic: no id round trip, no staging, no barrier,
no CTA launch. The latency of a block's loads is hidden by the other warps of the SM (7 CTAs
x 4 warps, 6 KB in flight per warp: ~170 KB per SM, against the ~30 KB Little's law asks for).

Rounding points and fp32 sum orders are FC2 v2's (moe_experts module docstring), so `out` is
bit-identical to FC2 v2 on the same `a`; the check asserts that.

Check on the GPU (FC1 + this FC2 against FC1 + FC2 v2, stock and the float64 reference; both
timed on cold weights):
    python -m kimi_decode.kernels.moe_fc2_rows
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

import itertools
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from kimi_decode.kernels import chain
from kimi_decode.kernels._common import compile_options, compiled, current_stream, dummy_ptr, ptr, sm_count
from kimi_decode.kernels.moe_experts import (V2_GROUP_LANES, V2_WARPS, VEC, ExpertsConfig, can_implement_v2,
                                             fc2_views, v2_dots, v2_ids, v2_loads, v2_stage, v2_tensors,
                                             v2_weights)

MIN_ROWS = 2        # M = 1: FC2 v2's 896 CTAs are already one wave
BLOCKS_PER_SM = {1: 7, 2: 4}   # CTAs per SM by register buffers: ≤ 72 / ≤ 128 registers
STEP_BUFFERS = 1    # the register buffers the fused step uses (the check times both)


@dataclass(frozen=True)
class RowsConfig:
    """Compile-time configuration: the experts' shapes and how many register sets of w2
    slices each lane keeps in flight (1: load the next block after the arithmetic; 2: before)."""
    experts: ExpertsConfig
    buffers: int = 1


def can_implement(m: int, k: int, latent: int, inter_padded: int, dtypes: tuple[torch.dtype, ...],
                  inter: int | None = None) -> bool:
    """FC2 v2's shape rules (moe_experts.can_implement_v2) with M ≥ MIN_ROWS."""
    return m >= MIN_ROWS and can_implement_v2(m, k, latent, inter_padded, dtypes, inter)


def per_row(m: int, latent: int, buffers: int, sms: int) -> int:
    """CTAs per row: as many as the SMs hold at once beside the other rows' (⌊slots / M⌋),
    at most one per 4-column block, at least one."""
    return max(1, min(latent // V2_WARPS, BLOCKS_PER_SM[buffers] * sms // m))


class ExpertsFC2Rows:
    """out[m, l] = bf16(Σ_j w[m, j] · bf16(w2[e_j, l] · a[m·K + j])), one row per CTA walking
    column blocks (module docstring)."""

    def __init__(self, cfg: RowsConfig) -> None:
        self.cfg = cfg.experts
        self.buffers = cfg.buffers
        # launched with PDL: FC2's own flag, or always in the PDL chain (kernels/chain.py)
        self.pdl = cfg.experts.pdl or chain.chain_on()
        self.per_group = cfg.experts.top_k // 4                  # experts per 8-lane group (K/4)
        self.slices = cfg.experts.inter // (VEC * V2_GROUP_LANES)  # 128-bit slices per lane per row

    @cute.jit
    def __call__(self, act: cute.Pointer, idx: cute.Pointer, w: cute.Pointer, w2: cute.Pointer,
                 out: cute.Pointer, m: Int32, per_row: Int32, stream: cuda.CUstream):
        mA, mIdx, mWt, mW2, mO = fc2_views(self.cfg, act, idx, w, w2, out, m)
        self.kernel(mA, mIdx, mWt, mW2, mO, m, per_row).launch(
            grid=[m * per_row, 1, 1], block=[V2_WARPS * 32, 1, 1], stream=stream, use_pdl=self.pdl,
            min_blocks_per_mp=BLOCKS_PER_SM[self.buffers], preferred_smem_carveout=-1)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mIdx: cute.Tensor, mWt: cute.Tensor, mW2: cute.Tensor,
               mO: cute.Tensor, m: Int32, per_row: Int32):
        L, I, K, E = self.cfg.latent, self.cfg.inter, self.cfg.top_k, self.cfg.experts
        kpg, nsl = self.per_group, self.slices
        nq = I // VEC
        nblk = (L + V2_WARPS - 1) // V2_WARPS
        threads = V2_WARPS * 32
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()          # all 32 lanes, outside any branch
        lane = cute.arch.lane_idx()
        grp = lane // V2_GROUP_LANES
        r = lane - grp * V2_GROUP_LANES
        c0 = bidx // m                       # the CTA's first column block (< per_row ≤ nblk)
        row = bidx - c0 * m
        cnt = (nblk - c0 + per_row - 1) // per_row   # its column blocks: c0 + n·per_row, n < cnt
        sA, sW, wv, av, ev, ex = v2_tensors(mA, mW2, K, nq, kpg, nsl)
        v2_ids(mIdx, ev, row, grp, E, kpg)
        v2_loads(mW2, ev, wv, self.column(c0, warp, L), r, kpg, nsl)
        v2_weights(mIdx, mWt, sW, row, tidx, K, E)
        # the first block's w2 loads are issued before this: with PDL the point past which
        # FC1's `a` is complete and visible
        cute.arch.griddepcontrol_wait()
        chain.release()
        v2_stage(mA, sA, av, row, r, tidx, K, nsl, threads)
        if cutlass.const_expr(self.buffers == 1):
            for n in cutlass.range(cnt, unroll=1):
                cb = c0 + n * per_row
                # a memory-ordering point inside the loop: without it the compiler hoists
                # the loop-invariant shared reads of `a` and their fp32 conversions out of
                # the loop (96 registers held across it; 202 registers uncapped, spills at 72)
                cute.arch.sync_warp()
                v2_dots(mO, sA, sW, av, wv, ex, row, cb * V2_WARPS + warp, r, grp, lane, K, L, kpg, nsl)
                if n + 1 < cnt:              # CTA-uniform: the next block's slices in flight
                    v2_loads(mW2, ev, wv, self.column(cb + per_row, warp, L), r, kpg, nsl)
        else:
            wv2 = cute.make_rmem_tensor(cute.make_layout((VEC, nsl, kpg)), mW2.element_type)
            for h in cutlass.range((cnt + 1) // 2, unroll=1):
                cb = c0 + 2 * h * per_row
                cute.arch.sync_warp()        # as in the one-buffer loop: `a` read per block
                if 2 * h + 1 < cnt:          # CTA-uniform branches (the shuffles inside)
                    v2_loads(mW2, ev, wv2, self.column(cb + per_row, warp, L), r, kpg, nsl)
                v2_dots(mO, sA, sW, av, wv, ex, row, cb * V2_WARPS + warp, r, grp, lane, K, L, kpg, nsl)
                if 2 * h + 2 < cnt:
                    v2_loads(mW2, ev, wv, self.column(cb + 2 * per_row, warp, L), r, kpg, nsl)
                if 2 * h + 1 < cnt:
                    cute.arch.sync_warp()    # `a` re-read, not kept from the dots above
                    v2_dots(mO, sA, sW, av, wv2, ex, row, (cb + per_row) * V2_WARPS + warp, r, grp, lane,
                            K, L, kpg, nsl)

    @cute.jit
    def column(self, cb: Int32, warp: Int32, L: cutlass.Constexpr[int]) -> Int32:
        """The warp's column of block cb, clamped to L - 1 (an out-of-range warp, none at K3,
        reads a valid row and v2_dots stores nothing)."""
        col = cb * V2_WARPS + warp
        if col >= L:
            col = Int32(L - 1)
        return col


def compile_rows(cfg: RowsConfig) -> object:
    """The compiled ExpertsFC2Rows for `cfg` (cached per configuration and chain mode)."""
    def build() -> object:
        bf = dummy_ptr(torch.bfloat16)
        return cute.compile(ExpertsFC2Rows(cfg), bf, dummy_ptr(cfg.experts.idx_dtype), dummy_ptr(torch.float32),
                            bf, bf, Int32(2), Int32(1), current_stream(), options=compile_options())
    return compiled(("experts_fc2_rows", cfg), build)


def launch_fc2(act: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w2: torch.Tensor, out: torch.Tensor,
               cfg: ExpertsConfig, m: int, buffers: int = 1) -> None:
    """FC2 as ExpertsFC2Rows on the current stream (arguments as moe_experts.prepare returns
    them); the grid from this device's SM count, fixed per shape, so CUDA-graph safe."""
    pr = per_row(m, cfg.latent, buffers, sm_count(act.device))
    compile_rows(RowsConfig(cfg, buffers))(ptr(act), ptr(idx), ptr(w), ptr(w2), ptr(out), Int32(m), Int32(pr),
                                           current_stream())


def check(timing: bool = True, rows: tuple[int, ...] = (2, 8)) -> list[dict]:
    """The GPU check of kernel `experts_rows`: FC1 + ExpertsFC2Rows (buffers 1 and 2) against
    FC1 + FC2 v2 as the fused step runs them (PDL, padding skip) bit for bit, against stock's
    op and the float64 reference (checks.py's rule), repeat-equal, nothing written outside
    `out`, on the real LatentMoE weights at K3 TP16. Timing on cold weights (4 routings
    cycled, CUDA-graph replays): `kernel_us` (buffers 1), `kernel2_us` (buffers 2), `v2_us`."""
    from kimi_decode import stock_ops
    from kimi_decode.kernels import moe_experts
    from kimi_decode.kernels.checks import DEVICE, _sync, rel, time_us
    dev = torch.device(DEVICE)
    cfg0, w13, w2 = moe_experts.check_weights(dev)
    beta, lin_beta = cfg0.situ_beta, cfg0.situ_linear_beta
    I, L = cfg0.expert_local_inter, cfg0.latent_dim
    out = []
    for m in rows:
        z, routings = moe_experts.check_inputs(cfg0, m, 5000 + m, dev)
        idx, w = routings[0]

        def run(i: torch.Tensor, ww: torch.Tensor, fc2: str, dst: torch.Tensor | None = None) -> torch.Tensor:
            kw = {"rows": int(fc2[-1])} if fc2.startswith("rows") else {}
            return moe_experts.experts(z, i, ww, w13, w2, beta, lin_beta, out=dst, inter=I, pdl=True, v2=True, **kw)
        with torch.no_grad():
            r_s = stock_ops.experts_grouped(z, idx, w, w13, w2, beta, lin_beta)
            r_v2 = run(idx, w, "v2")
            res = {}
            for fc2 in ("rows1", "rows2"):
                buf = torch.full((m + 1, L), float("nan"), dtype=torch.bfloat16, device=dev)
                res[fc2] = (run(idx, w, fc2, buf[1:]), run(idx, w, fc2), bool(torch.isnan(buf[0]).all()))
        _sync()
        ref = moe_experts.reference(z, idx, w, w13, w2, beta, lin_beta, inter=I)
        e_s = rel(r_s, ref)
        for fc2, (r_k, r_k2, untouched) in res.items():
            e_ks, e_k = rel(r_k, r_s), rel(r_k, ref)
            r = {"kernel": "experts_rows", "M": m, "buffers": int(fc2[-1]), "rel_vs_stock": e_ks,
                 "rel_vs_f64": e_k, "stock_rel_vs_f64": e_s, "equal_v2": bool(torch.equal(r_k, r_v2)),
                 "repeat_equal": bool(torch.equal(r_k, r_k2)), "out_bounds_ok": untouched}
            r["ok"] = bool(e_ks <= 1e-2 and e_k <= 1.5 * e_s + 1e-3 and r["equal_v2"] and r["repeat_equal"]
                           and untouched and bool(torch.isfinite(r_k).all()))
            if timing:
                dst = torch.empty(m, L, dtype=torch.bfloat16, device=dev)
                for what in (fc2, "v2"):
                    n = itertools.count()
                    key = "v2_us" if what == "v2" else "kernel_us"
                    r[key] = time_us(lambda what=what, n=n: run(*routings[next(n) % 4], what, dst))
            out.append(r)
    del w13, w2
    return out


if __name__ == "__main__":
    for row in check():
        print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
