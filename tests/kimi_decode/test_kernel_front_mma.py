"""front_mma (kernels/front_mma.py): the MoE front at 2 ≤ M ≤ 8 in one grid, on the CPU.

Oracles:
- PTX at K3 TP16's shapes (M = 2 and 8, with and without the shared gate/up, 8 and 16 warps):
  exactly one gemv_mma tile body per tile kind (the mma count of gemv_mma's kernel at that warp
  count, times the kinds), one grid-completion atomic, no local memory, ptxas within the
  register cap that keeps every CTA resident and no spills;
- the chained build: only weight loads before each tile kind's griddepcontrol.wait, and with
  RELEASE_AT_END one launch_dependents per tile kind after its wait (none without);
- the grid's split into router / latent_down / shared tiles on shapes with partial last tiles
  (each tile's arithmetic is gemv_mma's, whose fragment replay test_kernel_gemv_mma checks);
- route_and_project reads WARPS and RELEASE_AT_END when called, refuses what it cannot run;
- fused.LatentMoE runs it (op moe_front, no router / latent_down ops) at 2 ≤ M ≤ 8 where it is
  on, with the kernel replaced by its contract: the step equals stock, with and without the
  shared gate/up in the grid; off, or at M = 1, it is not called;
- check() on the CPU with the kernels replaced by their contracts passes, and fails with a
  kernel that drops the correction bias or one whose latent output is 5 % off.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

import kimi_decode.kernels.front_mma as fm  # noqa: E402
import kimi_decode.kernels.gemv_mma as gm  # noqa: E402
import kimi_decode.kernels.router_mma as rm  # noqa: E402
from kimi_decode.config import k3_tp16  # noqa: E402
from kimi_decode.kernels import _common  # noqa: E402
from kimi_decode.kernels.router import reference  # noqa: E402
from tests.kimi_decode.ptxas_tool import ptxas_path, ptxas_usage  # noqa: E402
from tests.kimi_decode.test_kernels_compile import chained_ptx_at_wait, common_checks, ptx_of  # noqa: E402

bf = torch.bfloat16
P = _common.dummy_ptr
K3 = k3_tp16()
N1, N2 = K3.latent_dim, 2 * K3.shared_local_inter
MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


def k3_cfg(m: int, shared: bool, warps: int = fm.WARPS, release: bool = fm.RELEASE_AT_END) -> fm.FrontMmaConfig:
    return fm.FrontMmaConfig(K3.hidden, K3.num_experts, K3.top_k, m, K3.routed_scaling, N1, N2 if shared else 0,
                             warps, release, fm.MIN_CTAS[warps])


def k3_ptx(tmp_path: Path, cfg: fm.FrontMmaConfig) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return ptx_of(tmp_path, fm.FrontMma(cfg), P(bf), P(bf), P(torch.float32), P(torch.float32), P(torch.int32),
                  P(torch.int64), P(torch.float32), P(bf), P(bf), P(bf), P(bf))


def gemv_mma_count(tmp_path: Path, warps: int) -> int:
    """mma instructions in gemv_mma's own kernel at K3's K and this warp count (one tile body)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    ptx = ptx_of(tmp_path, gm.GemvMma(gm.GemvMmaConfig(N1, K3.hidden, 8, warps)), P(bf), P(bf), P(bf))
    return ptx.count(MMA)


@pytest.mark.parametrize("m,shared,warps", [(8, True, 8), (2, False, 8), (8, True, 16)])
def test_compiles_as_one_tile_body_per_kind(tmp_path: Path, m: int, shared: bool, warps: int) -> None:
    cfg = k3_cfg(m, shared, warps)
    kern = fm.FrontMma(cfg)
    assert (kern.t_r, kern.t_d, kern.ctas) == (56, 224, 56 + 224 + (48 if shared else 0))
    ptx = k3_ptx(tmp_path / "f", cfg)
    common_checks(ptx)
    kinds = 3 if shared else 2
    assert ptx.count(MMA) == kinds * gemv_mma_count(tmp_path / "g", warps) > 0
    assert ptx.count("atom.") == 1 and "atom.global.acq_rel.add" in ptx      # the router tiles' arrival
    if ptxas_path() is not None:
        regs, spills = ptxas_usage(tmp_path / "f", ptx)
        cap = 65536 // (fm.MIN_CTAS[warps] * warps * 32)
        assert regs <= min(cap, 255) and spills == 0, (regs, spills, cap)


