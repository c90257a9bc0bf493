"""kda_multi on the CPU: it compiles to sm_90a PTX at the K3 TP16 shapes with T = 8 (B = 1 and
8) with the structure its docstring claims (one arrival atomic, no local memory, the f_b row
as 128-bit loads, far fewer barriers than kda_split; chained: only state, weights and
constants before griddepcontrol.wait), its limits, fused's dispatch, and check()'s harness
passes with kda_split's thread-level emulation standing in for both kernels (kda_multi's math
is kda_split's) and fails on a wrong one.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

from kimi_decode.kernels import kda_multi as km  # noqa: E402
from kimi_decode.kernels.kda_split import KDASplit, make_scratch, splits_for  # noqa: E402
from tests.kimi_decode.ptxas_tool import ptxas_path, ptxas_usage  # noqa: E402
from tests.kimi_decode.test_kernel_kda_split import _fake_split, _wrong_split, k3_kcfg, ptx_of  # noqa: E402
from tests.kimi_decode.test_kernels_compile import chained_ptx_at_wait  # noqa: E402

bf = torch.bfloat16


@pytest.mark.parametrize("splits,gate_mma", [(16, True), (8, True), (16, False), (8, False)])
def test_compiles(monkeypatch, tmp_path: Path, splits: int, gate_mma: bool) -> None:
    """Both gate paths: the tensor-core one (T ≤ 8, the default: 2 key tiles × 4 k chunks × 2
    mma steps per warp, f_b's fragments as 16 and f_a's as 4 128-bit loads per lane, no f_a
    staging in shared memory) and the FMA one (the f_b row as 16 loads, f_a of 8 tokens read
    back from shared memory as vectors)."""
    monkeypatch.setattr(km, "GATE_MMA", gate_mma)
    kcfg = k3_kcfg(7)
    assert km.can_implement(kcfg.heads, kcfg.head_dim, 4, kcfg.in_proj_rows, 8, (bf,), splits)
    ptx = ptx_of(tmp_path, kcfg, splits, km.KDAMulti)
    assert ".target sm_90a" in ptx
    if km.cluster_applies(splits, 8, kcfg.head_dim // splits):
        # the cluster epilogue (V_SPLIT = 8): Σo² partials pushed into every rank's shared
        # memory (mapa + st.shared::cluster), the start and the exchange barriers; no arrival
        # counter, and 4 CTA barriers with the tensor-core gates (the prelude's, the epilogue's,
        # the token loop's two; none in the loop with WARP_COLUMNS)
        assert "atom.global" not in ptx
        assert ptx.count("mapa") == 1 and ptx.count("st.shared::cluster") == 1
        assert ptx.count("barrier.cluster.arrive") == 2 and ptx.count("barrier.cluster.wait") == 2
        assert ptx.count("bar.sync") == (2 if gate_mma else 3) + (0 if km.WARP_COLUMNS else 2)
    else:
        assert ptx.count("atom.global") == 1 and "atom.global.acq_rel.add" in ptx
        assert "barrier.cluster" not in ptx
    assert "ld.acquire" not in ptx                                  # no poll loop
    if gate_mma:
        assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 2 * 4 * 2
        assert ptx.count("ld.global.v4") >= 16 + 4                  # f_b and f_a fragments
        assert ptx.count("ld.shared.v4") < 2 * 16 * 8               # no f_a read-back
    else:
        assert "mma.sync" not in ptx
        assert ptx.count("ld.global.v4") >= 16                      # the f_b row, 16 × 128 bit
        assert ptx.count("ld.shared.v4") >= 2 * 16 * 8              # f_a of 8 tokens as vectors
    if ptxas_path() is not None:
        regs, spills = ptxas_usage(tmp_path, ptx)
        assert regs <= 255 and spills == 0, (regs, spills)


@pytest.mark.parametrize("gate_mma,cluster", [(False, False), (True, True), (True, False)])
def test_compiles_at_one_token(monkeypatch, tmp_path: Path, gate_mma: bool, cluster: bool) -> None:
    """T = 1 (B ≥ 2 at k = 0, V_SPLIT 8): the builds the wrapper takes there (B = 8: FMA gates
    and the counter's epilogue; B = 2: tensor cores and the cluster's) and the third; the gate
    mma runs its full n = 8 (one real token) and the token loops collapse to one pass."""
    monkeypatch.setattr(km, "GATE_MMA", gate_mma)
    kcfg = k3_kcfg(0)
    ptx = ptx_of(tmp_path, kcfg, 8, functools.partial(km.KDAMulti, cluster=cluster))
    assert ".target sm_90a" in ptx and "ld.local" not in ptx
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == (16 if gate_mma else 0)
    if cluster:
        assert "atom.global" not in ptx and ptx.count("st.shared::cluster") == 1
    else:
        assert ptx.count("atom.global") == 1 and "barrier.cluster" not in ptx
    if ptxas_path() is not None:
        regs, spills = ptxas_usage(tmp_path, ptx)
        assert regs <= 255 and spills == 0, (regs, spills)


@pytest.mark.parametrize("gate_mma,warp_columns,barriers", [(True, True, 4), (False, True, 5),
                                                            (True, False, 6), (False, False, 7)])
def test_fewer_barriers_than_kda_split(monkeypatch, tmp_path: Path, gate_mma: bool, warp_columns: bool,
                                       barriers: int) -> None:
    """Static barriers: kda_split's T-token loop body holds 5 (plus the last CTA's row loop);
    kda_multi's token loop holds none with WARP_COLUMNS (2 with kda_split's layout: kᵀS, q̂ᵀS),
    the arrival 2 and the last CTA one for all T rows; the tensor-core gates need no barrier of
    their own (f_a in registers), the FMA ones two."""
    monkeypatch.setattr(km, "GATE_MMA", gate_mma)
    monkeypatch.setattr(km, "WARP_COLUMNS", warp_columns)
    kcfg = k3_kcfg(7)
    split = ptx_of(tmp_path / "s", kcfg, 16, KDASplit)
    multi = ptx_of(tmp_path / "m", kcfg, 16, km.KDAMulti)
    assert multi.count("bar.sync") == barriers and split.count("bar.sync") == 9, (multi.count("bar.sync"),
                                                                                   split.count("bar.sync"))


@pytest.mark.parametrize("cols", [4, 8, 16, 32])
def test_warp_columns_layout_sums_each_column_over_its_keys(cols: int) -> None:
    """WARP_COLUMNS for every C the kernel takes (V_SPLIT 32..4): warp_column gives each
    (key, column) of the slice to exactly one (thread, register), a column's threads sit in one
    warp, and the kernel's butterfly (xor offsets 2^lg_w .. 16) leaves every one of them holding
    the column's full sum over its 128 keys (an integer replay of the shuffles), with key rows
    kr·C + r (key_of) as load_slice reads them."""
    kcfg = k3_kcfg(7)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(km, "WARP_COLUMNS", True)
        mod = km.KDAMulti(km.KDASplitConfig(kcfg, kcfg.head_dim // cols), cluster=False)
    assert mod.C == cols and mod.rows == 128 // cols
    value = {(key, c): 1000 * c + key for key in range(128) for c in range(cols)}
    seen: set[tuple[int, int]] = set()
    part = [0] * 128
    for tid in range(128):
        c, kr = km.warp_column(tid, cols)
        assert 0 <= c < cols and 0 <= kr < mod.rows
        for r in range(cols):
            key = mod.key_of(kr, r)
            assert key == kr * cols + r               # the thread's keys contiguous (vector loads)
            assert (key, c) not in seen
            seen.add((key, c))
            part[tid] += value[(key, c)]
    assert len(seen) == 128 * cols
    for w in range(4):                                 # the butterfly inside each warp
        lanes = part[32 * w: 32 * w + 32]
        for sh in range(mod.lg_w, 5):
            lanes = [lanes[i] + lanes[i ^ (1 << sh)] for i in range(32)]
        for lane in range(32):
            c, _ = km.warp_column(32 * w + lane, cols)
            assert lanes[lane] == sum(value[(key, c)] for key in range(128)), (cols, w, lane)
    # the o writers (lane < C/4) have kr = 0, one per column
    writers = [km.warp_column(t, cols) for t in range(128) if t % 32 < cols // km.WARPS]
    assert sorted(c for c, _ in writers) == list(range(cols)) and all(kr == 0 for _, kr in writers)


def test_warp_columns_build_has_no_barrier_in_the_token_loop(monkeypatch, tmp_path: Path) -> None:
    """The B = 1, k = 7 build (V_SPLIT 8, cluster, tensor-core gates): the token loop's column
    sums are butterfly shuffles over xor 4, 8, 16, and the only CTA barriers are the prelude's
    and the epilogue's; ptxas fits it without spills. With WARP_COLUMNS off the same build has
    kda_split's 2 barriers per token back."""
    kcfg = k3_kcfg(7)
    monkeypatch.setattr(km, "WARP_COLUMNS", True)
    ptx = ptx_of(tmp_path / "w", kcfg, 8, km.KDAMulti)
    assert ptx.count("bar.sync") == 2
    assert ptx.count("ld.shared.v4") == 7 + 3 * 16 // 4        # + k, q, exp(g): C / 4 each
    bfly = [ln.split(",")[2].strip() for ln in ptx.splitlines() if "shfl.sync.bfly" in ln]
    assert {"4", "8", "16"} <= set(bfly), sorted(set(bfly))
    if ptxas_path() is not None:
        regs, spills = ptxas_usage(tmp_path / "w", ptx)
        assert regs <= 255 and spills == 0, (regs, spills)
    monkeypatch.setattr(km, "WARP_COLUMNS", False)
    assert ptx_of(tmp_path / "x", kcfg, 8, km.KDAMulti).count("bar.sync") == 4


