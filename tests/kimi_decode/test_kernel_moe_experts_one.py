"""The one-launch routed experts (kimi_decode/kernels/moe_experts_one.py) on the CPU.

Oracles:
- compile (K3 TP16: L = 3584, Ip = 256, I = 192, K = 16, E = 896): sm_90a PTX with 7 CTAs
  per SM requested; FC1's 3 loads per unrolled slice (7 per trip) and FC2v2's 12 w2 loads per
  lane, all issued before griddepcontrol.wait and the acquire poll of the completion counter
  (ld.acquire.gpu in a loop); FC1's publish is fence.acq_rel.gpu, bar.sync, fence, then
  atom.acq_rel.gpu; the counter atomics (ticket, twice in the code; completion; exit) and
  the exit's re-zeroing stores; ptxas (when installed) fits it in 72 registers with a bounded spill.
- wrapper: the grid is ctas_per_sm x the device's SM count; bad shapes / counters refused.
- check harness: `check` on a tiny config with emulated kernels produces ok rows; a kernel
  that differs from FC2 v2 in one element fails (torch.equal), and so does one that leaves
  a counter nonzero.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

from cutlass import Float32, Int32  # noqa: E402

from tests.kimi_decode.ptxas_tool import require_ptxas
from kimi_decode.config import k3_tp16, tiny  # noqa: E402
from kimi_decode.kernels import _common  # noqa: E402
from kimi_decode.kernels.moe_experts import ExpertsConfig  # noqa: E402
from kimi_decode.kernels.moe_experts_one import ExpertsOne, can_implement_one, ctas_per_sm  # noqa: E402

from tests.kimi_decode.test_kernel_moe_experts import _emulate, divergent_shuffles, ptxas_usage  # noqa: E402

bf, f32, i64 = torch.bfloat16, torch.float32, torch.int64
P = _common.dummy_ptr
K3 = k3_tp16()
K3_CFG = ExpertsConfig(K3.latent_dim, K3.expert_local_inter_padded, K3.expert_local_inter, K3.top_k,
                       K3.num_experts, i64)


def ptx_of(tmp_path: Path, cfg: ExpertsConfig) -> str:
    opts = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    cute.compile(ExpertsOne(cfg), P(bf), P(cfg.idx_dtype), P(f32), P(bf), P(bf), P(bf), P(bf), P(torch.int32),
                 Int32(1), Int32(924), Float32(4.0), Float32(25.0), _common.current_stream(), options=opts)
    files = list(tmp_path.glob("*.ptx"))
    assert len(files) == 1, files
    return files[0].read_text()


def test_compiles_k3(tmp_path: Path) -> None:
    ptx = ptx_of(tmp_path, K3_CFG)
    K = K3.top_k
    assert ".target sm_90a" in ptx and ".minnctapersm 7" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert not divergent_shuffles(ptx)
    lines = [s.strip() for s in ptx.splitlines()]
    vec = [i for i, s in enumerate(lines) if s.startswith("ld.global.v4")]
    acq = [i for i, s in enumerate(lines) if s.startswith("ld.acquire.gpu")]
    wait = [i for i, s in enumerate(lines) if s.startswith("griddepcontrol.wait")]
    atom = [i for i, s in enumerate(lines) if s.startswith("atom.")]
    fence = [i for i, s in enumerate(lines) if s.startswith("fence.acq_rel.gpu")]
    bfly = [i for i, s in enumerate(lines) if s.startswith("shfl.sync.bfly")]
    # FC1 item: 3 loads per slice, 7 slices per trip, two 32-lane butterflies
    fc1 = [i for i in vec if i < wait[0]]
    assert len(wait) == 1 and len(acq) == 2          # the poll: one load before the loop, one in it
    # FC2 item: its K/4 x 3 w2 loads sit after FC1's code and before the wait and the poll
    assert len(fc1) == 3 * 7 + K // 4 * 3
    assert wait[0] < acq[0] < acq[1]
    assert re.search(r"bra\s+\$L__BB0_\d+;", "\n".join(lines[acq[1]:acq[1] + 4]))   # polled in a loop
    assert len([i for i in vec if i > acq[1]]) == 1                                # the staging loop's `a` load
    # ticket (before the loop), completion (FC1 item), ticket (end of the loop body), exit
    assert all("acq_rel" in lines[i] and "add" in lines[i] for i in atom) and len(atom) == 4
    ticket, done, ticket2, exit_ = atom
    assert ticket < done < wait[0] < acq[1] < ticket2 < exit_
    # publish: fence (every thread), barrier, fence (thread 0), release increment
    assert lines[done - 1].startswith("fence.acq_rel.gpu") and any(f < done - 1 for f in fence)
    assert "bar.sync" in "\n".join(lines[fence[0]:done])
    assert len([i for i in bfly if i < wait[0]]) == 10 and len([i for i in bfly if i > acq[1]]) == 3 * K // 4
    # the last CTA out re-zeroes the three counters
    # (ticket and exit, words 0 and 1, as one v2 store of zeros; the completion counter, word 32)
    zeros = [s for s in lines[exit_:] if s.startswith("st.global")]
    assert len(zeros) == 2 and "v2.b32" in zeros[0] and zeros[0].endswith("{0, 0};") and zeros[1].endswith("+128], 0;")
    assert "+128]" in "\n".join(lines[acq[0] - 3:acq[0] + 1])                     # the poll reads word 32


def test_no_padding_skip_compiles_with_4_ctas(tmp_path: Path) -> None:
    cfg = ExpertsConfig(3584, 256, 256, 16, 896, torch.int32)
    assert ctas_per_sm(cfg) == 4 and ctas_per_sm(K3_CFG) == 7
    ptx = ptx_of(tmp_path, cfg)
    assert ".minnctapersm 4" in ptx and "ld.acquire.gpu" in ptx


def test_registers_with_ptxas(tmp_path: Path) -> None:
    """ptxas fits the kernel in 72 registers (7 CTAs x 128 threads x 72 = 64,512 ≤ 65,536);
    its spill (94 B stored / 120 B loaded per thread with CUDA 13.0's ptxas, none in the
    weight loops: checked in the SASS by hand) is bounded here so that growth shows."""
    require_ptxas()
    ptx_of(tmp_path, K3_CFG)
    regs, spill_st, spill_ld = ptxas_usage(tmp_path)
    assert regs <= 72
    assert spill_st <= 128 and spill_ld <= 160


def test_can_implement() -> None:
    L, Ip, I, K = K3.latent_dim, K3.expert_local_inter_padded, K3.expert_local_inter, K3.top_k
    assert can_implement_one(1, K, L, Ip, (bf,) * 3, inter=I) and can_implement_one(8, K, L, Ip, (bf,) * 3, inter=I)
    assert not can_implement_one(9, K, L, Ip, (bf,) * 3, inter=I)
    assert not can_implement_one(1, 14, L, Ip, (bf,) * 3, inter=I)


def test_wrapper_grid_and_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch gets ctas_per_sm x SMs CTAs (7 x 132 = 924 on the H200) and M; bad
    counters are refused before any launch."""
    from kimi_decode.kernels import moe_experts_one as mod
    launched = []
    monkeypatch.setattr(mod, "sm_count", lambda dev: 132)
    monkeypatch.setattr(mod, "compile_for", lambda cfg: lambda *a: launched.append((cfg, a)))
    monkeypatch.setattr(mod, "ptr", lambda t: t)
    L, Ip, I, K, E = 512, 256, 192, 16, 8
    z = torch.zeros(1, L, dtype=bf)
    idx = torch.arange(K)[None] % E
    w = torch.ones(1, K)
    w13, w2 = torch.zeros(E, 2 * Ip, L, dtype=bf), torch.zeros(E, L, Ip, dtype=bf)
    cnt = torch.zeros(64, dtype=torch.int32)
    mod.experts_one(z, idx, w, w13, w2, 4.0, 25.0, cnt, inter=I)
    cfg, args = launched[0]
    assert cfg.inter == I and int(args[8]) == 1 and int(args[9]) == 7 * 132 and args[7] is cnt
    mod.experts_one(z, idx, w, w13, w2, 4.0, 25.0, cnt)               # I = Ip: 4 CTAs per SM
    assert int(launched[1][1][9]) == 4 * 132
    with pytest.raises(ValueError):
        mod.experts_one(z, idx, w, w13, w2, 4.0, 25.0, torch.zeros(2, dtype=torch.int32), inter=I)
    with pytest.raises(ValueError):
        mod.experts_one(z.repeat(9, 1), idx.repeat(9, 1), w.repeat(9, 1), w13, w2, 4.0, 25.0, cnt, inter=I)


