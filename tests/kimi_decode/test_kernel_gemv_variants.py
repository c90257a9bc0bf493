"""GEMV variants (kernels/gemv.py): out= into a caller's slot, K a multiple of 128 (64-bit
loads), and the SiTU-GLU prologue (gemv_situ), on the CPU.

Oracles:
- PTX: each variant compiles to sm_90a with the loads it exists for (64-bit `ld.global.v4.b16`
  for K = 384, the shared-memory staging + one barrier for the SiTU prologue, IEEE division
  for u / β_lin), no local-memory spills, and the default configuration's PTX is byte-identical
  to the GPU-verified kernel's (compiled from the same source with the variant fields left out);
- the float64 SiTU reference equals stock_ops.situ (fp32) to fp32 precision and, rounded to
  bf16, stock_ops.situ_glu except on rare rounding-boundary elements (one bf16 ulp);
- check_variants (the GPU check) runs on the CPU with the kernels replaced by a torch
  emulation of their exact math and passes; emulations that write the wrong slot, skip the
  SiTU or use the wrong half of h make it fail.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

import kimi_decode.kernels.gemv as k_gemv  # noqa: E402
from kimi_decode import stock_ops  # noqa: E402
from kimi_decode.config import k3_tp16  # noqa: E402
from kimi_decode.kernels import _common, checks  # noqa: E402
from kimi_decode.kernels.gemv import Gemv, GemvConfig  # noqa: E402
from tests.kimi_decode.test_kernels_compile import common_checks, shuffles_in_branches  # noqa: E402
from tests.kimi_decode.test_kernels_compile import ptx_of as compiled_ptx  # noqa: E402

bf = torch.bfloat16
P = _common.dummy_ptr


def ptx_of(tmp_path: Path, cfg: GemvConfig) -> str:
    return compiled_ptx(tmp_path, Gemv(cfg), P(bf), P(bf), P(bf))


def test_k384_compiles_to_64bit_loads(tmp_path: Path) -> None:
    cfg = k3_tp16()
    ptx = ptx_of(tmp_path, GemvConfig(cfg.hidden, cfg.shared_local_inter, 1, vec=k_gemv.vec_for(384)))
    common_checks(ptx)
    assert "ld.global.v4.b16" in ptx                    # 4 × bf16 = 64-bit weight/x loads
    assert "ld.global.v4.b32" not in ptx                # not the 128-bit path (K % 256 != 0)
    assert "bar.sync" not in ptx


@pytest.mark.parametrize("m", [1, 8])
def test_situ_compiles(tmp_path: Path, m: int) -> None:
    cfg = k3_tp16()
    g = GemvConfig(cfg.hidden, cfg.shared_local_inter, m, vec=4, situ=True,
                   beta=cfg.situ_beta, lin_beta=cfg.situ_linear_beta)
    ptx = ptx_of(tmp_path, g)
    common_checks(ptx)
    assert "kernel_situ" in ptx
    assert ptx.count("bar.sync") == 1                   # one barrier after the prologue
    assert "st.shared" in ptx and "ld.shared.v4.b16" in ptx
    assert "ld.global.v4.b16" in ptx
    assert "div.rn.f32" in ptx                          # u / β_lin: IEEE division as torch
    assert "tanh.approx" not in ptx                     # the accurate tanh
    assert "shfl.sync.bfly" in ptx


def test_situ_prologue_precedes_any_branch_shuffle(tmp_path: Path) -> None:
    """warp_idx()'s shuffle runs before the first branch (all 32 lanes), and the barrier is
    not inside the column branch (every thread of the CTA reaches it)."""
    ptx = ptx_of(tmp_path, GemvConfig(7168, 384, 1, vec=4, situ=True))
    lines = [s.strip() for s in ptx.splitlines()]
    first_bra = next(i for i, s in enumerate(lines) if " bra " in s)
    idx_shfl = [i for i, s in enumerate(lines) if s.startswith("shfl.sync.idx")]
    assert idx_shfl and max(idx_shfl) < first_bra
    bar = lines.index("bar.sync \t0;") if "bar.sync \t0;" in lines else next(
        i for i, s in enumerate(lines) if s.startswith("bar.sync"))
    # the barrier directly follows the prologue's join label
    assert lines[bar - 1].endswith(":"), lines[bar - 2:bar + 1]


# sha256 of the PTX that the GPU-verified gemv.py (main at 60af834, before the variants)
# compiled to with nvidia-cutlass-dsl 4.8.1; the PTX is deterministic (same bytes across runs
# and dump dirs). A DSL upgrade changes these: re-derive them from the old source then.
VERIFIED_PTX_SHA256 = {
    (3216, 7168, 1): "3af8186ea8a3e7f87bfb47eb1194a26f56efa29410ea6a2536fb8336f503a455",
    (3216, 7168, 8): "2fe248e4503e9efa5cdd20f3363ef835d097e379ca3719d7763c93d53881a77e",
    (7168, 768, 1): "0b0f4d4276f3017a6756a9d90921f333d555560a958109a38f68ce814db6541b",
}


@pytest.mark.parametrize("nkm", sorted(VERIFIED_PTX_SHA256))
def test_default_config_is_the_verified_kernel(tmp_path: Path, nkm: tuple[int, int, int]) -> None:
    """GemvConfig(n, k, m) with the new fields at their defaults compiles to byte-identical
    PTX to the GPU-verified kernel: the variant fields only select a different kernel."""
    ptx = ptx_of(tmp_path, GemvConfig(*nkm))
    common_checks(ptx)
    assert "ld.global.v4.b32" in ptx and "bar.sync" not in ptx and "kernel_situ" not in ptx
    assert hashlib.sha256(ptx.encode()).hexdigest() == VERIFIED_PTX_SHA256[nkm]
    assert GemvConfig(*nkm) == GemvConfig(*nkm, vec=8, situ=False)


def test_situ_weight_loads_issued_before_the_prologue(tmp_path: Path) -> None:
    """shared_down (3 slices per lane): the warp's 3 weight loads come before the prologue's
    branch (overlapping the SiTU math), with the column clamped to N-1 (in bounds)."""
    ptx = ptx_of(tmp_path, GemvConfig(7168, 384, 1, vec=4, situ=True))
    lines = [s.strip() for s in ptx.splitlines()]
    first_bra = next(i for i, s in enumerate(lines) if " bra " in s)
    early = [s for s in lines[:first_bra] if s.startswith("ld.global")]
    assert len(early) == 3 and all("v4.b16" in s for s in early)
    assert any(s.startswith("min.s32") and s.endswith("7167;") for s in lines[:first_bra])


def test_splitk_compiles(tmp_path: Path) -> None:
    """Split-K (M = 8, in_proj): 4 columns per CTA, 128-bit loads, one barrier, lane-0 stores
    to shared memory, no shuffle inside a branch that is not warp-uniform (the K-tail branch
    `warp < tail` is warp-uniform and holds no shuffle at all)."""
    ptx = ptx_of(tmp_path, GemvConfig(3216, 7168, 8, cols=k_gemv.SPLITK_COLS))
    common_checks(ptx)
    assert "kernel_splitk" in ptx
    assert "ld.global.v4.b32" in ptx and ptx.count("bar.sync") == 1
    assert "st.shared.b32" in ptx and "ld.shared.b32" in ptx
    assert "min.s32" in ptx and "3215;" in ptx                 # column clamp to N-1
    assert not shuffles_in_branches(ptx)


def test_splitk_k384_compiles(tmp_path: Path) -> None:
    ptx = ptx_of(tmp_path, GemvConfig(7168, 384, 3, vec=4, cols=4))
    common_checks(ptx)
    assert "ld.global.v4.b16" in ptx and ptx.count("bar.sync") == 1


def test_splitk_4warps_compiles(tmp_path: Path) -> None:
    ptx = ptx_of(tmp_path, GemvConfig(3216, 7168, 8, cols=4, kwarps=4))
    common_checks(ptx)
    assert ".reqntid 128" in ptx and ptx.count("bar.sync") == 1
    assert not shuffles_in_branches(ptx)


def test_splitk_plan() -> None:
    """The K slices are dealt round-robin: every slice to exactly one warp, once."""
    for k, vec in ((7168, 8), (768, 8), (1536, 8), (384, 4), (2048, 8)):
        for kw in (4, 8):
            g = Gemv(GemvConfig(3216, k, 8, vec=vec, cols=4, kwarps=kw))
            assert g.kw == kw
            got = sorted([w + i * kw for w in range(kw) for i in range(g.full)]
                         + [w + g.full * kw for w in range(g.tail)])
            assert got == list(range(k // (vec * 32))), (k, vec, kw)
    assert Gemv(GemvConfig(3217, 7168, 8, cols=4)).ctas == 805


def test_can_implement() -> None:
    f = (bf, bf)
    assert k_gemv.can_implement(1, 3216, 7168, f)
    assert not k_gemv.can_implement(1, 7168, 384, f)                  # default: fused.py unchanged
    assert k_gemv.can_implement(1, 7168, 384, f, k_multiple=128)
    assert not k_gemv.can_implement(1, 7168, 320, f, k_multiple=128)
    assert not k_gemv.can_implement(2, 7168, 384, f, k_multiple=128)  # per-M table
    assert k_gemv.can_implement(8, 3216, 7168, f, max_rows=k_gemv.SPLITK_MAX_ROWS)
    assert not k_gemv.can_implement(9, 3216, 7168, f, max_rows=64)
    assert k_gemv.can_implement_situ(1, 7168, 384, f)
    assert not k_gemv.can_implement_situ(1, 7168, 384, (torch.float32, bf))
    assert k_gemv.vec_for(7168) == 8 and k_gemv.vec_for(384) == 4


def test_wrappers_reject_bad_operands() -> None:
    x = torch.zeros(1, 384, dtype=bf)
    w = torch.zeros(7168, 384, dtype=bf)
    with pytest.raises(ValueError):
        k_gemv.gemv(x, w, out=torch.zeros(1, 7167, dtype=bf))
    with pytest.raises(ValueError):
        k_gemv.gemv(x, w, out=torch.zeros(16, 1, 7168, dtype=bf)[:, 0])   # not contiguous
    with pytest.raises(ValueError):
        k_gemv.gemv_situ(torch.zeros(1, 700, dtype=bf), w, 384, 4.0, 25.0)


@pytest.mark.parametrize("shape", [(4, 64), (1, 2 * 384), (8, 2 * 384)])
def test_situ_reference_equals_stock(shape: tuple[int, int]) -> None:
    m, two_i = shape
    inter = two_i // 2
    gen = torch.Generator().manual_seed(m * 7 + inter)
    h = (torch.randn(m, two_i, generator=gen) * 4.0).bfloat16()
    h[0, :4] = torch.tensor([0.0, -30.0, 30.0, 1e-3]).bfloat16()      # saturation and 0
    h[0, inter:inter + 4] = torch.tensor([200.0, -200.0, 0.0, 1.0]).bfloat16()
    ref = k_gemv.reference_situ_act(h, inter, 4.0, 25.0)
    f32 = stock_ops.situ(h[:, :inter], h[:, inter:], 4.0, 25.0)
    assert torch.allclose(ref, f32.double(), rtol=2e-6, atol=1e-6)
    glu = stock_ops.situ_glu(h, inter, 4.0, 25.0)
    rb = ref.to(bf)
    diff = rb != glu
    assert diff.float().mean() <= 2e-3
    # where they differ, by one bf16 ulp (a rounding-boundary value)
    ulp = glu.double().abs().clamp_min(1e-30) * 2 ** -7
    assert ((rb.double() - glu.double()).abs()[diff] <= ulp[diff] * 1.01).all()


def test_situ_reference_matches_stock_product() -> None:
    """reference_situ (float64, no bf16 activation) vs stock situ_glu then matmul: close
    (differences are the stock path's bf16 roundings only), on the K3 shared expert shape."""
    cfg = k3_tp16()
    inter, n = cfg.shared_local_inter, cfg.hidden
    gen = torch.Generator().manual_seed(5)
    h = (torch.randn(2, 2 * inter, generator=gen) * 3.0).bfloat16()
    w = (torch.randn(n, inter, generator=gen) * inter ** -0.5).bfloat16()
    ref = k_gemv.reference_situ(h, w, inter, cfg.situ_beta, cfg.situ_linear_beta)
    stock = stock_ops.situ_glu(h, inter, cfg.situ_beta, cfg.situ_linear_beta) @ w.t()
    e = checks.rel(stock, ref)
    assert 1e-4 < e < 1e-2                     # bf16 roundings present, nothing else
    wrong = k_gemv.reference_situ(h.flip(1), w, inter, cfg.situ_beta, cfg.situ_linear_beta)  # swapped halves
    assert checks.rel(stock, wrong) > 0.1


# ---- check_variants on the CPU with the kernels emulated by their exact math ----

def _emu_dot(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    y = (x.float() @ w.float().t()).to(bf)                         # fp32 accumulate, one rounding
    if out is None:
        return y
    out.copy_(y)
    return out


def _emu_gemv(x, w, out=None, splitk_warps=8):
    return _emu_dot(x, w, out)


def _emu_situ(h, w, inter, beta, lin_beta, out=None):
    g, u = h[:, :inter].float(), h[:, inter:2 * inter].float()
    a = ((beta * torch.tanh(g / beta)) * torch.sigmoid(g)) * (lin_beta * torch.tanh(u / lin_beta))
    return _emu_dot(a.to(bf), w, out)


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(k_gemv, "gemv", _emu_gemv)
    monkeypatch.setattr(k_gemv, "gemv_situ", _emu_situ)
    return monkeypatch


CASES = ["out_slot", "k384", "situ", "in_proj"]


def test_check_variants_passes_faithful_emulation(emulated) -> None:
    rows = k_gemv.check_variants(rows=(1, 8), timing=False)
    assert [r["case"] for r in rows] == CASES + CASES + ["in_proj_kw4"]
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
    assert all(r["kernel"] == "gemv_variants" for r in rows)
    assert [r["layout"] for r in rows if r["case"].startswith("in_proj")] == [
        "warp_per_col", "split_k", "split_k_4warps"]


def test_check_variants_rejects_wrong_slot(emulated) -> None:
    def wrong_slot(x, w, out=None, splitk_warps=8):
        """Writes its slot and also slot 0 of the same buffer (a bad output offset)."""
        if out is None:
            return _emu_dot(x, w, None)
        slot0 = torch.empty(0, dtype=out.dtype).set_(out.untyped_storage(), 0, out.shape)
        _emu_dot(x, w, slot0)
        return _emu_dot(x, w, out)
    emulated.setattr(k_gemv, "gemv", wrong_slot)
    rows = k_gemv.check_variants(rows=(1,), timing=False)
    assert not rows[0]["ok"] and not rows[0]["other_slots_untouched"]


def test_check_variants_rejects_allocating_out(emulated) -> None:
    emulated.setattr(k_gemv, "gemv", lambda x, w, out=None, splitk_warps=8: _emu_dot(x, w, None))
    rows = k_gemv.check_variants(rows=(1,), timing=False)
    assert not rows[0]["ok"] and not rows[0]["wrote_into_slot"]


@pytest.mark.parametrize("bug", ["no_situ", "up_as_gate"])
def test_check_variants_rejects_wrong_situ(emulated, bug: str) -> None:
    def wrong(h, w, inter, beta, lin_beta, out=None):
        if bug == "no_situ":
            return _emu_dot(h[:, :inter].contiguous(), w, out)
        return _emu_situ(torch.cat([h[:, inter:], h[:, :inter]], 1), w, inter, beta, lin_beta, out)
    emulated.setattr(k_gemv, "gemv_situ", wrong)
    rows = k_gemv.check_variants(rows=(1,), timing=False)
    assert [r["ok"] for r in rows] == [True, True, False, True]