@pytest.mark.parametrize("after", [True, False])
def test_cluster_epilogue_stores_the_state_after_the_exchange(monkeypatch, tmp_path: Path, after: bool) -> None:
    """STATE_AFTER_EXCHANGE: every global store of the B = 1, k = 7 build (state slice, v
    history, output, q/k history) follows the exchange's cluster arrive; off, the C state stores
    (and the v history's) come before it."""
    monkeypatch.setattr(km, "STATE_AFTER_EXCHANGE", after)
    lines = ptx_of(tmp_path, k3_kcfg(7), 8, km.KDAMulti).splitlines()
    arrive = [i for i, ln in enumerate(lines) if "barrier.cluster.arrive" in ln][-1]
    before = [ln for ln in lines[:arrive] if "st.global" in ln]
    assert len(before) == (0 if after else 16 + 3), len(before)


@pytest.mark.parametrize("after", [True, False])
def test_z_loads_of_every_token_come_before_the_first_sigmoid(monkeypatch, tmp_path: Path, after: bool) -> None:
    """BETA_AFTER_LOADS (B = 1, k = 7 build): past griddepcontrol.wait every z load of the 8
    tokens (q, k, v per token, the output gate, β) precedes the first exp (β's sigmoid, now
    after the loop), so ptxas can issue them as one batch; with β's sigmoid inside the token
    loop (off) only the first token's loads come before it, the shape ncu saw as 8 dependent
    round trips."""
    monkeypatch.setattr(km, "BETA_AFTER_LOADS", after)
    lines, wait = chained_ptx_at_wait(lambda: ptx_of(tmp_path, k3_kcfg(7), 8, km.KDAMulti))
    rest = lines[wait:]
    first_exp = next(i for i, ln in enumerate(rest) if ln.startswith("ex2"))
    loads = sum(ln.startswith("ld.global.b16") for ln in rest[:first_exp])
    assert loads == (8 * 3 + 2 if after else 5), loads


