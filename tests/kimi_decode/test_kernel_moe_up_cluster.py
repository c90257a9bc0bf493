"""moe_up_cluster (kernels/moe_up_cluster.py): the MoE tail at 1 ≤ M ≤ 8 with the slot sums
shared over clusters of 8 CTAs, on the CPU.

Oracles:
- PTX: compiles to sm_90a at M = 1, 2, 4, 8 with a cluster launch's barriers (one relaxed arrive
  at entry, one release arrive, two waits), 128-bit distributed-shared-memory stores (each r
  vector to all 8 CTAs) and one scalar store per Σ r² partial, no atomics (no grid barrier),
  moe_up_grid's 28 mma per warp, no spills; ptxas (where installed, always under CI) keeps the
  pass-by-pass build at ≤ 128 registers, below moe_up_grid's 168 at M = 8, and the default
  loads-first build without spills; chained, only the weights and the norm
  are loaded before the wait and nothing is stored;
- phase1_item over the whole K3 grid covers every (row, vector) exactly once per cluster, each
  by a thread of the CTA that owns the vector's share;
- the emulation of its rounding points equals the float64 reference (moe_up.reference) within
  bf16 tolerance, the stock ops (moe_up.stock) within the check's 1e-2, and moe_up_grid's
  emulation closely (only Σ r²'s order differs);
- check() (the GPU check) runs on the CPU with the kernels replaced by emulations and passes;
  an emulation that skips the shared add makes it fail;
- fused: the tail takes the kernel at 2 ≤ M ≤ 8 once it is on (M = 1 keeps moe_up,
  UP_CLUSTER_MIN_ROWS), and never when off; it is in the default set.
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
import kimi_decode.kernels.moe_up_cluster as kc  # noqa: E402
import kimi_decode.kernels.moe_up_grid as k_upg  # noqa: E402
from kimi_decode.config import k3_tp16  # noqa: E402
from kimi_decode.kernels import _common, chain, checks  # noqa: E402
from tests.kimi_decode.ptxas_tool import ptxas_path, ptxas_usage  # noqa: E402
from tests.kimi_decode.test_kernels_compile import common_checks, ptx_of, shuffles_in_branches  # noqa: E402

bf = torch.bfloat16
P = _common.dummy_ptr
K3 = k3_tp16()
N = K3.hidden // K3.tp


def cluster_ptx(tmp_path: Path, m: int) -> str:
    cfg = k_up.MoeUpConfig(m, K3.latent_dim, N, K3.tp, k_up.WARPS)
    return ptx_of(tmp_path, kc.MoeUpCluster(cfg), P(bf), P(bf), P(bf), P(bf), P(bf), P(bf), Int32(0),
                  Float32(1e-5))


def _instr(ptx: str) -> list[str]:
    return [s.strip() for s in ptx.splitlines() if s.strip() and not s.strip().startswith("//")]


@pytest.mark.parametrize("loads_first", [True, False])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_compiles_with_cluster_barriers_and_dsmem_stores(tmp_path: Path, m: int, loads_first: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kc, "ALL_PASSES_LOADS_FIRST", loads_first)
    ptx = cluster_ptx(tmp_path, m)
    common_checks(ptx)
    assert not shuffles_in_branches(ptx)          # a full-warp shuffle in a branch hangs the GPU
    lines = _instr(ptx)
    passes = -(-m // 4)                                # 4 row groups of 64 threads
    assert sum(s.startswith("st.shared::cluster.v4") for s in lines) == passes * kc.CL
    assert sum(s.startswith("st.shared::cluster.b32") for s in lines) == 1
    assert sum(s.startswith("barrier.cluster.arrive.relaxed") for s in lines) == 1
    assert sum(s.startswith("barrier.cluster.arrive;") for s in lines) == 1
    assert sum(s.startswith("barrier.cluster.wait") for s in lines) == 2
    assert not any(s.startswith(("atom.", "red.", "ld.acquire")) for s in lines)     # no grid barrier
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 28
    # the remote stores come after the start barrier's wait, the reads of them after the second
    first_wait = next(i for i, s in enumerate(lines) if s.startswith("barrier.cluster.wait"))
    first_remote = next(i for i, s in enumerate(lines) if s.startswith("st.shared::cluster"))
    assert first_wait < first_remote
    if ptxas_path() is not None:
        regs, spills = ptxas_usage(tmp_path, ptx)
        # both passes' 32 slot vectors in flight at once (M > 4, loads first) take ~240
        # registers: one CTA per SM, which the 56-CTA grid is anyway; pass by pass fits 128
        limit = 255 if loads_first and m > 4 else 128
        assert regs <= limit and spills == 0, (regs, spills)


def test_all_passes_loads_first_compiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default since session 38 (the switch's A/B, bench/fused_runs.md): both passes' 32 slot
    loads issued before the first add at M = 8."""
    monkeypatch.setattr(kc, "ALL_PASSES_LOADS_FIRST", True)
    ptx = cluster_ptx(tmp_path, 8)
    common_checks(ptx)
    lines = _instr(ptx)
    first_cvt = next(i for i, s in enumerate(lines) if s.startswith("cvt.f32.bf16"))
    slot_loads = [i for i, s in enumerate(lines) if s.startswith("ld.global.v4")]
    # 14 weight + 2 norm loads, then 2 × 16 slot vectors: all before the first conversion
    assert sum(i < first_cvt for i in slot_loads) >= 14 + 2 + 2 * K3.tp


