"""The non-GEMM math of the stock step, one pure function per stock vLLM kernel (group).

GEMMs stay plain cuBLAS calls in stock.py (vLLM issues each as one GEMM kernel). Everything
between them lives here as a pure function of tensors and Python constants, so that with
`cfg.compile_ops` each can be compiled on its own (torch.compile, static shapes): inductor
turns a function's plain PyTorch ops into about one Triton kernel, which is how vLLM issues
these steps (one fused attn_res kernel, a Triton conv update, one recurrent-KDA kernel, a
gated RMSNorm, fused routing, ...). Without compile_ops they run op by op in eager PyTorch
(about five times the kernels). State tensors are never mutated by these functions: new state
is returned and the caller copies it in place.

Where inductor cannot reach vLLM's single kernel (a top-k, a sort, cuBLAS's split-K skinny
GEMMs, a three-pass AttnRes), `OpSet` runs the Triton kernel of stock_triton.py instead, on
CUDA bf16/fp16 tensors when the config asks for it; everywhere else (CPU, fp32, triton absent)
the same call runs these torch functions, which define the math.
"""
from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F


def maybe_compiled(fn: Callable, enabled: bool) -> Callable:
    """`fn`, or its torch.compile'd twin (one per function, static shapes) when enabled."""
    return _compiled(fn) if enabled else fn


@functools.cache
def _compiled(fn: Callable) -> Callable:
    # Static shapes recompile once per (B, k) and per constant argument set: allow plenty.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(fn, dynamic=False)


def situ(g: torch.Tensor, u: torch.Tensor, beta: float, lin_beta: float) -> torch.Tensor:
    """SiTU GLU in fp32: [β·tanh(g/β)·σ(g)] · [β_lin·tanh(u/β_lin)]."""
    g, u = g.float(), u.float()
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (lin_beta * torch.tanh(u / lin_beta))


def situ_glu(h: torch.Tensor, inter: int, beta: float, lin_beta: float) -> torch.Tensor:
    """SiTU over a gate-first [.., 2·inter] GEMM output, back in h's dtype."""
    return situ(h[..., :inter], h[..., inter:], beta, lin_beta).to(h.dtype)


def attn_res_mix(prefix: torch.Tensor, blocks: torch.Tensor, w: torch.Tensor, norm: torch.Tensor,
                 eps: float, nb: int) -> torch.Tensor:
    """Softmax mix of [blocks[:nb], prefix] scored by RMS-normalised sources · w, taken over the
    RAW sources in fp32; then RMSNorm(norm)."""
    src = torch.cat([blocks[:, :nb], prefix[:, None]], dim=1).float()         # [M, nb+1, D]
    score = (F.rms_norm(src, (src.shape[-1],), None, eps) * w).sum(-1)        # [M, nb+1]
    mix = (torch.softmax(score, dim=-1)[..., None] * src).sum(dim=1)
    return F.rms_norm(mix, (mix.shape[-1],), norm, eps).to(prefix.dtype)


