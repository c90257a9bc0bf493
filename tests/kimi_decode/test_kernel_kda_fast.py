"""kda_fast on the CPU: it compiles to sm_90a PTX at the K3 TP16 shapes (B = 1, k = 0) with the
shorter chain its docstring claims (every global load but the last CTA's o re-read before the
first bar.sync, 6 bar.sync instead of kda_split's 8, the f_b row and f_a as 128-bit loads, one
arrival atomic, no poll loop), ptxas's register count, and check()'s harness passes with the
thread-level emulation standing in for both kernels (kda_fast's math is kda_split's at T = 1,
so kda_split's emulation is its oracle) and fails on a wrong one.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

from tests.kimi_decode.ptxas_tool import require_ptxas
from kimi_decode.kernels.kda_fast import KDAFast, can_implement, kda_decode_fast  # noqa: E402
from kimi_decode.kernels.kda_split import KDASplit, KDASplitConfig, make_scratch  # noqa: E402
from tests.kimi_decode.test_kernel_kda_split import _fake_split, _wrong_split, k3_kcfg, ptx_of  # noqa: E402

bf = torch.bfloat16


@pytest.mark.parametrize("splits", [16, 8])
def test_compiles_with_the_short_chain(tmp_path: Path, splits: int) -> None:
    kcfg = k3_kcfg(0)
    assert can_implement(kcfg.heads, kcfg.head_dim, 4, kcfg.in_proj_rows, 1, (bf,), splits)
    ptx = ptx_of(tmp_path, kcfg, splits, KDAFast)
    assert ".target sm_90a" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    first_bar = ptx.index("bar.sync")
    head, tail = ptx[:first_bar], ptx[first_bar:]
    assert tail.count("ld.global") == 1                             # only the last CTA's o re-read
    assert head.count("ld.global.v4") >= 32                         # f_b row + f_a: 16 + 16 × 128 bit
    assert ptx.count("bar.sync") == 6                               # kda_split: 8 (below)
    assert ptx.count("atom.global") == 1 and "atom.global.acq_rel.add" in ptx
    assert "ld.acquire" not in ptx                                  # no poll loop
    assert ptx.count("fence.acq_rel.gpu") >= 3                      # writers, bumper, last reader
    assert "shfl.sync.bfly" in ptx


def test_kda_split_has_the_longer_chain(tmp_path: Path) -> None:
    """The baseline the docstring's chain describes: 8 barriers, the f_b row, dt_bias, the o
    re-read, o_norm and the gate's z loads after the first barrier."""
    ptx = ptx_of(tmp_path, k3_kcfg(0), 16, KDASplit)
    tail = ptx[ptx.index("bar.sync"):]
    assert ptx.count("bar.sync") == 8 and tail.count("ld.global.v4") == 16 and tail.count("ld.global") >= 20


def test_ptxas_registers(tmp_path: Path) -> None:
    """ptxas (where installed): the 128 registers of f_b + f_a fit; measured on the CPU at
    2026-12-02: 168 registers and a 4-byte spill (one value through L1), vs kda_split's 56."""
    ptxas = require_ptxas()
    f = tmp_path / "k.ptx"
    f.write_text(ptx_of(tmp_path, k3_kcfg(0), 16, KDAFast))
    info = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(f), "-o", os.devnull],
                          capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", info).group(1))
    assert regs <= 255 and spill <= 16, info


def f32_ops(ptx: str) -> collections.Counter:
    """The fp32 arithmetic instructions of a PTX text, with their immediate constants."""
    ops = re.findall(r"^\s*((?:fma\.rn|mul|add|sub|neg|max|min)\.f32|ex2\.approx\.ftz\.f32|rcp\.rn\.f32|"
                     r"sqrt\.[a-z.]*f32|rsqrt\.[a-z.]*f32|div\.[a-z.]*f32|cvt\.sat\.f32\.f32)\s([^;]*);",
                     ptx, flags=re.M)
    return collections.Counter(op + " " + " ".join(re.findall(r"0f[0-9A-F]{8}", args)) for op, args in ops)


def test_same_fp32_arithmetic_as_kda_split(tmp_path: Path) -> None:
    """The bit-identity target, as far as the CPU can see it: the fp32 instructions (which
    mul each fma absorbs included) of kda_fast and of kda_split at T = 1 are the same multiset;
    the naive v conv (the fma chain of q and k) differed by one fma vs mul + add, which this
    catches."""
    fast = f32_ops(ptx_of(tmp_path / "fast", k3_kcfg(0), 16, KDAFast))
    split = f32_ops(ptx_of(tmp_path / "split", k3_kcfg(0), 16, KDASplit))
    assert fast == split and fast["fma.rn.f32 "] >= 128


