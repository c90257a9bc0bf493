"""gemv_mma_pair on the CPU: it compiles to sm_90a PTX at the K3 TP16 shapes it runs (qkv_a +
g_proj at M = 2, 4, 8) as two copies of gemv_mma's tile body behind one CTA-uniform branch,
its limits and wrapper errors, the kernel's arithmetic (gemv_mma.emulate per half, the split
of the grid) in float64 against the plain products, fused's dispatch and the MLA step wired
with it (emulated by its contract) against stock, and check()'s harness on the CPU with the
kernel replaced by its contract (passing) and by a wrong one (failing).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

from kimi_decode.config import k3_tp16, tiny  # noqa: E402
from kimi_decode.kernels import _common  # noqa: E402
from kimi_decode.kernels import gemv_mma as gm  # noqa: E402
from kimi_decode.kernels import gemv_mma_pair as gp  # noqa: E402
from tests.kimi_decode.ptxas_tool import ptxas_path, ptxas_usage  # noqa: E402

bf = torch.bfloat16
K3 = k3_tp16(batch=8, spec_tokens=0)
N1, N2, D = K3.qkv_a_rows, K3.mla_local_heads * K3.v_head_dim, K3.hidden
MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


def pair_ptx(tmp_path: Path, m: int) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    opts = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    P = _common.dummy_ptr(bf)
    cute.compile(gp.GemvMmaPair(gp.config_for(m, N1, N2, D)), P, P, P, P, P, _common.current_stream(),
                 options=opts)
    (f,) = list(tmp_path.glob("*.ptx"))
    return f.read_text()


def single_ptx(tmp_path: Path, m: int, n: int, warps: int) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    opts = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    P = _common.dummy_ptr(bf)
    cute.compile(gm.GemvMma(gm.GemvMmaConfig(n, D, m, warps=warps)), P, P, P, _common.current_stream(),
                 options=opts)
    (f,) = list(tmp_path.glob("*.ptx"))
    return f.read_text()


@pytest.mark.parametrize("m", [2, 8])
def test_compiles_as_two_gemv_mma_tile_bodies(tmp_path: Path, m: int) -> None:
    """K3: 132 + 48 CTAs of 8 warps; the PTX holds twice the mma and 128-bit global loads of
    gemv_mma's kernel at the same warp count (one tile body per half), no local memory, and
    ptxas fits it without spills."""
    cfg = gp.config_for(m, N1, N2, D)
    kern = gp.GemvMmaPair(cfg)
    assert cfg.warps == 8 and kern.t1 == 132 and kern.ctas == 132 + 48
    ptx = pair_ptx(tmp_path / "p", m)
    one = single_ptx(tmp_path / "s", m, N1, 8)
    assert ".target sm_90a" in ptx and "ld.local" not in ptx and "st.local" not in ptx
    assert ptx.count(MMA) == 2 * one.count(MMA) > 0
    assert ptx.count("ld.global.v4") == 2 * one.count("ld.global.v4")
    assert ptx.count("bar.sync") == 2 * one.count("bar.sync")
    if ptxas_path() is not None:
        regs, spills = ptxas_usage(tmp_path / "p", ptx)
        assert regs <= 255 and spills == 0, (regs, spills)


def test_limits_and_wrapper_errors() -> None:
    assert gp.can_implement(8, N1, N2, D, (bf, bf, bf))
    assert gp.can_implement(2, N1, N2, D, (bf,))
    assert not gp.can_implement(1, N1, N2, D, (bf,))        # M = 1: gemv_multi's
    assert not gp.can_implement(9, N1, N2, D, (bf,))        # past the mma's n
    assert not gp.can_implement(8, N1, 0, D, (bf,))
    assert not gp.can_implement(8, N1, N2, D + 16, (bf,))   # K not a multiple of 32
    assert not gp.can_implement(8, N1, N2, D, (torch.float16,))
    x = torch.zeros(8, D, dtype=bf)
    with pytest.raises(ValueError, match="gemv_mma_pair cannot run"):
        gp.gemv_mma_pair(x, torch.zeros(N1, D, dtype=bf), torch.zeros(N2, D + 32, dtype=bf))
    with pytest.raises(ValueError, match="gemv_mma_pair cannot run"):
        gp.gemv_mma_pair(torch.zeros(1, D, dtype=bf), torch.zeros(N1, D, dtype=bf), torch.zeros(N2, D, dtype=bf))


def test_emulated_arithmetic_matches_the_products() -> None:
    """The grid's split (tiles 0..T1-1 of W1, then W2) with gemv_mma's per-tile arithmetic
    replayed in float64 at the pair's warp count, on shapes with a partial last tile in each
    half: equal to x @ Wᵀ within float64 rounding."""
    gen = torch.Generator().manual_seed(5)
    n1, n2, k, m = 40, 24, 256, 5
    cfg = gp.config_for(m, n1, n2, k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w1 = torch.randn(n1, k, generator=gen).bfloat16()
    w2 = torch.randn(n2, k, generator=gen).bfloat16()
    e1, e2 = gm.emulate(x, w1, cfg.warps), gm.emulate(x, w2, cfg.warps)
    r1, r2 = gp.reference(x, w1, w2)
    assert torch.allclose(e1, r1, rtol=1e-12, atol=1e-10) and torch.allclose(e2, r2, rtol=1e-12, atol=1e-10)
    kern = gp.GemvMmaPair(cfg)
    assert kern.t1 == 3 and kern.ctas == 3 + 2


def test_fused_dispatch_and_step_on_cpu(monkeypatch) -> None:
    """MLAAttention runs one gemv_mma_pair launch (op qkv_a_g) for qkv_a + g_proj where the pair
    applies (kernel on, M within the table and the kernel's limits), emulated by its contract:
    the step equals stock; off, or past MAX_ROWS, it issues none."""
    import kimi_decode.fused as fused_mod
    from kimi_decode.fused import FusedDecoder
    from kimi_decode.stock import StockDecoder
    calls: list[tuple[int, int]] = []

    def pair(x, w1, w2, counter=None):
        calls.append((w1.data_ptr(), w2.data_ptr()))
        return x @ w1.t(), x @ w2.t()
    monkeypatch.setattr(gp, "gemv_mma_pair", pair)
    monkeypatch.setattr(gp, "can_implement", lambda *a, **k: True)
    cfg = tiny(layers=(3, 4, 5, 6, 7, 8), batch=2, spec_tokens=3)        # M = 8
    stock = StockDecoder(cfg)
    fused = FusedDecoder.from_stock(stock)
    mla = [layer.attn for layer in fused.layers if layer.kind == "mla"]
    assert len(mla) == 2
    for a in mla:
        a.use_pair = True
    m, prefix, blocks = stock.make_inputs(seed=11)
    with torch.no_grad():
        want = stock(m, prefix, blocks)
        got = fused(m, prefix, blocks)
    assert calls == [(a.qkv_a.data_ptr(), a.g_proj.data_ptr()) for a in mla]
    assert all(torch.allclose(g.float(), w.float(), rtol=2e-2, atol=2e-2) for g, w in zip(_flat(got), _flat(want)))
    calls.clear()
    monkeypatch.setitem(fused_mod.MAX_ROWS, "gemv_mma_pair", 4)            # M = 8 past the table
    with torch.no_grad():
        fused(m, prefix, blocks)
    assert calls == []


def _flat(out: object) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)]


def test_enable_sets_the_switch(monkeypatch) -> None:
    import kimi_decode.fused as fused_mod
    from kimi_decode import kernels
    from kimi_decode.fused import FusedDecoder
    from kimi_decode.stock import StockDecoder
    monkeypatch.setattr(fused_mod, "_kernels_usable", lambda dev: True)
    monkeypatch.setattr(fused_mod, "VERIFIED", fused_mod.VERIFIED | {"gemv_mma_pair"})
    monkeypatch.setattr(kernels, "applicable", lambda name, cfg: True)
    fused = FusedDecoder.from_stock(StockDecoder(tiny(layers=(3, 4), batch=1)))
    mla = [layer.attn for layer in fused.layers if layer.kind == "mla"]
    assert mla
    fused.enable(frozenset({"gemv_mma_pair"}))
    assert all(a.use_pair for a in mla)
    fused.enable(frozenset({"gemv"}))
    assert not any(a.use_pair for a in mla)


def test_registered_for_the_device_check() -> None:
    from kimi_decode.kernels import CHECK_MODULES, KERNELS, checks
    assert "gemv_mma_pair" in KERNELS and CHECK_MODULES["gemv_mma_pair"] == "gemv_mma_pair"
    assert "gemv_mma_pair" in checks.CHECKS
    from kimi_decode import fused
    # passed its H200 check; a tie or a win in the step on the H100 (sessions 21, 23): default
    assert "gemv_mma_pair" in fused.DEFAULT_KERNELS and "gemv_mma_pair" not in fused.OPT_IN


def test_check_harness_on_cpu(monkeypatch) -> None:
    """check() on the CPU with the kernel and gemv_mma replaced by their contracts (bf16 of the
    float32 products): every row passes; a kernel whose second output is off by 5 % fails."""
    from kimi_decode.kernels import checks
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(checks, "_sync", lambda: None)

    def exact(x, w1, w2, unroll=gm.UNROLL, counter=None):
        return (x.float() @ w1.float().t()).bfloat16(), (x.float() @ w2.float().t()).bfloat16()
    monkeypatch.setattr(gp, "gemv_mma_pair", exact)
    monkeypatch.setattr(gm, "gemv_mma", lambda x, w, *a, **k: (x.float() @ w.float().t()).bfloat16())
    rows = gp.check(timing=False)
    assert [r["M"] for r in rows] == [2, 4, 8] and all(r["ok"] for r in rows), rows
    assert all(r["first_equal_gemv_mma"] and r["repeat_equal"] for r in rows)

    def wrong(x, w1, w2, unroll=gm.UNROLL):
        a, b = exact(x, w1, w2)
        return a, (b.float() * 1.05).bfloat16()
    monkeypatch.setattr(gp, "gemv_mma_pair", wrong)
    assert not any(r["ok"] for r in gp.check(timing=False))


# ---- SIGNAL: q_b entered on qkv_a's CTAs (an A/B, off) ---------------------------------------

def signal_ptx(tmp_path: Path, m: int, g_after: bool) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    P = _common.dummy_ptr(bf)
    cfg = dataclasses.replace(gp.config_for(m, N1, N2, D), signal=True, g_after=g_after)
    cute.compile(gp.GemvMmaPairSignal(cfg), P, P, P, P, P, _common.dummy_ptr(torch.int32), _common.current_stream(),
                 options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}")
    (f,) = list(tmp_path.glob("*.ptx"))
    return f.read_text()


def norm_ptx(tmp_path: Path, after: int) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    P = _common.dummy_ptr(bf)
    cfg = gm.GemvMmaConfig(QB_N, QL, 8, warps=gm.warps_for(QB_N, QL), eps=1e-5, x_stride=N1, after=after)
    kern, extra = (gp.GemvMmaNormAfter(cfg), [_common.dummy_ptr(torch.int32)]) if after else (gm.GemvMmaNorm(cfg), [])
    cute.compile(kern, P, P, P, P, *extra, _common.current_stream(),
                 options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}")
    (f,) = list(tmp_path.glob("*.ptx"))
    return f.read_text()


QL, QB_N = K3.q_lora_rank, K3.mla_local_heads * K3.qk_head_dim      # q_b: [1152, 1536]


def ops(ptx: str) -> list[str]:
    """The PTX instruction lines, in order (comments and blank lines dropped)."""
    return [s.strip() for s in ptx.splitlines() if s.strip() and not s.strip().startswith("//")]


def first(lines: list[str], op: str, start: int = 0) -> int:
    return next(i for i in range(start, len(lines)) if lines[i].startswith(op))


def test_signal_default_off_and_counter_shape() -> None:
    assert gp.SIGNAL is False and gp.G_AFTER_QKV is True and gp.COUNTER_WORDS == 2
    assert gp.producers(8, N1, N2, D) == 132                # qkv_a's CTAs at K3
    c = gp.pair_counter("cpu")
    assert c.dtype == torch.int32 and c.tolist() == [0, 0]
    for bad in (torch.zeros(3, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)):
        with pytest.raises(ValueError, match="signal counter must be 2 contiguous int32 words"):
            gp._check_counter(bad)


@pytest.mark.parametrize("g_after", [True, False])
def test_signalled_pair_build(tmp_path: Path, g_after: bool) -> None:
    """The qkv_a half signals after its stores: its output store, a CTA barrier, fence.acq_rel.gpu,
    then one atom.add.release (gpu scope); the g_proj half (g_after) polls with ld.acquire.gpu
    only after its chain step (wait, launch_dependents), so q_b launches while it waits. The
    arithmetic is the plain pair's (same mma and 128-bit loads); ptxas keeps 64 registers' worth
    (≤ 255), no spills."""
    from kimi_decode.kernels import chain
    chain.set_chain(True, 0)
    try:
        ptx = signal_ptx(tmp_path / "s", 8, g_after)
        plain = pair_ptx(tmp_path / "p", 8)
    finally:
        chain.set_chain(False, chain.DEFAULT_BUDGET)
    lines = ops(ptx)
    assert ptx.count(MMA) == plain.count(MMA) and ptx.count("ld.global.v4") == plain.count("ld.global.v4")
    assert ptx.count("atom.") == 1 and ptx.count("atom.global.release.add") == 1
    atom = first(lines, "atom.global.release.add")
    assert lines[atom - 1] == "fence.acq_rel.gpu;"
    assert any(x.startswith("bar.sync") for x in lines[atom - 4:atom - 1])
    assert any(x.startswith("st.global.b16") for x in lines[:atom])            # the tile's output first
    polls = [i for i, x in enumerate(lines) if x.startswith("ld.acquire.gpu")]
    if g_after:
        assert polls and all(i > max(j for j, x in enumerate(lines) if x.startswith("griddepcontrol.launch"))
                             for i in polls)
    else:
        assert polls == []
    if ptxas_path() is not None:
        regs, spills = ptxas_usage(tmp_path / "s", ptx)
        assert regs <= 255 and spills == 0, (regs, spills)


def test_q_b_after_build(tmp_path: Path) -> None:
    """GemvMmaNormAfter: its first weights loaded, then launch_dependents, then the poll on word
    0 (ld.acquire.gpu), then the normalised row's loads and the mma; griddepcontrol.wait only
    after the output stores, followed by the arrival (atom.add acq_rel) and the re-zeroing
    store. The plain GemvMmaNorm waits (wait, launch) before its first mma and has no atomics.
    Same mma count; ptxas within one CTA per SM (≤ 128 registers at 16 warps), no spills."""
    from kimi_decode.kernels import chain
    chain.set_chain(True, 0)
    try:
        after = ops(norm_ptx(tmp_path / "a", 132))
        plain = ops(norm_ptx(tmp_path / "n", 0))
    finally:
        chain.set_chain(False, chain.DEFAULT_BUDGET)
    count = lambda lines, op: sum(x.startswith(op) for x in lines)  # noqa: E731
    assert count(after, "mma.sync") == count(plain, "mma.sync") > 0
    launch, poll = first(after, "griddepcontrol.launch_dependents"), first(after, "ld.acquire.gpu")
    mma, wait = first(after, "mma.sync"), first(after, "griddepcontrol.wait")
    stores = [i for i, x in enumerate(after) if x.startswith("st.global.b16")]
    assert first(after, "ld.global.v4") < launch < poll < mma < stores[0]
    assert max(stores) < wait < first(after, "atom.global.acq_rel.add") < first(after, "st.global.v2.b32")
    assert count(after, "griddepcontrol.wait") == 1 and count(after, "atom.") == 1
    assert first(plain, "griddepcontrol.wait") < first(plain, "griddepcontrol.launch") < first(plain, "mma.sync")
    assert count(plain, "atom.") == 0 and count(plain, "ld.acquire") == 0
    if ptxas_path() is not None:
        regs, spills = ptxas_usage(tmp_path / "a", "\n".join(after))
        assert regs <= 128 and spills == 0, (regs, spills)


def _emulate_signal(monkeypatch, calls: list) -> None:
    """The signalled pair and q_b by their contracts, the counter protocol included: the pair
    adds its T1 signals; q_b requires them all, then re-zeroes the counter."""
    import torch.nn.functional as F

    def pair(x, w1, w2, counter=None):
        calls.append("pair+signal" if counter is not None else "pair")
        if counter is not None:
            counter[0] += (w1.shape[0] + 15) // 16
        return x @ w1.t(), x @ w2.t()

    def after(a, w_norm, w, k, eps, counter, producers):
        calls.append("q_b_after")
        assert int(counter[0]) == producers, "q_b entered before every qkv_a CTA signalled"
        counter.zero_()
        return F.rms_norm(a[:, :k], (k,), w_norm, eps) @ w.t()
    monkeypatch.setattr(gp, "gemv_mma_pair", pair)
    monkeypatch.setattr(gp, "can_implement", lambda *a, **k: True)
    monkeypatch.setattr(gp, "gemv_mma_rmsnorm_after", after)
    monkeypatch.setattr(gp, "producers", lambda m, n1, n2, k: (n1 + 15) // 16)


@pytest.mark.parametrize("signal", [True, False])
def test_fused_signal_call_sites_on_cpu(monkeypatch, signal: bool) -> None:
    """At M = 8 with the pair and the folded q_b on: with a counter (SIGNAL) each MLA layer runs
    the signalled pair then q_b entered on it, and the counter is zero after the step; without,
    the plain pair and gemv_mma_rmsnorm. The step equals stock either way (float32 rounding)."""
    from tests.kimi_decode.test_fused import _emulate_fold_kernels, run_close
    from kimi_decode.fused import FusedDecoder
    from kimi_decode.stock import StockDecoder
    cfg = tiny(layers=(3, 4, 5, 6, 7, 8), batch=2, spec_tokens=3)        # M = 8
    calls: list[str] = []
    _emulate_fold_kernels(monkeypatch, cfg, calls)
    _emulate_signal(monkeypatch, calls)
    stock = StockDecoder(cfg)
    fused = FusedDecoder.from_stock(stock)
    mla = [layer.attn for layer in fused.layers if layer.kind == "mla"]
    assert len(mla) == 2
    for attn in mla:
        attn.use_gemv = attn.use_glue = attn.use_pair = attn.use_fold_mma = True
        attn.pair_counter = gp.pair_counter("cpu") if signal else None
    run_close(stock, fused, seed=81, steps=2)
    per_layer = (["pair+signal", "q_b_after", "uk_insert_norm"] if signal
                 else ["pair", "gemv_mma_rmsnorm", "uk_insert_norm"])
    assert calls == per_layer * (2 * 2)                                  # 2 MLA layers, 2 steps
    assert all(a.pair_counter is None or not a.pair_counter.any() for a in mla)


@pytest.mark.parametrize("switch,kernels,allocated", [
    (True, {"gemv_mma_pair", "mla_norm_fold_mma", "mla_glue"}, True),
    (False, {"gemv_mma_pair", "mla_norm_fold_mma", "mla_glue"}, False),
    (True, {"gemv_mma_pair", "mla_glue"}, False),                        # no folded q_b to re-zero it
    (True, {"mla_norm_fold_mma", "mla_glue"}, False)])
def test_enable_allocates_the_counter_only_for_the_signal(monkeypatch, switch: bool, kernels: set,
                                                          allocated: bool) -> None:
    import kimi_decode.fused as fused_mod
    from kimi_decode import kernels as kmod
    from kimi_decode.fused import FusedDecoder
    from kimi_decode.stock import StockDecoder
    monkeypatch.setattr(fused_mod, "_kernels_usable", lambda dev: True)
    monkeypatch.setattr(kmod, "applicable", lambda name, cfg: True)
    monkeypatch.setattr(gp, "SIGNAL", switch)
    fused = FusedDecoder.from_stock(StockDecoder(tiny(layers=(3, 4), batch=2, spec_tokens=3)))
    fused.enable(frozenset(kernels))
    mla = [layer.attn for layer in fused.layers if layer.kind == "mla"]
    assert mla and all((a.pair_counter is not None) == allocated for a in mla)
    if allocated:
        assert all(a.pair_counter.tolist() == [0, 0] for a in mla)


def test_check_harness_runs_the_signal(monkeypatch) -> None:
    """check() with SIGNAL on the CPU (kernels by their contracts, the counter protocol
    emulated): every row passes and reports the signalled pair + q_b equal and the counter zero;
    a q_b that forgets to re-zero the counter fails every row."""
    import torch.nn.functional as F

    from kimi_decode.kernels import checks
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(checks, "_sync", lambda: None)
    monkeypatch.setattr(gp, "SIGNAL", True)

    def exact(x, w1, w2, unroll=gm.UNROLL, counter=None):
        if counter is not None:
            counter[0] += gp.producers(x.shape[0], w1.shape[0], w2.shape[0], x.shape[1])
        return (x.float() @ w1.float().t()).bfloat16(), (x.float() @ w2.float().t()).bfloat16()

    def norm(a, w_norm, w, k, eps):
        return (F.rms_norm(a[:, :k].float(), (k,), w_norm.float(), eps).bfloat16().float() @ w.float().t()).bfloat16()

    def after(a, w_norm, w, k, eps, counter, producers):
        ok = int(counter[0]) == producers
        counter.zero_()
        return norm(a, w_norm, w, k, eps) if ok else norm(a, w_norm, w, k, eps) * 2
    monkeypatch.setattr(gp, "gemv_mma_pair", exact)
    monkeypatch.setattr(gp, "gemv_mma_rmsnorm_after", after)
    monkeypatch.setattr(gm, "gemv_mma", lambda x, w, *a, **k: (x.float() @ w.float().t()).bfloat16())
    monkeypatch.setattr(gm, "gemv_mma_rmsnorm", norm)
    rows = gp.check(timing=False)
    assert all(r["ok"] and r["signal_equal"] and r["signal_counter_zero"] for r in rows), rows
    assert [r["signal_producers"] for r in rows] == [132] * 3

    def leaky(a, w_norm, w, k, eps, counter, producers):
        counter[1] += 1                                   # arrives, never re-zeroes
        return norm(a, w_norm, w, k, eps)
    monkeypatch.setattr(gp, "gemv_mma_rmsnorm_after", leaky)
    rows = gp.check(timing=False)
    assert not any(r["ok"] for r in rows) and not any(r["signal_counter_zero"] for r in rows)


# ---- SIGNAL's counter protocol, model-checked over every interleaving --------------------------

def _explore(producers: int, waiters: int, consumers: int, calls: int, reset_when: Callable[[int, int], bool],
             arrive_after_pair: bool = True) -> tuple[bool, bool, bool]:
    """Every interleaving of the protocol's steps (the module docstring, "SIGNAL") over `calls`
    back-to-back calls, each: `producers` qkv_a CTAs (store, then signal: word 0 += 1),
    `waiters` g_proj CTAs (wait word 0 ≥ producers, then store), `consumers` q_b CTAs (wait word 0
    ≥ producers, read the qkv_a outputs, wait for the pair grid's completion when
    `arrive_after_pair`, then arrive: old = word 1, word 1 += 1, and re-zero both words when
    reset_when(old, consumers)). A call starts once the previous one's grids have all completed
    (stream order; the next MLA layer's pair is kernels later). Returns (every read saw all of
    its call's stores, no interleaving deadlocks, both words zero after every call)."""
    import functools

    P, W, Q = producers, waiters, consumers
    # per process: its program counter; producers 0..2 (store, signal, done), waiters 0..2 (wait,
    # store, done), consumers 0..4 (wait, read, pair-wait, arrive, done)
    @functools.lru_cache(maxsize=None)
    def run(call: int, pcs: tuple[int, ...], stored: int, c0: int, c1: int) -> tuple[bool, bool, bool]:
        prod, wait, cons = pcs[:P], pcs[P:P + W], pcs[P + W:]
        if all(p == 2 for p in prod) and all(w == 2 for w in wait) and all(q == 4 for q in cons):
            if call + 1 == calls:
                return True, True, (c0, c1) == (0, 0)
            ok_zero = (c0, c1) == (0, 0)
            reads, live, zero = run(call + 1, (0,) * (P + W + Q), 0, c0, c1)
            return reads, live, zero and ok_zero
        pair_done = all(p == 2 for p in prod) and all(w == 2 for w in wait)
        results = []
        for i, pc in enumerate(prod):
            if pc == 0:
                results.append(run(call, pcs[:i] + (1,) + pcs[i + 1:], stored + 1, c0, c1))
            elif pc == 1:
                results.append(run(call, pcs[:i] + (2,) + pcs[i + 1:], stored, c0 + 1, c1))
        for j, pc in enumerate(wait):
            k = P + j
            if pc == 0 and c0 >= P:
                results.append(run(call, pcs[:k] + (1,) + pcs[k + 1:], stored, c0, c1))
            elif pc == 1:
                results.append(run(call, pcs[:k] + (2,) + pcs[k + 1:], stored, c0, c1))
        for j, pc in enumerate(cons):
            k = P + W + j
            nxt = pcs[:k] + (pc + 1,) + pcs[k + 1:]
            if pc == 0 and c0 >= P:
                results.append(run(call, nxt, stored, c0, c1))
            elif pc == 1:                                  # the read: every store of this call done?
                r = run(call, nxt, stored, c0, c1)
                results.append((r[0] and stored == P, r[1], r[2]))
            elif pc == 2 and (pair_done or not arrive_after_pair):
                results.append(run(call, nxt, stored, c0, c1))
            elif pc == 3:
                old = c1
                n0, n1 = (0, 0) if reset_when(old, Q) else (c0, c1 + 1)
                results.append(run(call, nxt, stored, n0, n1))
        if not results:                                    # nobody can move: a deadlock
            return True, False, False
        return (all(r[0] for r in results), all(r[1] for r in results), all(r[2] for r in results))
    return run(0, (0,) * (P + W + Q), 0, 0, 0)


def test_signal_protocol_model_checked() -> None:
    """The protocol as built (the last q_b CTA, old == CTAs − 1, re-zeroes both words after the
    pair's completion): in every interleaving of two back-to-back calls every q_b read sees all
    qkv_a stores, nothing deadlocks and the counter is zero after each call. Negative controls,
    each caught: the first arriver re-zeroing (a q_b CTA still polling never sees the count: a
    deadlock); the counter never re-zeroed (the next call's q_b enters before its qkv_a stores);
    q_b arriving without waiting for the pair grid (the re-zeroing can come before a g_proj CTA
    has seen the count: a deadlock, even with one q_b CTA)."""
    last = lambda old, n: old == n - 1          # noqa: E731  (GemvMmaNormAfter's rule)
    assert _explore(2, 1, 2, 2, last) == (True, True, True)
    assert _explore(3, 1, 2, 2, last) == (True, True, True)
    assert _explore(2, 2, 3, 2, last) == (True, True, True)
    assert _explore(2, 1, 2, 2, lambda old, n: old == 0) == (True, False, False)
    assert _explore(2, 1, 2, 2, lambda old, n: False) == (False, True, False)
    assert _explore(2, 1, 2, 2, last, arrive_after_pair=False) == (True, False, False)
    assert _explore(2, 1, 1, 2, last, arrive_after_pair=False) == (True, False, False)
