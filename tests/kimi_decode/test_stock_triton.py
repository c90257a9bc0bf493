"""The stock path's Triton kernels against the torch functions they stand for (stock_ops.py).

Oracle: each torch function of stock_ops is the definition; the kernel must give the same
numbers on random inputs of small shapes (odd sizes, padding, several rows per expert). Runs
on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py before
triton is imported), so it needs the `triton` package (a test dependency): skipped where it is
not installed, except under CI (the device job runs the same comparison on the GPU at the real
shapes). Tolerances: fp32 inputs, so differences are summation
order only (1e-5 relative); the bf16 AttnRes case allows one bf16 rounding of the output (1e-2).
"""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("CI"):
    import triton  # noqa: F401  (a test dependency: CI must run these, not skip them)
triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # imported earlier without the interpreter
    if os.environ.get("CI"):   # tests/conftest.py sets it first; under CI a skip would hide these
        raise RuntimeError("TRITON_INTERPRET is not 1 under CI: the Triton tests would not run")
    pytest.skip("triton already imported without TRITON_INTERPRET=1", allow_module_level=True)

from kimi_decode import stock_ops as ops  # noqa: E402
from kimi_decode import stock_triton as kt  # noqa: E402


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    a, b = a.double(), b.double()
    err = float((a - b).norm() / b.norm().clamp_min(1e-30))
    assert err < tol, err


@pytest.mark.parametrize("M,N,K", [(1, 40, 70), (5, 33, 256), (20, 48, 100)])
def test_skinny_mm(M, N, K):
    g = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K + 3, generator=g)[:, 2:K + 2]          # strided rows, as z slices are
    w = torch.randn(N, K, generator=g)
    close(kt.skinny_mm(x, w), x @ w.t(), 1e-5)
    add = torch.randn(M, N, generator=g)
    nw = torch.rand(K, generator=g) + 0.5
    ref = ops.latent_up(x, nw, w, add, 1e-5)
    close(kt.skinny_mm(x, w, add=add, norm_w=nw, eps=1e-5), ref, 1e-5)
    # (bf16 tl.dot is not emulated by the interpreter: bf16 GEMMs are checked on the device)


@pytest.mark.parametrize("nb,reset", [(0, False), (3, False), (2, True)])
def test_attn_res(nb, reset):
    g = torch.Generator().manual_seed(nb)
    M, S, D = 3, 5, 1500
    base, delta = torch.randn(M, D, generator=g), torch.randn(M, D, generator=g)
    blocks = torch.randn(M, S, D, generator=g)
    w, norm = torch.randn(D, generator=g) * 0.05, torch.rand(D, generator=g) + 0.5
    p, x = kt.attn_res(base, delta, blocks, w, norm, 1e-5, nb, reset)
    rp, rx = ops.res_mix(base, delta, blocks, w, norm, 1e-5, nb, reset)
    close(p, rp, 1e-6)
    close(x, rx, 1e-5)
    bf = [t.bfloat16() for t in (base, delta, blocks)]
    p, x = kt.attn_res(*bf, w, norm, 1e-5, nb, reset)
    rp, rx = ops.res_mix(*bf, w, norm, 1e-5, nb, reset)
    close(p, rp, 1e-2)      # within one bf16 step (the interpreter truncates fp32 -> bf16)
    close(x, rx, 1e-2)


@pytest.mark.parametrize("B,T", [(2, 1), (1, 3)])
def test_conv_update(B, T):
    g = torch.Generator().manual_seed(B * 10 + T)
    C, R = 300, 310
    state = torch.randn(B, C, 3, generator=g)
    z = torch.randn(B * T, R, generator=g)
    w = torch.randn(C, 4, generator=g)
    ref_act, ref_state = ops.conv_update(state.clone(), z[:, :C], w, B)
    act = kt.conv_update_(state, z[:, :C], w, B)
    close(act, ref_act, 1e-6)
    close(state, ref_state, 1e-7)


@pytest.mark.parametrize("B,T", [(2, 1), (1, 3)])
def test_kda_recurrence(B, T):
    g = torch.Generator().manual_seed(B + 7 * T)
    H, d = 2, 16
    P = H * d
    act = torch.randn(B, T, 3 * P, generator=g)
    z = torch.randn(B * T, P + H + 5, generator=g)
    f_b, beta_in = z[:, :P], z[:, P + 1:P + 1 + H]
    dt_bias, a_log = torch.randn(P, generator=g) * 0.5, torch.rand(H, generator=g) * 2
    state = torch.randn(B, H, d, d, generator=g) * 0.1
    ro, rs = ops.kda_recurrence(act, f_b, beta_in, dt_bias, a_log, state.clone(), -5.0, H)
    o = kt.kda_recurrence_(act, f_b, beta_in, dt_bias, a_log, state, -5.0, H)
    close(o, ro, 1e-5)
    close(state, rs, 1e-5)


