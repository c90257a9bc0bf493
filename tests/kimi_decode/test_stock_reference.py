"""The stock step (tiny config) against the independent float64 reference, state included.

Oracle: tests/kimi_decode/k3_reference.py re-derives every formula from KIMI_K3.md. The tiny
config runs in float32, so the only error is float32 rounding: relative L2 error well under
1e-4 (measured ~1e-6); the tolerance 1e-4 leaves room for reordered fp32 sums but is far below
any formula error (a wrong sign, gate or normalisation moves outputs by O(1)).
"""
from __future__ import annotations

import pytest
import torch

from kimi_decode.config import tiny
from kimi_decode.runner import build
from kimi_decode.stock import StockDecoder
from tests.kimi_decode.k3_reference import Reference

TOL = 1e-4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def run_both(cfg, steps: int) -> list[float]:
    model = StockDecoder(cfg)
    ref = Reference(model)
    errs = []
    for s in range(steps):
        m, prefix, blocks = model.make_inputs(seed=100 + s)
        r_m, r_prefix, r_blocks = ref.step(m, prefix, blocks)
        with torch.no_grad():
            o_m, o_prefix = model(m, prefix, blocks)
        errs += [rel(o_m, r_m), rel(o_prefix, r_prefix), rel(blocks, r_blocks)]
    # the state after all steps, layer by layer
    for layer, (_, _, _, st) in zip(model.layers, ref.layers):
        for name, buf in layer.named_buffers():
            errs.append(rel(buf, st[name]))
    assert int(model.pos) == ref.pos
    return errs


@pytest.mark.parametrize("layers", [(0, 1, 2, 3, 4), (3, 4, 5, 6, 7, 8)])
def test_decode_steps_match_reference(layers):
    """Dense layer 0, KDA, MLA, a block boundary at 4 and 8, 3 steps, batch 2."""
    errs = run_both(tiny(layers=layers, batch=2), steps=3)
    assert max(errs) < TOL, errs


def test_speculative_rows_match_reference():
    """k = 7: 8 rows per sequence run through conv, recurrence and the cache in order."""
    errs = run_both(tiny(layers=(2, 3), batch=2, spec_tokens=7), steps=2)
    assert max(errs) < TOL, errs


def test_gather_bmm_experts_match_reference():
    """The fallback expert path (no torch._grouped_mm) computes the same thing."""
    errs = run_both(tiny(layers=(1,), batch=3, expert_impl="gather_bmm"), steps=2)
    assert max(errs) < TOL, errs


def test_reference_detects_a_wrong_formula():
    """The oracle can fail: flipping the KDA gate bound moves the output far past TOL."""
    cfg = tiny(layers=(1,), batch=1)
    model = StockDecoder(cfg)
    ref = Reference(model)
    ref.cfg = tiny(layers=(1,), batch=1, gate_lower_bound=-1.0)
    m, prefix, blocks = model.make_inputs(seed=5)
    r_m, _, _ = ref.step(m, prefix, blocks)
    with torch.no_grad():
        o_m, _ = model(m, prefix, blocks)
    assert rel(o_m, r_m) > 100 * TOL


@pytest.mark.parametrize("rank", [0, 1])
def test_tp_sim_matches_reference_semantics(rank):
    """tp_sim: collectives are local kernels over `sim_world` slots where the other ranks'
    partials are zero; the reference states that rule independently (identity all-reduce,
    only this rank's column slice surviving the gather)."""
    cfg = tiny(layers=(2, 3, 4), batch=2, tp=2, rank=rank, tp_sim=True, sim_world=2)
    model, rt = build("stock", cfg, "cpu")
    assert rt.comm.simulated
    ref = Reference(model, sim_world=2, rank=rank)
    for s in range(2):
        m, prefix, blocks = model.make_inputs(seed=7 + s)
        r_m, r_prefix, _ = ref.step(m, prefix, blocks)
        with torch.no_grad():
            o_m, o_prefix = model(m, prefix, blocks)
        assert rel(o_m, r_m) < TOL and rel(o_prefix, r_prefix) < TOL
    n = cfg.hidden // 2
    others = torch.cat([o_m[:, :rank * n], o_m[:, (rank + 1) * n:]], dim=1)
    assert torch.count_nonzero(others) == 0 and torch.count_nonzero(o_m) > 0
