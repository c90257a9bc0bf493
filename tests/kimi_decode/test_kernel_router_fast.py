"""router_fast on the CPU: the kernel compiles to sm_90a PTX for the K3 TP16 shapes with the
instructions its speed and correctness rest on; `reference` (the float64 oracle of the GPU
check) equals the stock routing op; the kernel's top-k algorithm (lower bound from group
maxima, candidates, exact ranks), emulated in torch, equals a stable sort on random and
tie-heavy rows.
"""
from __future__ import annotations

import os
import subprocess
import re
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

from cutlass import Int32  # noqa: E402

from tests.kimi_decode.ptxas_tool import require_ptxas
from kimi_decode import stock_ops  # noqa: E402
from kimi_decode.config import k3_tp16  # noqa: E402
from kimi_decode.kernels import _common  # noqa: E402
from kimi_decode.kernels.router_fast import (CAP, KSPLIT, STAGE_MAX_LOGITS, RouterFast, RouterFastConfig,  # noqa: E402
                                             can_implement, emulate_select, reference)

bf, f32 = torch.bfloat16, torch.float32
P = _common.dummy_ptr
K3 = k3_tp16()


def ptx_of(tmp_path: Path, cfg: RouterFastConfig) -> str:
    opts = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    cute.compile(RouterFast(cfg), P(bf), P(bf), P(f32), P(f32), P(torch.int32), P(torch.int64), P(f32),
                 Int32(cfg.rows), _common.current_stream(), options=opts)
    files = list(tmp_path.glob("*.ptx"))
    assert len(files) == 1, files
    return files[0].read_text()


