"""router_mma (kernels/router_mma.py): the router at 2 ≤ M ≤ 8 in one launch, on the CPU.

Oracles:
- the logits: gemv_mma's fragment replay over the S K-slices, added in slice order
  (emulate_logits), equals y @ Wᵀ in float64; a slice boundary off by one chunk fails;
- PTX at every M the step runs: mma.sync m16n8k16 (two per chunk of the CTA's slice), one
  grid-completion atomic, no spills (ptxas, under CI), the chained build loading its first
  weights before griddepcontrol.wait and reading nothing the step writes there;
- the device check runs on the CPU with the kernel replaced by a faithful emulation (router.py's
  float64 statement) and passes; an emulation that drops the correction bias fails it;
- fused.LatentMoE._route takes the kernel at 2 ≤ M ≤ 8 only when it is enabled.
"""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

import kimi_decode.kernels.gemv_mma as gm  # noqa: E402
import kimi_decode.kernels.router_fast as rf  # noqa: E402
import kimi_decode.kernels.router_mma as rm  # noqa: E402
from kimi_decode.config import k3_tp16  # noqa: E402
from kimi_decode.kernels import _common  # noqa: E402
from kimi_decode.kernels.router import reference  # noqa: E402
from tests.kimi_decode.ptxas_tool import ptxas_path, ptxas_usage  # noqa: E402
from tests.kimi_decode.test_kernels_compile import chained_ptx_at_wait, common_checks, ptx_of  # noqa: E402

bf = torch.bfloat16
P = _common.dummy_ptr
K3 = k3_tp16()


def k3_ptx(tmp_path: Path, m: int, release: bool = rm.RELEASE_AFTER_ARRIVAL) -> str:
    """The build route() compiles at K3 with the module's settings (SPLITS, WARPS, and
    RELEASE_AFTER_ARRIVAL unless `release` says otherwise)."""
    cfg = rm.RouterMmaConfig(K3.hidden, K3.num_experts, K3.top_k, m, K3.routed_scaling, splits=rm.SPLITS,
                             warps=rm.WARPS, release_tail=release)
    return ptx_of(tmp_path, rm.RouterMma(cfg), P(bf), P(bf), P(torch.float32), P(torch.float32),
                  P(torch.int32), P(torch.int64), P(torch.float32))


@pytest.mark.parametrize("m,d,e,splits", [(8, 1024, 48, 4), (3, 512, 21, 2), (2, 2048, 32, 1)])
def test_slice_sums_are_the_product(m: int, d: int, e: int, splits: int) -> None:
    gen = torch.Generator().manual_seed(m * 7 + d + e)
    y = torch.randn(m, d, generator=gen, dtype=torch.float64)
    w = torch.randn(e, d, generator=gen, dtype=torch.float64)
    got = rm.emulate_logits(y, w, splits)
    ref = y @ w.t()
    assert got.shape == (m, e)
    assert torch.allclose(got, ref, rtol=0, atol=1e-12 * ref.abs().max().item() * d)


