"""attn_res_ar: the AttnRes kernel that also finishes the all-reduce (kernels/attn_res.py with
`delta_slots`), on the CPU.

Oracles:
- compile: the variant compiles to sm_90a PTX at the K3 TP16 shapes (world = 16), without
  spills, and its global loads are exactly the 128-bit loads the design counts: world × VPT
  slot loads (each slot vector one ld.global.v4, read once: pass 2 does not re-read the slots)
  plus the plain kernel's; the slot rows are indexed with gridDim.x (M); no full-warp shuffle
  inside a lane-divergent branch (that deadlocked the GPU once).
- reference: `prefix_reference` / `reference` (the check's float64 oracle) against the stock
  path on the CPU: SimComm(world=16).all_reduce then stock_ops.res_mix; prefix' equal, the mix
  within bf16 rounding; a wrong `reset` is told apart.
- harness: check_ar run on the CPU with the kernel replaced by an emulation of its contract
  passes every row; an emulation that ignores the other ranks' slots fails the random-fill
  rows (the check can say no).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

from cutlass import Float32, Int32  # noqa: E402

import kimi_decode.kernels.attn_res as k_ar  # noqa: E402
from kimi_decode import stock_ops  # noqa: E402
from kimi_decode.comm import SimComm  # noqa: E402
from kimi_decode.config import k3_tp16  # noqa: E402
from kimi_decode.kernels import _common, checks  # noqa: E402
from kimi_decode.kernels.attn_res import (AttnResConfig, AttnResRMSNorm, can_implement,  # noqa: E402
                                          prefix_reference, reference, slot_sum)
from kimi_decode.stock import AttnRes  # noqa: E402
from kimi_decode.weights import Seeder  # noqa: E402
from tests.kimi_decode.test_kernels_compile import common_checks, ptx_of, shuffles_in_branches  # noqa: E402

bf, f32 = torch.bfloat16, torch.float32
P = _common.dummy_ptr
WORLD, D, VPT = 16, 7168, 4


def expected_v4_loads(nb: int, reset: bool) -> int:
    """128-bit global loads of one thread in the ar variant (w_mix and norm_w are fp32: two
    vectors per 8 elements, each loaded once up front): w 2, the norm weight 2; pass 1 per
    block source 1, the slots world, the prefix 1 unless reset; pass 2 the blocks again."""
    return VPT * (2 + 2 + nb + WORLD + (0 if reset else 1) + nb)


@pytest.mark.parametrize("nb,reset,write", [(1, False, True), (8, True, False)])
def test_attn_res_ar_compiles(tmp_path: Path, nb: int, reset: bool, write: bool) -> None:
    cfg = AttnResConfig(D, nb, 8, has_delta=True, has_write=write, world=WORLD, reset=reset)
    ptx = ptx_of(tmp_path, AttnResRMSNorm(cfg), P(bf), P(bf), P(bf), P(bf), P(bf), P(f32), P(f32),
                 Int32(1), Int32(0), Float32(1e-5))
    common_checks(ptx)
    assert ptx.count("ld.global.v4") == expected_v4_loads(nb, reset)
    assert ptx.count("ld.global") == ptx.count("ld.global.v4")        # no scalar fallback
    assert ptx.count("st.global.v4") == VPT * (3 if write else 2)     # prefix', out (+ block)
    assert "%nctaid.x" in ptx                                          # slot row r·M + m
    assert not shuffles_in_branches(ptx)


def test_plain_variant_unchanged(tmp_path: Path) -> None:
    """world = 0 keeps the plain kernel: no slot loads, no gridDim read."""
    cfg = AttnResConfig(D, 1, 8, has_delta=True, has_write=False)
    ptx = ptx_of(tmp_path, AttnResRMSNorm(cfg), P(bf), P(bf), P(bf), P(bf), P(bf), P(f32), P(f32),
                 Int32(1), Int32(0), Float32(1e-5))
    # w and norm once (fp32: 2 + 2), block, prefix + delta; pass 2: block, prefix + delta
    assert ptx.count("ld.global.v4") == VPT * (2 + 2 + 1 + 2 + 1 + 2)
    assert "%nctaid.x" not in ptx


def test_can_implement_world() -> None:
    assert can_implement(D, 8, 8, (bf, f32), world=WORLD)
    assert not can_implement(D, 8, 8, (bf, f32), world=64)


def _stock_case(m: int, nb: int, reset: bool, fill: str, seed: int):
    cfg = k3_tp16()
    mod = AttnRes(cfg, Seeder(cfg, torch.device("cpu")).sub("test.attn_res_ar"))
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randn(m, 8, D, generator=g).bfloat16()
    base = torch.randn(m, D, generator=g).bfloat16()
    x = torch.randn(m, D, generator=g).bfloat16()
    comm = SimComm(torch.device("cpu"), WORLD)
    buf = comm._buf("ar", (WORLD, m, D), x)
    if fill == "random":
        buf.copy_(0.25 * torch.randn(WORLD, m, D, generator=g))
    ar = comm.all_reduce(x)                                    # writes x into slot 0, sums
    p_s, x_s = stock_ops.res_mix(base, ar, blocks, mod.w, mod.norm, cfg.rms_eps, nb, reset)
    return mod, cfg, blocks, base, buf, p_s, x_s


@pytest.mark.parametrize("m,nb,reset", [(1, 1, False), (1, 8, True), (3, 8, False), (3, 1, True)])
def test_reference_equals_stock_zero_slots(m: int, nb: int, reset: bool) -> None:
    """The simulation's buffer (other ranks zero): prefix' exactly stock's, mix within bf16."""
    mod, cfg, blocks, base, buf, p_s, x_s = _stock_case(m, nb, reset, "zero", m * 10 + nb)
    assert torch.equal(prefix_reference(base, buf, reset), p_s)
    ref = reference(blocks, nb, base, mod.w, mod.norm, cfg.rms_eps, delta_slots=buf, reset=reset)
    assert checks.rel(x_s, ref) <= 3e-3                         # stock's bf16 output vs float64
    wrong = reference(blocks, nb, base, mod.w, mod.norm, cfg.rms_eps, delta_slots=buf, reset=not reset)
    assert checks.rel(x_s, wrong) > 5e-2