@pytest.mark.parametrize("release", [True, False])
def test_chained_build_loads_weights_before_each_wait(tmp_path: Path, release: bool) -> None:
    """PDL chain on: each tile kind (router, latent_down, shared gate/up) has its own wait with
    only its first round of weight loads before it; with RELEASE_AT_END each releases the next
    kernel once after its wait (after its mma loop), without it none does."""
    lines, _ = chained_ptx_at_wait(lambda: k3_ptx(tmp_path, k3_cfg(8, True, release=release)))
    waits = [i for i, s in enumerate(lines) if s.startswith("griddepcontrol.wait")]
    rels = [i for i, s in enumerate(lines) if s.startswith("griddepcontrol.launch_dependents")]
    assert len(waits) == 3
    u = min(gm.UNROLL, K3.hidden // gm.CHUNK // fm.WARPS)
    before = [s for s in lines[:waits[0]] if s.startswith(("ld.global", "atom", "ld.shared"))]
    assert len(before) == 2 * u and all(s.startswith("ld.global") for s in before)
    if release:
        assert len(rels) == 3 and all(w < r for w, r in zip(waits, rels))
        mmas = [i for i, s in enumerate(lines) if s.startswith(MMA)]
        assert all(any(w < i < r for i in mmas) for w, r in zip(waits, rels))   # each after its loop's mma
    else:
        assert rels == []


def test_grid_split_with_partial_tiles() -> None:
    cfg = fm.FrontMmaConfig(512, 64, 4, 3, 1.0, 40, 24, 8)
    kern = fm.FrontMma(cfg)
    assert (kern.t_r, kern.t_d, kern.ctas) == (4, 3, 4 + 3 + 2)
    assert fm.FrontMma(fm.FrontMmaConfig(512, 64, 4, 3, 1.0, 40, 0, 8)).ctas == 7


def test_limits_and_wrapper_errors() -> None:
    d, e, k = K3.hidden, K3.num_experts, K3.top_k
    for m in range(2, 9):
        assert fm.can_implement(m, d, e, k, (N1, N2), (bf,) * 4)
    assert fm.can_implement(8, d, e, k, (N1,), (bf,) * 3)
    assert fm.can_implement(8, d, e, k, (N1, N2), (bf,), warps=16)
    assert not fm.can_implement(1, d, e, k, (N1, N2), (bf,))          # M = 1: gemv_multi's front
    assert not fm.can_implement(9, d, e, k, (N1, N2), (bf,))          # past the mma's n
    assert not fm.can_implement(8, d, e, k, (), (bf,))
    assert not fm.can_implement(8, d, e, k, (N1, N2, 64), (bf,))      # at most two projections
    assert not fm.can_implement(8, d, 900, k, (N1,), (bf,))           # E % 32 (router_fast's top-k)
    assert not fm.can_implement(8, d, e, k, (N1,), (torch.float16,))
    assert not fm.can_implement(8, d, e, k, (N1,), (bf,), warps=4)
    y, wg = torch.zeros(8, d, dtype=bf), torch.zeros(e, d, dtype=bf)
    c = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="front_mma cannot run M=1"):
        fm.route_and_project(torch.zeros(1, d, dtype=bf), wg, torch.zeros(e), k, 1.0, c, [torch.zeros(N1, d, dtype=bf)])
    with pytest.raises(ValueError, match="front_mma cannot run"):
        fm.route_and_project(y, wg, torch.zeros(e, dtype=torch.float64), k, 1.0, c, [torch.zeros(N1, d, dtype=bf)])
    with pytest.raises(ValueError, match="front_mma cannot run"):
        fm.route_and_project(y, wg, torch.zeros(e), k, 1.0, c, [torch.zeros(N1, d + 32, dtype=bf)])


