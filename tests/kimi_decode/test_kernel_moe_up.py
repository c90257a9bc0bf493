"""The MoE-tail kernel (kimi_decode/kernels/moe_up.py) on the CPU: it compiles to sm_90a PTX,
its float64 reference is the stock path's math, and its GPU check runs and can say no.

Oracles:
- PTX: `.target sm_90a`, the 128-bit global loads (weights, slots) and shared-memory vector
  stores/loads the design relies on, one barrier per block_sum + one per chunk, no local-memory
  spills (the 14 weight slices stay in registers), no warp shuffle inside a branch (a shuffle in
  a lane-divergent branch deadlocked the GPU once), and every weight load issued before the
  first barrier (the weight stream overlaps the collective sums).
- reference == stock: SimComm's all_reduce / reduce_scatter_cols + stock_ops.latent_up on the
  CPU (bf16) agree with the float64 reference within bf16 rounding, and a reference with the
  wrong rank does not (the comparison can fail).
- check(): run on the CPU with the kernel replaced by a torch emulation of its rounding points,
  every row passes; an emulation that reads the unused slot `rank` of sh_slots fails.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

from cutlass import Float32, Int32  # noqa: E402

from kimi_decode import stock_ops  # noqa: E402
from kimi_decode.comm import SimComm  # noqa: E402
from kimi_decode.config import k3_tp16  # noqa: E402
from kimi_decode.kernels import _common, checks  # noqa: E402
import kimi_decode.kernels.moe_up as k_up  # noqa: E402
from tests.kimi_decode.test_kernels_compile import ptx_of, shuffles_in_branches  # noqa: E402

bf = torch.bfloat16
P = _common.dummy_ptr
K3 = k3_tp16()
L, D, WORLD = K3.latent_dim, K3.hidden, K3.tp
N = D // WORLD


@pytest.mark.parametrize("warps,m", [(8, 1), (8, 8), (4, 1), (16, 1)])
def test_compiles_to_sm90a(tmp_path: Path, warps: int, m: int) -> None:
    """The default CTA (8 warps) at M = 1 and 8, and the CTA sizes check() also times."""
    assert N == 448 and L == 3584 and WORLD == 16
    cfg = k_up.MoeUpConfig(m, L, N, WORLD, warps)
    ptx = ptx_of(tmp_path, k_up.MoeUp(cfg), P(bf), P(bf), P(bf), P(bf), P(bf), P(bf), Int32(0), Float32(1e-5))
    assert ".target sm_90a" in ptx
    assert f".reqntid {32 * warps}, 1, 1" in ptx            # ptxas fits registers to the CTA size
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert not shuffles_in_branches(ptx)
    lines = [x.strip() for x in ptx.splitlines()]
    v4 = [i for i, x in enumerate(lines) if x.startswith("ld.global.v4")]
    it = -(-(L // 8) // (32 * warps))                       # r vectors per thread per row
    chunk = min(m, k_up.CHUNK, max(1, 8 // it))
    chunks = -(-m // chunk)
    slices = L // 256
    # weight slices + slot vectors (16 slots per r vector) + norm vectors
    assert len(v4) == slices + m * it * WORLD + m * it
    bars = [i for i, x in enumerate(lines) if x.startswith("bar.sync")]
    assert len(bars) == m + chunks + (chunks - 1)           # block_sum per row; per chunk: xn ready, reuse
    assert all(i < bars[0] for i in v4[:slices])          # the weight stream is issued first
    assert sum(x.startswith("st.shared.v4") for x in lines) == it * m
    # xn vectors per weight slice and row, + block_sum's read of the warp sums per row
    assert sum(x.startswith("ld.shared.v4") for x in lines) == slices * m + (warps // 4) * m
    assert sum(x.startswith("st.global") for x in lines) == m


@pytest.mark.parametrize("m", [1, 2])
def test_slot_loads_issued_together(tmp_path: Path, m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """SLOT_LOADS_FIRST: each r vector's WORLD slot loads are one run of loads (after the
    shared partials' conversions), where the first build's load-add order has runs of one."""
    from tests.kimi_decode.test_kernels_compile import load_convert_order
    cfg = k_up.MoeUpConfig(m, L, N, WORLD, k_up.WARPS)

    def longest_run_after_first_convert(sub: str) -> int:
        (tmp_path / sub).mkdir()
        order = load_convert_order(ptx_of(tmp_path / sub, k_up.MoeUp(cfg), P(bf), P(bf), P(bf), P(bf), P(bf),
                                          P(bf), Int32(0), Float32(1e-5)))
        tail = order[order.index("C"):].replace("B", "C")
        return max(len(r) for r in tail.split("C"))
    assert longest_run_after_first_convert("new") >= WORLD
    monkeypatch.setattr(k_up, "SLOT_LOADS_FIRST", False)
    assert longest_run_after_first_convert("old") <= 2


def test_can_implement() -> None:
    assert k_up.can_implement(1, L, N, WORLD, (bf,) * 5)
    assert k_up.can_implement(8, L, N, WORLD, (bf,) * 5)
    assert not k_up.can_implement(9, L, N, WORLD, (bf,) * 5)
    assert not k_up.can_implement(1, 32, 4, 16, (torch.float32,))       # tiny CPU config
    assert not k_up.can_implement(1, L, N, WORLD, (bf, torch.float32))
    assert not k_up.can_implement(1, L, 452, WORLD, (bf,))                 # n % warps
    assert not k_up.can_implement(1, L, N, WORLD, (bf,), warps=7)
    with pytest.raises(ValueError):
        k_up.moe_up(torch.zeros(WORLD, 1, L, dtype=bf), torch.zeros(WORLD, 1, N, dtype=bf),
                    torch.zeros(1, D, dtype=bf), WORLD, torch.ones(L, dtype=bf),
                    torch.zeros(N, L, dtype=bf), 1e-5)


def _inputs(m: int, rank: int, others: bool, L: int = L, n: int = N, world: int = WORLD, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r_slots = torch.zeros(world, m, L, dtype=bf)
    sh_slots = torch.zeros(world, m, n, dtype=bf)
    if others:
        r_slots.copy_(torch.randn(world, m, L, generator=g) * 0.25)
        sh_slots.copy_(torch.randn(world, m, n, generator=g) * 0.25)
    r_loc = torch.randn(m, L, generator=g).to(bf)
    sh_full = torch.randn(m, world * n, generator=g).to(bf)
    r_slots[rank].copy_(r_loc)
    sh_slots[rank].fill_(1.0e4)                                   # never read
    norm = (1.0 + 0.1 * torch.randn(L, generator=g)).to(bf)
    up_rows = (torch.randn(n, L, generator=g) * L ** -0.5).to(bf)
    return r_slots, sh_slots, sh_full, r_loc, norm, up_rows


@pytest.mark.parametrize("m,rank", [(1, 0), (8, 5), (3, 15)])
def test_reference_equals_stock_simcomm(m: int, rank: int) -> None:
    """Other slots zero: SimComm's collectives + stock_ops.latent_up == reference (f64)."""
    r_slots, sh_slots, sh_full, r_loc, norm, up_rows = _inputs(m, rank, others=False)
    comm = SimComm(torch.device("cpu"), WORLD, rank)
    r = comm.all_reduce(r_loc)
    sh = comm.reduce_scatter_cols(sh_full)
    y_s = stock_ops.latent_up(r, norm, up_rows, sh, K3.rms_eps)
    assert y_s.dtype == bf and y_s.shape == (m, N)
    ref = k_up.reference(r_slots, sh_slots, sh_full, rank, norm, up_rows, K3.rms_eps)
    assert checks.rel(y_s, ref) <= 6e-3
    # the comparison can fail: the wrong rank's slice of the shared partial and of the slots
    wrong = k_up.reference(r_slots, sh_slots, sh_full, (rank + 1) % WORLD, norm, up_rows, K3.rms_eps)
    assert checks.rel(y_s, wrong) > 0.1


