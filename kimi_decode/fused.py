"""Fused Kimi K3 decode step: stock.py's math with custom CuTe DSL kernels where they exist.

Mirrors stock.py: same class names, forward signatures and NVTX op names, so a diff of the two
files is the list of fusions. `FusedDecoder.from_stock(stock)` re-uses the stock model's
weights (shared, not copied) and clones its decode state, so the two can run side by side
from the same state; `FusedDecoder(cfg, rt, device)` (the variant registry's constructor)
builds the stock model and converts it.

Fused (CuTe DSL kernels in kimi_decode/kernels/, used on a GPU when `can_implement` holds
and the kernel is in `VERIFIED`):
- `attn_res`, `mlp_res`: prefix add + optional block write + AttnRes mix + RMSNorm, one
  kernel (kernels/attn_res.py) instead of the stock op chain.
- `attn_res_ag` (tp_sim, with `moe_up`): the MoE block's all-gather is finished by the next
  layer's attention AttnRes kernel, which reads the all-gather slots in place (`Gathered`);
  the concatenation kernel disappears (the last layer's output is concatenated in forward).
- `attn_res_mc` (M ≤ 8, and M ≤ 64 where the mix reads ≤ 4 blocks; every mode above): the same AttnRes kernel with one row spread over a
  cluster of 7 CTAs (kernels/attn_res_mc.py) instead of one CTA on one SM; the one-CTA kernel
  stays the fallback (AttnRes._kernel).
- KDA: f_b projection + conv update + SiLU + gate + β + L2 norms + delta-rule recurrence +
  gated RMSNorm for the local heads, one kernel under op `kda_recurrence`; the stock ops
  `f_b_proj`, `conv`, `o_norm` disappear. `kda_split` (kernels/kda_split.py) spreads it over
  (value-column groups × heads × sequences) CTAs, the last CTA of a head normalising its row;
  `kda_fast` (kernels/kda_fast.py) is the same kernel at B = 1, T = 1 with every global load
  issued up front (a shorter dependency chain); `kda_multi` (kernels/kda_multi.py) the same for
  T ≥ 2 tokens (speculative decode) with the conv, norms and gates of all T tokens done before
  the recurrence (B = 1, k = 7: 16.6 us in its check vs 28.4 for kda_split; stock's four
  kernels before), and for T = 1 at 2 ≤ B (B = 8, k = 0); `kda` (kernels/kda_decode.py, one CTA
  per head) is the fallback.
- Collectives finished inside kernels (tp_sim only; `Slots`, comm.SimComm.ar_slots): o_proj
  writes this rank's all-reduce slot (GEMV `out=` or cuBLAS `torch.mm(out=)`) and the
  `mlp_res` AttnRes kernel sums the slots (`attn_res_ar`): o_proj + all-reduce + AttnRes +
  RMSNorm in two launches instead of four. Real NCCL (DistComm) keeps its collectives.
- MoE router: GEMV (fp32 accumulation) + sigmoid + correction-bias top-k + renormalisation,
  one kernel (`router_fast`: K split over 4 warps per expert, 448 CTAs, candidate-rank top-k;
  `router`: the first version) for small M (above: the stock router GEMM's fp32 logits + one
  kernel), op `router`; the stock op `routing` disappears.
- MoE front at M = 1 (`gemv_multi`, op `moe_front`): router (router_fast's CTAs, top-k in the
  last of them) + latent down-projection + shared-expert gate/up in ONE grid over the three
  weights (75 MB), all on the main stream; bit-identical to the separate kernels. In the B = 1
  step it replaced 39.8 us (latent_down and the shared expert on the side stream, the router
  starting ~15 us late beside them) with 24-25 us. The shared expert's down GEMV then runs on
  the side stream beside the routed experts, joined before the tail. With FRONT_SHARED off
  (an A/B setting: 2.8 us slower per KDA layer, session 15) the grid streams the router and
  latent_down only and the whole shared expert runs on the side stream after it.
- MoE front at 2 ≤ M ≤ 8 (`front_mma`, kernels/front_mma.py, op `moe_front`): the same three
  projections as one grid of gemv_mma tiles (16 warps per CTA), router_mma's top-k run by the
  last router tile while the projection tiles still stream; with FRONT_MMA_SHARED the shared
  expert's gate/up is one of them (its down GEMV then on the side stream), else the shared
  expert runs whole on the side stream after it. Two kernels fewer per MoE layer at M = 8; in
  the step a tie with router_mma + latent_down + the shared gate/up on an H100 (session 22,
  bench/fused_runs.md); not yet measured on the H200. Where it cannot run, router_mma (below).
- Shared expert (M > 1) on the side stream after the latent down-projection, overlapping the
  router on the main stream (stock joins the side stream before the router starts) and the
  routed experts, which wait only for latent_down's event (_mark / _wait_mark; the tail joins
  the shared expert); at M = 1 its SiTU GLU is the down GEMV's prologue (`gemv_variants`:
  gemv_situ), at 2 ≤ M ≤ 8 gemv_mma's (`gemv_mma_situ`), above it stock's SiTU kernel then
  the down projection.
  With SHARED_AFTER_ROUTER (default) the shared expert is issued after the router, so the
  front streams latent_down and the router's weights only and the shared expert runs beside
  the routed experts.
- Router at 2 ≤ M ≤ 8: `router_mma` (kernels/router_mma.py), one launch: gemv_mma's 56-CTA
  fp32 logits grid (one K slice, 16 warps) with the sigmoid + correction-bias top-k in its last
  CTA, which releases FC1 on arrival; the shared expert is issued after it
  (SHARED_AFTER_ROUTER_MMA). The default from session 15 (the 4-layer step graph 823-829 µs
  against 838-842 at B = 1, k = 7 and one kernel fewer per layer, per layer within the
  run-to-run spread, bench/fused_runs.md sessions 14-15) until front_mma (above) took its tiles
  into the one-grid front in session 22; it runs where front_mma cannot. Where it cannot either, gemv_mma's
  logits then `router_topk` (kernels/router_topk.py: router_fast's selection, one warp-CTA per
  row) instead of stock's Triton routing kernel.
- Routed experts (`experts`, kernels/moe_experts.py): FC1 + SiTU GLU, then FC2 + the
  weighted top-k sum written into the all-reduce slot; each selected expert's weights read
  once, the zero padding of the intermediate skipped; FC2 launched with programmatic dependent
  launch (MAX_ROWS["experts_pdl"]), so its weight loads start while FC1 finishes. With
  `experts_v2` FC2 is ExpertsFC2v2 (one wave, every lane loading: 23.5 vs 26.0 us at M = 1);
  with `experts_rows` at 2 ≤ M ≤ 8 FC2 is moe_fc2_rows.ExpertsFC2Rows (the same arithmetic,
  bit-equal, as a resident grid: one row per CTA walking column blocks; 131.1 vs 141.3 us for
  FC1 + FC2 at M = 8 cold, B = 1, k = 7 layers 238.6 / 251.9 -> 227.2 / 242.0 us).
  `experts_one` (kernels/moe_experts_one.py, opt-in: OPT_IN): FC1 + FC2 v2 as work items of
  one persistent launch (FC2 items wait on a grid-wide completion counter), bit-equal to the
  two kernels, at M ≤ MAX_ROWS["experts_one"]; one kernel fewer per layer, but slower.
- MoE tail (`moe_up`, kernels/moe_up.py): the all-reduce of the routed latent and the shared
  expert's reduce-scatter are summed from their slots, then latent RMSNorm, this rank's
  up-projection rows and the shared add, written into the all-gather slot: one launch for
  the stock op's six. At 2 ≤ M ≤ 8 `moe_up_grid` (kernels/moe_up_grid.py) does the same with
  the slot sums shared by the whole grid (a grid barrier), so the M = 8 step keeps the
  collectives in kernels too (5 launches fewer per layer than stock's tail).
  `moe_up_cluster` (kernels/moe_up_cluster.py) does it at 2 ≤ M ≤ 8 (UP_CLUSTER_MIN_ROWS) in
  place of moe_up_grid, with the slot sums shared inside clusters of 8 CTAs through
  distributed shared memory (no grid barrier, no scratch, 1/8 of moe_up's slot reads per
  CTA): in same-machine H100 pairs the step graph 2.3-4.2 us faster per step at M = 8
  (session 38; ~0.3 %, not visible across machines); M = 1 keeps moe_up, which the cluster
  kernel lost to in the step.
- Projections at M = 1 (the per-M table, kernels/gemv.py GEMV_MAX_ROWS): a CuTe DSL GEMV
  streaming each weight once (in_proj 10.1 us = 4.6 TB/s vs 14.0 us for torch's GEMM on the
  H200) for in_proj, o_proj, g_proj, qkv_a, q_b, latent_down, shared gate_up; from M = 2 the
  stock GEMM op (its skinny GEMM or cuBLAS: at M = 8 the first GEMV measured 33 us vs 13.8 us),
  or with `gemv_mma` (kernels/gemv_mma.py, 2 ≤ M ≤ 8) every projection _linear runs and the
  router's fp32 logits (LatentMoE._router_logits) on the tensor cores: in the B = 1, k = 7 step
  FC1 starts 32.1 us after the MoE front does instead of 41.6 (bench/fused_runs.md).
  With `gemv_tuned` each weight shape at M = 1 takes the configuration its device sweep found
  fastest (gemv.TUNED / TUNED_MULTI: split-K for in_proj, cache hints, unroll 7); with
  `gemv_mma_tuned` likewise at 2 ≤ M ≤ 8 where the step gained (gemv_mma.TUNED).
- MLA: at M = 1 qkv_a and g_proj are one `gemv_multi` grid (op `qkv_a_g`; 41 MB), above it
  g_proj stays on the side stream until the gate needs it; the query positions pos + t_off
  are computed once per step by FusedDecoder, not in every MLA layer; `mla_glue` fuses W_UK
  absorption + KV-cache insert (`uk_insert`) and W_UV + sigmoid gate (`uv_gate`);
  `mla_attend` is the absorbed attention over the latent cache in one launch (split over
  positions, combined in-kernel) where it beats stock's bmm (few query rows); with
  `mla_attend_uv` that launch also does uv_gate (its first 48 CTAs run the W_UV tiles once
  the combine has written o_lat), so the op `uv_gate` disappears.
  `mla_attend_mma` (kernels/mla_attend_mma.py) is the same attention with both products on the
  tensor cores and a one-round-trip merge; it replaces mla_attend at B = 1, k = 0 (with its own
  uv mode) and stock's chain at B = 8 and 64 (R ≤ MLA_MMA_MAX_ROWS rows per sequence) and at
  B = 1, k = 7 (R = 48 ≤ MLA_MMA_MAX_ROWS_ONE_SEQ, in row groups, uv mode too).
  `mla_norm_fold` (M = 1): the q/kv RMSNorms (stock op `qkv_norm`) disappear: q_b's GEMV
  normalises the q part of qkv_a's output in its prologue (kernels/gemv.py gemv_rmsnorm) and
  uk_insert normalises the c_kv part while writing the cache (mla_glue.uk_insert_norm);
  `mla_norm_fold_mma` does the same at 2 ≤ M ≤ 8 with q_b on the tensor cores (gemv_mma's
  RMSNorm prologue, kernels/gemv_mma.py gemv_mma_rmsnorm). `gemv_mma_pair` runs qkv_a and
  g_proj as one gemv_mma grid at 2 ≤ M ≤ 8, as gemv_multi at M = 1.
- `pdl_chain` (kernels/chain.py): the kernels above launched with programmatic dependent
  launch, each loading what no kernel of the step writes (a weight row, kda's state) before
  `griddepcontrol.wait` and releasing its successor right after the wait, so every kernel's
  launch and ramp overlap its predecessor: 5-6 us per B = 1 layer, bit-identical results
  (bench/fused_runs.md). A process-wide mode like gemv_tuned, set by each model's enable()
  and forward (FusedDecoder._apply_modes).
- `prefetch` (opt-in, see DEFAULT_KERNELS): after the routed experts are issued, a
  side-stream kernel pulls the first `PREFETCH_BYTES` of the next layer's first attention
  weight into L2 (kernels/l2_prefetch.py), under its own NVTX op `prefetch`.

Still stock ops: the dense layer-0 MLP; the MLA q/kv RMSNorms (`qkv_norm`) where neither
`mla_norm_fold` (M = 1) nor `mla_norm_fold_mma` (2 ≤ M ≤ 8) applies; and every op at shapes a
kernel's `can_implement` refuses (large M). Of those, at large M (B = 64) the routed experts run
stock's Triton kernels with the fused byte rule and an O(P) sort (LARGE_M_EXPERTS), and the
projections can take cuBLAS instead of stock's skinny GEMM (LINEAR_CUBLAS_MIN_ROWS,
ROUTER_CUBLAS_MIN_ROWS); a CuTe DSL grouped-experts kernel for M > 8 is not written yet.

On the CPU (no kernels) every op falls back to the stock ops, so fused equals stock exactly.
"""
from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kimi_decode import stock
from kimi_decode.config import KimiConfig
from kimi_decode.ranges import layer_range, op_range, step_range
from kimi_decode.stock import Runtime, StockDecoder