def test_route_and_project_reads_its_settings_when_called(monkeypatch: pytest.MonkeyPatch) -> None:
    """WARPS and RELEASE_AT_END as they are at the call (a `bench/fused_device.py --patch`
    reaches the step), `warps=` over WARPS; outputs shaped [M, N] per projection."""
    built: list[fm.FrontMmaConfig] = []
    monkeypatch.setattr(fm, "compile_for", lambda cfg: built.append(cfg) or (lambda *a: None))
    monkeypatch.setattr(fm, "ptr", lambda t: None)
    d, e = K3.hidden, K3.num_experts
    args = (torch.zeros(8, d, dtype=bf), torch.zeros(e, d, dtype=bf), torch.zeros(e), K3.top_k, 1.0,
            torch.zeros(1, dtype=torch.int32))
    monkeypatch.setattr(fm, "WARPS", 8)
    ids, w, outs = fm.route_and_project(*args, [torch.zeros(N1, d, dtype=bf), torch.zeros(N2, d, dtype=bf)])
    assert ids.shape == (8, K3.top_k) and ids.dtype == torch.int64 and w.dtype == torch.float32
    assert [tuple(o.shape) for o in outs] == [(8, N1), (8, N2)]
    monkeypatch.setattr(fm, "WARPS", 16)
    monkeypatch.setattr(fm, "RELEASE_AT_END", False)
    fm.route_and_project(*args, [torch.zeros(N1, d, dtype=bf)])
    fm.route_and_project(*args, [torch.zeros(N1, d, dtype=bf)], warps=8)
    assert [(c.warps, c.release_end, c.n2, c.min_ctas) for c in built] == [
        (8, True, N2, fm.MIN_CTAS[8]), (16, False, 0, fm.MIN_CTAS[16]), (8, False, 0, fm.MIN_CTAS[8])]


def test_registered_for_the_device_check() -> None:
    from kimi_decode import fused
    from kimi_decode.kernels import CHECK_MODULES, KERNELS, checks
    assert "front_mma" in KERNELS and CHECK_MODULES["front_mma"] == "front_mma"
    assert "front_mma" in checks.CHECKS
    # checked on the device (H100, session 22) and a tie in the step with two kernels fewer: default
    assert "front_mma" in fused.DEFAULT_KERNELS and fused.MAX_ROWS["front_mma"] == 8


def _contract(y, w_gate, bias, top_k, scaling, counter, ws, *, warps=None, drop_bias=False):
    """route_and_project's contract: the float64 routing statement and bf16 of the products."""
    ids, w, _ = reference(y, w_gate, torch.zeros_like(bias) if drop_bias else bias, top_k, scaling)
    return ids, w.float(), [(y.double() @ p.double().t()).to(y.dtype) for p in ws]