def test_route():
    g = torch.Generator().manual_seed(3)
    logits, bias = torch.randn(5, 40, generator=g), torch.randn(40, generator=g) * 0.1
    ri, rw = ops.route(logits, bias, 6, 2.5)
    idx, w = kt.route(logits, bias, 6, 2.5)
    assert torch.equal(idx, ri)
    close(w, rw, 1e-6)


@pytest.mark.parametrize("M", [1, 7])
def test_experts(M):
    """7 rows x top-4 of 6 experts: experts hold several rows, some none (empty segments)."""
    g = torch.Generator().manual_seed(M)
    E, K, L, I = 6, 4, 40, 24
    z = torch.randn(M, L, generator=g)
    idx = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(M)])  # expert 5 unused
    w = torch.rand(M, K, generator=g)
    w13, w2 = torch.randn(E, 2 * I, L, generator=g) * 0.3, torch.randn(E, L, I, generator=g) * 0.3
    ref_e = ops.expert_outputs_gathered(z, idx, w13, w2, 4.0, 25.0)
    close(kt.expert_outputs(z, idx, w13, w2, 4.0, 25.0), ref_e, 1e-5)
    close(kt.experts(z, idx, w, w13, w2, 4.0, 25.0), ops.experts_gathered(z, idx, w, w13, w2, 4.0, 25.0), 1e-5)


