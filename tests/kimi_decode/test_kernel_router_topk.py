"""router_topk (kernels/router_topk.py): the router's selection from fp32 logits at 2 ≤ M ≤ 8,
on the CPU.

Oracles:
- PTX at the M the step runs: one warp per CTA (no CTA barrier), the bias (28 loads per lane)
  read before griddepcontrol.wait and the logits after it, never a release of the next kernel
  (FC1 starts when this kernel completes), no spills (ptxas, under CI);
- the device check runs on the CPU with the kernel replaced by router_fast's selection
  emulation (emulate_select, the kernel's own algorithm in torch) and passes against stock's
  routing op and the float64 reference; an emulation that drops the correction bias fails;
- fused.LatentMoE._route takes the kernel at 2 ≤ M ≤ 8 only when it is enabled, on the fp32
  logits of the router GEMM.
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
import kimi_decode.kernels.router_topk as rt  # noqa: E402
from kimi_decode.config import k3_tp16  # noqa: E402
from kimi_decode.kernels import _common  # noqa: E402
from tests.kimi_decode.ptxas_tool import ptxas_path, ptxas_usage  # noqa: E402
from tests.kimi_decode.test_kernels_compile import chained_ptx_at_wait, common_checks, ptx_of  # noqa: E402

f32 = torch.float32
P = _common.dummy_ptr
K3 = k3_tp16()


def k3_ptx(tmp_path: Path, m: int) -> str:
    cfg = rt.RouterTopKConfig(K3.num_experts, K3.top_k, m, K3.routed_scaling)
    return ptx_of(tmp_path, rt.RouterTopK(cfg), P(f32), P(f32), P(torch.int64), P(f32))


def test_limits() -> None:
    for m in range(2, 9):
        assert rt.can_implement(m, K3.num_experts, K3.top_k)
    assert not rt.can_implement(1, K3.num_experts, K3.top_k)        # M = 1: router_fast
    assert not rt.can_implement(9, K3.num_experts, K3.top_k)        # not verified past 8
    assert not rt.can_implement(8, 900, K3.top_k)                   # E % 32
    assert not rt.can_implement(8, K3.num_experts, 33)              # k > a warp
    with pytest.raises(ValueError, match="router_topk cannot run M=8 E=896"):
        rt.route_logits(torch.zeros(8, K3.num_experts, dtype=torch.bfloat16), torch.zeros(K3.num_experts),
                        K3.top_k, 1.0)
    with pytest.raises(ValueError, match="router_topk cannot run M=1"):
        rt.route_logits(torch.zeros(1, K3.num_experts), torch.zeros(K3.num_experts), K3.top_k, 1.0)


@pytest.mark.parametrize("m", [2, 8])
def test_compiles(tmp_path: Path, m: int) -> None:
    ptx = k3_ptx(tmp_path, m)
    common_checks(ptx)
    assert "bar.sync" not in ptx                                   # one warp per CTA
    assert ptx.count("ld.global") == 2 * K3.num_experts // 32      # bias and the row's logits
    if ptxas_path() is not None:
        regs, spills = ptxas_usage(tmp_path, ptx)
        assert regs <= 96 and spills == 0, (regs, spills)


def test_chained_build_reads_the_logits_after_the_wait(tmp_path: Path) -> None:
    """PDL chain on: only the bias (a weight) is read before griddepcontrol.wait, the logits
    after it; no release of the next kernel."""
    lines, wait = chained_ptx_at_wait(lambda: k3_ptx(tmp_path, 8))
    assert not any(s.startswith("griddepcontrol.launch_dependents") for s in lines)
    loads = [i for i, s in enumerate(lines) if s.startswith("ld.global")]
    per = K3.num_experts // 32
    assert len([i for i in loads if i < wait]) == per and len([i for i in loads if i > wait]) == per


def test_registered_for_the_device_check() -> None:
    from kimi_decode.kernels import CHECK_MODULES, KERNELS, checks
    assert "router_topk" in KERNELS and CHECK_MODULES["router_topk"] == "router_topk"
    assert "router_topk" in checks.CHECKS


def test_pdl_switch_reaches_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """USE_PDL (the session-14 A/B: router_topk launched as a plain kernel) is read when
    route_logits is called and is part of the compiled configuration (the cache key), so the
    two launch modes never share a build."""
    built: list[rt.RouterTopKConfig] = []
    monkeypatch.setattr(rt, "compile_for", lambda cfg: built.append(cfg) or (lambda *a: None))
    monkeypatch.setattr(rt, "ptr", lambda t: None)
    logits, bias = torch.zeros(8, 896), torch.zeros(896)
    rt.route_logits(logits, bias, 16, 2.5)
    monkeypatch.setattr(rt, "USE_PDL", False)
    rt.route_logits(logits, bias, 16, 2.5)
    assert [c.pdl for c in built] == [True, False] and built[0] != built[1]


def _emulate(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
             drop_bias: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel in torch: router_fast's selection (emulate_select) row by row, in fp32."""
    s = torch.sigmoid(logits.float())
    key = s + (0.0 if drop_bias else bias.float())
    ids, ws = [], []
    for r in range(logits.shape[0]):
        i, w, _ = rf.emulate_select(key[r], s[r], top_k, scaling, rf.RouterFastConfig(0, logits.shape[1], top_k, 1).group_bits)
        ids.append(i)
        ws.append(w)
    return torch.stack(ids).long(), torch.stack(ws).float()