def _check_on_cpu(monkeypatch: pytest.MonkeyPatch, one, timing: bool = True) -> list[dict]:
    from kimi_decode.kernels import checks, moe_experts, moe_experts_one
    import kimi_decode.config as config
    small = tiny(dtype="bfloat16", moe_pad_local_inter=24)
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(config, "k3_tp16", lambda **kw: small.with_(**kw))
    monkeypatch.setattr(moe_experts, "experts", lambda *a, v2=False, pdl=False, **kw: _emulate(*a, **kw))
    monkeypatch.setattr(moe_experts_one, "experts_one", one)
    monkeypatch.setattr(checks, "time_us", lambda fn: (fn(), 1.0)[1])
    return moe_experts_one.check(timing=timing, rows=(1, 2))


def _one(z, idx, w, w13, w2, beta, lin_beta, counters, out=None, *, inter=None):
    return _emulate(z, idx, w, w13, w2, beta, lin_beta, out, inter=inter)


def test_check_runs_on_cpu_with_emulated_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = _check_on_cpu(monkeypatch, _one)
    assert [(r["M"], r["skip_pad"]) for r in rows] == [(1, True), (2, True), (1, False)]
    assert all(r["ok"] and r["equal_v2"] and r["counters_zero_after_replays"] for r in rows), rows
    assert all(r["kernel_us"] == r["v2_pdl_us"] == r["stock_us"] == 1.0 for r in rows)