# Kernels that passed their device checks on the H200 (bench/fused_correctness.md); a kernel
# not listed here is never used.
VERIFIED: frozenset[str] = frozenset({"attn_res", "kda", "router", "gemv", "prefetch",
                                    "kda_split", "experts", "router_fast", "attn_res_ar", "attn_res_ag",
                                    "gemv_variants", "moe_up", "mla_attend", "mla_glue", "gemv_multi",
                                    # fourth and fifth rounds: every check passed at 801b1da
                                    # (2026-12-02 22:24-22:28 UTC, bench/fused_correctness.md)
                                    "experts_v2", "attn_res_mc", "mla_norm_fold", "mla_attend_uv",
                                    "kda_fast", "experts_one", "gemv_tuned",
                                    # sixth round: checked at 6ebf33b, 02226bc and 7eb4e95 (2026-12-03,
                                    # bench/fused_correctness.md: bit-identical to the unchained step)
                                    "pdl_chain",
                                    # eighth round: checked at 0af015a (2026-12-03 08:40 UTC,
                                    # bench/fused_correctness.md: 27 shapes, step parity, reference)
                                    "gemv_mma",
                                    # ninth round: checked at 644406b (2026-12-03 09:00 UTC)
                                    "moe_up_grid",
                                    # tenth round: checked at 41febc2 (09:38 UTC; bit-equal to FC2 v2)
                                    "experts_v2_async",
                                    # eleventh round: gemv_mma_situ checked at 6c936ea, kda_multi at
                                    # ba774df and 8c6e2b1, router_mma at 6c936ea, 0561ccb, 8c6e2b1 and
                                    # 7efa548, 2026-12-03 13:00-13:36 UTC (bench/fused_correctness.md)
                                    "gemv_mma_situ", "router_mma", "kda_multi",
                                    # twelfth round: experts_rows checked at 530c2da (2026-12-03
                                    # 14:26 UTC: bit-equal to FC2 v2 at M = 2 and 8), router_topk
                                    # at f8ea401 (one CTA) and 588963f (M CTAs, its present form)
                                    "experts_rows", "router_topk",
                                    # thirteenth round: mla_attend_mma (both modes) checked at
                                    # 2026-12-03 19:53 UTC (bench/fused_correctness.md), step parity at
                                    # B = 1, 8, 64, k = 0 in the same call
                                    "mla_attend_mma",
                                    # fourteenth round: kda_multi re-checked with T = 1 rows (B = 8
                                    # and 64, k = 0), gemv_mma_pair and mla_norm_fold_mma checked at
                                    # 939672d (2026-12-03 21:15 UTC, bench/fused_correctness.md)
                                    "gemv_mma_pair", "mla_norm_fold_mma",
                                    # gemv_mma's sweep (every configuration checked) at 0bb4935,
                                    # 21:45 UTC; step parity with its table at 21:49 UTC
                                    "gemv_mma_tuned",
                                    # fifteenth round: front_mma checked on an H100 at fc0e2b9 (8
                                    # warps) and 9067543 (16 warps, 2026-12-06 04:10-04:12 UTC), step
                                    # parity in both calls (bench/fused_correctness.md, fused_runs.md)
                                    "front_mma",
                                    # session 37: moe_up_cluster checked on an H100 at b3397af
                                    # (2026-12-07 22:18 UTC, 16 rows, step parity at B = 1 and 8;
                                    # the pass-by-pass build; default at M ≥ 2 since session 38)
                                    "moe_up_cluster"})
# gemv_mma_pair (qkv_a + g_proj in one gemv_mma grid at 2 ≤ M ≤ 8, one kernel fewer per MLA
# layer) left OPT_IN in session 23 (2026-12-06): on the H200 in session 11 it lost 1-4 us per
# MLA layer (g_proj on the side stream beside qkv_a had only uv_gate waiting for it; the pair
# puts its 11 MB on the path to q_b), but since the PDL chain, front_mma and the attention at
# R = 48 on the tensor cores it tied or won on the H100 in two A/Bs: MLA 272.4 / 278.5 us
# against 272.2-272.5 / 278.8-279.0 at 6ad2cfc (session 21, B = 1, k = 7 / B = 8), 271.8 /
# 278.8 against 272.8 / 280.4 at 3354121 beside mla_attend_mma at R = 48 (session 23). It
# makes the M = 8 MLA layer 13 kernels. Not yet re-measured on the H200 (the headline card):
# the next H200 call A/Bs it (`--patch 'kimi_decode.fused:MAX_ROWS["gemv_mma_pair"]=1'`). On
# an H100 again in session 30 (8336d10, twice): off, the MLA layer took +3.6-3.9 us one-layer
# and -0.1..+1.9 in-step at B = 1, k = 7 and B = 8 (14 kernels), KDA unchanged.
# Verified but opt-in (kernels={..., name}), each slower in the step where it would be used:
# - prefetch: slowed its consumer GEMV in the device check (21.8 us cold vs 70.4 us after a
#   prefetch);
# - experts_one (FC1 + FC2 in one persistent launch, one kernel fewer per layer): 29.0 us vs
#   23.6 us for FC1 + FC2 v2 with PDL at M = 1 (cold weights; 163 vs 143 us at M = 8;
#   bench/fused_correctness.md); the B = 1 step with it (and kda_fast, itself 0.4 us faster
#   than kda_split in its check) took 105.3 / 124.3 us (KDA / MLA) against 97.1 / 114.5 us
#   without both (bench/fused_runs.md).
# - experts_v2_async (FC2 v2 staging its activations with cp.async: no spills, one round trip):
#   faster alone (41febc2 check, cold, FC1 + FC2 with PDL: 23.5 vs 24.9 us at M = 1, 128.7 vs
#   141.3 at M = 8) but slower in the chained step: FC2 took 90-95 us at B = 1, k = 7 (72 with
#   the rolled staging) and the layers 271.3 / 280.9 us (KDA / MLA) against 247.2 / 256.7
#   (bench/fused_runs.md); why is not known.
# moe_up_cluster (kernels/moe_up_cluster.py, session 36): the MoE tail at every M ≤ 8 with its
# slot sums shared over clusters of 8 CTAs instead of moe_up's per-CTA sums (M ≤ 2) and
# moe_up_grid's grid barrier (M ≥ 3). Correct (session 37, H100, b3397af) and faster alone
# above M = 1 (CUDA-graph replays: 5.2 / 5.3 / 6.4 / 7.9 us at M = 1 / 2 / 4 / 8 against
# today's tail's 4.3 / 6.8 / 7.3 / 8.3), but slower in the step: +1.4 to +2.7 us per layer at
# B = 1 k = 0, B = 1 k = 7 and B = 8 in two ABAB pairs (bench/fused_runs.md, session 37); with
# ALL_PASSES_LOADS_FIRST 0.4-1.3 us faster at M = 8 in one unpaired run and still +1.1 to
# +2.0 at M = 1 (UP_CLUSTER_MIN_ROWS below). Session 38 (H100, b895496, `fused_ab --batch 8
# --spec 0 7`, base / cf2 / base2 / cf2b, bench/fused_runs.md): at M ≥ 2 only and with its loads
# first, the one-layer graphs tie (-0.4..+0.3 us) and the step is faster: the 4-layer step
# graph 1010.0 / 1011.3 against 1013.9 / 1013.6 us at B = 1, k = 7 and 1031.0 / 1031.0 against
# 1033.8 / 1035.2 at B = 8; the in-step layers 0.5-1.5 us each. So in the default set since
# session 38, at 2 ≤ M ≤ 8 (correct: the loads-first build's check and step parity passed at
# cd6f996). Small: the bench at cd6f996 on another H100 (bench/decode_h100.md) sits between
# those base and cf2 rows and within the cross-machine spread of session 36's run.
OPT_IN: frozenset[str] = frozenset({"prefetch", "experts_one", "experts_v2_async"})
DEFAULT_KERNELS: frozenset[str] = VERIFIED - OPT_IN
PREFETCH_BYTES = 24 << 20   # about half of the H200's usable L2
# The shared expert (M > 1, no one-launch MoE front) issued on the side stream after the
# router instead of after latent_down: the front then streams latent_down and the router's
# weights only, and the shared expert's 11 MB run beside the routed experts.
SHARED_AFTER_ROUTER = True
# The same where router_mma is issued first (the side stream forked before it): False keeps the
# shared expert right after latent_down, in the front beside the router's grid (as router_mma
# was measured before session 14); True (the default since session 15) issues it after the
# router as above: with 8 warps per CTA it was 4-5.5 us slower per layer, with 16 the best
# setting of session 14 (bench/fused_runs.md).
SHARED_AFTER_ROUTER_MMA = True
# The one-launch MoE front at M = 1 (gemv_multi): the shared expert's gate/up as one of its
# segments (True, 75 MB in one grid), or issued on the side stream after the front (False: the
# front streams the router and latent_down only, 64 MB, and the shared expert's 16.5 MB share
# the expert window, whose FC1 streams at ~58 % of the DRAM peak at M = 1 while it waits on
# the ids and ramps up: bench/ncu_fused_b1.md; one launch more per layer). Measured in session
# 15: B = 1, k = 0 KDA layers 87.4-87.9 us with it off against 84.6-85.0 (bench/fused_runs.md),
# so True.
FRONT_SHARED = True
# The one-launch MoE front at 2 ≤ M ≤ 8 (front_mma, kernels/front_mma.py): the shared expert's
# gate/up as one of its projections (its down GEMV then on the side stream beside the routed
# experts) or, False, the front streams the router and latent_down only and the whole shared
# expert runs on the side stream after it. Read per call, so `--patch` A/Bs it.
FRONT_MMA_SHARED = True
# Where no CuTe experts kernel runs (above their rows, M > 8 or M·K > 128: B = 64, or B = 8 with
# k = 7) the routed experts are stock's four Triton kernels (sort, FC1, FC2, finalize). True:
# called with the fused path's byte rule and sort (stock_triton.expert_outputs' `inter` and
# `fast_align`): FC1 and FC2 skip the zero padding (192 of 256 intermediate rows; stock's FC1 +
# FC2 took 479 + 282 µs in the bundled H200 B = 64 trace) and the sort's places come from atomics
# (stock's stable O(P²) sort took 85-97 µs there at P = 1024), and the finalize writes the
# all-reduce slot itself (no copy). Bit-identical outputs (tests/kimi_decode/test_stock_triton.py;
# on an H100 in bench/large_m_experts.md at M = 8, 16, 64). Measured (session 32, H100, 9eea7b9,
# bench/fused_runs.md): the call at M = 64 1220 -> 894 µs (sort 86 -> 19 µs); the B = 64 layers
# 1339-1388 / 1462 µs (KDA range / MLA) with False against 1023-1061 / 1148-1150 with True.
# Since session 34 stock's own call sorts the same way (stock_ops.STOCK_FAST_ALIGN, vLLM's
# method), so the padding skip and the slot write are what remain different.
# Read per call, so `--patch` A/Bs it.
LARGE_M_EXPERTS = True
# The projections no CuTe kernel takes (M > 8) run stock's GEMM op, the skinny Triton GEMM up to
# M = 64 (vLLM's low-latency GEMM); past 16 rows its configuration is 32-wide column blocks
# (skinny_mm_config), so the router's N = 896 gets 28 CTAs (~40 µs in the bundled H200 B = 64
# trace for 6.4 MB) and the up-projection's 448-row shard 14 (42 µs busy); in_proj took 28.9 µs
# for 46 MB, latent_down 39.7 for 51 MB. From LINEAR_CUBLAS_MIN_ROWS rows on, `_linear` calls
# cuBLAS (torch.mm) and the latent up-projection is the norm + addmm; from ROUTER_CUBLAS_MIN_ROWS
# on the router's fp32 logits are cuBLAS with an fp32 output (torch.mm's out_dtype, CUDA only).
# Measured at B = 64 (session 32, H100, 9eea7b9, two A/Bs, bench/fused_runs.md): both on
# 980-1012 / 1097-1103 µs per layer (KDA range / MLA) against 1023-1061 / 1148-1150 (28/35
# kernels against 23/28); the projections alone 1020-1056 / 1144, the router alone 1018-1061 /
# 1140: the two paths of the MoE front run beside each other, so only both together shorten
# it. Step parity at B = 64 passes with both (own and forced routing, max rel 8.0e-3). 17: the
# first M of skinny_mm's past-16-rows configuration, the regime measured (M = 64 only). None:
# stock's ops at every M. Read per call, so `--patch` A/Bs them.
LINEAR_CUBLAS_MIN_ROWS: int | None = 17
ROUTER_CUBLAS_MIN_ROWS: int | None = 17
# The step's tail advances the MLA positions in place (add_, then masked_fill_ at the cache
# wrap) instead of StockDecoder's `pos.copy_(torch.where(..))`, whose copy is a device-to-device
# memcpy node in the step's CUDA graph. Same positions (tests/kimi_decode/test_fused.py).
# Measured (H100, 5a0a1f9, bench/fused_runs.md session 31): the step graph's median drops
# 2.0-2.5 us at B = 1, k = 0 (414.4 / 414.9 -> 412.4 / 412.4) and 3.6-5.3 us at k = 7, in two
# pairs of processes (fused_ab); step parity with it on passes at B = 1, 8, 64, k = 0, 7 (own
# routing at B = 1, k = 7 not compared, as in every run); the one-layer figures do not move
# (their graphs have no tail). It was tried for the step graph's 3.3 us first gap and
# does not remove it: that gap grows with the graph's size (bench/graph_start.md). Read per
# call, so `--patch` A/Bs it.
POS_UPDATE_IN_PLACE = True

