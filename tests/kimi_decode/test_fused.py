"""The fused decoder on the CPU: its own layer flow (prefix update inside AttnRes, side-stream
MoE order, the router fallback) must reproduce the stock step exactly when no kernel can run.

Oracle: the stock decoder from the same seeded weights and state, run side by side. With every
kernel off, fused issues the same float32 ops in the same order, so outputs, the AttnRes
blocks and every decode-state buffer must be bit-identical (tolerance 0): any slip in the
re-expressed flow (a missed block write, the prefix not reset at a block start, a wrong
routing weight) shows up as a difference. The kernels themselves are checked on the GPU
(kimi_decode/kernels/checks.py, bench/fused_correctness.md); here their float64 statements
are checked against the stock modules they replace.
"""
from __future__ import annotations

import pytest
import torch

from kimi_decode.config import tiny
from kimi_decode.fused import FusedDecoder
from kimi_decode.stock import AttnRes, StockDecoder
from kimi_decode.variants import variant_class
from kimi_decode.weights import Seeder


def run_side_by_side(cfg, steps: int) -> None:
    stock = StockDecoder(cfg)
    fused = FusedDecoder.from_stock(stock)
    assert fused.kernels == frozenset()                     # CPU: everything falls back
    for s in range(steps):
        m, prefix, blocks = stock.make_inputs(seed=40 + s)
        blocks_f = blocks.clone()
        with torch.no_grad():
            out_s = stock(m, prefix, blocks)
            out_f = fused(m, prefix, blocks_f)
        for a, b in zip(out_s, out_f):
            assert torch.equal(a, b)
        assert torch.equal(blocks, blocks_f)
    bufs_s, bufs_f = dict(stock.named_buffers()), dict(fused.named_buffers())
    assert bufs_s.keys() == bufs_f.keys()
    for name, buf in bufs_s.items():
        assert torch.equal(buf, bufs_f[name]), name


@pytest.mark.parametrize("batch,k", [(1, 0), (2, 0), (2, 7)])
def test_fused_matches_stock_exactly_on_cpu(batch: int, k: int) -> None:
    """Layers 3..8 of tiny: KDA, MLA (3, 7) and two block starts (4, 8); state over 3 steps."""
    run_side_by_side(tiny(layers=(3, 4, 5, 6, 7, 8), batch=batch, spec_tokens=k), steps=3)


def test_dense_layer_zero_and_embedding_start() -> None:
    run_side_by_side(tiny(layers=(0, 1, 2), batch=2), steps=2)


def test_from_stock_shares_weights_and_copies_state() -> None:
    stock = StockDecoder(tiny(layers=(2, 3), batch=1))
    fused = FusedDecoder.from_stock(stock)
    ps, pf = dict(stock.named_parameters()), dict(fused.named_parameters())
    assert ps.keys() == pf.keys()
    assert all(ps[n] is pf[n] for n in ps)
    for name, buf in fused.named_buffers():
        other = dict(stock.named_buffers())[name]
        assert buf.data_ptr() != other.data_ptr() and torch.equal(buf, other)
    assert [type(a.attn).__name__ for a in fused.layers] == [type(a.attn).__name__ for a in stock.layers]


def test_registered_as_variant() -> None:
    assert variant_class("fused") is FusedDecoder


def test_attn_res_kernel_formula_matches_stock() -> None:
    """kernels/attn_res.reference (what the kernel computes: <v, w>/rms(v) scores, prefix'
    rounded to its dtype) equals the stock AttnRes module after `prefix + delta`."""
    from kimi_decode.kernels.attn_res import reference
    cfg = tiny(hidden=256)
    mod = AttnRes(cfg, Seeder(cfg, torch.device("cpu")).sub("t"))
    gen = torch.Generator().manual_seed(3)
    for nb in (0, 1, 5):
        blocks = torch.randn(4, 8, 256, generator=gen)
        prefix, delta = torch.randn(4, 256, generator=gen), torch.randn(4, 256, generator=gen)
        want = mod(prefix + delta, blocks, nb).double()
        got = reference(blocks, nb, prefix, mod.w, mod.norm, cfg.rms_eps, delta)
        assert float((got - want).norm() / want.norm()) < 1e-5


def test_router_kernel_formula_against_brute_force() -> None:
    """kernels/router.reference (biased selection, unbiased renormalised weights) against a
    per-row Python sort of the same float64 scores."""
    from kimi_decode.kernels.router import reference
    gen = torch.Generator().manual_seed(5)
    y, w = torch.randn(6, 64, generator=gen), torch.randn(40, 64, generator=gen) * 0.125
    bias = torch.randn(40, generator=gen) * 0.02
    ids, weights, _ = reference(y, w, bias, 5, 2.5, logits_bf16=False)
    s = torch.sigmoid(y.double() @ w.double().t())
    for m in range(6):
        order = sorted(range(40), key=lambda e: -(float(s[m, e]) + float(bias[e])))[:5]
        assert sorted(ids[m].tolist()) == sorted(order)
        tot = sum(float(s[m, e]) for e in order)
        for j, e in enumerate(ids[m].tolist()):
            assert abs(float(weights[m, j]) - 2.5 * float(s[m, e]) / tot) < 1e-12