def test_a_shifted_slice_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation: slice s read one chunk late (the kernel's offset wrong) is not the product."""
    real = gm.emulate

    def shifted(x: torch.Tensor, w: torch.Tensor, warps: int) -> torch.Tensor:
        return real(torch.roll(x, gm.CHUNK, dims=1), w, warps)
    monkeypatch.setattr(gm, "emulate", shifted)
    gen = torch.Generator().manual_seed(1)
    y = torch.randn(4, 1024, generator=gen, dtype=torch.float64)
    w = torch.randn(32, 1024, generator=gen, dtype=torch.float64)
    assert not torch.allclose(rm.emulate_logits(y, w, 4), y @ w.t())


def test_limits() -> None:
    for m in range(2, 9):
        assert rm.can_implement(m, K3.hidden, K3.num_experts, K3.top_k, (bf, bf))
    assert not rm.can_implement(1, K3.hidden, K3.num_experts, K3.top_k, (bf, bf))     # M = 1: router_fast
    assert not rm.can_implement(9, K3.hidden, K3.num_experts, K3.top_k, (bf, bf))     # the mma's n
    assert not rm.can_implement(8, K3.hidden, K3.num_experts, K3.top_k, (bf, bf), splits=3)
    assert not rm.can_implement(8, K3.hidden, 900, K3.top_k, (bf, bf))               # E % 32
    assert not rm.can_implement(8, K3.hidden, K3.num_experts, 33, (bf, bf))          # k > a warp
    assert not rm.can_implement(8, K3.hidden, K3.num_experts, K3.top_k, (torch.float16, bf))
    with pytest.raises(ValueError, match="router_mma cannot run M=1"):
        rm.route(torch.zeros(1, K3.hidden, dtype=bf), torch.zeros(K3.num_experts, K3.hidden, dtype=bf),
                 torch.zeros(K3.num_experts), K3.top_k, 1.0, torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="router_mma cannot run"):
        rm.route(torch.zeros(8, K3.hidden, dtype=bf), torch.zeros(K3.num_experts, K3.hidden, dtype=bf),
                 torch.zeros(K3.num_experts, dtype=torch.float64), K3.top_k, 1.0, torch.zeros(1, dtype=torch.int32))


def mma_count(per_warp: int) -> int:
    """mma.sync instructions in a build whose warps take `per_warp` chunks each: two per chunk
    of round 0 (peeled: loaded before the wait), of one loop body (when there are more rounds)
    and of the remainder."""
    u = min(gm.UNROLL, per_warp)
    return 2 * (u * (1 + (per_warp // u > 1)) + per_warp % u)


@pytest.mark.parametrize("m", [2, 8])
def test_compiles(tmp_path: Path, m: int) -> None:
    """The step's build (S = 1, 16 warps since session 15: gemv_mma's own 56-CTA logits grid
    plus the top-k tail, 14 chunks per warp): no spills (ptxas gives a 512-thread CTA 128
    registers), one arrival atomic at .gpu scope."""
    assert (rm.SPLITS, rm.WARPS) == (1, 16)
    ptx = k3_ptx(tmp_path, m)
    common_checks(ptx)
    per_warp = K3.hidden // rm.SPLITS // gm.CHUNK // rm.WARPS          # 14 chunks
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == mma_count(per_warp) == 20
    assert ptx.count("atom.") == 1 and "atom.global.acq_rel.add" in ptx     # one arrival, .gpu scope by default
    assert "fence.acq_rel.gpu" in ptx
    if ptxas_path() is not None:
        regs, spills = ptxas_usage(tmp_path, ptx)
        assert regs <= 128 and spills == 0, (regs, spills)
    assert not rm.can_implement(8, K3.hidden, K3.num_experts, K3.top_k, (bf, bf), splits=8, warps=16)  # 28 chunks
    assert not rm.can_implement(8, K3.hidden, K3.num_experts, K3.top_k, (bf, bf), splits=1, warps=4)


def test_four_slices_eight_warps_compiles(tmp_path: Path) -> None:
    """S = 4 with 8 warps (the default until session 15, 224 CTAs; 3-6 µs slower per layer in
    the step, still selectable): 7 chunks per warp, no loop body, no spills."""
    cfg = rm.RouterMmaConfig(K3.hidden, K3.num_experts, K3.top_k, 8, K3.routed_scaling, splits=4, warps=8)
    ptx = ptx_of(tmp_path, rm.RouterMma(cfg), P(bf), P(bf), P(torch.float32), P(torch.float32),
                 P(torch.int32), P(torch.int64), P(torch.float32))
    common_checks(ptx)
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == mma_count(7) == 14
    assert ptx.count("atom.") == 1
    if ptxas_path() is not None:
        regs, spills = ptxas_usage(tmp_path, ptx)
        assert regs <= 128 and spills == 0, (regs, spills)
    assert rm.can_implement(8, K3.hidden, K3.num_experts, K3.top_k, (bf, bf), splits=4, warps=8)


def test_route_reads_its_settings_when_called(monkeypatch: pytest.MonkeyPatch) -> None:
    """route() and can_implement() take SPLITS, WARPS (and route() RELEASE_AFTER_ARRIVAL) as
    they are at the call, so a `bench/fused_device.py --patch` reaches the step's router (the
    compiled kernel replaced)."""
    built: list[rm.RouterMmaConfig] = []
    monkeypatch.setattr(rm, "compile_for", lambda cfg: built.append(cfg) or (lambda *a: None))
    monkeypatch.setattr(rm, "ptr", lambda t: None)
    args = (torch.zeros(8, K3.hidden, dtype=bf), torch.zeros(K3.num_experts, K3.hidden, dtype=bf),
            torch.zeros(K3.num_experts), K3.top_k, 1.0, torch.zeros(1, dtype=torch.int32))
    rm.route(*args)
    monkeypatch.setattr(rm, "SPLITS", 4)
    monkeypatch.setattr(rm, "WARPS", 8)
    rm.route(*args)
    monkeypatch.setattr(rm, "RELEASE_AFTER_ARRIVAL", False)
    rm.route(*args)
    assert [(c.splits, c.warps, c.release_tail) for c in built] == [(1, 16, True), (4, 8, True), (4, 8, False)]
    monkeypatch.setattr(rm, "WARPS", 16)
    monkeypatch.setattr(rm, "SPLITS", 8)     # 28 chunks per slice: not a multiple of 16 warps
    assert not rm.can_implement(8, K3.hidden, K3.num_experts, K3.top_k, (bf, bf))


def test_chained_build_waits_before_reading_x(tmp_path: Path) -> None:
    """PDL chain on: only weight loads (2 per chunk of round 0) precede griddepcontrol.wait;
    y, the partials, the counter and the bias are read after it. Without RELEASE_AFTER_ARRIVAL
    it never releases the next kernel (FC1 starts when it completes; a release from every CTA
    would let FC1's waiting CTAs take the SMs this grid still needs)."""
    lines, wait = chained_ptx_at_wait(lambda: k3_ptx(tmp_path, 8, release=False))
    assert not any(s.startswith("griddepcontrol.launch_dependents") for s in lines)
    assert next(i for i, s in enumerate(lines) if s.startswith("atom.")) > wait
    before = [s for s in lines[:wait] if s.startswith(("ld.global", "atom", "ld.shared"))]
    per_warp = K3.hidden // rm.SPLITS // gm.CHUNK // rm.WARPS
    assert len(before) == 2 * min(gm.UNROLL, per_warp) and all(s.startswith("ld.global") for s in before)


def test_release_after_arrival_is_the_last_ctas_only(tmp_path: Path) -> None:
    """RELEASE_AFTER_ARRIVAL's build (chain on): one griddepcontrol.launch_dependents, after the
    grid-completion atomic (only the last CTA, which has seen every other CTA arrive, reaches
    it) and before the top-k's ids store: the step's build (on since session 15); without it
    none (the test above)."""
    assert rm.RELEASE_AFTER_ARRIVAL
    lines, wait = chained_ptx_at_wait(lambda: k3_ptx(tmp_path, 8))
    rel = [i for i, s in enumerate(lines) if s.startswith("griddepcontrol.launch_dependents")]
    atom = next(i for i, s in enumerate(lines) if s.startswith("atom."))
    ids_store = next(i for i, s in enumerate(lines) if s.startswith("st.global.u64") or s.startswith("st.global.b64"))
    assert len(rel) == 1 and wait < atom < rel[0] < ids_store, (wait, atom, rel, ids_store)


def test_registered_for_the_device_check() -> None:
    from kimi_decode.kernels import CHECK_MODULES, KERNELS, checks
    assert "router_mma" in KERNELS and CHECK_MODULES["router_mma"] == "router_mma"
    assert "router_mma" in checks.CHECKS


def _emulate_route(y: torch.Tensor, w_gate: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
                   counter: torch.Tensor, splits: int = rm.SPLITS) -> tuple[torch.Tensor, torch.Tensor]:
    ids, w, _ = reference(y, w_gate, bias, top_k, scaling)
    return ids, w.float()


def test_check_runs_on_cpu_and_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    from kimi_decode.kernels import checks
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(rm, "route", _emulate_route)
    monkeypatch.setattr(rf, "route", lambda y, w, b, k, s, c: _emulate_route(y, w, b, k, s, c))
    monkeypatch.setattr(gm, "gemv_mma", lambda x, w, out=None, out_dtype=bf: (x.double() @ w.double().t()).to(out_dtype))
    rows = rm.check(timing=False, rows=(2, 8))
    assert [r["M"] for r in rows] == [2, 8] and all(r["ok"] for r in rows), rows
    assert all(r["rows_same_experts_f64"] == 1.0 and r["counter_zero"] for r in rows)

    def no_bias(y, w_gate, bias, top_k, scaling, counter, splits=rm.SPLITS):
        return _emulate_route(y, w_gate, torch.zeros_like(bias), top_k, scaling, counter)
    monkeypatch.setattr(rm, "route", no_bias)
    assert not any(r["ok"] for r in rm.check(timing=False, rows=(8,)))


def test_route_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """fused.LatentMoE._route: router_mma at 2 ≤ M ≤ 8 when enabled; M = 1 and switched off
    take the logits + routing op path."""
    from kimi_decode import fused
    calls: list[int] = []

    def fake(y, w, b, k, s, counter):
        calls.append(y.shape[0])
        return torch.zeros(y.shape[0], k, dtype=torch.int64), torch.zeros(y.shape[0], k)
    monkeypatch.setattr(rm, "route", fake)
    cfg = SimpleNamespace(top_k=4, routed_scaling=1.0)
    routed: list[int] = []
    moe = SimpleNamespace(cfg=cfg, router=torch.zeros(64, 1024, dtype=bf), bias=torch.zeros(64),
                          router_counter=torch.zeros(1, dtype=torch.int32), use_router_fast=False,
                          use_router_kernel=False, use_router_mma=True, use_router_topk=False,
                          _router_logits=lambda y: torch.zeros(y.shape[0], 64),
                          fx={"route": lambda lg, b, k, s: routed.append(lg.shape[0]) or (None, None)})
    moe._router_mma_applies = lambda y: fused.LatentMoE._router_mma_applies(moe, y)
    fused.LatentMoE._route(moe, torch.zeros(8, 1024, dtype=bf))
    fused.LatentMoE._route(moe, torch.zeros(1, 1024, dtype=bf))
    moe.use_router_mma = False
    fused.LatentMoE._route(moe, torch.zeros(8, 1024, dtype=bf))
    assert calls == [8] and routed == [1, 8]


def test_router_issued_before_the_side_stream_when_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """fused.LatentMoE.forward at M > 1: with router_mma applying, the router op is issued first
    and the side stream forks from an event recorded before it (fused._fork); otherwise
    latent_down comes first and there is no fork. The step's result equals stock either way
    (the emulated router returns the float64 statement's choice)."""
    from kimi_decode import fused
    from kimi_decode.config import tiny
    from kimi_decode.runner import build
    from tests.kimi_decode.test_fused import record_ops, run_close
    order = record_ops(monkeypatch)
    monkeypatch.setattr(fused, "_fork", lambda rt: order.append("fork") or None)
    monkeypatch.setattr(rm, "route", lambda y, w, b, k, s, c: _emulate_route(y, w, b, k, s, c))
    cfg = tiny(layers=(3, 4), batch=2, spec_tokens=3)
    for on in (True, False):
        stock, _ = build("stock", cfg, "cpu")
        model = fused.FusedDecoder.from_stock(stock)
        for layer in model.layers:
            layer.mlp.use_router_mma = on
            layer.mlp.router_counter = torch.zeros(1, dtype=torch.int32)
        monkeypatch.setattr(fused.LatentMoE, "_router_mma_applies", lambda self, y: self.use_router_mma)
        order.clear()
        run_close(stock, model, seed=5, steps=1)
        moe = [o for o in order if o in ("fork", "router", "latent_down")]
        per_layer = [tuple(moe[i:i + (3 if on else 2)]) for i in range(0, len(moe), 3 if on else 2)]
        want = ("fork", "router", "latent_down") if on else ("latent_down", "router")
        assert per_layer and all(p == want for p in per_layer), (on, per_layer)


@pytest.mark.parametrize("deferred", [False, True])
def test_shared_expert_after_router_mma_when_set(monkeypatch: pytest.MonkeyPatch, deferred: bool) -> None:
    """fused.SHARED_AFTER_ROUTER_MMA: with router_mma issued first, the shared expert is issued
    on the side stream right after latent_down (False, the block _on_side(after=fork) opened)
    or in a block of its own that waits for the main stream, i.e. for the router (True, as
    SHARED_AFTER_ROUTER does for the two-kernel router). The step equals stock either way."""
    from kimi_decode import fused
    from kimi_decode.config import tiny
    from kimi_decode.runner import build
    from tests.kimi_decode.test_fused import record_ops, run_close
    order = record_ops(monkeypatch)
    real_on_side = fused._on_side

    def on_side(rt, *inputs, after=None):
        order.append("side(fork)" if after is not None else "side(main)")
        return real_on_side(rt, *inputs, after=after)
    monkeypatch.setattr(fused, "_on_side", on_side)
    monkeypatch.setattr(fused, "_fork", lambda rt: order.append("fork") or object())
    monkeypatch.setattr(fused, "SHARED_AFTER_ROUTER_MMA", deferred)
    monkeypatch.setattr(rm, "route", lambda y, w, b, k, s, c: _emulate_route(y, w, b, k, s, c))
    monkeypatch.setattr(fused.LatentMoE, "_router_mma_applies", lambda self, y: True)
    cfg = tiny(layers=(3, 4), batch=2, spec_tokens=3)
    stock, _ = build("stock", cfg, "cpu")
    model = fused.FusedDecoder.from_stock(stock)
    for layer in model.layers:
        layer.mlp.router_counter = torch.zeros(1, dtype=torch.int32)
    run_close(stock, model, seed=7, steps=1)
    moe = [o for o in order if o in ("fork", "router", "side(fork)", "side(main)", "latent_down", "shared_expert")]
    want = (("fork", "router", "side(fork)", "latent_down", "side(main)", "shared_expert") if deferred
            else ("fork", "router", "side(fork)", "latent_down", "shared_expert"))
    n = len(want)
    per_layer = [tuple(moe[i:i + n]) for i in range(0, len(moe), n)]
    assert per_layer and all(p == want for p in per_layer), per_layer
