"""kda_split at T = 1 with a shorter dependency chain: every global load a CTA needs is issued
at its start (one overlapped round trip; with the last CTA's o re-read, 2 dependent load
round trips instead of kda_split's 4), the conv, the q/k norms and the gate all run before
the first barrier, and the last CTA's norm needs no load after its barrier (KIMI_K3.md §1.4; same math, grid, scratch and ownership as kimi_decode.kernels.
kda_split, whose docstring this module assumes; used at B = 1, k = 0, where fused.MAX_ROWS
["kda"] = 1 puts the kernel).

Numerics: the same fp32 operations in the same order per value as kda_split at T = 1 (the
conv taps, the SiLU, the warp-then-warp-order sums of q², k², the 128-term gate dot product
in key order with its bf16 rounding, kᵀS and q̂ᵀS with the same shuffles and partial order,
the last CTA's Σo² over the whole row re-read from scratch), with the values coming from
registers instead of shared memory: so the target is bit-identical to kda_split. One detail
needed care: which mul an fma absorbs is LLVM's choice (fp contraction), and in kda_split it
computes the v channels' hist·w products in their load block, so they round on their own and
only x·w[3] fuses: y = fma(x, w[3], hist_0·w_0) + hist_1·w_1 + hist_2·w_2 (q and k: the plain
fma chain). Written naively here, v got the q/k chain; so the v products and x pass through
shared memory (own slots, no barrier needed), which reproduces kda_split's form. The CPU test
checks that the fp32 arithmetic of the two kernels' PTX is the same multiset of instructions
(fma/mul/add/ex2/rcp/sqrt/..., with their constants); ptxas then gives the same FFMA/FMUL/FADD
counts (242/46/64, nvdisasm on the CPU, not in the test). check() reports whether out,
rec_state and conv_state are equal to kda_split's on the GPU ("bit_identical"); its `ok`
holds the kernel to kda_split's own tolerances vs the stock ops (so a difference in rounding
would show up as bit_identical = False, not as a failed kernel).

The chain of kda_split at T = 1 (one CTA, in order; L2 round trip ~600-800 cycles under
load, HBM ~1000+, barrier ~20-50, a dependent shuffle ~30; at ~1.98 GHz):
    1. loads: S slice (8 × 4 B, HBM on a cold step), conv history + weights of q, k (and v on
       tid < C), A_log, the z row's q, k, f_a, v, β into shared memory  ~1000-1200
    2. bar.sync (top of the token loop)                                           ~30
    3. conv + SiLU, two interleaved 5-step warp sums (q², k²)                     ~200
    4. bar.sync                                                                    ~30
    5. the f_b row: 16 × 128-bit loads issued only now (L2 or HBM) + dt_bias      ~700-1000
    6. 128 dependent FMAs of the gate (~4 cycles each) + exp/σ                    ~600
    7. bar.sync                                                                    ~30
    8. decay + kᵀS (8 FMAs, 2 shuffles)                                            ~100
    9. bar.sync                                                                    ~30
   10. update + q̂ᵀS (8 FMAs, 2 shuffles)                                          ~100
   11. bar.sync                                                                    ~30
   12. o to scratch, S and v history back, fence.acq_rel (waits for the stores)   ~700
   13. bar.sync; thread 0: fence + atomic add acq_rel (L2 round trip)             ~800
   14. bar.sync (the flag)                                                         ~30
   15. last CTA: fence; o row + o_norm loads (L2 round trip)                       ~700
   16. 5-step warp sum of o², bar.sync                                            ~200
   17. the output gate z[m, 3P + ·]: a load issued only now (L2)                  ~700
   18. bf16 store
   ≈ 6000-6500 cycles ≈ 3.1-3.3 µs of chain, against 9.1 K SM-active cycles measured (the
   rest: launch, CTA rasterisation, the stores' drain, clocks under load).
Here (kda_fast): steps 5 and 17 lose their loads (issued in step 1: the f_b row and f_a as
16 + 16 × 128-bit loads per thread into 128 registers, dt_bias, β's z value (every thread
computes σ itself, no shared slot), o_norm[tid] and the gate's z value), step 6 moves before
the first barrier (its inputs are all in registers; it overlaps the warp sums of step 3),
and the barriers of steps 2 and 4 disappear (conv inputs are the thread's own registers, the
gate reads f_a from registers): 4 bar.sync before the atomic instead of 6, 6 in all instead
of 8, and 1 global load after the first barrier (the o row re-read) instead of 4 groups.
Expected saving ≈ one L2/HBM round trip (f_b, 700-1000 cycles) + one L2 round trip (gate,
~700) + 2 barriers (~60-100) ≈ 1500-1800 cycles ≈ 0.75-0.9 µs of the 8.2-8.4 µs: ≈ 7.3-7.6 µs
expected in the step, an expectation until the device check times it.
Measured (H200, check at 801b1da, bench/fused_correctness.md; CUDA-graph replays, warm
weights): B = 1 6.20 µs vs 6.57 for kda_split (stock's ops 72.5), out, rec_state and
conv_state bit-identical to kda_split; B = 8: 13.1 vs 9.6 µs (not used there). So the chain above is not where most of the step's
8.2 µs goes; the remaining latency is not yet located.

Why not "every CTA spins on the head counter and normalises its own columns": the row's
Σo² needs all 16 CTAs' o, so the critical path is the LAST CTA to arrive; under the spin
scheme that CTA still does atomic → re-read (one L2 round trip: 128 threads read one float
each, in parallel, the same latency as reading 16 published partial sums) → warp sum → store,
exactly as here, while the other 15 CTAs would see the count only one poll later. The
output store is one bf16 per thread, in parallel, not serial. So the spin would move no
work off the critical path and would add a second counter (to re-zero safely) and a poll
loop; not done. (A per-CTA partial Σo² in place of the o row would not be bit-identical
either: warp_reduction_sum's butterfly does not sum 8 adjacent columns as one subtree.)

Registers: the f_b row and f_a are 2 × 64 registers of packed bf16 held from the start to the
gate: ptxas (CPU, sm_90a) uses 168 registers (kda_split: 56) and spills 4 bytes (one value
through L1); at 128 threads per CTA and one CTA per SM the count costs nothing.

Check on the GPU (against the stock KDAAttention ops and the verified kda_split; times new vs
kda_split vs stock in CUDA graphs):
    python -m kimi_decode.kernels.kda_fast
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from kimi_decode.kernels import chain
from kimi_decode.kernels._common import sigmoid
from kimi_decode.kernels.kda_decode import CONV, KDAConfig
from kimi_decode.kernels.kda_split import (THREADS, VEC, KDAScratch, KDASplit, KDASplitConfig,
                                           compile_kernel, launch)
from kimi_decode.kernels.kda_split import can_implement as split_can_implement

# The chained build's loads past griddepcontrol.wait as one batch: the v channels' conv history
# and weights (state and constants) before the wait, then every z value (v predicated on
# tid < C) before the v conv's shared-memory stores. Why: in the PTX of the default build the
# tid < C block loads those, then its z value, stores it to shared memory (waiting on it), and
# only after the block come A_log, dt_bias, β's input, o_norm and the output gate, so warp 0
# pays two z round trips before the first barrier (the pattern kda_multi.BETA_AFTER_LOADS
# removed at T = 8, worth ~5 µs per B = 1, k = 7 KDA layer on the H100, bench/fused_runs.md
# session 24). Not measured yet: off, for a `--patch kimi_decode.kernels.kda_fast:
# Z_LOADS_FIRST=True` A/B. The arithmetic is the same either way (same PTX fp32 multiset).
Z_LOADS_FIRST = False


def can_implement(heads: int, head_dim: int, conv_kernel: int, in_proj_rows: int, tokens: int,
                  dtypes: tuple[torch.dtype, ...], splits: int = 16) -> bool:
    """kda_split's limits, and one token per sequence (k = 0)."""
    return tokens == 1 and split_can_implement(heads, head_dim, conv_kernel, in_proj_rows, dtypes, splits)


