"""The routed-experts kernels (kimi_decode/kernels/moe_experts.py) on the CPU.

Oracles:
- compile: both kernels compile to sm_90a PTX at the K3 TP16 shapes (L = 3584, Ip = 256,
  I = 192, K = 16, E = 896) with 128-bit weight loads (`ld.global.v4`), no local-memory spills,
  no shuffle inside a lane-dependent branch, and the expected load counts: FC1 issues 3 loads
  (gate, up, z) per unrolled slice, all 14 slices in one loop trip; FC2 issues all K w2 loads of a row
  (one slice per lane) before griddepcontrol.wait, then stages `a` through shared memory,
  before its K butterflies (5 shuffles each).
- math: `reference` (float64 with stock's bf16 rounding points) equals stock_ops.experts_grouped
  on the CPU. Stock rounds r to bf16 (relative error ~1e-3 alone) and its intermediates from
  fp32 sums, so the tolerance is 4e-3; a wrong formula (gate/up swapped, weights ignored, SiTU
  betas of 1) moves the result by more than 5e-2, which the negative cases assert.
- padding skip: with the LatentMoE weights (zero padding by construction), the reference that
  reads only I of Ip rows/columns is bit-identical to the full one; with nonzero padding it
  is not (so the test can fail).
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

from cutlass import Float32, Int32  # noqa: E402

from tests.kimi_decode.ptxas_tool import ptxas_path, require_ptxas
from kimi_decode import stock_ops  # noqa: E402
from kimi_decode.comm import LocalComm, SideStream  # noqa: E402
from kimi_decode.config import k3_tp16, tiny  # noqa: E402
from kimi_decode.kernels import _common  # noqa: E402
from kimi_decode.kernels.moe_experts import (WARPS, ExpertsConfig, ExpertsFC1, ExpertsFC2,  # noqa: E402
                                             ExpertsFC2v2, can_implement, can_implement_v2, fc1_warp_index,
                                             reference)
from kimi_decode.stock import LatentMoE, Runtime  # noqa: E402
from kimi_decode.weights import Seeder  # noqa: E402

bf, f32, i64 = torch.bfloat16, torch.float32, torch.int64
P = _common.dummy_ptr
K3 = k3_tp16()
K3_CFG = ExpertsConfig(K3.latent_dim, K3.expert_local_inter_padded, K3.expert_local_inter, K3.top_k,
                       K3.num_experts, i64)


def ptx_of(tmp_path: Path, kernel: object, *args: object) -> str:
    opts = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    cute.compile(kernel, *args, _common.current_stream(), options=opts)
    files = list(tmp_path.glob("*.ptx"))
    assert len(files) == 1, files
    return files[0].read_text()


def ptxas_usage(tmp_path: Path) -> tuple[int, int, int]:
    """(registers, spill bytes stored, spill bytes loaded) per thread that `ptxas -v` reports
    for the one .ptx in tmp_path (sm_90a); the caller skips when ptxas is not installed.
    Shared with test_kernel_moe_experts_one."""
    src = next(tmp_path.glob("*.ptx"))
    res = subprocess.run(["ptxas", "-v", "-arch=sm_90a", str(src), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True)
    regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    assert spill is not None
    return regs, int(spill.group(1)), int(spill.group(2))


def divergent_shuffles(ptx: str) -> list[str]:
    """shfl.sync between a predicated forward branch and its target label, except where the
    branch skips a whole loop (its region holds a back-edge to a label inside it: the `m < 1`
    guard of a uniform loop, which every lane takes alike)."""
    lines = [s.strip() for s in ptx.splitlines()]
    label = {s[:-1]: i for i, s in enumerate(lines) if s.startswith("$") and s.endswith(":")}

    def target(s: str) -> str:
        return s.split()[-1].rstrip(";")

    found = []
    for i, s in enumerate(lines):
        if not (s.startswith("@%p") and " bra " in s) or label[target(s)] < i:
            continue
        j = label[target(s)]
        region = lines[i + 1:j]
        loop_guard = any(" bra " in r and i < label.get(target(r), -1) < i + 1 + k
                         for k, r in enumerate(region))
        if not loop_guard:
            found += [r for r in region if r.startswith("shfl.sync")]
    return found


def common_checks(ptx: str) -> None:
    assert ".target sm_90a" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert not divergent_shuffles(ptx)


def test_divergent_shuffles_helper_can_fail() -> None:
    bad = "@%p1 bra $L__BB0_2;\nshfl.sync.bfly.b32 %r1, %r2, 1, 31, -1;\n$L__BB0_2:\n"
    ok_loop = ("@%p1 bra $L__BB0_3;\n$L__BB0_2:\nshfl.sync.bfly.b32 %r1, %r2, 1, 31, -1;\n"
               "@%p2 bra $L__BB0_2;\n$L__BB0_3:\n")
    assert divergent_shuffles(bad) and not divergent_shuffles(ok_loop)


def test_fc1_compiles(tmp_path: Path) -> None:
    ptx = ptx_of(tmp_path, ExpertsFC1(K3_CFG), P(bf), P(i64), P(bf), P(bf), P(torch.int32), Int32(1), Float32(4.0), Float32(25.0))
    common_checks(ptx)
    assert ptx.count("ld.global.v4") == 3 * 14       # gate, up, z per slice; all 14 slices in one trip
    assert ptx.count("shfl.sync.bfly") == 2 * 5      # two butterflies (gate, up)
    assert "st.global.b16" in ptx
    assert "griddepcontrol.launch_dependents" in ptx  # the PDL hint for FC2


@pytest.mark.parametrize("group", [5, 7])
def test_fc1_load_groups_issue_each_groups_loads_first(tmp_path: Path, group: int) -> None:
    """FC1_LOADS_GROUP: the expert id's load, then per group of slices every gate, up and z
    load (3 per slice) before the group's first bf16 -> fp32 conversion (24 per slice), the
    groups in slice order, then the two conversions of the rounded h; the same 42 vector
    loads and butterflies as the loop; 3 CTAs per SM asked of ptxas (<= 85 registers), and
    ptxas (when installed) fits that with at most one spilled word. The SASS order is
    ptxas's (cuobjdump of this build with ptxas 13.0): the first group's loads ~15 back to
    back, the later ones as registers freed, where the loop's build kept 3-5 in flight."""
    from tests.kimi_decode.test_kernels_compile import load_convert_order
    ptx = ptx_of(tmp_path, ExpertsFC1(K3_CFG, group=group), P(bf), P(i64), P(bf), P(bf), P(torch.int32), Int32(1),
                 Float32(4.0), Float32(25.0))
    common_checks(ptx)
    slices = K3.latent_dim // 256
    sizes = [min(group, slices - i0) for i0 in range(0, slices, group)]
    assert load_convert_order(ptx) == "L" + "".join("L" * 3 * n + "C" * 24 * n for n in sizes) + "CC"
    assert ptx.count("ld.global.v4") == 3 * slices and ptx.count("shfl.sync.bfly") == 2 * 5
    assert ".minnctapersm 3" in ptx
    if ptxas_path() is None:
        return
    regs, spill_st, spill_ld = ptxas_usage(tmp_path)
    assert regs <= 85 and spill_st <= 4 and spill_ld <= 4