@pytest.mark.parametrize("shared", [True, False])
def test_fused_step_runs_the_front_at_m8(monkeypatch: pytest.MonkeyPatch, shared: bool) -> None:
    """LatentMoE at M = 8 with front_mma on: one moe_front op per MoE layer (no router or
    latent_down op), the kernel handed [latent_down, shared gate/up] (FRONT_MMA_SHARED) or
    [latent_down] and the shared expert op after it; the step equals stock. Off: not called.
    The shared expert's down GEMV (or, without the front's gate/up, the whole shared expert)
    is issued on the side stream and joined once before the tail (in the main chain it was
    slower: fused.py's note after FRONT_MMA_SHARED)."""
    from contextlib import contextmanager

    from kimi_decode import fused
    from kimi_decode.config import tiny
    from kimi_decode.runner import build
    from tests.kimi_decode.test_fused import record_ops, run_close
    order = record_ops(monkeypatch)
    calls: list[tuple[int, ...]] = []
    side_depth = [0]
    shared_on_side: list[bool] = []
    real_on_side, real_down = fused._on_side, fused.LatentMoE._shared_down

    @contextmanager
    def on_side(*a, **k):
        side_depth[0] += 1
        try:
            with real_on_side(*a, **k) as s:
                yield s
        finally:
            side_depth[0] -= 1

    def shared_down(self, h):       # also the whole shared expert's (LatentMoE._shared) last step
        shared_on_side.append(side_depth[0] > 0)
        return real_down(self, h)

    joins: list[int] = []
    real_join = fused._join

    def join(rt, *outputs):
        joins.append(len(outputs))
        return real_join(rt, *outputs)
    monkeypatch.setattr(fused, "_on_side", on_side)
    monkeypatch.setattr(fused, "_join", join)
    monkeypatch.setattr(fused.LatentMoE, "_shared_down", shared_down)

    def front(y, w_gate, bias, top_k, scaling, counter, ws, **kw):
        calls.append((y.shape[0], *(p.data_ptr() for p in ws)))
        return _contract(y, w_gate, bias, top_k, scaling, counter, ws)
    monkeypatch.setattr(fm, "route_and_project", front)
    monkeypatch.setattr(fm, "can_implement", lambda *a, **k: True)
    monkeypatch.setattr(fused, "FRONT_MMA_SHARED", shared)
    cfg = tiny(layers=(3, 4), batch=2, spec_tokens=3)                       # M = 8
    stock, _ = build("stock", cfg, "cpu")
    model = fused.FusedDecoder.from_stock(stock)
    for layer in model.layers:
        layer.mlp.use_front_mma = True
        layer.mlp.router_counter = torch.zeros(1, dtype=torch.int32)
    run_close(stock, model, seed=9, steps=2)
    moe = [layer.mlp for layer in model.layers]
    want = [(8, l.down.data_ptr()) + ((l.shared_gate_up.data_ptr(),) if shared else ()) for l in moe] * 2
    assert calls == want
    ops = [o for o in order if o in ("moe_front", "router", "latent_down", "shared_expert")]
    assert ops == ["moe_front", "shared_expert"] * (2 * len(moe))
    assert shared_on_side == [True] * (2 * len(moe))
    assert joins == [1] * (2 * len(moe))
    calls.clear()
    for layer in model.layers:
        layer.mlp.use_front_mma = False
    run_close(stock, model, seed=9, steps=1)
    assert calls == []


def test_not_at_one_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """M = 1 keeps gemv_multi's front (or the separate kernels): _front_mma_applies is False."""
    from types import SimpleNamespace

    from kimi_decode import fused
    monkeypatch.setattr(fm, "can_implement", lambda *a, **k: True)
    moe = SimpleNamespace(use_front_mma=True, router=torch.zeros(64, 512, dtype=bf), bias=torch.zeros(64),
                          cfg=SimpleNamespace(top_k=4), down=torch.zeros(32, 512, dtype=bf),
                          shared_gate_up=torch.zeros(16, 512, dtype=bf))
    moe._front_weights = lambda shared=None: fused.LatentMoE._front_weights(moe, shared)
    assert fused.LatentMoE._front_mma_applies(moe, torch.zeros(8, 512, dtype=bf))
    assert not fused.LatentMoE._front_mma_applies(moe, torch.zeros(1, 512, dtype=bf))
    assert not fused.LatentMoE._front_mma_applies(moe, torch.zeros(9, 512, dtype=bf))
    moe.use_front_mma = False
    assert not fused.LatentMoE._front_mma_applies(moe, torch.zeros(8, 512, dtype=bf))