class KDAFast(KDASplit):
    """See the module docstring (T = 1 only). The blocks it shares with kda_split (indices,
    shared buffers, state and conv loads, q/k conv, norms, kᵀS, update and q̂ᵀS, arrival, the
    last CTA's row norm) are KDASplit's @cute.jit helpers; what is its own is the up-front
    loads, the v conv through shared memory, the register gate and the single-row norm."""

    def __init__(self, cfg: KDASplitConfig) -> None:
        super().__init__(cfg)
        if self.T != 1:
            raise ValueError("kda_fast is the T = 1 kernel")

    @cute.jit
    def __call__(self, z: cute.Pointer, f_b: cute.Pointer, conv_w: cute.Pointer,
                 conv_state: cute.Pointer, dt_bias: cute.Pointer, a_log: cute.Pointer,
                 rec_state: cute.Pointer, o_norm: cute.Pointer, out: cute.Pointer,
                 o_buf: cute.Pointer, counter: cute.Pointer, batch: Int32, stream: cuda.CUstream):
        mZ, *rest = self.views(z, f_b, conv_w, conv_state, dt_bias, a_log, rec_state, o_norm, out,
                               o_buf, counter, batch)            # T = 1: row m = b
        mZv = cute.make_tensor(z, cute.make_layout((batch, self.R // VEC, VEC), stride=(self.R, VEC, 1)))
        self.kernel_fast(mZ, mZv, *rest).launch(
            grid=[self.VS, self.H, batch], block=[THREADS, 1, 1], stream=stream,
            use_pdl=chain.chain_on())

    @cute.kernel
    def kernel_fast(self, mZ: cute.Tensor, mZv: cute.Tensor, mFb: cute.Tensor, mCw: cute.Tensor,
                    mCs: cute.Tensor, mDt: cute.Tensor, mA: cute.Tensor, mS: cute.Tensor,
                    mOn: cute.Tensor, mOut: cute.Tensor, mOb: cute.Tensor, mC: cute.Tensor):
        d, P, C = self.d, self.P, self.C
        kc = self.k
        tid, sp, h, b, lane, warp, c, kr, c0 = self.indices()
        row = b                           # T = 1
        smem = cutlass.memory.SmemAllocator()
        s_q, s_k, s_eg, s_v, s_part, s_red, s_flag = self.shared(smem)
        s_pv = smem.allocate_tensor(Float32, cute.make_layout((CONV, C), stride=(C, 1)))  # v conv terms

        # 1. Every global load of the CTA (except the last CTA's o re-read), before any barrier.
        S, gq, gk, gv = self.load_slice(mS, tid, h, b, c, kr, c0)
        fb = cute.make_rmem_tensor(cute.make_layout((d // VEC, VEC), stride=(VEC, 1)), BFloat16)
        fa = cute.make_rmem_tensor(cute.make_layout((d // VEC, VEC), stride=(VEC, 1)), BFloat16)
        if cutlass.const_expr(chain.chain_on()):
            # PDL chain: the state slice, f_b's row and the conv history / weights are this
            # layer's state of the previous step and constants; z (in_proj's output) is read
            # after the wait
            for vi in cutlass.range_constexpr(d // VEC):
                cute.autovec_copy(mFb[h * d + tid, vi, None], fb[vi, None])
            hq, hk, hv, wq, wk, wv = self.load_conv_qk(mCs, mCw, b, gq, gk)
            if cutlass.const_expr(Z_LOADS_FIRST):
                if tid < C:
                    self.load_conv_v(mCs, mCw, b, gv, hv, wv)
            chain.enter()
            for vi in cutlass.range_constexpr(d // VEC):
                cute.autovec_copy(mZv[row, 4 * P // VEC + vi, None], fa[vi, None])
        else:
            for vi in cutlass.range_constexpr(d // VEC):
                cute.autovec_copy(mFb[h * d + tid, vi, None], fb[vi, None])
                cute.autovec_copy(mZv[row, 4 * P // VEC + vi, None], fa[vi, None])
            hq, hk, hv, wq, wk, wv = self.load_conv_qk(mCs, mCw, b, gq, gk)
        xq = mZ[row, gq].to(Float32)
        xk = mZ[row, gk].to(Float32)
        xv = Float32(0.0)
        loads_first = Z_LOADS_FIRST and chain.chain_on()
        if cutlass.const_expr(loads_first):
            if tid < C:
                xv = mZ[row, gv].to(Float32)
            a_h = mA[h]
            dt = mDt[h * d + tid]
            zb = mZ[row, 4 * P + d + h].to(Float32)
            wn = mOn[tid].to(Float32)
            zg = mZ[row, 3 * P + h * d + tid].to(Float32)
        if tid < C:
            if cutlass.const_expr(not loads_first):
                self.load_conv_v(mCs, mCw, b, gv, hv, wv)
                xv = mZ[row, gv].to(Float32)
            # kda_split's rounding of the v conv: there LLVM computes the hist·w products in the
            # load block, so they round on their own and only x·w[3] fuses into the first add;
            # here they and x pass through shared memory (own slots) so that no fma absorbs the
            # products and x·w[3] is not computed (rounded) in this block (PTX of both, CPU test)
            for j in cutlass.range_constexpr(CONV - 1):
                s_pv[j, tid] = hv[j] * wv[j]
            s_pv[CONV - 1, tid] = xv
        if cutlass.const_expr(not loads_first):
            a_h = mA[h]
            dt = mDt[h * d + tid]
            zb = mZ[row, 4 * P + d + h].to(Float32)            # β's input (same address, broadcast)
            wn = mOn[tid].to(Float32)                           # the last CTA's norm operands
            zg = mZ[row, 3 * P + h * d + tid].to(Float32)

        # 2. Conv update + SiLU of q, k channel tid (and the slice's v channels on tid < C).
        aq, ak = self.conv_qk(xq, xk, xq * wq[CONV - 1], xk * wk[CONV - 1], hq, hk, wq, wk, s_q, s_k, tid)
        if tid < C:
            yv = s_pv[CONV - 1, tid] * wv[CONV - 1]
            for j in cutlass.range_constexpr(CONV - 1):
                yv += s_pv[j, tid]
            for j in cutlass.range_constexpr(CONV - 2):
                hv[j] = hv[j + 1]
            hv[CONV - 2] = xv
            s_v[tid] = yv * sigmoid(yv)
        self.norm_partials(aq, ak, s_red, lane, warp)              # ‖q‖², ‖k‖² per warp
        # Gate of key tid: f_b row h·d + tid · f_a, both in registers, in key order.
        decay = cute.math.exp(a_h)
        acc = Float32(0.0)
        for vi in cutlass.range_constexpr(d // VEC):
            for j in cutlass.range_constexpr(VEC):
                acc += fb[vi, j].to(Float32) * fa[vi, j].to(Float32)
        gr = acc.to(BFloat16).to(Float32) + dt
        g = Float32(kc.gate_lower_bound) * sigmoid(decay * gr)
        s_eg[tid] = cute.math.exp(g)
        beta = sigmoid(zb)
        cute.arch.sync_threads()                                # s_q, s_k, s_v, s_eg, s_red
        q_scale, k_scale = self.l2_scales(s_red)
        # 3. Decay, then k̂ᵀS[:, c]; 4. delta-rule update, then q̂ᵀS[:, c] to scratch.
        kS = self.decay_and_kS(S, s_eg, s_k, s_part, k_scale, tid, lane, warp, c, kr)
        u = beta * (s_v[c] - kS)
        self.update_and_o(S, s_k, s_q, s_part, k_scale, q_scale, u, mOb, row, tid, h, lane, warp, c, kr, c0)

        # 5. Own slice of the state and own v history back; then arrive (kda_split's pattern).
        self.arrive(mS, mCs, mC, S, hv, s_flag, tid, h, b, c, kr, c0, gv)
        if s_flag[0] == self.VS - 1:                    # CTA-uniform: the last CTA of (b, h)
            self.write_qk_history(mCs, hq, hk, b, gq, gk)
            # slot 0: its qn readers passed 4 barriers ago
            o_r, rs = self.row_rsqrt(mOb, s_red, 0, row, tid, h, lane, warp)
            gate = sigmoid(zg)
            mOut[row, h * d + tid] = (o_r * rs * wn * gate).to(BFloat16)
            if tid == 0:
                mC[b * self.H + h] = Int32(0)


def compile_for(cfg: KDASplitConfig) -> object:
    """The compiled kernel for `cfg` (cached)."""
    return compile_kernel(KDAFast, "kda_fast_zfirst" if Z_LOADS_FIRST else "kda_fast", cfg)


def kda_decode_fast(z: torch.Tensor, f_b: torch.Tensor, conv_w: torch.Tensor,
                    conv_state: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
                    rec_state: torch.Tensor, o_norm: torch.Tensor, kcfg: KDAConfig,
                    scratch: KDAScratch, splits: int | None = None) -> torch.Tensor:
    """kda_split.kda_decode_split's contract at T = 1 (kcfg.tokens == 1): conv_state and
    rec_state advance in place by one token; scratch from kda_split.make_scratch. Returns out
    [B, P] bf16."""
    return launch("kda_decode_fast", compile_for,
                  lambda dts, vs: can_implement(kcfg.heads, kcfg.head_dim, conv_w.shape[1],
                                                kcfg.in_proj_rows, kcfg.tokens, dts, vs),
                  z, f_b, conv_w, conv_state, dt_bias, a_log, rec_state, o_norm, kcfg, scratch, splits)


@torch.no_grad()
def _timings(mod: torch.nn.Module, kcfg: KDAConfig, conv_k: torch.Tensor, rec_k: torch.Tensor,
             batch: int) -> dict:
    """µs per call in CUDA-graph replays, on one in_proj output: the stock ops, kda_split (the
    verified path this kernel replaces) and this kernel (each on its own state and scratch)."""
    from kimi_decode.kernels import kda_split as ks
    from kimi_decode.kernels.checks import time_us
    cfg = mod.cfg
    z = mod.k.linear(torch.randn(cfg.rows, cfg.hidden, device=rec_k.device).bfloat16(), mod.in_proj)
    conv_s, rec_s = conv_k.clone(), rec_k.clone()
    sc_f, sc_s = ks.make_scratch(kcfg, batch, rec_k.device), ks.make_scratch(kcfg, batch, rec_k.device)
    return {"stock_us": time_us(lambda: ks._stock_core(mod, z)),
            "kda_split_us": time_us(lambda: ks.kda_decode_split(
                z, mod.f_b, mod.conv_w, conv_s, mod.dt_bias, mod.a_log, rec_s, mod.o_norm, kcfg, sc_s)),
            "kernel_us": time_us(lambda: kda_decode_fast(
                z, mod.f_b, mod.conv_w, conv_k, mod.dt_bias, mod.a_log, rec_k, mod.o_norm, kcfg, sc_f))}


def check(timing: bool = True, batches: tuple[int, ...] = (1, 8), steps: int = 3) -> list[dict]:
    """kda_split.check's harness at k = 0: the kernel vs the stock KDAAttention ops on the
    module's own tensors (z = the stock in_proj of fresh inputs), `steps` steps with state
    carried, vs the float64 reference on the same pre-step state, and vs the verified kda_split
    on the same inputs and state ("bit_identical": out, rec_state and conv_state equal). `ok`
    is kda_split's own acceptance (out within 1e-2 of stock and within 1.5× stock's own error
    vs float64, rec_state within 1e-3, conv_state equal, counters back to zero); bit identity
    is reported, not required. B = 1 is where fused.py uses it; B = 8 (V_SPLIT = 8) covers a
    second column width. Timing: this kernel vs kda_split vs the stock ops."""
    from kimi_decode.kernels import kda_split as ks
    return ks.check_beside_split("kda_fast", kda_decode_fast, _timings, timing, batches, 0, steps)


if __name__ == "__main__":
    for row in check():
        print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