# Tried and removed (session 30): the shared expert's down GEMV in the main PDL chain between
# front_mma and FC1 (2 ≤ M ≤ 8) instead of on the side stream. Why tried: in the H200 step
# traces (cd24720) that GEMV runs beside FC1 in each step's first layer but beside FC2's
# resident grid in every later one, where FC2 ends 46.5-56.4 us after FC1 instead of 39.1-40.8
# (bench/fused_runs.md, session 29). Measured on an H100 (8336d10, fused_ab twice): slower
# at B = 1, k = 7 and B = 8, one-layer KDA / MLA +4.5-6.4 / +5.1-6.1 us, in-step +0.6-4.4 /
# +1.9-4.4 us (bench/fused_runs.md, session 30).

# The per-M table: the most rows M = B·(1 + k) at which each kernel is used, from the fused
# step's traces on the H200 (`decodescope layers traces/k3_fused_*_graph.json.gz`; two device
# runs on 2026-12-02, the first with every kernel at every M it can do):
# - router_fast, router: M = 1 (router_fast 22-24 us in the step while the side stream streams
#   67 MB beside it); at M = 8 both lose to stock's GEMM (11.3 us) + Triton routing (8.4 us):
#   router_fast 50 us, router.py's top-k mode 60+ us.
# - kda_split, kda: M = 1 (kda_split 8.2-8.3 us, stock's f_b + conv + recurrence + o_norm 8.1
#   us: a tie, kept for the launch count, 1 vs 4); at T = 8 or B = 8, 64 stock's Triton ops win
#   (B=1 k=7: 29.4 vs 19.7 us; B=8: 10.3 vs 9.3; B=64: 33.1 vs 21.8). At T = 8 kda_multi
#   (below) replaces both.
# - moe_up: M = 1 (5.5 us vs stock tail 9.8 + up 13.8 us); at M = 8 it re-sums the slots per
#   row in every CTA: 49 us vs 28.6. M = 2 too: in the 644406b check (moe_up_grid's, which
#   compares the two kernels: equal outputs) moe_up took 5.9 us there against 6.9 for
#   moe_up_grid and 24.2 for the stock ops. From M = 3 to 8 moe_up_grid runs where enabled
#   (kernels/moe_up_grid.py, the sums once per grid; same check: M = 4 8.7 us vs moe_up's
#   12.2, M = 8 12.4 vs 25.9, stock 24.8 / 25.1; with every row in one pass after its grid
#   barrier, 9e42f27: M = 2 6.8, M = 4 8.0, M = 8 10.5 us); LatentMoE._up_applies makes the
#   choice. Since session 38 moe_up_cluster takes 2 ≤ M ≤ 8 (UP_CLUSTER_MIN_ROWS, the note
#   before OPT_IN); moe_up_grid runs there only with that kernel off.
# - mla_attend: query rows B·T·H ≤ 6, i.e. B = 1, k = 0, where it runs the grid merge
#   (9f04320, bench/fused_correctness.md: 11.6 us cold vs 13.7 for stock's compiled op, 16.8
#   with the two-level merge it had before); at 48 rows (B = 8 or k = 7) 43-330 us vs 15-30 us
#   for stock's bmm chain.
# - experts (M ≤ 8: 156 vs 177 us at M = 8), attn_res_ar/ag, mla_glue, GEMV (M = 1, its own
#   table in kernels/gemv.py): every M their can_implement allows.
# - gemv_multi: M = 1, as the plain GEMV it is made of (kernels/gemv.py GEMV_MAX_ROWS).
# - mla_norm_fold: M = 1, as the GEMV whose prologue takes qkv_norm's q half (the kernel
#   itself is correct to M = 8, see kernels/mla_norm_fold.py; from M = 2 q_b is stock's GEMM).
#   H200 (bench/fused_correctness.md, 801b1da): 6.35 vs 7.49 us for qkv_norm + q_b + uk_insert
#   at M = 1; at M = 8 17.2 vs 10.4 us.
# - mla_norm_fold_mma: 2 ≤ M ≤ 8 (gemv_mma's prologue instead of the CUDA-core GEMV; its check
#   at 939672d, cold weights: M = 8 7.8 us vs 9.2 for qkv_norm + gemv_mma + uk_insert, M = 2 6.7
#   vs 8.1; MLA layers 224.7 / 227.6 us vs 227.1 / 230.7 at B = 1, k = 7 / B = 8).
# - gemv_mma_pair: 2 ≤ M ≤ 8 (the note after VERIFIED).
# - gemv_mma_tuned: gemv_mma's per-shape (warps, unroll) at 2 ≤ M ≤ 8 (gemv_mma.TUNED: 16 warps
#   for in_proj and qkv_a; latent_down's sweep winner measured slower in the step, see there).
# - experts_pdl: FC2 launched with programmatic dependent launch (its w2 loads start while FC1
#   finishes; CUDA-graph replays on the H200, 2026-12-02: 26.0 vs 27.7 us at M = 1, 153.7 vs
#   155.1 us at M = 8, same results); the two M the check covers.
# - attn_res_mc (one row over a cluster of 7 CTAs, kernels/attn_res_mc.py): M ≤ 8 (its check on
#   the H200, CUDA-graph replays at M = 1: ar mode nb = 1 3.54 vs 5.19 us for the one-CTA
#   kernel, nb = 8 4.85 vs 8.97; plain nb = 1 3.00 vs 3.81; ag nb = 1 3.02 vs 3.90; at M = 8,
#   9e42f27: ar nb = 1 3.6 vs 5.4, nb = 8 4.9 vs 9.3, plain 3.1 vs 3.9, ag 3.1 vs 4.1). It is
#   also the AttnRes kernel in the PDL chain (the one-CTA kernel is not). Until 9e42f27 it ran
#   at M = 1 only ("the one-CTA kernel already has M CTAs on M SMs"); the bench in one device
#   call, one process each: B = 1, k = 7 KDA / MLA 218.2 / 235.0 us at M ≤ 1, 216.4 / 225.2
#   at M ≤ 8; B = 8 215.8 / 243.8 vs 210.7 / 234.4 (bench/fused_runs.md).
#   Above M = 8 (B = 64), where the one-CTA kernel puts each row on one SM (mlp_res, 16
#   all-reduce slot rows, 229 KB per row, took 17.0 us and attn_res 5.2 us in the cd24720 B = 64
#   H200 trace for 14.7 MB of slots; the cluster grid (7, 64) spreads them over 448 CTAs): up
#   to ATTN_RES_MC_WIDE_ROWS rows while the mix reads at most ATTN_RES_MC_WIDE_MAX_NB blocks.
#   In the step (H100, bench/fused_runs.md session 34), B = 64, one-layer graphs, every
#   AttnRes on the cluster kernel against the one-CTA one: layers 4-7 (nb = 1; fa8c778, three
#   runs against two, interleaved) KDA 948.4-977.8 vs 954.6-984.7 us, MLA 1062.5-1070.9 vs
#   1075.9-1078.0; layers 40-43 (nb = 4; 5bac28a, one pair) every layer 0.6-3.1 us faster
#   (KDA 948.4-973.3 vs 950.9-976.4, MLA 1082.0 vs 1083.9); layers 88-91 (nb = 8, two pairs)
#   every layer 2.4-3.4 us SLOWER (KDA 974.0-985.9 vs 971.6-983.3, MLA 1072.5 / 1081.3 vs
#   1070.0 / 1077.9). The isolated check at M = 64, nb = 8 agrees (cluster 11.5-13.9 vs 7.1-9.9
#   us in every mode: 448 CTAs in clusters of 7, several waves, each reading 8 block rows).
#   So nb ≤ 4 (K3's first 48 layers); nb 5-7 are unmeasured and keep the one-CTA kernel, and
#   9 ≤ M ≤ 63 take the same rule as M = 64, not measured apart.
# - experts_v2 (FC2 in one wave): every M the kernel takes (≤ 8; cold weights, with PDL:
#   23.7 vs 26.2 us at M = 1, 141.9 vs 155.4 us at M = 8).
# - mla_attend_uv (uv_gate inside mla_attend's launch, B = 1, k = 0 where mla_attend runs):
#   with the grid merge 16.0 us cold vs 15.1 us for mla_attend + uv_gate in isolation (9f04320;
#   22.3 with the two-level merge); kept for the kernel count: in the B = 1 bench at 801b1da
#   the MLA layer took 113.8 us in 13 kernels with it and 111.2 us in 14 without it
#   (bench/fused_runs.md); with the grid merge 101.7 us in 13 (bench/decode.md).
# - experts_one (FC1 + FC2 v2 in one persistent launch, kernels/moe_experts_one.py): M = 1 when
#   opted in (OPT_IN: slower, see there); the kernel is correct to M = 8.
# - kda_fast: B = 1, T = 1 (6.20 vs 6.57 us for kda_split in its check, bit-identical; at B = 8
#   13.1 vs 9.6 us, so not there).
# - gemv_mma: 2 ≤ M ≤ 8, its own limits (kernels/gemv_mma.py MIN_ROWS / MAX_ROWS: the mma's n
#   is 8; M = 1 keeps the CUDA-core GEMV). Cold in its check at 0af015a, M = 8 vs stock's Triton
#   GEMM: in_proj 16.6 vs 17.4 us, latent_down 17.4 vs 17.9, q_b 3.7 vs 5.5, router (fp32
#   logits) 8.0 vs 11.9, qkv_a 13.6 vs 13.2 (the one shape it does not win alone; kept: in the
#   step a Triton GEMM beside a gemv_mma grid waits for SMs, bench/fused_runs.md).
# - kda_multi: M ≤ 8 except B = 1, T = 1 (B = 1, k = 7: the shape the bench runs; its check also
#   covers B = 8, k = 7: 23.6 us vs kda_split's 47.9), the T-token kernel with the per-token
#   prelude done for all tokens at once (kernels/kda_multi.py) in place of stock's four
#   kernels: in the B = 1, k = 7 step the KDA attention part (AttnRes to AttnRes) 46.8-48.2 ->
#   38.8-40.2 us, 6 kernels -> 3 (ba774df, bench/fused_runs.md). Larger M not measured. With
#   its gates on the tensor cores (d714341) 14.4 us in its check at B = 1, k = 7 against 16.6
#   with the FMA gates, and the KDA layer 212.2 vs 216.1 us in the bench; with the cluster
#   epilogue (ccfc99b) 12.7 us, the layer 209.9 vs 211.0. T = 1 at B = 8 (M = 8; 68dea66, its
#   check at 939672d): 10.7 us alone against 9.7 for kda_split, but in the B = 8 step the KDA
#   layer took 203.0-203.4 us with it (13 kernels) against 209.0 with kda_split and 210.4-210.8
#   with stock's four kernels (16; bench/fused_runs.md, session 11). B = 64 (M = 64, past the
#   table): 33.1 us against kda_split's 31.1.
# - experts_rows (FC2 as a resident grid, kernels/moe_fc2_rows.py): 2 ≤ M ≤ 8 (its own
#   MIN_ROWS: at M = 1 FC2 v2's 896 CTAs are already one wave); M = 2 40.3 vs 41.9 us, M = 8
#   131.1 vs 141.3 us for FC1 + FC2 cold (530c2da); in the B = 1, k = 7 step FC2's end comes
#   44-45 us after FC1's instead of ~55 at ba774df (ncu, cold: 46 us for 165 MB, 75 % of the DRAM peak).
# - router_topk (the selection from gemv_mma's logits): 2 ≤ M ≤ 8 (M = 1 keeps router_fast's
#   one launch); 6.0 us alone at M = 8, 7.6 us in the B = 1, k = 7 step against 10.6-12.1 for
#   stock's Triton kernel, but the layers do not move beyond the run-to-run spread (the front
#   then waits for latent_down; bench/fused_runs.md); kept for the Triton kernel it removes.
#   Since session 15 only where router_mma cannot run (below).
# - router_mma (the router at 2 ≤ M ≤ 8 in one launch, kernels/router_mma.py): every M its
#   can_implement allows. At 4 K slices of 8 warps (7efa548: 11.4-14.2 us cold in its check)
#   the step did not gain: issued first, its 224-CTA grid slowed latent_down beside it (layers
#   239.7 / 256.9 us KDA / MLA at B = 1, k = 7 against 238.6 / 251.9; bench/fused_runs.md). At
#   one slice of 16 warps (gemv_mma's own logits grid; 13.0 / 14.5 us at M = 2 / 8 at 421b9f0)
#   with the shared expert after it and FC1 released on the last CTA's arrival, FC1 starts
#   0.4-0.8 us after latent_down in every M = 8 layer (3.9-6.7 late in most KDA layers with
#   router_topk) and the 4-layer step graph took 823-829 us against 838-842 at B = 1, k = 7
#   (818.8-823.2 vs 822.4-835.4 at B = 8), per layer within the spread (sessions 14-15).
# - mla_attend_mma (the attention on the tensor cores in one launch, kernels/mla_attend_mma.py;
#   with mla_attend_uv on, its uv mode does uv_gate in the same launch): R = T·H ≤
#   MLA_MMA_MAX_ROWS query rows per sequence, every B whose plan fits (one CTA per SM). In
#   place of mla_attend (B = 1, k = 0) and of stock's chain (B = 8, 64). Its check on the H200
#   (warm, CUDA-graph replays, 2026-12-03): B = 1, k = 0 8.0 us vs 11.2 for mla_attend and 13.5
#   for stock's compiled op; B = 64 117.0 vs 146.1; B = 8 20.4 vs 20.1 (a tie, 1 launch for
#   stock's 3); at R = 48 (B = 1, k = 7) 17.9 us vs 14.4, and the k = 7 MLA layer 231.0 us with
#   it vs 225.0 without (bench A/B in one call), so not there (bench/fused_runs.md). Again at
#   6ad2cfc on an H100 (session 21): the k = 7 MLA layer 280.1 us in 16 kernels against
#   272.2-272.5 in 20 (step parity with it passes), so R = 48 stayed on stock's chain. Session
#   23 (3354121, H100): in row groups of 16 rows (mla_attend_mma.row_groups: 3 groups of 44
#   splits) R = 48 runs 14.8 us warm against 19.6 ungrouped and 15.3 for stock's chain, 20.4
#   cold in its uv mode against 25.9 ungrouped and 24.8 for stock + uv_gate, and the k = 7 MLA
#   layer took 272.8 us in 14 kernels against 273.8-274.0 in 18 (281.3 ungrouped); step parity
#   passes. So R ≤ MLA_MMA_MAX_ROWS_ONE_SEQ at B = 1. At B = 8, k = 7 (R = 48, 8 sequences,
#   not in the bench) the kernel took 41.4 us (ungrouped, 16 splits) against 35.4 for stock's
#   chain, so with several sequences the rule stays R ≤ MLA_MMA_MAX_ROWS.
MLA_MMA_MAX_ROWS = 6
MLA_MMA_MAX_ROWS_ONE_SEQ = 48
MAX_ROWS = {"router_fast": 1, "router_kernel": 1, "kda": 1, "moe_up": 2, "mla_attend_rows": 6,
            "gemv_multi": 1, "experts_pdl": 8, "attn_res_mc": 8, "mla_norm_fold": 1, "experts_one": 1,
            "kda_multi": 8, "gemv_mma_pair": 8, "mla_norm_fold_mma": 8, "front_mma": 8}