def test_chained_loads_only_constants_before_the_wait(tmp_path: Path) -> None:
    chain.set_chain(True, 0)
    try:
        lines = _instr(cluster_ptx(tmp_path, 8))
    finally:
        chain.set_chain(False, chain.DEFAULT_BUDGET)
    wait = next(i for i, s in enumerate(lines) if s.startswith("griddepcontrol.wait"))
    head = lines[:wait]
    nv = K3.latent_dim // 8
    # the warp's 14 weight fragments and the thread's 2 norm vectors (448 vectors, 256 threads)
    assert sum(s.startswith("ld.global") for s in head) == nv // 8 // 4 + 2
    assert not any(s.startswith(("st.global", "st.shared::cluster", "atom.")) for s in head)
    assert any(s.startswith("griddepcontrol.launch_dependents") for s in lines[wait:])


@pytest.mark.parametrize("m", [1, 3, 4, 5, 8])
def test_phase1_items_cover_every_vector_once_per_cluster(m: int) -> None:
    nv = K3.latent_dim // 8
    threads = k_up.WARPS * 32
    per, gt, rg = kc.shares(nv, threads)
    assert (per, gt, rg) == (56, 64, 4)
    wpg = gt // 32
    seen: list[tuple[int, int]] = []
    for q in range(kc.CL):
        for w in range(k_up.WARPS):
            for ln in range(32):
                for p in range(-(-m // rg)):
                    row, c, cc = kc.phase1_item(q, w, ln, p, per, wpg, rg)
                    if row < m and cc < per:
                        assert q * per <= c < (q + 1) * per          # the CTA's own share
                        seen.append((row, c))
    assert sorted(seen) == [(r, c) for r in range(m) for c in range(nv)]


def test_can_implement() -> None:
    dts = (bf,) * 5
    for m in range(1, 9):
        assert kc.can_implement(m, K3.latent_dim, N, K3.tp, dts)
    assert not kc.can_implement(9, K3.latent_dim, N, K3.tp, dts)
    assert not kc.can_implement(8, K3.latent_dim, N, K3.tp, dts, warps=4)       # the mma's 8 warps
    assert not kc.can_implement(8, K3.latent_dim, 8 * 60, K3.tp, dts)          # 60 CTAs: not whole clusters
    assert not kc.can_implement(8, K3.latent_dim, 8 * 200, K3.tp, dts)         # 200 CTAs: past one per SM
    assert not kc.can_implement(2, K3.latent_dim, N, K3.tp, (torch.float16,) * 5)


def _inputs(m: int, rank: int, L: int = 4096, n: int = 16, world: int = 4):
    gen = torch.Generator().manual_seed(10 * m + rank)
    r_slots = (torch.randn(world, m, L, generator=gen) * 0.5).bfloat16()
    sh_slots = (torch.randn(world, m, n, generator=gen) * 0.5).bfloat16()
    sh_full = torch.randn(m, world * n, generator=gen).bfloat16()
    norm = (1 + 0.1 * torch.randn(L, generator=gen)).bfloat16()
    up_rows = (torch.randn(n, L, generator=gen) * L ** -0.5).bfloat16()
    return r_slots, sh_slots, sh_full, norm, up_rows


@pytest.mark.parametrize("m,rank", [(1, 0), (2, 1), (8, 3)])
def test_emulation_matches_reference_stock_and_the_grid_kernel(m: int, rank: int) -> None:
    r_slots, sh_slots, sh_full, norm, up_rows = _inputs(m, rank)
    args = (r_slots, sh_slots, sh_full, rank, norm, up_rows, 1e-5)
    y = kc.emulate(*args)
    assert checks.rel(y, k_up.reference(*args)) <= 6e-3
    assert checks.rel(y, k_up.stock(*args)) <= 1e-2
    assert checks.rel(y, k_upg.emulate(*args)) <= 2e-3


def _fake_kernel(skip_shared: bool = False):
    def run(r_slots, sh_slots, sh_full, rank, norm, up_rows, eps, out=None, warps=8):
        if skip_shared:
            sh_slots, sh_full = sh_slots * 0, sh_full * 0
        y = kc.emulate(r_slots, sh_slots, sh_full, rank, norm, up_rows, eps)
        if out is not None:
            out.copy_(y)
            return out
        return y
    return run


def _fake_grid(r_slots, sh_slots, sh_full, rank, norm, up_rows, eps, scratch, out=None, warps=8):
    y = k_upg.emulate(r_slots, sh_slots, sh_full, rank, norm, up_rows, eps)
    if out is not None:
        out.copy_(y)
        return out
    return y


def test_check_runs_and_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.kimi_decode.test_kernel_moe_up import emulate as emulate_one
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(k_up, "moe_up", emulate_one)
    monkeypatch.setattr(k_upg, "moe_up_grid", _fake_grid)
    monkeypatch.setattr(kc, "moe_up_cluster", _fake_kernel())
    rows = kc.check(timing=False)
    assert len(rows) == 16 and {r["M"] for r in rows} == {1, 2, 4, 8}
    assert all(r["ok"] for r in rows), rows
    monkeypatch.setattr(kc, "moe_up_cluster", _fake_kernel(skip_shared=True))
    assert not any(r["ok"] for r in kc.check(timing=False))


def test_wrapper_refuses_shapes_it_cannot_run() -> None:
    r_slots, sh_slots, sh_full, norm, up_rows = _inputs(2, 0, L=K3.latent_dim, n=N, world=K3.tp)
    with pytest.raises(ValueError, match="cannot run M=2"):
        kc.moe_up_cluster(r_slots, sh_slots, sh_full, 0, norm, up_rows[:, :1024].contiguous(), 1e-5)
    with pytest.raises(ValueError, match="cannot run M=2"):
        kc.moe_up_cluster(r_slots, sh_slots, sh_full, K3.tp, norm, up_rows, 1e-5)


def test_fused_tail_takes_the_cluster_kernel_only_when_on() -> None:
    """LatentMoE._up_applies / _up_cluster_applies: with use_up_cluster (enable() sets it from
    "moe_up_cluster" in the kernel set) every M ≤ 8 takes the kernel, needing no grid scratch;
    without it the old rule (moe_up at M ≤ 2, moe_up_grid with its scratch above)."""
    from types import SimpleNamespace

    from kimi_decode import fused
    rt = SimpleNamespace(comm=SimpleNamespace(world=K3.tp))
    up = torch.zeros(1, dtype=bf)

    def moe(on: bool) -> SimpleNamespace:
        m = SimpleNamespace(cfg=K3, rt=rt, up=up, up_grid_scratch=None, use_up_cluster=on)
        m._up_cluster_applies = lambda y: fused.LatentMoE._up_cluster_applies(m, y)
        return m

    def x(m: int) -> torch.Tensor:
        return torch.zeros(m, K3.hidden, dtype=bf)
    for m in range(2, 9):
        assert fused.LatentMoE._up_cluster_applies(moe(True), x(m))
        assert fused.LatentMoE._up_applies(moe(True), x(m))
        assert not fused.LatentMoE._up_cluster_applies(moe(False), x(m))
    assert not fused.LatentMoE._up_cluster_applies(moe(True), x(1))   # moe_up (UP_CLUSTER_MIN_ROWS)
    assert fused.LatentMoE._up_applies(moe(True), x(1))
    assert not fused.LatentMoE._up_applies(moe(False), x(8))        # no grid scratch: stock tail
    assert not fused.LatentMoE._up_cluster_applies(moe(True), x(16))
    # in the default set since session 38 (the A/B in bench/fused_runs.md), with its loads first
    assert "moe_up_cluster" in fused.DEFAULT_KERNELS and "moe_up_cluster" not in fused.OPT_IN
    assert kc.ALL_PASSES_LOADS_FIRST


def test_fused_tail_keeps_moe_up_below_the_min_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """UP_CLUSTER_MIN_ROWS (default 2, bench/fused_runs.md sessions 37-38): M = 1 keeps moe_up,
    every 2 ≤ M ≤ 8 takes the cluster kernel; the knob at 1 gives M = 1 the kernel too."""
    import types

    import kimi_decode.fused as fused
    m = types.SimpleNamespace(use_up_cluster=True, cfg=K3, up=torch.zeros(1, dtype=bf),
                              rt=types.SimpleNamespace(comm=types.SimpleNamespace(world=K3.tp)))

    def took() -> list[bool]:
        return [fused.LatentMoE._up_cluster_applies(m, torch.zeros(r, K3.hidden, dtype=bf)) for r in range(1, 9)]
    assert fused.UP_CLUSTER_MIN_ROWS == 2 and took() == [False] + [True] * 7
    monkeypatch.setattr(fused, "UP_CLUSTER_MIN_ROWS", 1)
    assert took() == [True] * 8
