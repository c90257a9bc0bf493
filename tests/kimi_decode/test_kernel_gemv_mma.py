"""gemv_mma (kernels/gemv_mma.py): the projections at 2 ≤ M ≤ 8 on the tensor cores, on the CPU.

Oracles:
- the fragment map: the float64 replay of the kernel's per-lane fragments (emulate) equals
  x @ Wᵀ in float64 (1e-12) on every K3 shape class the step runs (N not a multiple of 16,
  M < 8, 4 / 8 / 16 warps), so the k permutation is a bijection and A and B agree on it; a
  map that pairs A and B differently (the mutation test) fails it;
- PTX: every K3 projection's configuration compiles to sm_90a with mma.sync m16n8k16
  bf16 → f32 (two per chunk), 128-bit loads, one barrier, no spills; ptxas (where installed,
  always under CI) keeps it under 96 registers;
- the per-shape warp choice and can_implement's limits (M = 1 and M = 9 refused).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

import kimi_decode.kernels.gemv_mma as gm  # noqa: E402
from kimi_decode.config import k3_tp16  # noqa: E402
from kimi_decode.kernels import _common  # noqa: E402
from tests.kimi_decode.ptxas_tool import ptxas_path, ptxas_usage  # noqa: E402
from tests.kimi_decode.test_kernels_compile import chained_ptx_at_wait, common_checks  # noqa: E402
from tests.kimi_decode.test_kernels_compile import ptx_of as compiled_ptx  # noqa: E402

bf = torch.bfloat16
P = _common.dummy_ptr
K3 = k3_tp16()
# (N, K) of every projection the fused step runs through _linear at M ≥ 2
SHAPES = {"in_proj": (K3.in_proj_rows, K3.hidden), "o_proj": (K3.hidden, K3.kda_local_dim),
          "latent_down": (K3.latent_dim, K3.hidden), "shared_gate_up": (2 * K3.shared_local_inter, K3.hidden),
          "shared_down": (K3.hidden, K3.shared_local_inter), "qkv_a": (K3.qkv_a_rows, K3.hidden),
          "g_proj": (K3.mla_local_heads * K3.v_head_dim, K3.hidden),
          "q_b": (K3.mla_local_heads * K3.qk_head_dim, K3.q_lora_rank)}


def ptx_of(tmp_path: Path, cfg: gm.GemvMmaConfig) -> str:
    return compiled_ptx(tmp_path, gm.GemvMma(cfg), P(bf), P(bf), P(bf))


@pytest.mark.parametrize("m,n,k,warps", [(8, 40, 256, 8), (3, 16, 128, 4), (2, 21, 1024, 16),
                                         (5, 33, 384, 0), (8, 8, 768, 8)])
def test_emulated_fragments_equal_the_product(m: int, n: int, k: int, warps: int) -> None:
    """The kernel's fragment map, replayed in float64, is x @ Wᵀ (warps = 0: warps_for's choice)."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen, dtype=torch.float64)
    w = torch.randn(n, k, generator=gen, dtype=torch.float64)
    warps = warps or gm.warps_for(n, k)
    assert warps and (k // gm.CHUNK) % warps == 0
    got = gm.emulate(x, w, warps)
    ref = x @ w.t()
    assert got.shape == (m, n)
    assert torch.allclose(got, ref, rtol=0, atol=1e-12 * ref.abs().max().item() * k)


def test_a_mismatched_map_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation: if B took step s's words from the other half of the vector than A, the
    replay would not be the product (the test above can fail)."""
    real = gm.physical_k
    calls = {"n": 0}

    def skewed(c: int, t: int, s: int, logical: int) -> int:
        calls["n"] += 1
        # A's gathers come first in each lane's loop (two rows), then B's: skew every third call
        return real(c, t, 1 - s, logical) if calls["n"] % 3 == 0 else real(c, t, s, logical)
    monkeypatch.setattr(gm, "physical_k", skewed)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=gen, dtype=torch.float64)
    w = torch.randn(16, 64, generator=gen, dtype=torch.float64)
    assert not torch.allclose(gm.emulate(x, w, 2 if (64 // gm.CHUNK) % 2 == 0 else 1), x @ w.t())


def test_physical_k_is_a_bijection_per_chunk() -> None:
    seen = sorted(gm.physical_k(0, t, s, lg) for t in range(4) for s in range(2)
                  for lg in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9))
    assert seen == list(range(gm.CHUNK))


def test_warp_choice_and_limits() -> None:
    assert {name: gm.warps_for(n, k) for name, (n, k) in SHAPES.items()} == {
        "in_proj": 8, "o_proj": 8, "latent_down": 8, "shared_gate_up": 16, "shared_down": 4,
        "qkv_a": 8, "g_proj": 16, "q_b": 16}
    for (n, k) in SHAPES.values():
        for m in range(2, 9):
            assert gm.can_implement(m, n, k, (bf, bf))
        assert not gm.can_implement(1, n, k, (bf, bf))       # M = 1: the CUDA-core GEMV
        assert not gm.can_implement(9, n, k, (bf, bf))       # the mma's n is 8
        assert not gm.can_implement(8, n, k, (torch.float32, bf))
    assert not gm.can_implement(8, 64, 48, (bf, bf))         # K not a multiple of 32
    assert not gm.can_implement(8, 64, 96, (bf, bf))          # 3 chunks: no warp count divides them


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_compiles_with_mma(tmp_path: Path, name: str) -> None:
    n, k = SHAPES[name]
    cfg = gm.config_for(8, n, k)
    ptx = ptx_of(tmp_path, cfg)
    common_checks(ptx)
    mmas = ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
    per_warp = k // gm.CHUNK // cfg.warps
    # two mma per chunk: the unrolled rounds' bodies appear once in the loop, plus round 0 and
    # the short last round
    u = min(gm.UNROLL, per_warp)
    rest = per_warp % u
    assert mmas == 2 * (u * (2 if per_warp // u > 1 else 1) + rest), (mmas, per_warp)
    assert ptx.count("bar.sync") == 1
    assert "ld.global.v4.b32" in ptx
    if ptxas_path() is not None:
        regs, spills = ptxas_usage(tmp_path, ptx)
        assert regs <= 96 and spills == 0, (regs, spills)


def test_small_m_compiles(tmp_path: Path) -> None:
    ptx = ptx_of(tmp_path, gm.config_for(2, *SHAPES["in_proj"]))
    common_checks(ptx)
    assert "mma.sync.aligned.m16n8k16" in ptx


def test_wrapper_refuses_bad_shapes() -> None:
    with pytest.raises(ValueError, match="gemv_mma cannot run M=1"):
        gm.gemv_mma(torch.zeros(1, 256, dtype=bf), torch.zeros(16, 256, dtype=bf))
    with pytest.raises(ValueError, match="gemv_mma cannot run M=8 N=16 K=256"):
        gm.gemv_mma(torch.zeros(8, 256, dtype=bf), torch.zeros(16, 128, dtype=bf))


def test_registered_for_the_device_check() -> None:
    from kimi_decode.kernels import CHECK_MODULES, KERNELS, checks
    assert "gemv_mma" in KERNELS and CHECK_MODULES["gemv_mma"] == "gemv_mma"
    assert "gemv_mma" in checks.CHECKS


def test_chained_build_loads_round_zero_weights_before_the_wait(tmp_path: Path) -> None:
    """PDL chain on: the first round's weight loads (2 per chunk) precede griddepcontrol.wait,
    every x load follows it, and the successor is released right after the wait."""
    n, k = SHAPES["in_proj"]
    cfg = gm.config_for(8, n, k)
    lines, wait = chained_ptx_at_wait(lambda: ptx_of(tmp_path, cfg))
    assert lines[wait + 1].startswith("griddepcontrol.launch_dependents")
    before = [s for s in lines[:wait] if s.startswith("ld.global")]
    assert len(before) == 2 * min(gm.UNROLL, k // gm.CHUNK // cfg.warps)
    assert not any(s.startswith("mma.sync") for s in lines[:wait])


def test_linear_dispatches_to_the_mma_kernel_only_when_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    """fused._linear: 2 ≤ M ≤ 8 goes to gemv_mma when its switch is on (kernel "gemv_mma" with
    "gemv"), with `out` passed through; M = 1 keeps the GEMV; switched off, the stock op."""
    from types import SimpleNamespace

    from kimi_decode import fused
    calls: list[tuple[int, bool]] = []

    def fake_mma(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        calls.append((x.shape[0], out is not None))
        y = (x.float() @ w.float().t()).bfloat16()
        return y if out is None else out.copy_(y)
    monkeypatch.setattr(gm, "gemv_mma", fake_mma)
    stock = SimpleNamespace(linear=lambda x, w: (x.float() @ w.float().t()).bfloat16())
    x = torch.randn(8, 256).bfloat16()
    w = torch.randn(48, 256).bfloat16()
    gm.set_enabled(True)
    try:
        slot = torch.empty(8, 48, dtype=bf)
        assert fused._linear(x, w, True, stock, out=slot) is slot
        fused._linear(x[:3].contiguous(), w, True, stock)
        assert calls == [(8, True), (3, False)]
        assert fused._linear(x, w, False, stock).shape == (8, 48)     # use_gemv off: stock
        assert len(calls) == 2
    finally:
        gm.set_enabled(False)
    fused._linear(x, w, True, stock)                                  # switched off: stock
    assert len(calls) == 2


def test_fp32_output_compiles(tmp_path: Path) -> None:
    """The router's logits: fp32 stores of the unrounded sums, no bf16 conversion."""
    cfg = gm.config_for(8, K3.num_experts, K3.hidden, out_f32=True)
    ptx = compiled_ptx(tmp_path, gm.GemvMma(cfg), P(bf), P(bf), P(torch.float32))
    common_checks(ptx)
    assert "st.global.b32" in ptx and "st.global.b16" not in ptx
    assert "cvt.rn.bf16.f32" not in ptx
    with pytest.raises(ValueError, match="bf16 or float32"):
        gm.gemv_mma(torch.zeros(8, 256, dtype=bf), torch.zeros(16, 256, dtype=bf), out_dtype=torch.float16)


def test_router_logits_use_the_mma_kernel_when_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from kimi_decode import fused
    calls: list[torch.dtype] = []

    def fake_mma(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
                 out_dtype: torch.dtype = bf) -> torch.Tensor:
        calls.append(out_dtype)
        return x.float() @ w.float().t()
    monkeypatch.setattr(gm, "gemv_mma", fake_mma)
    router = torch.randn(64, 256).bfloat16()
    stock_calls: list[int] = []
    k = SimpleNamespace(linear=lambda x, w, dt: stock_calls.append(x.shape[0]) or (x.float() @ w.float().t()))
    moe = SimpleNamespace(use_gemv=True, router=router, k=k)
    y = torch.randn(8, 256).bfloat16()
    gm.set_enabled(True)
    try:
        fused.LatentMoE._router_logits(moe, y)
        fused.LatentMoE._router_logits(moe, y[:1].contiguous())       # M = 1: not the mma kernel
    finally:
        gm.set_enabled(False)
    fused.LatentMoE._router_logits(moe, y)                             # switched off
    assert calls == [torch.float32] and stock_calls == [1, 8]


# ---- gemv_mma_situ: the shared expert's SiTU GLU as the prologue (kernel "gemv_mma_situ") ----

def situ_cfg(m: int) -> gm.GemvMmaConfig:
    n, k = SHAPES["shared_down"]
    return gm.GemvMmaConfig(n, k, m, warps=gm.warps_for(n, k), situ=True, beta=K3.situ_beta,
                            lin_beta=K3.situ_linear_beta)


@pytest.mark.parametrize("m", [2, 8])
def test_situ_prologue_compiles(tmp_path: Path, m: int) -> None:
    """The prologue stages x = bf16(SiTU(h)) in shared memory after the chain's wait (one more
    barrier), the mma rounds then read x there (128-bit shared loads, no x from global)."""
    cfg = situ_cfg(m)
    ptx = ptx_of(tmp_path, cfg)
    common_checks(ptx)
    per_warp = cfg.k // gm.CHUNK // cfg.warps
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 2 * per_warp
    assert ptx.count("bar.sync") == 2
    assert ptx.count("ld.shared.v4") == per_warp        # x: one vector per chunk
    assert "ex2.approx" in ptx                          # the sigmoid / tanh of SiTU
    if ptxas_path() is not None:
        regs, spills = ptxas_usage(tmp_path, ptx)
        assert regs <= 96 and spills == 0, (regs, spills)


def test_situ_plain_build_unchanged(tmp_path: Path) -> None:
    """situ=False keeps the plain kernel: one barrier, x from global, no shared x loads."""
    ptx = ptx_of(tmp_path, gm.config_for(8, *SHAPES["shared_down"]))
    assert ptx.count("bar.sync") == 1 and "ld.shared.v4" not in ptx.split("bar.sync")[0]


def test_situ_wrapper_refuses_bad_shapes() -> None:
    n, k = SHAPES["shared_down"]
    with pytest.raises(ValueError, match="gemv_mma_situ cannot run"):
        gm.gemv_mma_situ(torch.zeros(1, 2 * k, dtype=bf), torch.zeros(n, k, dtype=bf), k, 1.0, 1.0)
    with pytest.raises(ValueError, match="gemv_mma_situ cannot run"):
        gm.gemv_mma_situ(torch.zeros(8, k, dtype=bf), torch.zeros(n, k, dtype=bf), k, 1.0, 1.0)


def test_situ_check_runs_on_cpu_and_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """check_situ with the kernel replaced by its statement (stock situ_glu, then the product
    in float64 rounded once) passes; gate and up swapped fails."""
    from kimi_decode import stock_ops
    from kimi_decode.kernels import checks
    monkeypatch.setattr(checks, "DEVICE", "cpu")

    def emulate(h, w, inter, beta, lin, out=None):
        y = (stock_ops.situ_glu(h, inter, beta, lin).double() @ w.double().t()).to(bf)
        return y if out is None else out.copy_(y)
    monkeypatch.setattr(gm, "gemv_mma", lambda x, w, out=None, out_dtype=bf: (x.double() @ w.double().t()).to(out_dtype))
    monkeypatch.setattr(gm, "gemv_mma_situ", emulate)
    rows = gm.check_situ(timing=False)
    assert [r["M"] for r in rows] == [2, 4, 8] and all(r["ok"] for r in rows), rows

    def swapped(h, w, inter, beta, lin, out=None):
        return emulate(torch.cat([h[:, inter:], h[:, :inter]], 1), w, inter, beta, lin, out)
    monkeypatch.setattr(gm, "gemv_mma_situ", swapped)
    assert not any(r["ok"] for r in gm.check_situ(timing=False))


def test_shared_down_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """fused.LatentMoE._shared_down: gemv_mma_situ at M ≥ 2 when enabled, else stock SiTU + _linear."""
    from types import SimpleNamespace

    from kimi_decode import fused
    calls: list[int] = []
    monkeypatch.setattr(gm, "gemv_mma_situ", lambda h, w, i, b, lb: calls.append(h.shape[0]) or h[:, :1])
    cfg = SimpleNamespace(shared_local_inter=128, situ_beta=2.0, situ_linear_beta=3.0)
    situ: list[int] = []
    moe = SimpleNamespace(cfg=cfg, use_gemv_situ=False, use_mma_situ=True, use_gemv=False,
                          shared_down=torch.zeros(64, 128, dtype=bf),
                          k=SimpleNamespace(linear=lambda x, w: x @ w.t()),
                          fx={"situ": lambda h, i, b, lb: situ.append(h.shape[0]) or h[:, :i]})
    fused.LatentMoE._shared_down(moe, torch.zeros(8, 256, dtype=bf))
    fused.LatentMoE._shared_down(moe, torch.zeros(1, 256, dtype=bf))
    moe.use_mma_situ = False
    fused.LatentMoE._shared_down(moe, torch.zeros(8, 256, dtype=bf))
    assert calls == [8] and situ == [1, 8]


# --- gemv_mma_tuned: per-shape (warps, unroll) from the device sweep -------------------------

def test_config_for_takes_the_table_only_in_the_tuned_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    n, k = SHAPES["in_proj"]
    monkeypatch.setattr(gm, "TUNED", {(n, k): (16, 8)})
    monkeypatch.setattr(gm, "_tuned_on", False)
    base = gm.config_for(8, n, k)
    assert (base.warps, base.unroll) == (gm.warps_for(n, k), gm.UNROLL)
    gm.set_tuned(True)
    tuned = gm.config_for(8, n, k)
    assert (tuned.warps, tuned.unroll) == (16, 8) and gm.tuned_on()
    other = gm.config_for(8, *SHAPES["o_proj"])                     # not in the table: defaults
    assert (other.warps, other.unroll) == (gm.warps_for(*SHAPES["o_proj"]), gm.UNROLL)
    explicit = gm.config_for(8, n, k, unroll=2, warps=4)           # explicit arguments win
    assert (explicit.warps, explicit.unroll) == (4, 2)
    with pytest.raises(ValueError, match="cannot split K"):
        gm.config_for(8, 64, 96, warps=4)                          # 3 chunks over 4 warps
    gm.set_tuned(False)


def test_tuned_from_sweep_keeps_clear_winners_of_passing_shapes() -> None:
    rows = [{"N": 1, "K": 2, "ok": True, "best_us": 9.0, "default_us": 10.0, "best_warps": 16, "best_unroll": 8},
            {"N": 3, "K": 4, "ok": True, "best_us": 9.9, "default_us": 10.0, "best_warps": 4, "best_unroll": 2},
            {"N": 5, "K": 6, "ok": False, "best_us": 5.0, "default_us": 10.0, "best_warps": 4, "best_unroll": 2},
            {"N": 7, "K": 8, "ok": True}]                              # no timing: nothing to choose
    assert gm.tuned_from_sweep(rows) == {(1, 2): (16, 8)}


@pytest.mark.parametrize("warps,unroll", [(16, 8), (4, 2), (16, 2)])
def test_sweep_configurations_compile(tmp_path: Path, warps: int, unroll: int) -> None:
    """The sweep's corner configurations at in_proj's shape build without spills."""
    n, k = SHAPES["in_proj"]
    ptx = ptx_of(tmp_path, gm.config_for(8, n, k, unroll=unroll, warps=warps))
    common_checks(ptx)
    if ptxas_path() is not None:
        regs, spills = ptxas_usage(tmp_path, ptx)
        assert regs <= 128 and spills == 0, (regs, spills)


def test_sweep_check_runs_on_cpu_and_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """check_sweep with the kernel replaced by its statement (the product in float64, rounded
    once) passes every shape and times nothing without timing; a kernel that drops the last
    32 columns of K at 16 warps fails that shape's row."""
    from kimi_decode.kernels import checks
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    calls = []

    def exact(x, w, out=None, *, unroll=None, out_dtype=bf, warps=None):
        calls.append((warps, unroll))
        return (x.double() @ w.double().t()).to(out_dtype)
    monkeypatch.setattr(gm, "gemv_mma", exact)
    rows = gm.check_sweep(timing=False)
    assert [r["op"] for r in rows] == list(gm.sweep_shapes(k3_tp16()))
    assert all(r["ok"] and r["configs"] >= 3 for r in rows), rows
    assert all(r["default"] == f"w{gm.warps_for(r['N'], r['K'])}_u{gm.UNROLL}" for r in rows)
    assert {(16, 8), (8, 4), (8, 2)} <= set(calls)

    def wrong(x, w, out=None, *, unroll=None, out_dtype=bf, warps=None):
        k = x.shape[1] - (32 if warps == 16 else 0)
        return (x[:, :k].double() @ w[:, :k].double().t()).to(out_dtype)
    monkeypatch.setattr(gm, "gemv_mma", wrong)
    rows = gm.check_sweep(timing=False)
    assert not any(r["ok"] for r in rows if r["K"] // gm.CHUNK % 16 == 0)


def test_tuned_mode_follows_the_kernel_set(monkeypatch: pytest.MonkeyPatch) -> None:
    import kimi_decode.fused as fused_mod
    from kimi_decode import kernels
    from kimi_decode.config import tiny
    from kimi_decode.fused import FusedDecoder
    from kimi_decode.kernels import CHECK_MODULES, KERNELS, checks
    from kimi_decode.stock import StockDecoder
    assert "gemv_mma_tuned" in KERNELS and CHECK_MODULES["gemv_mma_tuned"] == "gemv_mma"
    assert "gemv_mma_tuned" in checks.CHECKS
    monkeypatch.setattr(fused_mod, "_kernels_usable", lambda dev: True)
    monkeypatch.setattr(fused_mod, "VERIFIED", fused_mod.VERIFIED | {"gemv_mma_tuned"})
    monkeypatch.setattr(kernels, "applicable", lambda name, cfg: True)
    fused = FusedDecoder.from_stock(StockDecoder(tiny(layers=(3, 4), batch=1)))
    fused.enable(frozenset({"gemv", "gemv_mma", "gemv_mma_tuned"}))
    assert gm.tuned_on()
    fused.enable(frozenset({"gemv", "gemv_mma"}))
    assert not gm.tuned_on()


@pytest.mark.parametrize("shape", sorted(gm.TUNED))
def test_tuned_entries_are_swept_shapes_and_build(tmp_path: Path, shape: tuple[int, int]) -> None:
    """Every TUNED entry is a shape the sweep measures, a configuration the kernel can build,
    and it compiles without spills at M = 8 and M = 2."""
    n, k = shape
    assert shape in set(gm.sweep_shapes(k3_tp16()).values())
    warps, unroll = gm.TUNED[shape]
    assert gm.config_valid(k, warps, unroll) and warps in gm.SWEEP_WARPS and unroll in gm.SWEEP_UNROLLS
    for m in (8, 2):
        (tmp_path / str(m)).mkdir()
        ptx = ptx_of(tmp_path / str(m), gm.config_for(m, n, k, unroll=unroll, warps=warps))
        common_checks(ptx)
        if ptxas_path() is not None:
            regs, spills = ptxas_usage(tmp_path / str(m), ptx)
            assert regs <= 128 and spills == 0, (regs, spills)