def test_chained_build_reads_z_after_the_wait(tmp_path: Path) -> None:
    """PDL chain on: the state slice, conv history and weights, the f_b fragments (the f_b row
    without the tensor-core gates), dt_bias, A_log and o_norm load before griddepcontrol.wait;
    every z value after it; the release follows the wait."""
    lines, wait = chained_ptx_at_wait(lambda: ptx_of(tmp_path, k3_kcfg(7), 16, km.KDAMulti))
    assert lines[wait + 1].startswith("griddepcontrol.launch_dependents")
    before = [s for s in lines[:wait] if s.startswith("ld.global")]
    after = [s for s in lines[wait:] if s.startswith("ld.global")]
    # S slice 8 + conv q, k history 6 + v history 3 (b16) + conv weights q, k, v (one v4 each)
    # + f_b fragments 16 (v4) + dt_bias of the lane's 4 keys, A_log, o_norm
    assert len(before) == 8 + 6 + 3 + 3 + 16 + 4 + 2, before
    assert sum("v4" in s for s in before) == 3 + 16
    # z of 8 tokens: q, k, the output gate, v per token, β (one load, thread tid < T: the
    # BETA_AFTER_LOADS build), f_a's 4 fragments (v4), and the last CTA's 8 o rows
    assert len(after) >= 8 * 4 + 1 + 4 + 8
    assert sum("v4" in s for s in after) == 4
    assert not any(s.startswith("bar.sync") for s in lines[:wait])


