"""MLA `qkv_norm` folded into its two consumers (kernel name "mla_norm_fold"): the fused MLA
layer at M = 1 goes from 15 to 14 launches.

Stock (and the fused path before this) normalises both latent halves of qkv_a's output
a [M, ql + c + rope] in one op, `qkv_norm` (stock_triton.mla_norms: ~1.8 µs at B = 1 on the
H200, plus a launch gap), whose outputs qa [M, ql] and ckv [M, c] feed exactly one kernel each:
  qa  -> q_b_proj   (kernels/gemv.py GEMV, 144 CTAs)
  ckv -> uk_insert  (kernels/mla_glue.py, the cache insert of its head-0 CTAs)
Both consumers now read the raw halves of `a` and normalise themselves:
- gemv_rmsnorm (kernels/gemv.py, class GemvRMSNorm): every warp (one output column, the plain
  GEMV's layout) issues its whole weight row (K = 1536: 6 128-bit loads per lane), loads the
  same 6 slices of the q row that the plain kernel multiplies (strided view: row stride
  A = 2112), sums their squares, butterflies the sum (every lane gets Σx² of the whole 3 KB
  row, L2-resident), and multiplies its slices normalised and rounded to bf16. No shared
  memory, no barrier; at most 128 registers (2 CTAs per SM: all 144 CTAs resident at once).
- uk_insert_norm (kernels/mla_glue.py, GlueConfig.norm): warp w of every CTA loads row
  min(w, M-1) of a's c_kv part (c = 512: 2 vectors per lane) and butterflies Σx² (no branch
  around the shuffles); the head-0 CTAs then write their tile's 8 vectors of the normalised
  row (warp m < M, its lanes whose vectors fall in the tile) into the cache row pos + t.

Exact math (both halves, as stock_triton._mla_norms_kernel / stock_ops.mla_norms):
    ss   = Σ_k fp32(x_k)²                         fp32 (lane order, then a butterfly)
    rstd = rsqrt(ss / K + eps)                    cute.math.rsqrt (rsqrt.approx.f32)
    xn_k = bf16( (fp32(x_k) · rstd) · fp32(w_k) ) the stock rounding point: the normalised
                                                  activation in bf16, before the GEMV / cache
    q    = bf16( Σ_k fp32(xn_k) · fp32(W[n, k]) ) gemv_rmsnorm: the plain GEMV's summation
                                                  order (slice, element, then the butterfly)
Stock computes rstd as 1 / sqrt(mean + eps) with Triton's approximate sqrt/division (eager
torch: rsqrt) and sums in another order, so rstd may differ in its last fp32 bits; xn then
equals stock's qa / ckv bit for bit except where such a difference moves (x·rstd)·w across a
bf16 rounding boundary (one bf16 ulp there). Hence:
- ckv in the cache: within one bf16 ulp of stock's, bit-equal on ≥ 99% of elements, and bit
  for bit on inputs whose norm is exact (the check's "exact" case: x = ±2, so
  x·rstd = ±(1 - ~1e-6) and every product rounds to ±w); every other cache byte bit-equal;
- q: at M = 1 bit-identical to gemv(qa, q_b) whenever qa equals the kernel's xn (the
  "exact" case checks it against stock's qa); otherwise within the GEMV's documented tolerance
  against stock (checks.py: rel ≤ 1e-2, float64 error ≤ stock's × 1.5 + 1e-3) and within one
  bf16 rounding (rel ≤ 2⁻⁸) of gemv(stock qa);
- q_full: bit-equal to the verified uk_insert run on the new q (the W_UK part is unchanged).

Why it should be faster (an expectation; the check times it): the launch of qkv_norm and its
gap go (~1.8 µs kernel + ~1 µs gap in the step trace); the GEMV's extra work is one more
3 KB L2 read per warp and 5 shuffles + one rsqrt before its first FMA, which overlap the
weight row already in flight (3.5 MB of q_b: ~1 µs of HBM time, the kernel ~3.4 µs, latency
bound); uk_insert's 48 CTAs each add 1 KB of L2 reads and 5 shuffles beside the W_UK loads.
Expected at M = 1 (trace figures, not measured for the new kernels): old = 1.8 (norm) + 3.4
(q_b) + 2.5 (uk_insert) = 7.7 µs plus one more launch gap; new ≈ (3.4 + ~0.3 for the x row's
L2 round trip and 5 shuffles before the first FMA) + (2.5 + ~0.1) ≈ 6.3 µs, i.e. ~1.4 µs
and one launch gap (~1 µs in the step) less per MLA layer; the check times both.
Measured (H200, check at 801b1da, bench/fused_correctness.md; CUDA-graph replays, cold
weights): M = 1 6.35 µs vs 7.49 for qkv_norm + q_b + uk_insert (stock's four ops 17.4); q equal
to gemv(stock qa) bit for bit and the cache equal to stock's; at M = 8 17.2 vs 10.4 µs, so the
per-M table keeps M = 1.

Check on the GPU (against stock's mla_norms (the Triton op of the compiled stock step, and
the eager torch op) + the q_b GEMV + the verified uk_insert; float64 reference; times old
and new in CUDA graphs on cold weights):
    python -m kimi_decode.kernels.mla_norm_fold
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

import itertools
from collections.abc import Callable

import torch

ONE_ULP_REL = 2.0 ** -8      # one bf16 rounding, relative
COLD_COPIES = 16             # 16 × (q_b 3.5 MB + w_uk_t 0.75 MB) = 68 MB, beyond the 50 MB L2


def bf16_ulps(x: torch.Tensor, y: torch.Tensor) -> int:
    """Largest distance between x and y in bf16 ulps (adjacent values of one sign differ by
    1 in their 16-bit patterns; a sign change counts as far)."""
    xi = x.contiguous().view(torch.int16).int()
    yi = y.contiguous().view(torch.int16).int()
    return int((xi - yi).abs().max()) if x.numel() else 0


def make_inputs(m: int, dev: torch.device, gen: torch.Generator, exact: bool, spec: int = 0) -> dict:
    """K3 TP16 MLA operands at M = m rows, T = 1 + spec tokens per sequence (B = m / T).
    `exact`: a's two latent halves are ±2 (random signs), so both RMSNorms are exact in bf16
    whatever rstd's last bits."""
    from kimi_decode.config import k3_tp16
    cfg = k3_tp16(batch=m // (1 + spec), spec_tokens=spec)
    H, nope, rope, c, ql = cfg.mla_local_heads, cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.kv_lora_rank, cfg.q_lora_rank
    A = cfg.qkv_a_rows
    rnd = lambda *s, sc=1.0: (torch.randn(*s, generator=gen, device=dev) * sc).bfloat16()  # noqa: E731
    a = rnd(m, A, sc=3.0)
    if exact:
        signs = torch.randint(0, 2, (m, ql + c), generator=gen, device=dev) * 2 - 1
        a[:, :ql + c] = (2.0 * signs).bfloat16()
    return dict(cfg=cfg, a=a, q_norm=(1.0 + 0.1 * torch.randn(ql, generator=gen, device=dev)).bfloat16(),
                kv_norm=(1.0 + 0.1 * torch.randn(c, generator=gen, device=dev)).bfloat16(),
                q_b=rnd(H * (nope + rope), ql, sc=ql ** -0.5), w_uk_t=rnd(H, nope, c, sc=c ** -0.5),
                cache=rnd(cfg.batch, cfg.cache_len, c + rope), pos=cfg.context_len + 3)


def check(timing: bool = True, rows: tuple[int, ...] = (1, 8), *, kernel: str = "mla_norm_fold",
          specs: tuple[int, ...] = ()) -> list[dict]:
    """The q projection with the RMSNorm prologue (kernel "mla_norm_fold": gemv_rmsnorm;
    "mla_norm_fold_mma": gemv_mma.gemv_mma_rmsnorm) + uk_insert_norm against stock's mla_norms +
    the q_b projection the fused path runs without it (the GEMV at M = 1, else gemv_mma for
    the mma kernel and stock's GEMM for the GEMV one) + uk_insert, at the K3 TP16 shapes, M in
    `rows` with T = 1, and M = 1 + k (B = 1, T = 1 + k) for each k in `specs`; on random
    ("random") and norm-exact ("exact") inputs; the gates are the module docstring's. With
    timing (random inputs): old (norm + q_b projection + uk_insert, the fused path without the
    kernel) vs new (2 launches), and stock's four ops, in CUDA graphs cycling COLD_COPIES weight
    copies."""
    from kimi_decode import stock_ops
    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels import checks
    from kimi_decode.kernels import gemv as k_gemv
    from kimi_decode.kernels import gemv_mma as k_mma
    from kimi_decode.kernels import mla_glue as glue
    dev = torch.device(checks.DEVICE)
    mma = kernel == "mla_norm_fold_mma"
    out = []
    for m, spec in [(m, 0) for m in rows] + [(1 + k, k) for k in specs]:
        for case in ("random", "exact"):
            gen = torch.Generator(device=dev).manual_seed(3000 + 10 * m + 1000 * spec + (case == "exact"))
            d = make_inputs(m, dev, gen, case == "exact", spec)
            cfg = d["cfg"]
            H, nope, rope, c, ql = cfg.mla_local_heads, cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.kv_lora_rank, cfg.q_lora_rank
            T, eps, A = cfg.tokens_per_seq, cfg.rms_eps, cfg.qkv_a_rows
            a, qn, kvn, q_b, w_uk_t, cache0 = d["a"], d["q_norm"], d["kv_norm"], d["q_b"], d["w_uk_t"], d["cache"]
            pos_i = d["pos"]
            pos = torch.tensor([pos_i], dtype=torch.int64, device=dev)
            # Triton mla_norms on the GPU
            ops = stock_ops.OpSet(k3_tp16(batch=cfg.batch, spec_tokens=spec, compile_ops=True))
            eager = stock_ops.OpSet(cfg)

            def q_gemm(qa: torch.Tensor, w: torch.Tensor = q_b) -> torch.Tensor:
                """The fused path's q_b_proj without the kernel: GEMV at M = 1, gemv_mma above
                (the mma kernel's), else stock's GEMM."""
                if m <= k_gemv.GEMV_MAX_ROWS:
                    return k_gemv.gemv(qa, w)
                return k_mma.gemv_mma(qa, w) if mma else ops.linear(qa, w)

            def q_norm_proj(w: torch.Tensor = q_b) -> torch.Tensor:
                """The kernel under check: the q projection with the RMSNorm prologue."""
                if mma:
                    return k_mma.gemv_mma_rmsnorm(a, qn, w, ql, eps)
                return k_gemv.gemv_rmsnorm(a, qn, w, ql, eps)

            cache_s, cache_k, cache_u = cache0.clone(), cache0.clone(), cache0.clone()
            with torch.no_grad():
                qa_s, ckv_s = ops.mla_norms(a, qn, kvn, ql, c, eps)
                qa_e, ckv_e = eager.mla_norms(a, qn, kvn, ql, c, eps)
                q_s = q_gemm(qa_s)
                q_t = qa_s @ q_b.t()                                     # torch's matmul (checks.py's stock)
                qf_s = glue.stock_uk(q_s.reshape(m, H, nope + rope), a, ckv_s, w_uk_t, cache_s, pos, T, ql + c, eager)
                q_k = q_norm_proj()
                qf_k = glue.uk_insert_norm(q_k.reshape(m, H, nope + rope), a, kvn, eps, w_uk_t, cache_k, pos, T,
                                           ql + c, ql)
                # the verified uk_insert on the new q: the W_UK part must be bit-equal
                qf_u = glue.uk_insert(q_k.reshape(m, H, nope + rope), a, ckv_s, w_uk_t, cache_u, pos, T, ql + c)
            checks._sync()
            ref_qa = k_gemv.reference_rmsnorm(a[:, :ql], qn, eps)
            ref_q = ref_qa @ q_b.double().t()
            rows_k = cache_k[:, pos_i:pos_i + T, :c].reshape(m, c)
            rest_k = cache_k.clone()
            rest_k[:, pos_i:pos_i + T, :c] = cache_s[:, pos_i:pos_i + T, :c]
            r = {"kernel": kernel, "case": case, "M": m, "k": spec,
                 "rel_vs_stock": checks.rel(q_k, q_t), "rel_vs_f64": checks.rel(q_k, ref_q),
                 "stock_rel_vs_f64": checks.rel(q_t, ref_q), "rel_vs_gemv_stock_qa": checks.rel(q_k, q_s),
                 "q_equal_gemv_stock_qa": torch.equal(q_k, q_s),
                 "ckv_max_ulps_vs_stock": bf16_ulps(rows_k, ckv_s),
                 "ckv_max_ulps_vs_eager": bf16_ulps(rows_k, ckv_e),
                 "ckv_bits_equal_stock": float((rows_k == ckv_s).float().mean()),
                 "stock_qa_equal_eager": float((qa_s == qa_e).float().mean()),
                 "cache_rest_equal_stock": torch.equal(rest_k, cache_s),
                 "q_full_equal_uk_insert": torch.equal(qf_k, qf_u),
                 "rel_q_full_vs_stock": checks.rel(qf_k, qf_s)}
            ok = (tuple(q_k.shape) == (m, H * (nope + rope)) and bool(torch.isfinite(q_k).all())
                  and r["rel_vs_stock"] <= 1e-2 and r["rel_vs_f64"] <= 1.5 * r["stock_rel_vs_f64"] + 1e-3
                  and r["rel_vs_gemv_stock_qa"] <= ONE_ULP_REL
                  and r["ckv_max_ulps_vs_stock"] <= 1 and r["ckv_bits_equal_stock"] >= 0.99
                  and r["cache_rest_equal_stock"] and r["q_full_equal_uk_insert"] and r["rel_q_full_vs_stock"] <= 1e-2)
            if case == "exact":
                # the norms are exact: qa and ckv equal stock's bit for bit, so q equals the
                # GEMV on stock's qa (M = 1: same kernel layout and order) and the cache stock's
                ok = ok and r["ckv_bits_equal_stock"] == 1.0 and torch.equal(cache_k, cache_s)
                if m <= k_gemv.GEMV_MAX_ROWS or mma:
                    ok = ok and r["q_equal_gemv_stock_qa"]
            r["ok"] = bool(ok)
            if timing and case == "random":
                r.update(time_paths(d, ops, q_gemm, q_norm_proj, dev))
            out.append(r)
    return out


def time_paths(d: dict, ops: object, q_gemm: Callable, q_norm_proj: Callable, dev: torch.device) -> dict:
    """old (qkv_norm + q_gemm + uk_insert), new (q_norm_proj, the kernel, + uk_insert_norm) and
    stock (mla_norms + GEMM + bmm + kv_insert), each cycling COLD_COPIES copies of (q_b, w_uk_t)."""
    from kimi_decode import stock_ops
    from kimi_decode.kernels import checks
    from kimi_decode.kernels import gemv as k_gemv
    from kimi_decode.kernels import mla_glue as glue
    cfg = d["cfg"]
    H, nope, rope, c, ql = cfg.mla_local_heads, cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.kv_lora_rank, cfg.q_lora_rank
    T, eps = cfg.tokens_per_seq, cfg.rms_eps
    a, qn, kvn, cache = d["a"], d["q_norm"], d["kv_norm"], d["cache"].clone()
    m = a.shape[0]
    pos = torch.tensor([d["pos"]], dtype=torch.int64, device=dev)
    sets = [(d["q_b"], d["w_uk_t"])] + [(d["q_b"].clone(), d["w_uk_t"].clone()) for _ in range(COLD_COPIES - 1)]
    eager = stock_ops.OpSet(cfg)

    def old() -> object:
        q_b, w_uk_t = next(cyc)
        qa, ckv = ops.mla_norms(a, qn, kvn, ql, c, eps)
        q = q_gemm(qa, q_b).reshape(m, H, nope + rope)
        return glue.uk_insert(q, a, ckv, w_uk_t, cache, pos, T, ql + c)

    def new() -> object:
        q_b, w_uk_t = next(cyc)
        q = q_norm_proj(q_b).reshape(m, H, nope + rope)
        return glue.uk_insert_norm(q, a, kvn, eps, w_uk_t, cache, pos, T, ql + c, ql)

    def stock() -> object:
        q_b, w_uk_t = next(cyc)
        qa, ckv = ops.mla_norms(a, qn, kvn, ql, c, eps)
        q = ops.linear(qa, q_b).reshape(m, H, nope + rope)
        return glue.stock_uk(q, a, ckv, w_uk_t, cache, pos, T, ql + c, eager)

    res = {}
    for name, fn in (("old_us", old), ("kernel_us", new), ("stock_us", stock)):
        cyc = itertools.cycle(sets)
        res[name] = checks.time_us(fn)
    cyc = itertools.cycle(sets[:1])
    res["old_hot_us"] = checks.time_us(old)
    cyc = itertools.cycle(sets[:1])
    res["kernel_hot_us"] = checks.time_us(new)
    return res


def check_mma(timing: bool = True) -> list[dict]:
    """The device check of kernel "mla_norm_fold_mma": check() with gemv_mma's RMSNorm prologue
    at the shapes the fused step would run it: M = 2 and 8 with T = 1 (B = 2, 8) and B = 1 with
    k = 7 (M = 8, T = 8)."""
    return check(timing, rows=(2, 8), kernel="mla_norm_fold_mma", specs=(7,))


if __name__ == "__main__":
    import sys

    from kimi_decode.kernels.checks import _print
    _print(check_mma() if sys.argv[1:] == ["mma"] else check())