def res_mix(base: torch.Tensor, delta: torch.Tensor, blocks: torch.Tensor, w: torch.Tensor,
            norm: torch.Tensor, eps: float, nb: int, reset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """AttnRes with its prefix update: prefix = delta (new block) or base + delta, then the mix."""
    prefix = delta if reset else base + delta
    return prefix, attn_res_mix(prefix, blocks, w, norm, eps, nb)


def conv_update(conv_state: torch.Tensor, qkv: torch.Tensor, conv_w: torch.Tensor,
                batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv (width 4, no bias) + SiLU over T new tokens per sequence.
    conv_state [B, C, 3] holds the last 3 pre-conv inputs; returns (act [B, T, C] fp32, new state)."""
    width = conv_w.shape[1]
    new = qkv.reshape(batch, -1, qkv.shape[-1]).transpose(1, 2)                 # [B, C, T]
    full = torch.cat([conv_state, new], dim=-1)                                 # [B, C, 3+T]
    y = (full.float().unfold(-1, width, 1) * conv_w[:, None, :]).sum(-1)       # [B, C, T]
    return F.silu(y).transpose(1, 2), full[..., -(width - 1):]


def kda_recurrence(act: torch.Tensor, f_b: torch.Tensor, beta_in: torch.Tensor, dt_bias: torch.Tensor,
                   a_log: torch.Tensor, state: torch.Tensor, lower_bound: float,
                   heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-norm q, k; gate g = lb·σ(e^A·(f_b + dt_bias)); β = σ(b); per token
    S ← S·e^g (key rows), S ← S + β k ⊗ (v − kᵀS), o = qᵀS. Returns (o [M, H, d] fp32, S)."""
    B, T, _ = act.shape
    d = state.shape[-1]
    q, k, v = act.reshape(B, T, 3, heads, d).unbind(2)                         # [B, T, H, d]
    q = F.normalize(q, dim=-1, eps=1e-6) * d ** -0.5
    k = F.normalize(k, dim=-1, eps=1e-6)
    g = (f_b.float() + dt_bias).reshape(B, T, heads, d) * a_log.exp()[:, None]
    g = lower_bound * torch.sigmoid(g)
    beta = torch.sigmoid(beta_in.float()).reshape(B, T, heads)
    S, outs = state, []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        kS = (k[:, t, :, :, None] * S).sum(-2)                                  # [B, H, d]
        S = S + (beta[:, t, :, None] * k[:, t])[..., None] * (v[:, t] - kS)[..., None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, dim=1).reshape(B * T, heads, d), S


def gated_rms_norm(o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float,
                   dtype: torch.dtype) -> torch.Tensor:
    """Per-head RMSNorm(o) ⊙ σ(gate), flattened to [M, H·d] in `dtype`."""
    M, H, d = o.shape
    out = F.rms_norm(o, (d,), weight.float(), eps) * torch.sigmoid(gate.float()).reshape(M, H, d)
    return out.to(dtype).reshape(M, H * d)


def mla_norms(a: torch.Tensor, q_norm: torch.Tensor, kv_norm: torch.Tensor, q_rank: int, kv_rank: int,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the q latent and of c_kv (vLLM's fused_q_kv_rmsnorm)."""
    qa = F.rms_norm(a[:, :q_rank], (q_rank,), q_norm, eps)
    ckv = F.rms_norm(a[:, q_rank:q_rank + kv_rank], (kv_rank,), kv_norm, eps)
    return qa, ckv


def mla_attend(q_full: torch.Tensor, cache: torch.Tensor, last: torch.Tensor, heads: int, kv_rank: int,
               scale: float) -> torch.Tensor:
    """Absorbed MLA decode over the latent cache [B, C, c + rope]: row (t, h) sees positions
    <= last[t]. Returns o_lat [B, T·H, c]."""
    scores = torch.bmm(q_full, cache.transpose(1, 2)).float() * scale           # [B, T*H, C]
    allowed = torch.arange(cache.shape[1], device=cache.device) <= last[:, None]  # [T, C]
    scores = scores.masked_fill(~allowed.repeat_interleave(heads, 0), float("-inf"))
    return torch.bmm(torch.softmax(scores, -1).to(cache.dtype), cache[..., :kv_rank])


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return o * torch.sigmoid(gate)


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """σ(logits); top-k of σ + bias (bias selects only); weights = unbiased σ renormalised."""
    s = torch.sigmoid(logits)
    idx = torch.topk(s + bias, top_k, dim=-1).indices
    w = s.gather(-1, idx)
    return idx, w / w.sum(-1, keepdim=True) * scaling


def expert_outputs_grouped(z: torch.Tensor, idx: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                           beta: float, lin_beta: float) -> torch.Tensor:
    """e[m, j] = w2_e · SiTU(w1_e z_m, w3_e z_m), e = idx[m, j]: rows sorted by expert, two
    grouped GEMMs (each selected expert's weights read once). Returns [M, K, L]."""
    M, K = idx.shape
    inter = w2.shape[-1]
    sorted_e, order = torch.sort(idx.reshape(-1), stable=True)
    offs = torch.searchsorted(sorted_e, torch.arange(w13.shape[0], device=z.device), right=True).to(torch.int32)
    h = torch._grouped_mm(z[order // K], w13.transpose(1, 2), offs=offs)        # [M*K, 2I]
    e = torch._grouped_mm(situ_glu(h, inter, beta, lin_beta), w2.transpose(1, 2), offs=offs)  # [M*K, L]
    return torch.empty_like(e).index_copy_(0, order, e).reshape(M, K, -1)


def expert_outputs_gathered(z: torch.Tensor, idx: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                            beta: float, lin_beta: float) -> torch.Tensor:
    """Same as expert_outputs_grouped via a gather of each row's expert weights and bmm (gpt-fast)."""
    M, K = idx.shape
    flat = idx.reshape(-1)
    h = torch.bmm(w13[flat], z.repeat_interleave(K, dim=0)[..., None]).squeeze(-1)
    return torch.bmm(w2[flat], situ_glu(h, w2.shape[-1], beta, lin_beta)[..., None]).reshape(M, K, -1)


EXPERT_OUTPUTS = {"grouped_mm": expert_outputs_grouped, "gather_bmm": expert_outputs_gathered}


def experts_grouped(z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    beta: float, lin_beta: float) -> torch.Tensor:
    """Σ_j w[m, j] · e[m, j] (the top-k finalize) in fp32, back in z's dtype: [M, L]."""
    e = expert_outputs_grouped(z, idx, w13, w2, beta, lin_beta)
    return (w[..., None] * e.float()).sum(1).to(z.dtype)


def experts_gathered(z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     beta: float, lin_beta: float) -> torch.Tensor:
    """experts_grouped through expert_outputs_gathered."""
    e = expert_outputs_gathered(z, idx, w13, w2, beta, lin_beta)
    return (w[..., None] * e.float()).sum(1).to(z.dtype)


EXPERTS = {"grouped_mm": experts_grouped, "gather_bmm": experts_gathered}


def latent_up(r: torch.Tensor, norm: torch.Tensor, up_rows: torch.Tensor, shared: torch.Tensor,
              eps: float) -> torch.Tensor:
    """RMSNorm of the reduced latent, this rank's row shard of the up-projection, + shared slice."""
    return F.rms_norm(r, (r.shape[-1],), norm, eps) @ up_rows.t() + shared


# Op groups that have a Triton kernel (stock_triton.py); config.triton_off names any to skip.
TRITON_OPS = ("mm", "attn_res", "conv", "kda", "route", "experts", "up", "mla_norms", "kv_insert")
SKINNY_MAX_M = 64   # rows up to which a GEMM is one skinny-GEMM kernel (vLLM's low-latency GEMM)
# The routed experts' sort (Triton op group "experts"): each (row, slot) pair's place in its
# expert's run from an atomic add on the run's next free position, O(P) (stock_triton's
# _moe_align_atomic_kernel), as vLLM places them (count_and_sort_expert_tokens_kernel:
# atomicAdd on the expert's cumsum). Until session 34 stock ran a stable counting sort that
# counts the equal ids before each pair, O(P²): 86.1 against 18.8 µs at P = 1024 (B = 64) and
# 18.3 against 15.2 at P = 128 (M = 8) on an H100 (bench/large_m_experts.md), 85-97 µs per
# layer in the bundled H200 B = 64 stock trace: time vLLM does not spend. The outputs are
# bit-identical (tests/kimi_decode/test_stock_triton.py). The stock figures committed before
# this (bench/decode.md, decode_h100.md, the bundled traces) include the slower sort.
STOCK_FAST_ALIGN = True


class OpSet:
    """The implementation of each op group for one config: a Triton kernel (CUDA, bf16/fp16,
    compile_ops and triton_ops on, op not in triton_off), else the torch function above
    (torch.compile'd when compile_ops). Same signatures and results either way; state-updating
    ops (`conv_`, `kda_`) update the state in place."""

    # tests only: Triton for every tensor (CPU under TRITON_INTERPRET=1, any dtype), compile or not
    force_triton = False

    def __init__(self, cfg) -> None:
        on = ((cfg.compile_ops or self.force_triton) and cfg.triton_ops
              and importlib.util.find_spec("triton") is not None)
        self.triton = set(TRITON_OPS) - set(cfg.triton_off) if on else set()
        self.fn = {f.__name__: maybe_compiled(f, cfg.compile_ops) for f in
                   (res_mix, attn_res_mix, conv_update, kda_recurrence, route, situ_glu, latent_up,
                    experts_grouped, experts_gathered, gated_rms_norm, mla_norms)}
        self.experts_fn = self.fn[EXPERTS[cfg.expert_impl].__name__]

    def _kernels(self, op: str, t: torch.Tensor, any_dtype: bool = False) -> ModuleType | None:
        if op in self.triton and (self.force_triton or (
                t.is_cuda and (any_dtype or t.dtype in (torch.bfloat16, torch.float16)))):
            from kimi_decode import stock_triton
            return stock_triton
        return None

    def linear(self, x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ w.t() (in out_dtype): one skinny-GEMM kernel for M <= SKINNY_MAX_M, else cuBLAS."""
        k = self._kernels("mm", x)
        if k is not None and x.shape[0] <= SKINNY_MAX_M and x.stride(1) == 1:
            return k.skinny_mm(x, w, out_dtype)
        y = x @ w.t()
        return y if out_dtype is None else y.to(out_dtype)

    def res_mix(self, base, delta, blocks, w, norm, eps: float, nb: int, reset: bool):
        k = self._kernels("attn_res", delta)
        if k is not None:
            return k.attn_res(base.contiguous(), delta.contiguous(), blocks, w, norm, eps, nb, reset)
        return self.fn["res_mix"](base, delta, blocks, w, norm, eps, nb, reset)

    def attn_res_mix(self, prefix, blocks, w, norm, eps: float, nb: int):
        k = self._kernels("attn_res", prefix)
        if k is not None:
            p = prefix.contiguous()
            return k.attn_res(p, p, blocks, w, norm, eps, nb, True)[1]
        return self.fn["attn_res_mix"](prefix, blocks, w, norm, eps, nb)

    def conv_(self, conv_state, qkv, conv_w, batch: int) -> torch.Tensor:
        """conv_update, the new state copied into conv_state; returns act [B, T, C] fp32."""
        k = self._kernels("conv", qkv)
        if k is not None:
            return k.conv_update_(conv_state, qkv, conv_w, batch)
        act, new = self.fn["conv_update"](conv_state, qkv, conv_w, batch)
        conv_state.copy_(new)
        return act

    def kda_(self, act, f_b, beta_in, dt_bias, a_log, state, lower_bound: float, heads: int) -> torch.Tensor:
        """kda_recurrence, the new state copied into `state`; returns o [M, H, d] fp32."""
        k = self._kernels("kda", f_b)
        if k is not None:
            return k.kda_recurrence_(act, f_b, beta_in, dt_bias, a_log, state, lower_bound, heads)
        o, S = self.fn["kda_recurrence"](act, f_b, beta_in, dt_bias, a_log, state, lower_bound, heads)
        state.copy_(S)
        return o

    def gated_rms_norm(self, o, weight, gate, eps: float, dtype: torch.dtype) -> torch.Tensor:
        return self.fn["gated_rms_norm"](o, weight, gate, eps, dtype)

    def route(self, logits, bias, top_k: int, scaling: float):
        k = self._kernels("route", logits, any_dtype=True)
        if k is not None and logits.is_contiguous():
            return k.route(logits, bias, top_k, scaling)
        return self.fn["route"](logits, bias, top_k, scaling)

    def situ(self, h, inter: int, beta: float, lin_beta: float) -> torch.Tensor:
        return self.fn["situ_glu"](h, inter, beta, lin_beta)

    def experts(self, z, idx, w, w13, w2, beta: float, lin_beta: float, inter: int | None = None,
                fast_align: bool | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts. `inter`, `fast_align` and `out` are the fused path's call above
        its CuTe kernels' rows (stock_triton.experts: skip the zero padding, the O(P) sort,
        write into an all-reduce slot); stock passes none of them, so it reads the padding as
        vLLM does and sorts as STOCK_FAST_ALIGN says. The torch functions read the padding
        (zeros: the same numbers) and copy into `out`."""
        k = self._kernels("experts", z)
        if k is not None:
            return k.experts(z, idx.contiguous(), w, w13, w2, beta, lin_beta, inter=inter,
                             fast_align=STOCK_FAST_ALIGN if fast_align is None else fast_align, out=out)
        r = self.experts_fn(z, idx, w, w13, w2, beta, lin_beta)
        return r if out is None else out.copy_(r)

    def up(self, r, norm, up_rows, shared, eps: float) -> torch.Tensor:
        """latent_up: one skinny GEMM with the RMSNorm as prologue and the shared add as epilogue."""
        k = self._kernels("up", r)
        if k is not None and r.shape[0] <= SKINNY_MAX_M:
            return k.skinny_mm(r.contiguous(), up_rows, add=shared.contiguous(), norm_w=norm, eps=eps)
        return self.fn["latent_up"](r, norm, up_rows, shared, eps)

    def mla_norms(self, a, q_norm, kv_norm, q_rank: int, kv_rank: int, eps: float):
        k = self._kernels("mla_norms", a)
        if k is not None:
            return k.mla_norms(a, q_norm, kv_norm, q_rank, kv_rank, eps)
        return self.fn["mla_norms"](a, q_norm, kv_norm, q_rank, kv_rank, eps)

    def kv_insert(self, q_lat, q, ckv, a, rope_off: int, cache, pos, T: int) -> torch.Tensor:
        """q_full [B, T·H, c + rope] = [q_lat | q[..., nope:]]; cache[:, pos + t] = [ckv | a[:, rope_off:]]."""
        k = self._kernels("kv_insert", q_lat)
        if k is not None:
            return k.kv_insert(q_lat, q, ckv, a, rope_off, cache, pos, T)
        M, H, c = q_lat.shape
        rope = cache.shape[-1] - c
        q_full = torch.cat([q_lat, q[..., q.shape[-1] - rope:]], dim=-1).reshape(M // T, T * H, c + rope)
        last = pos + torch.arange(T, device=q.device)
        cache.index_copy_(1, last, torch.cat([ckv, a[:, rope_off:]], dim=-1).reshape(M // T, T, c + rope))
        return q_full