def test_limits_and_wrapper() -> None:
    kcfg = k3_kcfg(7)
    for t in (1, 2, 8, km.MAX_TOKENS):
        assert km.can_implement(kcfg.heads, kcfg.head_dim, 4, kcfg.in_proj_rows, t, (bf,))
    assert not km.can_implement(kcfg.heads, kcfg.head_dim, 4, kcfg.in_proj_rows, 0, (bf,))
    assert not km.can_implement(kcfg.heads, kcfg.head_dim, 4, kcfg.in_proj_rows, km.MAX_TOKENS + 1, (bf,))
    k17 = k3_kcfg(16)                 # T = 17: past MAX_TOKENS
    p = k17.heads * k17.head_dim
    with pytest.raises(ValueError, match="kda_decode_multi cannot run"):
        km.kda_decode_multi(torch.zeros(17, k17.in_proj_rows, dtype=bf), torch.zeros(p, 128, dtype=bf),
                            torch.zeros(3 * p, 4), torch.zeros(1, 3 * p, 3, dtype=bf), torch.zeros(p),
                            torch.zeros(k17.heads), torch.zeros(1, k17.heads, 128, 128), torch.ones(128, dtype=bf),
                            k17, make_scratch(k17, 1, "cpu"))
    with pytest.raises(ValueError, match="cluster epilogue cannot run"):
        km.KDAMulti(km.KDASplitConfig(kcfg, 16), cluster=True)      # V_SPLIT 16: past a portable cluster


def test_registered_for_the_device_check() -> None:
    from kimi_decode.kernels import CHECK_MODULES, KERNELS, checks
    assert "kda_multi" in KERNELS and CHECK_MODULES["kda_multi"] == "kda_multi"
    assert "kda_multi" in checks.CHECKS


def test_check_harness_on_cpu_with_emulated_kernels(monkeypatch) -> None:
    """kda_multi.check() (stock module at k = 7, steps with state carried, reference, kda_split
    side by side, counters) runs on the CPU with the thread-level emulation for both launches,
    passes and reports bit identity; a wrong gate lower bound fails it."""
    from kimi_decode.kernels import checks
    from kimi_decode.kernels import kda_split as ks
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(km, "kda_decode_multi", _fake_split)
    monkeypatch.setattr(ks, "kda_decode_split", _fake_split)
    rows = km.check(timing=False, batches=(1,), steps=2, k0_batches=(2,))
    assert len(rows) == 2 and all(r["ok"] and r["bit_identical"] for r in rows), rows
    assert [(r["kernel"], r["k"]) for r in rows] == [("kda_multi", 7), ("kda_multi", 0)]
    assert all(r["counter_zero"] for r in rows)
    monkeypatch.setattr(km, "kda_decode_multi", _wrong_split)
    for row in km.check(timing=False, batches=(1,), steps=1, k0_batches=(2,)):
        assert not row["ok"] and not row["bit_identical"]


def test_fused_dispatch(monkeypatch) -> None:
    """fused.KDAAttention.forward calls kda_decode_multi when use_kda_multi is set (enable(): kernel
    on, T ≥ 2, M ≤ MAX_ROWS["kda_multi"]) and the stock ops otherwise."""
    from kimi_decode import fused
    from kimi_decode.config import k3_tp16
    calls: list[int] = []
    monkeypatch.setattr(km, "kda_decode_multi", lambda z, *a, **kw: calls.append(z.shape[0]) or z[:, :768])
    monkeypatch.setattr(fused, "_project_and_reduce", lambda mod, o: o)
    cfg = k3_tp16(batch=1, spec_tokens=7)
    attn = SimpleNamespace(cfg=cfg, k=SimpleNamespace(), use_kernel=True, use_gemv=False, ar_slots=False,
                           use_kda_multi=True, use_fast=False, split_scratch=object(), in_proj=None,
                           f_b=None, conv_w=None, conv_state=None, dt_bias=None, a_log=None, rec_state=None,
                           o_norm=None)
    monkeypatch.setattr(fused, "_linear", lambda x, w, g, k: torch.zeros(8, cfg.in_proj_rows, dtype=bf))
    fused.KDAAttention.forward(attn, torch.zeros(8, cfg.hidden, dtype=bf))
    assert calls == [8]
    assert fused.MAX_ROWS["kda_multi"] == 8


