"""experts_rows (kernels/moe_fc2_rows.py): FC2 of the routed experts at 2 ≤ M ≤ 8 as a resident
grid, on the CPU.

Oracles:
- work split, by brute force: for every M the step can run and several SM counts, the grid's
  CTAs (row = b % M, blocks b // M + n·per_row, n < cnt as the kernel computes cnt) cover
  every (row, 4-column block) exactly once, and the grid fits the CTA slots (one wave);
- PTX at K3: the first block's 12 w2 loads per lane before griddepcontrol.wait, the row's
  activations staged once behind one barrier, then per block one set of 12 loads (two with
  two buffers) and FC2 v2's butterflies and index shuffles; a `bar.warp.sync` in every block
  (without it the compiler hoists the shared reads out of the loop); ptxas (under CI) within
  72 registers and 16 B of spill for one buffer, 128 and none for two;
- the device check runs on the CPU with faithful emulations and fails with a broken one;
- moe_experts.experts takes this FC2 only with `rows`, v2, no cp.async staging and M ≥ 2.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

from cutlass import Int32  # noqa: E402

import kimi_decode.kernels.moe_experts as k_ex  # noqa: E402
import kimi_decode.kernels.moe_fc2_rows as k_rows  # noqa: E402
from kimi_decode.config import tiny  # noqa: E402
from tests.kimi_decode.ptxas_tool import ptxas_path  # noqa: E402
from tests.kimi_decode.test_kernel_moe_experts import K3, K3_CFG, P, _emulate, ptx_of, ptxas_usage  # noqa: E402

bf, f32, i64 = torch.bfloat16, torch.float32, torch.int64


@pytest.mark.parametrize("sms", [132, 114, 8])
@pytest.mark.parametrize("buffers", [1, 2])
def test_every_row_and_block_once(sms: int, buffers: int) -> None:
    nblk = K3.latent_dim // 4
    for m in range(2, 9):
        pr = k_rows.per_row(m, K3.latent_dim, buffers, sms)
        grid = m * pr
        assert grid <= max(m, k_rows.BLOCKS_PER_SM[buffers] * sms)        # resident at once
        seen: dict[tuple[int, int], int] = {}
        for b in range(grid):
            c0, row = b // m, b % m
            cnt = (nblk - c0 + pr - 1) // pr                               # the kernel's formula
            assert cnt >= 1
            for n in range(cnt):
                key = (row, c0 + n * pr)
                seen[key] = seen.get(key, 0) + 1
        assert seen == {(r, c): 1 for r in range(m) for c in range(nblk)}, (m, sms)


def _ptx(tmp_path: Path, buffers: int) -> str:
    cfg = k_rows.RowsConfig(dataclasses.replace(K3_CFG, pdl=True), buffers)
    return ptx_of(tmp_path, k_rows.ExpertsFC2Rows(cfg), P(bf), P(i64), P(f32), P(bf), P(bf), Int32(8), Int32(115))


@pytest.mark.parametrize("buffers", [1, 2])
def test_compiles(tmp_path: Path, buffers: int) -> None:
    ptx = _ptx(tmp_path, buffers)
    assert ".target sm_90a" in ptx and "ld.local" not in ptx
    lines = [s.strip() for s in ptx.splitlines()]
    vec = [i for i, s in enumerate(lines) if s.startswith("ld.global.v4")]
    wait = [i for i, s in enumerate(lines) if s.startswith("griddepcontrol.wait")]
    bar = [i for i, s in enumerate(lines) if s.startswith("bar.sync")]
    per_block = K3.top_k // 4 * (K3.expert_local_inter // 64)             # 12 slices per lane
    assert len(wait) == 1 and len(bar) == 1 and wait[0] < bar[0]
    assert len([i for i in vec if i < wait[0]]) == per_block                # the first block's
    assert len([i for i in vec if wait[0] < i < bar[0]]) == 1               # the staging loop
    assert len([i for i in vec if i > bar[0]]) == buffers * per_block       # later blocks
    bfly = [s for s in lines if s.startswith("shfl.sync.bfly")]
    assert len(bfly) == buffers * 3 * K3.top_k // 4
    assert len([s for s in lines if s.startswith("bar.warp.sync")]) == buffers
    assert f".minnctapersm {k_rows.BLOCKS_PER_SM[buffers]}" in ptx
    if ptxas_path() is not None:
        regs, spill_st, spill_ld = ptxas_usage(tmp_path)
        if buffers == 1:
            assert regs <= 72 and spill_st <= 16 and spill_ld <= 16, (regs, spill_st, spill_ld)
        else:
            assert regs <= 128 and spill_st == 0 and spill_ld == 0, (regs, spill_st, spill_ld)


def test_limits() -> None:
    L, Ip, I, K = K3.latent_dim, K3.expert_local_inter_padded, K3.expert_local_inter, K3.top_k
    assert all(k_rows.can_implement(m, K, L, Ip, (bf,) * 3, inter=I) for m in range(2, 9))
    assert not k_rows.can_implement(1, K, L, Ip, (bf,) * 3, inter=I)       # FC2 v2's one wave
    assert not k_rows.can_implement(9, K, L, Ip, (bf,) * 3, inter=I)       # FC2 v2's rules
    assert not k_rows.can_implement(8, 14, L, Ip, (bf,) * 3, inter=I)


def test_experts_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """experts(rows=b): FC1, then ExpertsFC2Rows with b buffers at M ≥ 2 with v2; M = 1, no
    v2 or the cp.async staging keep the FC2 kernel compile_for returns."""
    launched: list[object] = []
    monkeypatch.setattr(k_ex, "compile_for", lambda cfg, v2, m, early=False: (lambda *a: launched.append("fc1"),
                                                                    lambda *a: launched.append("fc2")))
    monkeypatch.setattr(k_rows, "launch_fc2", lambda act, idx, w, w2, out, cfg, m, buffers: launched.append(("rows", m, buffers)))
    monkeypatch.setattr(k_ex, "ptr", lambda t: None)
    E, L, Ip = 8, 256, 256
    w13, w2 = torch.zeros(E, 2 * Ip, L, dtype=bf), torch.zeros(E, L, Ip, dtype=bf)
    for m, kw, want in ((8, {"rows": 1, "v2": True}, ("rows", 8, 1)), (2, {"rows": 2, "v2": True}, ("rows", 2, 2)),
                        (1, {"rows": 1, "v2": True}, "fc2"), (8, {"rows": 1, "v2": False}, "fc2"),
                        (8, {"rows": 1, "v2": True, "stage_async": True}, "fc2")):
        launched.clear()
        z = torch.zeros(m, L, dtype=bf)
        idx = torch.arange(4).repeat(m, 1)
        k_ex.experts(z, idx, torch.ones(m, 4), w13, w2, 1.0, 1.0, **kw)
        assert launched == ["fc1", want], (m, kw, launched)


def test_check_runs_on_cpu_and_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """`check` (kernel experts_rows) on a tiny bf16 config with the kernels emulated: every row
    passes and is timed (rows and v2); an FC2 that ignores the routing weights fails every row."""
    from kimi_decode.kernels import checks
    import kimi_decode.config as config
    small = tiny(dtype="bfloat16", moe_pad_local_inter=24)
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(config, "k3_tp16", lambda **kw: small.with_(**kw))
    asked: list[int] = []

    def kernels(z, idx, w, *a, v2=None, rows=0, **kw):
        asked.append(rows)
        return _emulate(z, idx, w, *a, **kw)
    monkeypatch.setattr(k_ex, "experts", kernels)
    monkeypatch.setattr(checks, "time_us", lambda fn: (fn(), 1.0)[1])
    out = k_rows.check(timing=True, rows=(2, 8))
    assert len(out) == 4 and all(r["ok"] and r["equal_v2"] for r in out), out
    assert {r["buffers"] for r in out} == {1, 2} and all(r["kernel_us"] == r["v2_us"] == 1.0 for r in out)
    assert set(asked) == {0, 1, 2}

    def broken(z, idx, w, *a, v2=None, rows=0, **kw):
        return _emulate(z, idx, torch.full_like(w, 1.0 / w.shape[1]) if rows else w, *a, **kw)
    monkeypatch.setattr(k_ex, "experts", broken)
    assert not any(r["ok"] for r in k_rows.check(timing=False, rows=(2,)))
