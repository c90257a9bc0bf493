"""Device check of kernel "pdl_chain" (kernels/chain.py): the chain changes scheduling only, so
the fused step with it must equal the fused step without it bit for bit.

At B = 1, k = 0 (every chained kernel runs: AttnRes on a cluster, the GEMVs and both fronts,
kda_fast, the experts, moe_up, q_b's norm GEMV, mla_attend's early release) and k = 7 (the
experts at M = 8; the other ops there are stock's or not chained): three steps from the same
weights and state, the chained step run eagerly and as CUDA-graph replays (the bench's mode:
PDL edges inside a graph), outputs, block writes and every state buffer torch.equal to the
unchained step. Timed (timing=True): each layer of the B = 1 step as CUDA-graph replays without
the chain and with it at several pre-wait prefetch budgets (0: PDL only), median of 50,
interleaved; `stock_us` is the unchained layer, `kernel_us` the chained one at the default
budget.

    python -m kimi_decode.kernels.chain_check
"""
from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

LAYERS = (4, 5, 6, 7)
# prefetch budgets timed (the first device run timed 0 / 8 / 16 / 32 MB: chain.DEFAULT_BUDGET)
BUDGETS = (0, 8 << 20)


def _layer_us(run: Callable[[], object], reps: int = 50) -> float:
    """Median µs of CUDA-graph replays of `run` (one layer), cold-ish as in bench/decode.py."""
    from kimi_decode.kernels.checks import replay_us
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        run()
    us = replay_us(g, reps)
    del g
    return us


def _same(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    eq = torch.equal(a, b)
    return eq, 0.0 if eq else float((a.float() - b.float()).abs().max())


def _parity(k: int) -> tuple[list[dict], object, object, tuple]:
    import kimi_decode.fused as fused
    from kimi_decode.config import k3_tp16
    from kimi_decode.runner import build

    cfg = k3_tp16(batch=1, spec_tokens=k, layers=LAYERS, tp_sim=True, compile_ops=False)
    stock, _ = build("stock", cfg, "cuda")
    base = fused.DEFAULT_KERNELS - {"pdl_chain"}
    chained = base | {"pdl_chain"}
    ref = fused.FusedDecoder.from_stock(stock, base)
    eager_c = fused.FusedDecoder.from_stock(stock, chained)
    graph_c = fused.FusedDecoder.from_stock(stock, chained)
    assert "pdl_chain" in eager_c.kernels and "pdl_chain" not in ref.kernels, (ref.kernels, eager_c.kernels)
    m0, p0, b0 = stock.make_inputs(seed=100)
    warm = fused.FusedDecoder.from_stock(stock, chained)     # compiles the chained kernels before capture
    with torch.no_grad():
        warm(m0.clone(), p0.clone(), b0.clone())
    torch.cuda.synchronize()
    del warm
    static = (m0.clone(), p0.clone(), b0.clone())
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        g_out = graph_c(*static)
    ref._apply_modes()
    rows = []
    worst = {"eager": (True, 0.0), "graph": (True, 0.0)}
    for s in range(3):
        m, p, b = stock.make_inputs(seed=100 + s)
        b_ref, b_e = b.clone(), b.clone()
        with torch.no_grad():
            o_ref = [t.clone() for t in ref(m, p, b_ref)]
            o_e = [t.clone() for t in eager_c(m, p, b_e)]
            for dst, src in zip(static, (m, p, b)):
                dst.copy_(src)
            g.replay()
            torch.cuda.synchronize()
        for mode, outs, blk in (("eager", o_e, b_e), ("graph", g_out, static[2])):
            for x, y in ((outs[0], o_ref[0]), (outs[1], o_ref[1]), (blk, b_ref)):
                eq, d = _same(x, y)
                worst[mode] = (worst[mode][0] and eq, max(worst[mode][1], d))
    bufs = {"eager": dict(eager_c.named_buffers()), "graph": dict(graph_c.named_buffers())}
    for mode in ("eager", "graph"):
        n_bufs = 0
        for name, buf in ref.named_buffers():
            eq, d = _same(bufs[mode][name], buf)
            n_bufs += 1
            worst[mode] = (worst[mode][0] and eq, max(worst[mode][1], d))
        rows.append({"kernel": "pdl_chain", "B": 1, "k": k, "mode": mode, "steps": 3, "buffers": n_bufs,
                     "max_abs_diff": worst[mode][1], "ok": worst[mode][0]})
    del g, graph_c, eager_c
    return rows, ref, stock, (m0, p0, b0)


def _timed(ref: object, stock: object, inputs: tuple) -> list[dict]:
    import kimi_decode.fused as fused
    from kimi_decode.kernels import chain

    chained = fused.FusedDecoder.from_stock(stock, ref.kernels | {"pdl_chain"})
    m, p, b = inputs
    res: dict[str, dict[str, list[float]]] = {}
    for rnd in range(2):                          # interleaved: off, then each budget, twice
        for lr, lc in zip(ref.layers, chained.layers):
            name = f"L{lr.idx}.{lr.kind}"
            r = res.setdefault(name, {})
            ref._apply_modes()
            r.setdefault("off", []).append(_layer_us(lambda: lr(m, p, b, ref.pos)))
            for budget in BUDGETS:
                chain.set_chain(True, budget)
                r.setdefault(str(budget), []).append(_layer_us(lambda: lc(m, p, b, chained.pos)))
    chain.set_chain(False, chain.DEFAULT_BUDGET)
    rows = []
    for name, r in res.items():
        row = {"kernel": "pdl_chain", "op": name, "B": 1, "k": 0, "ok": True,
               "stock_us": statistics.median(r["off"]), "kernel_us": statistics.median(r[str(chain.DEFAULT_BUDGET)])}
        for budget in BUDGETS:
            row[f"budget_{budget >> 20}MB_us"] = statistics.median(r[str(budget)])
        rows.append(row)
    return rows


def check(timing: bool = True) -> list[dict]:
    """See the module docstring. Enables "pdl_chain" for its own models whatever fused.VERIFIED
    says (it is the kernel under test) and leaves the chain off."""
    import kimi_decode.fused as fused
    from kimi_decode.kernels import chain

    saved = fused.VERIFIED
    fused.VERIFIED = saved | {"pdl_chain"}
    rows: list[dict] = []
    try:
        for k in (0, 7):
            r, ref, stock, inputs = _parity(k)
            rows += r
            if timing and k == 0:
                rows += _timed(ref, stock, inputs)
            del ref, stock
            torch.cuda.empty_cache()
    finally:
        fused.VERIFIED = saved
        chain.set_chain(False, chain.DEFAULT_BUDGET)
    return rows


if __name__ == "__main__":
    for row in check():
        print(row)