def test_applies_within_the_table_except_kda_fasts_shape() -> None:
    """fused._kda_multi_applies: B = 1, k = 7 and B = 8, k = 0 (M = 8) yes; B = 1, k = 0 (T = 1:
    kda_fast's), B = 8, k = 7 and B = 64, k = 0 (M = 64, past MAX_ROWS["kda_multi"]) no."""
    from kimi_decode import fused
    from kimi_decode.config import k3_tp16
    assert fused._kda_multi_applies(k3_tp16(batch=1, spec_tokens=7))
    assert fused._kda_multi_applies(k3_tp16(batch=8, spec_tokens=0))
    assert fused._kda_multi_applies(k3_tp16(batch=2, spec_tokens=0))
    assert not fused._kda_multi_applies(k3_tp16(batch=1, spec_tokens=0))
    assert not fused._kda_multi_applies(k3_tp16(batch=8, spec_tokens=7))
    assert not fused._kda_multi_applies(k3_tp16(batch=64, spec_tokens=0))


@pytest.mark.parametrize("batch,tokens,want_fma", [(1, 8, False), (2, 8, False), (4, 8, False), (8, 8, True),
                                                   (2, 1, False), (8, 1, True), (64, 1, True)])
def test_wrapper_picks_the_epilogue_and_the_gates_by_grid_size(monkeypatch, batch: int, tokens: int,
                                                                        want_fma: bool) -> None:
    """kda_decode_multi: V_SPLIT 8 with the cluster epilogue where the grid has at most one CTA
    per SM of the H200 (B = 1: 48, B = 2: 96), kda_split's splits_for above with the counter's
    epilogue (B = 4 and 8: V_SPLIT 8 in 192 and 384 CTAs, not clustered; B = 64: V_SPLIT 4);
    the tensor-core build (2 CTAs per SM by its registers) where B · H · V_SPLIT fits 2 per
    SM, the FMA build where it does not (B = 4: 192 CTAs, tensor cores; B = 8: 384, FMA). T = 1
    (k = 0) chooses as T = 8 does."""
    chosen: list[object] = []
    monkeypatch.setattr(km, "launch", lambda name, fn, *a, **kw: chosen.append((fn, a[-1])))
    kcfg = k3_kcfg(tokens - 1)
    p = kcfg.heads * kcfg.head_dim
    km.kda_decode_multi(torch.zeros(batch * tokens, kcfg.in_proj_rows, dtype=bf), None, None,
                        torch.zeros(batch, 3 * p, 3, dtype=bf), None, None, None, None, kcfg, None)
    fits = batch * kcfg.heads * km.CLUSTER_SPLITS <= 132
    want_splits = km.CLUSTER_SPLITS if fits else splits_for(batch)
    ((fn, splits),) = chosen
    assert splits == want_splits
    assert fn.func is (km.compile_fma if want_fma else km.compile_for)
    assert fn.keywords == {"cluster": fits}


def test_build_switches_are_part_of_the_compile_key(monkeypatch) -> None:
    """GATE_MMA and CLUSTER_NORM change the traced kernel, so each setting caches under its own
    name: flipping one in a process (the bench's A/B runs) never reuses the other build."""
    names = {km._build_name(gate, cluster) for gate in (True, False) for cluster in (True, False)}
    assert len(names) == 4
    for switch in ("WARP_COLUMNS", "STATE_AFTER_EXCHANGE"):
        monkeypatch.setattr(km, switch, not getattr(km, switch))
        other = {km._build_name(gate, cluster) for gate in (True, False) for cluster in (True, False)}
        assert not names & other
        names |= other
    # the epilogue a build takes when the caller leaves it open follows CLUSTER_NORM
    cfg8 = km.KDASplitConfig(k3_kcfg(7), 8)
    assert km._cluster_for(cfg8, None) and not km._cluster_for(cfg8, False)
    monkeypatch.setattr(km, "CLUSTER_NORM", False)
    assert not km._cluster_for(cfg8, None)


def test_cluster_grid_limit_is_a_switch(monkeypatch) -> None:
    """CLUSTER_MAX_CTAS_PER_SM = 3 lets B = 8, k = 0 (384 CTAs of V_SPLIT 8) take the cluster
    epilogue (the A/B the constant exists for); at 1 it keeps the counter's."""
    chosen: list[object] = []
    monkeypatch.setattr(km, "launch", lambda name, fn, *a, **kw: chosen.append(fn))
    kcfg = k3_kcfg(0)
    p = kcfg.heads * kcfg.head_dim
    args = (torch.zeros(8, kcfg.in_proj_rows, dtype=bf), None, None, torch.zeros(8, 3 * p, 3, dtype=bf),
            None, None, None, None, kcfg, None)
    km.kda_decode_multi(*args)
    monkeypatch.setattr(km, "CLUSTER_MAX_CTAS_PER_SM", 3)
    km.kda_decode_multi(*args)
    assert [fn.keywords["cluster"] for fn in chosen] == [False, True]