# moe_up_cluster from this M on, up to its limit of 8; below it moe_up. In session 37 the kernel
# lost 1.1-2.0 us per layer at M = 1 even with ALL_PASSES_LOADS_FIRST (bench/fused_runs.md), so
# M = 1 keeps moe_up; at M ≥ 2 with that switch the step gained (the note before OPT_IN).
UP_CLUSTER_MIN_ROWS = 2
ATTN_RES_MC_WIDE_ROWS = 64     # attn_res_mc above MAX_ROWS["attn_res_mc"], up to this M ...
ATTN_RES_MC_WIDE_MAX_NB = 4    # ... while the mix reads at most this many blocks (the note above)


def _mla_mma_scratch(cfg: KimiConfig, on: frozenset[str], dev: torch.device) -> object | None:
    """kernels/mla_attend_mma.py's buffers where it runs (the per-M table's rule above:
    kernel on, R ≤ MLA_MMA_MAX_ROWS rows per sequence, or ≤ MLA_MMA_MAX_ROWS_ONE_SEQ at B = 1,
    a plan that fits), else None."""
    R, c = cfg.tokens_per_seq * cfg.mla_local_heads, cfg.kv_lora_rank
    limit = MLA_MMA_MAX_ROWS_ONE_SEQ if cfg.batch == 1 else MLA_MMA_MAX_ROWS
    if "mla_attend_mma" not in on or R > limit:
        return None
    from kimi_decode.kernels import mla_attend_mma as k_mma
    from kimi_decode.kernels._common import sm_count
    if not (k_mma.can_implement(cfg.mla_local_heads, cfg.tokens_per_seq, c, cfg.qk_rope_dim, (cfg.torch_dtype,))
            and k_mma.fits(cfg.batch, R, cfg.cache_len, c, sm_count(dev))):
        return None
    return k_mma.make_scratch(cfg.batch, R, cfg.cache_len, c, dev)


def _kernels_usable(device: torch.device) -> bool:
    return device.type == "cuda"


def _kda_multi_applies(cfg: KimiConfig) -> bool:
    """kda_multi's shapes: M within the per-M table, its limits, and not B = 1, T = 1 (kda_fast's)."""
    if not ((cfg.tokens_per_seq >= 2 or cfg.batch >= 2) and cfg.rows <= MAX_ROWS["kda_multi"]):
        return False
    from kimi_decode.kernels.kda_multi import can_implement
    return can_implement(cfg.kda_local_heads, cfg.kda_head_dim, cfg.conv_kernel, cfg.in_proj_rows,
                         cfg.tokens_per_seq, (cfg.torch_dtype,))


def _linear(x: torch.Tensor, w: torch.Tensor, use_gemv: bool, k: object,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ wᵀ. The per-M table: the CuTe GEMV (kernels/gemv.py) where its shape rules hold,
    else the stock path's own GEMM op `k.linear` (its skinny GEMM or cuBLAS). With `out` (a
    collective's slot, see comm.SimComm.ar_slots) the product is written there: by the GEMV
    itself, or by cuBLAS (`torch.mm(out=)`), never through an extra copy."""
    if use_gemv:
        from kimi_decode.kernels.gemv import can_implement, gemv
        if x.is_contiguous() and can_implement(x.shape[0], w.shape[0], w.shape[1], (x.dtype, w.dtype)):
            return gemv(x, w) if out is None else gemv(x, w, out=out)
        if "kimi_decode.kernels.gemv_mma" in sys.modules:
            from kimi_decode.kernels import gemv_mma as k_mma
            if (k_mma.enabled() and x.is_contiguous()
                    and k_mma.can_implement(x.shape[0], w.shape[0], w.shape[1], (x.dtype, w.dtype))):
                return k_mma.gemv_mma(x, w, out=out)
    if out is None:
        if LINEAR_CUBLAS_MIN_ROWS is not None and x.shape[0] >= LINEAR_CUBLAS_MIN_ROWS:
            return torch.mm(x, w.t())
        return k.linear(x, w)
    return torch.mm(x, w.t(), out=out)


@dataclass
class Slots:
    """A simulated all-reduce left unfinished: this rank's partial sits in slot `rank` of the
    persistent buffer `buf` [world, M, N]; the consumer (the AttnRes kernel) sums the slots.
    `reduce()` is what comm.all_reduce would have returned (the fallback when the consumer
    kernel is off)."""

    buf: torch.Tensor

    def reduce(self) -> torch.Tensor:
        return self.buf.sum(0)


@dataclass
class Gathered:
    """A simulated all-gather left unfinished: this rank's slice sits in slot `rank` of the
    persistent buffer `buf` [world, M, n] (moe_up wrote it); the consumer (the next layer's
    attention AttnRes kernel, mode attn_res_ag) reads delta[m, s·n + j] = buf[s, m, j] in
    place. `gather()` is what comm.all_gather_cols would have returned (the fallback: one
    concatenation kernel, comm.SimComm.gather_slots)."""

    buf: torch.Tensor

    def gather(self) -> torch.Tensor:
        return torch.cat(self.buf.unbind(0), dim=1)


def _project_and_reduce(mod: nn.Module, o: torch.Tensor) -> torch.Tensor | Slots:
    """o_proj then the all-reduce. With `mod.ar_slots` (tp_sim and the AttnRes kernel that
    finishes the reduction) the projection writes this rank's slot and the reduction moves
    into the next kernel: two launches fewer (the copy and the sum)."""
    if getattr(mod, "ar_slots", False):
        comm = mod.rt.comm
        buf = comm.ar_slots((o.shape[0], mod.o_proj.shape[0]), o)
        with op_range("o_proj"):
            _linear(o, mod.o_proj, mod.use_gemv, mod.k, out=buf[comm.rank])
        return Slots(buf)
    with op_range("o_proj"):
        out = _linear(o, mod.o_proj, mod.use_gemv, mod.k)
    with op_range("all_reduce"):
        return mod.rt.comm.all_reduce(out)


def _restate(module: nn.Module, cls: type) -> nn.Module:
    """A copy of `module` that shares its parameters and runtime (streams, collectives),
    clones its buffers (decode state), and has class `cls` (a fused subclass)."""
    memo: dict[int, object] = {id(p): p for p in module.parameters()}
    for sub in module.modules():
        rt = getattr(sub, "rt", None)
        if rt is not None:
            memo[id(rt)] = rt
    new = copy.deepcopy(module, memo)
    new.__class__ = cls
    return new


@contextlib.contextmanager
def _on_side(rt: Runtime, *inputs: torch.Tensor,
             after: torch.cuda.Event | None = None) -> Iterator[torch.cuda.Stream | None]:
    """Issue the block on the aux stream after the main stream's work so far (or only after
    the main-stream event `after`, from `_fork`), WITHOUT joining at the end (call `_join`
    where the main stream first needs the results)."""
    side = rt.aux.stream
    if side is None:
        yield None
        return
    if after is not None:
        side.wait_event(after)
    else:
        side.wait_stream(torch.cuda.current_stream())
    for t in inputs:
        t.record_stream(side)
    with torch.cuda.stream(side):
        yield side


def _fork(rt: Runtime) -> torch.cuda.Event | None:
    """An event recorded on the main stream now: an `_on_side(after=...)` block issued later
    starts from this point, not after main-stream work issued in between (the router issued
    before the side stream's GEMVs, so its CTAs are placed first, without the side stream
    waiting for it)."""
    if rt.aux.stream is None:
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream())
    return ev


def _join(rt: Runtime, *outputs: torch.Tensor) -> None:
    """The main stream waits for the aux stream; its outputs are marked used on main."""
    side = rt.aux.stream
    if side is None:
        return
    main = torch.cuda.current_stream()
    main.wait_stream(side)
    for t in outputs:
        t.record_stream(main)


def _mark(rt: Runtime) -> torch.cuda.Event | None:
    """An event recorded on the aux stream now (inside an `_on_side` block): the point a later
    `_wait_mark` joins, so the main stream can take one result of the side stream before the
    side stream's later work is done."""
    side = rt.aux.stream
    if side is None:
        return None
    ev = torch.cuda.Event()
    ev.record(side)
    return ev


def _wait_mark(ev: torch.cuda.Event | None, *outputs: torch.Tensor) -> None:
    """The main stream waits for `ev` (from `_mark`); `outputs` are marked used on main."""
    if ev is None:
        return
    main = torch.cuda.current_stream()
    main.wait_event(ev)
    for t in outputs:
        t.record_stream(main)


def _attn_res_mc_rows(rows: int, nb: int) -> bool:
    """Whether an AttnRes call of `rows` rows mixing `nb` blocks goes to the cluster kernel
    (the per-M table above: always up to MAX_ROWS["attn_res_mc"], wider only at small nb)."""
    return rows <= MAX_ROWS["attn_res_mc"] or (rows <= ATTN_RES_MC_WIDE_ROWS and nb <= ATTN_RES_MC_WIDE_MAX_NB)