@pytest.mark.parametrize("m,rank", [(1, 3), (8, 0)])
def test_reference_equals_stock_all_slots(m: int, rank: int) -> None:
    """Every slot non-zero: stock's sums over the same slots + latent_up == reference."""
    r_slots, sh_slots, sh_full, _, norm, up_rows = _inputs(m, rank, others=True, seed=m)
    y_s = k_up.stock(r_slots, sh_slots, sh_full, rank, norm, up_rows, K3.rms_eps)
    ref = k_up.reference(r_slots, sh_slots, sh_full, rank, norm, up_rows, K3.rms_eps)
    assert checks.rel(y_s, ref) <= 6e-3
    # the unused slot holds 1e4: reading it would be far off
    bad_sh = sh_slots.clone()
    bad_sh[rank].copy_(sh_full[:, rank * N:(rank + 1) * N])
    assert torch.equal(k_up.stock(r_slots, bad_sh, sh_full, rank, norm, up_rows, K3.rms_eps), y_s)
    assert checks.rel(k_up.stock(r_slots, sh_slots, sh_full * 0, rank, norm, up_rows, K3.rms_eps), y_s) > 0.1


def emulate(r_slots, sh_slots, sh_full, rank, latent_norm, up_rows, eps, out=None, read_own_slot=False, warps=8):
    """The kernel's contract in torch, with its rounding points (fp32 math, bf16 stores)."""
    n = up_rows.shape[0]
    r = r_slots.float().sum(0).to(bf).float()
    sl = sh_slots.float().clone()
    if not read_own_slot:
        sl[rank] = sh_full[:, rank * n:(rank + 1) * n].float()
    shared = sl.sum(0).to(bf).float()
    rstd = torch.rsqrt(r.pow(2).sum(-1, keepdim=True) / r.shape[-1] + eps)
    xn = (r * rstd * latent_norm.float()).to(bf).float()
    y = (xn @ up_rows.float().t()).to(bf).float()
    part = (y + shared).to(bf)
    if out is not None:
        out.copy_(part)
        return out
    return part


def test_emulation_matches_reference_small() -> None:
    """A non-K3 shape too (the emulation and reference do not depend on K3 sizes)."""
    r_slots, sh_slots, sh_full, _, norm, up_rows = _inputs(2, 1, others=True, L=256, n=8, world=4)
    ref = k_up.reference(r_slots, sh_slots, sh_full, 1, norm, up_rows, 1e-5)
    assert checks.rel(emulate(r_slots, sh_slots, sh_full, 1, norm, up_rows, 1e-5), ref) <= 6e-3


def test_check_runs_and_can_fail(monkeypatch) -> None:
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(k_up, "moe_up", emulate)
    rows = k_up.check(timing=False)
    assert len(rows) == 8 and {r["M"] for r in rows} == {1, 8}
    assert all(r["ok"] for r in rows), rows
    assert all(r["kernel"] == "moe_up" and "w4_rel_vs_stock" in r for r in rows)
    monkeypatch.setattr(k_up, "moe_up", lambda *a, **k: emulate(*a, **k, read_own_slot=True))
    assert not any(r["ok"] for r in k_up.check(timing=False))