def test_fc1_group_follows_the_module_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """ExpertsFC1 reads FC1_LOADS_GROUP when built (the bench's --patch A/B sets it), fc1_group
    applies it up to FC1_GROUP_MAX_ROWS, and the compile cache keys on the group."""
    import kimi_decode.kernels.moe_experts as mx
    monkeypatch.setattr(mx, "FC1_LOADS_GROUP", 5)
    assert ExpertsFC1(K3_CFG).group == 5 and ExpertsFC1(K3_CFG, group=0).group == 0
    assert ExpertsFC1(K3_CFG, group=99).group == K3.latent_dim // 256      # at most every slice
    monkeypatch.undo()
    assert [mx.fc1_group(m) for m in (1, 2, 8)] == [7, 0, 0]               # the measured default
    monkeypatch.setattr(mx, "FC1_LOADS_GROUP", 5)
    monkeypatch.setattr(mx, "FC1_GROUP_MAX_ROWS", 4)
    assert [mx.fc1_group(m) for m in (1, 4, 5, 8)] == [5, 5, 0, 0]
    seen = []
    monkeypatch.setattr(mx, "compiled", lambda key, build: seen.append(key))
    mx.compile_fc1(K3_CFG, True, 0)
    mx.compile_fc1(K3_CFG, True, 5)
    mx.compile_fc1(K3_CFG, True)
    mx.compile_for(K3_CFG, False, 8)
    assert seen[0] != seen[1] and seen[2] == seen[1] and seen[3] == seen[0]


@pytest.mark.parametrize("column_major", [False, True])
def test_fc1_orders_compile_the_same_loads(tmp_path: Path, column_major: bool) -> None:
    """Both CTA orders of the loop build (M >= 2: fc1_group 0): the same loads, butterflies
    and store (only the warp's index math differs), no local memory, registers at the
    pair-major build's level."""
    ptx = ptx_of(tmp_path, ExpertsFC1(K3_CFG, column_major=column_major, group=0), P(bf), P(i64), P(bf), P(bf), P(torch.int32), Int32(8),
                 Float32(4.0), Float32(25.0))
    common_checks(ptx)
    assert ptx.count("ld.global.v4") == 3 * 14 and ptx.count("shfl.sync.bfly") == 2 * 5
    regs, spill_st, spill_ld = ptxas_usage(tmp_path)
    assert regs <= 40 and spill_st == 0 and spill_ld == 0
    # column order divides the CTA index by the runtime pair count; pair order does not
    assert (("div.s32" in ptx or "div.u32" in ptx) or not column_major)