class AttnRes(stock.AttnRes):
    """prefix = delta or base + delta, optional block write, mix, RMSNorm: one kernel."""

    use_kernel = False
    use_slots = False     # the kernel variant that sums all-reduce slots (kernel "attn_res_ar")
    use_gather = False    # the kernel variant that reads all-gather slots (kernel "attn_res_ag")
    use_mc = False        # one row over a cluster of CTAs (kernel "attn_res_mc"), M ≤ MAX_ROWS

    def _kernel(self, blocks: torch.Tensor, nb: int, world: int = 0, gather: int = 0) -> Callable:
        """The kernel wrapper for this call (both take attn_res_rmsnorm's arguments): the
        cluster kernel (kernels/attn_res_mc.py) when on, at M ≤ MAX_ROWS["attn_res_mc"] (or
        M ≤ ATTN_RES_MC_WIDE_ROWS with nb ≤ ATTN_RES_MC_WIDE_MAX_NB) and where it can run; the
        one-CTA kernel (kernels/attn_res.py) otherwise."""
        m, slots, d = blocks.shape
        if self.use_mc and _attn_res_mc_rows(m, nb):
            from kimi_decode.kernels import attn_res_mc as k_mc
            if k_mc.can_implement(d, nb, slots, (blocks.dtype, self.norm.dtype), k_mc.pick_ctas(d),
                                  world=world, gather=gather):
                return k_mc.attn_res_mc
        from kimi_decode.kernels.attn_res import attn_res_rmsnorm
        return attn_res_rmsnorm

    def update_and_mix(self, base: torch.Tensor, delta: torch.Tensor, blocks: torch.Tensor, nb: int,
                       reset: bool, write_slot: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(new prefix, normalised mix); with `write_slot`, blocks[:, write_slot] = new prefix
        (the mix reads blocks[:nb] only, so the slot written is never a source). `delta` may
        be `Slots` (an all-reduce to finish): the kernel sums the slots itself; or `Gathered`
        (an all-gather to finish): the kernel reads the slots in place."""
        if isinstance(delta, Gathered):
            if self.use_kernel and self.use_gather and not reset:
                fn = self._kernel(blocks, nb, gather=delta.buf.shape[-1])
                x, prefix = fn(blocks, nb, base, self.w, self.norm, self.eps,
                               delta_gather=delta.buf, write_slot=write_slot)
                return prefix, x
            delta = delta.gather()
        if isinstance(delta, Slots):
            if self.use_kernel and self.use_slots:
                fn = self._kernel(blocks, nb, world=delta.buf.shape[0])
                x, prefix = fn(blocks, nb, base, self.w, self.norm, self.eps,
                               delta_slots=delta.buf, reset=reset, write_slot=write_slot)
                return prefix, x
            delta = delta.reduce()
        if not self.use_kernel:
            prefix, x = super().update_and_mix(base, delta, blocks, nb, reset)
            if write_slot is not None:
                blocks[:, write_slot].copy_(prefix)
            return prefix, x
        fn = self._kernel(blocks, nb)
        if reset:
            x, prefix = fn(blocks, nb, delta, self.w, self.norm, self.eps, write_slot=write_slot)
        else:
            x, prefix = fn(blocks, nb, base, self.w, self.norm, self.eps, delta=delta, write_slot=write_slot)
        return prefix, x


class KDAAttention(stock.KDAAttention):
    """in_proj GEMV, one fused KDA kernel, o_proj GEMV, all-reduce."""

    use_kernel = False
    use_gemv = False
    ar_slots = False                               # o_proj writes its all-reduce slot
    split_scratch: object | None = None            # kernels/kda_split.py's buffers (kda_split or kda_fast)
    use_fast = False                               # kda_fast is on and the shape is B = 1, T = 1
    use_kda_multi = False                          # kda_multi is on, T ≥ 2 or B ≥ 2 (kernels/kda_multi.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor | Slots:
        if not (self.use_kernel or self.use_gemv or self.ar_slots):
            return super().forward(x)
        cfg, k = self.cfg, self.k
        H, d, P = cfg.kda_local_heads, cfg.kda_head_dim, cfg.kda_local_dim
        with op_range("in_proj"):
            z = _linear(x, self.in_proj, self.use_gemv, k)                             # [M, R]
        if self.use_kernel:
            from kimi_decode.kernels.kda_decode import KDAConfig, kda_decode
            with op_range("kda_recurrence"):
                kcfg = KDAConfig(H, d, cfg.tokens_per_seq, cfg.in_proj_rows, cfg.gate_lower_bound,
                                 1e-6, cfg.rms_eps)
                if self.use_kda_multi:                   # T ≥ 2 or B ≥ 2 (kernels/kda_multi.py)
                    from kimi_decode.kernels.kda_multi import kda_decode_multi
                    o = kda_decode_multi(z, self.f_b, self.conv_w, self.conv_state, self.dt_bias,
                                         self.a_log, self.rec_state, self.o_norm, kcfg, self.split_scratch)
                elif self.use_fast and z.shape[0] == 1:   # B = 1, T = 1 (kernels/kda_fast.py)
                    from kimi_decode.kernels.kda_fast import kda_decode_fast
                    o = kda_decode_fast(z, self.f_b, self.conv_w, self.conv_state, self.dt_bias,
                                        self.a_log, self.rec_state, self.o_norm, kcfg, self.split_scratch)
                elif self.split_scratch is not None:     # many CTAs (kernels/kda_split.py)
                    from kimi_decode.kernels.kda_split import kda_decode_split
                    o = kda_decode_split(z, self.f_b, self.conv_w, self.conv_state, self.dt_bias,
                                         self.a_log, self.rec_state, self.o_norm, kcfg, self.split_scratch)
                else:
                    o = kda_decode(z, self.f_b, self.conv_w, self.conv_state, self.dt_bias, self.a_log,
                                   self.rec_state, self.o_norm, kcfg)                 # [M, P]
        else:                                                                          # stock ops
            qkv, gate_out = z[:, :3 * P], z[:, 3 * P:4 * P]
            f_a, beta_in = z[:, 4 * P:4 * P + d], z[:, 4 * P + d:4 * P + d + H]
            with op_range("f_b_proj"):
                f_b = k.linear(f_a, self.f_b)
            with op_range("conv"):
                act = k.conv_(self.conv_state, qkv, self.conv_w, cfg.batch)
            with op_range("kda_recurrence"):
                o = k.kda_(act, f_b, beta_in, self.dt_bias, self.a_log, self.rec_state,
                           cfg.gate_lower_bound, H)
            with op_range("o_norm"):
                o = k.gated_rms_norm(o, self.o_norm, gate_out, cfg.rms_eps, x.dtype)
        return _project_and_reduce(self, o)


class MLAAttention(stock.MLAAttention):
    """The stock op sequence with GEMVs for the projections, and g_proj on the side stream
    until the gate multiply needs it (stock joins right after issuing it)."""

    use_gemv = False
    ar_slots = False
    use_multi = False                              # kernels/gemv_multi.py: qkv_a + g_proj, one launch
    use_pair = False                               # kernels/gemv_mma_pair.py: the same at 2 ≤ M ≤ 8
    use_glue = False                               # kernels/mla_glue.py: uk_insert, uv_gate
    use_fold = False                               # "mla_norm_fold": no qkv_norm launch (M = 1)
    use_fold_mma = False                           # "mla_norm_fold_mma": the same at 2 ≤ M ≤ 8
    pair_counter: torch.Tensor | None = None       # gemv_mma_pair.SIGNAL (an A/B): q_b on qkv_a's signal
    attend_scratch: object | None = None           # kernels/mla_attend.py's buffers when it is on
    attend_uv = False                              # mla_attend_uv: mla_attend also does uv_gate
    mma_scratch: object | None = None              # kernels/mla_attend_mma.py's buffers when it is on
    last_buf: torch.Tensor | None = None           # pos + t_off, kept by FusedDecoder (once per step)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor | Slots:
        if not (self.use_gemv or self.ar_slots or self.use_glue or self.use_multi or self.use_pair
                or self.attend_scratch is not None):
            return super().forward(x, pos)
        cfg, fx, k, lin = self.cfg, self.fx, self.k, self.use_gemv
        B, T, H = cfg.batch, cfg.tokens_per_seq, cfg.mla_local_heads
        nope, rope, c, ql = cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.kv_lora_rank, cfg.q_lora_rank
        multi = self._multi_applies(x)
        g_on_side = not (multi or self._pair_applies(x))
        signal = False
        if g_on_side:
            with _on_side(self.rt, x), op_range("g_proj"):
                g = _linear(x, self.g_proj, lin, k)                                    # [M, H*vd]
            with op_range("qkv_a"):
                a = _linear(x, self.qkv_a, lin, k)                                     # [M, ql+c+rope]
        elif multi:                             # both weight streams in one grid (gemv_multi, M = 1)
            from kimi_decode.kernels.gemv_multi import gemv_multi
            with op_range("qkv_a_g"):
                a, g = gemv_multi(x, [self.qkv_a, self.g_proj])
        else:                                   # the same on the tensor cores (2 ≤ M ≤ 8)
            from kimi_decode.kernels.gemv_mma_pair import gemv_mma_pair
            signal = self._signal_applies(x)    # q_b entered on qkv_a's CTAs (gemv_mma_pair.SIGNAL)
            with op_range("qkv_a_g"):
                a, g = gemv_mma_pair(x, self.qkv_a, self.g_proj, counter=self.pair_counter if signal else None)
        fold = self._fold_mode(a)
        if signal and fold != "mma":            # only q_b-after re-zeroes the pair's counter
            raise RuntimeError(f"MLA layer: the signalled pair ran but q_b's fold mode is {fold!r}")
        if fold == "gemv":                      # the norms move into q_b's GEMV and uk_insert
            from kimi_decode.kernels.gemv import gemv_rmsnorm
            with op_range("q_b_proj"):
                q = gemv_rmsnorm(a, self.q_a_norm, self.q_b, ql, cfg.rms_eps).reshape(-1, H, nope + rope)
        elif fold == "mma" and signal:          # the same, entered on qkv_a's signal
            from kimi_decode.kernels import gemv_mma_pair as k_pair
            with op_range("q_b_proj"):
                q = k_pair.gemv_mma_rmsnorm_after(
                    a, self.q_a_norm, self.q_b, ql, cfg.rms_eps, self.pair_counter,
                    k_pair.producers(x.shape[0], self.qkv_a.shape[0], self.g_proj.shape[0], x.shape[1])
                ).reshape(-1, H, nope + rope)
        elif fold == "mma":                     # the same with q_b on the tensor cores (2 ≤ M ≤ 8)
            from kimi_decode.kernels.gemv_mma import gemv_mma_rmsnorm
            with op_range("q_b_proj"):
                q = gemv_mma_rmsnorm(a, self.q_a_norm, self.q_b, ql, cfg.rms_eps).reshape(-1, H, nope + rope)
        else:
            with op_range("qkv_norm"):
                qa, ckv = k.mla_norms(a, self.q_a_norm, self.kv_a_norm, ql, c, cfg.rms_eps)
            with op_range("q_b_proj"):
                q = _linear(qa, self.q_b, lin, k).reshape(-1, H, nope + rope)          # [M, H, 192]
        glue = None
        if self.use_glue:
            from kimi_decode.kernels import mla_glue as glue
        if fold:
            with op_range("uk_insert"):          # + c_kv's RMSNorm, read from a in-kernel
                q_full = glue.uk_insert_norm(q, a, self.kv_a_norm, cfg.rms_eps, self.w_uk_t, self.cache, pos, T,
                                             ql + c, ql)
        elif glue is not None and glue.can_implement_uk(q.shape[0], T, H, nope, rope, c, a.shape[1], ql + c, (q.dtype,)):
            with op_range("uk_insert"):          # W_UK absorption + cache insert: one launch
                q_full = glue.uk_insert(q.contiguous(), a, ckv.contiguous(), self.w_uk_t, self.cache, pos, T, ql + c)
        else:
            with op_range("uk_bmm"):
                q_lat = torch.bmm(q[..., :nope].transpose(0, 1), self.w_uk_t).transpose(0, 1)
            with op_range("kv_insert"):
                q_full = k.kv_insert(q_lat, q, ckv, a, ql + c, self.cache, pos, T)
        uv_in_attend = self.attend_uv and (self.attend_scratch is not None or self.mma_scratch is not None)
        if uv_in_attend and g_on_side:           # the kernel reads g
            _join(self.rt, g)
        with op_range("mla_decode"):
            # the step's query positions, computed once per step by FusedDecoder (last_buf)
            last = self.last_buf if self.last_buf is not None else pos + self.t_off
            if uv_in_attend and self.mma_scratch is not None:    # the same on the tensor cores
                from kimi_decode.kernels.mla_attend_mma import mla_attend_mma_uv
                o, _ = mla_attend_mma_uv(q_full.contiguous(), self.cache, last, H, c, (nope + rope) ** -0.5,
                                         self.w_uv, g.contiguous(), self.mma_scratch)
            elif uv_in_attend:                   # attention + W_UV + gate: one launch
                from kimi_decode.kernels.mla_attend import mla_attend_uv
                o, _ = mla_attend_uv(q_full.contiguous(), self.cache, last, H, c, (nope + rope) ** -0.5,
                                     self.w_uv, g.contiguous(), scratch=self.attend_scratch)
            elif self.attend_scratch is not None:         # one launch (kernels/mla_attend.py)
                from kimi_decode.kernels.mla_attend import mla_attend
                o_lat = mla_attend(q_full.contiguous(), self.cache, last, H, c, (nope + rope) ** -0.5,
                                   scratch=self.attend_scratch)
            elif self.mma_scratch is not None:            # tensor cores, one launch (many rows)
                from kimi_decode.kernels.mla_attend_mma import mla_attend_mma
                o_lat = mla_attend_mma(q_full.contiguous(), self.cache, last, H, c, (nope + rope) ** -0.5,
                                       self.mma_scratch)
            else:
                o_lat = fx["attend"](q_full, self.cache, last, H, c, (nope + rope) ** -0.5)
        if uv_in_attend:
            return _project_and_reduce(self, o)
        if glue is not None and glue.can_implement_uv(B * T, H, c, cfg.v_head_dim, (o_lat.dtype,)):
            if g_on_side:
                _join(self.rt, g)
            with op_range("uv_gate"):            # W_UV absorption + sigmoid gate: one launch
                o = glue.uv_gate(o_lat.contiguous(), self.w_uv, g)
        else:
            with op_range("uv_bmm"):
                o = torch.bmm(o_lat.reshape(B * T, H, c).transpose(0, 1), self.w_uv).transpose(0, 1)
            if g_on_side:
                _join(self.rt, g)
            with op_range("gate_mul"):
                o = fx["gate"](o.reshape(B * T, -1), g)
        return _project_and_reduce(self, o)

    def _signal_applies(self, x: torch.Tensor) -> bool:
        """gemv_mma_pair.SIGNAL's pair and q_b: its counter allocated (fused.enable) and q_b
        folded on the tensor cores after this pair (the only consumer that re-zeroes it)."""
        if self.pair_counter is None:
            return False
        a_like = torch.empty(x.shape[0], self.qkv_a.shape[0], dtype=x.dtype, device="meta")
        return self._fold_mode(a_like) == "mma"

    def _fold_mode(self, a: torch.Tensor) -> str | None:
        """qkv_norm folded into q_b's projection (RMSNorm prologue) and uk_insert: "gemv" (kernel
        "mla_norm_fold" with gemv and mla_glue on, M within its per-M table: the CUDA-core GEMV),
        "mma" (kernel "mla_norm_fold_mma" with mla_glue on, 2 ≤ M ≤ its table: gemv_mma's
        prologue), None (qkv_norm stays a launch); both kernels must take the shapes."""
        cfg = self.cfg
        m = a.shape[0]
        gemv_fold = self.use_fold and self.use_gemv and m <= MAX_ROWS["mla_norm_fold"]
        mma_fold = self.use_fold_mma and 2 <= m <= MAX_ROWS["mla_norm_fold_mma"]   # gemv_mma's M
        if not (self.use_glue and a.is_contiguous() and (gemv_fold or mma_fold)):
            return None
        from kimi_decode.kernels import gemv, gemv_mma
        from kimi_decode.kernels.mla_glue import can_implement_uk_norm
        ql, c, rope, H = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_dim, cfg.mla_local_heads
        A = a.shape[1]
        dts = (a.dtype, self.q_a_norm.dtype, self.q_b.dtype)
        if not can_implement_uk_norm(m, cfg.tokens_per_seq, H, cfg.qk_nope_dim, rope, c, A, ql + c, ql,
                                     (a.dtype, self.kv_a_norm.dtype, self.w_uk_t.dtype, self.cache.dtype)):
            return None
        if gemv_fold and gemv.can_implement_norm(m, self.q_b.shape[0], ql, A, dts):
            return "gemv"
        if mma_fold and gemv_mma.can_implement_norm(m, self.q_b.shape[0], ql, A, dts):
            return "mma"
        return None

    def _pair_applies(self, x: torch.Tensor) -> bool:
        """qkv_a and g_proj as one gemv_mma_pair launch: kernel on, M within the per-M table and
        its limits (2 ≤ M ≤ 8)."""
        if not (self.use_pair and x.shape[0] <= MAX_ROWS["gemv_mma_pair"] and x.is_contiguous()):
            return False
        from kimi_decode.kernels.gemv_mma_pair import can_implement
        return can_implement(x.shape[0], self.qkv_a.shape[0], self.g_proj.shape[0], x.shape[1],
                             (x.dtype, self.qkv_a.dtype, self.g_proj.dtype))

    def _multi_applies(self, x: torch.Tensor) -> bool:
        """qkv_a and g_proj as one gemv_multi launch: kernel on, M within the per-M table."""
        if not (self.use_multi and x.shape[0] <= MAX_ROWS["gemv_multi"] and x.is_contiguous()):
            return False
        from kimi_decode.kernels.gemv_multi import can_implement
        return can_implement(x.shape[0], x.shape[1], [self.qkv_a.shape[0], self.g_proj.shape[0]],
                             (x.dtype, self.qkv_a.dtype, self.g_proj.dtype))


class LatentMoE(stock.LatentMoE):
    """Router kernel; shared expert beside the latent down-projection on the side stream;
    L2 prefetch of the next layer's weights; experts and tail as stock."""

    use_router_kernel = False
    use_router_fast = False      # kernels/router_fast.py (M ≤ 8)
    use_router_mma = False       # kernels/router_mma.py (2 ≤ M ≤ 8): logits on the tensor cores + top-k
    use_router_topk = False      # kernels/router_topk.py (2 ≤ M ≤ 8): the selection from the logits
    use_mma_situ = False         # shared down at 2 ≤ M ≤ 8 with the SiTU prologue (gemv_mma_situ)
    use_gemv = False
    use_gemv_situ = False        # shared down GEMV with the SiTU GLU prologue
    use_experts_kernel = False   # kernels/moe_experts.py
    use_experts_v2 = False       # the same with FC2 in one wave (ExpertsFC2v2, kernel experts_v2)
    use_experts_one = False      # FC1 + FC2 v2 in one persistent launch (kernels/moe_experts_one.py)
    use_up_kernel = False        # kernels/moe_up.py, collectives finished in kernels (tp_sim)
    up_grid_scratch = None       # kernels/moe_up_grid.py at 2 ≤ M ≤ 8 (made by enable())
    use_up_cluster = False       # kernels/moe_up_cluster.py in place of both (UP_CLUSTER_MIN_ROWS ≤ M ≤ 8)
    # the routing sync buffer (kernels/router_fast.py SYNC_WORDS) where FC1 takes the ids from
    # the M = 1 front's flag (moe_experts.FC1_EARLY_IDS; made by enable(), else None)
    routing_sync: torch.Tensor | None = None
    use_experts_async = False    # FC2 v2 stages its activations with cp.async (experts_v2_async)
    use_experts_rows = False     # at M ≥ 2 FC2 as a resident grid (kernels/moe_fc2_rows.py)
    use_front = False            # kernels/gemv_multi.py: router + latent_down + shared gate/up
    use_front_mma = False        # kernels/front_mma.py: the same at 2 ≤ M ≤ 8 on the tensor cores
    gather_out = False           # with use_up_kernel: return Gathered (the next layer's AttnRes
                                 # kernel reads the all-gather slots; kernel "attn_res_ag")
    prefetch_target: torch.Tensor | None = None
    # (idx, w) used instead of the router's own choice (the router still runs): lets a parity
    # check follow the stock step's expert choice through a routing near-tie (the 16th and
    # 17th scores within one bf16 rounding), which the router checks cover on their own
    forced_routing: tuple[torch.Tensor, torch.Tensor] | None = None

    def _route(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        if self.use_router_fast and y.shape[0] <= MAX_ROWS["router_fast"]:
            from kimi_decode.kernels.router_fast import route as route_fast
            return route_fast(y, self.router, self.bias, cfg.top_k, cfg.routed_scaling, self.router_counter)
        if self._router_mma_applies(y):
            from kimi_decode.kernels import router_mma as k_rm
            return k_rm.route(y, self.router, self.bias, cfg.top_k, cfg.routed_scaling, self.router_counter)
        if self.use_router_kernel and y.shape[0] <= MAX_ROWS["router_kernel"]:
            from kimi_decode.kernels.router import GEMV_MAX_ROWS, route
            # past the GEMV rows the logits come from the stock path's router GEMM
            logits = None if y.shape[0] <= GEMV_MAX_ROWS else self.k.linear(y, self.router, torch.float32)
            return route(y, self.router, self.bias, cfg.top_k, cfg.routed_scaling, self.router_counter,
                         logits=logits)
        logits = self._router_logits(y)
        if self.use_router_topk and logits.dtype == torch.float32 and logits.is_contiguous():
            # 2 ≤ M ≤ 8: the selection in one CUDA block instead of stock's Triton kernel
            from kimi_decode.kernels import router_topk as k_tk
            if k_tk.can_implement(logits.shape[0], logits.shape[1], cfg.top_k):
                return k_tk.route_logits(logits, self.bias, cfg.top_k, cfg.routed_scaling)
        return self.fx["route"](logits, self.bias, cfg.top_k, cfg.routed_scaling)

    def _router_mma_applies(self, y: torch.Tensor) -> bool:
        """router_mma (one launch: logits + top-k) at 2 ≤ M ≤ 8 where it is enabled."""
        if not (self.use_router_mma and y.shape[0] >= 2 and y.is_contiguous()):
            return False
        from kimi_decode.kernels import router_mma as k_rm
        return k_rm.can_implement(y.shape[0], y.shape[1], self.router.shape[0], self.cfg.top_k,
                                  (y.dtype, self.router.dtype))

    def _router_logits(self, y: torch.Tensor) -> torch.Tensor:
        """y @ routerᵀ in fp32: gemv_mma at 2 ≤ M ≤ 8 where it is switched on (the stock
        Triton GEMM beside it on the other stream could not start until gemv_mma's CTAs left
        the SMs: bench/fused_runs.md), else the stock path's router GEMM."""
        if self.use_gemv and "kimi_decode.kernels.gemv_mma" in sys.modules and y.is_contiguous():
            from kimi_decode.kernels import gemv_mma as k_mma
            if k_mma.enabled() and k_mma.can_implement(y.shape[0], self.router.shape[0], self.router.shape[1],
                                                       (y.dtype, self.router.dtype)):
                return k_mma.gemv_mma(y, self.router, out_dtype=torch.float32)
        if (ROUTER_CUBLAS_MIN_ROWS is not None and y.is_cuda and y.shape[0] >= ROUTER_CUBLAS_MIN_ROWS):
            return torch.mm(y, self.router.t(), out_dtype=torch.float32)               # cuBLAS, fp32 out
        return self.k.linear(y, self.router, torch.float32)                           # stock ops

    def _shared(self, y: torch.Tensor) -> torch.Tensor:
        """Shared expert partial [M, D]: gate/up GEMV, SiTU GLU, down GEMV; with the GEMV
        variant the GLU is the down GEMV's prologue (one launch fewer)."""
        return self._shared_down(_linear(y, self.shared_gate_up, self.use_gemv, self.k))

    def _shared_down(self, h: torch.Tensor) -> torch.Tensor:
        """The shared expert after its gate/up projection h [M, 2·Is]: SiTU GLU + down."""
        cfg, Is = self.cfg, self.cfg.shared_local_inter
        if self.use_gemv_situ:
            from kimi_decode.kernels.gemv import can_implement_situ, gemv_situ
            if h.is_contiguous() and can_implement_situ(h.shape[0], self.shared_down.shape[0], Is,
                                                        (h.dtype, self.shared_down.dtype)):
                return gemv_situ(h, self.shared_down, Is, cfg.situ_beta, cfg.situ_linear_beta)
        if self.use_mma_situ and h.shape[0] >= 2:
            from kimi_decode.kernels import gemv_mma as k_mma
            if h.is_contiguous() and k_mma.can_implement_situ(h.shape[0], self.shared_down.shape[0], Is,
                                                              (h.dtype, self.shared_down.dtype)):
                return k_mma.gemv_mma_situ(h, self.shared_down, Is, cfg.situ_beta, cfg.situ_linear_beta)
        sh = self.fx["situ"](h, Is, cfg.situ_beta, cfg.situ_linear_beta)
        return _linear(sh, self.shared_down, self.use_gemv, self.k)

    def _experts(self, z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                 out: torch.Tensor | None = None, ids_ready: torch.Tensor | None = None) -> torch.Tensor:
        """Σ_j w·expert_j(z): the one-launch kernel (kernels/moe_experts_one.py) where
        `experts_one` is enabled, M ≤ MAX_ROWS["experts_one"] and its shape rules hold; else
        the two-kernel CuTe path (kernels/moe_experts.py) where it applies (FC2 v2 where
        `experts_v2` is enabled and its shape rules hold, else the first FC2 where `experts`
        is enabled), else the stock op; with `out`, written there (the all-reduce slot).
        `ids_ready`: the routing sync buffer whose flag the front raised (forward passes it only
        where _early_ids_apply said this call runs the two-kernel path with FC2 v2)."""
        cfg = self.cfg
        if self.use_experts_one and z.shape[0] <= MAX_ROWS["experts_one"]:
            from kimi_decode.kernels.moe_experts_one import can_implement_one, experts_one
            inter = cfg.expert_local_inter       # zero padding skipped, as below
            if can_implement_one(z.shape[0], idx.shape[1], z.shape[1], self.w2.shape[-1], (z.dtype,), inter=inter):
                return experts_one(z, idx, w, self.w13, self.w2, cfg.situ_beta, cfg.situ_linear_beta,
                                   self.experts_counters, out=out, inter=inter)
        if self.use_experts_kernel or self.use_experts_v2:
            from kimi_decode.kernels.moe_experts import can_implement, can_implement_v2, experts
            # inter: the padded intermediate rows are zero by construction (stock.LatentMoE), so
            # the kernels skip them (a quarter of the expert bytes)
            inter = cfg.expert_local_inter
            shape = (z.shape[0], idx.shape[1], z.shape[1], self.w2.shape[-1], (z.dtype,))
            v2 = self.use_experts_v2 and can_implement_v2(*shape, inter=inter)
            if v2 or (self.use_experts_kernel and can_implement(*shape, inter=inter)):
                rows = 0
                if v2 and self.use_experts_rows:
                    from kimi_decode.kernels import moe_fc2_rows as k_rows
                    rows = k_rows.STEP_BUFFERS if k_rows.can_implement(*shape, inter=inter) else 0
                return experts(z, idx, w, self.w13, self.w2, cfg.situ_beta, cfg.situ_linear_beta, out=out,
                               inter=inter, pdl=z.shape[0] <= MAX_ROWS["experts_pdl"], v2=v2,
                               stage_async=v2 and self.use_experts_async and not rows, rows=rows,
                               ids_ready=ids_ready)
        if LARGE_M_EXPERTS:
            return self.fx["experts"](z, idx, w, self.w13, self.w2, cfg.situ_beta, cfg.situ_linear_beta,
                                      inter=cfg.expert_local_inter, fast_align=True, out=out)
        r = self.fx["experts"](z, idx, w, self.w13, self.w2, cfg.situ_beta, cfg.situ_linear_beta)
        return r if out is None else out.copy_(r)

    def forward(self, y: torch.Tensor) -> torch.Tensor | Gathered:
        cfg, comm = self.cfg, self.rt.comm
        n = cfg.row_shard
        front = self._front_applies(y)
        front_mma = not front and self._front_mma_applies(y)
        if front or front_mma:
            # router + latent down + shared gate/up: one grid streaming all three weights on the
            # main stream (kernels/gemv_multi.py at M = 1, kernels/front_mma.py at 2 ≤ M ≤ 8);
            # the shared expert's down GEMV then runs on the side stream beside the routed
            # experts, joined before the tail needs it
            if front:
                from kimi_decode.kernels.gemv_multi import route_and_project
            else:
                from kimi_decode.kernels.front_mma import route_and_project
            shared_in = FRONT_SHARED if front else FRONT_MMA_SHARED
            sync = self.routing_sync if front and self._early_ids_apply(y) else None
            with op_range("moe_front"):
                if sync is not None:     # gemv_multi's front: its top-k raises the flag FC1 starts on
                    idx, w, outs = route_and_project(y, self.router, self.bias, cfg.top_k, cfg.routed_scaling,
                                                     sync, self._front_weights(shared_in), publish_ready=True)
                else:
                    idx, w, outs = route_and_project(y, self.router, self.bias, cfg.top_k, cfg.routed_scaling,
                                                     self.router_counter, self._front_weights(shared_in))
            z = outs[0]
            if shared_in:
                with _on_side(self.rt, outs[1]), op_range("shared_expert"):
                    sh = self._shared_down(outs[1])                                    # [M, D] partial
            else:   # after the front, beside the routed experts (FRONT_SHARED's note)
                with _on_side(self.rt, y), op_range("shared_expert"):
                    sh = self._shared(y)                                               # [M, D] partial
        else:
            # latent_down then the shared expert on the side stream, the router on the main one;
            # the routed experts wait for latent_down only (its event), so the shared expert's
            # SiTU and down GEMV overlap them; the tail joins the shared expert. router_mma is
            # issued first (its 224 CTAs placed before the side stream's chained GEMVs take the
            # SMs), the side stream forked from before it
            router_first = self._router_mma_applies(y)
            fork = _fork(self.rt) if router_first else None
            if router_first:
                with op_range("router"):
                    idx, w = self._route(y)                                            # [M, K]
            defer = SHARED_AFTER_ROUTER_MMA if router_first else SHARED_AFTER_ROUTER
            with _on_side(self.rt, y, after=fork):
                with op_range("latent_down"):
                    z = _linear(y, self.down, self.use_gemv, self.k)                   # [M, L]
                z_ready = _mark(self.rt)
                if not defer:
                    with op_range("shared_expert"):
                        sh = self._shared(y)                                           # [M, D] partial
            if not router_first:
                with op_range("router"):
                    idx, w = self._route(y)                                            # [M, K]
            if defer:
                # the shared expert after the routing (beside the routed experts), so the
                # front streams only latent_down and the router's weights
                with _on_side(self.rt, y), op_range("shared_expert"):
                    sh = self._shared(y)                                               # [M, D] partial
        self.last_idx, self.last_w = idx, w
        if self.forced_routing is not None:   # parity checks only: stock's choice, see the attribute
            idx, w = self.forced_routing
        if not (front or front_mma):
            sync = None
            _wait_mark(z_ready, z)
        rank = comm.rank
        if self.use_up_kernel and self._up_applies(y):
            # the collectives finish inside kernels: experts write this rank's all-reduce slot,
            # moe_up sums the slots (r and the shared reduce-scatter), normalises, projects,
            # adds, and writes this rank's all-gather slot; one concatenation remains, unless
            # the next layer's AttnRes kernel reads the slots itself (gather_out)
            from kimi_decode.kernels.moe_up import moe_up
            r_buf = comm.ar_slots((y.shape[0], cfg.latent_dim), z)
            with op_range("experts"):
                self._experts(z, idx, w, out=r_buf[rank], ids_ready=sync)
            self._prefetch()
            _join(self.rt, sh)
            sh_buf = comm.rs_slots(tuple(sh.shape), sh)
            ag_buf = comm.ag_slots((y.shape[0], n), sh)
            up_args = (r_buf, sh_buf, sh, rank, self.latent_norm, self.up[rank * n:(rank + 1) * n], cfg.rms_eps)
            with op_range("up_proj"):
                if self._up_cluster_applies(y):   # the slot sums shared over clusters of CTAs
                    from kimi_decode.kernels.moe_up_cluster import moe_up_cluster
                    moe_up_cluster(*up_args, out=ag_buf[rank])
                elif y.shape[0] <= MAX_ROWS["moe_up"]:
                    moe_up(*up_args, out=ag_buf[rank])
                else:   # 2 ≤ M ≤ 8: the slot sums once per grid (kernels/moe_up_grid.py)
                    from kimi_decode.kernels.moe_up_grid import moe_up_grid
                    moe_up_grid(*up_args, self.up_grid_scratch, out=ag_buf[rank])
            if self.gather_out:
                return Gathered(ag_buf)
            with op_range("moe_gather"):
                return comm.gather_slots(ag_buf)
        with op_range("experts"):
            r = self._experts(z, idx, w, ids_ready=sync)
        self._prefetch()
        _join(self.rt, sh)
        with op_range("moe_tail"):
            r = comm.all_reduce(r)                                                     # [M, L]
            sh = comm.reduce_scatter_cols(sh)                                          # [M, D/tp]
        with op_range("up_proj"):
            up_rows = self.up[rank * n:(rank + 1) * n]
            if LINEAR_CUBLAS_MIN_ROWS is not None and r.shape[0] >= LINEAR_CUBLAS_MIN_ROWS:
                # stock's skinny GEMM gives this 448-row shard 14 CTAs at M = 64 (42 µs busy in
                # the bundled H200 B = 64 trace): the norm, then cuBLAS with the add fused
                normed = F.rms_norm(r, (r.shape[-1],), self.latent_norm, cfg.rms_eps)
                part = torch.addmm(sh, normed, up_rows.t())
            else:
                part = self.fx["up"](r, self.latent_norm, up_rows, sh, cfg.rms_eps)
        with op_range("moe_gather"):
            return comm.all_gather_cols(part)

    def _front_weights(self, shared: bool | None = None) -> list[torch.Tensor]:
        """The projections the one-launch front streams beside the router: latent_down, and
        the shared expert's gate/up where `shared` (default FRONT_SHARED, the M = 1 front's)."""
        return [self.down, self.shared_gate_up] if (FRONT_SHARED if shared is None else shared) else [self.down]

    def _front_mma_applies(self, y: torch.Tensor) -> bool:
        """The MoE front in one launch at 2 ≤ M ≤ 8 (front_mma): kernel on, M within the per-M
        table, shapes the kernel takes."""
        if not (self.use_front_mma and 2 <= y.shape[0] <= MAX_ROWS["front_mma"] and y.is_contiguous()):
            return False
        from kimi_decode.kernels.front_mma import can_implement
        ws = self._front_weights(FRONT_MMA_SHARED)
        return can_implement(y.shape[0], y.shape[1], self.router.shape[0], self.cfg.top_k,
                             tuple(w.shape[0] for w in ws),
                             (y.dtype, self.router.dtype, *(w.dtype for w in ws))) and self.bias.dtype == torch.float32

    def _front_applies(self, y: torch.Tensor) -> bool:
        """The MoE front in one launch (gemv_multi with the router): kernel on, M within the
        per-M table, shapes the kernel takes."""
        if not (self.use_front and y.shape[0] <= MAX_ROWS["gemv_multi"] and y.is_contiguous()):
            return False
        from kimi_decode.kernels.gemv_multi import can_implement
        ws = self._front_weights()
        return can_implement(y.shape[0], y.shape[1], [w.shape[0] for w in ws],
                             (y.dtype, self.router.dtype, *(w.dtype for w in ws)),
                             router=(self.router.shape[0], self.cfg.top_k)) and self.bias.dtype == torch.float32

    def _early_ids_apply(self, y: torch.Tensor) -> bool:
        """FC1 takes the ids from the front's flag (FC1_EARLY_IDS) on this call: the buffer
        exists (enable()), and _experts will run the two-kernel path with FC2 v2 and FC1's load
        groups at this M (the only FC1 that lowers the flag: a raised flag nobody lowers would
        let the next step's FC1 read stale ids)."""
        if self.routing_sync is None or (self.use_experts_one and y.shape[0] <= MAX_ROWS["experts_one"]):
            return False
        from kimi_decode.kernels import moe_experts as k_mx
        cfg = self.cfg
        return (self.use_experts_v2 and k_mx.fc1_group(y.shape[0]) > 0
                and k_mx.can_implement_v2(y.shape[0], cfg.top_k, cfg.latent_dim, self.w2.shape[-1], (y.dtype,),
                                          inter=cfg.expert_local_inter))

    def _up_cluster_applies(self, y: torch.Tensor) -> bool:
        """moe_up_cluster in place of moe_up / moe_up_grid: the kernel on, M ≥
        UP_CLUSTER_MIN_ROWS and the shape one it takes (1 ≤ M ≤ 8, whole clusters)."""
        if not self.use_up_cluster or y.shape[0] < UP_CLUSTER_MIN_ROWS:
            return False
        from kimi_decode.kernels.moe_up_cluster import can_implement
        return can_implement(y.shape[0], self.cfg.latent_dim, self.cfg.row_shard, self.rt.comm.world,
                             (y.dtype, self.up.dtype))

    def _up_applies(self, y: torch.Tensor) -> bool:
        """The MoE tail in one kernel: moe_up_cluster where on and it can run; else moe_up at
        M ≤ MAX_ROWS["moe_up"], moe_up_grid above it where that kernel is on (its scratch
        made by enable() for this M) and can run."""
        if self._up_cluster_applies(y):
            return True
        shape = (y.shape[0], self.cfg.latent_dim, self.cfg.row_shard, self.rt.comm.world, (y.dtype, self.up.dtype))
        if y.shape[0] <= MAX_ROWS["moe_up"]:
            from kimi_decode.kernels.moe_up import can_implement
            return can_implement(*shape)
        sc = self.up_grid_scratch
        if sc is None or sc.rbuf.shape[0] != y.shape[0]:
            return False
        from kimi_decode.kernels.moe_up_grid import can_implement as can_grid
        return can_grid(*shape)

    def _prefetch(self) -> None:
        """The L2 prefetch of the next layer's first weight, on the side stream, while the
        tail's collectives run (opt-in kernel "prefetch")."""
        if self.prefetch_target is not None:
            from kimi_decode.kernels.l2_prefetch import prefetch_l2
            with _on_side(self.rt), op_range("prefetch"):
                prefetch_l2(self.prefetch_target, PREFETCH_BYTES)
            _join(self.rt)


class DenseMLP(stock.DenseMLP):
    """Not fused yet: the stock op sequence."""


class DecoderLayer(stock.DecoderLayer):
    """One K3 layer; the prefix update and block write live inside the AttnRes kernels."""

    def forward(self, m: torch.Tensor | Gathered, prefix: torch.Tensor, blocks: torch.Tensor,
                pos: torch.Tensor) -> tuple[torch.Tensor | Gathered, torch.Tensor]:
        with layer_range(self.idx, self.kind):
            with op_range("attn_res"):
                slot = self.block_slot if self.starts_block else None
                prefix, x = self.attn_res.update_and_mix(prefix, m, blocks, self.nb_attn, False, write_slot=slot)
            a = self.attn(x, pos) if self.kind == "mla" else self.attn(x)
            with op_range("mlp_res"):
                prefix, y = self.mlp_res.update_and_mix(prefix, a, blocks, self.nb_mlp, self.starts_block)
            return self.mlp(y), prefix


FUSED_CLASS = {stock.AttnRes: AttnRes, stock.KDAAttention: KDAAttention,
               stock.MLAAttention: MLAAttention, stock.LatentMoE: LatentMoE,
               stock.DenseMLP: DenseMLP, stock.DecoderLayer: DecoderLayer}


class FusedDecoder(StockDecoder):
    """The fused step; same interface as StockDecoder (forward, make_inputs, layers, pos)."""

    def __init__(self, cfg: KimiConfig, rt: Runtime | None = None,
                 device: torch.device | str = "cpu", kernels: frozenset[str] | None = None) -> None:
        nn.Module.__init__(self)
        self._adopt(StockDecoder(cfg, rt, device), kernels)

    @classmethod
    def from_stock(cls, model: StockDecoder, kernels: frozenset[str] | None = None) -> "FusedDecoder":
        """Fused decoder over `model`'s weights (shared) with a copy of its current state."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new._adopt(model, kernels)
        return new

    def _adopt(self, model: StockDecoder, kernels: frozenset[str] | None) -> None:
        memo = {id(p): p for p in model.parameters()}
        memo[id(model.rt)] = model.rt                                    # same runtime, not a copy
        clone = copy.deepcopy(model, memo)
        for mod in clone.modules():
            if type(mod) in FUSED_CLASS:
                mod.__class__ = FUSED_CLASS[type(mod)]
        self.cfg, self.rt = clone.cfg, clone.rt
        self.layers = clone.layers
        self.register_buffer("pos", clone.pos)
        self._hoist_positions()
        self.kernels = self.enable(kernels if kernels is not None else DEFAULT_KERNELS)

    def forward(self, m: torch.Tensor, prefix: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """StockDecoder.forward, plus: a `Gathered` output of the last layer (its all-gather
        left for a next layer that is not there) is concatenated here, inside the step; the
        positions advance in place (POS_UPDATE_IN_PLACE: no memcpy node in the step graph)."""
        cfg = self.cfg
        self._apply_modes()
        with step_range():
            for layer in self.layers:
                m, prefix = layer(m, prefix, blocks, self.pos)
            if isinstance(m, Gathered):
                with op_range("moe_gather"):
                    m = m.gather()
            if any(layer.kind == "mla" for layer in self.layers):
                T = cfg.tokens_per_seq
                if POS_UPDATE_IN_PLACE:   # the same positions, no copy (no memcpy node in a graph)
                    self.pos.add_(T)
                    self.pos.masked_fill_(self.pos + T > cfg.cache_len, cfg.context_len)
                else:
                    nxt = self.pos + T
                    self.pos.copy_(torch.where(nxt + T > cfg.cache_len, cfg.context_len, nxt))
                if self.mla_last is not None:    # the next step's query positions, for every MLA layer
                    torch.add(self.pos, self.mla_t_off, out=self.mla_last)
        return m, prefix

    def _hoist_positions(self) -> None:
        """The MLA query positions pos + t_off [T] are the same in every MLA layer of a step:
        computed once per step here (right after pos advances, so the invariant mla_last ==
        pos + t_off holds between steps) instead of one add kernel in each of the 24 MLA
        layers (stock computes it per layer inside mla_decode). A plain attribute, not a
        buffer: it is derived from pos, not decode state of its own."""
        mla = [layer.attn for layer in self.layers if isinstance(layer.attn, MLAAttention)]
        self.mla_t_off = mla[0].t_off if mla else None
        self.mla_last = (self.pos + self.mla_t_off) if mla else None
        for attn in mla:
            attn.last_buf = self.mla_last

    def _apply_modes(self) -> None:
        """Set the process-wide kernel modes of this model's kernel set (gemv.TUNED tables,
        the PDL chain): at enable() and at every forward, so two fused models with different
        sets in one process (the chain's device check) each run as enabled."""
        if self._tuned or "kimi_decode.kernels.gemv" in sys.modules:
            from kimi_decode.kernels import gemv as k_gemv
            k_gemv.set_tuned(self._tuned)
        if self._chain or "kimi_decode.kernels.chain" in sys.modules:
            from kimi_decode.kernels import chain as k_chain
            k_chain.set_chain(self._chain)
        if self._mma or "kimi_decode.kernels.gemv_mma" in sys.modules:
            from kimi_decode.kernels import gemv_mma as k_mma
            k_mma.set_enabled(self._mma)
            k_mma.set_tuned(self._mma_tuned)

    def enable(self, kernels: frozenset[str]) -> frozenset[str]:
        """Switch the named kernels on where they can run (GPU, supported shapes), the rest
        off; returns the set actually enabled."""
        from kimi_decode.kernels import applicable
        dev = self.pos.device
        on = frozenset(k for k in kernels & VERIFIED if _kernels_usable(dev) and applicable(k, self.cfg))
        cfg = self.cfg
        # per-shape GEMV configurations at M = 1 (kernels/gemv.py TUNED, TUNED_MULTI): a flag of
        # the gemv module, read by gemv() and gemv_multi at each call (so it applies to every
        # model in the process; the tables hold only shapes the device sweep measured)
        self._tuned = {"gemv", "gemv_tuned"} <= on
        # the PDL chain (kernels/chain.py): likewise a process-wide flag, read when a kernel is
        # traced (and part of its compile key)
        self._chain = "pdl_chain" in on
        # the projections at 2 ≤ M ≤ 8 on the tensor cores (kernels/gemv_mma.py): a flag of
        # that module, read by _linear at each call
        self._mma = {"gemv", "gemv_mma"} <= on
        # and their per-shape (warps, unroll) from the device sweep (gemv_mma.TUNED)
        self._mma_tuned = {"gemv", "gemv_mma", "gemv_mma_tuned"} <= on
        self._apply_modes()
        # collectives finished inside kernels: only for the one-GPU simulation, whose slot
        # buffers the kernels can address (real NCCL keeps its own collectives)
        sim = bool(getattr(self.rt.comm, "simulated", False))
        ar_slots = sim and {"attn_res", "attn_res_ar"} <= on and (
            "gemv" not in on or "gemv_variants" in on)     # a GEMV writing a slot needs out=
        # all-gather finished in the next layer's AttnRes kernel (moe_up writes the slot)
        ag_slots = sim and {"attn_res", "attn_res_ag", "moe_up"} <= on
        if ag_slots:   # the buffer [world, M, n] must be the [M, D] row the kernel can address
            from kimi_decode.kernels.attn_res import can_implement as ar_can
            n_ag = cfg.row_shard
            ag_slots = self.rt.comm.world * n_ag == cfg.hidden and ar_can(
                cfg.hidden, 0, cfg.attn_res_slots, (cfg.torch_dtype, torch.float32), gather=n_ag)
        for i, layer in enumerate(self.layers):
            for res in (layer.attn_res, layer.mlp_res):
                res.use_kernel = "attn_res" in on
                res.use_slots = ar_slots
                res.use_gather = ag_slots
                res.use_mc = {"attn_res", "attn_res_mc"} <= on
            if isinstance(layer.attn, KDAAttention):
                multi = "kda_multi" in on and _kda_multi_applies(cfg)
                layer.attn.use_kda_multi = multi
                layer.attn.use_kernel = multi or (bool({"kda", "kda_split", "kda_fast"} & on)
                                                  and cfg.rows <= MAX_ROWS["kda"])
                layer.attn.split_scratch = None
                layer.attn.use_fast = ("kda_fast" in on and layer.attn.use_kernel
                                       and cfg.batch == 1 and cfg.tokens_per_seq == 1)
                if ("kda_split" in on and layer.attn.use_kernel) or layer.attn.use_fast or multi:
                    from kimi_decode.kernels.kda_decode import KDAConfig
                    from kimi_decode.kernels.kda_split import make_scratch
                    kcfg = KDAConfig(cfg.kda_local_heads, cfg.kda_head_dim, cfg.tokens_per_seq,
                                     cfg.in_proj_rows, cfg.gate_lower_bound, 1e-6, cfg.rms_eps)
                    layer.attn.split_scratch = make_scratch(kcfg, cfg.batch, dev)
            if isinstance(layer.attn, MLAAttention):
                layer.attn.use_glue = "mla_glue" in on
                layer.attn.attend_scratch = None
                layer.attn.attend_uv = False
                layer.attn.mma_scratch = _mla_mma_scratch(cfg, on, dev)
                if "mla_attend" in on and layer.attn.mma_scratch is None:
                    from kimi_decode.kernels import mla_attend as k_mla
                    T, H = cfg.tokens_per_seq, cfg.mla_local_heads
                    # one launch where it beats stock's tensor-core bmm (few query rows)
                    if cfg.batch * T * H <= MAX_ROWS["mla_attend_rows"] and k_mla.can_implement(
                            H, T, cfg.kv_lora_rank, cfg.qk_rope_dim, (cfg.torch_dtype,)):
                        layer.attn.attend_scratch = k_mla.make_scratch(cfg.batch, T * H, cfg.cache_len,
                                                                       cfg.kv_lora_rank, dev)
                    # uv_gate inside mla_attend's launch (its W_UV tiles run by the first CTAs)
                    sc = layer.attn.attend_scratch
                    layer.attn.attend_uv = bool("mla_attend_uv" in on and sc is not None and k_mla.can_implement_uv(
                        cfg.batch, H, T, cfg.kv_lora_rank, cfg.qk_rope_dim, cfg.v_head_dim, sc.splits,
                        (cfg.torch_dtype,)))
                if layer.attn.mma_scratch is not None and "mla_attend_uv" in on:
                    from kimi_decode.kernels import mla_attend_mma as k_mma
                    from kimi_decode.kernels._common import sm_count
                    layer.attn.attend_uv = k_mma.can_implement_uv(
                        cfg.batch, cfg.mla_local_heads, cfg.tokens_per_seq, cfg.kv_lora_rank, cfg.qk_rope_dim,
                        cfg.v_head_dim, layer.attn.mma_scratch.splits, (cfg.torch_dtype,), sm_count(dev),
                        layer.attn.mma_scratch.groups)
            if isinstance(layer.attn, MLAAttention):
                layer.attn.use_multi = "gemv_multi" in on
                layer.attn.use_pair = "gemv_mma_pair" in on
                layer.attn.use_fold = {"mla_norm_fold", "mla_glue", "gemv"} <= on
                layer.attn.use_fold_mma = {"mla_norm_fold_mma", "mla_glue"} <= on
                # gemv_mma_pair.SIGNAL (an A/B, off): the pair and q_b share two counter words
                layer.attn.pair_counter = None
                if layer.attn.use_pair and layer.attn.use_fold_mma:
                    from kimi_decode.kernels import gemv_mma_pair as k_pair
                    if k_pair.SIGNAL:
                        layer.attn.pair_counter = k_pair.pair_counter(dev)
            if isinstance(layer.attn, (KDAAttention, MLAAttention)):
                layer.attn.use_gemv = "gemv" in on
                layer.attn.ar_slots = ar_slots
            if isinstance(layer.mlp, LatentMoE):
                layer.mlp.use_router_kernel = "router" in on
                layer.mlp.use_router_fast = "router_fast" in on
                layer.mlp.use_gemv = "gemv" in on
                layer.mlp.use_gemv_situ = {"gemv", "gemv_variants"} <= on
                layer.mlp.use_router_mma = "router_mma" in on
                layer.mlp.use_router_topk = "router_topk" in on
                layer.mlp.use_mma_situ = "gemv_mma_situ" in on
                layer.mlp.use_experts_kernel = "experts" in on
                layer.mlp.use_experts_v2 = "experts_v2" in on
                layer.mlp.use_experts_async = "experts_v2_async" in on
                layer.mlp.use_experts_rows = "experts_rows" in on
                layer.mlp.use_experts_one = "experts_one" in on
                if "experts_one" in on and not hasattr(layer.mlp, "experts_counters"):
                    # ticket / completion / exit counters of the one-launch experts; it re-zeroes them
                    from kimi_decode.kernels.moe_experts_one import make_counters
                    layer.mlp.register_buffer("experts_counters", make_counters(dev))
                layer.mlp.use_front = "gemv_multi" in on
                layer.mlp.use_front_mma = "front_mma" in on
                layer.mlp.routing_sync = None
                if layer.mlp.use_front and layer.mlp.use_experts_v2 and cfg.rows <= MAX_ROWS["gemv_multi"]:
                    from kimi_decode.kernels import moe_experts as k_mx
                    from kimi_decode.kernels.router_fast import SYNC_WORDS
                    if k_mx.FC1_EARLY_IDS:    # a plain attribute: scratch, not decode state
                        layer.mlp.routing_sync = torch.zeros(SYNC_WORDS, dtype=torch.int32, device=dev)
                layer.mlp.use_up_kernel = sim and "moe_up" in on
                layer.mlp.up_grid_scratch = None
                layer.mlp.use_up_cluster = layer.mlp.use_up_kernel and "moe_up_cluster" in on
                if layer.mlp.use_up_kernel and "moe_up_grid" in on and cfg.rows > MAX_ROWS["moe_up"]:
                    from kimi_decode.kernels import moe_up_grid as k_upg
                    if k_upg.can_implement(cfg.rows, cfg.latent_dim, cfg.row_shard, self.rt.comm.world,
                                           (cfg.torch_dtype, cfg.torch_dtype)):
                        layer.mlp.up_grid_scratch = k_upg.make_scratch(cfg.rows, cfg.latent_dim, dev)
                # every layer hands its slots on, the last one too: its all-gather is the
                # step's output, concatenated by forward in the step's range outside the layer
                # ranges (as the module docstring says). Why: the bench's slice (layers 4-7)
                # ends on an MLA layer, and a gather inside L7's range counted a kernel and its
                # launch that 23 of K3's 24 MLA layers (followed by a KDA layer's AttnRes,
                # which reads the slots) do not run; bench/decode.py's in-step figures already
                # left it out (run_layers gathers after the last layer)
                layer.mlp.gather_out = ag_slots
                if ({"router", "router_fast", "gemv_multi", "router_mma", "front_mma"} & on) and not hasattr(layer.mlp, "router_counter"):
                    # grid-completion counter of the one-kernel router; the kernel re-zeroes it.
                    # With front_mma's TAIL_SPLIT (an A/B) it also holds the split tiles' counters
                    # and halves (front_mma.split_counter_words)
                    words = 1
                    if "front_mma" in on:
                        from kimi_decode.kernels import front_mma as k_fm
                        words = k_fm.split_counter_words(k_fm.MAX_TAIL) if k_fm.TAIL_SPLIT else 1
                    layer.mlp.register_buffer("router_counter", torch.zeros(words, dtype=torch.int32, device=dev))
                nxt = self.layers[i + 1].attn if i + 1 < len(self.layers) else None
                target = None
                if "prefetch" in on and nxt is not None:
                    target = nxt.in_proj if isinstance(nxt, stock.KDAAttention) else nxt.qkv_a
                # a plain tensor view (a Parameter here would be registered as a second weight)
                layer.mlp.prefetch_target = None if target is None else target.detach()
        return on
