"""Routed experts for small M in two kernels: FC1 + SiTU-GLU, then FC2 + the weighted top-k
reduce (replaces stock_ops.experts_grouped / stock_triton.experts: a sort, two grouped GEMMs,
the GLU and the finalize, 48.8 us in 4 kernels at B = 1 on the H200). Every selected expert's
weights are streamed from HBM once per (row, slot) pair at near copy bandwidth; nothing else
of size is read.

Math (stock_ops.experts_grouped with situ_glu; P = M·K pairs p = m·K + j, e = idx[m, j]):
    h[p]    = bf16( w13[e] @ z[m] )                 [2·Ip]  fp32 accumulation, bf16 output
                                                            (the grouped GEMM's output dtype)
    a[p]    = bf16( SiTU(h[p, :Ip], h[p, Ip:]) )    [Ip]    SiTU in fp32, evaluated as
              (β·tanh(g/β) · σ(g)) · (β_lin·tanh(u/β_lin))  (stock_ops.situ's order)
    e[p]    = bf16( w2[e] @ a[p] )                  [L]     fp32 accumulation, bf16 output
    r[m]    = bf16( Σ_j w[m, j] · float(e[m·K + j]) )       fp32, j in order, then bf16
Rounding points: h, a, e, r, as stock. Only the fp32 summation orders differ (lane-strided
partial sums + a butterfly), which moves a bf16 rounding by one ulp now and then.

Padding: w13 rows I..Ip-1 of each half and w2 columns I..Ip-1 are zero by construction
(stock.LatentMoE concatenates zero blocks; I = 192 real, Ip = 256 at TP16). With
`inter=I` the kernels skip them: h = 0 there, SiTU(0, 0) = 0 and a zero term adds nothing, so
the result is bit-identical to reading them, and 25% fewer bytes are read. With `inter=None`
(I = Ip) everything is read and nothing is assumed.

Kernel 1 (ExpertsFC1): one warp per (pair p, output column c < I); grid = P·I / 8 CTAs of 8
warps (warp g = p·I + c, so a CTA covers 8 consecutive rows of one expert). CTA order
(FC1_COLUMN_MAJOR, fc1_warp_index): column-block major, CTA b = pair b mod P, so the P pairs'
CTAs for one block of 8 columns run together and a repeat of an expert in a later row reads
lines another CTA is reading at that moment (L2), where pair-major order re-read it from HBM. The warp computes
both gate row c and up row Ip + c of w13[e] (so the GLU is local): lane l reads the 128-bit
slices l, l+32, ... of both rows (coalesced 512-byte warp loads; the loop unrolled 14 deep at
K3, one trip: 36 registers and no spill, where 7 deep took 40 and spilled 12 B, ~7 us slower
per M = 8 layer in the step, bench/fused_runs.md) and the same slices of z[m] (7 KB, L1/L2-resident); two butterflies
finish the dots, every lane computes SiTU, lane 0 writes a[p, c] to a [P, Ip] bf16 scratch
(columns ≥ I are never written and never read). At M = 1 (FC1_LOADS_GROUP, fc1_group) the
14 slices run in groups of 7, each group's 21 loads written before its first conversion, with
ptxas allowed 80 registers (3 CTAs per SM; it issues ~15 of a group's loads back to back and
the rest as registers free): the loop's 36-register build kept only 3-5 loads in flight per
round trip, which the M = 1 grid of half a wave could not hide.
Kernel 2 (ExpertsFC2): one warp per output column l of L; grid = L / 8 CTAs of 8 warps. For
each row m, the warp first issues all K loads w2[e_j, l, 8·lane : 8·lane+8] (one 512-byte
row per expert, coalesced; lanes with 8·lane ≥ I skip theirs: 16 loads in flight per lane),
then `griddepcontrol.wait` (see PDL below; it is also the fence that keeps ptxas from sinking
each load next to its use); the CTA stages a[m·K : m·K+K, :I] (6 KB, L2-resident) in shared
memory (its loads issued with the w2 loads, or after the wait with PDL), a barrier, and per
j: one 128-bit shared read, 8 FMAs, a butterfly, bf16 round, acc += w[m, j] · that (j in
order). Lane 0 writes out[m, l] in bf16. `out` may be any
contiguous [M, L] bf16 view (e.g. a slot of the all-reduce buffer). ~120 registers (64 hold
the w2 slices), capped at 128 by `min_blocks_per_mp=2`: 2 CTAs per SM, so 448 CTAs take 1.7
waves; each SM keeps ~100 KB of w2 loads in flight. The weights w[m, :] (0 for an invalid id)
sit in shared memory too, so no register holds them across the loads.

FC2 v2 (ExpertsFC2v2, kernel `experts_v2`, `experts(..., v2=True)`; FC1 unchanged). Why FC2
reached 34% of the HBM peak (bench/ncu_fused_b1.md: 13.6 us cold for 22 MB): 126 registers
(ptxas 13.0) allow 2 CTAs of 8 warps per SM, so 448 CTAs take 1.7 waves of all-at-once
bursts (98 KB per SM, then the drain, then a second, uneven burst: 184 CTAs leave 80 SMs with
one), and lanes 24..31 of every warp hold registers but load nothing (192 of 256 columns).
Little's law asks for ~3.8 TB/s x ~1 us / 132 SMs ≈ 29 KB in flight per SM; the M = 1 stream
is 16·3584·192·2 B = 22 MB = 167 KB per SM, so a burst that holds ALL of it fits when ~65%
of the register file (42.7 K of 64 K registers) can be load destinations. Layout:
- a warp = one output column l, all K experts; its 32 lanes are 4 groups of 8: group g takes
  experts j = g + 4t (t < K/4), lane r of the group the slices q = r + 8i (i < I/64) of each
  row: 4·3 = 12 loads of 16 B per lane at K3, every lane busy, 48 registers of data (the old
  FC2: 16 loads, 64 registers, 25% of them idle); one warp instruction reads 4 experts'
  whole 128-byte lines.
- a CTA = 4 warps (4 columns) of one row: grid = M·L/4 = 896 CTAs at M = 1, CTA b taking row
  b % M of column block b // M (the rows of a block side by side: experts shared by rows are
  re-read from L2). min_blocks_per_mp = 7 caps ptxas at 72 registers: 7·132 = 924 CTA slots
  ≥ 896, so the whole 22 MB is requested in one wave (~163 KB per SM in flight); ptxas spills
  a few words under that cap (20 B stored, 32 B reloaded per thread, local memory in L1;
  118 registers uncapped).
- as before, all w2 loads (and the ids and weights) are issued before griddepcontrol.wait;
  `a` [K, I] (6 KB, L2) is staged in shared memory after it, 8 threads per activation row,
  one 128-bit slice at a time (a rolled loop: 4 registers beside the 48 in flight; staging
  all at once made ptxas spill more); one barrier.
- per group: K/4 dots (lane: its slices, 8 elements each, in order; then a 3-step 8-lane
  butterfly, after which every lane of the group holds the same fp32 sum), each rounded to
  bf16 (e); then 16 index shuffles bring e_j from group j % 4 and every lane sums
  acc += w[m, j]·e_j in j order, as ExpertsFC2; lane 0 stores bf16(acc).
Rounding points unchanged (h, a, e, r); only e's fp32 dot order differs from ExpertsFC2
(3 slices per lane + 8-lane butterfly instead of 1 slice per lane + 32-lane butterfly), so
results match it within the check's 1e-2 (an occasional one-ulp bf16 flip of an e_j), not
bit for bit. Shuffles: 12 + 16 per warp (ExpertsFC2: 80). Expectation at M = 1 (not yet
measured): latency + 22 MB / 3.8 TB/s ≈ 1 + 5.8 ≈ 7 us cold, against 13.6 us. With PDL in
the step FC2 CTAs become resident beside FC1's (~3 per SM at 40 registers ≈ 30 K registers)
only as far as registers allow (~4 of the 7), the rest as FC1 drains. At M = 8: 7,168 CTAs,
~7.8 waves of the same per-CTA burst (24 KB).
Measured (H200, check_v2 at 801b1da, bench/fused_correctness.md; cold weights cycling 4
routings, FC1 included): M = 1 with PDL 23.7 us vs 26.2 for FC1 + ExpertsFC2 (without PDL
25.6 vs 27.6); M = 8 with PDL 141.9 vs 155.4 us. Equal to ExpertsFC2 bit for bit at M = 1 in
that run, within 1e-2 at M = 8.

PDL (`pdl=True`): FC2 is launched with programmatic stream serialization; FC1 executes
`griddepcontrol.launch_dependents` at its start, so FC2's CTAs may start (and issue their w2
loads, which depend on nothing FC1 writes) while FC1's last CTAs run; `griddepcontrol.wait`
then blocks until FC1 has completed and its writes are visible, before `a` is read. idx and
w are read before the wait: they were written before FC1 started. Without `pdl` both
instructions are no-ops and the launch is ordinary stream order.

Early ids (FC1_EARLY_IDS, `experts(..., ids_ready=)`, M = 1 with load groups): the MoE front
(gemv_multi.route_and_project with publish_ready) raises a flag in a routing sync buffer once
its top-k has written idx and w (a release add after each writer's fence and a barrier). FC1's
thread 0 polls it (acquire loads) and arrives on a counter beside it; the last of FC1's CTAs
lowers the flag and the counter again (fc1_await_ids). A barrier and a fence by every thread,
then each warp reads its id and issues its first load group's weights, and only then passes
the PDL chain's wait (z, the front's other output, is read after it) and releases FC2. So
FC1's first weight bytes are requested while the front's last projection CTAs still stream,
not one ids round trip after its end. Why the flag is safe across steps and layers: under the
chain FC1 starts only once every front CTA has entered (passed its wait), and the next step's
front raises the flag only after this FC1 has completed (chain.py's protocol), so no FC1 can
see the previous step's flag; a front that raises it is always followed by an FC1 that lowers
it (fused.LatentMoE._early_ids_apply decides both together).

Why it should reach its target (M = 1, K = 16, L = 3584, I = 192): FC1 reads 16·2·192·3584·2 B
= 44 MB, FC2 16·3584·192·2 B = 22 MB: 66 MB, 17 us at 3.9 TB/s, plus two ramp/tails (~2 us
each) -> ~21-23 us (88 MB and ~26-28 us with inter=None), against 48.8 us stock; PDL may hide
1-2 us of FC2's start. FC1's 384 CTAs are one wave (~40 registers); every SM keeps ~45 KB of
loads in flight, above what 3.9 TB/s · ~1 us latency / 132 SMs needs (~30 KB).
At M = 8 the bytes scale with the number of pairs (each pair re-reads its expert; repeats
across rows may hit L2), like a gather-bmm: ~128·5.5 MB·0.75 at worst.

Indices: all offsets are int32 element offsets; the largest, into w13, is E·2·Ip·L < 2^31
(1.64e9 at K3 TP16), which the wrapper checks. Expert ids outside [0, E) contribute 0
(never happens with router output). No shuffle sits in a lane-dependent branch: guards clamp
indices and predicate loads and stores (warp_idx() included, see _common.block_sum).

Check on the GPU (against stock_ops.experts_grouped and the float64 reference; times both;
`check_v2`: FC2 v2, also against the kernels above, old vs new timed):
    python -m kimi_decode.kernels.moe_experts [v2]
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from kimi_decode.kernels import chain
from kimi_decode.kernels._common import compile_options, compiled, current_stream, dummy_ptr, ptr, sigmoid
from kimi_decode.kernels.router_fast import FC1_DONE_WORD, READY_WORD, SYNC_WORDS

VEC = 8          # bf16 per 128-bit load
WARPS = 8        # warps per CTA (both kernels)
MAX_ROWS = 8     # M
MAX_PAIRS = 128  # M·K
FC1_UNROLL = 14  # slices of the L loop in flight per lane (L / 256 = 14 at K3: one round; 7 ran
                 # ~7 us slower per M = 8 layer with 40 registers and a spill: bench/fused_runs.md)
# FC1's CTA order: True = column-block major (CTA b: pair b % P, columns 8·(b // P) ..), so
# the CTAs of all P pairs for the same 8 columns run at the same time and two rows that picked
# the same expert request the same weight lines together (one HBM read, the other an L2 hit);
# False = pair major (CTA b: pair b // (I/8)), where at M = 8 such a repeat comes ~1/8 of the
# kernel later and is read from HBM again (ncu, session 9: 347 MB from DRAM for 352 MB of
# (pair, expert) slices; ~331 MB are distinct experts). Same warps, same code: `a` is
# bit-identical either way (check_fc1_order). In the step (d9ea8dc, bench/fused_runs.md
# session 12) column order took 1.3-2.6 µs off every M = 8 layer (B = 1, k = 7 KDA 206.8 ->
# 204.7, MLA 222.6 -> 220.9; B = 8 201.7 -> 200.4, 225.8 -> 223.2).
FC1_COLUMN_MAJOR = True
# FC1's slices in groups of FC1_LOADS_GROUP per lane, every load of a group (gate, up and z
# slices) issued before its first conversion; 0: the per-slice loop above (FC1_UNROLL). Why:
# ncu at 150e59b (H100, B = 1, k = 0, the first layer's FC1, cold, SourceCounters): 20.9 us for
# 44 MB (2.2 TB/s against the card's 3.0 TB/s copy), 88 % of the warps' stall cycles on L1TEX
# scoreboards, and in the SASS ptxas kept the unrolled loop's order: 3-5 LDG.128 in flight, then
# the first bf16 -> fp32 shift waits for them (each of ~10 such rounds holds 3.5-6.4 % of the
# samples), so at 36 registers a warp spends FC1 in ~10 dependent round trips. Grouped, each
# lane has a group's 3·G loads in flight at once (same products in the same order: bit-equal).
# Measured (H100, 664c221, bench/fused_runs.md session 19; check_fc1_group, FC1 alone, cold):
# M = 1 loop 21.2 us, groups 3 / 5 / 7 20.7 / 20.6 / 18.4; M = 8 loop 111.2, groups 114.8-115.0.
# In the step (fused_ab, groups at every M <= 8): B = 1, k = 0 KDA 102.1-102.4 us against
# 103.5-103.8 (MLA 116.3-116.5 against 118.0), but M = 8 layers 4-5 us slower. So: group 7 at
# M = 1 only (the per-M table); M >= 2 keeps the loop (at 3,072+ CTAs its 6 CTAs per SM win).
FC1_LOADS_GROUP = 7
FC1_GROUP_MAX_ROWS = 1   # M up to which FC1 runs grouped (above: the loop)
# With a group: ptxas held to 3 CTAs of 8 warps per SM (it takes 80 registers, a group of 7
# slices would need 84 for its data alone, so ptxas issues ~15 loads at once and the rest as
# registers free; 4 B of spill), so M = 1's 384 CTAs stay one wave on 132 SMs
FC1_GROUP_MIN_BLOCKS = 3
# FC1 at M = 1 (its load groups) takes the router's ids as soon as the MoE front's top-k
# publishes them (router_fast.READY_WORD of the front's routing sync buffer), not at the
# front's end: its CTAs that are resident beside the front's last projection CTAs issue their
# first load group of expert weights, then wait (griddepcontrol.wait) for z. Why: in the H200
# B = 1, k = 0 graph trace (cd24720) FC1 ends 15.4 us after the front for 44 MB (10.4 us at
# the copy rate); after the front's end each CTA read the ids (an L2 round trip) before its
# first weight address was known, then waited for its first bytes, with HBM idle meanwhile
# (the fixed ~5-6 us of bench/ncu_fused_b1.md). The top-k runs in the front's last router
# CTA, while the projection CTAs still stream (gemv_multi's module docstring). Measured (H100,
# 315382f, bench/fused_runs.md session 28, `fused_ab --batch 1 --spec 0`, two pairs): B = 1,
# k = 0 KDA 98.9-99.4 / MLA 112.1-112.4 us against 100.7-101.1 / 113.9-114.0 without it; the
# PDL chain's bit-equality check and step parity (B = 1, k = 0 and 7) pass with it.
# fused.LatentMoE passes the buffer only when on.
FC1_EARLY_IDS = True
V2_WARPS = 4         # FC2 v2: warps per CTA (one output column each)
V2_GROUPS = 4        # FC2 v2: 8-lane groups per warp (each a quarter of the K experts)
V2_GROUP_LANES = 8


@dataclass(frozen=True)
class ExpertsConfig:
    """Compile-time sizes (M is a runtime argument of both kernels)."""

    latent: int              # L
    inter_padded: int        # Ip: row length of w2, half the rows of w13
    inter: int               # I ≤ Ip: rows of w13 / columns of w2 actually read
    top_k: int               # K
    experts: int             # E
    idx_dtype: torch.dtype   # int32 or int64
    pdl: bool = False        # launch FC2 with programmatic dependent launch (see `experts`)
    stage_async: bool = False  # FC2 v2 stages `a` with cp.async (kernel experts_v2_async)


def can_implement(m: int, k: int, latent: int, inter_padded: int, dtypes: tuple[torch.dtype, ...],
                  inter: int | None = None) -> bool:
    """1 ≤ M ≤ 8, M·K ≤ 128; L a multiple of 256 (8 bf16 × 32 lanes); Ip a multiple of 256
    with K·Ip/256 ≤ 16 (FC2 keeps K·Ip/256 slices of w2 and a per lane in registers); the
    skipped padding I..Ip-1 starts on a 128-bit slice (I % 8 == 0); bf16 tensors."""
    i = inter_padded if inter is None else inter
    return (1 <= m <= MAX_ROWS and 1 <= k and m * k <= MAX_PAIRS
            and latent % (VEC * 32) == 0 and latent > 0
            and inter_padded % (VEC * 32) == 0 and k * (inter_padded // (VEC * 32)) <= 16
            and 0 < i <= inter_padded and i % VEC == 0
            and all(d == torch.bfloat16 for d in dtypes))


@cute.jit
def fc1_warp(mZ: cute.Tensor, mIdx: cute.Tensor, mW: cute.Tensor, mA: cute.Tensor, m: Int32,
             beta: Float32, lin_beta: Float32, g: Int32, lane: Int32, Ip: cutlass.Constexpr[int],
             I: cutlass.Constexpr[int], K: cutlass.Constexpr[int], E: cutlass.Constexpr[int],
             slices: cutlass.Constexpr[int], unroll: cutlass.Constexpr[int],
             group: cutlass.Constexpr[int] = 0, pre_wait: cutlass.Constexpr[bool] = False):
    """FC1's warp g: a[p, c] for pair p = g // I, column c = g % I (gate row c and up row
    Ip + c of the pair's expert, `slices` 128-bit slices per lane, a 32-lane butterfly each,
    bf16 h, then the gate/up activation). Shared by ExpertsFC1.kernel and
    moe_experts_one.ExpertsOne.fc1_item. `group` > 0 (FC1_LOADS_GROUP): the slices in groups
    of that many, each group's loads all issued before its first conversion; the products
    are summed in the same order either way (bit-equal). `pre_wait` (with a group; the ids
    already published, FC1_EARLY_IDS): the first group's weight loads are issued, then the
    PDL chain's wait and release (chain.enter), then its z loads: the same loads, products and
    order, only z's loads move after the wait."""
    p = g // I                           # pair
    c = g - p * I                        # output column (gate row c, up row Ip + c)
    # Every lane reaches the shuffles below: out-of-range warps (none: the grid is exact)
    # clamp their indices, load nothing and store nothing.
    pairs = m * K
    pc = p
    if p >= pairs:
        pc = pairs - 1
    row = pc // K
    e = mIdx[row, pc - row * K].to(Int32)
    acc = cute.make_rmem_tensor(cute.make_layout(2), Float32)
    acc.fill(0.0)
    wg = cute.make_rmem_tensor(cute.make_layout(VEC), mW.element_type)
    wu = cute.make_rmem_tensor(cute.make_layout(VEC), mW.element_type)
    zv = cute.make_rmem_tensor(cute.make_layout(VEC), mZ.element_type)
    if cutlass.const_expr(group > 0):
        # every slice's gate and up weights in one register array each (indexed at trace time,
        # so only a group's stay live), z per group
        gw = cute.make_rmem_tensor(cute.make_layout((slices, VEC), stride=(VEC, 1)), mW.element_type)
        uw = cute.make_rmem_tensor(cute.make_layout((slices, VEC), stride=(VEC, 1)), mW.element_type)
        if cutlass.const_expr(pre_wait):
            if p < pairs and e >= 0 and e < E:   # warp-uniform; the first group's weights only
                for t in cutlass.range_constexpr(min(group, slices)):
                    q = lane + t * 32
                    cute.autovec_copy(mW[e, c, q, None], gw[t, None])
                    cute.autovec_copy(mW[e, Ip + c, q, None], uw[t, None])
            chain.enter()                        # every thread: z is read after the wait
        if p < pairs and e >= 0 and e < E:   # warp-uniform; loads only (no shuffles inside)
            for gi in cutlass.range_constexpr((slices + group - 1) // group):
                i0 = gi * group
                n = min(group, slices - i0)
                zs = cute.make_rmem_tensor(cute.make_layout((n, VEC), stride=(VEC, 1)), mZ.element_type)
                for t in cutlass.range_constexpr(n):
                    q = lane + (i0 + t) * 32
                    if cutlass.const_expr(not pre_wait or gi > 0):
                        cute.autovec_copy(mW[e, c, q, None], gw[i0 + t, None])
                        cute.autovec_copy(mW[e, Ip + c, q, None], uw[i0 + t, None])
                    cute.autovec_copy(mZ[row, q, None], zs[t, None])
                for t in cutlass.range_constexpr(n):
                    for v in cutlass.range_constexpr(VEC):
                        zf = zs[t, v].to(Float32)
                        acc[0] = acc[0] + gw[i0 + t, v].to(Float32) * zf
                        acc[1] = acc[1] + uw[i0 + t, v].to(Float32) * zf
    else:
        if p < pairs and e >= 0 and e < E:   # warp-uniform; loads only (no shuffles inside)
            for i in cutlass.range(slices, unroll=unroll):
                q = lane + i * 32
                cute.autovec_copy(mW[e, c, q, None], wg)
                cute.autovec_copy(mW[e, Ip + c, q, None], wu)
                cute.autovec_copy(mZ[row, q, None], zv)
                for t in cutlass.range_constexpr(VEC):
                    zf = zv[t].to(Float32)
                    acc[0] = acc[0] + wg[t].to(Float32) * zf
                    acc[1] = acc[1] + wu[t].to(Float32) * zf
    hg = cute.arch.warp_reduction_sum(acc[0]).to(mA.element_type).to(Float32)   # bf16 h
    hu = cute.arch.warp_reduction_sum(acc[1]).to(mA.element_type).to(Float32)
    gate = beta * cute.math.tanh(hg / beta) * sigmoid(hg)
    up = lin_beta * cute.math.tanh(hu / lin_beta)
    a = gate * up
    if lane == 0 and p < pairs:
        mA[p, c] = a.to(mA.element_type)


def fc2_views(cfg: ExpertsConfig, act: cute.Pointer, idx: cute.Pointer, w: cute.Pointer,
              w2: cute.Pointer, out: cute.Pointer, m: Int32) -> tuple[cute.Tensor, ...]:
    """FC2's tensors (mA, mIdx, mWt, mW2, mO) for ExpertsFC2 and ExpertsFC2v2 (plain Python,
    run while their __call__ traces)."""
    L, Ip, K, E = cfg.latent, cfg.inter_padded, cfg.top_k, cfg.experts
    ni = Ip // VEC
    mA = cute.make_tensor(act, cute.make_layout((m * K, ni, VEC), stride=(Ip, VEC, 1)))
    mIdx = cute.make_tensor(idx, cute.make_layout((m, K), stride=(K, 1)))
    mWt = cute.make_tensor(w, cute.make_layout((m, K), stride=(K, 1)))
    mW2 = cute.make_tensor(w2, cute.make_layout((E, L, ni, VEC), stride=(L * Ip, Ip, VEC, 1)))
    mO = cute.make_tensor(out, cute.make_layout((m, L), stride=(L, 1)))
    return mA, mIdx, mWt, mW2, mO


def fc1_warp_index(bidx, warp, pairs, inter: int, column_major: bool):
    """FC1's warp number g = p·I + c (fc1_warp's pair p, column c) of warp `warp` in CTA `bidx`:
    pair major, CTA b covers columns 8·(b mod I/8) .. of pair b div (I/8); column major, CTA b
    covers columns 8·(b div P) .. of pair b mod P. Plain arithmetic, so the kernel traces it
    on its Int32 values and the tests run it on Python ints (a bijection onto 0 .. P·I - 1)."""
    if column_major:
        cb = bidx // pairs
        return (bidx - cb * pairs) * inter + cb * WARPS + warp
    return bidx * WARPS + warp


class ExpertsFC1:
    """Kernel 1: a[p, c] = bf16(SiTU(bf16(w13[e, c] · z[m]), bf16(w13[e, Ip + c] · z[m])))."""

    def __init__(self, cfg: ExpertsConfig, unroll: int = FC1_UNROLL, column_major: bool | None = None,
                 group: int | None = None, early_ids: bool = False) -> None:
        """`unroll`: slices of the L loop per trip (FC1_UNROLL; experts_one builds its FC1
        items at its own depth and compares them with this kernel at that depth).
        `column_major`: the CTA order (FC1_COLUMN_MAJOR when None); it needs I % 8 == 0
        (a CTA's 8 columns within one pair), which can_implement's I % VEC == 0 gives.
        `group`: FC1_LOADS_GROUP when None (0: the loop). `early_ids` (with a group:
        FC1_EARLY_IDS): the ids are read once the front's top-k has published them (the
        routing sync buffer `sync`), and the first load group's weights before the wait."""
        self.cfg = cfg
        self.slices = cfg.latent // (VEC * 32)
        self.unroll = unroll if self.slices % unroll == 0 else 1
        cm = FC1_COLUMN_MAJOR if column_major is None else column_major
        self.column_major = bool(cm) and cfg.inter % WARPS == 0
        self.group = max(0, min(int(FC1_LOADS_GROUP if group is None else group), self.slices))
        self.early_ids = bool(early_ids) and self.group > 0

    @cute.jit
    def __call__(self, z: cute.Pointer, idx: cute.Pointer, w13: cute.Pointer, act: cute.Pointer,
                 sync: cute.Pointer, m: Int32, beta: Float32, lin_beta: Float32, stream: cuda.CUstream):
        """`sync`: the front's routing sync buffer (int32, router_fast.SYNC_WORDS) with
        early_ids, else never read (any int32 pointer)."""
        L, Ip, I, K, E = self.cfg.latent, self.cfg.inter_padded, self.cfg.inter, self.cfg.top_k, self.cfg.experts
        nv = L // VEC
        mZ = cute.make_tensor(z, cute.make_layout((m, nv, VEC), stride=(L, VEC, 1)))
        mIdx = cute.make_tensor(idx, cute.make_layout((m, K), stride=(K, 1)))
        mW = cute.make_tensor(w13, cute.make_layout((E, 2 * Ip, nv, VEC), stride=(2 * Ip * L, L, VEC, 1)))
        mA = cute.make_tensor(act, cute.make_layout((m * K, Ip), stride=(Ip, 1)))
        mS = cute.make_tensor(sync, cute.make_layout(SYNC_WORDS))
        if cutlass.const_expr(self.group > 0):
            # explicit carveout (-1: the driver's default): no device query at compile time
            self.kernel(mZ, mIdx, mW, mA, mS, m, beta, lin_beta).launch(
                grid=[m * (K * I // WARPS), 1, 1], block=[WARPS * 32, 1, 1], stream=stream,
                use_pdl=chain.chain_on(), min_blocks_per_mp=FC1_GROUP_MIN_BLOCKS, preferred_smem_carveout=-1)
        else:
            self.kernel(mZ, mIdx, mW, mA, mS, m, beta, lin_beta).launch(
                grid=[m * (K * I // WARPS), 1, 1], block=[WARPS * 32, 1, 1], stream=stream,
                use_pdl=chain.chain_on())

    @cute.kernel
    def kernel(self, mZ: cute.Tensor, mIdx: cute.Tensor, mW: cute.Tensor, mA: cute.Tensor,
               mS: cute.Tensor, m: Int32, beta: Float32, lin_beta: Float32):
        Ip, I, K, E = self.cfg.inter_padded, self.cfg.inter, self.cfg.top_k, self.cfg.experts
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()          # all 32 lanes, outside any branch
        lane = cute.arch.lane_idx()
        # PDL hint: FC2 (when launched with use_pdl) may start once every FC1 CTA is running;
        # it waits (griddepcontrol.wait) for this grid's end before reading `a`. No effect
        # on results; without use_pdl on FC2 it is a no-op. In the PDL chain FC1 itself
        # starts early: it waits for the router's ids first and releases FC2 only then (FC2
        # reads the ids before its own wait; kernels/chain.py). With early_ids the ids come
        # from the front's flag instead and the chain's wait follows the first load group
        # (fc1_warp's pre_wait), still before FC2 is released.
        if cutlass.const_expr(self.early_ids):
            if cutlass.const_expr(not chain.chain_on()):
                cute.arch.griddepcontrol_launch_dependents()
            fc1_await_ids(mS)
        elif cutlass.const_expr(chain.chain_on()):
            chain.enter()
        else:
            cute.arch.griddepcontrol_launch_dependents()
        g = fc1_warp_index(bidx, warp, m * K, I, self.column_major)
        fc1_warp(mZ, mIdx, mW, mA, m, beta, lin_beta, g, lane, Ip, I, K, E, self.slices, self.unroll,
                 self.group, self.early_ids)


@cute.jit
def fc1_await_ids(mS: cute.Tensor):
    """FC1_EARLY_IDS, at the kernel's start: thread 0 polls the routing sync buffer's ids-ready
    flag (acquire, gpu scope) until the front's top-k has raised it, then arrives on the FC1
    counter; the CTA that arrives last (every other CTA has seen the flag) lowers the flag and
    re-zeroes the counter for the next step's front. Then a barrier and a fence by every
    thread, after which the ids and weights the top-k wrote are visible (moe_experts_one's
    poll pattern). Deadlock-free: FC1 starts only after every front CTA has entered the chain
    (kernels/chain.py), so the top-k CTA is running; without the chain the front is complete."""
    tidx, _, _ = cute.arch.thread_idx()
    gdim, _, _ = cute.arch.grid_dim()
    if tidx == 0:
        rp = mS.iterator + READY_WORD
        seen = cute.arch.load(rp.llvm_ptr, Int32, sem="acquire", scope="gpu")
        while seen == 0:
            seen = cute.arch.load(rp.llvm_ptr, Int32, sem="acquire", scope="gpu")
        old = cute.arch.atomic_add(mS.iterator + FC1_DONE_WORD, Int32(1), sem="acq_rel", scope="gpu")
        if old == gdim - 1:
            mS[FC1_DONE_WORD] = Int32(0)
            mS[READY_WORD] = Int32(0)
    cute.arch.sync_threads()
    cute.arch.fence_acq_rel_gpu()


class ExpertsFC2:
    """Kernel 2: out[m, l] = bf16(Σ_j w[m, j] · bf16(w2[e_j, l] · a[m·K + j]))."""

    def __init__(self, cfg: ExpertsConfig) -> None:
        self.cfg = cfg
        # launched with PDL: FC2's own flag, or always in the PDL chain (kernels/chain.py)
        self.pdl = cfg.pdl or chain.chain_on()
        self.chunks = cfg.inter_padded // (VEC * 32)   # 128-bit slices per lane per w2 row

    @cute.jit
    def __call__(self, act: cute.Pointer, idx: cute.Pointer, w: cute.Pointer, w2: cute.Pointer,
                 out: cute.Pointer, m: Int32, stream: cuda.CUstream):
        L = self.cfg.latent
        mA, mIdx, mWt, mW2, mO = fc2_views(self.cfg, act, idx, w, w2, out, m)
        self.kernel(mA, mIdx, mWt, mW2, mO, m).launch(
            grid=[L // WARPS, 1, 1], block=[WARPS * 32, 1, 1], stream=stream, use_pdl=self.pdl,
            # ptxas: at most 128 registers, so 2 CTAs share an SM (~120 used without the cap);
            # an explicit carveout (-1: the driver's default) keeps the DSL from querying the
            # device for its shared-memory size at compile time (no GPU in CI)
            min_blocks_per_mp=2, preferred_smem_carveout=-1)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mIdx: cute.Tensor, mWt: cute.Tensor, mW2: cute.Tensor,
               mO: cute.Tensor, m: Int32):
        L, Ip, I, K, E = self.cfg.latent, self.cfg.inter_padded, self.cfg.inter, self.cfg.top_k, self.cfg.experts
        nch = self.chunks
        ni = Ip // VEC
        threads = WARPS * 32
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()          # all 32 lanes, outside any branch
        lane = cute.arch.lane_idx()
        col = bidx * WARPS + warp
        # every thread runs the row loop, its barriers and shuffles; an out-of-range warp
        # (none: the grid is exact) reads column L-1 and stores nothing
        cc = col
        if col >= L:
            cc = L - 1
        smem = cutlass.memory.SmemAllocator()
        sA = smem.allocate_tensor(mA.element_type, cute.make_layout((K, ni, VEC), stride=(Ip, VEC, 1)),
                                  byte_alignment=16)
        sW = smem.allocate_tensor(Float32, cute.make_layout(K), byte_alignment=16)
        wv = cute.make_rmem_tensor(cute.make_layout((VEC, nch, K)), mW2.element_type)
        av = cute.make_rmem_tensor(cute.make_layout(VEC), mA.element_type)
        nst = (K * ni + threads - 1) // threads          # staged slices per thread
        stg = cute.make_rmem_tensor(cute.make_layout((VEC, nst)), mA.element_type)
        ev = cute.make_rmem_tensor(cute.make_layout(K), Int32)
        for row in range(m):
            # the row's K ids (one 128-byte line); an id outside [0, E) reads expert 0, and its
            # weight is 0 (never happens with router output)
            for j in cutlass.range_constexpr(K):
                e = mIdx[row, j].to(Int32)
                if e < 0 or e >= E:
                    e = Int32(0)
                ev[j] = e
            # all K experts' w2 slices (K·nch 128-bit loads in flight per lane) ...
            wv.fill(0.0)
            for j in cutlass.range_constexpr(K):
                for i in cutlass.range_constexpr(nch):
                    q = lane + i * 32
                    if q * VEC < I:                  # lane-divergent: loads only
                        cute.autovec_copy(mW2[ev[j], cc, q, None], wv[None, i, j])
            # ... all issued before griddepcontrol.wait below, which is a scheduling fence
            # (ptxas otherwise sinks each load next to its butterfly, leaving one or two loads
            # in flight per warp) and, with PDL, the point past which FC1's `a` is complete and
            # visible (a no-op otherwise; idx, w and w2 were written before FC1 started).
            # The row's K activation rows (columns < I) are staged in shared memory by the CTA:
            # each thread loads its slices (thread t: slices t, t + 256, ...) into registers,
            # before the wait when FC1 is known complete (no PDL: stream order), after it with
            # PDL, then stores them to shared memory.
            if cutlass.const_expr(not self.pdl):
                for s0 in cutlass.range_constexpr(nst):
                    sl = tidx + s0 * threads
                    j = sl // ni
                    q = sl - j * ni
                    if sl < K * ni and q * VEC < I:
                        cute.autovec_copy(mA[row * K + j, q, None], stg[None, s0])
            if tidx < K:                             # the row's weights, 0 for an invalid id
                e = mIdx[row, tidx].to(Int32)
                wj = mWt[row, tidx]
                if e < 0 or e >= E:
                    wj = Float32(0.0)
                sW[tidx] = wj
            cute.arch.griddepcontrol_wait()
            chain.release()
            if cutlass.const_expr(self.pdl):
                for s0 in cutlass.range_constexpr(nst):
                    sl = tidx + s0 * threads
                    j = sl // ni
                    q = sl - j * ni
                    if sl < K * ni and q * VEC < I:
                        cute.autovec_copy(mA[row * K + j, q, None], stg[None, s0])
            for s0 in cutlass.range_constexpr(nst):
                sl = tidx + s0 * threads
                j = sl // ni
                q = sl - j * ni
                if sl < K * ni and q * VEC < I:
                    cute.autovec_copy(stg[None, s0], sA[j, q, None])
            cute.arch.sync_threads()
            # the K dot products, each rounded to bf16, weighted in j order
            acc = Float32(0.0)
            for j in cutlass.range_constexpr(K):
                s = Float32(0.0)
                for i in cutlass.range_constexpr(nch):
                    q = lane + i * 32
                    av.fill(0.0)
                    if q * VEC < I:                  # lane-divergent: a shared-memory read only
                        cute.autovec_copy(sA[j, q, None], av)
                    for t in cutlass.range_constexpr(VEC):
                        s = s + wv[t, i, j].to(Float32) * av[t].to(Float32)
                tot = cute.arch.warp_reduction_sum(s).to(mO.element_type).to(Float32)
                acc = acc + sW[j] * tot
            if lane == 0 and col < L:
                mO[row, col] = acc.to(mO.element_type)
            cute.arch.sync_threads()                 # sA is rewritten by the next row


def v2_tensors(mA: cute.Tensor, mW2: cute.Tensor, K: int, nq: int, kpg: int, nsl: int) -> tuple:
    """FC2 v2's buffers, allocated inside the calling kernel (plain Python, run while it
    traces): sA, the row's K activation rows (nq 128-bit slices each) in shared memory; sW,
    its K routing weights; the registers wv (the lane's w2 slices), av (one staged slice), ev
    (its group's expert ids) and ex (its group's rounded dot products). Shared by
    ExpertsFC2v2.kernel and moe_fc2_rows.ExpertsFC2Rows.kernel."""
    smem = cutlass.memory.SmemAllocator()
    sA = smem.allocate_tensor(mA.element_type, cute.make_layout((K, nq, VEC), stride=(nq * VEC, VEC, 1)),
                              byte_alignment=16)
    sW = smem.allocate_tensor(Float32, cute.make_layout(K), byte_alignment=16)
    wv = cute.make_rmem_tensor(cute.make_layout((VEC, nsl, kpg)), mW2.element_type)
    av = cute.make_rmem_tensor(cute.make_layout(VEC), mA.element_type)
    ev = cute.make_rmem_tensor(cute.make_layout(kpg), Int32)
    ex = cute.make_rmem_tensor(cute.make_layout(kpg), Float32)
    return sA, sW, wv, av, ev, ex


@cute.jit
def v2_ids(mIdx: cute.Tensor, ev: cute.Tensor, row: Int32, grp: Int32, E: cutlass.Constexpr[int],
           kpg: cutlass.Constexpr[int]):
    """The lane's group's K/4 expert ids of `row` (ev); an id outside [0, E) reads expert 0
    (and weighs 0, v2_weights)."""
    for t in cutlass.range_constexpr(kpg):
        e = mIdx[row, grp + t * V2_GROUPS].to(Int32)
        if e < 0 or e >= E:
            e = Int32(0)
        ev[t] = e


@cute.jit
def v2_loads(mW2: cute.Tensor, ev: cute.Tensor, wv: cute.Tensor, cc: Int32, r: Int32,
             kpg: cutlass.Constexpr[int], nsl: cutlass.Constexpr[int]):
    """All the lane's w2 slices of column cc in flight (wv): K/4 experts x I/64 slices, 12
    loads of 16 B per lane at K3, every lane busy; one warp instruction reads 4 experts' 128
    contiguous bytes (a whole line each)."""
    for t in cutlass.range_constexpr(kpg):
        for i in cutlass.range_constexpr(nsl):
            cute.autovec_copy(mW2[ev[t], cc, r + i * V2_GROUP_LANES, None], wv[None, i, t])


@cute.jit
def v2_weights(mIdx: cute.Tensor, mWt: cute.Tensor, sW: cute.Tensor, row: Int32, tidx: Int32,
               K: cutlass.Constexpr[int], E: cutlass.Constexpr[int]):
    """The row's K routing weights in shared memory (sW; 0 for an invalid id), written by
    threads 0..K-1 (read after the staging barrier)."""
    if tidx < K:
        e = mIdx[row, tidx].to(Int32)
        wj = mWt[row, tidx]
        if e < 0 or e >= E:
            wj = Float32(0.0)
        sW[tidx] = wj


@cute.jit
def v2_issue(mIdx: cute.Tensor, mWt: cute.Tensor, mW2: cute.Tensor, sW: cute.Tensor, ev: cute.Tensor,
             wv: cute.Tensor, row: Int32, cc: Int32, r: Int32, grp: Int32, tidx: Int32,
             K: cutlass.Constexpr[int], E: cutlass.Constexpr[int], kpg: cutlass.Constexpr[int],
             nsl: cutlass.Constexpr[int]):
    """FC2 v2, before the wait: the lane's group's K/4 expert ids (ev), all its w2 slices of
    column cc in flight (wv) and the row's K routing weights in shared memory (sW). Shared by
    ExpertsFC2v2.kernel and moe_experts_one.ExpertsOne.fc2_item (moe_fc2_rows uses the parts)."""
    v2_ids(mIdx, ev, row, grp, E, kpg)
    v2_loads(mW2, ev, wv, cc, r, kpg, nsl)
    v2_weights(mIdx, mWt, sW, row, tidx, K, E)


@cute.jit
def v2_stage(mA: cute.Tensor, sA: cute.Tensor, av: cute.Tensor, row: Int32, r: Int32, tidx: Int32,
             K: cutlass.Constexpr[int], nsl: cutlass.Constexpr[int], threads: cutlass.Constexpr[int],
             stage_async: cutlass.Constexpr[bool] = False):
    """FC2 v2, after the wait: the row's `a` (columns < I) staged in shared memory, then a
    barrier. 8 threads per activation row, as the groups read it (thread t: row t // 8
    (+ 16·n), slices t % 8 + 8·i). Default: one 128-bit slice at a time (a rolled loop: 4
    registers beside the 48 of w2 in flight), so nsl dependent L2 round trips. `stage_async`
    (ExpertsConfig.stage_async): every slice as one cp.async global -> shared copy, all in
    flight at once and no register held, then one wait: one round trip."""
    jr = tidx // V2_GROUP_LANES
    if cutlass.const_expr(stage_async):
        atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), mA.element_type, num_bits_per_copy=128)
    for jj in cutlass.range_constexpr((K * V2_GROUP_LANES + threads - 1) // threads):
        j = jr + jj * (threads // V2_GROUP_LANES)
        if j < K:
            if cutlass.const_expr(stage_async):
                for i in cutlass.range_constexpr(nsl):
                    cute.copy(atom, mA[row * K + j, r + i * V2_GROUP_LANES, None],
                              sA[j, r + i * V2_GROUP_LANES, None])
            else:
                for i in cutlass.range(nsl, unroll=1):
                    cute.autovec_copy(mA[row * K + j, r + i * V2_GROUP_LANES, None], av)
                    cute.autovec_copy(av, sA[j, r + i * V2_GROUP_LANES, None])
    if cutlass.const_expr(stage_async):
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
    cute.arch.sync_threads()


@cute.jit
def v2_dots(mO: cute.Tensor, sA: cute.Tensor, sW: cute.Tensor, av: cute.Tensor, wv: cute.Tensor,
            ex: cute.Tensor, row: Int32, col: Int32, r: Int32, grp: Int32, lane: Int32,
            K: cutlass.Constexpr[int], L: cutlass.Constexpr[int], kpg: cutlass.Constexpr[int],
            nsl: cutlass.Constexpr[int]):
    """FC2 v2's arithmetic on the w2 slices in wv and the staged `a`: each group's K/4 dot
    products (a lane: its slices in order, then an 8-lane butterfly, after which every lane
    of the group holds the same sum), rounded to bf16; the j-ordered weighted sum (e_j from
    group j % 4: a uniform source lane, every lane shuffles); lane 0 stores out[row, col]."""
    for t in cutlass.range_constexpr(kpg):
        s = Float32(0.0)
        for i in cutlass.range_constexpr(nsl):
            cute.autovec_copy(sA[grp + t * V2_GROUPS, r + i * V2_GROUP_LANES, None], av)
            for u in cutlass.range_constexpr(VEC):
                s = s + wv[u, i, t].to(Float32) * av[u].to(Float32)
        ex[t] = cute.arch.warp_reduction_sum(s, threads_in_group=V2_GROUP_LANES).to(
            mO.element_type).to(Float32)
    acc = Float32(0.0)
    for j in cutlass.range_constexpr(K):
        ej = cute.arch.shuffle_sync(ex[j // V2_GROUPS], offset=(j % V2_GROUPS) * V2_GROUP_LANES)
        acc = acc + sW[j] * ej
    if lane == 0 and col < L:
        mO[row, col] = acc.to(mO.element_type)


@cute.jit
def v2_finish(mA: cute.Tensor, mO: cute.Tensor, sA: cute.Tensor, sW: cute.Tensor, av: cute.Tensor,
              wv: cute.Tensor, ex: cute.Tensor, row: Int32, col: Int32, r: Int32, grp: Int32,
              tidx: Int32, lane: Int32, K: cutlass.Constexpr[int], L: cutlass.Constexpr[int],
              kpg: cutlass.Constexpr[int], nsl: cutlass.Constexpr[int], threads: cutlass.Constexpr[int],
              stage_async: cutlass.Constexpr[bool] = False):
    """FC2 v2, after the wait: stage the row's `a` in shared memory (v2_stage), then the dot
    products and out[row, col] (v2_dots). Shared by ExpertsFC2v2.kernel and
    moe_experts_one.ExpertsOne.fc2_item."""
    v2_stage(mA, sA, av, row, r, tidx, K, nsl, threads, stage_async)
    v2_dots(mO, sA, sW, av, wv, ex, row, col, r, grp, lane, K, L, kpg, nsl)


class ExpertsFC2v2:
    """Kernel 2, version 2 (kernel name `experts_v2`): the same out[m, l], one (row, 4
    columns) per CTA, every lane loading (module docstring, "FC2 v2")."""

    def __init__(self, cfg: ExpertsConfig) -> None:
        self.cfg = cfg
        # launched with PDL: FC2's own flag, or always in the PDL chain (kernels/chain.py)
        self.pdl = cfg.pdl or chain.chain_on()
        self.per_group = cfg.top_k // V2_GROUPS              # experts per 8-lane group (K/4)
        self.slices = cfg.inter // (VEC * V2_GROUP_LANES)     # 128-bit slices per lane per row (I/64)
        # 48 weight registers (K·I/256 ≤ 12 slices) fit under 72 registers: 7 CTAs of 4 warps
        # per SM, one wave at K3 (896 CTAs ≤ 7·132); more slices: 4 CTAs (≤ 128 registers)
        self.min_blocks = 7 if self.per_group * self.slices <= 12 else 4

    @cute.jit
    def __call__(self, act: cute.Pointer, idx: cute.Pointer, w: cute.Pointer, w2: cute.Pointer,
                 out: cute.Pointer, m: Int32, stream: cuda.CUstream):
        L = self.cfg.latent
        mA, mIdx, mWt, mW2, mO = fc2_views(self.cfg, act, idx, w, w2, out, m)
        self.kernel(mA, mIdx, mWt, mW2, mO, m).launch(
            grid=[m * ((L + V2_WARPS - 1) // V2_WARPS), 1, 1], block=[V2_WARPS * 32, 1, 1], stream=stream,
            use_pdl=self.pdl, min_blocks_per_mp=self.min_blocks, preferred_smem_carveout=-1)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mIdx: cute.Tensor, mWt: cute.Tensor, mW2: cute.Tensor,
               mO: cute.Tensor, m: Int32):
        L, I, K, E = self.cfg.latent, self.cfg.inter, self.cfg.top_k, self.cfg.experts
        kpg, nsl = self.per_group, self.slices
        nq = I // VEC                        # 128-bit slices of a row actually read (24)
        threads = V2_WARPS * 32
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()          # all 32 lanes, outside any branch
        lane = cute.arch.lane_idx()
        grp = lane // V2_GROUP_LANES         # the group's experts: j = grp + 4·t
        r = lane - grp * V2_GROUP_LANES      # the lane's slices of a row: q = r + 8·i
        # CTA b: row b % m of column block b // m (the M rows of a block run side by side,
        # so experts shared between rows are re-read from L2)
        cb = bidx // m
        row = bidx - cb * m
        col = cb * V2_WARPS + warp
        # every thread reaches the barrier and the shuffles; an out-of-range warp (none at
        # K3: L % 4 == 0) reads column L-1 and stores nothing
        cc = col
        if col >= L:
            cc = L - 1
        sA, sW, wv, av, ev, ex = v2_tensors(mA, mW2, K, nq, kpg, nsl)
        v2_issue(mIdx, mWt, mW2, sW, ev, wv, row, cc, r, grp, tidx, K, E, kpg, nsl)
        # all w2 loads are issued before this: the scheduling fence of ExpertsFC2 and, with
        # PDL, the point past which FC1's `a` is complete and visible
        cute.arch.griddepcontrol_wait()
        chain.release()
        v2_finish(mA, mO, sA, sW, av, wv, ex, row, col, r, grp, tidx, lane, K, L, kpg, nsl, threads,
                  self.cfg.stage_async)


def can_implement_v2(m: int, k: int, latent: int, inter_padded: int, dtypes: tuple[torch.dtype, ...],
                     inter: int | None = None) -> bool:
    """can_implement, and FC2 v2's lane split: K a multiple of 4 (four 8-lane groups, K ≤ 64
    so a row fits its 128-thread CTA's weight staging; K/4·I/64 ≤ 16 slices in registers) and
    I a multiple of 64 (8 lanes x 128-bit slices)."""
    i = inter_padded if inter is None else inter
    return (can_implement(m, k, latent, inter_padded, dtypes, inter)
            and k % V2_GROUPS == 0 and k <= V2_WARPS * 32 and i % (VEC * V2_GROUP_LANES) == 0
            and (k // V2_GROUPS) * (i // (VEC * V2_GROUP_LANES)) <= 16)


def fc1_group(m: int) -> int:
    """FC1's load group at M rows (FC1_LOADS_GROUP up to FC1_GROUP_MAX_ROWS, else 0)."""
    return FC1_LOADS_GROUP if m <= FC1_GROUP_MAX_ROWS else 0


def compile_fc1(cfg: ExpertsConfig, column_major: bool | None = None, group: int | None = None,
                early_ids: bool = False) -> object:
    """FC1 compiled for `cfg` in the given CTA order (FC1_COLUMN_MAJOR when None), load
    group (FC1_LOADS_GROUP when None) and ids mode (early_ids: ExpertsFC1's; only with a
    group); cached per order, group and mode, so flipping a module constant in a process
    cannot reuse the other build."""
    cm = FC1_COLUMN_MAJOR if column_major is None else column_major
    grp = FC1_LOADS_GROUP if group is None else group
    early_ids = bool(early_ids) and grp > 0
    cfg1 = dataclasses.replace(cfg, pdl=False, stage_async=False)   # FC1 does not depend on them

    def build() -> object:
        bf = dummy_ptr(torch.bfloat16)
        return cute.compile(ExpertsFC1(cfg1, column_major=cm, group=grp, early_ids=early_ids), bf,
                            dummy_ptr(cfg.idx_dtype), bf, bf, dummy_ptr(torch.int32), Int32(1), Float32(4.0),
                            Float32(25.0), current_stream(), options=compile_options())
    return compiled(("experts_fc1", cfg1, bool(cm), int(grp), early_ids), build)


def compile_for(cfg: ExpertsConfig, v2: bool, m: int, early_ids: bool = False) -> tuple[object, object]:
    """The two compiled kernels for `cfg` (cached), FC1 with M = `m`'s load group
    (fc1_group: M is required, so no caller gets M = 1's build at another M) and, where that
    group is not 0, `early_ids`; `v2`: FC2 is ExpertsFC2v2."""

    def build2() -> object:
        bf = dummy_ptr(torch.bfloat16)
        return cute.compile((ExpertsFC2v2 if v2 else ExpertsFC2)(cfg), bf, dummy_ptr(cfg.idx_dtype),
                            dummy_ptr(torch.float32), bf, bf, Int32(1), current_stream(), options=compile_options())
    # FC1 does not depend on `pdl` (its launch_dependents hint is always there): one compile
    return compile_fc1(cfg, group=fc1_group(m), early_ids=early_ids), compiled(("experts_fc2_v2" if v2 else "experts_fc2", cfg), build2)


def prepare(z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            out: torch.Tensor | None, inter: int | None, can: Callable[..., bool], name: str
            ) -> tuple[tuple[int, ...], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The launch arguments of `experts` and moe_experts_one.experts_one: checks the shapes
    (ValueError naming `name` where `can` says no), converts idx (int32 unless int64/int32)
    and w (fp32, contiguous), allocates out (or checks it) and the [M·K, Ip] bf16 `a` buffer.
    Returns ((M, K, L, E, Ip, I), idx, w, out, act)."""
    m, L = z.shape
    k = idx.shape[1]
    E, two_ip, L13 = w13.shape
    ip = two_ip // 2
    i = ip if inter is None else inter
    if (idx.shape[0] != m or w.shape != (m, k) or L13 != L or tuple(w2.shape) != (E, L, ip)
            or two_ip != 2 * ip or E * two_ip * L >= 2 ** 31
            or not can(m, k, L, ip, (z.dtype, w13.dtype, w2.dtype), inter)):
        raise ValueError(f"{name} cannot run M={m} K={k} L={L} Ip={ip} I={i} E={E}")
    if idx.dtype not in (torch.int32, torch.int64):
        idx = idx.to(torch.int32)
    idx = idx.contiguous()
    w = w.contiguous() if w.dtype == torch.float32 else w.float().contiguous()
    if out is None:
        out = torch.empty(m, L, dtype=torch.bfloat16, device=z.device)
    elif out.shape != (m, L) or out.dtype != torch.bfloat16:
        raise ValueError(f"out must be [{m}, {L}] bf16, got {tuple(out.shape)} {out.dtype}")
    act = torch.empty(m * k, ip, dtype=torch.bfloat16, device=z.device)
    return (m, k, L, E, ip, i), idx, w, out, act


def experts(z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            beta: float, lin_beta: float, out: torch.Tensor | None = None, *,
            inter: int | None = None, pdl: bool = False, v2: bool = False,
            stage_async: bool = False, rows: int = 0, ids_ready: torch.Tensor | None = None) -> torch.Tensor:
    """stock_ops.experts_grouped on the current stream, CUDA-graph safe (no host syncs).
    z [M, L] bf16, idx [M, K] int64/int32 (distinct per row), w [M, K] fp32 (other float
    dtypes are converted), w13 [E, 2·Ip, L] bf16, w2 [E, L, Ip] bf16; `out` an optional
    contiguous [M, L] bf16 view to write into. `inter`: the real intermediate I (w13 rows and
    w2 columns I..Ip-1 are zero padding, skipped); None reads all Ip. `pdl`: launch FC2 with
    programmatic dependent launch, so its w2 stream starts while FC1's last CTAs run (it
    waits for FC1 before reading FC1's output; results are identical). `v2`: FC2 is
    ExpertsFC2v2 (kernel `experts_v2`; shapes: can_implement_v2); `stage_async` (with v2,
    kernel `experts_v2_async`): its `a` staged by cp.async, bit-identical. `rows` (1 or 2,
    with v2, kernel `experts_rows`): at M ≥ 2 FC2 is moe_fc2_rows.ExpertsFC2Rows with that
    many register buffers, bit-identical to FC2 v2 (M = 1 keeps FC2 v2). `ids_ready`: the
    routing sync buffer (router_fast.SYNC_WORDS int32) whose ids-ready flag the MoE front
    that wrote idx and w raises (gemv_multi.route_and_project's publish_ready); where FC1 runs
    its load groups (fc1_group(M) > 0) it then reads idx once the flag is up instead of after
    the front's end (FC1_EARLY_IDS) and lowers the flag again; results are identical. Without
    a flag-raising front it must be None (FC1 would wait forever). Returns out [M, L]."""
    (m, k, L, E, ip, i), idx, w, out, act = prepare(z, idx, w, w13, w2, out, inter,
                                                     can_implement_v2 if v2 else can_implement,
                                                     "experts kernel")
    early = ids_ready is not None and fc1_group(m) > 0
    if early and (ids_ready.dtype != torch.int32 or ids_ready.numel() < SYNC_WORDS or not ids_ready.is_contiguous()):
        raise ValueError(f"experts ids_ready must be a contiguous int32 [{SYNC_WORDS}] routing sync buffer")
    fc1, fc2 = compile_for(ExpertsConfig(L, ip, i, k, E, idx.dtype, pdl, stage_async and v2), v2, m, early)
    stream = current_stream()
    fc1(ptr(z), ptr(idx), ptr(w13), ptr(act), ptr(ids_ready) if early else dummy_ptr(torch.int32), Int32(m),
        Float32(beta), Float32(lin_beta), stream)
    if rows and v2 and not stage_async and m >= 2:
        from kimi_decode.kernels import moe_fc2_rows
        moe_fc2_rows.launch_fc2(act, idx, w, w2, out, ExpertsConfig(L, ip, i, k, E, idx.dtype, pdl), m, rows)
    else:
        fc2(ptr(act), ptr(idx), ptr(w), ptr(w2), ptr(out), Int32(m), stream)
    return out


def reference(z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              beta: float, lin_beta: float, inter: int | None = None, round_bf16: bool = True) -> torch.Tensor:
    """float64 statement of the module docstring: r [M, L] float64 (before its final bf16
    rounding). round_bf16 rounds h, a and e to bf16 where stock does; `inter` uses only w13
    rows / w2 columns < I of each half (equal to the full result when the padding is zero)."""
    M, K = idx.shape
    ip = w2.shape[-1]
    i = ip if inter is None else inter
    rnd = (lambda t: t.to(torch.bfloat16).double()) if round_bf16 else (lambda t: t)
    flat = idx.reshape(-1).long()
    zz = z.double().repeat_interleave(K, dim=0)                                   # [P, L]
    out = torch.zeros(M * K, z.shape[1], dtype=torch.float64, device=z.device)
    for p in range(M * K):                                                        # one pair at a time (memory)
        e = int(flat[p])
        h = w13[e].double() @ zz[p]                                               # [2·Ip]
        g, u = rnd(h[:i]), rnd(h[ip:ip + i])
        a = rnd((beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (lin_beta * torch.tanh(u / lin_beta)))
        out[p] = rnd(w2[e].double()[:, :i] @ a)
    return (w.double().reshape(M * K, 1) * out).reshape(M, K, -1).sum(1)


def check_weights(dev: torch.device) -> tuple[object, torch.Tensor, torch.Tensor]:
    """The GPU checks' experts: the real LatentMoE weights at K3 TP16 (seed "check.experts"),
    as (config, w13, w2). Shared by check, check_async and moe_experts_one.check."""
    from kimi_decode.comm import LocalComm, SideStream
    from kimi_decode.config import k3_tp16
    from kimi_decode.stock import LatentMoE, Runtime
    from kimi_decode.weights import Seeder
    cfg0 = k3_tp16()
    with torch.no_grad():
        moe = LatentMoE(cfg0, Seeder(cfg0, dev).sub("check.experts"), Runtime(LocalComm(), SideStream(dev)))
    return cfg0, moe.w13.detach(), moe.w2.detach()


def check_inputs(cfg0: object, m: int, seed: int, dev: torch.device
                 ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """z [M, L] (rms ≈ 1) and 4 routings (distinct ids per row, positive renormalised weights)
    from one generator seeded `seed`: the cycled routings of the checks' cold timings."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    E, K, L = cfg0.num_experts, cfg0.top_k, cfg0.latent_dim
    z = torch.randn(m, L, generator=gen, device=dev).bfloat16()
    routings = []
    for _ in range(4):
        scores = torch.rand(m, E, generator=gen, device=dev)
        idx = scores.topk(K, dim=-1).indices
        w = scores.gather(1, idx)
        routings.append((idx, w / w.sum(-1, keepdim=True) * cfg0.routed_scaling))
    return z, routings


def check(timing: bool = True, rows: tuple[int, ...] = (1, 8), v2: bool = False) -> list[dict]:
    """Kernel vs stock_ops.experts_grouped and the float64 reference on the real LatentMoE
    weights at K3 TP16 shapes, for M in `rows`: with the padding skip (inter=I), without it,
    then with PDL (last; an exception there is reported as a skipped row, see below).
    `v2` (kernel `experts_v2`, see check_v2): FC2 is ExpertsFC2v2, also compared with the
    verified two-kernel path (`rel_vs_old` within the same 1e-2 as vs stock; `equal_old`
    reported: bit-equality is not expected, the per-expert fp32 dot order differs) and timed
    against it (`old_us`, `old_same_us`).
    Timings vs OpSet(cfg).experts, the stock path's op: `stock_us`/`kernel_us` cycle through
    4 routings (~260 MB of expert weights, ≫ 50 MB L2: weights come from HBM, as in a decode
    step where every layer has its own experts); `*_same_us` repeat one routing (66-88 MB per
    call, partly L2-resident across calls)."""
    from kimi_decode import stock_ops
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels.checks import DEVICE, _sync, rel, time_us
    dev = torch.device(DEVICE)
    cfg0, w13, w2 = check_weights(dev)
    beta, lin_beta = cfg0.situ_beta, cfg0.situ_linear_beta
    I, K, L = cfg0.expert_local_inter, cfg0.top_k, cfg0.latent_dim
    name, kw = ("experts_v2", {"v2": True}) if v2 else ("experts", {})
    cases = {}
    for m in rows:
        z, routings = check_inputs(cfg0, m, 1000 + m, dev)
        idx, w = routings[0]
        with torch.no_grad():
            r_s = stock_ops.experts_grouped(z, idx, w, w13, w2, beta, lin_beta)
        ref = reference(z, idx, w, w13, w2, beta, lin_beta)
        cases[m] = (z, idx, w, r_s, ref, routings)

    def cycling(call, routings):
        """A no-argument function running call(idx, w) with the next routing each time (captured
        call by call into time_us's CUDA graph, so its replays cycle too)."""
        n = itertools.count()
        return lambda: call(*routings[next(n) % len(routings)])

    def one(m: int, skip: bool, pdl: bool) -> dict:
        z, idx, w, r_s, ref, routings = cases[m]
        inter = I if skip else None
        r = {"kernel": name, "M": m, "skip_pad": skip, "pdl": pdl}
        with torch.no_grad():
            buf = torch.full((m + 1, L), float("nan"), dtype=torch.bfloat16, device=dev)
            r_k = experts(z, idx, w, w13, w2, beta, lin_beta, out=buf[1:], inter=inter, pdl=pdl, **kw)
            r_k32 = experts(z, idx.int(), w, w13, w2, beta, lin_beta, inter=inter, pdl=pdl, **kw)
            r_old = experts(z, idx, w, w13, w2, beta, lin_beta, inter=inter, pdl=pdl) if v2 else r_k
        _sync()
        e_ks, e_k, e_s, e_old = rel(r_k, r_s), rel(r_k, ref), rel(r_s, ref), rel(r_k, r_old)
        same32 = torch.equal(r_k, r_k32)
        untouched = bool(torch.isnan(buf[0]).all())          # nothing written outside `out`
        r.update(rel_vs_stock=e_ks, rel_vs_f64=e_k, stock_rel_vs_f64=e_s, int32_idx_equal=same32,
                 out_bounds_ok=untouched,
                 ok=(e_ks <= 1e-2 and e_k <= 1.5 * e_s + 1e-3 and same32 and untouched and e_old <= 1e-2
                     and bool(torch.isfinite(r_k).all())))
        if v2:
            r.update(rel_vs_old=e_old, equal_old=torch.equal(r_k, r_old))
        if timing:
            ops = stock_ops.OpSet(k3_tp16(batch=m))
            dst = torch.empty(m, L, dtype=torch.bfloat16, device=dev)
            calls = [("stock", lambda i, ww: ops.experts(z, i, ww, w13, w2, beta, lin_beta)),
                     ("kernel", lambda i, ww: experts(z, i, ww, w13, w2, beta, lin_beta, out=dst,
                                                      inter=inter, pdl=pdl, **kw))]
            if v2:
                calls.append(("old", lambda i, ww: experts(z, i, ww, w13, w2, beta, lin_beta, out=dst,
                                                           inter=inter, pdl=pdl)))
            for what, call in calls:
                r[f"{what}_us"] = time_us(cycling(call, routings))
                r[f"{what}_same_us"] = time_us(cycling(call, routings[:1]))
            nbytes = m * K * 3 * (I if skip else w2.shape[-1]) * L * 2       # FC1 2·I·L + FC2 I·L per pair
            r["kernel_tbs"] = nbytes / (r["kernel_us"] * 1e-6) / 1e12
        return r

    out = [one(m, skip, False) for m in rows for skip in (True, False)]
    # PDL last, optional: wrong results fail the check (the same kernel code runs without
    # PDL), but a PDL launch or graph capture the stack does not support only marks the row
    # skipped, so the default (pdl=False) path is not blocked by it
    for m in rows:
        try:
            out.append(one(m, True, True))
        except Exception as exc:  # noqa: BLE001  (report, do not abort the batched device job)
            out.append({"kernel": name, "M": m, "skip_pad": True, "pdl": True, "ok": True,
                        "skipped": f"pdl unsupported here: {type(exc).__name__}: {exc}"[:300]})
    del w13, w2, cases
    if not v2:                           # the plain FC1 check also covers FC1's CTA order
        out += check_fc1_order(timing=timing, rows=tuple(m for m in rows if m > 1) or rows)
        out += check_fc1_group(timing=timing, rows=rows)   # and its load groups
    return out


def fc1_launch(z: torch.Tensor, idx: torch.Tensor, w13: torch.Tensor, act: torch.Tensor, beta: float,
               lin_beta: float, inter: int, column_major: bool, group: int | None = None) -> None:
    """FC1 alone into `act` [M·K, Ip] in the given CTA order and load group (fc1_group(M)
    when None; check_fc1_order's and check_fc1_group's A/Bs)."""
    m, k = idx.shape
    E, two_ip, L = w13.shape
    grp = fc1_group(m) if group is None else group
    fc1 = compile_fc1(ExpertsConfig(L, two_ip // 2, inter, k, E, idx.dtype), column_major, grp)
    fc1(ptr(z), ptr(idx), ptr(w13), ptr(act), dummy_ptr(torch.int32), Int32(m), Float32(beta), Float32(lin_beta),
        current_stream())


def check_fc1_order(timing: bool = True, rows: tuple[int, ...] = (2, 8)) -> list[dict]:
    """FC1 in column-block order (FC1_COLUMN_MAJOR) against pair order, on the real weights at
    K3 TP16 shapes: `a` must be bit-identical (the same warps run the same code; only which
    CTA runs which warp changes), nothing written past column I; both timed alone on cold
    weights (4 routings cycled, as `check`), with the routing's repeats reported: the rows'
    (row, expert) pairs whose expert an earlier row also picked, the bytes column order
    should read once instead of twice."""
    from kimi_decode.kernels.checks import DEVICE, _sync, time_us
    dev = torch.device(DEVICE)
    cfg0, w13, w2 = check_weights(dev)
    beta, lin_beta = cfg0.situ_beta, cfg0.situ_linear_beta
    I, K, L = cfg0.expert_local_inter, cfg0.top_k, cfg0.latent_dim
    ip = w13.shape[1] // 2
    out = []
    for m in rows:
        z, routings = check_inputs(cfg0, m, 3000 + m, dev)
        idx = routings[0][0].int().contiguous()
        acts = {}
        for cm in (False, True):
            acts[cm] = torch.full((m * K, ip), float("nan"), dtype=torch.bfloat16, device=dev)
            with torch.no_grad():
                fc1_launch(z, idx, w13, acts[cm], beta, lin_beta, I, cm)
        _sync()
        ids = routings[0][0]
        repeats = int(m * K - ids.unique().numel())
        equal = torch.equal(acts[True][:, :I], acts[False][:, :I])
        pad_untouched = bool(torch.isnan(acts[True][:, I:]).all()) if I < ip else True
        r = {"kernel": "experts", "case": "fc1_order", "M": m, "repeat_pairs": repeats,
             "a_equal": equal, "pad_untouched": pad_untouched,
             "ok": equal and pad_untouched and bool(torch.isfinite(acts[True][:, :I]).all())}
        if timing:
            ids_all = [i.int().contiguous() for i, _ in routings]
            dst = torch.empty(m * K, ip, dtype=torch.bfloat16, device=dev)
            for cm, key in ((False, "pair_order_us"), (True, "column_order_us")):
                n = itertools.count()
                r[key] = time_us(lambda cm=cm, n=n: fc1_launch(z, ids_all[next(n) % len(ids_all)], w13, dst,
                                                               beta, lin_beta, I, cm))
            distinct = sum(int(i.unique().numel()) for i, _ in routings) / len(routings)
            r["distinct_tbs_column"] = distinct * 2 * I * L * 2 / (r["column_order_us"] * 1e-6) / 1e12
            r["pair_tbs_pair"] = m * K * 2 * I * L * 2 / (r["pair_order_us"] * 1e-6) / 1e12
        out.append(r)
    del w13, w2
    return out


FC1_GROUPS_CHECKED = (3, 5, 7)   # check_fc1_group: the load groups compared with the loop


def check_fc1_group(timing: bool = True, rows: tuple[int, ...] = (1, 8),
                    groups: tuple[int, ...] = FC1_GROUPS_CHECKED) -> list[dict]:
    """FC1 with its loads in groups (FC1_LOADS_GROUP; each of `groups`, and the module's own
    value) against the loop (group 0), real weights at K3 TP16 shapes: `a` must be
    bit-identical (the same products summed in the same order; only when the loads are issued
    changes), nothing written past column I; each timed alone on cold weights (4 routings
    cycled, as `check`): `loop_us`, `g{G}_us`, and the loop's and each group's TB/s over the
    distinct experts' bytes."""
    from kimi_decode.kernels.checks import DEVICE, _sync, time_us
    dev = torch.device(DEVICE)
    cfg0, w13, w2 = check_weights(dev)
    beta, lin_beta = cfg0.situ_beta, cfg0.situ_linear_beta
    I, K, L = cfg0.expert_local_inter, cfg0.top_k, cfg0.latent_dim
    ip = w13.shape[1] // 2
    every = sorted({g for g in (*groups, FC1_LOADS_GROUP) if g > 0})
    out = []
    for m in rows:
        z, routings = check_inputs(cfg0, m, 3100 + m, dev)
        idx = routings[0][0].int().contiguous()
        acts = {}
        for g in (0, *every):
            acts[g] = torch.full((m * K, ip), float("nan"), dtype=torch.bfloat16, device=dev)
            with torch.no_grad():
                fc1_launch(z, idx, w13, acts[g], beta, lin_beta, I, FC1_COLUMN_MAJOR, g)
        _sync()
        for g in every:
            equal = torch.equal(acts[g][:, :I], acts[0][:, :I])
            pad_untouched = bool(torch.isnan(acts[g][:, I:]).all()) if I < ip else True
            out.append({"kernel": "experts", "case": "fc1_group", "M": m, "group": g, "a_equal": equal,
                        "pad_untouched": pad_untouched,
                        "ok": equal and pad_untouched and bool(torch.isfinite(acts[g][:, :I]).all())})
        if timing:
            ids_all = [i.int().contiguous() for i, _ in routings]
            dst = torch.empty(m * K, ip, dtype=torch.bfloat16, device=dev)
            distinct = sum(int(i.unique().numel()) for i, _ in routings) / len(routings)
            times = {}
            for g in (0, *every):
                n = itertools.count()
                times[g] = time_us(lambda g=g, n=n: fc1_launch(z, ids_all[next(n) % len(ids_all)], w13, dst,
                                                               beta, lin_beta, I, FC1_COLUMN_MAJOR, g))
            r = out[-1]
            r["loop_us"] = times[0]
            for g in every:
                r[f"g{g}_us"] = times[g]
            best = min(times, key=times.get)
            r["best_group"] = best
            r["best_tbs"] = distinct * 2 * I * L * 2 / (times[best] * 1e-6) / 1e12
    del w13, w2
    return out


def check_v2(timing: bool = True, rows: tuple[int, ...] = (1, 8)) -> list[dict]:
    """The GPU check of kernel `experts_v2`: `check` with FC2 = ExpertsFC2v2, against stock,
    the float64 reference and the verified kernels (old vs new timed, cold weights)."""
    return check(timing=timing, rows=rows, v2=True)


def check_async(timing: bool = True, rows: tuple[int, ...] = (1, 8)) -> list[dict]:
    """The GPU check of kernel `experts_v2_async`: FC1 + FC2 v2 with `a` staged by cp.async
    (stage_async) against FC1 + FC2 v2 as verified (bit for bit: only the staging's
    instructions differ), against stock and the float64 reference (checks.py's rule), with
    PDL and the padding skip as the fused step runs them. Timing: both on cold weights (4
    routings cycled, as check's `kernel_us`), `kernel_us` (async) vs `v2_us`."""
    from kimi_decode import stock_ops
    from kimi_decode.kernels.checks import DEVICE, _sync, rel, time_us
    dev = torch.device(DEVICE)
    cfg0, w13, w2 = check_weights(dev)
    beta, lin_beta = cfg0.situ_beta, cfg0.situ_linear_beta
    I, L = cfg0.expert_local_inter, cfg0.latent_dim
    out = []
    for m in rows:
        z, routings = check_inputs(cfg0, m, 3000 + m, dev)
        idx, w = routings[0]

        def run(i: torch.Tensor, ww: torch.Tensor, async_: bool, dst: torch.Tensor | None = None) -> torch.Tensor:
            return experts(z, i, ww, w13, w2, beta, lin_beta, out=dst, inter=I, pdl=True, v2=True,
                           stage_async=async_)
        with torch.no_grad():
            r_s = stock_ops.experts_grouped(z, idx, w, w13, w2, beta, lin_beta)
            r_v2 = run(idx, w, False)
            r_k = run(idx, w, True)
            r_k2 = run(idx, w, True)
        _sync()
        ref = reference(z, idx, w, w13, w2, beta, lin_beta)
        e_ks, e_k, e_s = rel(r_k, r_s), rel(r_k, ref), rel(r_s, ref)
        r = {"kernel": "experts_v2_async", "M": m, "rel_vs_stock": e_ks, "rel_vs_f64": e_k,
             "stock_rel_vs_f64": e_s, "equal_v2": bool(torch.equal(r_k, r_v2)),
             "repeat_equal": bool(torch.equal(r_k, r_k2))}
        r["ok"] = bool(e_ks <= 1e-2 and e_k <= 1.5 * e_s + 1e-3 and r["equal_v2"] and r["repeat_equal"])
        if timing:
            dst = torch.empty(m, L, dtype=torch.bfloat16, device=dev)
            for what, a in (("kernel", True), ("v2", False)):
                n = itertools.count()
                r[f"{what}_us"] = time_us(lambda a=a, n=n: run(*routings[next(n) % 4], a, dst))
        out.append(r)
    del w13, w2
    return out


if __name__ == "__main__":
    import sys
    for row in (check_v2() if sys.argv[1:] == ["v2"] else check()):
        print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
