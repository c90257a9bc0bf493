"""A late writer for the PDL chain's device checks: a kernel that releases its successor at
once, waits `delay_ns` on the global timer, and only then writes rows into a buffer.

Why: a chained kernel (kernels/chain.py) may read before its griddepcontrol.wait only what no
kernel of the step writes. Where it reads a buffer that its predecessor writes in part (the
MLA cache: uk_insert writes this step's rows, mla_attend_mma.PRE_WAIT_TILES reads the others
before the wait and re-loads those rows after it), a step-parity check catches a missing
re-load only if the race happens to go the wrong way. Launched just before that kernel, this
writer makes it go the wrong way every time: the successor is resident and past its pre-wait
loads long before the rows land, so it sees their old contents (poisoned by the check) unless
it loads them again after the wait. The check's negative control (the kernel built without
the re-load) shows that the race was exercised. The delay must outlast the host's launch of
that kernel (tens of µs from Python), not just the kernel's own start: callers use ~ms.

Layout: grid (B, 1, 1), 128 threads; CTA b copies src[b, t, :] to dst[b, last[t], :] for the
T positions last[0 .. T-1] (bf16 rows of D values, D % 8 == 0), 128-bit vectors.
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from kimi_decode.kernels._common import compile_options, compiled, current_stream, dummy_ptr, ptr

THREADS = 128
VEC = 8


@dataclass(frozen=True)
class WriterConfig:
    """Rows per sequence T (the positions in `last`), values per row D."""

    tokens: int
    dim: int


class DelayedRowWriter:
    """dst[b, last[t], :] = src[b, t, :], written `delay_ns` after the kernel's start and after
    griddepcontrol.launch_dependents (issued first, whether or not the chain mode is on)."""

    def __init__(self, cfg: WriterConfig):
        self.cfg = cfg
        self.T, self.D = cfg.tokens, cfg.dim

    @cute.jit
    def __call__(self, src: cute.Pointer, dst: cute.Pointer, last: cute.Pointer, batch: Int32, rows: Int32,
                 delay_ns: Int32, stream: cuda.CUstream):
        NV = self.D // VEC
        mS = cute.make_tensor(src, cute.make_layout((batch * self.T, NV, VEC), stride=(self.D, VEC, 1)))
        mD = cute.make_tensor(dst, cute.make_layout((batch * rows, NV, VEC), stride=(self.D, VEC, 1)))
        mL = cute.make_tensor(last, cute.make_layout(self.T))
        self.kernel(mS, mD, mL, rows, delay_ns).launch(grid=[batch, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mS: cute.Tensor, mD: cute.Tensor, mL: cute.Tensor, rows: Int32, delay_ns: Int32):
        tid, _, _ = cute.arch.thread_idx()
        b, _, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_launch_dependents()
        t0 = cute.arch.globaltimer()
        now = t0
        while now - t0 < delay_ns.to(cutlass.Int64):
            now = cute.arch.globaltimer()
        NV = self.D // VEC
        for i in range(tid, self.T * NV, THREADS):
            t = i // NV
            v = i - t * NV
            r = mL[t].to(Int32)
            buf = cute.make_rmem_tensor(cute.make_layout(VEC), cutlass.BFloat16)
            cute.autovec_copy(mS[b * self.T + t, v, None], buf)
            cute.autovec_copy(buf, mD[b * rows + r, v, None])


def compile_for(cfg: WriterConfig) -> object:
    def build() -> object:
        bf = dummy_ptr(torch.bfloat16)
        return cute.compile(DelayedRowWriter(cfg), bf, bf, dummy_ptr(torch.int64), Int32(1), Int32(1), Int32(1),
                            current_stream(), options=compile_options())
    return compiled(("chain_writer", cfg), build)


def write_rows_late(src: torch.Tensor, dst: torch.Tensor, last: torch.Tensor, delay_ns: int) -> None:
    """dst[b, last[t]] = src[b, t] on the current stream, `delay_ns` after the kernel starts
    (its successor released at once). src [B, T, D], dst [B, C, D] bf16, last [T] int64."""
    B, T, D = src.shape
    if (dst.dim() != 3 or dst.shape[0] != B or dst.shape[2] != D or last.shape != (T,)
            or src.dtype != torch.bfloat16 or dst.dtype != torch.bfloat16 or last.dtype != torch.int64
            or D % VEC or not 0 <= delay_ns < 2 ** 31):
        raise ValueError(f"write_rows_late: src {tuple(src.shape)} dst {tuple(dst.shape)} last {tuple(last.shape)}")
    compile_for(WriterConfig(T, D))(ptr(src.contiguous()), ptr(dst), ptr(last), Int32(B), Int32(dst.shape[1]),
                                    Int32(delay_ns), current_stream())