def test_check_fails_a_kernel_one_element_off(monkeypatch: pytest.MonkeyPatch) -> None:
    def off(*a, **kw):
        r = _one(*a, **kw)
        r[0, 0] = (r[0, 0].float() * 1.01).to(r.dtype) if r[0, 0] != 0 else 1e-3
        return r
    assert not any(r["ok"] for r in _check_on_cpu(monkeypatch, off, timing=False))


def test_check_fails_counters_left_nonzero(monkeypatch: pytest.MonkeyPatch) -> None:
    def leaky(z, idx, w, w13, w2, beta, lin_beta, counters, out=None, **kw):
        counters[1] += 1
        return _one(z, idx, w, w13, w2, beta, lin_beta, counters, out, **kw)
    rows = _check_on_cpu(monkeypatch, leaky, timing=False)
    assert not any(r["ok"] for r in rows) and not any(r["counters_zero"] for r in rows)


def _float_ops(lines: list[str]) -> list[str]:
    """The mnemonics of the floating-point, conversion and shuffle instructions, in order."""
    out = []
    for s in (s.strip() for s in lines):
        if not s or s.startswith(("//", "$", ".", "{", "}")):
            continue
        m = s.split()[1] if s.startswith("@") else s.split()[0]
        if re.search(r"f32|bf16|f16|shfl|tanh|ex2|rcp|lg2", m):
            out.append(m)
    return out


def test_items_run_the_two_kernels_arithmetic(tmp_path: Path) -> None:
    """Bit-equality with FC1 + FC2v2, on the CPU: the FC1 item's code (from its first weight
    load to the completion atomic) has ExpertsFC1's float/convert/shuffle instruction sequence
    (from its first weight load, built at the item's unroll depth), and the FC2 item's (from
    griddepcontrol.wait to the next ticket) ExpertsFC2v2's (from its wait): same FMAs in the
    same order, same roundings."""
    from kimi_decode.kernels.moe_experts import ExpertsFC1, ExpertsFC2v2
    from kimi_decode.kernels.moe_experts_one import ONE_FC1_UNROLL
    (tmp_path / "one").mkdir()
    one = [s.strip() for s in ptx_of(tmp_path / "one", K3_CFG).splitlines()]

    def kernel_ptx(sub: str, kernel: object, *args: object) -> list[str]:
        d = tmp_path / sub
        d.mkdir()
        cute.compile(kernel, *args, _common.current_stream(), options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {d}")
        return [s.strip() for s in next(d.glob("*.ptx")).read_text().splitlines()]
    fc1 = kernel_ptx("fc1", ExpertsFC1(K3_CFG, unroll=ONE_FC1_UNROLL, group=0), P(bf), P(i64), P(bf), P(bf), P(torch.int32), Int32(1), Float32(4.0), Float32(25.0))
    fc2 = kernel_ptx("fc2", ExpertsFC2v2(K3_CFG), P(bf), P(i64), P(f32), P(bf), P(bf), Int32(1))
    atom = [i for i, s in enumerate(one) if s.startswith("atom.")]
    wait = next(i for i, s in enumerate(one) if s.startswith("griddepcontrol.wait"))
    first_load = next(i for i, s in enumerate(one) if s.startswith("ld.global.v4"))
    fc1_from = next(i for i, s in enumerate(fc1) if s.startswith("ld.global.v4"))
    fc2_from = next(i for i, s in enumerate(fc2) if s.startswith("griddepcontrol.wait"))
    a, b = _float_ops(fc1[fc1_from:]), _float_ops(one[first_load:atom[1]])
    assert len(a) > 300 and a == b
    a, b = _float_ops(fc2[fc2_from:]), _float_ops(one[wait:atom[2]])
    assert len(a) > 300 and a == b