@pytest.mark.parametrize("reset", [False, True])
def test_reference_equals_stock_random_slots(reset: bool) -> None:
    """All 16 slots non-zero (real TP): the slot-order sum vs torch's bf16 sum(0) (fp32
    accumulation, its own order) differ in at most 1e-3 of the elements, by one bf16 step."""
    mod, cfg, blocks, base, buf, p_s, x_s = _stock_case(2, 8, reset, "random", 7)
    p_r = prefix_reference(base, buf, reset)
    diff = p_r != p_s
    assert float(diff.double().mean()) <= 1e-3
    ulp = (p_s.float().abs().clamp_min(1e-30).log2().floor() - 7).exp2()
    assert bool(((p_r.float() - p_s.float()).abs() <= ulp * 1.01)[diff].all())
    ref = reference(blocks, 8, base, mod.w, mod.norm, cfg.rms_eps, delta_slots=buf, reset=reset)
    assert checks.rel(x_s, ref) <= 3e-3


def test_slot_sum_is_ordered_fp32() -> None:
    """slot_sum rounds once: three slots whose bf16 pairwise sums would round differently."""
    s = torch.tensor([[[1.0]], [[2 ** -8]], [[2 ** -8]]], dtype=bf)   # 1 + 2^-8 + 2^-8 = 1 + 2^-7
    assert float(slot_sum(s)) == 1 + 2 ** -7                          # bf16 pairwise: 1 (ties to even)


def _emulate(blocks, num_blocks, prefix, w_mix, norm_w, eps, delta=None, write_slot=None, out=None,
             *, delta_slots=None, reset=False, only_own_slot=False):
    """attn_res_rmsnorm's attn_res_ar contract in torch (the check's kernel stand-in)."""
    assert delta is None and delta_slots is not None
    slots = delta_slots[:1] if only_own_slot else delta_slots
    new_prefix = prefix_reference(prefix, slots, reset)
    mix = reference(blocks, num_blocks, prefix, w_mix, norm_w, eps, delta_slots=slots, reset=reset)
    if write_slot is not None:
        blocks[:, write_slot].copy_(new_prefix)
    return mix.to(torch.bfloat16), new_prefix


def test_check_ar_passes_faithful_emulation(on_cpu) -> None:
    on_cpu.setattr(k_ar, "attn_res_rmsnorm", _emulate)
    rows = k_ar.check_ar(timing=False, rows=(1, 2))
    assert len(rows) == 2 * 2 * (4 + 2)        # fills × M × (nb=1: reset×write, nb=8: reset)
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
    assert {r["fill"] for r in rows} == {"zero", "random"} and {r["reset"] for r in rows} == {False, True}


def test_check_ar_rejects_a_kernel_that_skips_peer_slots(on_cpu) -> None:
    """Summing only this rank's slot is right in the simulation (others zero) and wrong in
    real TP: the zero-fill rows pass, every random-fill row fails."""
    on_cpu.setattr(k_ar, "attn_res_rmsnorm", lambda *a, **k: _emulate(*a, **k, only_own_slot=True))
    rows = k_ar.check_ar(timing=False, rows=(1,), nbs=(1,))
    assert all(r["ok"] for r in rows if r["fill"] == "zero")
    assert not any(r["ok"] for r in rows if r["fill"] == "random")


def test_small_m_variant_runs_more_threads_per_row(tmp_path: Path) -> None:
    """The per-M table: at M ≤ 8 the wrapper compiles 896 threads per row (VPT = 1), each with
    its 16 slot loads as 128-bit loads, no local memory; above, the verified VPT = 4."""
    assert k_ar.ar_vec_per_thread(1, 7168) == 1 and k_ar.ar_vec_per_thread(8, 7168) == 1
    assert k_ar.ar_vec_per_thread(64, 7168) == 4
    cfg = AttnResConfig(7168, 1, 8, True, False, torch.bfloat16, world=16, vec_per_thread=1)
    src = _common.dummy_ptr(torch.bfloat16)
    ptx = ptx_of(tmp_path, AttnResRMSNorm(cfg), _common.dummy_ptr(torch.bfloat16), src, src, src, src,
                 _common.dummy_ptr(torch.float32), _common.dummy_ptr(torch.float32), Int32(1), Int32(0),
                 Float32(1e-5))
    common_checks(ptx)
    assert ".reqntid 896, 1, 1" in ptx
    # 16 slots + 1 prefix + nb=1 block, once each in pass 1 (the block and prefix re-read in pass 2)
    assert ptx.count("ld.global.v4") >= 16
