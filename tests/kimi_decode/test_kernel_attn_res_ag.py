"""attn_res_ag: the AttnRes kernel that also finishes the all-gather (kernels/attn_res.py with
`delta_gather`), on the CPU.

Oracles:
- compile: the variant compiles to sm_90a PTX at the K3 TP16 shapes (world 16, n = 448),
  without spills; its global loads are exactly the plain has_delta kernel's 128-bit loads
  (the gathered delta costs one ld.global.v4 per vector, as a plain delta row does), the
  buffer rows are indexed with gridDim.x (row s·M + m) and stride n = 448 (896 bytes); no
  full-warp shuffle inside a lane-divergent branch.
- structure: every variant (plain, has_delta/write, attn_res_ar, attn_res_ag) reduces in two
  passes (four CTA barriers whatever nb) with all of pass 1's loads before the first barrier.
- reference: `reference(delta_gather=)` / `gather_cols` (the check's oracles) against the stock
  path on the CPU: SimComm(world=16).all_gather_cols then stock_ops.res_mix; prefix' equal,
  the mix within bf16 rounding; a misaddressed gather (the buffer read as a plain [M, D] row)
  is told apart.
- harness: check_ag on the CPU with the kernel replaced by an emulation of its contract passes
  every row; the misaddressed emulation fails the M > 1 random-fill rows (the check can say no).
"""
from __future__ import annotations

import os
import re
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
                                          gather_cols, reference)
from kimi_decode.stock import AttnRes  # noqa: E402
from kimi_decode.weights import Seeder  # noqa: E402
from tests.kimi_decode.test_kernels_compile import common_checks, ptx_of, shuffles_in_branches  # noqa: E402

bf, f32 = torch.bfloat16, torch.float32
P = _common.dummy_ptr
WORLD, D, VPT = 16, 7168, 4
N = D // WORLD                         # 448: this rank's all-gather slice


def _args() -> tuple:
    return (P(bf), P(bf), P(bf), P(bf), P(bf), P(f32), P(f32), Int32(1), Int32(0), Float32(1e-5))


@pytest.mark.parametrize("nb,write", [(1, True), (8, False)])
def test_attn_res_ag_compiles(tmp_path: Path, nb: int, write: bool) -> None:
    cfg = AttnResConfig(D, nb, 8, has_delta=True, has_write=write, gather=N)
    ptx = ptx_of(tmp_path, AttnResRMSNorm(cfg), *_args())
    common_checks(ptx)
    # w and the norm weight once up front (fp32: 2 vectors per 8 elements each); pass 1: each
    # block source, prefix + delta; pass 2: the blocks, prefix + delta
    assert ptx.count("ld.global.v4") == VPT * (2 + 2 + nb + 2 + nb + 2)
    assert ptx.count("ld.global") == ptx.count("ld.global.v4")        # no scalar fallback
    assert ptx.count("st.global.v4") == VPT * (3 if write else 2)     # prefix', out (+ block)
    assert "%nctaid.x" in ptx                                          # buffer row s·M + m
    assert re.search(r"mad\.lo\.s32\s+%r\d+, %r\d+, 448,", ptx)        # buffer row stride n
    assert not shuffles_in_branches(ptx)


@pytest.mark.parametrize("kw", [dict(has_delta=False, has_write=False),
                                dict(has_delta=True, has_write=True),
                                dict(has_delta=True, has_write=False, world=WORLD),
                                dict(has_delta=True, has_write=True, world=WORLD, reset=True),
                                dict(has_delta=True, has_write=False, gather=N)],
                         ids=["plain", "delta_write", "ar", "ar_reset_write", "ag"])
@pytest.mark.parametrize("nb", [1, 8])
def test_two_reductions_whatever_the_sources(tmp_path: Path, kw: dict, nb: int) -> None:
    """Every variant reduces all 2·(nb + 1) pass-1 sums in one pass and Σh² in another: four
    CTA barriers in all, whatever nb (the earlier kernel had one barrier per sum, 2·(nb+1) + 1,
    with each source's loads issued only after the previous source's barriers), and no global
    load after the first barrier except pass 2's re-reads of the stored blocks and prefix."""
    ptx = ptx_of(tmp_path, AttnResRMSNorm(AttnResConfig(D, nb, 8, **kw)), *_args())
    assert ptx.count("bar.sync") == 4
    first_bar = ptx.index("bar.sync")
    loads_before = ptx[:first_bar].count("ld.global.v4")
    world = kw.get("world", 0)
    own = 0 if kw.get("reset") else 1
    delta = 1 if kw["has_delta"] and not world else 0
    # before the first barrier: w and norm (2 + 2), every source of pass 1
    assert loads_before == VPT * (4 + nb + own + delta + world)


