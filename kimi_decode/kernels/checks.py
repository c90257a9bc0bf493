"""GPU checks of each kernel against the stock path's own module (and a float64 statement of
the formula), plus timings of both; the `__main__` of every kernel module calls one of these,
and bench/fused_device.py calls them all.

Tolerances (bf16 outputs; the stock path rounds the same intermediates to bf16):
- a bf16 result: relative L2 error against stock ≤ 1e-2, and against the float64 statement no
  worse than stock's own error × 1.5 + 1e-3 (bf16 rounding alone gives ~1e-3 relative);
- fp32 state (KDA recurrent state): relative L2 error against stock ≤ 1e-3;
- values stock stores exactly (prefix' in bf16, conv history): equal;
- routing: the chosen expert sets equal stock's on ≥ 99% of rows (a near-tie at the k-th
  score may flip under a different fp32 summation order), weights within 1e-3 where equal.
Timings: CUDA-graph replays of 20 back-to-back calls (no CPU launch cost), median of 20.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from kimi_decode.comm import LocalComm, SideStream
from kimi_decode.config import k3_tp16
from kimi_decode.kernels import CHECK_MODULES
from kimi_decode.weights import Seeder


DEVICE = "cuda"  # the CPU smoke test of this harness sets "cpu" (with emulated kernels)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of a against b."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def time_us(fn: Callable[[], Any], calls: int = 20, reps: int = 20) -> float:
    """Median GPU time of one call, from CUDA-graph replays of `calls` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return replay_us(g, reps, calls)


def replay_us(g: torch.cuda.CUDAGraph, reps: int, calls: int = 1, discard: int = 0) -> float:
    """Median µs per call over `reps` replays of graph `g` holding `calls` calls, one event
    pair around each replay (after `discard` replays not counted). Shared by time_us,
    chain_check and bench/stream_bw.py."""
    times = []
    for _ in range(reps + discard):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times[discard:])


def check_attn_res(rows: tuple[int, ...] = (1, 8, 64, 512), nbs: tuple[int, ...] = (1, 8),
                   timing: bool = True) -> list[dict]:
    """Kernel vs stock AttnRes (prefix add, block write, mix, RMSNorm) at K3 width."""
    from kimi_decode.fused import AttnRes as FusedAttnRes
    from kimi_decode.fused import _restate
    from kimi_decode.kernels.attn_res import reference
    from kimi_decode.stock import AttnRes
    cfg = k3_tp16()
    dev = torch.device(DEVICE)
    mod = AttnRes(cfg, Seeder(cfg, dev).sub("check.attn_res"))
    fused = _restate(mod, FusedAttnRes)
    fused.use_kernel = True
    out = []
    for m in rows:
        for nb in nbs:
            for write in (False, True):
                gen = torch.Generator(device=dev).manual_seed(m * 100 + nb)
                blocks = torch.randn(m, 8, cfg.hidden, generator=gen, device=dev).bfloat16()
                prefix = torch.randn(m, cfg.hidden, generator=gen, device=dev).bfloat16()
                delta = torch.randn(m, cfg.hidden, generator=gen, device=dev).bfloat16()
                slot = nb if write and nb < 8 else None
                b_s, b_k = blocks.clone(), blocks.clone()
                with torch.no_grad():
                    p_s = prefix + delta
                    if slot is not None:
                        b_s[:, slot].copy_(p_s)
                    x_s = mod(p_s, b_s, nb)
                    p_k, x_k = fused.update_and_mix(prefix, delta, b_k, nb, False, write_slot=slot)
                _sync()
                ref = reference(blocks, nb, prefix, mod.w, mod.norm, cfg.rms_eps, delta)
                e_ks, e_k, e_s = rel(x_k, x_s), rel(x_k, ref), rel(x_s, ref)
                ok = (e_ks <= 1e-2 and e_k <= 1.5 * e_s + 1e-3 and torch.equal(p_k, p_s)
                      and torch.equal(b_k, b_s))
                r = {"kernel": "attn_res", "M": m, "nb": nb, "write": slot is not None,
                     "rel_vs_stock": e_ks, "rel_vs_f64": e_k, "stock_rel_vs_f64": e_s, "ok": ok}
                if timing and not write:
                    def stock_call() -> None:
                        mod(prefix + delta, b_s, nb)
                    r["stock_us"] = time_us(stock_call)
                    r["kernel_us"] = time_us(lambda: fused.update_and_mix(prefix, delta, b_k, nb, False))
                out.append(r)
    return out


