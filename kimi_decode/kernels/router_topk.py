"""The router's selection alone, from fp32 logits, for 2 ≤ M ≤ 8 (kernel "router_topk"):
sigmoid + correction-bias top-k + renormalise in one CTA, replacing stock's Triton routing
kernel after gemv_mma's logits.

Why: in the B = 1, k = 7 and B = 8 steps the MoE front's critical path is the router:
gemv_mma's fp32 logits (16 µs beside latent_down and the shared gate/up on the other stream),
then stock's Triton routing kernel, 10.6-12.1 µs for 8 rows of 896 scores in the 7a5884e
traces (8.1-8.4 µs in the stock step, alone on the GPU), while latent_down ends ~4 µs before
it. router_mma put the selection into the logits grid's last CTA (2-3 µs for the top-k from
shared memory) but its grid, issued first, slowed latent_down (kernels/router_mma.py); here
the logits stay gemv_mma's and only the selection changes.

Math: router_fast's selection, unchanged (RouterFast.topk_row, module docstring there):
    s = σ(logits), key = s + bias; ids = top-k by key, descending (ties → lower index);
    w = s[ids] / Σ_j s[ids_j] · routed_scaling (j in output order); all fp32.
Layout: M CTAs of one warp, CTA r for row r (as Triton's kernel: one program per row, so
the rows run on M SMs). Before the chain's wait the warp copies the bias (a weight: no kernel
of the step writes it) into shared memory; after the wait the row's E logits (all loads
independent: one L2 round trip), then topk_row. ~9 KB of shared memory per CTA.
The first build ran the M rows as the 8 warps of one CTA (~50 KB of shared memory): 6.5 µs
alone at M = 8 (stock's op 26.1 in the same check, eager), but 21.3 µs in the step beside the
side stream's GEMVs (f8ea401 trace), twice stock's Triton kernel there.

PDL chain (kernels/chain.py): launched with PDL when the chain is on, it waits but never
releases: FC1 (next on the stream) starts when this kernel has completed, as after stock's
routing kernel (released early, FC1's waiting CTAs would take SMs the other stream's GEMVs
still need: router_mma's finding, bench/fused_runs.md).

Check on the GPU (against stock's routing op on the same logits, router_fast on the same
activations and the float64 reference; times this kernel and stock's op on warm logits):
    python -m kimi_decode.kernels.router_topk
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
from kimi_decode.kernels import router_fast as rf
from kimi_decode.kernels._common import compile_options, compiled, current_stream, dummy_ptr, ptr

MIN_ROWS, MAX_ROWS = 2, 8    # M = 1 keeps router_fast (GEMV + top-k in one launch); 8: verified
# Launched with PDL when the chain is on (its CTAs become resident under the logits and wait).
# False: launched as a plain kernel after the logits complete; an A/B switch (`--patch`) for
# the late start in the M = 8 KDA layers: measured 1.3-1.8 us slower per M = 8 KDA layer
# (bench/fused_runs.md, session 14), so PDL stays.
USE_PDL = True


@dataclass(frozen=True)
class RouterTopKConfig:
    """Compile-time sizes: experts E, top_k, rows M (2..8), routed scaling."""

    experts: int
    top_k: int
    rows: int
    scaling: float = 1.0
    pdl: bool = True      # USE_PDL when route_logits built it


def can_implement(m: int, experts: int, top_k: int) -> bool:
    """2 ≤ M ≤ 8, router_fast's selection limits (E a multiple of 32 up to 2048, 1 ≤ k ≤ 32,
    k ≤ E)."""
    return (MIN_ROWS <= m <= MAX_ROWS and experts % 32 == 0 and 1 <= experts // 32 <= 64
            and 1 <= top_k <= 32 and top_k <= experts)


class RouterTopK:
    """See the module docstring."""

    def __init__(self, cfg: RouterTopKConfig) -> None:
        self.cfg = cfg
        # router_fast's selection (topk_row, one warp per row); its GEMV is not used, so its
        # hidden size does not matter
        self.sel = rf.RouterFast(rf.RouterFastConfig(0, cfg.experts, cfg.top_k, cfg.rows, cfg.scaling))

    @cute.jit
    def __call__(self, logits: cute.Pointer, bias: cute.Pointer, ids: cute.Pointer, weights: cute.Pointer,
                 stream: cuda.CUstream):
        E, K, m = self.cfg.experts, self.cfg.top_k, self.cfg.rows
        mL = cute.make_tensor(logits, cute.make_layout((m, E), stride=(E, 1)))
        mB = cute.make_tensor(bias, cute.make_layout(E))
        mI = cute.make_tensor(ids, cute.make_layout((m, K), stride=(K, 1)))
        mO = cute.make_tensor(weights, cute.make_layout((m, K), stride=(K, 1)))
        self.kernel(mL, mB, mI, mO).launch(grid=[m, 1, 1], block=[32, 1, 1], stream=stream,
                                           use_pdl=self.cfg.pdl and chain.chain_on())

    @cute.kernel
    def kernel(self, mL: cute.Tensor, mB: cute.Tensor, mI: cute.Tensor, mO: cute.Tensor):
        E, m = self.cfg.experts, self.cfg.rows
        row, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = Int32(0)                                 # topk_row's buffer index: one warp per CTA
        smem = cutlass.memory.SmemAllocator()
        cK = smem.allocate_tensor(Float32, cute.make_layout((1, rf.CAP), stride=(rf.CAP, 1)), 16)
        cI = smem.allocate_tensor(Int32, cute.make_layout((1, rf.CAP), stride=(rf.CAP, 1)), 16)
        selI = smem.allocate_tensor(Int32, cute.make_layout((1, 32), stride=(32, 1)), 16)
        selS = smem.allocate_tensor(Float32, cute.make_layout((1, 32), stride=(32, 1)), 16)
        # this row's logits: an [M, E] view with row stride 0 (topk_row indexes it by `row`)
        sL = smem.allocate_tensor(Float32, cute.make_layout((m, E), stride=(0, 1)), 16)
        sB = smem.allocate_tensor(Float32, cute.make_layout(E), 16)
        for i in cutlass.range_constexpr(E // 32):      # before the wait (E % 32 == 0)
            sB[lane + i * 32] = mB[lane + i * 32]
        # the logits are the previous kernel's output: after the wait (no release, see above)
        chain.wait()
        for i in cutlass.range_constexpr(E // 32):
            sL[row, lane + i * 32] = mL[row, lane + i * 32]
        cute.arch.sync_warp()
        self.sel.topk_row(sL, sB, mI, mO, cK, cI, selI, selS, row, warp, lane)


def compile_for(cfg: RouterTopKConfig) -> object:
    """The compiled kernel for `cfg` (cached per configuration and chain mode)."""
    def build() -> object:
        f32 = dummy_ptr(torch.float32)
        return cute.compile(RouterTopK(cfg), f32, f32, dummy_ptr(torch.int64), f32, current_stream(),
                            options=compile_options())
    return compiled(("router_topk", cfg), build)


def route_logits(logits: torch.Tensor, bias: torch.Tensor, top_k: int,
                 scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """stock_ops.route's contract for 2 ≤ M ≤ 8: logits [M, E] fp32 (contiguous), bias [E]
    fp32. Returns (ids [M, k] int64, weights [M, k] fp32), ordered by biased score,
    descending."""
    m, e = logits.shape
    if (not can_implement(m, e, top_k) or logits.dtype != torch.float32 or not logits.is_contiguous()
            or bias.dtype != torch.float32 or bias.numel() != e):
        raise ValueError(f"router_topk cannot run M={m} E={e} k={top_k} ({logits.dtype}, bias {bias.dtype})")
    ids = torch.empty(m, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(m, top_k, dtype=torch.float32, device=logits.device)
    compile_for(RouterTopKConfig(e, top_k, m, float(scaling), USE_PDL))(ptr(logits), ptr(bias), ptr(ids), ptr(weights),
                                                              current_stream())
    return ids, weights


def check(timing: bool = True, rows: tuple[int, ...] = (2, 4, 8)) -> list[dict]:
    """On the H200, per M, on K3's router (seeded weights, RMS-normed activations): ids and
    weights against stock's routing op on the same fp32 logits (gemv_mma's, as the step feeds
    both) and against the float64 reference: every row whose 16th and 17th float64 keys are
    not within 1e-5 (a near-tie, counted) has the same expert set, the weights of equal rows
    agree within 1e-3 (1e-6 against stock's op on the same logits); reported besides:
    router_fast on the same activations; repeat bit-equal; router.route's dtypes and shapes,
    ids in descending key order. Timing (CUDA-graph replays, warm logits): kernel_us vs
    stock_op_us (stock's routing op)."""
    from kimi_decode import stock_ops
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels import gemv_mma as gm
    from kimi_decode.kernels.checks import DEVICE, _sync, router_weights, time_us
    from kimi_decode.kernels.router import reference
    cfg = k3_tp16()
    dev = torch.device(DEVICE)
    ops = stock_ops.OpSet(cfg)
    w_gate, bias = router_weights(cfg, dev, "check.router_topk")
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    K, sc = cfg.top_k, cfg.routed_scaling
    out = []
    for m in rows:
        y = torch.randn(m, cfg.hidden, generator=torch.Generator(device=dev).manual_seed(200 + m), device=dev)
        y = torch.nn.functional.rms_norm(y, (cfg.hidden,)).bfloat16()
        with torch.no_grad():
            logits = gm.gemv_mma(y, w_gate, out_dtype=torch.float32)
            ids_s, w_s = ops.route(logits, bias, K, sc)
            ids_k, w_k = route_logits(logits, bias, K, sc)
            ids_k2, w_k2 = route_logits(logits, bias, K, sc)
            ids_f, w_f = rf.route(y, w_gate, bias, K, sc, counter)
        _sync()
        ids_r, w_r, key_r = reference(y.cpu(), w_gate.cpu(), bias.cpu(), K, sc)
        agree, werr = rf.agreement(ids_k, w_k, ids_s, w_s)
        agree_r, werr_r = rf.agreement(ids_k, w_k, ids_r.to(dev), w_r.to(dev))
        agree_f, werr_f = rf.agreement(ids_k, w_k, ids_f, w_f)
        r = {"kernel": "router_topk", "M": m, "rows_same_as_stock_op": agree, "max_weight_err_vs_stock_op": werr,
             "rows_same_experts_f64": agree_r, "max_weight_err_f64": werr_r,
             "rows_same_as_router_fast": agree_f, "max_weight_err_vs_router_fast": werr_f,
             **rf.selection_facts(ids_k, w_k, ids_k2, w_k2, key_r, K)}
        floor = 1.0 - r["near_ties_f64"] / m - 1e-9       # every row but a near-tie agrees
        r["ok"] = bool(agree >= floor and werr <= 1e-6 and agree_r >= floor and werr_r <= 1e-3
                       and r["repeat_equal"] and r["dropin_types"] and r["descending"])
        if timing:
            r["stock_op_us"] = time_us(lambda: ops.route(logits, bias, K, sc))
            r["kernel_us"] = time_us(lambda: route_logits(logits, bias, K, sc))
        out.append(r)
    return out


if __name__ == "__main__":
    for row in check():
        print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