def test_can_implement_gather() -> None:
    assert can_implement(D, 8, 8, (bf, f32), gather=N)
    assert not can_implement(D, 8, 8, (bf, f32), gather=N + 4)        # not a multiple of 8
    assert not can_implement(D, 8, 8, (bf, f32), gather=D // 7 + 8)   # does not divide D
    assert not can_implement(D, 8, 8, (bf, f32), world=WORLD, gather=N)


def test_wrapper_rejects_bad_calls() -> None:
    """Shape and mode errors are raised before anything compiles or launches."""
    m = 2
    blocks, base = torch.zeros(m, 8, D, dtype=bf), torch.zeros(m, D, dtype=bf)
    w, nw, ag = torch.zeros(D), torch.zeros(D), torch.zeros(WORLD, m, N, dtype=bf)
    call = k_ar.attn_res_rmsnorm
    with pytest.raises(ValueError):
        call(blocks, 1, base, w, nw, 1e-5, delta=base, delta_gather=ag)
    with pytest.raises(ValueError):
        call(blocks, 1, base, w, nw, 1e-5, delta_slots=ag, delta_gather=ag)
    with pytest.raises(ValueError):
        call(blocks, 1, base, w, nw, 1e-5, delta_gather=ag, reset=True)
    with pytest.raises(ValueError):
        call(blocks, 1, base, w, nw, 1e-5, delta_gather=ag[:, :1])
    with pytest.raises(ValueError):
        call(blocks, 1, base, w, nw, 1e-5, delta_gather=torch.zeros(WORLD, m, N - 8, dtype=bf))
    with pytest.raises(ValueError):
        call(blocks, 2, base, w, nw, 1e-5, delta_gather=ag, write_slot=1)


def _stock_case(m: int, nb: int, fill: str, seed: int, rank: int = 0):
    cfg = k3_tp16()
    mod = AttnRes(cfg, Seeder(cfg, torch.device("cpu")).sub("test.attn_res_ag"))
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randn(m, 8, D, generator=g).bfloat16()
    base = torch.randn(m, D, generator=g).bfloat16()
    x = torch.randn(m, N, generator=g).bfloat16()
    comm = SimComm(torch.device("cpu"), WORLD, rank=rank)
    buf = comm.ag_slots((m, N), x)
    if fill == "random":
        buf.copy_(torch.randn(WORLD, m, N, generator=g))
    gathered = comm.all_gather_cols(x)                         # writes x into slot `rank`, cats
    p_s, x_s = stock_ops.res_mix(base, gathered, blocks, mod.w, mod.norm, cfg.rms_eps, nb, False)
    return mod, cfg, blocks, base, buf, p_s, x_s


def _misaddressed(buf: torch.Tensor) -> torch.Tensor:
    """The gather buffer read as if it were the [M, D] row itself (the addressing bug)."""
    return buf.reshape(buf.shape[1], -1)


@pytest.mark.parametrize("m,nb,fill,rank", [(1, 1, "zero", 0), (1, 8, "random", 3), (3, 8, "zero", 5),
                                            (3, 1, "random", 0)])
def test_reference_equals_stock(m: int, nb: int, fill: str, rank: int) -> None:
    mod, cfg, blocks, base, buf, p_s, x_s = _stock_case(m, nb, fill, m * 10 + nb, rank)
    assert torch.equal(base + gather_cols(buf), p_s)          # prefix' exactly stock's
    ref = reference(blocks, nb, base, mod.w, mod.norm, cfg.rms_eps, delta_gather=buf)
    assert checks.rel(x_s, ref) <= 3e-3                       # stock's bf16 output vs float64
    if m > 1:                                                 # M = 1: same memory, no bug to see
        assert not torch.equal(base + _misaddressed(buf), p_s)
        wrong = reference(blocks, nb, base, mod.w, mod.norm, cfg.rms_eps, delta=_misaddressed(buf))
        assert checks.rel(x_s, wrong) > 1e-2


def test_gather_cols_layout() -> None:
    """gather_cols(ag)[m, s·n + j] = ag[s, m, j], the kernel's addressing, element by element."""
    ag = torch.arange(4 * 3 * 16, dtype=f32).reshape(4, 3, 16)
    g = gather_cols(ag)
    assert g.shape == (3, 64)
    for m in range(3):
        for col in range(64):
            assert g[m, col] == ag[col // 16, m, col % 16]


def _emulate(blocks, num_blocks, prefix, w_mix, norm_w, eps, delta=None, write_slot=None, out=None,
             *, delta_slots=None, reset=False, delta_gather=None, misaddress=False):
    """attn_res_rmsnorm's attn_res_ag contract in torch (the check's kernel stand-in)."""
    if delta_gather is None:                  # the timing-only plain call (not reached: timing off)
        raise AssertionError("check_ag must call the kernel with delta_gather")
    assert delta is None and delta_slots is None and not reset
    d = _misaddressed(delta_gather) if misaddress else gather_cols(delta_gather)
    new_prefix = prefix + d
    mix = reference(blocks, num_blocks, prefix, w_mix, norm_w, eps, delta=d)
    if write_slot is not None:
        blocks[:, write_slot].copy_(new_prefix)
    return mix.to(torch.bfloat16), new_prefix


def test_check_ag_passes_faithful_emulation(on_cpu) -> None:
    on_cpu.setattr(k_ar, "attn_res_rmsnorm", _emulate)
    rows = k_ar.check_ag(timing=False, rows=(1, 2))
    assert len(rows) == 2 * 2 * (2 + 1)        # fills × M × (nb=1: write on/off, nb=8: off)
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
    assert {r["fill"] for r in rows} == {"zero", "random"} and {r["write"] for r in rows} == {False, True}
    assert all(r["kernel"] == "attn_res_ag" for r in rows)


def test_check_ag_rejects_misaddressed_gather(on_cpu) -> None:
    """Reading the buffer as a plain [M, D] row is right at M = 1 (same memory) and wrong for
    M > 1: those rows fail."""
    on_cpu.setattr(k_ar, "attn_res_rmsnorm", lambda *a, **k: _emulate(*a, **k, misaddress=True))
    rows = k_ar.check_ag(timing=False, rows=(1, 2), nbs=(1,))
    assert all(r["ok"] for r in rows if r["M"] == 1)
    assert not any(r["ok"] for r in rows if r["M"] == 2)