@pytest.mark.parametrize("m", [1, 2, 8])
@pytest.mark.parametrize("column_major", [False, True])
def test_fc1_warp_index_is_a_bijection(m: int, column_major: bool) -> None:
    """Every (pair, column) warp of FC1's grid exactly once, in both orders; column order
    puts all M·K pairs of a column block in consecutive CTAs (the point of it: two rows that
    picked one expert load its rows at the same time)."""
    I, K = K3.expert_local_inter, K3.top_k
    pairs = m * K
    ctas = pairs * I // WARPS
    gs = [fc1_warp_index(b, w, pairs, I, column_major) for b in range(ctas) for w in range(WARPS)]
    assert sorted(gs) == list(range(pairs * I))
    first_wave = {fc1_warp_index(b, 0, pairs, I, column_major) // I for b in range(pairs)}
    assert len(first_wave) == (pairs if column_major else -(-pairs * WARPS // I))   # pair order: ceil(P·8 / I)


def test_fc1_order_follows_the_module_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """ExpertsFC1 reads FC1_COLUMN_MAJOR when built (the bench's --patch A/B sets it), and the
    compile cache keys on the order (compile_fc1), so a flip cannot reuse the other build."""
    import kimi_decode.kernels.moe_experts as mx
    monkeypatch.setattr(mx, "FC1_COLUMN_MAJOR", False)
    assert not ExpertsFC1(K3_CFG).column_major
    monkeypatch.setattr(mx, "FC1_COLUMN_MAJOR", True)
    assert ExpertsFC1(K3_CFG).column_major
    odd = ExpertsConfig(K3_CFG.latent, K3_CFG.inter_padded, 190, K3_CFG.top_k, K3_CFG.experts, i64)
    assert not ExpertsFC1(odd).column_major                      # I % 8 != 0 (can_implement refuses it): pair order
    seen = []
    monkeypatch.setattr(mx, "compiled", lambda key, build: seen.append(key))
    mx.compile_fc1(K3_CFG, False)
    mx.compile_fc1(K3_CFG, True)
    mx.compile_fc1(K3_CFG)
    assert seen[0] != seen[1] and seen[2] == seen[1]


@pytest.mark.parametrize("pdl", [False, True])
def test_fc2_compiles(tmp_path: Path, pdl: bool) -> None:
    cfg = ExpertsConfig(K3_CFG.latent, K3_CFG.inter_padded, K3_CFG.inter, K3_CFG.top_k, K3_CFG.experts, i64, pdl=pdl)
    ptx = ptx_of(tmp_path, ExpertsFC2(cfg), P(bf), P(i64), P(f32), P(bf), P(bf), Int32(1))
    common_checks(ptx)
    K = K3.top_k
    lines = [s.strip() for s in ptx.splitlines()]
    vec = [i for i, s in enumerate(lines) if s.startswith("ld.global.v4")]
    shf = [i for i, s in enumerate(lines) if s.startswith("shfl.sync.bfly")]
    assert len(shf) == 5 * K                          # one butterfly per expert slot
    assert "st.global.b16" in ptx
    # all K w2 slices (and the ids/weights) are loaded before griddepcontrol.wait (also the
    # fence that keeps them in flight together); the 2 staged `a` slices per thread (16·32
    # slices / 256 threads) before it too without PDL, after it with PDL; then shared memory
    wait = [i for i, s in enumerate(lines) if s.startswith("griddepcontrol.wait")]
    bar = [i for i, s in enumerate(lines) if s.startswith("bar.sync")]
    assert len(wait) == 1 and len(bar) == 2 and wait[0] < bar[0] < shf[0]
    assert len([i for i in vec if i < wait[0]]) >= K + (0 if pdl else 2)
    assert len([i for i in vec if wait[0] < i < bar[0]]) == (2 if pdl else 0)
    assert ptx.count("st.shared.v4") == 2 and ptx.count("ld.shared.v4") == K
    assert ".minnctapersm 2" in ptx                   # ≤ 128 registers: 2 CTAs per SM


@pytest.mark.parametrize("pdl", [False, True])
def test_fc2_v2_compiles(tmp_path: Path, pdl: bool) -> None:
    """ExpertsFC2v2 at K3: each lane issues its 12 w2 slices (4 experts x 3 slices, every lane
    busy) before griddepcontrol.wait, stages `a` after it (one rolled slice loop: one
    ld.global.v4 / st.shared.v4 in the code), one barrier, then 4 experts x 3 shared reads,
    an 8-lane butterfly (3 shuffles) per expert and 16 index shuffles gathering e_j for the
    j-ordered weighted sum; 7 CTAs per SM requested (≤ 72 registers)."""
    cfg = ExpertsConfig(K3_CFG.latent, K3_CFG.inter_padded, K3_CFG.inter, K3_CFG.top_k, K3_CFG.experts, i64, pdl=pdl)
    ptx = ptx_of(tmp_path, ExpertsFC2v2(cfg), P(bf), P(i64), P(f32), P(bf), P(bf), Int32(1))
    common_checks(ptx)
    K = K3.top_k
    lines = [s.strip() for s in ptx.splitlines()]
    vec = [i for i, s in enumerate(lines) if s.startswith("ld.global.v4")]
    bfly = [i for i, s in enumerate(lines) if s.startswith("shfl.sync.bfly")]
    idx_shfl = [i for i, s in enumerate(lines) if s.startswith("shfl.sync.idx")]
    wait = [i for i, s in enumerate(lines) if s.startswith("griddepcontrol.wait")]
    bar = [i for i, s in enumerate(lines) if s.startswith("bar.sync")]
    assert len(wait) == 1 and len(bar) == 1 and wait[0] < bar[0] < bfly[0]
    assert len([i for i in vec if i < wait[0]]) == K // 4 * 3          # all w2 loads before the wait
    assert len([i for i in vec if wait[0] < i < bar[0]]) == 1          # the staging loop's load
    assert len(bfly) == 3 * K // 4 and all("31, -1" in lines[i] for i in bfly)
    assert len([i for i in idx_shfl if i > bfly[-1]]) == K            # e_j gathered in j order
    assert ptx.count("st.shared.v4") == 1 and ptx.count("ld.shared.v4") == K // 4 * 3
    assert "st.global.b16" in ptx
    assert ".minnctapersm 7" in ptx


def test_fc2_v2_registers_with_ptxas(tmp_path: Path) -> None:
    """ptxas (when installed) fits ExpertsFC2v2 in 72 registers (7 CTAs of 4 warps per SM:
    the 896 CTAs of M = 1 in one wave); the old FC2 needs ~126 (2 CTAs of 8 warps per SM).
    ptxas spills a few words under that cap (20 B stored, 32 B loaded per thread with
    CUDA 13.0's ptxas): bounded here so that growth shows."""
    require_ptxas()
    cfg = ExpertsConfig(K3_CFG.latent, K3_CFG.inter_padded, K3_CFG.inter, K3_CFG.top_k, K3_CFG.experts, i64, pdl=True)
    ptx_of(tmp_path, ExpertsFC2v2(cfg), P(bf), P(i64), P(f32), P(bf), P(bf), Int32(1))
    regs, spill_st, spill_ld = ptxas_usage(tmp_path)
    assert regs <= 72
    assert spill_st <= 32 and spill_ld <= 48


def test_fc1_int32_idx_compiles(tmp_path: Path) -> None:
    cfg = ExpertsConfig(3584, 256, 256, 16, 896, torch.int32)    # no padding skip, int32 ids
    ptx = ptx_of(tmp_path, ExpertsFC1(cfg), P(bf), P(torch.int32), P(bf), P(bf), P(torch.int32), Int32(8), Float32(4.0), Float32(25.0))
    common_checks(ptx)
    assert "ld.global.v4" in ptx


def test_can_implement() -> None:
    L, Ip, I, K = K3.latent_dim, K3.expert_local_inter_padded, K3.expert_local_inter, K3.top_k
    assert can_implement(1, K, L, Ip, (bf,) * 3, inter=I) and can_implement(8, K, L, Ip, (bf,) * 3)
    assert not can_implement(9, K, L, Ip, (bf,) * 3)                   # M > 8
    assert not can_implement(1, K, 32, 24, (f32,) * 3)                  # tiny: stock op
    assert not can_implement(1, K, L, 512, (bf,) * 3)                   # K·Ip/256 > 16 registers
    assert not can_implement(1, K, L, Ip, (bf,) * 3, inter=190)         # I not on a 128-bit slice
    assert can_implement_v2(1, K, L, Ip, (bf,) * 3, inter=I) and can_implement_v2(8, K, L, Ip, (bf,) * 3)
    assert not can_implement_v2(9, K, L, Ip, (bf,) * 3, inter=I)       # can_implement's rules too
    assert not can_implement_v2(1, 14, L, Ip, (bf,) * 3, inter=I)      # K not a multiple of 4
    assert not can_implement_v2(1, K, L, Ip, (bf,) * 3, inter=184)     # I not a multiple of 64


def _moe(cfg):
    with torch.no_grad():
        return LatentMoE(cfg, Seeder(cfg, torch.device("cpu")).sub("check.experts"),
                         Runtime(LocalComm(), SideStream(torch.device("cpu"))))


def _inputs(m: int, k: int, e: int, L: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(m, L, generator=gen).bfloat16()
    scores = torch.rand(m, e, generator=gen)
    idx = scores.topk(k, dim=-1).indices
    w = scores.gather(1, idx)
    return z, idx, w / w.sum(-1, keepdim=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("m", [1, 3, 8])
def test_reference_matches_stock_tiny(m: int) -> None:
    """Tiny LatentMoE in bf16 with padding (I = 16 of Ip = 24)."""
    cfg = tiny(dtype="bfloat16", moe_pad_local_inter=24)
    moe = _moe(cfg)
    w13, w2 = moe.w13.detach(), moe.w2.detach()
    assert w2.shape[-1] == 24 and cfg.expert_local_inter == 16
    z, idx, w = _inputs(m, cfg.top_k, cfg.num_experts, cfg.latent_dim, seed=m)
    b, lb = cfg.situ_beta, cfg.situ_linear_beta
    r_s = stock_ops.experts_grouped(z, idx, w, w13, w2, b, lb)
    ref = reference(z, idx, w, w13, w2, b, lb)
    assert rel(r_s, ref) < 4e-3
    # padding is zero by construction: reading only I rows / columns is exact
    assert torch.equal(reference(z, idx, w, w13, w2, b, lb, inter=16), ref)
    # and the test can fail: wrong formulas are far away
    w13_swapped = torch.cat([w13[:, 24:], w13[:, :24]], dim=1)
    assert rel(r_s, reference(z, idx, w, w13_swapped, w2, b, lb)) > 5e-2
    assert rel(r_s, reference(z, idx, torch.full_like(w, 1 / cfg.top_k), w13, w2, b, lb)) > 5e-2
    assert rel(r_s, reference(z, idx, w, w13, w2, 1.0, 1.0)) > 5e-2      # wrong SiTU betas


def test_padding_skip_detects_nonzero_padding() -> None:
    cfg = tiny(dtype="bfloat16", moe_pad_local_inter=24)
    moe = _moe(cfg)
    w13, w2 = moe.w13.detach().clone(), moe.w2.detach().clone()
    w13[:, 16:24] = 0.5
    w13[:, 40:48] = 0.5
    w2[:, :, 16:] = 0.5
    z, idx, w = _inputs(2, cfg.top_k, cfg.num_experts, cfg.latent_dim, seed=7)
    full = reference(z, idx, w, w13, w2, 4.0, 25.0)
    assert not torch.equal(reference(z, idx, w, w13, w2, 4.0, 25.0, inter=16), full)


def test_reference_matches_stock_k3_shapes() -> None:
    """K3 TP16 per-expert shapes (L = 3584, Ip = 256 with zero rows 192..255, K = 16, M = 2)
    on a 20-expert slice of random weights at the LatentMoE scales."""
    E, L, If, Ip, K = 20, K3.latent_dim, K3.expert_local_inter, K3.expert_local_inter_padded, K3.top_k
    gen = torch.Generator().manual_seed(3)
    zpad = torch.zeros(E, Ip - If, L)
    w1, w3 = (torch.randn(E, If, L, generator=gen) * L ** -0.5 for _ in range(2))
    w13 = torch.cat([w1, zpad, w3, zpad], dim=1).bfloat16()
    w2 = torch.cat([torch.randn(E, L, If, generator=gen) * 1536 ** -0.5, zpad.transpose(1, 2)], dim=2).bfloat16()
    z, idx, w = _inputs(2, K, E, L, seed=12)
    r_s = stock_ops.experts_grouped(z, idx, w, w13, w2, K3.situ_beta, K3.situ_linear_beta)
    ref = reference(z, idx, w, w13, w2, K3.situ_beta, K3.situ_linear_beta, inter=If)
    assert rel(r_s, ref) < 4e-3
    assert rel(r_s, reference(z, idx, w, w13, w2, K3.situ_beta, K3.situ_linear_beta, round_bf16=False)) < 1e-2


def _emulate_a(z, idx, w13, beta, lin_beta, i):
    """FC1's math in torch: a [M·K, i] bf16 (fp32 sums, bf16 h, SiTU in fp32)."""
    K = idx.shape[1]
    ip = w13.shape[1] // 2
    e = idx.reshape(-1).long()
    zz = z.float().repeat_interleave(K, 0)[:, :, None]
    g = torch.bmm(w13[e, :i].float(), zz)[..., 0].bfloat16().float()
    u = torch.bmm(w13[e, ip:ip + i].float(), zz)[..., 0].bfloat16().float()
    return ((beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (lin_beta * torch.tanh(u / lin_beta))).bfloat16()


def _emulate_fc1(z, idx, w13, act, beta, lin_beta, inter, column_major, group=None):
    """moe_experts.fc1_launch emulated (any order, any load group: the same `a`)."""
    act[:, :inter] = _emulate_a(z, idx, w13, beta, lin_beta, inter)


def _emulate(z, idx, w, w13, w2, beta, lin_beta, out=None, *, inter=None, pdl=False):
    """The kernels' math in torch (fp32 sums, the same bf16 rounding points), for the CPU run
    of `check`."""
    M, K = idx.shape
    ip = w2.shape[-1]
    i = ip if inter is None else inter
    e = idx.reshape(-1).long()
    a = _emulate_a(z, idx, w13, beta, lin_beta, i)
    eo = torch.bmm(w2[e, :, :i].float(), a.float()[:, :, None])[..., 0].bfloat16().float()
    r = (w.float().reshape(M, K, 1) * eo.reshape(M, K, -1)).sum(1).bfloat16()
    if out is None:
        return r
    out.copy_(r)
    return out


def test_check_runs_on_cpu_with_emulated_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """`check` end to end on a tiny bf16 config, the kernel replaced by _emulate and time_us by
    a stub that calls the timed function: every case row is produced and ok; a broken kernel
    (weights ignored) is not ok."""
    from kimi_decode.kernels import checks, moe_experts
    import kimi_decode.config as config
    small = tiny(dtype="bfloat16", moe_pad_local_inter=24)
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(config, "k3_tp16", lambda **kw: small.with_(**kw))
    monkeypatch.setattr(moe_experts, "experts", _emulate)
    monkeypatch.setattr(moe_experts, "fc1_launch", _emulate_fc1)
    calls = []

    def fake_time_us(fn) -> float:                  # time_us needs CUDA: call fn, count calls
        for _ in range(5):
            fn()
        calls.append(5)
        return 1.0
    monkeypatch.setattr(checks, "time_us", fake_time_us)
    all_rows = moe_experts.check(timing=True, rows=(1, 2))
    rows = [r for r in all_rows if r.get("case") not in ("fc1_order", "fc1_group")]
    order = [r for r in all_rows if r.get("case") == "fc1_order"]
    groups = [r for r in all_rows if r.get("case") == "fc1_group"]
    assert len(rows) == 6 and all(r["ok"] for r in all_rows), all_rows
    assert all(r["kernel_us"] == r["stock_us"] == r["kernel_same_us"] == 1.0 for r in rows)
    n_groups = len(moe_experts.FC1_GROUPS_CHECKED)
    # + FC1 alone in both orders at M = 2, + FC1 alone as the loop and in each group at M = 1, 2
    assert len(calls) == 4 * 6 + 2 + 2 * (1 + n_groups)
    assert [(r["M"], r["group"]) for r in groups] == [(m, g) for m in (1, 2) for g in moe_experts.FC1_GROUPS_CHECKED]
    assert all(r["a_equal"] and r["pad_untouched"] for r in groups)
    assert all(groups[-1][k] == 1.0 for k in ["loop_us", *(f"g{g}_us" for g in moe_experts.FC1_GROUPS_CHECKED)])
    assert [(r["M"], r["skip_pad"], r["pdl"]) for r in rows] == [
        (1, True, False), (1, False, False), (2, True, False), (2, False, False), (1, True, True), (2, True, True)]
    assert [r["M"] for r in order] == [2] and order[0]["a_equal"] and order[0]["pad_untouched"]
    assert order[0]["pair_order_us"] == order[0]["column_order_us"] == 1.0

    def order_dependent(z, idx, w13, act, beta, lin_beta, inter, column_major, group=None):   # must fail
        _emulate_fc1(z, idx, w13, act, beta, lin_beta, inter, column_major)
        if column_major:
            act[0, 0] = act[0, 0] * 2 + 1
    monkeypatch.setattr(moe_experts, "fc1_launch", order_dependent)
    bad = [r for r in moe_experts.check(timing=False, rows=(2,)) if r.get("case") == "fc1_order"]
    assert len(bad) == 1 and not bad[0]["ok"] and not bad[0]["a_equal"]

    def group_dependent(z, idx, w13, act, beta, lin_beta, inter, column_major, group=None):   # must fail
        _emulate_fc1(z, idx, w13, act, beta, lin_beta, inter, column_major)
        if group == 5:
            act[1, 2] = act[1, 2] * 2 + 1
    monkeypatch.setattr(moe_experts, "fc1_launch", group_dependent)
    bad = [r for r in moe_experts.check(timing=False, rows=(2,)) if r.get("case") == "fc1_group"]
    assert [(r["group"], r["ok"]) for r in bad] == [(3, True), (5, False), (7, True)]
    monkeypatch.setattr(moe_experts, "fc1_launch", _emulate_fc1)

    def no_pdl(*a, pdl=False, **kw):                # a stack without PDL: only those rows skip
        if pdl:
            raise RuntimeError("programmatic launch unsupported")
        return _emulate(*a, **kw)
    monkeypatch.setattr(moe_experts, "experts", no_pdl)
    rows = moe_experts.check(timing=False, rows=(2,))
    rows = [r for r in rows if r.get("case") != "fc1_group"]      # (FC1 alone: no PDL involved)
    assert all(r["ok"] for r in rows) and [("skipped" in r) for r in rows] == [False, False, True, False]

    def broken(z, idx, w, *a, **kw):
        return _emulate(z, idx, torch.full_like(w, 1.0 / w.shape[1]), *a, **kw)
    monkeypatch.setattr(moe_experts, "experts", broken)
    assert not any(r["ok"] for r in moe_experts.check(timing=False, rows=(2,)) if r.get("case") not in ("fc1_order", "fc1_group"))


def test_check_v2_runs_on_cpu_with_emulated_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """`check_v2` (kernel experts_v2) end to end on a tiny bf16 config with emulated kernels:
    the rows are named experts_v2, compare v2 with the old kernels (rel_vs_old, equal_old) and
    time stock, v2 and old; a v2 that ignores the routing weights fails every row although
    the old kernels are right, and the old kernels are called without `v2`."""
    from kimi_decode.kernels import checks, moe_experts
    import kimi_decode.config as config
    small = tiny(dtype="bfloat16", moe_pad_local_inter=24)
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(config, "k3_tp16", lambda **kw: small.with_(**kw))
    seen = []

    def kernels(z, idx, w, *a, v2=None, **kw):
        seen.append(v2)
        return _emulate(z, idx, w, *a, **kw)
    monkeypatch.setattr(moe_experts, "experts", kernels)
    calls = []

    def fake_time_us(fn) -> float:
        fn()
        calls.append(1)
        return 1.0
    monkeypatch.setattr(checks, "time_us", fake_time_us)
    rows = moe_experts.check_v2(timing=True, rows=(1, 2))
    assert len(rows) == 6 and all(r["ok"] and r["kernel"] == "experts_v2" for r in rows), rows
    assert all(r["equal_old"] and r["rel_vs_old"] == 0.0 for r in rows)
    assert all(r["kernel_us"] == r["old_us"] == r["stock_us"] == r["old_same_us"] == 1.0 for r in rows)
    assert len(calls) == 6 * 6 and set(seen) == {True, None}

    def broken(z, idx, w, *a, v2=None, **kw):
        if v2:
            w = torch.full_like(w, 1.0 / w.shape[1])
        return _emulate(z, idx, w, *a, **kw)
    monkeypatch.setattr(moe_experts, "experts", broken)
    monkeypatch.setattr(moe_experts, "fc1_launch", _emulate_fc1)      # check's FC1-order rows
    rows = moe_experts.check_v2(timing=False, rows=(2,))
    assert not any(r["ok"] for r in rows) and all(r["rel_vs_old"] > 1e-2 for r in rows)
    assert all(r["ok"] for r in moe_experts.check(timing=False, rows=(2,)))


def test_fc2_v2_async_staging_compiles(tmp_path: Path) -> None:
    """ExpertsConfig.stage_async (kernel experts_v2_async): the row's `a` slices go to shared
    memory as 3 cp.async copies per thread (no ld.global / st.shared pair after the wait), one
    commit and one wait_group 0 before the barrier; the w2 loads before griddepcontrol.wait
    are unchanged; ptxas (where installed) keeps the 72-register cap without the spills the
    rolled staging loop has."""
    cfg = ExpertsConfig(K3_CFG.latent, K3_CFG.inter_padded, K3_CFG.inter, K3_CFG.top_k, K3_CFG.experts, i64,
                        pdl=True, stage_async=True)
    ptx = ptx_of(tmp_path, ExpertsFC2v2(cfg), P(bf), P(i64), P(f32), P(bf), P(bf), Int32(1))
    common_checks(ptx)
    lines = [s.strip() for s in ptx.splitlines()]
    wait = next(i for i, s in enumerate(lines) if s.startswith("griddepcontrol.wait"))
    bar = next(i for i, s in enumerate(lines) if s.startswith("bar.sync"))
    copies = [i for i, s in enumerate(lines) if s.startswith("cp.async.ca.shared.global")]
    assert len(copies) == K3_CFG.inter // (8 * 8) and all(wait < i < bar for i in copies)
    commit = next(i for i, s in enumerate(lines) if s.startswith("cp.async.commit_group"))
    done = next(i for i, s in enumerate(lines) if s.startswith("cp.async.wait_group"))
    assert max(copies) < commit < done < bar
    assert not [i for i, s in enumerate(lines) if s.startswith("ld.global.v4") and wait < i < bar]
    assert "st.shared.v4" not in ptx
    assert len([i for i, s in enumerate(lines) if s.startswith("ld.global.v4") and i < wait]) == K3.top_k // 4 * 3
    (tmp_path / "plain").mkdir()
    plain = ptx_of(tmp_path / "plain", ExpertsFC2v2(dataclasses.replace(cfg, stage_async=False)),
                   P(bf), P(i64), P(f32), P(bf), P(bf), Int32(1))
    assert "cp.async" not in plain
    if ptxas_path() is not None:
        regs, spill_st, spill_ld = ptxas_usage(tmp_path)
        assert regs <= 72 and spill_st == 0 and spill_ld == 0


def test_check_async_runs_on_cpu_with_emulated_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """`check_async` (kernel experts_v2_async) on a tiny bf16 config with emulated kernels: rows
    pass when the async build equals the plain v2 and fail when it does not (a build that
    drops the routing weights), and both builds are timed."""
    from kimi_decode.kernels import checks, moe_experts
    import kimi_decode.config as config
    small = tiny(dtype="bfloat16", moe_pad_local_inter=24)
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(config, "k3_tp16", lambda **kw: small.with_(**kw))
    seen = []

    def kernels(z, idx, w, *a, v2=None, stage_async=False, **kw):
        seen.append((v2, stage_async))
        return _emulate(z, idx, w, *a, **kw)
    monkeypatch.setattr(moe_experts, "experts", kernels)
    monkeypatch.setattr(checks, "time_us", lambda fn: (fn(), 1.0)[1])
    rows = moe_experts.check_async(timing=True, rows=(1, 2))
    assert len(rows) == 2 and all(r["ok"] and r["equal_v2"] for r in rows), rows
    assert all(r["kernel_us"] == r["v2_us"] == 1.0 for r in rows)
    assert {s for s in seen} == {(True, True), (True, False)}

    def broken(z, idx, w, *a, v2=None, stage_async=False, **kw):
        ww = torch.full_like(w, 1.0 / w.shape[1]) if stage_async else w
        return _emulate(z, idx, ww, *a, **kw)
    monkeypatch.setattr(moe_experts, "experts", broken)
    assert not any(r["ok"] for r in moe_experts.check_async(timing=False, rows=(2,)))


def _ordered_events(ptx: str) -> str:
    """FC1_EARLY_IDS' protocol in PTX order: A = an acquire load of the flag, T = an atomic
    add, W = griddepcontrol.wait, R = griddepcontrol.launch_dependents, V = a 128-bit global
    load (weights or z), S = a barrier."""
    from tests.kimi_decode.test_kernels_compile import ptx_events
    return ptx_events(ptx, [(lambda s: s.startswith(("ld.acquire.gpu", "ld.global.acquire.gpu")), "A"),
                            (lambda s: s.startswith("atom."), "T"),
                            (lambda s: s.startswith("griddepcontrol.wait"), "W"),
                            (lambda s: s.startswith("griddepcontrol.launch_dependents"), "R"),
                            (lambda s: s.startswith("ld.global") and ".v4" in s, "V"),
                            (lambda s: s.startswith("bar.sync"), "S")])


@pytest.mark.parametrize("chained", [False, True])
def test_fc1_early_ids_protocol_in_ptx(tmp_path: Path, chained: bool) -> None:
    """FC1_EARLY_IDS (the M = 1 load-group build): the flag polled with acquire loads and the
    arrival atomic before the CTA barrier, then the first group's 2 x 7 weight loads, then (in
    the PDL chain) the wait and the release of FC2, then the first group's 7 z loads and the
    later groups' 21; the same 42 vector loads as without it. Off the chain FC2 is released
    at the start, as before, and there is no wait. The default build has no acquire or atomic."""
    from kimi_decode.kernels import chain
    chain.set_chain(chained)
    try:
        ptx = ptx_of(tmp_path, ExpertsFC1(K3_CFG, group=7, early_ids=True), P(bf), P(i64), P(bf), P(bf),
                     P(torch.int32), Int32(1), Float32(4.0), Float32(25.0))
        (tmp_path / "plain").mkdir()
        plain = ptx_of(tmp_path / "plain", ExpertsFC1(K3_CFG, group=7), P(bf), P(i64), P(bf), P(bf),
                       P(torch.int32), Int32(1), Float32(4.0), Float32(25.0))
    finally:
        chain.set_chain(False)
    common_checks(ptx)
    ev = _ordered_events(ptx)
    assert ptx.count("ld.global.v4") == 3 * 14
    head = ev.index("S")
    assert "A" in ev[:head] and "T" in ev[:head] and "V" not in ev[:head]
    if chained:
        assert ev[head:].replace("A", "") .startswith("S" + "V" * 14 + "WR" + "V" * 28), ev
    else:
        assert ev.index("R") < head and "W" not in ev and ev[head:].startswith("S" + "V" * 42), ev
    plain_ev = _ordered_events(plain)
    assert "A" not in plain_ev and "T" not in plain_ev
    assert not ExpertsFC1(K3_CFG, group=0, early_ids=True).early_ids      # the loop build never polls
