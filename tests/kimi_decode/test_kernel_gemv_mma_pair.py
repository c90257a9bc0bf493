"""gemv_mma_pair on the CPU: it compiles to sm_90a PTX at the K3 TP16 shapes it runs (qkv_a +
g_proj at M = 2, 4, 8) as two copies of gemv_mma's tile body behind one CTA-uniform branch,
its limits and wrapper errors, the kernel's arithmetic (gemv_mma.emulate per half, the split
of the grid) in float64 against the plain products, fused's dispatch and the MLA step wired
with it (emulated by its contract) against stock, and check()'s harness on the CPU with the
kernel replaced by its contract (passing) and by a wrong one (failing).
"""
from __future__ import annotations

import os
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

    def pair(x, w1, w2):
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

    def exact(x, w1, w2, unroll=gm.UNROLL):
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