def router_weights(cfg: object, dev: torch.device, tag: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The router checks' K3 router: W_gate [E, D] bf16 (scale D^-1/2) and the correction bias
    [E] fp32, seeded by `tag` (check_router, router_fast, router_mma, router_topk)."""
    seed = Seeder(cfg, dev).sub(tag)
    w_gate = seed.replicated("gate", (cfg.num_experts, cfg.hidden), cfg.hidden ** -0.5).bfloat16()
    return w_gate, seed.replicated("bias", (cfg.num_experts,), 0.02)


def stock_router(cfg: object, w_gate: torch.Tensor, bias: torch.Tensor
                 ) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The stock path's router as the fused LatentMoE falls back to it (eager ops): the router
    GEMM with fp32 output, then the routing op. The router checks time their kernels against
    it (a plain function: the fused module's methods need a whole LatentMoE)."""
    from kimi_decode import stock_ops
    ops = stock_ops.OpSet(cfg)
    return lambda y: stock_ops.route(ops.linear(y, w_gate, torch.float32), bias, cfg.top_k, cfg.routed_scaling)


def check_router(rows: tuple[int, ...] = (1, 8, 64, 512), timing: bool = True) -> list[dict]:
    """Kernel vs the stock routing op (stock_ops.route) on the same fp32 logits (the stock
    skinny GEMM's output; for M > 16 the fused path hands the kernel exactly those logits)."""
    from kimi_decode import stock_ops
    from kimi_decode.kernels.router import GEMV_MAX_ROWS, route
    cfg = k3_tp16()
    dev = torch.device(DEVICE)
    w_gate, bias = router_weights(cfg, dev, "check.router")
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    stock_route = stock_router(cfg, w_gate, bias)
    ops = stock_ops.OpSet(cfg)
    out = []
    for m in rows:
        y = torch.randn(m, cfg.hidden, generator=torch.Generator(device=dev).manual_seed(m), device=dev)
        y = torch.nn.functional.rms_norm(y, (cfg.hidden,)).bfloat16()
        logits = torch.mm(y.float(), w_gate.float().t())                               # fp32
        given = None if m <= GEMV_MAX_ROWS else logits
        with torch.no_grad():
            ids_s, w_s = stock_ops.route(logits, bias, cfg.top_k, cfg.routed_scaling)
            ids_k, w_k = route(y, w_gate, bias, cfg.top_k, cfg.routed_scaling, counter, logits=given)
        _sync()
        same = (ids_k.sort(-1).values == ids_s.sort(-1).values).all(-1)
        dense_s = torch.zeros(m, cfg.num_experts, device=dev).scatter_(1, ids_s, w_s)
        dense_k = torch.zeros(m, cfg.num_experts, device=dev).scatter_(1, ids_k, w_k)
        werr = float((dense_k - dense_s)[same].abs().max()) if bool(same.any()) else 0.0
        agree = float(same.float().mean())
        r = {"kernel": "router", "M": m, "mode": "gemv+topk" if given is None else "topk",
             "rows_same_experts": agree, "max_weight_err": werr, "counter_zero": int(counter.item()) == 0,
             "ok": agree >= 0.99 and werr <= 1e-3 and int(counter.item()) == 0}
        if timing:  # stock: router GEMM + routing ops (eager torch); kernel: one launch (+ GEMM above 16)
            r["stock_us"] = time_us(lambda: stock_route(y))
            r["kernel_us"] = time_us(lambda: route(y, w_gate, bias, cfg.top_k, cfg.routed_scaling, counter,
                                                   logits=None if m <= GEMV_MAX_ROWS else ops.linear(y, w_gate, torch.float32)))
        out.append(r)
    return out


def check_kda(batches: tuple[int, ...] = (1, 8, 64), spec: tuple[int, ...] = (0, 7),
              timing: bool = True) -> list[dict]:
    """Kernel path of KDAAttention vs the stock module: output, conv and recurrent state."""
    from kimi_decode.fused import KDAAttention as FusedKDA
    from kimi_decode.fused import _restate
    from kimi_decode.stock import KDAAttention, Runtime
    dev = torch.device(DEVICE)
    out = []
    for b in batches:
        for k in spec:
            cfg = k3_tp16(batch=b, spec_tokens=k)
            rt = Runtime(LocalComm(), SideStream(dev))
            mod = KDAAttention(cfg, Seeder(cfg, dev).sub("check.kda"), rt)
            fused = _restate(mod, FusedKDA)
            fused.use_kernel = True
            errs = {"out": 0.0, "rec_state": 0.0}
            conv_equal = True
            for step in range(3):
                gen = torch.Generator(device=dev).manual_seed(step)
                x = torch.nn.functional.rms_norm(torch.randn(cfg.rows, cfg.hidden, generator=gen, device=dev),
                                                 (cfg.hidden,)).bfloat16()
                with torch.no_grad():
                    o_s, o_k = mod(x), fused(x)
                _sync()
                errs["out"] = max(errs["out"], rel(o_k, o_s))
                errs["rec_state"] = max(errs["rec_state"], rel(fused.rec_state, mod.rec_state))
                conv_equal &= torch.equal(fused.conv_state, mod.conv_state)
            r = {"kernel": "kda", "B": b, "k": k, "rel_out": errs["out"], "rel_rec_state": errs["rec_state"],
                 "conv_state_equal": conv_equal,
                 "ok": errs["out"] <= 1e-2 and errs["rec_state"] <= 1e-3 and conv_equal}
            if timing:
                x = torch.randn(cfg.rows, cfg.hidden, device=dev).bfloat16()
                r["stock_us"] = time_us(lambda: mod(x))
                r["kernel_us"] = time_us(lambda: fused(x))
            out.append(r)
            del mod, fused
    return out


GEMV_SHAPES = {"in_proj": (3216, 7168), "o_proj": (7168, 768), "qkv_a": (2112, 7168),
               "g_proj": (768, 7168), "q_b": (1152, 1536), "latent_down": (3584, 7168),
               "shared_gate_up": (768, 7168)}


def check_gemv(rows: tuple[int, ...] = (1,), timing: bool = True,
               shapes: dict[str, tuple[int, int]] | None = None) -> list[dict]:
    """Kernel vs torch's x @ wᵀ (the stock projection op) on the K3 TP16 projection shapes."""
    from kimi_decode.kernels.gemv import gemv
    dev = torch.device(DEVICE)
    out = []
    for name, (n, k) in (shapes or GEMV_SHAPES).items():
        gen = torch.Generator(device=dev).manual_seed(n + k)
        w = (torch.randn(n, k, generator=gen, device=dev) * k ** -0.5).bfloat16()
        for m in rows:
            x = torch.randn(m, k, generator=gen, device=dev).bfloat16()
            with torch.no_grad():
                y_s, y_k = x @ w.t(), gemv(x, w)
            _sync()
            ref = x.double() @ w.double().t()
            e_ks, e_k, e_s = rel(y_k, y_s), rel(y_k, ref), rel(y_s, ref)
            r = {"kernel": "gemv", "op": name, "M": m, "N": n, "K": k, "rel_vs_stock": e_ks,
                 "rel_vs_f64": e_k, "stock_rel_vs_f64": e_s, "ok": e_ks <= 1e-2 and e_k <= 1.5 * e_s + 1e-3}
            if timing:
                r["stock_us"] = time_us(lambda: x @ w.t())
                r["kernel_us"] = time_us(lambda: gemv(x, w))
                r["kernel_tbs"] = n * k * 2 / (r["kernel_us"] * 1e-6) / 1e12
            out.append(r)
    return out


def check_prefetch(timing: bool = True) -> list[dict]:
    """A bf16 GEMV over the KDA in_proj weight [3216, 7168] from HBM (L2 flushed) vs after a
    prefetch of its first 24 MB; the kernel must run and the GEMV result must not change."""
    from kimi_decode.kernels.l2_prefetch import prefetch_l2
    dev = torch.device(DEVICE)
    w = torch.randn(3216, 7168, device=dev).bfloat16()
    x = torch.randn(1, 7168, device=dev).bfloat16()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    ref = x @ w.t()

    def timed(pre: bool) -> float:
        ts = []
        for _ in range(20):
            flush.add_(1)
            if pre:
                prefetch_l2(w, 24 << 20)
                torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            x @ w.t()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
        return statistics.median(ts)

    prefetch_l2(w, 24 << 20)
    _sync()
    r = {"kernel": "prefetch", "ok": torch.equal(x @ w.t(), ref)}
    if timing:
        r.update(gemv_cold_us=timed(False), gemv_after_prefetch_us=timed(True),
                 prefetch_kernel_us=time_us(lambda: prefetch_l2(w, 24 << 20)))
    return [r]


def _module_check(name: str) -> Callable[..., list[dict]]:
    """The GPU check of a second-round kernel: `check(timing)` of its module (imported late:
    a module that fails to import fails only its own check)."""
    def run(timing: bool = True) -> list[dict]:
        import importlib

        from kimi_decode.kernels import CHECK_MODULES
        mod = importlib.import_module(f"kimi_decode.kernels.{CHECK_MODULES[name]}")
        fn = getattr(mod, {"attn_res_ar": "check_ar", "attn_res_ag": "check_ag", "gemv_variants": "check_variants",
                           "mla_attend_uv": "check_uv", "experts_v2": "check_v2",
                           "gemv_tuned": "check_sweep", "experts_v2_async": "check_async",
                           "gemv_mma_situ": "check_situ", "mla_attend_mma": "check_all",
                           "mla_norm_fold_mma": "check_mma", "gemv_mma_tuned": "check_sweep"}.get(name, "check"))
        return fn(timing=timing)
    return run


CHECKS = {"attn_res": check_attn_res, "router": check_router, "kda": check_kda,
          "gemv": check_gemv, "prefetch": check_prefetch,
          **{name: _module_check(name) for name in CHECK_MODULES}}


def _print(rows: list[dict]) -> None:
    for r in rows:
        print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()})


def main_attn_res() -> None:
    _print(check_attn_res())


def main_router() -> None:
    _print(check_router())


def main_kda() -> None:
    _print(check_kda())


def main_gemv() -> None:
    _print(check_gemv())


def main_prefetch() -> None:
    _print(check_prefetch())
