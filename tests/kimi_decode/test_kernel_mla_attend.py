"""CPU tests of the MLA decode-attention kernel (kimi_decode/kernels/mla_attend.py).

Oracles:
- the kernel compiles to sm_90a PTX at the K3 TP16 shape (H = 6, T = 1) with the
  instructions it exists for (128-bit global and shared loads, the acq_rel grid-completion
  atomic, bf16 rounding of the scores), no local-memory arrays, and warp_idx()'s shuffle
  before any branch (warp_idx() in a divergent branch deadlocked the GPU once);
- `reference` (float64, the formula of the module docstring) equals the stock op
  stock_ops.mla_attend on random inputs, small and at K3 shapes (so the device check's
  reference is right), and the mask matters (a different `last` changes it);
- the uv mode (mla_attend_uv) compiles at K3 B = 1, k = 0 with its added instructions (the
  acquire poll of the ready counter, the W_UV tile's 128-bit loads issued before the group
  counter, the bf16 gate multiply), no local memory, and ptxas (where installed) gives the
  same registers as the attention alone, no spills; its worker CTAs cover every uv_gate tile
  once; can_implement_uv's limits;
- the split/merge plan covers every cache tile exactly once with ≤ GMAX partials per merge,
  and a float64 emulation of the kernel's tiles, online softmax and two-level merge (same
  plan, same masks, same clamped loads) equals the reference: the algorithm, not the DSL, is
  checked here; the DSL indexing is checked on the GPU.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

from cutlass import Int32  # noqa: E402

from tests.kimi_decode.ptxas_tool import ptxas_path, ptxas_usage  # noqa: E402
# uv_gate's contract, bf16(bf16(o_lat @ w_uv) · bf16(σ(g))), as the mla_glue tests state it
from tests.kimi_decode.test_kernel_mla_glue import _emulate_uv as _emulate_uv_gate  # noqa: E402
from kimi_decode import stock_ops  # noqa: E402
from kimi_decode.config import k3_tp16  # noqa: E402
from kimi_decode.kernels import _common  # noqa: E402
from kimi_decode.kernels.mla_attend import (GMAX, SMS, TILE, MLAAttend, MLAConfig, can_implement,  # noqa: E402
                                            can_implement_uv, plan, reference, uv_workers)

bf, f32 = torch.bfloat16, torch.float32
P = _common.dummy_ptr


def ptx_of(tmp_path: Path, cfg: MLAConfig) -> str:
    opts = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    cute.compile(MLAAttend(cfg), P(bf), P(bf), P(torch.int64), P(bf), P(f32), P(f32), P(f32), P(f32),
                 P(torch.int32), P(bf), P(bf), P(bf), P(torch.int64), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1),
                 Int32(1),
                 _common.current_stream(), options=opts)
    files = list(tmp_path.glob("*.ptx"))
    assert len(files) == 1, files
    return files[0].read_text()


def idx_shuffles_after_first_branch(ptx: str) -> list[str]:
    """shfl.sync.idx instructions (warp_idx()'s and lane broadcasts) after the kernel's first
    branch. The kernel calls warp_idx() once, at the top, before any branch; its other
    shuffles (butterfly sums and maxima) sit only in CTA-uniform loops and warp-uniform code
    (test_kernels_compile.py's forward-branch scan cannot tell a uniform loop guard from a
    lane branch, so it is not used here)."""
    lines = [line.strip() for line in ptx.splitlines()]
    first = next(i for i, s in enumerate(lines) if " bra " in s)
    return [s for s in lines[first:] if s.startswith("shfl.sync.idx")]


def test_compiles_k3_t1(tmp_path: Path) -> None:
    cfg = k3_tp16()
    mc = MLAConfig(cfg.mla_local_heads, 1, cfg.kv_lora_rank, cfg.qk_rope_dim,
                   (cfg.qk_nope_dim + cfg.qk_rope_dim) ** -0.5)
    ptx = ptx_of(tmp_path, mc)
    assert ".target sm_90a" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert "ld.global.v4" in ptx                  # 128-bit cache / partial loads
    assert "ld.shared.v4" in ptx                  # 128-bit q / k / p reads from shared memory
    assert "atom.global.acq_rel.add" in ptx       # the grid-completion counters
    assert "fence.acq_rel.gpu" in ptx
    assert "cvt.rn.bf16.f32" in ptx               # the scores' bf16 rounding (as stock's bmm)
    assert "ex2" in ptx
    assert "shfl.sync.bfly" in ptx
    assert not idx_shuffles_after_first_branch(ptx)


def k3_config(uv_rows: int = 0) -> MLAConfig:
    cfg = k3_tp16()
    return MLAConfig(cfg.mla_local_heads, 1, cfg.kv_lora_rank, cfg.qk_rope_dim,
                     (cfg.qk_nope_dim + cfg.qk_rope_dim) ** -0.5, uv_rows=uv_rows, v_dim=cfg.v_head_dim)


def test_compiles_k3_uv_mode(tmp_path: Path) -> None:
    """mla_attend_uv at the per-M table's shape (B = 1, k = 0: M = 1 row of o)."""
    (tmp_path / "base").mkdir()
    (tmp_path / "uv").mkdir()
    base = ptx_of(tmp_path / "base", k3_config())
    ptx = ptx_of(tmp_path / "uv", k3_config(uv_rows=1))
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert not idx_shuffles_after_first_branch(ptx)
    # the ready-counter poll (acquire), one more acq_rel atomic (the workers' counter) and the
    # publish atomics (the two final-merge paths): 5 in all vs 2
    assert ptx.count("ld.acquire.gpu") == 1 and "ld.acquire.gpu" not in base
    assert ptx.count("atom.global.acq_rel.add") == 5 and base.count("atom.global.acq_rel.add") == 2
    assert ptx.count("mul.bf16") == 1                     # mla_glue.gated: the bf16 gate multiply
    # W_UV: mla_glue's 4 (P) 128-bit loads per thread, after the partial's fence and before the
    # group counter's atomic (in flight during the merges and the wait); then the o_lat staging
    lines = ptx.splitlines()
    fences = [i for i, s in enumerate(lines) if "fence.acq_rel.gpu" in s]
    atoms = [i for i, s in enumerate(lines) if "atom.global.acq_rel.add" in s]
    poll = next(i for i, s in enumerate(lines) if "ld.acquire.gpu" in s)
    v4 = [i for i, s in enumerate(lines) if "ld.global.v4" in s]
    assert sum(fences[0] < i < atoms[0] for i in v4) == 4
    assert sum(i > poll for i in v4) == 1
    assert base.count("ld.global.v4") + 4 + 1 == ptx.count("ld.global.v4")
    if ptxas_path():
        regs, spills = ptxas_usage(tmp_path, ptx)
        regs0, _ = ptxas_usage(tmp_path, base)
        assert spills == 0 and regs <= regs0 <= 168, (regs, regs0)   # 158 at commit time


def test_compiles_k3_grid_merge(tmp_path: Path) -> None:
    """The grid merge (the default at B = 1, k = 0), alone and in uv mode: one sense-reversal
    barrier per sequence (the epoch read and poll: 2 acquire loads; the arrival: 1 acq_rel
    atomic; the last one's epoch bump: 1 release atomic), in uv mode each CTA publishes its
    share (+1 acq_rel atomic) and the workers poll and count (+1 poll, +1 atomic); no local
    memory, about the registers of the two-level build."""
    import dataclasses
    for name, cfg, polls, atoms in (("grid", dataclasses.replace(k3_config(), grid=True), 2, 1),
                                    ("grid_uv", dataclasses.replace(k3_config(uv_rows=1), grid=True), 3, 3)):
        (tmp_path / name).mkdir()
        ptx = ptx_of(tmp_path / name, cfg)
        assert "ld.local" not in ptx and "st.local" not in ptx, name
        assert not idx_shuffles_after_first_branch(ptx), name
        assert ptx.count("ld.acquire.gpu") == polls, name
        assert ptx.count("atom.global.acq_rel.add") == atoms, name
        assert ptx.count("atom.global.release.add") == 1, name
        assert "cvt.rn.bf16.f32" in ptx and "shfl.sync.bfly" in ptx
        if ptxas_path():
            regs, spills = ptxas_usage(tmp_path / name, ptx)
            assert spills == 0 and regs <= 168, (name, regs)   # 158 at commit time


def test_grid_ok() -> None:
    """The grid merge runs where every CTA can be resident at once and a thread holds a
    partial, with enough splits to share the merge: B = 1, k = 0 (6 rows, 130 splits) yes;
    k = 7 (48 rows) no; B = 8 and 64 (16 / 2 splits: 32 / 64 column quads per CTA) no; B = 2
    at 130 splits each (260 CTAs) no."""
    from kimi_decode.kernels.mla_attend import GRID_MAX_ROWS, GRID_MIN_SPLITS, grid_ok
    assert grid_ok(1, 6, plan(1, 4160)[0])
    assert grid_ok(1, 6, plan(1, 4160, sms=66)[0])            # bench/mla_phases.py's 65 splits
    assert not grid_ok(1, 48, plan(1, 4608)[0])               # R > GRID_MAX_ROWS
    assert not grid_ok(64, 6, plan(64, 4160)[0])              # 2 splits
    assert not grid_ok(8, 6, plan(8, 4160)[0])                # 16 splits
    assert not grid_ok(1, 6, GRID_MIN_SPLITS - 1)
    assert not grid_ok(2, 6, 130)                             # 260 CTAs > 132 SMs
    assert not grid_ok(1, 6, 130, sms=66)
    assert not grid_ok(1, GRID_MAX_ROWS + 1, 8)


def test_can_implement_uv() -> None:
    cfg = k3_tp16()
    H, c, rope, vd = cfg.mla_local_heads, cfg.kv_lora_rank, cfg.qk_rope_dim, cfg.v_head_dim
    splits = plan(1, cfg.cache_len)[0]
    assert uv_workers(H, vd) == 48 < splits
    assert can_implement_uv(1, H, 1, c, rope, vd, splits, (bf, bf))
    assert can_implement_uv(2, H, 1, c, rope, vd, plan(2, cfg.cache_len)[0], (bf, bf))
    assert not can_implement_uv(1, H, 1, c, rope, vd, 40, (bf, bf))      # fewer CTAs than uv tiles
    assert not can_implement_uv(1, H, 1, c, rope, vd, splits, (bf, bf), sms=48)   # workers fill the GPU
    assert not can_implement_uv(1, H, 1, c, rope, 120, splits, (bf, bf))  # vd not whole tiles
    assert not can_implement_uv(3, H, 3, c, rope, vd, 64, (bf, bf))       # M = 9 > mla_glue's 8 rows
    assert not can_implement_uv(1, H, 1, c, rope, vd, splits, (f32, bf))
    assert SMS > uv_workers(H, vd)


def test_uv_workers_cover_tiles() -> None:
    """Worker CTA lin < NW owns tile (h, ct) = (lin // CT, lin % CT): every uv_gate tile of
    the [H, vd / UV_COLS] grid exactly once (the kernel's index arithmetic, restated)."""
    from kimi_decode.kernels.mla_glue import UV_COLS
    cfg = k3_tp16()
    H, vd = cfg.mla_local_heads, cfg.v_head_dim
    ct_n = vd // UV_COLS
    tiles = [(lin // ct_n, lin - (lin // ct_n) * ct_n) for lin in range(uv_workers(H, vd))]
    assert sorted(tiles) == [(h, ct) for h in range(H) for ct in range(ct_n)]


def test_can_implement() -> None:
    cfg = k3_tp16()
    assert can_implement(cfg.mla_local_heads, 1, cfg.kv_lora_rank, cfg.qk_rope_dim, (bf, bf))
    assert can_implement(cfg.mla_local_heads, 8, cfg.kv_lora_rank, cfg.qk_rope_dim, (bf, bf))
    assert not can_implement(cfg.mla_local_heads, 9, cfg.kv_lora_rank, cfg.qk_rope_dim, (bf, bf))
    assert not can_implement(4, 1, 16, 8, (f32, f32))           # the tiny CPU config
    assert not can_implement(cfg.mla_local_heads, 1, cfg.kv_lora_rank, cfg.qk_rope_dim, (f32, bf))


def _inputs(b: int, t: int, h: int, c: int, rope: int, cache_len: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(b, cache_len, c + rope, generator=g)
    cache[..., :c] = torch.nn.functional.rms_norm(cache[..., :c], (c,))
    q = torch.randn(b, t * h, c + rope, generator=g) * (0.5 if c >= 256 else 2.0)
    return q.bfloat16(), cache.bfloat16()


@pytest.mark.parametrize("b,t,h,c,rope,cache_len,last0", [
    (2, 2, 3, 16, 8, 40, 30),          # small
    (1, 1, 6, 512, 64, 4160, 3000),    # K3 TP16, k = 0 (a third of the cache masked)
    (1, 8, 6, 512, 64, 4608, 3500),    # K3 TP16, k = 7
])
def test_reference_matches_stock(b: int, t: int, h: int, c: int, rope: int, cache_len: int, last0: int) -> None:
    q, cache = _inputs(b, t, h, c, rope, cache_len, b * 100 + t)
    scale = 192 ** -0.5
    last = last0 + torch.arange(t)
    ref = reference(q, cache, last, h, c, scale)
    stock = stock_ops.mla_attend(q, cache, last, h, c, scale)
    assert stock.dtype == torch.bfloat16 and stock.shape == ref.shape == (b, t * h, c)
    err = float((stock.double() - ref).norm() / ref.norm())
    assert err < 1e-2, err                                 # stock rounds p and o to bf16
    err_out = float((ref.to(torch.bfloat16).double() - ref).norm() / ref.norm())
    assert err_out < 5e-3
    # the mask matters: the stock op ignoring it would fail the comparison above ...
    full = stock_ops.mla_attend(q, cache, torch.full_like(last, cache_len - 1), h, c, scale)
    assert float((full.double() - ref).norm() / ref.norm()) > 2e-2
    # ... and the reference follows `last` (half the positions: a different result)
    other = reference(q, cache, last // 2, h, c, scale)
    assert float((other - ref).norm() / ref.norm()) > 10 * err_out


def test_plan_covers_cache() -> None:
    for bsz in (1, 2, 8, 64):
        for k in (0, 7):
            cache_len = k3_tp16(batch=bsz, spec_tokens=k).cache_len
            splits, group, groups, tps = plan(bsz, cache_len)
            n_tiles = math.ceil(cache_len / TILE)
            assert splits * tps >= n_tiles > (splits - 1) * tps      # every tile once, no empty split
            assert 1 <= group <= GMAX and 1 <= groups <= GMAX and group * groups >= splits
            assert (groups - 1) * group < splits                     # no empty group
            assert bsz * splits <= 2 * 132
    assert plan(1, 4160)[0] == 130 and plan(64, 4160)[0] == 2
    # check_uv's group sweep at B = 1, k = 0: the group asked for, or raised to keep groups ≤ GMAX
    assert plan(1, 4160)[1:3] == (12, 11)
    assert plan(1, 4160, group=16)[1:3] == (16, 9)
    assert plan(1, 4160, group=9)[1:3] == (9, 15)
    assert plan(1, 4160, group=6)[1:3] == (9, 15)         # 22 groups: raised
    assert plan(1, 4160, group=40)[1:3] == (GMAX, 9)


def emulate(q: torch.Tensor, cache: torch.Tensor, last: torch.Tensor, h: int, c: int, scale: float,
            sms: int = 132, group_ask: int | None = None, grid: bool = False) -> torch.Tensor:
    """The kernel's algorithm in float64: splits of whole tiles, clamped loads, masked
    bf16-rounded scores, online softmax per tile, partials (m, l, o), two-level merge (or,
    with `grid`, the grid merge: all partials at once, a partial with m = NEG weighs 0)."""
    B, R, D = q.shape
    C = cache.shape[1]
    NEG, VALID = -1.0e30, -1.0e29
    splits, group, groups, tps = plan(B, C, sms, group_ask)
    out = torch.zeros(B, R, c, dtype=torch.float64)
    t_of_row = torch.arange(R) // h
    for b in range(B):
        parts = []
        maxlast = int(last.max())
        for s in range(splits):
            t0 = s * tps * TILE
            end = min(t0 + tps * TILE, C, maxlast + 1)
            m = torch.full((R,), NEG, dtype=torch.float64)
            l_ = torch.zeros(R, dtype=torch.float64)
            o = torch.zeros(R, c, dtype=torch.float64)
            ntile = (end - t0 + TILE - 1) // TILE if end > t0 else 0
            for it in range(ntile):
                ts = t0 + it * TILE
                pos = ts + torch.arange(TILE)
                rows = cache[b, pos.clamp(max=end - 1)].double()                  # clamped loads
                sc = (q[b].double() @ rows.t()).to(torch.bfloat16).double() * scale  # [R, TILE]
                bad = (pos[None, :] >= end) | (pos[None, :] > last[t_of_row][:, None])
                sc = sc.masked_fill(bad, NEG)
                m_new = torch.maximum(m, sc.max(1).values)
                alpha = torch.exp(m - m_new)
                p = torch.where(sc > VALID, torch.exp(sc - m_new[:, None]), torch.zeros_like(sc))
                l_ = l_ * alpha + p.sum(1)
                o = o * alpha[:, None] + p @ rows[:, :c]
                m = m_new
            parts.append((m, l_, o))

        def merge(ps):
            big = torch.stack([x[0] for x in ps]).max(0).values
            w = [torch.exp(x[0] - big) for x in ps]
            return big, sum(x[1] * wi for x, wi in zip(ps, w)), sum(x[2] * wi[:, None] for x, wi in zip(ps, w))

        if grid:
            big = torch.stack([x[0] for x in parts]).max(0).values
            w = [torch.where(x[0] > VALID, torch.exp(x[0] - big), torch.zeros_like(big)) for x in parts]
            L = sum(x[1] * wi for x, wi in zip(parts, w))
            O = sum(x[2] * wi[:, None] for x, wi in zip(parts, w))
        else:
            grp = [merge(parts[g * group:(g + 1) * group]) for g in range(groups)]
            _, L, O = merge(grp) if groups > 1 else grp[0]
        out[b] = O / L[:, None]
    return out


@pytest.mark.parametrize("b,t,h,c,rope,cache_len,last0,sms,group", [
    (2, 2, 3, 16, 8, 300, 250, 132, None),     # 10 tiles: 10 one-tile splits per sequence
    (1, 3, 2, 16, 8, 1000, 900, 132, None),    # 32 tiles, several groups, a tail tile and skipped splits
    (1, 1, 6, 512, 64, 4160, 4101, 132, None),  # K3 TP16 k = 0: 130 splits, 11 groups
    (1, 1, 6, 512, 64, 4160, 4101, 132, 9),     # check_uv's group sweep: 15 groups
    (1, 1, 6, 512, 64, 4160, 4101, 132, 16),    # 9 groups
    (3, 2, 2, 16, 8, 700, 650, 16, None),      # several tiles per split
])
@pytest.mark.parametrize("grid", [False, True])
def test_emulated_kernel_matches_reference(b: int, t: int, h: int, c: int, rope: int, cache_len: int,
                                           last0: int, sms: int, group: int | None, grid: bool) -> None:
    q, cache = _inputs(b, t, h, c, rope, cache_len, 7 + b + t)
    scale = 192 ** -0.5
    last = last0 + torch.arange(t)
    cache_nan = cache.clone()
    cache_nan[:, last0 + t:] = float("nan")                 # never read by the kernel's plan
    ref = reference(q, cache, last, h, c, scale)
    emu = emulate(q, cache_nan, last, h, c, scale, sms, group, grid)
    assert torch.isfinite(emu).all()
    assert float((emu - ref).norm() / ref.norm()) < 1e-9


def _emulate_attend(q_full, cache, last, heads, c, scale, scratch=None, grid=None, probe=None):
    """mla_attend's contract (float64 statement, o_lat rounded to bf16; positions past `last`
    are never read, here by zeroing the NaNs the check puts there)."""
    return reference(q_full, cache.nan_to_num(0.0), last, heads, c, scale).to(bf)


@pytest.fixture
def emulated(monkeypatch):
    import kimi_decode.kernels.mla_attend as ma
    import kimi_decode.kernels.mla_glue as mg
    from kimi_decode.kernels import checks
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(stock_ops, "maybe_compiled", lambda fn, enabled: fn)   # no inductor on CPU here
    monkeypatch.setattr(ma, "mla_attend", _emulate_attend)
    monkeypatch.setattr(mg, "uv_gate", _emulate_uv_gate)

    def attend_uv(q_full, cache, last, heads, c, scale, w_uv, g, scratch, grid=None, probe=None):
        o_lat = _emulate_attend(q_full, cache, last, heads, c, scale)
        return _emulate_uv_gate(o_lat, w_uv, g), o_lat
    monkeypatch.setattr(ma, "mla_attend_uv", attend_uv)
    return monkeypatch


def test_check_uv_harness_passes_emulation(emulated) -> None:
    """mla_attend.check_uv (the GPU check of mla_attend_uv, registered for that name) on the
    CPU with the kernels replaced by their contracts: its one row (B = 1, k = 0) passes."""
    from kimi_decode.kernels import CHECK_MODULES, KERNELS
    from kimi_decode.kernels.mla_attend import check_uv
    assert "mla_attend_uv" in KERNELS and CHECK_MODULES["mla_attend_uv"] == "mla_attend"
    rows = check_uv(timing=False)
    assert len(rows) == 1 and rows[0]["ok"], rows
    assert (rows[0]["B"], rows[0]["k"], rows[0]["workers"]) == (1, 0, 48)
    assert rows[0]["o_equal_two_launch"] and rows[0]["o_lat_equal_mla_attend"]


def test_check_uv_harness_rejects_wrong_kernel(emulated) -> None:
    """A fused kernel gating with σ(-g) (o_lat right) fails: o differs from the two launches."""
    import kimi_decode.kernels.mla_attend as ma

    def wrong(q_full, cache, last, heads, c, scale, w_uv, g, scratch, grid=None, probe=None):
        o_lat = _emulate_attend(q_full, cache, last, heads, c, scale)
        return _emulate_uv_gate(o_lat, w_uv, -g), o_lat
    emulated.setattr(ma, "mla_attend_uv", wrong)
    rows = ma.check_uv(timing=False)
    assert len(rows) == 1 and not rows[0]["ok"] and not rows[0]["o_equal_two_launch"]
    assert rows[0]["o_lat_equal_mla_attend"]


def test_check_uv_timing_rows(emulated) -> None:
    """check_uv's timing path (time_us replaced by one call): the main row gets new / old /
    stock times cold and warm, and the group sweep adds its rows (15 and 9 groups)."""
    from kimi_decode.kernels import checks
    from kimi_decode.kernels.mla_attend import check_uv
    emulated.setattr(checks, "time_us", lambda fn: fn() is None or 1.0)
    rows = check_uv(timing=True, copies=2)
    assert all(r["ok"] for r in rows), rows
    assert {"kernel_us", "two_launch_us", "stock_us", "kernel_warm_us", "two_launch_warm_us"} <= rows[0].keys()
    assert [(r["group"], r["groups"]) for r in rows] == [(12, 11), (9, 15), (16, 9)]


def test_scratch_epochs_follow_counters() -> None:
    """The grid barrier's epochs sit right after the counters in one buffer (the kernel
    indexes them from the counters' pointer at B·G + B + 2 + b) and are not part of the
    counters the checks hold to zero."""
    from kimi_decode.kernels.mla_attend import make_scratch
    sc = make_scratch(1, 6, 4160, 512, "cpu")
    n = sc.batch * sc.groups + sc.batch + 2
    assert sc.counters.numel() == n and sc.epochs.numel() == sc.batch
    assert sc.epochs.data_ptr() == sc.counters.data_ptr() + 4 * n
    assert int(sc.counters.abs().sum()) == 0 and int(sc.epochs.abs().sum()) == 0