def test_check_runs_on_cpu_and_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    from kimi_decode.kernels import checks
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(checks, "_sync", lambda: None)
    monkeypatch.setattr(fm, "route_and_project", _contract)
    monkeypatch.setattr(rm, "route", lambda y, w, b, k, s, c: _contract(y, w, b, k, s, c, [])[:2])
    monkeypatch.setattr(gm, "gemv_mma", lambda x, w, out=None, out_dtype=bf: (x.double() @ w.double().t()).to(out_dtype))
    rows = fm.check(timing=False, rows=(2, 8))
    assert [(r["M"], r["shared"]) for r in rows] == [(2, True), (2, False), (8, True), (8, False)]
    assert all(r["ok"] for r in rows), rows
    assert all(r["rows_same_experts_f64"] == 1.0 and r["down_equal_gemv_mma"] for r in rows)
    assert [r["shared_equal_gemv_mma"] for r in rows] == [True, False, True, False]

    monkeypatch.setattr(fm, "route_and_project", lambda *a, **k: _contract(*a, **k, drop_bias=True))
    assert not any(r["ok"] for r in fm.check(timing=False, rows=(8,)))

    def off(*a, **k):
        ids, w, outs = _contract(*a, **k)
        return ids, w, [(outs[0].float() * 1.05).bfloat16(), *outs[1:]]
    monkeypatch.setattr(fm, "route_and_project", off)
    assert not any(r["ok"] for r in fm.check(timing=False, rows=(8,)))


def test_tail_split_arithmetic() -> None:
    """TAIL_SPLIT's choice: the CTAs past the last full wave, when their halves fit in one wave
    and they are projection tiles; the counter words behind it."""
    assert fm.TAIL_SPLIT is False                           # an A/B, off by default
    assert fm.tail_tiles(56 + 224 + 48, 272, 132) == 64     # K3 M = 8, 16 warps, with the shared gate/up
    assert fm.tail_tiles(56 + 224, 224, 132) == 16          # without it
    assert fm.tail_tiles(264, 208, 132) == 0                # whole waves: nothing to split
    assert fm.tail_tiles(132 + 100, 176, 132) == 0          # 2 x 100 halves would need two waves
    assert fm.tail_tiles(132 + 40, 30, 132) == 0            # the tail would reach the router tiles
    assert fm.split_counter_words(0) == 1
    assert fm.split_counter_words(64) == 1 + fm.MAX_TAIL + 2 * 64 * 128      # counters at a fixed place
    kern = fm.FrontMma(dataclasses.replace(k3_cfg(8, True, 16), tail=64))
    assert (kern.t_p, kern.ctas) == (272, 56 + 272 + 64)    # each split tile two CTAs
    fm.split_tail.cache_clear()                            # the wrapper's choice from the unsplit grid
    assert fm.split_tail(k3_cfg(8, True, 16), 132) == 64 and fm.split_tail(k3_cfg(8, False, 16), 132) == 16
    assert fm.split_tail(k3_cfg(8, True, 16), 132) == 64
    assert fm.split_tail.cache_info().hits == 1 and fm.split_tail.cache_info().misses == 2


def test_tail_split_build(tmp_path: Path) -> None:
    """The split build at K3 M = 8, 16 warps: the three whole-tile bodies plus the half-K ones
    (LLVM may merge the latent and shared halves, which differ only in pointers and n, so only
    "more than the three" is asserted), one arrival atomic per arriving kind (router, split
    latent_down, split shared gate/up), ptxas within one CTA per SM and no spills; the default
    build keeps one atomic (test above)."""
    cfg = dataclasses.replace(k3_cfg(8, True, 16), tail=64)
    ptx = k3_ptx(tmp_path / "f", cfg)
    common_checks(ptx)
    assert ptx.count(MMA) > 3 * gemv_mma_count(tmp_path / "g", 16)
    assert ptx.count("atom.") == 3 and ptx.count("atom.global.acq_rel.add") == 3
    assert ptx.count("fence.acq_rel.gpu") >= 3 * 2
    if ptxas_path() is not None:
        regs, spills = ptxas_usage(tmp_path / "f", ptx)
        assert regs <= 128 and spills == 0, (regs, spills)


