"""attn_res_mc: the AttnRes kernel with one row over a cluster of CTAs (kernels/attn_res_mc.py),
on the CPU.

Oracles:
- compile: every mode the fused step uses at M = 1 (no delta, plain delta, ar with 16 slots
  with and without reset, ag with gather 448; block write or not; nb = 1 and 8) compiles to
  sm_90a PTX at the K3 TP16 shapes with 128 threads per CTA, no local memory, and exactly the
  global traffic the design counts: each source vector ONE ld.global.v4 per thread (sources
  are kept in registers for pass 2, so no re-read), 4 for w and the norm weight; 128-bit
  stores of out, prefix' and the block slot; the cross-CTA reductions are 2 DSMEM pushes
  (mapa.shared::cluster + st.shared::cluster) each followed by a barrier.cluster
  arrive/wait, plus the relaxed arrive at the start whose wait comes before the first push;
  4 CTA barriers (bar.sync) as the one-CTA kernel; every global load issued before the first
  barrier, and (LOADS_FIRST) before the first bf16 → fp32 conversion, which the first build's
  order fails; no full-warp shuffle inside a lane-divergent branch. ptxas (when installed):
  no spills, registers ≤ 255.
- sizes: pick_ctas gives C = 7 at D = 7168 (128 threads, whole warps), can_implement follows.
- harness: check() on the CPU with both kernels replaced by a torch emulation of their
  contract passes every row; an emulated cluster kernel that ignores the other ranks' slots
  fails the random-fill ar rows (the check can say no).
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

from cutlass import Float32, Int32  # noqa: E402

from tests.kimi_decode.ptxas_tool import ptxas_path
import kimi_decode.kernels.attn_res as k_ar  # noqa: E402
import kimi_decode.kernels.attn_res_mc as k_mc  # noqa: E402
from kimi_decode.kernels import _common  # noqa: E402
from kimi_decode.kernels.attn_res_mc import AttnResMC, AttnResMCConfig, can_implement, pick_ctas  # noqa: E402
from tests.kimi_decode.test_kernels_compile import (common_checks, load_convert_order, ptx_of,  # noqa: E402
                                                     shuffles_in_branches)

bf, f32 = torch.bfloat16, torch.float32
P = _common.dummy_ptr
WORLD, D, GATHER = 16, 7168, 448

# (nb, has_delta, write, world, reset, gather): every mode at M = 1
MODES = [(1, False, False, 0, False, 0), (8, True, False, 0, False, 0), (1, True, True, 0, False, 0),
         (1, True, True, WORLD, False, 0), (8, True, False, WORLD, True, 0), (1, True, False, WORLD, True, 0),
         (8, True, False, 0, False, GATHER), (1, True, True, 0, False, GATHER)]


def _ptx(tmp_path: Path, nb: int, has_delta: bool, write: bool, world: int, reset: bool, gather: int) -> str:
    cfg = AttnResMCConfig(D, nb, 8, has_delta, write, vec_per_thread=1, world=world, reset=reset,
                          gather=gather, ctas=pick_ctas(D))
    return ptx_of(tmp_path, AttnResMC(cfg), P(bf), P(bf), P(bf), P(bf), P(bf), P(f32), P(f32),
                  Int32(1), Int32(0), Float32(1e-5))


def expected_loads(nb: int, has_delta: bool, world: int, reset: bool) -> int:
    """128-bit global loads of one thread (VPT = 1): w and the fp32 norm weight 2 + 2; each
    block source once; the prefix unless reset; the delta once, or the world slots."""
    delta = world if world else (1 if has_delta else 0)
    return 4 + nb + (0 if reset else 1) + delta


@pytest.mark.parametrize("nb,has_delta,write,world,reset,gather", MODES)
def test_attn_res_mc_compiles(tmp_path: Path, nb: int, has_delta: bool, write: bool, world: int,
                              reset: bool, gather: int) -> None:
    ptx = _ptx(tmp_path, nb, has_delta, write, world, reset, gather)
    common_checks(ptx)
    assert ".reqntid 128, 1, 1" in ptx
    assert ptx.count("ld.global.v4") == expected_loads(nb, has_delta, world, reset)
    assert ptx.count("ld.global") == ptx.count("ld.global.v4")        # no scalar fallback
    assert ptx.count("st.global.v4") == (1 + has_delta + (write and has_delta))   # out, prefix', block
    # the cluster reductions: two DSMEM pushes, three arrive/wait pairs (the first relaxed)
    assert ptx.count("mapa.shared::cluster") == 2 and ptx.count("st.shared::cluster") == 2
    assert ptx.count("barrier.cluster.arrive.relaxed;") == 1
    assert ptx.count("barrier.cluster.arrive;") == 2 and ptx.count("barrier.cluster.wait;") == 3
    assert ptx.count("bar.sync") == 4
    assert "%cluster_ctarank" in ptx and "%ctaid.y" in ptx                # rank, row = blockIdx.y
    # order: relaxed arrive first; the wait for it before the first remote store; every global
    # load before the first CTA barrier (all sources in flight together)
    first_wait, first_push = ptx.index("barrier.cluster.wait;"), ptx.index("st.shared::cluster")
    assert ptx.index("barrier.cluster.arrive.relaxed;") < ptx.index("ld.global") and first_wait < first_push
    assert ptx[ptx.index("bar.sync"):].count("ld.global") == 0
    if world or gather:
        assert "%nctaid.y" in ptx                                         # slot rows r·M + m
    if gather:
        assert re.search(r"mad\.lo\.s32\s+%r\d+, %r\d+, 448,", ptx)      # buffer row stride n
    assert not shuffles_in_branches(ptx)
    ptxas = ptxas_path()
    if ptxas:
        f = tmp_path / "k.ptx"
        f.write_text(ptx)
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(f), "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
        assert "0 bytes spill stores, 0 bytes spill loads" in info
        regs = int(re.search(r"Used (\d+) registers", info).group(1))
        assert regs <= 255


@pytest.mark.parametrize("nb,has_delta,write,world,reset,gather", MODES)
def test_every_source_load_before_the_first_conversion(tmp_path: Path, nb: int, has_delta: bool,
                                                       write: bool, world: int, reset: bool,
                                                       gather: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """LOADS_FIRST: no global load of pass 1 follows a bf16 → fp32 conversion (so none waits
    behind an earlier load's round trip); the first build's order (LOADS_FIRST off) has loads
    after conversions wherever a mode loads more than the prefix."""
    (tmp_path / "new").mkdir()
    (tmp_path / "old").mkdir()
    order = load_convert_order(_ptx(tmp_path / "new", nb, has_delta, write, world, reset, gather))
    assert "CL" not in order, order
    monkeypatch.setattr(k_mc, "LOADS_FIRST", False)
    old = load_convert_order(_ptx(tmp_path / "old", nb, has_delta, write, world, reset, gather))
    assert old.count("L") == order.count("L")
    assert "CL" in old, old


def test_cluster_size_and_limits() -> None:
    assert pick_ctas(7168) == 7 and AttnResMCConfig(7168, 1, 8, True, False, vec_per_thread=1).threads == 128
    assert pick_ctas(4096) == 8                     # 4096 / 64 = 64 threads
    assert pick_ctas(100) == 0
    assert can_implement(D, 8, 8, (bf, f32), 7, world=WORLD)
    assert can_implement(D, 8, 8, (bf, f32), 7, gather=GATHER)
    assert not can_implement(D, 1, 8, (bf, f32), 8)        # 112 vectors per CTA: 3.5 warps
    assert not can_implement(D, 1, 8, (bf, f32), 9)        # not a portable cluster
    assert not can_implement(D, 9, 8, (bf, f32), 7)        # nb > slots


def test_wrapper_rejects_bad_calls() -> None:
    blocks, prefix = torch.zeros(1, 8, D, dtype=bf), torch.zeros(1, D, dtype=bf)
    w, n = torch.zeros(D), torch.zeros(D)
    with pytest.raises(ValueError):
        k_mc.attn_res_mc(blocks, 1, prefix, w, n, 1e-5, delta=prefix, delta_slots=torch.zeros(2, 1, D, dtype=bf))
    with pytest.raises(ValueError):
        k_mc.attn_res_mc(blocks, 1, prefix, w, n, 1e-5, reset=True)
    with pytest.raises(ValueError):
        k_mc.attn_res_mc(blocks, 1, prefix, w, n, 1e-5, delta_gather=torch.zeros(16, 1, 100, dtype=bf))
    with pytest.raises(ValueError):
        k_mc.attn_res_mc(blocks, 1, prefix, w.bfloat16(), n, 1e-5, delta=prefix)
    with pytest.raises(ValueError):
        k_mc.attn_res_mc(blocks, 2, prefix, w, n, 1e-5, delta=prefix, write_slot=1)


def emulate(blocks, num_blocks, prefix, w_mix, norm_w, eps, delta=None, write_slot=None, out=None, *,
            delta_slots=None, reset=False, delta_gather=None, own_slot_only=False):
    """attn_res_rmsnorm's (and attn_res_mc's) contract in torch, every mode."""
    if delta_slots is not None:
        slots = delta_slots[:1] if own_slot_only else delta_slots
        new_prefix = k_ar.prefix_reference(prefix, slots, reset)
    elif delta_gather is not None:
        new_prefix = prefix + k_ar.gather_cols(delta_gather)
    else:
        new_prefix = prefix if delta is None else prefix + delta
    if write_slot is not None:
        blocks[:, write_slot].copy_(new_prefix)
    mix = k_ar.reference(blocks, num_blocks, new_prefix, w_mix, norm_w, eps)
    return mix.to(torch.bfloat16), new_prefix


def test_check_passes_faithful_emulation(on_cpu) -> None:
    """Every row passes; timing (its closures run once on the CPU in place of CUDA-graph
    replays) covers each mode at M = 1 without a write, in the simulation's zero fill."""
    from kimi_decode.kernels import checks
    on_cpu.setattr(k_ar, "attn_res_rmsnorm", emulate)
    on_cpu.setattr(k_mc, "attn_res_mc", emulate)
    on_cpu.setattr(checks, "time_us", lambda fn: fn() or 1.0)
    rows = k_mc.check(timing=True, rows=(1, 2))
    # per (M): nb=1 × write 2 + nb=8 × 1 = 3 rows; prefix 1 + plain 1 + ar 2 fills × 2 resets + ag 2 fills
    assert len(rows) == 2 * 3 * (1 + 1 + 4 + 2)
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
    assert {r["mode"] for r in rows} == {"prefix", "plain", "ar", "ag"}
    timed = [(r["mode"], r["nb"], r["reset"]) for r in rows if "kernel_us" in r]
    assert sorted(timed) == sorted((mode, nb, reset) for nb in (1, 8) for mode, reset in
                                   (("prefix", False), ("plain", False), ("ar", False), ("ar", True),
                                    ("ag", False)))
    assert all({"stock_us", "one_cta_us"} <= r.keys() and r["M"] == 1 and not r["write"]
               for r in rows if "kernel_us" in r)


def test_check_rejects_a_kernel_that_skips_peer_slots(on_cpu) -> None:
    on_cpu.setattr(k_ar, "attn_res_rmsnorm", emulate)
    on_cpu.setattr(k_mc, "attn_res_mc", lambda *a, **k: emulate(*a, **k, own_slot_only=True))
    rows = k_mc.check(timing=False, rows=(1,), nbs=(1,))
    ar = [r for r in rows if r["mode"] == "ar"]
    assert all(r["ok"] for r in ar if r["fill"] == "zero")
    assert not any(r["ok"] for r in ar if r["fill"] == "random")
    assert all(r["ok"] for r in rows if r["mode"] != "ar")