@pytest.mark.parametrize("m", [1, 8])
def test_router_fast_compiles(tmp_path: Path, m: int) -> None:
    cfg = RouterFastConfig(K3.hidden, K3.num_experts, K3.top_k, m, K3.routed_scaling)
    ptx = ptx_of(tmp_path, cfg)
    assert ".target sm_90a" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx          # register arrays stayed registers
    # 7 weight slices per lane + 7 per y row, all 128-bit
    slices = K3.hidden // (8 * 32 * KSPLIT)
    assert ptx.count("ld.global.v4") == slices * (1 + m)
    # the 7 weight loads come before the first FMA (all in flight at once)
    first_fma = ptx.index("fma.rn.f32")
    assert ptx[:first_fma].count("ld.global.v4") >= slices
    # grid completion: release/acquire atomic on the counter, fences, CTA barriers
    assert "atom.global.acq_rel.add" in ptx and ptx.count("fence.acq_rel.gpu") >= 3
    # top-k: warp prefix sum (shfl.up), warp barriers around the shared-memory candidates
    assert ptx.count("shfl.sync.up") == 5 and ptx.count("bar.warp.sync") >= 3
    assert re.search(r"\.reqntid 256, 1, 1", ptx)
    # small M: the last CTA stages the logits and the bias in shared memory (coalesced scalar
    # loads, ceil(E/256) each) before its top-k; the top-k itself reads no global memory
    scalar = ptx.count("ld.global.b32") + ptx.count("ld.global.f32")
    if m * K3.num_experts <= STAGE_MAX_LOGITS:
        per = -(-K3.num_experts // 256)
        assert scalar == per * (m + 1)
        last_bar = ptx.rindex("bar.sync")
        assert "ld.global" not in ptx[last_bar:]
    else:
        assert scalar > 2 * K3.num_experts // 32      # logits and bias read in the top-k


def test_can_implement() -> None:
    assert can_implement(K3.hidden, K3.num_experts, K3.top_k, (bf, bf))
    assert not can_implement(64, 16, 4, (f32,))
    assert not can_implement(7168 + 256, 896, 16, (bf,))   # D not a multiple of 1024
    assert not can_implement(7168, 896, 16, (f32,))


def test_group_bits() -> None:
    for k in range(1, 33):
        g = RouterFastConfig(7168, 896, k, 1).group_bits
        assert (32 >> g) >= k and (g == 5 or (32 >> (g + 1)) < k)
    assert RouterFastConfig(7168, 896, 16, 1).group_bits == 1


def _stable_topk(key: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(-key, stable=True).indices[:k]   # ties → lower index


@pytest.mark.parametrize("m,d,e,k", [(3, 1024, 64, 4), (8, K3.hidden, K3.num_experts, K3.top_k)])
def test_reference_equals_stock(m: int, d: int, e: int, k: int) -> None:
    g = torch.Generator().manual_seed(m + e)
    y = torch.nn.functional.rms_norm(torch.randn(m, d, generator=g), (d,)).bfloat16()
    w = (torch.randn(e, d, generator=g) * d ** -0.5).bfloat16()
    bias = torch.randn(e, generator=g) * 0.02
    ids_r, w_r, _ = reference(y, w, bias, k, 2.5)
    logits = torch.mm(y.float(), w.float().t())
    ids_s, w_s = stock_ops.route(logits, bias, k, 2.5)
    assert torch.equal(ids_r.sort(-1).values, ids_s.sort(-1).values)
    assert torch.equal(ids_r, ids_s)                      # same order (descending biased score)
    torch.testing.assert_close(w_r.float(), w_s, rtol=1e-5, atol=1e-6)
    # and the oracle can fail: a different bias changes the selection
    ids_b, _, _ = reference(y, w, bias + torch.randn(e, generator=g), k, 2.5)
    assert not torch.equal(ids_b.sort(-1).values, ids_s.sort(-1).values)


def _check_rows(key: torch.Tensor, s: torch.Tensor, k: int) -> list[int]:
    ns = []
    bits = RouterFastConfig(7168, key.shape[1], k, 1).group_bits
    for row in range(key.shape[0]):
        ids, w, n = emulate_select(key[row], s[row], k, 2.5, bits)
        want = _stable_topk(key[row], k)
        assert torch.equal(ids, want), (row, ids, want)
        ws = s[row][want]
        torch.testing.assert_close(w, ws / ws.sum() * 2.5, rtol=1e-6, atol=1e-7)
        ns.append(n)
    return ns


def test_select_algorithm_random_k3() -> None:
    """K3-like rows (logits ~ N(0, 1), bias ~ 0.02): exact top-16, and few candidates."""
    g = torch.Generator().manual_seed(0)
    e, k = K3.num_experts, K3.top_k
    logits = torch.randn(64, e, generator=g)
    s = torch.sigmoid(logits)
    key = s + torch.randn(e, generator=g) * 0.02
    ns = _check_rows(key, s, k)
    assert min(ns) >= k and max(ns) <= CAP, ns              # the fast path, not the fallback
    assert sum(ns) / len(ns) < 80


@pytest.mark.parametrize("k", [1, 5, 16, 32])
def test_select_algorithm_ties(k: int) -> None:
    """Heavy ties (keys from 6 values) and all-equal rows: ranks break ties by lower index."""
    g = torch.Generator().manual_seed(k)
    e = 128
    key = torch.randint(0, 6, (16, e), generator=g).float() / 8
    key[0] = 0.5
    s = torch.rand(16, e, generator=g)
    ns = _check_rows(key, s, k)
    assert max(ns) == e                                       # the all-equal row: every expert a candidate


def test_registers_allow_all_ctas_resident(tmp_path: Path) -> None:
    """≤ 64 registers (.minnctapersm 4): 4 CTAs of 256 threads per SM, so all E/2 = 448 CTAs
    of the K3 grid fit in one wave on 132 SMs; no spills at M = 1."""
    require_ptxas()
    cfg = RouterFastConfig(K3.hidden, K3.num_experts, K3.top_k, 1, K3.routed_scaling)
    ptx_of(tmp_path, cfg)
    f = next(tmp_path.glob("*.ptx"))
    out = subprocess.run(["ptxas", "-arch=sm_90a", "-v", "-O3", str(f), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    assert regs <= 64, out
    assert "0 bytes spill stores" in out, out
    assert 4 * 132 >= K3.num_experts // 2


def _rounds(key: torch.Tensor, k: int) -> torch.Tensor:
    """The fallback in torch: round r takes the best (key, then lower index) element strictly
    below round r-1's winner in (key desc, index asc) order; lane l holds l + 32 i."""
    e = key.numel()
    pk, pi, out = float("inf"), -1, []
    for _ in range(k):
        below = (key < pk) | ((key == pk) & (torch.arange(e) > pi))
        cand = torch.where(below, key, torch.full_like(key, -3e38))
        # per lane: first maximum in ascending index; then across lanes: value, lower index
        best_v, best_i = -3e38, e
        for lane in range(32):
            idx = torch.arange(lane, e, 32)
            v = cand[idx]
            j = int(torch.argmax(v))          # first occurrence
            if bool(v[j] > best_v) or (bool(v[j] == best_v) and int(idx[j]) < best_i):
                best_v, best_i = float(v[j]), int(idx[j])
        pk, pi = best_v, best_i
        out.append(best_i)
    return torch.tensor(out)


@pytest.mark.parametrize("k", [4, 16])
def test_fallback_rounds_equal_stable_sort(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    for key in (torch.randint(0, 3, (128,), generator=g).float() / 4, torch.rand(128, generator=g),
                torch.full((128,), 0.5)):
        assert torch.equal(_rounds(key, k), _stable_topk(key, k))
