"""Triton kernels of the stock path: one kernel per op where stock vLLM issues one.

Stock vLLM issues these ops as Triton kernels (AttnRes, causal_conv1d_update, the recurrent KDA
fallback at 6 heads, the routing) or as one skinny-GEMM kernel per projection (KIMI_K3.md §2.4);
inductor cannot reach one kernel for them (a top-k, a sort, a split-K cuBLAS GEMM), so they are
written here. Each computes exactly the torch function of stock_ops.py it stands for (same
formula, same bf16 roundings where the torch op rounds); `stock_ops.Kernels` picks one or the
other, and the device job checks them against each other at the real shapes.

Needs triton; runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (tests). All wrappers take
and return torch tensors; decode state is updated in place.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(n)))


# --- skinny GEMM: out[M, N] = prologue(x)[M, K] @ w[N, K]^T (+ add), no split-K ---------------

@triton.jit
def _skinny_mm_kernel(x_ptr, w_ptr, out_ptr, add_ptr, normw_ptr, M, N, K,
                      stride_xm, stride_wn, stride_om, stride_am, eps,
                      HAS_ADD: tl.constexpr, HAS_NORM: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One CTA per BLOCK_N output columns (and BLOCK_M rows): the whole K loop in the CTA, so
    one kernel and no reduce. HAS_NORM: rows of x are RMS-normalised (weight normw) first;
    HAS_ADD: the dtype-rounded product plus `add`, rounded again (as `x @ w.t() + add`)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < N
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if HAS_NORM:
        ss = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                         mask=mmask[:, None] & (rk[None, :] < K), other=0.0).to(tl.float32)
            ss += tl.sum(xv * xv, 1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        if HAS_NORM:
            nw = tl.load(normw_ptr + rk, mask=kmask, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * rstd[:, None] * nw[None, :]).to(w.dtype)
        acc += tl.dot(w, tl.trans(x.to(w.dtype)))
    y = tl.trans(acc)                                                            # [BLOCK_M, BLOCK_N]
    omask = mmask[:, None] & nmask[None, :]
    out_t = out_ptr.dtype.element_ty
    if HAS_ADD:
        a = tl.load(add_ptr + rm[:, None] * stride_am + rn[None, :], mask=omask, other=0.0).to(tl.float32)
        y = (y.to(out_t).to(tl.float32) + a)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], y.to(out_t), mask=omask)


def skinny_mm_config(M: int, N: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): the fewest rows that cover M. Up to 16 rows, the narrowest
    column block (16) unless N gives two CTAs per SM (132 on H200) anyway, and long K steps
    (512: many weight bytes in flight per CTA). Past 16 rows every CTA re-reads the rows of x
    from L2, so columns go 32 wide to halve that traffic."""
    bm = min(_pow2(M), 64)
    if bm <= 16:
        return bm, (64 if N >= 64 * 264 else 32 if N >= 32 * 264 else 16), 512
    return bm, 32, 128


def skinny_mm(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
              add: torch.Tensor | None = None, norm_w: torch.Tensor | None = None,
              eps: float = 0.0) -> torch.Tensor:
    """x [M, K] (unit column stride) @ w[N, K]^T in one kernel; see _skinny_mm_kernel."""
    M, K = x.shape
    N = w.shape[0]
    assert x.stride(1) == 1 and w.stride(1) == 1 and w.shape[1] == K
    out = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    bm, bn, bk = skinny_mm_config(M, N)
    if add is not None:
        assert add.shape == (M, N) and add.stride(1) == 1
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm))
    _skinny_mm_kernel[grid](x, w, out, add if add is not None else out, norm_w if norm_w is not None else w,
                            M, N, K, x.stride(0), w.stride(0), out.stride(0),
                            add.stride(0) if add is not None else 0, eps,
                            HAS_ADD=add is not None, HAS_NORM=norm_w is not None,
                            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=4)
    return out


# --- AttnRes: prefix update + softmax mix over raw sources + RMSNorm, one kernel -------------

