"""Several decode GEMVs that read the same input, in one launch; optionally with the MoE
router (fp32 logits + top-k) in front: the MoE block's "front" (KIMI_K3.md §1.6: router,
latent down-projection and shared-expert gate/up all read y) and MLA's qkv_a + g_proj.

Why: at M = 1 each of these is a weight stream (router 12.8 MB, latent_down 51.4 MB, shared
gate_up 11 MB; qkv_a 30.3 MB, g_proj 11 MB), and as separate kernels on two streams they do
not share the memory system well. In the fused B = 1 step on the H200 (traces/k3_fused_b1_k0,
layer 6) latent_down + shared expert ran 34 us on the side stream and the router's CTAs could
not start until latent_down's had drained: 39.8 us from latent_down's start to the router's end
for 80 MB, i.e. 2 TB/s. One grid over all the rows streams 75 MB at the GEMV's rate (in_proj
alone: 4.6 TB/s), ~17 us, and the router's top-k is hidden behind the projection CTAs.
Measured (bench/fused_correctness.md, H200, cold weights): 22.4 us vs 35.6 us for the separate
kernels; 24-25 us in the step (traces/k3_fused_b1_k0_graph.json.gz): 3.0-3.4 TB/s, the rate the
plain GEMV reaches on cold weights (4.6 TB/s was an L2-warm figure).

Layout: grid = [router CTAs] + [segment 0 CTAs] + [segment 1 CTAs] (+ [segment 2 CTAs]), 256
threads each. CTA b < E/2 (router, optional) is exactly router_fast's CTA (RouterFast.gemv_cta:
2 experts per CTA, each over 4 warps, fp32 logits to a scratch row) followed by its grid
completion over the router CTAs only (RouterFast.complete: the last router CTA to bump the
counter runs the top-k and re-zeroes the counter). The CTAs after it are gemv.py's plain
kernel, one warp per output column (Gemv.column), segment by segment, each writing its own
bf16 output. The block scheduler hands out CTAs in index order, so the short router CTAs
(28 KB of weight each) run first and the top-k runs while the projection CTAs (115 KB each)
still stream; nothing waits for it inside this kernel.

Math: bit-identical to the separate kernels it replaces (the same traced code per CTA):
router_fast.route(y, w_gate, ...) for (ids, weights) and gemv(y, w_i) for each output, so the
fused step's numbers do not change, only its launches (check() asserts torch.equal on all).

Registers: with the router the launch asks for 4 CTAs per SM (≤ 64 registers, router_fast's
setting), so 528 CTAs are resident: the 448 router CTAs and the first projection CTAs start
together, the rest take the router CTAs' slots within ~2 us; every SM keeps 4 × 8 warps × 4
× 512 B = 64 KB of weight loads in flight (3.9 TB/s × ~1 us / 132 SMs needs ~30 KB).

Tuning (kernel "gemv_tuned", gemv.py): MultiConfig.per_warp / warps / hint / unroll are
gemv.py's plain-layout fields, applied to every segment (8 warps per CTA with the router);
gemv_multi and route_and_project take them as `tune=` or from gemv.TUNED_MULTI at M = 1 while
the kernel is enabled. Bit-identical for every entry (split-K is not offered here).

Check on the GPU (against router_fast + gemv and the stock ops; times all three):
    python -m kimi_decode.kernels.gemv_multi
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from kimi_decode.kernels import chain
from kimi_decode.kernels import gemv as kg
from kimi_decode.kernels import router_fast as rf
from kimi_decode.kernels._common import compile_options, compiled, current_stream, dummy_ptr, ptr
from kimi_decode.kernels.gemv import GEMV_UNROLL, SPLITK_MIN_ROWS, VEC, WARPS, Gemv, GemvConfig

MAX_SEGMENTS = 3
MAX_ROWS = 8          # what the kernel compiles for; the per-M table (fused.MAX_ROWS) uses M = 1
# PDL chain, weights before the wait (both off by default; read by _config, so part of the
# compile key through MultiConfig; `bench/fused_device.py --patch` A/Bs them). Why: the CTAs
# resident when the kernel is released (all 448 router CTAs and the first 80 projection CTAs
# of the MoE front at 4 per SM; all 360 of the MLA front) wait with HBM idle while mlp_res /
# the AttnRes run (~4 us at B = 1). Measured, kept off (H100, d65a12f, bench/fused_runs.md
# session 20): at B = 1 ROUTER_PRE_WAIT took the layers to 103.4-103.7 / 118.0 us (KDA / MLA;
# two default runs 102.0-102.5 / 116.2-116.6), with PRE_WAIT_ROUNDS = 1 as well to
# 103.9-104.4 / 117.1: in the graph traces mlp_res (attn_res_mc, whose few
# slot loads are latency-bound) ended 3.0 us later behind the W_gate stream while the front
# ended only 1.8 us sooner after it.
# ROUTER_PRE_WAIT: the router CTAs issue their 7 W_gate loads per lane (12.8 MB in all) before
# the wait (router_fast.gemv_cta's enter_after_loads), y after it.
ROUTER_PRE_WAIT = False
# PRE_WAIT_ROUNDS: the projection warps load their first ROUNDS x unroll weight slices before
# the wait (gemv.column_preloaded); 0: none.
PRE_WAIT_ROUNDS = 0


@dataclass(frozen=True)
class MultiConfig:
    """Compile-time sizes: reduction K (shared by all), rows M, the output columns of each bf16
    segment, and the router (RouterFastConfig with hidden = K and rows = M) or None."""

    k: int
    rows: int
    segs: tuple[int, ...]
    router: rf.RouterFastConfig | None = None
    unroll: int = GEMV_UNROLL      # the projection loop's weight loads in flight per lane (gemv.py)
    # gemv.py's plain-layout tuning (kernel "gemv_tuned"): output columns per warp, warps per
    # CTA (8 with the router: its CTAs are 256 threads), L1 policy of the weight loads
    per_warp: int = 1
    warps: int = WARPS
    hint: str = ""
    # PDL chain: projection slices per lane loaded before the wait (gemv.column_preloaded), and
    # the router CTAs' weights before it (ROUTER_PRE_WAIT)
    peel: int = 0
    router_pre: bool = False


def can_implement(m: int, k: int, ns: Sequence[int], dtypes: tuple[torch.dtype, ...],
                  router: tuple[int, int] | None = None) -> bool:
    """1-3 segments of K a multiple of 256 (gemv.py's 128-bit path), M ≤ MAX_ROWS, bf16;
    router = (experts, top_k): router_fast's own shape rules on K."""
    ok = (1 <= m <= MAX_ROWS and 1 <= len(ns) <= MAX_SEGMENTS and all(n >= 1 for n in ns)
          and k >= 1 and k % (VEC * 32) == 0 and all(d == torch.bfloat16 for d in dtypes))
    if ok and router is not None:
        ok = rf.can_implement(k, router[0], router[1], dtypes)
    return ok


class GemvMulti:
    """See the module docstring."""

    def __init__(self, cfg: MultiConfig) -> None:
        assert 1 <= len(cfg.segs) <= MAX_SEGMENTS, cfg
        self.cfg = cfg
        self.gemvs = [Gemv(GemvConfig(n, cfg.k, cfg.rows, unroll=cfg.unroll, per_warp=cfg.per_warp,
                                      warps=cfg.warps, hint=cfg.hint)) for n in cfg.segs]
        self.ctas = [g.ctas for g in self.gemvs]
        pf = chain.row_prefetch_bytes(cfg.k * 2, sum(cfg.segs))   # PDL chain: one budget for all
        for g in self.gemvs:
            g.pf = pf
            g.plain_peel = cfg.peel if chain.chain_on() and cfg.per_warp == 1 else 0
        assert cfg.router is None or cfg.warps == WARPS, cfg
        self.router = None
        self.rctas = 0
        if cfg.router is not None:
            assert cfg.router.hidden == cfg.k and cfg.router.rows == cfg.rows, cfg
            self.router = rf.RouterFast(cfg.router)
            self.rctas = cfg.router.experts // rf.EPC

    @cute.jit
    def __call__(self, x: cute.Pointer, w0: cute.Pointer, o0: cute.Pointer, w1: cute.Pointer,
                 o1: cute.Pointer, w2: cute.Pointer, o2: cute.Pointer, w_gate: cute.Pointer,
                 bias: cute.Pointer, logits: cute.Pointer, counter: cute.Pointer, ids: cute.Pointer,
                 weights: cute.Pointer, stream: cuda.CUstream):
        k, m = self.cfg.k, self.cfg.rows
        mX = cute.make_tensor(x, cute.make_layout((m, k // VEC, VEC), stride=(k, VEC, 1)))
        ns = list(self.cfg.segs) + [1] * (MAX_SEGMENTS - len(self.cfg.segs))   # unused: never read
        mW0 = cute.make_tensor(w0, cute.make_layout((ns[0], k // VEC, VEC), stride=(k, VEC, 1)))
        mW1 = cute.make_tensor(w1, cute.make_layout((ns[1], k // VEC, VEC), stride=(k, VEC, 1)))
        mW2 = cute.make_tensor(w2, cute.make_layout((ns[2], k // VEC, VEC), stride=(k, VEC, 1)))
        mO0 = cute.make_tensor(o0, cute.make_layout((m, ns[0]), stride=(ns[0], 1)))
        mO1 = cute.make_tensor(o1, cute.make_layout((m, ns[1]), stride=(ns[1], 1)))
        mO2 = cute.make_tensor(o2, cute.make_layout((m, ns[2]), stride=(ns[2], 1)))
        e = self.cfg.router.experts if cutlass.const_expr(self.router is not None) else 32
        tk = self.cfg.router.top_k if cutlass.const_expr(self.router is not None) else 1
        mG = cute.make_tensor(w_gate, cute.make_layout((e, k // VEC, VEC), stride=(k, VEC, 1)))
        mB = cute.make_tensor(bias, cute.make_layout(e))
        mL = cute.make_tensor(logits, cute.make_layout((m, e), stride=(e, 1)))
        nc = rf.SYNC_WORDS if cutlass.const_expr(self.router is not None and self.cfg.router.publish_ready) else 1
        mC = cute.make_tensor(counter, cute.make_layout(nc))
        mI = cute.make_tensor(ids, cute.make_layout((m, tk), stride=(tk, 1)))
        mR = cute.make_tensor(weights, cute.make_layout((m, tk), stride=(tk, 1)))
        grid = self.rctas + sum(self.ctas)
        if cutlass.const_expr(self.router is not None):
            self.kernel(mX, mW0, mO0, mW1, mO1, mW2, mO2, mG, mB, mL, mC, mI, mR).launch(
                grid=[grid, 1, 1], block=[WARPS * 32, 1, 1], stream=stream,
                min_blocks_per_mp=rf.MIN_CTAS, preferred_smem_carveout=rf.SMEM_CARVEOUT,
                use_pdl=chain.chain_on())
        else:
            self.kernel(mX, mW0, mO0, mW1, mO1, mW2, mO2, mG, mB, mL, mC, mI, mR).launch(
                grid=[grid, 1, 1], block=[self.cfg.warps * 32, 1, 1], stream=stream,
                use_pdl=chain.chain_on())

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW0: cute.Tensor, mO0: cute.Tensor, mW1: cute.Tensor,
               mO1: cute.Tensor, mW2: cute.Tensor, mO2: cute.Tensor, mG: cute.Tensor,
               mB: cute.Tensor, mL: cute.Tensor, mC: cute.Tensor, mI: cute.Tensor, mR: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()          # all lanes, top level (a full-warp shuffle)
        lane = cute.arch.lane_idx()
        if cutlass.const_expr(self.router is not None):
            red, flag, cK, cI, selI, selS, sL, sB = self.router.smem_tensors()
            if bidx < self.rctas:                                   # CTA-uniform
                if cutlass.const_expr(self.cfg.router_pre and chain.chain_on()):
                    # PDL chain: W_gate loads issued first, the wait after them (gemv_cta)
                    self.router.gemv_cta(mX, mG, mL, red, bidx, tidx, warp, lane, True)
                else:
                    chain.enter()      # PDL chain (the segments' CTAs enter in warp_columns)
                    self.router.gemv_cta(mX, mG, mL, red, bidx, tidx, warp, lane, False)
                self.router.complete(mL, mB, mC, mI, mR, flag, cK, cI, selI, selS, sL, sB,
                                     Int32(self.rctas), Int32(self.cfg.rows), tidx, warp, lane)
            else:
                self.segments(mX, mW0, mO0, mW1, mO1, mW2, mO2, bidx - self.rctas, warp, lane)
        else:
            self.segments(mX, mW0, mO0, mW1, mO1, mW2, mO2, bidx, warp, lane)

    @cute.jit
    def segments(self, mX: cute.Tensor, mW0: cute.Tensor, mO0: cute.Tensor, mW1: cute.Tensor,
                 mO1: cute.Tensor, mW2: cute.Tensor, mO2: cute.Tensor, b: Int32, warp: Int32,
                 lane: Int32):
        """Projection CTA b (counted from the first segment): one warp per output column (or
        per_warp columns) of the segment b falls in (CTA-uniform branches)."""
        c0 = self.ctas[0]
        W = self.cfg.warps
        if cutlass.const_expr(len(self.gemvs) == 1):
            self.gemvs[0].warp_columns(mX, mW0, mO0, b * W + warp, lane)
        else:
            if b < c0:
                self.gemvs[0].warp_columns(mX, mW0, mO0, b * W + warp, lane)
            else:
                if cutlass.const_expr(len(self.gemvs) == 2):
                    self.gemvs[1].warp_columns(mX, mW1, mO1, (b - c0) * W + warp, lane)
                else:
                    c1 = self.ctas[1]
                    if b < c0 + c1:
                        self.gemvs[1].warp_columns(mX, mW1, mO1, (b - c0) * W + warp, lane)
                    else:
                        self.gemvs[2].warp_columns(mX, mW2, mO2, (b - c0 - c1) * W + warp, lane)


def compile_for(cfg: MultiConfig) -> object:
    """The compiled kernel for `cfg` (cached)."""
    def build() -> object:
        bf, f32 = dummy_ptr(torch.bfloat16), dummy_ptr(torch.float32)
        i32, i64 = dummy_ptr(torch.int32), dummy_ptr(torch.int64)
        return cute.compile(GemvMulti(cfg), bf, bf, bf, bf, bf, bf, bf, bf, f32, f32, i32, i64, f32,
                            current_stream(), options=compile_options())
    return compiled(("gemv_multi", cfg), build)


def _launch(cfg: MultiConfig, x: torch.Tensor, ws: Sequence[torch.Tensor], outs: list[torch.Tensor],
            router: tuple[torch.Tensor, ...] | None) -> None:
    pw = [ptr(w) for w in ws] + [ptr(x)] * (MAX_SEGMENTS - len(ws))      # unused segments: never read
    po = [ptr(o) for o in outs] + [ptr(x)] * (MAX_SEGMENTS - len(outs))
    if router is None:
        f32 = torch.empty(16, dtype=torch.float32, device=x.device)       # never touched
        rp = [ptr(x), ptr(f32), ptr(f32), ptr(torch.empty(4, dtype=torch.int32, device=x.device)),
              ptr(torch.empty(2, dtype=torch.int64, device=x.device)), ptr(f32)]
    else:
        rp = [ptr(t) for t in router]
    compile_for(cfg)(ptr(x), pw[0], po[0], pw[1], po[1], pw[2], po[2], *rp, current_stream())


def _check_operands(x: torch.Tensor, ws: Sequence[torch.Tensor], router: tuple[int, int] | None) -> None:
    m, k = x.shape
    if (any(w.dim() != 2 or w.shape[1] != k or not w.is_contiguous() for w in ws) or not x.is_contiguous()
            or not can_implement(m, k, [w.shape[0] for w in ws], (x.dtype, *(w.dtype for w in ws)), router)):
        raise ValueError(f"gemv_multi cannot run x {tuple(x.shape)} with weights "
                         f"{[tuple(w.shape) for w in ws]} router={router}")


def _config(k: int, m: int, segs: tuple[int, ...], rcfg: rf.RouterFastConfig | None, unroll: int,
            tune: dict[str, object] | None) -> MultiConfig:
    """MultiConfig with gemv.py's tuning: `tune` when given, else TUNED_MULTI[(K, segs,
    router?)] at M = 1 while kernel "gemv_tuned" is on, else the plain layout with `unroll`."""
    if tune is None and m == 1 and kg.tuned_on():
        tune = kg.TUNED_MULTI.get((k, segs, rcfg is not None))
    f = kg.tune_fields(tune, k)
    if f.get("cols"):
        raise ValueError(f"gemv_multi runs the plain layout only, not the split-K config {tune}")
    cfg = MultiConfig(k, m, segs, rcfg, **{"unroll": unroll, **f})
    if chain.chain_on():
        slices = k // (VEC * 32)
        cfg = replace(cfg, peel=min(PRE_WAIT_ROUNDS * cfg.unroll, slices) if cfg.per_warp == 1 else 0,
                      router_pre=ROUTER_PRE_WAIT and rcfg is not None)
    return cfg


def gemv_multi(x: torch.Tensor, ws: Sequence[torch.Tensor], *, unroll: int = GEMV_UNROLL,
               tune: dict[str, object] | None = None) -> list[torch.Tensor]:
    """[x @ w.t() for w in ws] (each [M, N_i] bf16) in one launch on the current stream;
    x [M, K] and every w [N_i, K] contiguous bf16, 1-3 weights. Equals gemv(x, w) bit for bit
    (for every `tune`, gemv.py's TUNE_CONFIGS entries)."""
    _check_operands(x, ws, None)
    m, k = x.shape
    outs = [torch.empty(m, w.shape[0], dtype=torch.bfloat16, device=x.device) for w in ws]
    _launch(_config(k, m, tuple(w.shape[0] for w in ws), None, unroll, tune), x, ws, outs, None)
    return outs


def route_and_project(y: torch.Tensor, w_gate: torch.Tensor, bias: torch.Tensor, top_k: int,
                      scaling: float, counter: torch.Tensor, ws: Sequence[torch.Tensor], *,
                      unroll: int = GEMV_UNROLL, tune: dict[str, object] | None = None,
                      publish_ready: bool = False) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """router_fast.route(y, w_gate, bias, top_k, scaling, counter) and [y @ w.t() for w in ws]
    in one launch: (ids [M, k] int64, weights [M, k] fp32, outputs). counter: the zeroed int32
    [1] buffer router_fast uses (left zeroed). Bit-identical to the separate kernels.
    `publish_ready`: counter is a routing sync buffer (router_fast.SYNC_WORDS, zeroed) and the
    top-k raises its ids-ready flag for FC1 (moe_experts.experts' `ids_ready`), which lowers it."""
    e = w_gate.shape[0]
    _check_operands(y, [w_gate, *ws], (e, top_k))
    if bias.dtype != torch.float32 or bias.numel() != e or len(ws) > MAX_SEGMENTS:
        raise ValueError(f"gemv_multi router: bias must be fp32 [{e}], at most {MAX_SEGMENTS} projections")
    if publish_ready and (counter.dtype != torch.int32 or counter.numel() < rf.SYNC_WORDS
                          or not counter.is_contiguous()):
        raise ValueError(f"gemv_multi publish_ready: counter must be a contiguous int32 [{rf.SYNC_WORDS}] "
                         f"routing sync buffer, got {counter.dtype} {tuple(counter.shape)}")
    m, k = y.shape
    dev = y.device
    outs = [torch.empty(m, w.shape[0], dtype=torch.bfloat16, device=dev) for w in ws]
    logits = torch.empty(m, e, dtype=torch.float32, device=dev)
    ids = torch.empty(m, top_k, dtype=torch.int64, device=dev)
    weights = torch.empty(m, top_k, dtype=torch.float32, device=dev)
    rcfg = rf.RouterFastConfig(k, e, top_k, m, float(scaling), publish_ready=publish_ready)
    _launch(_config(k, m, tuple(w.shape[0] for w in ws), rcfg, unroll, tune), y, ws, outs,
            (w_gate, bias, logits, counter, ids, weights))
    return ids, weights, outs


def check(timing: bool = True, rows: tuple[int, ...] = (1, 8)) -> list[dict]:
    """On K3 TP16 shapes: the MoE front (router + latent_down + shared gate_up) equals
    router_fast.route (ids, weights: bit for bit at every M) and, at M = 1, gemv + gemv bit for
    bit, and leaves the counter at 0; the MLA front (qkv_a + g_proj) equals two gemv calls bit
    for bit at M = 1; every output within bf16 tolerance of torch's matmul (the stock op) and
    the float64 product (at M ≥ 2 gemv() is split-K: another summation order). Times the
    one launch against the separate kernels and the stock ops (CUDA-graph replays)."""
    from kimi_decode import stock_ops
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels import checks
    from kimi_decode.kernels.gemv import gemv
    dev = torch.device(checks.DEVICE)
    cfg = k3_tp16()
    D = cfg.hidden
    out = []
    for m in rows:
        gen = torch.Generator(device=dev).manual_seed(2000 + m)

        def w(n: int) -> torch.Tensor:
            return (torch.randn(n, D, generator=gen, device=dev) * D ** -0.5).bfloat16()

        y = torch.nn.functional.rms_norm(torch.randn(m, D, generator=gen, device=dev), (D,)).bfloat16()
        w_gate, down, gate_up = w(cfg.num_experts), w(cfg.latent_dim), w(2 * cfg.shared_local_inter)
        bias = torch.randn(cfg.num_experts, generator=gen, device=dev) * 0.02
        qkv_a, g_proj = w(cfg.qkv_a_rows), w(cfg.mla_local_heads * cfg.v_head_dim)
        counter = torch.zeros(1, dtype=torch.int32, device=dev)
        counter_sep = torch.zeros(1, dtype=torch.int32, device=dev)
        with torch.no_grad():
            ids_k, wt_k, (z_k, h_k) = route_and_project(y, w_gate, bias, cfg.top_k, cfg.routed_scaling,
                                                        counter, [down, gate_up])
            ids_s, wt_s = rf.route(y, w_gate, bias, cfg.top_k, cfg.routed_scaling, counter_sep)
            z_s, h_s = gemv(y, down), gemv(y, gate_up)
            a_k, g_k = gemv_multi(y, [qkv_a, g_proj])
            a_s, g_s = gemv(y, qkv_a), gemv(y, g_proj)
            logits = torch.mm(y.float(), w_gate.float().t())
            ids_t, wt_t = stock_ops.route(logits, bias, cfg.top_k, cfg.routed_scaling)
        checks._sync()
        same_t = bool((ids_k.sort(-1).values == ids_t.sort(-1).values).all())
        r = {"kernel": "gemv_multi", "case": "moe_front", "M": m,
             "ids_equal_router_fast": torch.equal(ids_k, ids_s), "weights_equal_router_fast": torch.equal(wt_k, wt_s),
             "z_equal_gemv": torch.equal(z_k, z_s), "h_equal_gemv": torch.equal(h_k, h_s),
             "experts_same_as_stock": same_t, "counter_zero": int(counter.item()) == 0,
             "rel_z_vs_stock": checks.rel(z_k, y @ down.t()), "rel_z_vs_f64": checks.rel(z_k, y.double() @ down.double().t()),
             "stock_rel_z_vs_f64": checks.rel(y @ down.t(), y.double() @ down.double().t())}
        # bit-equality with gemv() holds where gemv() runs the same one-warp-per-column layout
        # (M = 1); from M = 2 gemv() switches to split-K (another fp32 summation order), so
        # there the outputs are held to bf16 tolerance against torch and float64 instead
        exact = m < SPLITK_MIN_ROWS
        r["ok"] = bool(r["ids_equal_router_fast"] and r["weights_equal_router_fast"] and r["counter_zero"]
                       and r["rel_z_vs_stock"] <= 1e-2 and r["rel_z_vs_f64"] <= 1.5 * r["stock_rel_z_vs_f64"] + 1e-3
                       and checks.rel(h_k, y @ gate_up.t()) <= 1e-2
                       and (not exact or (r["z_equal_gemv"] and r["h_equal_gemv"])))
        q = {"kernel": "gemv_multi", "case": "mla_front", "M": m,
             "qkv_a_equal_gemv": torch.equal(a_k, a_s), "g_equal_gemv": torch.equal(g_k, g_s),
             "rel_vs_stock": checks.rel(a_k, y @ qkv_a.t()), "rel_g_vs_stock": checks.rel(g_k, y @ g_proj.t())}
        q["ok"] = bool(q["rel_vs_stock"] <= 1e-2 and q["rel_g_vs_stock"] <= 1e-2
                       and (not exact or (q["qkv_a_equal_gemv"] and q["g_equal_gemv"])))
        if timing:
            # cold weights, as in the step (each read once per layer): the timed calls cycle
            # through 3 copies of the three weights (225 MB, beyond the 50 MB L2)
            sets = [(w_gate, down, gate_up)] + [(w_gate.clone(), down.clone(), gate_up.clone()) for _ in range(2)]
            for u in (4, 8):
                cyc = itertools.cycle(sets)

                def front(u: int = u) -> object:
                    g_, d_, s_ = next(cyc)
                    return route_and_project(y, g_, bias, cfg.top_k, cfg.routed_scaling, counter, [d_, s_], unroll=u)
                r[f"kernel_unroll{u}_us"] = checks.time_us(front)
            cyc = itertools.cycle(sets)

            def separate() -> object:
                g_, d_, s_ = next(cyc)
                return rf.route(y, g_, bias, cfg.top_k, cfg.routed_scaling, counter_sep), gemv(y, d_), gemv(y, s_)
            r["separate_us"] = checks.time_us(separate)
            r["kernel_us"] = r[f"kernel_unroll{GEMV_UNROLL}_us"]
            ops = stock_ops.OpSet(cfg)           # the stock path's router GEMM, routing, GEMMs
            r["stock_us"] = checks.time_us(lambda: (stock_ops.route(ops.linear(y, w_gate, torch.float32), bias,
                                                                    cfg.top_k, cfg.routed_scaling),
                                                    ops.linear(y, down), ops.linear(y, gate_up)))
            r["kernel_tbs"] = (w_gate.numel() + down.numel() + gate_up.numel()) * 2 / (r["kernel_us"] * 1e-6) / 1e12
            r["counter_zero_after_replays"] = int(counter.item()) == 0
            r["ok"] = r["ok"] and r["counter_zero_after_replays"]
            msets = [(qkv_a, g_proj)] + [(qkv_a.clone(), g_proj.clone()) for _ in range(4)]
            for u in (4, 8):
                cyc = itertools.cycle(msets)
                q[f"kernel_unroll{u}_us"] = checks.time_us(lambda u=u: gemv_multi(y, list(next(cyc)), unroll=u))
            cyc = itertools.cycle(msets)

            def separate_mla() -> object:
                a_, g_ = next(cyc)
                return gemv(y, a_), gemv(y, g_)
            q["separate_us"] = checks.time_us(separate_mla)
            q["kernel_us"] = q[f"kernel_unroll{GEMV_UNROLL}_us"]
            q["stock_us"] = checks.time_us(lambda: (y @ qkv_a.t(), y @ g_proj.t()))
        out += [r, q]
    return out


if __name__ == "__main__":
    from kimi_decode.kernels.checks import _print
    _print(check())
