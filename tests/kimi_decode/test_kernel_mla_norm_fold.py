"""CPU tests of "mla_norm_fold" (kernels/mla_norm_fold.py): gemv_rmsnorm (kernels/gemv.py,
GemvRMSNorm) and uk_insert_norm (kernels/mla_glue.py, GlueConfig.norm).

Oracles:
- PTX at the K3 TP16 shapes (ql = 1536 from rows of A = 2112, c = 512, H = 6, q_b N = 1152;
  M = 1 and 8): the loads the design needs (GEMV: 6 weight + 6 x + 6 norm-weight 128-bit
  loads per row at M = 1, the weight row issued before the first shuffle; uk: two c_kv
  vectors and one norm vector more than uk_insert), one rsqrt per normalised row, the
  butterflies (5 for Σx² + 5 per dot product; uk: 5 more than uk_insert), no barrier in the
  GEMV, no local memory, no shuffle inside a forward branch, warp_idx()'s shuffles first;
  ptxas: gemv_rmsnorm fits the 128 registers its launch allows (.minnctapersm 2) without
  spills at M = 1;
- the kernels' index mapping, emulated without the DSL: every x slice / c_kv vector is read
  and written exactly once;
- the rounding (emulate_rmsnorm, the kernels' formula in torch) equals stock_ops.mla_norms
  within one bf16 ulp (bit-equal on ≥ 99%) and bit for bit on the check's norm-exact inputs;
- mla_norm_fold.check (the GPU check) passes on the CPU with the kernels replaced by their
  contract, and fails for emulations that skip the c_kv norm weight or normalise the wrong
  columns.
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


from tests.kimi_decode.ptxas_tool import require_ptxas
import kimi_decode.kernels.gemv as k_gemv  # noqa: E402
import kimi_decode.kernels.mla_glue as k_glue  # noqa: E402
from kimi_decode import stock_ops  # noqa: E402
from kimi_decode.config import k3_tp16  # noqa: E402
from kimi_decode.kernels import CHECK_MODULES, KERNELS, _common  # noqa: E402
from kimi_decode.kernels.gemv import GemvConfig, GemvRMSNorm, can_implement_norm, emulate_rmsnorm  # noqa: E402
from kimi_decode.kernels.mla_glue import can_implement_uk_norm, config_uk, config_uk_norm  # noqa: E402
from tests.kimi_decode.test_kernel_mla_glue import (common_checks, idx_shuffles_after_first_branch,  # noqa: E402
                                                    shuffles_in_branches)
from tests.kimi_decode.test_kernel_mla_glue import ptx_of as glue_ptx  # noqa: E402

bf = torch.bfloat16
P = _common.dummy_ptr
K3 = k3_tp16()
QL, C, A, H = K3.q_lora_rank, K3.kv_lora_rank, K3.qkv_a_rows, K3.mla_local_heads
NOPE, ROPE, EPS = K3.qk_nope_dim, K3.qk_rope_dim, K3.rms_eps
NQ = H * (NOPE + ROPE)


def gemv_ptx(tmp_path: Path, m: int) -> str:
    opts = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    cute.compile(GemvRMSNorm(GemvConfig(NQ, QL, m, eps=EPS, x_stride=A)), P(bf), P(bf), P(bf), P(bf),
                 _common.current_stream(), options=opts)
    files = list(tmp_path.glob("*.ptx"))
    assert len(files) == 1, files
    return files[0].read_text()


def test_registered() -> None:
    assert "mla_norm_fold" in KERNELS and CHECK_MODULES["mla_norm_fold"] == "mla_norm_fold"
    from kimi_decode.fused import VERIFIED
    assert "mla_norm_fold" in VERIFIED              # passed its H200 check (e859ebe)


def test_k3_shapes_accepted() -> None:
    assert K3.qkv_a_rows == QL + C + ROPE == 2112 and NQ == 1152
    assert can_implement_norm(1, NQ, QL, A, (bf, bf, bf)) and not can_implement_norm(2, NQ, QL, A, (bf,))
    assert can_implement_norm(8, NQ, QL, A, (bf,), max_rows=8)
    assert not can_implement_norm(1, NQ, QL, 2100, (bf,))          # rows not 16-byte aligned
    assert not can_implement_norm(1, NQ, 2304, 2304, (bf,))        # 9 slices per lane > 8
    assert not can_implement_norm(1, NQ, QL, A, (torch.float16,))
    for m in (1, 8):
        assert can_implement_uk_norm(m, 1, H, NOPE, ROPE, C, A, QL + C, QL, (bf,))
    assert not can_implement_uk_norm(1, 1, H, NOPE, ROPE, C, A, QL + C, QL + 4, (bf,))    # misaligned
    assert not can_implement_uk_norm(1, 1, H, NOPE, ROPE, C, A, QL + C, QL + 8, (bf,))    # overlaps rope
    assert not can_implement_uk_norm(9, 1, H, NOPE, ROPE, C, A, QL + C, QL, (bf,))        # > 8 rows


@pytest.mark.parametrize("m", [1, 8])
def test_gemv_rmsnorm_ptx(tmp_path: Path, m: int) -> None:
    ptx = gemv_ptx(tmp_path, m)
    S = QL // 256                                                  # 6 slices per lane
    assert ".target sm_90a" in ptx and "kernel_norm" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert ".reqntid 256, 1, 1" in ptx and ".minnctapersm 2" in ptx
    assert "bar.sync" not in ptx and "st.shared" not in ptx        # no shared memory, no barrier
    lines = [s.strip() for s in ptx.splitlines()]
    vec = [i for i, s in enumerate(lines) if s.startswith("ld.global.v4")]
    shf = [i for i, s in enumerate(lines) if s.startswith("shfl.sync.bfly")]
    if m == 1:
        assert len(vec) == 3 * S                                   # weight, x, norm weight
    assert len(shf) == 10 * m                                      # Σx² and the dot product, per row
    assert len([i for i in vec if i < shf[0]]) >= 2 * S            # weight row + x row before the reduction
    assert ptx.count("rsqrt.approx") == m
    assert ptx.count("cvt.rn.bf16.f32") == m * (QL // 32 + 1)      # xn per element, the output
    assert not shuffles_in_branches(ptx) and not idx_shuffles_after_first_branch(ptx)
    assert ptx.count("st.global") == m                             # the one predicated store per row


def test_gemv_rmsnorm_registers(tmp_path: Path) -> None:
    """M = 1: ≤ 128 registers (2 CTAs of 256 threads per SM, all 144 CTAs resident) and no
    spills (uncapped, ptxas took 145; with the 6 norm-weight slices held up front it spilled)."""
    require_ptxas()
    gemv_ptx(tmp_path, 1)
    f = next(tmp_path.glob("*.ptx"))
    out = subprocess.run(["ptxas", "-arch=sm_90a", "-v", "-O3", str(f), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    assert regs <= 128, out
    assert "0 bytes spill stores" in out and "0 bytes spill loads" in out, out


@pytest.mark.parametrize("m,t", [(1, 1), (8, 1), (8, 8)])
def test_uk_insert_norm_ptx(tmp_path: Path, m: int, t: int) -> None:
    (tmp_path / "n").mkdir()
    (tmp_path / "b").mkdir()
    ptx = glue_ptx(tmp_path / "n", config_uk_norm(m, t, H, NOPE, ROPE, C, A, QL + C, QL, EPS))
    base = glue_ptx(tmp_path / "b", config_uk(m, t, H, NOPE, ROPE, C, A, QL + C))
    common_checks(ptx)                                             # no shuffle in a branch, etc.
    assert ptx.count("rsqrt.approx") == 1
    assert ptx.count("shfl.sync.bfly") == base.count("shfl.sync.bfly") + 5
    # the ckv copy (1 load + 1 store) becomes the 2 c_kv loads per lane, and per vector slot
    # of the lane (2 unrolled sites) one norm-weight load, 8 products rounded in pairs, a store
    assert ptx.count("ld.global.v4") == base.count("ld.global.v4") - 1 + 2 + 2
    assert ptx.count("st.global.v4") == base.count("st.global.v4") - 1 + 2
    assert ptx.count("cvt.rn.bf16x2.f32") == base.count("cvt.rn.bf16x2.f32") + 2 * 4
    assert ptx.count("bar.sync") == base.count("bar.sync")
    lines = [s.strip() for s in ptx.splitlines()]
    vec = [i for i, s in enumerate(lines) if s.startswith("ld.global.v4")]
    shf = [i for i, s in enumerate(lines) if s.startswith("shfl.sync.bfly")]
    # the W_UK slices (P = 4) and the c_kv row (2) are issued before the Σx² butterfly
    assert len([i for i in vec if i < shf[0]]) == 4 + 2


def test_uk_insert_norm_registers(tmp_path: Path) -> None:
    require_ptxas()
    glue_ptx(tmp_path, config_uk_norm(8, 1, H, NOPE, ROPE, C, A, QL + C, QL, EPS))
    f = next(tmp_path.glob("*.ptx"))
    out = subprocess.run(["ptxas", "-arch=sm_90a", "-v", "-O3", str(f), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True).stderr
    assert int(re.search(r"Used (\d+) registers", out).group(1)) <= 255
    assert "0 bytes spill stores" in out, out


def test_index_mapping_covers_rows_once() -> None:
    """GEMV: lane l reads slices l + 32 i, i < K/256: each of the K/8 vectors once per warp.
    uk: in CTA (ct, head 0) lane l of warp m writes vector v = l + 32 j of row m when
    ct·8 ≤ v < ct·8 + 8: over the 8 column tiles every vector of the row exactly once."""
    nv = QL // 8
    seen = [lane + 32 * i for lane in range(32) for i in range(QL // 256)]
    assert sorted(seen) == list(range(nv))
    vpr = k_glue.UK_COLS // 8
    writes = [lane + 32 * j for ct in range(C // k_glue.UK_COLS) for lane in range(32) for j in range(C // 256)
              if ct * vpr <= lane + 32 * j < ct * vpr + vpr]
    assert sorted(writes) == list(range(C // 8))


@pytest.mark.parametrize("scale", [1.0, 30.0, 1e-3])
def test_rounding_matches_stock(scale: float) -> None:
    gen = torch.Generator().manual_seed(int(scale * 1000))
    a = (torch.randn(8, A, generator=gen) * scale).to(bf)
    qn = (1 + 0.1 * torch.randn(QL, generator=gen)).to(bf)
    kvn = (1 + 0.1 * torch.randn(C, generator=gen)).to(bf)
    qa_s, ckv_s = stock_ops.mla_norms(a, qn, kvn, QL, C, EPS)
    from kimi_decode.kernels.mla_norm_fold import bf16_ulps
    for mine, ref in ((emulate_rmsnorm(a[:, :QL], qn, EPS), qa_s), (emulate_rmsnorm(a[:, QL:QL + C], kvn, EPS), ckv_s)):
        assert bf16_ulps(mine, ref) <= 1
        assert float((mine == ref).float().mean()) >= 0.99


def test_exact_inputs_make_the_norm_exact() -> None:
    from kimi_decode.kernels.mla_norm_fold import make_inputs
    d = make_inputs(2, torch.device("cpu"), torch.Generator().manual_seed(1), exact=True)
    a = d["a"]
    qa_s, ckv_s = stock_ops.mla_norms(a, d["q_norm"], d["kv_norm"], QL, C, EPS)
    assert torch.equal(qa_s, (a[:, :QL].float() / 2 * d["q_norm"].float()).to(bf))
    assert torch.equal(ckv_s, (a[:, QL:QL + C].float() / 2 * d["kv_norm"].float()).to(bf))
    # perturbing rstd in its last bits changes nothing
    for f in (1 - 2 ** -22, 1 + 2 ** -22):
        xf = a[:, :QL].float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * f
        assert torch.equal((xf * rstd * d["q_norm"].float()).to(bf), qa_s)


# --- the GPU check, run on the CPU with the kernels replaced by their contract ------------

def _gemv(x, w, out=None, **kw):
    return (x.double() @ w.double().t()).to(bf)


def _gemv_rmsnorm(a, w_norm, w, k, eps, out=None):
    return _gemv(emulate_rmsnorm(a[:, :k], w_norm, eps), w)


def _uk(q, a, ckv, w_uk_t, cache, pos, T, rope_off):
    from tests.kimi_decode.test_kernel_mla_glue import _emulate_uk
    return _emulate_uk(q, a, ckv, w_uk_t, cache, pos, T, rope_off)


def _uk_norm(q, a, kv_norm, eps, w_uk_t, cache, pos, T, rope_off, ckv_off):
    c = w_uk_t.shape[2]
    return _uk(q, a, emulate_rmsnorm(a[:, ckv_off:ckv_off + c], kv_norm, eps), w_uk_t, cache, pos, T, rope_off)


@pytest.fixture
def emulated(monkeypatch):
    from kimi_decode.kernels import checks
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(stock_ops, "maybe_compiled", lambda fn, enabled: fn)   # no inductor on CPU here
    monkeypatch.setattr(k_gemv, "gemv", _gemv)
    monkeypatch.setattr(k_gemv, "gemv_rmsnorm", _gemv_rmsnorm)
    monkeypatch.setattr(k_glue, "uk_insert", _uk)
    monkeypatch.setattr(k_glue, "uk_insert_norm", _uk_norm)
    return monkeypatch


def test_check_harness_passes_emulation(emulated) -> None:
    from kimi_decode.kernels.mla_norm_fold import check
    rows = check(timing=False)
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
    assert {(r["case"], r["M"]) for r in rows} == {(c, m) for c in ("random", "exact") for m in (1, 8)}
    assert all(r["kernel"] == "mla_norm_fold" for r in rows)


def test_check_harness_rejects_wrong_kernels(emulated) -> None:
    """c_kv normalised without its weight, or the q norm taken over the wrong columns: fails."""
    from kimi_decode.kernels.mla_norm_fold import check

    def no_weight(q, a, kv_norm, eps, w_uk_t, cache, pos, T, rope_off, ckv_off):
        return _uk_norm(q, a, torch.ones_like(kv_norm), eps, w_uk_t, cache, pos, T, rope_off, ckv_off)

    emulated.setattr(k_glue, "uk_insert_norm", no_weight)
    rows = check(timing=False, rows=(1,))
    assert rows and not any(r["ok"] for r in rows)
    emulated.setattr(k_glue, "uk_insert_norm", _uk_norm)
    emulated.setattr(k_gemv, "gemv_rmsnorm", lambda a, wn, w, k, eps, out=None: _gemv(
        emulate_rmsnorm(a[:, 8:k + 8], wn, eps), w))
    rows = check(timing=False, rows=(1,))
    assert rows and not any(r["ok"] for r in rows)


# --- mla_norm_fold_mma: gemv_mma's RMSNorm prologue (kernels/gemv_mma.py) ------------------

def _mma(x, w, out=None, **kw):
    return _gemv(x, w)


def _mma_rmsnorm(a, w_norm, w, k, eps):
    return _gemv(emulate_rmsnorm(a[:, :k], w_norm, eps), w)


def test_mma_kernel_registered_and_on_by_default() -> None:
    from kimi_decode.fused import DEFAULT_KERNELS
    from kimi_decode.kernels import checks
    assert "mla_norm_fold_mma" in KERNELS and CHECK_MODULES["mla_norm_fold_mma"] == "mla_norm_fold"
    assert "mla_norm_fold_mma" in checks.CHECKS and "mla_norm_fold_mma" in DEFAULT_KERNELS   # 939672d


def test_check_mma_harness_passes_emulation(emulated) -> None:
    """check_mma (M = 2 and 8 at T = 1, B = 1 at k = 7) on the CPU with gemv_mma, its RMSNorm
    prologue and uk_insert(_norm) replaced by their contracts: every row passes, q equal to
    gemv_mma on stock's qa where the norm is exact."""
    from kimi_decode.kernels import gemv_mma as k_mma
    from kimi_decode.kernels.mla_norm_fold import check_mma
    emulated.setattr(k_mma, "gemv_mma", _mma)
    emulated.setattr(k_mma, "gemv_mma_rmsnorm", _mma_rmsnorm)
    rows = check_mma(timing=False)
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
    assert {(r["case"], r["M"], r["k"]) for r in rows} == {(c, m, k) for c in ("random", "exact")
                                                           for m, k in ((2, 0), (8, 0), (8, 7))}
    assert all(r["kernel"] == "mla_norm_fold_mma" for r in rows)