@triton.jit
def _attn_res_kernel(base_ptr, delta_ptr, blocks_ptr, w_ptr, norm_ptr, prefix_ptr, out_ptr,
                     D, stride_row, stride_bm, stride_bs, nb, eps,
                     RESET: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """One CTA per row. Pass 1: the score of each source (blocks[:nb], then the new prefix,
    which it writes) = rsqrt(mean(x²)+eps)·Σ x·w; softmax. Pass 2: Σ mix² for the final
    RMSNorm. Pass 3: mix·rstd·norm, stored. Sources are re-read (they stay in L1/L2)."""
    m = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    scores = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s in range(0, nb):
        ss = tl.zeros([BLOCK_D], tl.float32)
        sw = tl.zeros([BLOCK_D], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            mask = offs < D
            x = tl.load(blocks_ptr + m * stride_bm + s * stride_bs + offs, mask=mask, other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + offs, mask=mask, other=0.0)
            ss += x * x
            sw += x * wv
        score = tl.sum(sw, 0) / tl.sqrt(tl.sum(ss, 0) / D + eps)
        scores = tl.where(offs_s == s, score, scores)
    ss = tl.zeros([BLOCK_D], tl.float32)
    sw = tl.zeros([BLOCK_D], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        mask = offs < D
        x = _prefix_src(base_ptr, delta_ptr, m * stride_row + offs, mask, RESET)
        tl.store(prefix_ptr + m * D + offs, x.to(prefix_ptr.dtype.element_ty), mask=mask)
        wv = tl.load(w_ptr + offs, mask=mask, other=0.0)
        ss += x * x
        sw += x * wv
    score = tl.sum(sw, 0) / tl.sqrt(tl.sum(ss, 0) / D + eps)
    scores = tl.where(offs_s == nb, score, scores)
    e = tl.exp(scores - tl.max(scores, 0))
    prob = e / tl.sum(e, 0)
    p_last = tl.sum(tl.where(offs_s == nb, prob, 0.0), 0)
    msq = tl.zeros([BLOCK_D], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        mask = offs < D
        mix = _prefix_src(base_ptr, delta_ptr, m * stride_row + offs, mask, RESET) * p_last
        for s in range(0, nb):
            ps = tl.sum(tl.where(offs_s == s, prob, 0.0), 0)
            mix += ps * tl.load(blocks_ptr + m * stride_bm + s * stride_bs + offs, mask=mask, other=0.0).to(tl.float32)
        msq += mix * mix
    rstd = 1.0 / tl.sqrt(tl.sum(msq, 0) / D + eps)
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        mask = offs < D
        mix = _prefix_src(base_ptr, delta_ptr, m * stride_row + offs, mask, RESET) * p_last
        for s in range(0, nb):
            ps = tl.sum(tl.where(offs_s == s, prob, 0.0), 0)
            mix += ps * tl.load(blocks_ptr + m * stride_bm + s * stride_bs + offs, mask=mask, other=0.0).to(tl.float32)
        nw = tl.load(norm_ptr + offs, mask=mask, other=0.0)
        tl.store(out_ptr + m * D + offs, (mix * rstd * nw).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _prefix_src(base_ptr, delta_ptr, offs, mask, RESET: tl.constexpr):
    """The new prefix (delta, or base + delta rounded to delta's dtype) as fp32."""
    p = tl.load(delta_ptr + offs, mask=mask, other=0.0)
    if not RESET:
        p = (tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32)
             + p.to(tl.float32)).to(delta_ptr.dtype.element_ty)
    return p.to(tl.float32)


def attn_res(base: torch.Tensor, delta: torch.Tensor, blocks: torch.Tensor, w: torch.Tensor,
             norm: torch.Tensor, eps: float, nb: int, reset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefix, RMSNorm(mix)) of stock_ops.res_mix in one kernel."""
    M, D = delta.shape
    assert delta.is_contiguous() and base.is_contiguous() and blocks.stride(2) == 1
    prefix = torch.empty_like(delta)
    out = torch.empty_like(delta)
    _attn_res_kernel[(M,)](base, delta, blocks, w, norm, prefix, out, D, delta.stride(0), blocks.stride(0),
                           blocks.stride(1), nb, eps, RESET=reset, BLOCK_D=1024,
                           BLOCK_S=_pow2(nb + 1, 2), num_warps=4)
    return prefix, out


# --- causal conv1d update (width 4) + SiLU, state in place -----------------------------------

@triton.jit
def _conv_kernel(state_ptr, qkv_ptr, w_ptr, act_ptr, C, stride_qm,
                 T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Grid (B, C blocks). y_t = Σ_j w_j·full[t + j] over full = [state(3), new(T)], SiLU;
    the state keeps the last three raw inputs."""
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = c < C
    st = state_ptr + (b * C + c) * 3
    x0 = tl.load(st, mask=mask, other=0.0)
    x1 = tl.load(st + 1, mask=mask, other=0.0)
    x2 = tl.load(st + 2, mask=mask, other=0.0)
    w0 = tl.load(w_ptr + c * 4, mask=mask, other=0.0)
    w1 = tl.load(w_ptr + c * 4 + 1, mask=mask, other=0.0)
    w2 = tl.load(w_ptr + c * 4 + 2, mask=mask, other=0.0)
    w3 = tl.load(w_ptr + c * 4 + 3, mask=mask, other=0.0)
    for t in tl.static_range(T):
        row = b * T + t
        x = tl.load(qkv_ptr + row * stride_qm + c, mask=mask, other=0.0)
        y = (x0.to(tl.float32) * w0 + x1.to(tl.float32) * w1 + x2.to(tl.float32) * w2
             + x.to(tl.float32) * w3)
        tl.store(act_ptr + row * C + c, y * tl.sigmoid(y), mask=mask)
        x0, x1, x2 = x1, x2, x.to(x0.dtype)
    tl.store(st, x0, mask=mask)
    tl.store(st + 1, x1, mask=mask)
    tl.store(st + 2, x2, mask=mask)


def conv_update_(conv_state: torch.Tensor, qkv: torch.Tensor, conv_w: torch.Tensor, batch: int) -> torch.Tensor:
    """stock_ops.conv_update with the state updated in place; returns act [B, T, C] fp32."""
    B, C, width = conv_state.shape
    assert width == 3 and conv_w.shape == (C, 4) and conv_state.is_contiguous() and qkv.stride(1) == 1
    T = qkv.shape[0] // batch
    act = torch.empty(B, T, C, dtype=torch.float32, device=qkv.device)
    _conv_kernel[(B, triton.cdiv(C, 256))](conv_state, qkv, conv_w, act, C, qkv.stride(0), T=T,
                                          BLOCK_C=256, num_warps=4)
    return act


# --- recurrent KDA (L2 norm, gate, β, delta-rule update, output), state in place -------------

@triton.jit
def _kda_kernel(act_ptr, fb_ptr, beta_ptr, dtb_ptr, alog_ptr, s_ptr, o_ptr,
                stride_fb, stride_beta, P, lower_bound, q_scale,
                T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BV: tl.constexpr):
    """Grid (B, H, D/BV): the fp32 state block S[:, value block] in registers, T tokens in turn:
    S ← S·e^g (key rows), S ← S + β k ⊗ (v − kᵀS), o = qᵀS."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    rk = tl.arange(0, D)
    rv = tl.program_id(2) * BV + tl.arange(0, BV)
    sp = s_ptr + ((b * H + h) * D + rk[:, None]) * D + rv[None, :]
    S = tl.load(sp)
    A = tl.exp(tl.load(alog_ptr + h))
    dtb = tl.load(dtb_ptr + h * D + rk)
    for t in tl.static_range(T):
        row = b * T + t
        base = act_ptr + row * 3 * P + h * D
        q = tl.load(base + rk)
        k = tl.load(base + P + rk)
        v = tl.load(base + 2 * P + rv)
        q = q / tl.maximum(tl.sqrt(tl.sum(q * q, 0)), 1e-6) * q_scale
        k = k / tl.maximum(tl.sqrt(tl.sum(k * k, 0)), 1e-6)
        g = lower_bound * tl.sigmoid((tl.load(fb_ptr + row * stride_fb + h * D + rk).to(tl.float32) + dtb) * A)
        beta = tl.sigmoid(tl.load(beta_ptr + row * stride_beta + h).to(tl.float32))
        S = S * tl.exp(g)[:, None]
        kS = tl.sum(k[:, None] * S, 0)
        S = S + (beta * k)[:, None] * (v - kS)[None, :]
        tl.store(o_ptr + (row * H + h) * D + rv, tl.sum(q[:, None] * S, 0))
    tl.store(sp, S)


def kda_recurrence_(act: torch.Tensor, f_b: torch.Tensor, beta_in: torch.Tensor, dt_bias: torch.Tensor,
                    a_log: torch.Tensor, state: torch.Tensor, lower_bound: float, heads: int) -> torch.Tensor:
    """stock_ops.kda_recurrence with the state updated in place; returns o [M, H, d] fp32."""
    B, T, _ = act.shape
    d = state.shape[-1]
    P = heads * d
    assert act.is_contiguous() and state.is_contiguous() and f_b.stride(1) == 1 and beta_in.stride(1) == 1
    o = torch.empty(B * T, heads, d, dtype=torch.float32, device=act.device)
    bv = min(32, d)
    _kda_kernel[(B, heads, d // bv)](act, f_b, beta_in, dt_bias, a_log, state, o, f_b.stride(0),
                                     beta_in.stride(0), P, lower_bound, d ** -0.5, T=T, H=heads, D=d, BV=bv, num_warps=4)
    return o


# --- routing: σ, + bias for selection, top-k, renormalised unbiased weights -------------------

@triton.jit
def _route_kernel(logits_ptr, bias_ptr, idx_ptr, w_ptr, E, scaling,
                  K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """One CTA per row; top-k by K rounds of argmax (first index on ties), descending."""
    m = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    mask = e < E
    s = tl.sigmoid(tl.load(logits_ptr + m * E + e, mask=mask, other=0.0).to(tl.float32))
    sel = tl.where(mask, s + tl.load(bias_ptr + e, mask=mask, other=0.0), float("-inf"))
    rk = tl.arange(0, BLOCK_K)
    ws = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int64)
    for j in tl.static_range(K):
        i = tl.argmax(sel, 0)
        ws = tl.where(rk == j, tl.sum(tl.where(e == i, s, 0.0), 0), ws)
        ids = tl.where(rk == j, i.to(tl.int64), ids)
        sel = tl.where(e == i, float("-inf"), sel)
    ws = ws / tl.sum(ws, 0) * scaling
    tl.store(idx_ptr + m * K + rk, ids, mask=rk < K)
    tl.store(w_ptr + m * K + rk, ws, mask=rk < K)


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """stock_ops.route in one kernel: (idx [M, K] int64, w [M, K] fp32)."""
    M, E = logits.shape
    assert logits.is_contiguous()
    idx = torch.empty(M, top_k, dtype=torch.int64, device=logits.device)
    w = torch.empty(M, top_k, dtype=torch.float32, device=logits.device)
    _route_kernel[(M,)](logits, bias, idx, w, E, scaling, K=top_k, BLOCK_E=_pow2(E),
                        BLOCK_K=_pow2(top_k, 2), num_warps=4)
    return idx, w


# --- routed experts: align (counting sort), FC1 + SiTU, FC2, top-k finalize ------------------

@triton.jit
def _moe_segments(idx_ptr, seg_ptr, nseg_ptr, start_ptr, P, E, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    """The part both sorts share: per-expert counts of the (row, slot) pairs, one segment
    (expert, first sorted position, count) per expert in use, in expert order (seg_ptr), their
    number (nseg_ptr) and each expert's first position (start_ptr). Returns the pair indices
    and their experts (E past P)."""
    p = tl.arange(0, BLOCK_P)
    ids = tl.load(idx_ptr + p, mask=p < P, other=E).to(tl.int32)
    ev = tl.arange(0, BLOCK_E)
    counts = tl.histogram(ids, BLOCK_E)
    counts = tl.where(ev < E, counts, 0)
    starts = tl.cumsum(counts, 0) - counts
    used = counts > 0
    slot = tl.cumsum(used.to(tl.int32), 0) - 1
    tl.store(seg_ptr + slot * 3, ev, mask=used)
    tl.store(seg_ptr + slot * 3 + 1, starts, mask=used)
    tl.store(seg_ptr + slot * 3 + 2, counts, mask=used)
    tl.store(nseg_ptr, tl.sum(used.to(tl.int32), 0))
    tl.store(start_ptr + ev, starts, mask=ev < E)
    return p, ids


@triton.jit
def _moe_align_kernel(idx_ptr, sorted_ptr, seg_ptr, nseg_ptr, start_ptr, P, E,
                      BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """One CTA: _moe_segments, then a stable counting sort of the (row, slot) pairs by expert
    (sorted_ptr: pair ids): a pair's place is its expert's start plus the number of equal ids
    before it."""
    p, ids = _moe_segments(idx_ptr, seg_ptr, nseg_ptr, start_ptr, P, E, BLOCK_P, BLOCK_E)
    tl.debug_barrier()
    for c0 in range(0, P, CHUNK):
        pc = c0 + tl.arange(0, CHUNK)
        pm = pc < P
        idc = tl.load(idx_ptr + pc, mask=pm, other=E).to(tl.int32)
        earlier = (idc[:, None] == ids[None, :]) & (p[None, :] < pc[:, None])
        rank = tl.sum(earlier.to(tl.int32), 1)
        st = tl.load(start_ptr + idc, mask=pm, other=0)
        tl.store(sorted_ptr + st + rank, pc, mask=pm)


@triton.jit
def _moe_align_atomic_kernel(idx_ptr, sorted_ptr, seg_ptr, nseg_ptr, start_ptr, P, E,
                             BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    """_moe_align_kernel's outputs in O(P): the same segments (_moe_segments), but each pair's
    place inside its expert's run comes from an atomic add on the run's next free position
    (start_ptr), not from counting the equal ids before it (O(P²): 85-97 µs at P = 1024 on the
    H200 in the bundled B = 64 traces; 86.1 against 18.8 µs here on an H100,
    bench/large_m_experts.md). The order inside a run is then not stable; FC1 and FC2 compute
    every pair's row on its own and write it back to the pair's place, so their outputs do
    not depend on it."""
    p, ids = _moe_segments(idx_ptr, seg_ptr, nseg_ptr, start_ptr, P, E, BLOCK_P, BLOCK_E)
    tl.debug_barrier()
    pm = p < P
    place = tl.atomic_add(start_ptr + ids, 1, mask=pm)
    tl.store(sorted_ptr + place, p, mask=pm)


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _moe_fc1_kernel(z_ptr, w13_ptr, sorted_ptr, seg_ptr, nseg_ptr, act_ptr, TOPK, L, I, UP,
                    stride_zm, stride_we, stride_wn, beta, lin_beta,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (segment, I blocks): gate and up columns of one expert for its rows, rounded to the
    weight dtype as a GEMM output is, then SiTU in fp32; act rows in sorted order. Gate rows
    0..I-1 and up rows UP..UP+I-1 of w13[e] (UP = I, or the padded half with expert_outputs'
    `inter`)."""
    a = tl.program_id(0)
    if a < tl.load(nseg_ptr):
        e = tl.load(seg_ptr + a * 3).to(tl.int64)
        r0 = tl.load(seg_ptr + a * 3 + 1)
        cnt = tl.load(seg_ptr + a * 3 + 2)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < I
        wdt = w13_ptr.dtype.element_ty
        for m0 in range(0, cnt, BLOCK_M):
            rr = m0 + tl.arange(0, BLOCK_M)
            rmask = rr < cnt
            tok = tl.load(sorted_ptr + r0 + rr, mask=rmask, other=0) // TOPK
            accg = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            accu = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for k0 in range(0, L, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                kmask = rk < L
                x = tl.load(z_ptr + tok[:, None] * stride_zm + rk[None, :], mask=rmask[:, None] & kmask[None, :],
                            other=0.0)
                wp = w13_ptr + e * stride_we + rn[:, None] * stride_wn + rk[None, :]
                wm = nmask[:, None] & kmask[None, :]
                accg += tl.dot(tl.load(wp, mask=wm, other=0.0), tl.trans(x))
                accu += tl.dot(tl.load(wp + UP * stride_wn, mask=wm, other=0.0), tl.trans(x))
            g = accg.to(wdt).to(tl.float32)
            u = accu.to(wdt).to(tl.float32)
            y = (beta * _tanh(g / beta) * tl.sigmoid(g)) * (lin_beta * _tanh(u / lin_beta))
            tl.store(act_ptr + (r0 + rr)[None, :] * I + rn[:, None], y.to(wdt),
                     mask=nmask[:, None] & rmask[None, :])


@triton.jit
def _moe_fc2_kernel(act_ptr, w2_ptr, sorted_ptr, seg_ptr, nseg_ptr, out_ptr, L, I, stride_we, stride_wn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (segment, L blocks): one expert's down projection of its rows, written to the
    rows' original (row, slot) positions, unweighted (the finalize weights them)."""
    a = tl.program_id(0)
    if a < tl.load(nseg_ptr):
        e = tl.load(seg_ptr + a * 3).to(tl.int64)
        r0 = tl.load(seg_ptr + a * 3 + 1)
        cnt = tl.load(seg_ptr + a * 3 + 2)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < L
        for m0 in range(0, cnt, BLOCK_M):
            rr = m0 + tl.arange(0, BLOCK_M)
            rmask = rr < cnt
            pair = tl.load(sorted_ptr + r0 + rr, mask=rmask, other=0)
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for k0 in range(0, I, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                kmask = rk < I
                x = tl.load(act_ptr + (r0 + rr)[:, None] * I + rk[None, :], mask=rmask[:, None] & kmask[None, :],
                            other=0.0)
                w = tl.load(w2_ptr + e * stride_we + rn[:, None] * stride_wn + rk[None, :],
                            mask=nmask[:, None] & kmask[None, :], other=0.0)
                acc += tl.dot(w, tl.trans(x))
            tl.store(out_ptr + pair[None, :].to(tl.int64) * L + rn[:, None], acc.to(out_ptr.dtype.element_ty),
                     mask=nmask[:, None] & rmask[None, :])


@triton.jit
def _moe_finalize_kernel(e_ptr, w_ptr, out_ptr, L, K: tl.constexpr, BLOCK: tl.constexpr):
    """out[m] = Σ_j w[m, j]·e[m·K + j] in fp32, rounded to out's dtype."""
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = rn < L
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K):
        wj = tl.load(w_ptr + m * K + j)
        acc += wj * tl.load(e_ptr + (m * K + j) * L + rn, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * L + rn, acc.to(out_ptr.dtype.element_ty), mask=mask)


def expert_outputs(z: torch.Tensor, idx: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   beta: float, lin_beta: float, inter: int | None = None,
                   fast_align: bool = False) -> torch.Tensor:
    """stock_ops.expert_outputs_grouped in three kernels (align, FC1 + SiTU, FC2): [M, K, L].

    `inter` (the fused path's byte rule, as kernels/moe_experts.py): w13's rows inter..Ip-1 of
    each half and w2's columns inter..Ip-1 are zero padding (stock.LatentMoE), so FC1 computes
    the first `inter` columns only and FC2 sums over them only: a quarter fewer expert bytes
    at K3 TP16 (192 of 256), the same numbers (each skipped term is an exact zero, and FC2's
    K blocks are the same). `fast_align`: _moe_align_atomic_kernel instead of the stable sort
    (same segments; see its docstring). Stock reads the padding, as vLLM does, and sorts as
    stock_ops.STOCK_FAST_ALIGN says (the O(P) sort, vLLM's method)."""
    M, K = idx.shape
    E, I2, L = w13.shape
    Ip = I2 // 2
    I = Ip if inter is None else inter
    assert 0 < I <= Ip and w2.shape[-1] == Ip
    P = M * K
    assert z.stride(1) == 1 and w13.is_contiguous() and w2.is_contiguous() and idx.is_contiguous()
    dev = z.device
    sorted_pairs = torch.empty(P, dtype=torch.int32, device=dev)
    nseg_max = min(E, P)
    seg = torch.empty(nseg_max, 3, dtype=torch.int32, device=dev)
    nseg = torch.empty(1, dtype=torch.int32, device=dev)
    starts = torch.empty(E, dtype=torch.int32, device=dev)
    if fast_align:
        _moe_align_atomic_kernel[(1,)](idx, sorted_pairs, seg, nseg, starts, P, E, BLOCK_P=_pow2(P),
                                       BLOCK_E=_pow2(E + 1), num_warps=8)
    else:
        _moe_align_kernel[(1,)](idx, sorted_pairs, seg, nseg, starts, P, E, BLOCK_P=_pow2(P),
                                BLOCK_E=_pow2(E + 1), CHUNK=16, num_warps=8)
    act = torch.empty(P, I, dtype=w13.dtype, device=dev)
    bm = 16
    # the column tile from the stored width, not `inter`: both calls then multiply the same
    # tiles (the masked columns load as the padding's zeros), which keeps them bit-identical
    # on the CPU interpreter too, whose numpy matmul may sum a 16-wide tile in another order
    # than a 32-wide one (OpenBLAS picks its kernel by the CPU at run time: on an AMD EPYC
    # runner numpy 2.4.6 did, where earlier runs had passed); at K3 (192 of 256) both give 32
    bn1 = 32 if Ip >= 32 else 16
    _moe_fc1_kernel[(nseg_max, triton.cdiv(I, bn1))](z, w13, sorted_pairs, seg, nseg, act, K, L, I, Ip, z.stride(0),
                                                     w13.stride(0), w13.stride(1), beta, lin_beta,
                                                     BLOCK_M=bm, BLOCK_N=bn1, BLOCK_K=128, num_warps=4,
                                                     num_stages=3)
    out = torch.empty(P, L, dtype=w2.dtype, device=dev)
    bn2 = 64 if L >= 64 else 16
    _moe_fc2_kernel[(nseg_max, triton.cdiv(L, bn2))](act, w2, sorted_pairs, seg, nseg, out, L, I, w2.stride(0),
                                                     w2.stride(1), BLOCK_M=bm, BLOCK_N=bn2,
                                                     BLOCK_K=min(128, _pow2(Ip)), num_warps=4, num_stages=3)
    return out.reshape(M, K, L)


def experts(z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            beta: float, lin_beta: float, inter: int | None = None, fast_align: bool = False,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """stock_ops.experts_grouped in four kernels: expert_outputs, then the top-k finalize
    (written into `out`, a contiguous [M, L] view such as an all-reduce slot, when given)."""
    M, K = idx.shape
    e = expert_outputs(z, idx, w13, w2, beta, lin_beta, inter=inter, fast_align=fast_align)
    L = e.shape[-1]
    if out is None:
        out = torch.empty(M, L, dtype=z.dtype, device=z.device)
    assert out.shape == (M, L) and out.is_contiguous()
    _moe_finalize_kernel[(M, triton.cdiv(L, 512))](e, w.contiguous(), out, L, K=K, BLOCK=512, num_warps=4)
    return out


# --- MLA: the two latent RMSNorms, and q-concat + latent-cache insert ------------------------

@triton.jit
def _mla_norms_kernel(a_ptr, qw_ptr, kvw_ptr, qa_ptr, ckv_ptr, stride_am, QR, KR, eps, BLOCK: tl.constexpr):
    """Grid (M, 2): program 0 normalises a[:, :QR] (weight qw), program 1 a[:, QR:QR+KR] (kvw)."""
    m = tl.program_id(0)
    j = tl.program_id(1)
    width = tl.where(j == 0, QR, KR)
    offs = tl.arange(0, BLOCK)
    mask = offs < width
    x = tl.load(a_ptr + m * stride_am + j * QR + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / width + eps)
    if j == 0:
        w = tl.load(qw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(qa_ptr + m * QR + offs, (x * rstd * w).to(qa_ptr.dtype.element_ty), mask=mask)
    else:
        w = tl.load(kvw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ckv_ptr + m * KR + offs, (x * rstd * w).to(ckv_ptr.dtype.element_ty), mask=mask)


def mla_norms(a: torch.Tensor, q_norm: torch.Tensor, kv_norm: torch.Tensor, q_rank: int, kv_rank: int,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """stock_ops.mla_norms in one kernel: (qa [M, q_rank], ckv [M, kv_rank])."""
    M = a.shape[0]
    assert a.stride(1) == 1
    qa = torch.empty(M, q_rank, dtype=a.dtype, device=a.device)
    ckv = torch.empty(M, kv_rank, dtype=a.dtype, device=a.device)
    _mla_norms_kernel[(M, 2)](a, q_norm, kv_norm, qa, ckv, a.stride(0), q_rank, kv_rank, eps,
                              BLOCK=_pow2(max(q_rank, kv_rank)), num_warps=4)
    return qa, ckv


@triton.jit
def _kv_insert_kernel(qlat_ptr, q_ptr, ckv_ptr, a_ptr, cache_ptr, pos_ptr, qfull_ptr,
                      s_lm, s_lh, s_qm, s_qh, s_am, s_cb, s_cp, H, T, C, ROPE, NOPE, ROPE_OFF,
                      BLOCK: tl.constexpr):
    """Grid (M, H + 1): program (m, h < H) writes q_full row m·H + h = [q_lat[m, h], q_rope[m, h]];
    program (m, H) writes cache[m // T, pos + m % T] = [ckv[m], k_rope[m]]."""
    m = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    lat = offs < C
    rope = (offs >= C) & (offs < C + ROPE)
    if h < H:
        x = tl.load(qlat_ptr + m * s_lm + h * s_lh + offs, mask=lat, other=0.0)
        r = tl.load(q_ptr + m * s_qm + h * s_qh + NOPE + offs - C, mask=rope, other=0.0)
        tl.store(qfull_ptr + (m * H + h) * (C + ROPE) + offs, tl.where(lat, x, r), mask=lat | rope)
    else:
        x = tl.load(ckv_ptr + m * C + offs, mask=lat, other=0.0)
        r = tl.load(a_ptr + m * s_am + ROPE_OFF + offs - C, mask=rope, other=0.0)
        p = tl.load(pos_ptr) + m % T
        tl.store(cache_ptr + (m // T) * s_cb + p * s_cp + offs, tl.where(lat, x, r), mask=lat | rope)


def kv_insert(q_lat: torch.Tensor, q: torch.Tensor, ckv: torch.Tensor, a: torch.Tensor, rope_off: int,
              cache: torch.Tensor, pos: torch.Tensor, T: int) -> torch.Tensor:
    """q_full [B, T·H, c + rope] = [q_lat | q[..., nope:]], and the new tokens' [ckv | a[:, rope_off:]]
    written into cache at positions pos .. pos + T - 1, in one kernel."""
    M, H, C = q_lat.shape
    ROPE = cache.shape[-1] - C
    NOPE = q.shape[-1] - ROPE
    assert q_lat.stride(2) == 1 and q.stride(2) == 1 and ckv.is_contiguous() and a.stride(1) == 1
    assert cache.stride(2) == 1
    q_full = torch.empty(M // T, T * H, C + ROPE, dtype=q_lat.dtype, device=q_lat.device)
    _kv_insert_kernel[(M, H + 1)](q_lat, q, ckv, a, cache, pos, q_full, q_lat.stride(0), q_lat.stride(1),
                                  q.stride(0), q.stride(1), a.stride(0), cache.stride(0), cache.stride(1),
                                  H, T, C, ROPE, NOPE, rope_off, BLOCK=_pow2(C + ROPE), num_warps=4)
    return q_full