def test_tail_split_halves_are_the_k_halves() -> None:
    """The split's arithmetic in float64: the half-K views (offset K / 4 int32 words, i.e. K / 2
    bf16 of each row) give gemv_mma's tile over columns [0, K/2) and [K/2, K), and their sum is
    the product (to fp64 rounding). (Which half arrives second cannot change the stored value:
    IEEE addition is commutative, so the kernel adds the halves as a + b either way.)"""
    torch.manual_seed(3)
    k = 1024
    x, w = torch.randn(8, k).to(bf), torch.randn(40, k).to(bf)
    words = x.view(torch.int32)                                   # [8, k / 2] int32
    off = fm.half_k_words(k)                                      # the kernel's view offset
    assert torch.equal(words[:, off:].contiguous().view(bf), x[:, k // 2:])
    assert torch.equal(words[:, :off].contiguous().view(bf), x[:, : k // 2])
    h0 = gm.emulate(x[:, : k // 2], w[:, : k // 2], 16)
    h1 = gm.emulate(x[:, k // 2:], w[:, k // 2:], 16)
    ref = x.double() @ w.double().t()
    assert torch.allclose(h0 + h1, ref, rtol=1e-12, atol=1e-9)


def test_enable_sizes_the_counter_for_the_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """fused.enable: with front_mma on, the router counter holds split_counter_words(MAX_TAIL)
    words when TAIL_SPLIT is on (the split tiles' counters and halves), one word otherwise."""
    import kimi_decode.fused as fused_mod
    import kimi_decode.kernels as kernels
    from kimi_decode.config import tiny
    from kimi_decode.fused import FusedDecoder
    from kimi_decode.stock import StockDecoder
    monkeypatch.setattr(fused_mod, "_kernels_usable", lambda dev: True)
    monkeypatch.setattr(kernels, "applicable", lambda name, cfg: True)
    for split, words in ((False, 1), (True, fm.split_counter_words(fm.MAX_TAIL))):
        monkeypatch.setattr(fm, "TAIL_SPLIT", split)
        model = FusedDecoder.from_stock(StockDecoder(tiny(layers=(3, 4), batch=2, spec_tokens=3)), kernels=frozenset())
        model.enable(frozenset({"front_mma"}))
        counters = [layer.mlp.router_counter for layer in model.layers if hasattr(layer.mlp, "router_counter")]
        assert counters and all(c.numel() == words and not c.any() for c in counters)


def test_check_with_the_tail_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """check() under TAIL_SPLIT: the counter it passes holds the split words; outputs within fp32
    rounding of gemv_mma pass where bit-equality was asked; a split counter left non-zero (the
    second half never re-zeroing it) fails the row."""
    from kimi_decode.kernels import checks
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(checks, "_sync", lambda: None)
    monkeypatch.setattr(fm, "TAIL_SPLIT", True)
    monkeypatch.setattr(rm, "route", lambda y, w, b, k, s, c: _contract(y, w, b, k, s, c, [])[:2])
    monkeypatch.setattr(gm, "gemv_mma", lambda x, w, out=None, out_dtype=bf: (x.double() @ w.double().t()).to(out_dtype))
    sizes: list[int] = []

    def split(y, w_gate, bias, top_k, scaling, counter, ws, **kw):
        sizes.append(counter.numel())
        ids, w, outs = _contract(y, w_gate, bias, top_k, scaling, counter, ws)
        outs = [o.clone() for o in outs]
        o = outs[-1]            # the shared gate/up where present: the projection asked to be bit-equal
        o[0, -1] = (o[0, -1].float() + o[0, -1].float().abs() * 2 ** -8).to(bf)    # one value one ulp off
        return ids, w, outs
    monkeypatch.setattr(fm, "route_and_project", split)
    rows = fm.check(timing=False, rows=(8,))
    assert set(sizes) == {fm.split_counter_words(fm.MAX_TAIL)}
    assert [r["shared"] for r in rows] == [True, False] and not rows[0]["shared_equal_gemv_mma"]
    assert all(r["ok"] and r["tail_split"] for r in rows), rows

    def stuck(y, w_gate, bias, top_k, scaling, counter, ws, **kw):
        counter[3] = 1
        return _contract(y, w_gate, bias, top_k, scaling, counter, ws)
    monkeypatch.setattr(fm, "route_and_project", stuck)
    assert not any(r["ok"] for r in fm.check(timing=False, rows=(8,)))