def test_check_mma_harness_rejects_a_wrong_prologue(emulated) -> None:
    """The q norm taken over the wrong columns (or without its weight): every row fails."""
    from kimi_decode.kernels import gemv_mma as k_mma
    from kimi_decode.kernels.mla_norm_fold import check_mma
    emulated.setattr(k_mma, "gemv_mma", _mma)
    emulated.setattr(k_mma, "gemv_mma_rmsnorm", lambda a, wn, w, k, eps: _gemv(emulate_rmsnorm(a[:, 8:k + 8], wn, eps), w))
    assert not any(r["ok"] for r in check_mma(timing=False) if r["case"] == "random")
    emulated.setattr(k_mma, "gemv_mma_rmsnorm", lambda a, wn, w, k, eps: _gemv(
        emulate_rmsnorm(a[:, :k], torch.ones_like(wn), eps), w))
    assert not any(r["ok"] for r in check_mma(timing=False))


def test_mma_prologue_compiles(tmp_path) -> None:
    """GemvMmaNorm at the K3 q_b shape (M = 8, N = 1152, K = 1536, rows of A = 2112): sm_90a
    PTX with the plain gemv_mma's mma count, the prologue's normalised row stored to shared
    memory as 128-bit vectors and x read back from there, one barrier and one rsqrt more than
    the plain kernel, no local memory; ptxas fits it without spills."""
    from kimi_decode.kernels import _common
    from kimi_decode.kernels import gemv_mma as k_mma
    from tests.kimi_decode.ptxas_tool import ptxas_path, ptxas_usage
    n, k, A = 1152, QL, 2112
    assert k_mma.can_implement_norm(8, n, k, A, (bf,)) and not k_mma.can_implement_norm(8, n, k + 32, A + 32, (bf,))
    assert not k_mma.can_implement_norm(8, n, k, k - 8, (bf,)) and not k_mma.can_implement_norm(1, n, k, A, (bf,))
    P = _common.dummy_ptr(bf)

    def ptx(cls, cfg, *ptrs) -> str:
        d = tmp_path / cls.__name__
        d.mkdir()
        cute.compile(cls(cfg), *ptrs, _common.current_stream(),
                     options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {d}")
        (f,) = list(d.glob("*.ptx"))
        return f.read_text()
    warps = k_mma.warps_for(n, k)
    norm = ptx(k_mma.GemvMmaNorm, k_mma.GemvMmaConfig(n, k, 8, warps=warps, eps=EPS, x_stride=A), P, P, P, P)
    plain = ptx(k_mma.GemvMma, k_mma.GemvMmaConfig(n, k, 8, warps=warps), P, P, P)
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    assert norm.count(mma) == plain.count(mma) > 0
    assert norm.count("bar.sync") == plain.count("bar.sync") + 1
    assert norm.count("rsqrt.approx") == 1 and "ld.local" not in norm
    # the prologue: the a row's and the norm weight's 6 vectors per lane in, xn's 6 out to shared
    assert norm.count("st.shared.v4") >= 6 and norm.count("ld.shared.v4") > plain.count("ld.shared.v4")
    if ptxas_path() is not None:
        regs, spills = ptxas_usage(tmp_path / "GemvMmaNorm", norm)
        assert regs <= 255 and spills == 0, (regs, spills)
