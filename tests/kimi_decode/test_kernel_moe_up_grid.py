"""moe_up_grid (kernels/moe_up_grid.py): the MoE tail at 2 ≤ M ≤ 8 with a grid-wide reduction, on
the CPU.

Oracles:
- PTX: compiles to sm_90a at M = 2, 4, 8 with the grid barrier's two atomics (arrival, epoch
  bump), no local-memory spills; ptxas (where installed, always under CI) keeps it at one CTA of
  256 threads per SM or better (≤ 255 registers), so the 56 CTAs the barrier needs co-resident
  fit on 132 SMs many times over;
- the emulation of its rounding points equals the float64 reference (moe_up.reference) within
  bf16 tolerance and the stock ops (moe_up.stock) within the check's 1e-2;
- check() (the GPU check) runs on the CPU with the kernels replaced by emulations and passes;
  an emulation that skips the shared add, or one that leaves the barrier's counter non-zero,
  makes it fail.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

from cutlass import Float32, Int32  # noqa: E402

import kimi_decode.kernels.moe_up as k_up  # noqa: E402
import kimi_decode.kernels.moe_up_grid as g  # noqa: E402
from kimi_decode.config import k3_tp16  # noqa: E402
from kimi_decode.kernels import _common, checks  # noqa: E402
from tests.kimi_decode.ptxas_tool import ptxas_path, ptxas_usage  # noqa: E402
from tests.kimi_decode.test_kernels_compile import common_checks, load_convert_order, ptx_of  # noqa: E402

bf = torch.bfloat16
P = _common.dummy_ptr
K3 = k3_tp16()
N = K3.hidden // K3.tp


def grid_ptx(tmp_path: Path, m: int) -> str:
    cfg = k_up.MoeUpConfig(m, K3.latent_dim, N, K3.tp, k_up.WARPS)
    return ptx_of(tmp_path, g.MoeUpGrid(cfg), P(bf), P(bf), P(bf), P(bf), P(bf), P(bf), P(bf),
                  P(torch.float32), P(torch.int32), Int32(0), Float32(1e-5))


@pytest.mark.parametrize("m", [2, 4, 8])
def test_compiles_with_one_grid_barrier(tmp_path: Path, m: int) -> None:
    ptx = grid_ptx(tmp_path, m)
    common_checks(ptx)
    assert ptx.count("atom.") == 2                     # the arrival and the epoch bump
    assert "ld.acquire.gpu" in ptx                     # the epoch poll
    if ptxas_path() is not None:
        regs, spills = ptxas_usage(tmp_path, ptx)
        assert regs <= 255 and spills == 0, (regs, spills)


@pytest.mark.parametrize("m", [2, 8])
def test_dots_on_the_tensor_cores_and_slot_loads_first(tmp_path: Path, m: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """DOTS_MMA: 2 mma per lane vector (14 at L = 3584: 28 mma.sync, 14 shared-memory vector
    loads of xn per warp) and no fp32 FMA dot products; SLOT_LOADS_FIRST: phase 1's world slot
    loads issued with the others before any conversion. The first build's structure fails
    both."""
    (tmp_path / "new").mkdir()
    (tmp_path / "old").mkdir()
    ptx = grid_ptx(tmp_path / "new", m)
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 28
    assert ptx.count("ld.shared.v4") == 14
    # before the grid barrier's first bar.sync: every load (weights, shared partials, the
    # world slots), then phase 1's adds; no load waits behind a conversion
    order = load_convert_order(ptx)
    head = order[:order.index("B")]
    assert "CL" not in head and head.count("L") >= K3.tp, head
    monkeypatch.setattr(g, "DOTS_MMA", False)
    monkeypatch.setattr(g, "SLOT_LOADS_FIRST", False)
    old = grid_ptx(tmp_path / "old", m)
    assert "mma.sync" not in old
    old_order = load_convert_order(old)
    assert "CL" in old_order[:old_order.index("B")]


@pytest.mark.parametrize("spread", [False, True])
@pytest.mark.parametrize("m", [2, 5, 8])
def test_phase1_items_cover_every_vector_once(m: int, spread: bool) -> None:
    """phase1_item over the whole K3 grid (56 CTAs × 8 warps × 32 lanes): every r vector of
    [M, L/8] exactly once; a warp's 32 lanes are 32 consecutive vectors of one row (its Σ r²
    partial is wss[item // 32]); with spread, the busy warps are spread so that no CTA holds
    more than ceil(busy warps / CTAs) of them (at M = 8: 2 per CTA instead of 8 in 14 CTAs)."""
    nv = K3.latent_dim // 8
    ctas, warps = N // k_up.WARPS, k_up.WARPS
    items = m * nv
    seen: list[int] = []
    busy_per_cta = [0] * ctas
    for b in range(ctas):
        for w in range(warps):
            lanes = [g.phase1_item(b, w, ln, ctas, warps, spread) for ln in range(32)]
            assert lanes == list(range(lanes[0], lanes[0] + 32)) and lanes[0] % 32 == 0
            if lanes[0] < items:
                assert lanes[0] // nv == lanes[-1] // nv          # one row
                busy_per_cta[b] += 1
                seen += lanes
    assert sorted(seen) == list(range(items))
    busy = items // 32
    if spread:
        assert max(busy_per_cta) == -(-busy // ctas)
    else:
        assert max(busy_per_cta) == min(warps, busy)


def test_phase1_spread_compiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(g, "PHASE1_SPREAD", True)
    ptx = grid_ptx(tmp_path, 8)
    common_checks(ptx)
    assert ptx.count("atom.") == 2
    order = load_convert_order(ptx)
    assert "CL" not in order[:order.index("B")]
    if ptxas_path() is not None:
        regs, spills = ptxas_usage(tmp_path, ptx)
        assert regs <= 255 and spills == 0, (regs, spills)


def test_can_implement() -> None:
    dts = (bf,) * 5
    for m in range(2, 9):
        assert g.can_implement(m, K3.latent_dim, N, K3.tp, dts)
    assert not g.can_implement(1, K3.latent_dim, N, K3.tp, dts)      # M = 1: moe_up
    assert not g.can_implement(9, K3.latent_dim, N, K3.tp, dts)
    assert not g.can_implement(8, K3.latent_dim, 8 * 200, K3.tp, dts)  # 200 CTAs: not all resident
    assert not g.can_implement(8, 4096, 16, 4, dts)                    # 2 CTAs: too few threads for M·L/8


def _inputs(m: int, rank: int, L: int = 512, n: int = 16, world: int = 4):
    gen = torch.Generator().manual_seed(10 * m + rank)
    r_slots = (torch.randn(world, m, L, generator=gen) * 0.5).bfloat16()
    sh_slots = (torch.randn(world, m, n, generator=gen) * 0.5).bfloat16()
    sh_full = torch.randn(m, world * n, generator=gen).bfloat16()
    norm = (1 + 0.1 * torch.randn(L, generator=gen)).bfloat16()
    up_rows = (torch.randn(n, L, generator=gen) * L ** -0.5).bfloat16()
    return r_slots, sh_slots, sh_full, norm, up_rows


@pytest.mark.parametrize("m,rank", [(2, 0), (8, 3)])
def test_emulation_matches_reference_and_stock(m: int, rank: int) -> None:
    r_slots, sh_slots, sh_full, norm, up_rows = _inputs(m, rank)
    args = (r_slots, sh_slots, sh_full, rank, norm, up_rows, 1e-5)
    y = g.emulate(*args)
    assert checks.rel(y, k_up.reference(*args)) <= 6e-3
    assert checks.rel(y, k_up.stock(*args)) <= 1e-2


def _fake_kernel(skip_shared: bool = False, leave_counter: bool = False):
    def run(r_slots, sh_slots, sh_full, rank, norm, up_rows, eps, scratch, out=None, warps=8):
        y = g.emulate(r_slots, sh_slots, sh_full, rank, norm, up_rows, eps)
        if skip_shared:
            y = g.emulate(r_slots, sh_slots * 0, sh_full * 0, rank, norm, up_rows, eps)
        scratch.sync[1] += 1
        if leave_counter:
            scratch.sync[0] = 1
        if out is not None:
            out.copy_(y)
            return out
        return y
    return run


def test_check_runs_and_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.kimi_decode.test_kernel_moe_up import emulate as emulate_one
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(k_up, "moe_up", emulate_one)
    monkeypatch.setattr(g, "moe_up_grid", _fake_kernel())
    rows = g.check(timing=False)
    assert len(rows) == 12 and {r["M"] for r in rows} == {2, 4, 8}
    assert all(r["ok"] for r in rows), rows
    monkeypatch.setattr(g, "moe_up_grid", _fake_kernel(skip_shared=True))
    assert not any(r["ok"] for r in g.check(timing=False))
    monkeypatch.setattr(g, "moe_up_grid", _fake_kernel(leave_counter=True))
    assert not any(r["ok"] for r in g.check(timing=False))


def test_wrapper_refuses_bad_scratch() -> None:
    r_slots, sh_slots, sh_full, norm, up_rows = _inputs(2, 0, L=K3.latent_dim, n=N, world=K3.tp)
    with pytest.raises(ValueError, match="scratch is not make_scratch"):
        g.moe_up_grid(r_slots, sh_slots, sh_full, 0, norm, up_rows, 1e-5, g.make_scratch(4, K3.latent_dim, "cpu"))
    with pytest.raises(ValueError, match="cannot run M=1"):
        g.moe_up_grid(r_slots[:, :1].contiguous(), sh_slots[:, :1].contiguous(), sh_full[:1].contiguous(), 0,
                      norm, up_rows, 1e-5, g.make_scratch(1, K3.latent_dim, "cpu"))


def test_fused_tail_picks_the_grid_kernel_between_2_and_8_rows() -> None:
    """LatentMoE._up_applies: M ≤ MAX_ROWS["moe_up"] (2) is moe_up's; above, up to 8, only with
    the scratch enable() made for that M (kernel "moe_up_grid" on), never past 8."""
    from types import SimpleNamespace

    from kimi_decode import fused
    rt = SimpleNamespace(comm=SimpleNamespace(world=K3.tp))
    up = torch.zeros(1, dtype=bf)

    def applies(m: int, scratch_rows: int | None) -> bool:
        sc = None if scratch_rows is None else g.make_scratch(scratch_rows, K3.latent_dim, "cpu")
        moe = SimpleNamespace(cfg=K3, rt=rt, up=up, up_grid_scratch=sc, use_up_cluster=False)
        moe._up_cluster_applies = lambda y: fused.LatentMoE._up_cluster_applies(moe, y)
        return fused.LatentMoE._up_applies(moe, torch.zeros(m, K3.hidden, dtype=bf))
    assert fused.MAX_ROWS["moe_up"] == 2
    assert applies(1, None) and applies(2, None)
    assert not applies(8, None) and not applies(3, None)
    assert applies(8, 8) and applies(3, 3)
    assert not applies(4, 8)          # scratch made for another M
    assert not applies(16, 16)