def test_t1_only_and_wrapper_rejects() -> None:
    k7 = k3_kcfg(7)
    assert not can_implement(k7.heads, k7.head_dim, 4, k7.in_proj_rows, k7.tokens, (bf,), 16)
    with pytest.raises(ValueError):
        KDAFast(KDASplitConfig(k7, 16))
    kcfg = k3_kcfg(0)
    p = kcfg.heads * kcfg.head_dim
    sc = make_scratch(kcfg, 1, "cpu")
    z = torch.zeros(2, kcfg.in_proj_rows, dtype=bf)                 # 2 rows for B = 1, T = 1
    with pytest.raises(ValueError):
        kda_decode_fast(z, torch.zeros(p, 128, dtype=bf), torch.zeros(3 * p, 4),
                        torch.zeros(1, 3 * p, 3, dtype=bf), torch.zeros(p), torch.zeros(6),
                        torch.zeros(1, 6, 128, 128), torch.ones(128, dtype=bf), kcfg, sc)


def test_check_harness_on_cpu_with_emulated_kernels(monkeypatch) -> None:
    """kda_fast.check() (stock module, 3 steps with state carried, reference, kda_split side by
    side, counters) runs on the CPU with the thread-level emulation for both launches, passes
    and reports bit identity."""
    from kimi_decode.kernels import checks
    from kimi_decode.kernels import kda_fast as mod
    from kimi_decode.kernels import kda_split as ks
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(mod, "kda_decode_fast", _fake_split)
    monkeypatch.setattr(ks, "kda_decode_split", _fake_split)
    rows = mod.check(timing=False, batches=(1,), steps=2)
    assert len(rows) == 1 and rows[0]["ok"] and rows[0]["bit_identical"], rows
    assert rows[0]["rel_out_vs_kda_split"] == 0.0 and rows[0]["counter_zero"] and rows[0]["kernel"] == "kda_fast"


def test_check_harness_can_fail(monkeypatch) -> None:
    """An emulated kernel with a wrong gate lower bound fails check() and is not bit-identical."""
    from kimi_decode.kernels import checks
    from kimi_decode.kernels import kda_fast as mod
    from kimi_decode.kernels import kda_split as ks
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(mod, "kda_decode_fast", _wrong_split)
    monkeypatch.setattr(ks, "kda_decode_split", _fake_split)
    row = mod.check(timing=False, batches=(1,), steps=1)[0]
    assert not row["ok"] and not row["bit_identical"]


@pytest.mark.parametrize("first", [True, False])
def test_z_loads_first_switch(monkeypatch, tmp_path: Path, first: bool) -> None:
    """Z_LOADS_FIRST (chained build, B = 1, k = 0): the v channels' conv history (3 × b16) and
    weights (one v4) load before griddepcontrol.wait, and past it no global load follows the
    first shared-memory store (the v conv's terms), so the z values issue as one batch; off
    (the default, not measured yet), β's input, the output gate and the rest load after those
    stores. The fp32 arithmetic is the same multiset either way, and each setting compiles
    under its own cache name."""
    from kimi_decode.kernels import kda_fast as kf
    from tests.kimi_decode.test_kernels_compile import chained_ptx_at_wait

    def build(on: bool, sub: str) -> tuple[list[str], int]:
        monkeypatch.setattr(kf, "Z_LOADS_FIRST", on)
        return chained_ptx_at_wait(lambda: ptx_of(tmp_path / sub, k3_kcfg(0), 16, KDAFast))

    lines, wait = build(first, "a")
    base, base_wait = build(False, "b")
    before = sum(ln.startswith("ld.global") for ln in lines[:wait])
    assert before == sum(ln.startswith("ld.global") for ln in base[:base_wait]) + (4 if first else 0)
    rest = lines[wait:]
    first_st = next(i for i, ln in enumerate(rest) if ln.startswith("st.shared"))
    barrier = next(i for i, ln in enumerate(rest) if ln.startswith("bar.sync"))
    late = [ln for ln in rest[first_st:barrier] if ln.startswith("ld.global")]
    assert (not late) if first else late, late

    def fp32_ops(ptx_lines: list[str]) -> collections.Counter:
        return collections.Counter(ln.split()[0] for ln in ptx_lines
                                   if re.match(r"(fma|mul|add|sub|ex2|rcp|sqrt|rsqrt)\.\S*f32", ln))
    assert fp32_ops(lines) == fp32_ops(base)
    monkeypatch.setattr(kf, "compile_kernel", lambda cls, name, cfg: name)
    names = set()
    for on in (True, False):
        monkeypatch.setattr(kf, "Z_LOADS_FIRST", on)
        names.add(kf.compile_for(KDASplitConfig(k3_kcfg(0), 16)))
    assert len(names) == 2
