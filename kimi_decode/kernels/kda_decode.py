"""Fused KDA decode for the local heads: conv update + SiLU + f_b gate projection +
lower-bound gate + β + L2 norm + delta-rule recurrence + gated RMSNorm, one launch
(KIMI_K3.md §1.4; replaces the stock ops `f_b_proj`, `conv`, `kda_recurrence`, `o_norm`,
which eager PyTorch issues as several dozen kernels, and vLLM at TP16 as 3 Triton kernels plus
a copy, §2.4 #3-#7).

Per sequence b, head h, token t (row m = b·T + t of the in_proj output z [M, R]):
    q,k,v  = SiLU(conv4(state ++ z[m, qkv channels of h]))    fp32; state ← last 3 inputs
    q̂ = q / max(‖q‖, 1e-6) · d^-½,  k̂ = k / max(‖k‖, 1e-6)
    g[i]  = lb · σ( e^{A_log[h]} · (bf16(f_b[h·d+i] · f_a[m]) + dt_bias[h·d+i]) )
    β     = σ(z[m, 4P + d + h])
    S ← S ⊙ e^{g}[:, None];  S ← S + β k̂ ⊗ (v − k̂ᵀS);  o = q̂ᵀ S          S fp32 [d, d]
    out[m, h·d + j] = bf16( RMSNorm(o; o_norm)_j · σ(z[m, 3P + h·d + j]) )
Tokens of one sequence run in order inside the CTA (speculative rows, k = 7), so the state
advances by T tokens exactly as the stock loop does.

Layout: grid (B, H); 2·d = 256 threads. Thread (j = tid mod d, half = tid div d) owns column
j of S for the keys half·d/2 .. half·d/2 + d/2 - 1: d/2 = 64 fp32 registers, read and written
once per step with coalesced loads (consecutive threads, consecutive columns). The two halves
of kᵀS and qᵀS meet in shared memory. Conv channels (3·d per head) are spread over the
threads, each keeping its channel's 3-tap history in registers across the T tokens. The f_b
gate projection (d outputs × d inputs per head) is warp-cooperative: each of the 8 warps owns
d/8 rows, its lanes read d/32 consecutive inputs of a row (coalesced) and a shuffle sum
finishes each row.

Check on the GPU (against the stock KDAAttention ops; times both):
    python -m kimi_decode.kernels.kda_decode
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from kimi_decode.kernels._common import compile_options, compiled, current_stream, dummy_ptr, ptr, sigmoid

CONV = 4  # taps of the causal depthwise conv (state keeps CONV - 1)


@dataclass(frozen=True)
class KDAConfig:
    """Compile-time sizes: local heads H, head dim d, tokens per sequence T, in_proj rows R."""

    heads: int
    head_dim: int
    tokens: int
    in_proj_rows: int
    gate_lower_bound: float = -5.0
    l2_eps: float = 1e-6
    norm_eps: float = 1e-5


def can_implement(heads: int, head_dim: int, conv_kernel: int, in_proj_rows: int,
                  dtypes: tuple[torch.dtype, ...]) -> bool:
    """d = 128 (one warp per 32 columns, 4 warps per half), 4-tap conv, bf16 activations."""
    p = heads * head_dim
    return (head_dim == 128 and conv_kernel == CONV and in_proj_rows >= 4 * p + head_dim + heads
            and in_proj_rows % 8 == 0 and all(dt == torch.bfloat16 for dt in dtypes))


class KDADecode:
    """See the module docstring."""

    def __init__(self, cfg: KDAConfig) -> None:
        self.cfg = cfg
        self.H, self.d, self.T, self.R = cfg.heads, cfg.head_dim, cfg.tokens, cfg.in_proj_rows
        self.P = self.H * self.d
        self.threads = 2 * self.d
        self.half = self.d // 2
        self.warps = self.threads // 32
        self.nch = 3 * self.d                                  # conv channels per head
        self.ch_per_thread = (self.nch + self.threads - 1) // self.threads
        self.rows_per_warp = self.d // self.warps              # f_b rows per warp
        self.fa_per_lane = self.d // 32                        # f_a inputs per lane

    @cute.jit
    def __call__(self, z: cute.Pointer, f_b: cute.Pointer, conv_w: cute.Pointer,
                 conv_state: cute.Pointer, dt_bias: cute.Pointer, a_log: cute.Pointer,
                 rec_state: cute.Pointer, o_norm: cute.Pointer, out: cute.Pointer, batch: Int32,
                 stream: cuda.CUstream):
        H, d, P, T = self.H, self.d, self.P, self.T
        m = batch * T
        mZ = cute.make_tensor(z, cute.make_layout((m, self.R), stride=(self.R, 1)))
        mFb = cute.make_tensor(f_b, cute.make_layout((P, d), stride=(d, 1)))
        mCw = cute.make_tensor(conv_w, cute.make_layout((3 * P, CONV), stride=(CONV, 1)))
        mCs = cute.make_tensor(conv_state, cute.make_layout(
            (batch, 3 * P, CONV - 1), stride=(3 * P * (CONV - 1), CONV - 1, 1)))
        mDt = cute.make_tensor(dt_bias, cute.make_layout(P))
        mA = cute.make_tensor(a_log, cute.make_layout(H))
        mS = cute.make_tensor(rec_state, cute.make_layout(
            (batch, H, d, d), stride=(H * d * d, d * d, d, 1)))
        mOn = cute.make_tensor(o_norm, cute.make_layout(d))
        mOut = cute.make_tensor(out, cute.make_layout((m, P), stride=(P, 1)))
        self.kernel(mZ, mFb, mCw, mCs, mDt, mA, mS, mOn, mOut).launch(
            grid=[batch, H, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mZ: cute.Tensor, mFb: cute.Tensor, mCw: cute.Tensor, mCs: cute.Tensor,
               mDt: cute.Tensor, mA: cute.Tensor, mS: cute.Tensor, mOn: cute.Tensor,
               mOut: cute.Tensor):
        d, P, T, half = self.d, self.P, self.T, self.half
        tid, _, _ = cute.arch.thread_idx()
        b, h, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        col = tid % d
        kh = tid // d                                   # which half of the keys this thread owns
        smem = cutlass.memory.SmemAllocator()
        s_qkv = smem.allocate_tensor(Float32, cute.make_layout(self.nch))
        s_eg = smem.allocate_tensor(Float32, cute.make_layout(d))        # exp(g) per key
        s_part = smem.allocate_tensor(Float32, cute.make_layout((2, d), stride=(d, 1)))
        s_red = smem.allocate_tensor(Float32, cute.make_layout(self.warps))
        s_beta = smem.allocate_tensor(Float32, cute.make_layout(1))

        # State column slice and conv histories into registers.
        S = cute.make_rmem_tensor(cute.make_layout(half), Float32)
        for j in cutlass.range_constexpr(half):
            S[j] = mS[b, h, kh * half + j, col]
        hist = cute.make_rmem_tensor(cute.make_layout((self.ch_per_thread, CONV - 1),
                                                      stride=(CONV - 1, 1)), Float32)
        cw = cute.make_rmem_tensor(cute.make_layout((self.ch_per_thread, CONV),
                                                    stride=(CONV, 1)), Float32)
        for c in cutlass.range_constexpr(self.ch_per_thread):
            ch = tid + c * self.threads
            if ch < self.nch:
                gch = (ch // d) * P + h * d + ch % d
                for j in cutlass.range_constexpr(CONV - 1):
                    hist[c, j] = mCs[b, gch, j].to(Float32)
                for j in cutlass.range_constexpr(CONV):
                    cw[c, j] = mCw[gch, j]
        decay = cute.math.exp(mA[h])

        for t in range(T):
            row = b * T + t
            cute.arch.sync_threads()                    # the previous token's readers are done
            # Conv update + SiLU for the 3·d channels of this head.
            for c in cutlass.range_constexpr(self.ch_per_thread):
                ch = tid + c * self.threads
                if ch < self.nch:
                    gch = (ch // d) * P + h * d + ch % d
                    x_new = mZ[row, gch].to(Float32)
                    y = x_new * cw[c, CONV - 1]
                    for j in cutlass.range_constexpr(CONV - 1):
                        y += hist[c, j] * cw[c, j]
                    for j in cutlass.range_constexpr(CONV - 2):
                        hist[c, j] = hist[c, j + 1]
                    hist[c, CONV - 2] = x_new
                    s_qkv[ch] = y * sigmoid(y)
            # Decay gate: each warp owns d / warps rows of f_b; lanes split the d inputs.
            fa = cute.make_rmem_tensor(cute.make_layout(self.fa_per_lane), Float32)
            for q in cutlass.range_constexpr(self.fa_per_lane):
                fa[q] = mZ[row, 4 * P + lane * self.fa_per_lane + q].to(Float32)
            for r in cutlass.range_constexpr(self.rows_per_warp):
                i = warp * self.rows_per_warp + r
                acc = Float32(0.0)
                for q in cutlass.range_constexpr(self.fa_per_lane):
                    acc += mFb[h * d + i, lane * self.fa_per_lane + q].to(Float32) * fa[q]
                acc = cute.arch.warp_reduction_sum(acc)
                if lane == 0:
                    gr = acc.to(BFloat16).to(Float32) + mDt[h * d + i]
                    g = Float32(self.cfg.gate_lower_bound) * sigmoid(decay * gr)
                    s_eg[i] = cute.math.exp(g)
            if tid == d:
                s_beta[0] = sigmoid(mZ[row, 4 * P + d + h].to(Float32))
            cute.arch.sync_threads()
            # ‖q‖² from the warps of half 0, ‖k‖² from the warps of half 1.
            qk = s_qkv[kh * d + col]
            sq = cute.arch.warp_reduction_sum(qk * qk)
            if lane == 0:
                s_red[warp] = sq
            cute.arch.sync_threads()
            qn = Float32(0.0)
            kn = Float32(0.0)
            for w in cutlass.range_constexpr(self.warps // 2):
                qn += s_red[w]
                kn += s_red[w + self.warps // 2]
            q_scale = Float32(d ** -0.5) / cute.arch.fmax(cute.math.sqrt(qn), Float32(self.cfg.l2_eps))
            k_scale = Float32(1.0) / cute.arch.fmax(cute.math.sqrt(kn), Float32(self.cfg.l2_eps))
            # Decay, then this half's share of kᵀS.
            part = Float32(0.0)
            for j in cutlass.range_constexpr(half):
                key = kh * half + j
                S[j] = S[j] * s_eg[key]
                part += s_qkv[d + key] * S[j]
            s_part[kh, col] = part * k_scale
            cute.arch.sync_threads()
            kS = s_part[0, col] + s_part[1, col]
            u = s_beta[0] * (s_qkv[2 * d + col] - kS)
            cute.arch.sync_threads()                    # s_part is re-used below
            part = Float32(0.0)
            for j in cutlass.range_constexpr(half):
                key = kh * half + j
                S[j] = S[j] + s_qkv[d + key] * k_scale * u
                part += s_qkv[key] * S[j]
            s_part[kh, col] = part * q_scale
            cute.arch.sync_threads()
            o = s_part[0, col] + s_part[1, col]
            # Gated RMSNorm over the head's d outputs (the d threads of half 0 hold them).
            so = cute.arch.warp_reduction_sum(o * o)
            if lane == 0:
                s_red[warp] = so
            cute.arch.sync_threads()
            on = Float32(0.0)
            for w in cutlass.range_constexpr(self.warps // 2):
                on += s_red[w]
            if kh == 0:
                r = cute.math.rsqrt(on / d + Float32(self.cfg.norm_eps))
                gate = sigmoid(mZ[row, 3 * P + h * d + col].to(Float32))
                mOut[row, h * d + col] = (o * r * mOn[col].to(Float32) * gate).to(BFloat16)

        for j in cutlass.range_constexpr(half):
            mS[b, h, kh * half + j, col] = S[j]
        for c in cutlass.range_constexpr(self.ch_per_thread):
            ch = tid + c * self.threads
            if ch < self.nch:
                gch = (ch // d) * P + h * d + ch % d
                for j in cutlass.range_constexpr(CONV - 1):
                    mCs[b, gch, j] = hist[c, j].to(BFloat16)


def compile_for(cfg: KDAConfig) -> object:
    """The compiled kernel for `cfg` (cached)."""
    def build() -> object:
        bf, f32 = dummy_ptr(torch.bfloat16), dummy_ptr(torch.float32)
        return cute.compile(KDADecode(cfg), bf, bf, f32, bf, f32, f32, f32, bf, bf, Int32(1),
                            current_stream(), options=compile_options())
    return compiled(("kda", cfg), build)


def kda_decode(z: torch.Tensor, f_b: torch.Tensor, conv_w: torch.Tensor,
               conv_state: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
               rec_state: torch.Tensor, o_norm: torch.Tensor, cfg: KDAConfig) -> torch.Tensor:
    """Launch on the current stream; conv_state [B, 3P, 3] bf16 and rec_state [B, H, d, d] fp32
    advance in place by T tokens. z [B·T, R] bf16 (in_proj output). Returns out [B·T, P] bf16."""
    batch = conv_state.shape[0]
    if z.shape != (batch * cfg.tokens, cfg.in_proj_rows) or rec_state.dtype != torch.float32:
        raise ValueError("kda_decode: operand shapes do not match the config")
    out = torch.empty(z.shape[0], cfg.heads * cfg.head_dim, dtype=torch.bfloat16, device=z.device)
    compile_for(cfg)(ptr(z), ptr(f_b), ptr(conv_w), ptr(conv_state), ptr(dt_bias), ptr(a_log),
                     ptr(rec_state), ptr(o_norm), ptr(out), Int32(batch), current_stream())
    return out


if __name__ == "__main__":
    from kimi_decode.kernels.checks import main_kda
    main_kda()