def padded_experts(g: torch.Generator, E: int, L: int, I: int, Ip: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2·Ip, L] and w2 [E, L, Ip] with zero rows / columns I..Ip-1, as stock.LatentMoE
    pads them at TP16."""
    w13, w2 = torch.zeros(E, 2 * Ip, L), torch.zeros(E, L, Ip)
    w13[:, :I] = torch.randn(E, I, L, generator=g) * 0.3
    w13[:, Ip:Ip + I] = torch.randn(E, I, L, generator=g) * 0.3
    w2[:, :, :I] = torch.randn(E, L, I, generator=g) * 0.3
    return w13, w2


@pytest.mark.parametrize("M", [1, 9])
def test_experts_unpadded_and_fast_align(M):
    """The fused path's large-M experts: `inter` skips the zero padding and `fast_align` sorts
    with atomics. Oracle: the same kernels reading the padding with the stable sort, bit for
    bit (every skipped term is an exact zero; a row's result does not depend on its place in
    its expert's run), and the torch definition. 9 rows x top-4 of 7 experts: runs of several
    rows, one unused expert. A wrong up-row offset (the unpadded width instead of the padded
    half) reads gate padding and fails both."""
    g = torch.Generator().manual_seed(20 + M)
    E, K, L, I, Ip = 7, 4, 40, 24, 32
    z = torch.randn(M, L, generator=g)
    idx = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(M)])
    w = torch.rand(M, K, generator=g)
    w13, w2 = padded_experts(g, E, L, I, Ip)
    base = kt.experts(z, idx, w, w13, w2, 4.0, 25.0)
    close(base, ops.experts_gathered(z, idx, w, w13, w2, 4.0, 25.0), 1e-5)
    for inter, fast in [(I, False), (None, True), (I, True)]:
        got = kt.experts(z, idx, w, w13, w2, 4.0, 25.0, inter=inter, fast_align=fast)
        assert torch.equal(got, base), (inter, fast)
    out = torch.full((M, L), float("nan"))
    assert kt.experts(z, idx, w, w13, w2, 4.0, 25.0, inter=I, fast_align=True, out=out) is out
    assert torch.equal(out, base)


def test_align_atomic_segments():
    """_moe_align_atomic_kernel against a brute-force grouping of the pairs by expert: the same
    segments (expert, first place, count) in expert order, and each run holding exactly that
    expert's pairs (in any order)."""
    g = torch.Generator().manual_seed(5)
    M, K, E = 13, 5, 11
    idx = torch.stack([torch.randperm(E - 2, generator=g)[:K] for _ in range(M)]).to(torch.int64).contiguous()
    P = M * K
    sorted_pairs = torch.empty(P, dtype=torch.int32)
    seg = torch.empty(min(E, P), 3, dtype=torch.int32)
    nseg, starts = torch.empty(1, dtype=torch.int32), torch.empty(E, dtype=torch.int32)
    kt._moe_align_atomic_kernel[(1,)](idx, sorted_pairs, seg, nseg, starts, P, E, BLOCK_P=kt._pow2(P),
                                      BLOCK_E=kt._pow2(E + 1), num_warps=8)
    flat = idx.flatten().tolist()
    want, first = [], 0
    for e in range(E):
        pairs = [p for p, x in enumerate(flat) if x == e]
        if pairs:
            want.append((e, first, len(pairs), sorted(pairs)))
            first += len(pairs)
    assert int(nseg) == len(want)
    for (e, f, c, pairs), row in zip(want, seg[:len(want)].tolist()):
        assert row == [e, f, c]
        assert sorted(sorted_pairs[f:f + c].tolist()) == pairs


def test_mla_norms():
    g = torch.Generator().manual_seed(11)
    a = torch.randn(3, 70, generator=g)[:, 2:62]                   # q 40 + kv 12 + rope 8
    qw, kvw = torch.rand(40, generator=g) + 0.5, torch.rand(12, generator=g) + 0.5
    for got, want in zip(kt.mla_norms(a, qw, kvw, 40, 12, 1e-5), ops.mla_norms(a, qw, kvw, 40, 12, 1e-5)):
        close(got, want, 1e-6)


@pytest.mark.parametrize("B,T", [(2, 1), (1, 3)])
def test_kv_insert(B, T):
    """Oracle: the torch path of OpSet.kv_insert (cat + index_copy_ at pos .. pos+T-1)."""
    g = torch.Generator().manual_seed(B + T)
    M, H, c, rope, nope, ql = B * T, 3, 16, 8, 8, 20
    q_lat = torch.randn(H, M, c, generator=g).transpose(0, 1)      # bmm output, transposed view
    q = torch.randn(M, H, nope + rope, generator=g)
    ckv = torch.randn(M, c, generator=g)
    a = torch.randn(M, ql + c + rope, generator=g)
    cache = torch.randn(B, 12, c + rope, generator=g)
    pos = torch.tensor([5])
    from kimi_decode.config import tiny
    torch_ops = ops.OpSet(tiny())                                  # compile_ops off: the torch path
    want_cache = cache.clone()
    want = torch_ops.kv_insert(q_lat, q, ckv, a, ql + c, want_cache, pos, T)
    got = kt.kv_insert(q_lat, q, ckv, a, ql + c, cache, pos, T)
    assert torch.equal(got, want) and torch.equal(cache, want_cache)


@pytest.mark.parametrize("spec", [0, 3])
def test_tiny_model_with_kernels_matches_reference(monkeypatch, spec):
    """The whole tiny stock step (fp32, 5 layers: dense, KDA, MLA; 2 steps, state included) with
    every Triton op group, against the float64 reference: same bar as the torch path (1e-4)."""
    from kimi_decode.config import tiny
    from kimi_decode.stock import StockDecoder
    from tests.kimi_decode.k3_reference import Reference

    monkeypatch.setattr(ops.OpSet, "force_triton", True)
    model = StockDecoder(tiny(batch=2, spec_tokens=spec))
    assert model.layers[1].attn.k.triton == set(ops.TRITON_OPS)
    ref = Reference(model)
    for s in range(2):
        m, prefix, blocks = model.make_inputs(seed=5 + s)
        r_m, r_prefix, r_blocks = ref.step(m, prefix, blocks)
        with torch.no_grad():
            o_m, o_prefix = model(m, prefix, blocks)
        for a, b in ((o_m, r_m), (o_prefix, r_prefix), (blocks, r_blocks)):
            close(a, b, 1e-4)
    for layer, (_, _, _, st) in zip(model.layers, ref.layers):
        for name, buf in layer.named_buffers():
            close(buf, st[name], 1e-4)


@pytest.mark.parametrize("given", [None, False, True])
def test_stock_experts_sort_as_vllm(monkeypatch, given):
    """stock_ops.OpSet.experts: stock's call (no keyword) takes the O(P) sort with atomic places
    (STOCK_FAST_ALIGN, vLLM's count_and_sort method), a caller's explicit choice is passed
    through; and the outputs are the stable sort's bit for bit, so only the time changes."""
    from kimi_decode.config import tiny
    monkeypatch.setattr(ops.OpSet, "force_triton", True)
    opset = ops.OpSet(tiny(batch=3))
    assert "experts" in opset.triton and ops.STOCK_FAST_ALIGN is True
    seen: list[bool] = []
    original = kt.experts

    def recording(*a, **kw):
        seen.append(kw["fast_align"])
        return original(*a, **kw)
    monkeypatch.setattr(kt, "experts", recording)
    g = torch.Generator().manual_seed(31)
    E, K, L, I, Ip, M = 7, 4, 40, 24, 32, 9
    z = torch.randn(M, L, generator=g)
    idx = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(M)])
    w = torch.rand(M, K, generator=g)
    w13, w2 = padded_experts(g, E, L, I, Ip)
    got = opset.experts(z, idx, w, w13, w2, 4.0, 25.0) if given is None else \
        opset.experts(z, idx, w, w13, w2, 4.0, 25.0, fast_align=given)
    assert seen == [True if given is None else given]
    assert torch.equal(got, original(z, idx, w, w13, w2, 4.0, 25.0, fast_align=False))
