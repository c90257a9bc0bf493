"""AttnRes mix + RMSNorm in one kernel (KIMI_K3.md §1.3; vLLM's `kimi_k3_attn_res`).

What it fuses, for each row m (a token) of the step:
    prefix' = prefix + delta                       (optional: the previous sublayer's output)
    blocks[slot] = prefix'                         (optional: a new AttnRes block starts)
    sources v_0..v_nb = [blocks[0:nb]..., prefix']
    score_s = <v_s / rms(v_s), w_norm ⊙ w_proj>    rms(v) = sqrt(mean(v²) + eps), fp32
    p = softmax(score)                             over the nb + 1 sources
    h = Σ_s p_s v_s                                the RAW sources, fp32
    out = RMSNorm(h; norm_weight, eps)             bf16
The stock path issues this as a dozen torch kernels (stack, norm, product, softmax, weighted
sum, RMSNorm, casts); here it is one launch.

Layout: one CTA per row; D/8 vectors of 8 elements per row, VPT vectors per thread (so
threads = D / (8·VPT), a multiple of 32; at D = 7168 VPT = 4 gives 224 threads). Pass 1
streams every source once and accumulates, per source, Σv² and Σv·w (w = w_norm ⊙ w_proj,
fp32, folded once at load time); one CTA reduction per accumulator. Pass 2 re-reads the
sources (L1/L2-resident: at most 9 × 14 KB per row), keeps h in registers (8·VPT floats),
reduces Σh² and writes the normalised row with 128-bit stores.
score_s uses <v/rms, w> = <v, w> / rms, which needs no normalised copy of v.

Check on the GPU (compares with the stock path's own ops and times both):
    python -m kimi_decode.kernels.attn_res
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from kimi_decode.kernels._common import (compile_options, TORCH_TO_CUTE, block_sum, compiled, current_stream,
                                         dummy_ptr, ptr)

VEC = 8          # elements per 128-bit bf16 vector
MAX_SOURCES = 9  # 8 stored blocks + the live prefix (K3: ceil(93 / 12) = 8)


@dataclass(frozen=True)
class AttnResConfig:
    """Compile-time choices: sizes, dtypes, and which optional steps the call performs."""

    hidden: int
    num_blocks: int              # nb: stored blocks mixed (the prefix is one more source)
    slots: int                   # blocks buffer holds [M, slots, hidden]
    has_delta: bool              # prefix' = prefix + delta (and prefix' written back)
    has_write: bool              # blocks[m, write_slot] = prefix'
    source_dtype: torch.dtype = torch.bfloat16   # blocks, prefix, delta
    out_dtype: torch.dtype = torch.bfloat16
    vec_per_thread: int = 4

    @property
    def threads(self) -> int:
        return self.hidden // (VEC * self.vec_per_thread)


def can_implement(hidden: int, num_blocks: int, slots: int, dtypes: tuple[torch.dtype, ...],
                  vec_per_thread: int = 4) -> bool:
    """Shapes and dtypes this kernel supports (checked before compiling)."""
    threads = hidden // (VEC * vec_per_thread)
    return (hidden % (VEC * vec_per_thread) == 0 and threads % 32 == 0 and 32 <= threads <= 1024
            and 0 <= num_blocks <= slots and num_blocks + 1 <= MAX_SOURCES
            and all(d in (torch.bfloat16, torch.float16, torch.float32) for d in dtypes))


class AttnResRMSNorm:
    """out = RMSNorm(AttnRes mix of [blocks[0:nb], prefix(+delta)]); see the module docstring."""

    def __init__(self, cfg: AttnResConfig) -> None:
        self.cfg = cfg
        self.D = cfg.hidden
        self.nv = cfg.hidden // VEC
        self.vpt = cfg.vec_per_thread
        self.threads = cfg.threads
        self.warps = self.threads // 32
        self.nsrc = cfg.num_blocks + 1
        self.src_t = TORCH_TO_CUTE[cfg.source_dtype]
        self.out_t = TORCH_TO_CUTE[cfg.out_dtype]

    def _rows(self, p: cute.Pointer, m: Int32) -> cute.Tensor:
        return cute.make_tensor(p, cute.make_layout((m, self.nv, VEC), stride=(self.D, VEC, 1)))

    @cute.jit
    def __call__(self, out: cute.Pointer, blocks: cute.Pointer, prefix: cute.Pointer,
                 delta: cute.Pointer, prefix_out: cute.Pointer, w_mix: cute.Pointer,
                 norm_w: cute.Pointer, m: Int32, write_slot: Int32, eps: Float32,
                 stream: cuda.CUstream):
        slots = self.cfg.slots
        mBlk = cute.make_tensor(blocks, cute.make_layout((m, slots, self.nv, VEC),
                                                         stride=(slots * self.D, self.D, VEC, 1)))
        mW = cute.make_tensor(w_mix, cute.make_layout((self.nv, VEC), stride=(VEC, 1)))
        mN = cute.make_tensor(norm_w, cute.make_layout((self.nv, VEC), stride=(VEC, 1)))
        self.kernel(self._rows(out, m), mBlk, self._rows(prefix, m), self._rows(delta, m),
                    self._rows(prefix_out, m), mW, mN, write_slot, eps).launch(
            grid=[m, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.jit
    def load_source(self, s: cutlass.Constexpr[int], row: Int32, c: Int32, mBlk: cute.Tensor,
                    mP: cute.Tensor, mDel: cute.Tensor, buf: cute.Tensor, acc: cute.Tensor):
        """acc[0:8] = source s at vector c of `row`, in fp32 (prefix' = prefix + delta)."""
        if cutlass.const_expr(s < self.cfg.num_blocks):
            cute.autovec_copy(mBlk[row, s, c, None], buf)
            for j in cutlass.range_constexpr(VEC):
                acc[j] = buf[j].to(Float32)
        else:
            cute.autovec_copy(mP[row, c, None], buf)
            for j in cutlass.range_constexpr(VEC):
                acc[j] = buf[j].to(Float32)
            if cutlass.const_expr(self.cfg.has_delta):
                # prefix' is stored in the source dtype, and the mix reads the stored value
                cute.autovec_copy(mDel[row, c, None], buf)
                for j in cutlass.range_constexpr(VEC):
                    acc[j] = (acc[j] + buf[j].to(Float32)).to(self.src_t).to(Float32)

    @cute.kernel
    def kernel(self, mOut: cute.Tensor, mBlk: cute.Tensor, mP: cute.Tensor, mDel: cute.Tensor,
               mPOut: cute.Tensor, mW: cute.Tensor, mN: cute.Tensor, write_slot: Int32,
               eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout((2 * self.nsrc + 1, self.warps),
                                                             stride=(self.warps, 1)))
        buf = cute.make_rmem_tensor(cute.make_layout(VEC), self.src_t)
        wbuf = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
        acc = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
        ss = cute.make_rmem_tensor(cute.make_layout(self.nsrc), Float32)
        dw = cute.make_rmem_tensor(cute.make_layout(self.nsrc), Float32)
        score = cute.make_rmem_tensor(cute.make_layout(self.nsrc), Float32)

        # Pass 1: per source, sum of squares and dot with w (and prefix' written once).
        for s in cutlass.range_constexpr(self.nsrc):
            a_ss = Float32(0.0)
            a_dw = Float32(0.0)
            for i in cutlass.range_constexpr(self.vpt):
                c = tidx + i * self.threads
                cute.autovec_copy(mW[c, None], wbuf)
                self.load_source(s, row, c, mBlk, mP, mDel, buf, acc)
                for j in cutlass.range_constexpr(VEC):
                    a_ss += acc[j] * acc[j]
                    a_dw += acc[j] * wbuf[j]
                if cutlass.const_expr(s == self.nsrc - 1 and self.cfg.has_delta):
                    for j in cutlass.range_constexpr(VEC):
                        buf[j] = acc[j].to(self.src_t)
                    cute.autovec_copy(buf, mPOut[row, c, None])
                    if cutlass.const_expr(self.cfg.has_write):
                        cute.autovec_copy(buf, mBlk[row, write_slot, c, None])
            ss[s] = block_sum(a_ss, red, 2 * s, self.warps)
            dw[s] = block_sum(a_dw, red, 2 * s + 1, self.warps)

        # Softmax over sources of <v, w> / rms(v) (every thread, redundantly: nsrc <= 9).
        best = Float32(-3.0e38)
        for s in cutlass.range_constexpr(self.nsrc):
            score[s] = dw[s] * cute.math.rsqrt(ss[s] / self.D + eps)
            best = cute.arch.fmax(best, score[s])
        tot = Float32(0.0)
        for s in cutlass.range_constexpr(self.nsrc):
            score[s] = cute.math.exp(score[s] - best)
            tot += score[s]
        for s in cutlass.range_constexpr(self.nsrc):
            score[s] = score[s] / tot

        # Pass 2: h = sum_s p_s v_s kept in registers, then RMSNorm.
        h = cute.make_rmem_tensor(cute.make_layout((self.vpt, VEC), stride=(VEC, 1)), Float32)
        h.fill(0.0)
        for s in cutlass.range_constexpr(self.nsrc):
            for i in cutlass.range_constexpr(self.vpt):
                c = tidx + i * self.threads
                self.load_source(s, row, c, mBlk, mP, mDel, buf, acc)
                for j in cutlass.range_constexpr(VEC):
                    h[i, j] = h[i, j] + score[s] * acc[j]
        a_h = Float32(0.0)
        for i in cutlass.range_constexpr(self.vpt):
            for j in cutlass.range_constexpr(VEC):
                a_h += h[i, j] * h[i, j]
        r = cute.math.rsqrt(block_sum(a_h, red, 2 * self.nsrc, self.warps) / self.D + eps)
        obuf = cute.make_rmem_tensor(cute.make_layout(VEC), self.out_t)
        nbuf = cute.make_rmem_tensor(cute.make_layout(VEC), mN.element_type)
        for i in cutlass.range_constexpr(self.vpt):
            c = tidx + i * self.threads
            cute.autovec_copy(mN[c, None], nbuf)
            for j in cutlass.range_constexpr(VEC):
                obuf[j] = (h[i, j] * r * nbuf[j].to(Float32)).to(self.out_t)
            cute.autovec_copy(obuf, mOut[row, c, None])


def compile_for(cfg: AttnResConfig, norm_dtype: torch.dtype) -> object:
    """The compiled kernel for `cfg` (cached; compiles to sm_90a PTX even without a GPU)."""
    def build() -> object:
        src = dummy_ptr(cfg.source_dtype)
        return cute.compile(AttnResRMSNorm(cfg), dummy_ptr(cfg.out_dtype), src, src, src, src,
                            dummy_ptr(torch.float32), dummy_ptr(norm_dtype), Int32(1), Int32(0),
                            Float32(1e-5), current_stream(), options=compile_options())
    return compiled(("attn_res", cfg, norm_dtype), build)


def attn_res_rmsnorm(blocks: torch.Tensor, num_blocks: int, prefix: torch.Tensor,
                     w_mix: torch.Tensor, norm_w: torch.Tensor, eps: float,
                     delta: torch.Tensor | None = None, write_slot: int | None = None,
                     out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch on the current stream. blocks [M, slots, D]; prefix, delta [M, D]; w_mix [D] fp32
    (w_norm ⊙ w_proj); norm_w [D]. Returns (out [M, D] bf16, prefix' [M, D]); with a delta,
    prefix' is a new tensor (and blocks[:, write_slot] is overwritten by it when asked)."""
    m, slots, d = blocks.shape
    if write_slot is not None and delta is None:  # nothing to compute: prefix' is prefix
        blocks[:, write_slot].copy_(prefix)
        write_slot = None
    cfg = AttnResConfig(d, num_blocks, slots, delta is not None, write_slot is not None,
                        prefix.dtype)
    if not can_implement(d, num_blocks, slots, (prefix.dtype, blocks.dtype, norm_w.dtype)):
        raise ValueError(f"attn_res kernel cannot run hidden={d} nb={num_blocks} slots={slots}")
    if blocks.dtype != prefix.dtype or (delta is not None and delta.dtype != prefix.dtype):
        raise ValueError("blocks, prefix and delta must share one dtype")
    if w_mix.dtype != torch.float32:
        raise ValueError("w_mix must be fp32")
    out = torch.empty(m, d, dtype=torch.bfloat16, device=prefix.device) if out is None else out
    new_prefix = torch.empty_like(prefix) if delta is not None else prefix
    fn = compile_for(cfg, norm_w.dtype)
    fn(ptr(out), ptr(blocks), ptr(prefix), ptr(delta if delta is not None else prefix),
       ptr(new_prefix), ptr(w_mix), ptr(norm_w), Int32(m), Int32(write_slot or 0), Float32(eps),
       current_stream())
    return out, new_prefix


def reference(blocks: torch.Tensor, num_blocks: int, prefix: torch.Tensor, w_mix: torch.Tensor,
              norm_w: torch.Tensor, eps: float, delta: torch.Tensor | None = None) -> torch.Tensor:
    """float64 statement of the formula in the module docstring (for the kernel check only;
    the parity check against stock lives in the fused-vs-stock test)."""
    p = prefix if delta is None else prefix + delta     # stored in prefix's dtype first
    p = p.double()
    v = torch.cat([blocks[:, :num_blocks].double(), p[:, None]], dim=1)      # [M, S, D]
    rms = (v.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    prob = ((v / rms) @ w_mix.double()).softmax(-1)                          # [M, S]
    h = (prob[..., None] * v).sum(1)
    return h * (h.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * norm_w.double()


if __name__ == "__main__":
    from kimi_decode.kernels.checks import main_attn_res
    main_attn_res()