def test_check_runs_on_cpu_and_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    from kimi_decode.kernels import checks
    from kimi_decode.kernels.router import reference
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(rt, "route_logits", _emulate)
    monkeypatch.setattr(rf, "route", lambda y, w, b, k, s, c: (lambda r: (r[0], r[1].float()))(reference(y, w, b, k, s)))
    monkeypatch.setattr(gm, "gemv_mma", lambda x, w, out=None, out_dtype=torch.bfloat16: (x.double() @ w.double().t()).to(out_dtype))
    timed: list[str] = []
    monkeypatch.setattr(checks, "time_us", lambda fn: (fn(), timed.append("t"), 1.0)[2])
    rows = rt.check(timing=True, rows=(2, 8))
    assert [r["M"] for r in rows] == [2, 8] and all(r["ok"] for r in rows), rows
    assert all(r["rows_same_as_stock_op"] == 1.0 and r["kernel_us"] == r["stock_op_us"] == 1.0 for r in rows)
    assert len(timed) == 4
    monkeypatch.setattr(rt, "route_logits", lambda lg, b, k, s: _emulate(lg, b, k, s, drop_bias=True))
    assert not any(r["ok"] for r in rt.check(timing=False, rows=(8,)))


def test_route_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """fused.LatentMoE._route: router_topk on the router GEMM's fp32 logits at 2 ≤ M ≤ 8 when
    enabled; M = 1 and switched off take stock's routing op."""
    from kimi_decode import fused
    calls: list[int] = []

    def fake(lg, b, k, s):
        assert lg.dtype == torch.float32
        calls.append(lg.shape[0])
        return torch.zeros(lg.shape[0], k, dtype=torch.int64), torch.zeros(lg.shape[0], k)
    monkeypatch.setattr(rt, "route_logits", fake)
    routed: list[int] = []
    moe = SimpleNamespace(cfg=SimpleNamespace(top_k=4, routed_scaling=1.0), bias=torch.zeros(64),
                          use_router_fast=False, use_router_kernel=False, use_router_topk=True,
                          _router_mma_applies=lambda y: False,
                          _router_logits=lambda y: torch.zeros(y.shape[0], 64),
                          fx={"route": lambda lg, b, k, s: routed.append(lg.shape[0]) or (None, None)})
    for m in (8, 2, 1):
        fused.LatentMoE._route(moe, torch.zeros(m, 1024))
    moe.use_router_topk = False
    fused.LatentMoE._route(moe, torch.zeros(8, 1024))
    assert calls == [8, 2] and routed == [1, 8]
