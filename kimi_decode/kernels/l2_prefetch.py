"""L2 prefetch side kernel: `cp.async.bulk.prefetch.L2.global` over a weight's bytes, so the
next layer's first GEMM finds them in L2 (KIMI_K3.md §2.5, "weight prefetch into L2 by a side
kernel during communication"; local-inference-lab/vllm #592, K3OPT `L2PF`).

It writes nothing and computes nothing: each thread issues one bulk prefetch of CHUNK bytes
(the last one trimmed to a multiple of 16), grid = ceil(bytes / (CHUNK · threads)). The
instructions are asynchronous and best-effort, so the kernel ends as soon as they are issued;
the traffic it starts overlaps the main stream's work when launched on a side stream. The
decode step runs it under its own NVTX op `prefetch`, so the prefetch analysis can measure how
much of it hides under other work and whether the consumer got faster.

Check on the GPU (times a GEMV on a weight with and without a preceding prefetch):
    python -m kimi_decode.kernels.l2_prefetch
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.experimental.primitives.nvvm_wrapper import cp_async_bulk_prefetch

from kimi_decode.kernels._common import compile_options, compiled, current_stream, dummy_ptr, ptr

CHUNK = 16384     # bytes per prefetch instruction
THREADS = 128


def can_implement(nbytes: int, dtypes: tuple[torch.dtype, ...] = ()) -> bool:
    """Any 16-byte-aligned region whose size is a multiple of 16 bytes."""
    return nbytes > 0 and nbytes % 16 == 0


class L2Prefetch:
    """Prefetch `nbytes` bytes from `src` into L2."""

    @cute.jit
    def __call__(self, src: cute.Pointer, nbytes: Int32, stream: cuda.CUstream):
        mSrc = cute.make_tensor(src, cute.make_layout(nbytes))
        per_cta = CHUNK * THREADS
        self.kernel(mSrc, nbytes).launch(grid=[(nbytes + per_cta - 1) // per_cta, 1, 1],
                                         block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mSrc: cute.Tensor, nbytes: Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        off = (bid * THREADS + tid) * CHUNK
        if off < nbytes:
            size = cutlass.min(nbytes - off, Int32(CHUNK))
            cp_async_bulk_prefetch(mSrc.iterator + off, size)


def compile_kernel() -> object:
    """The compiled kernel (one for all sizes; cached)."""
    return compiled("l2_prefetch", lambda: cute.compile(
        L2Prefetch(), dummy_ptr(torch.uint8), Int32(16), current_stream(), options=compile_options()))


def prefetch_l2(t: torch.Tensor, nbytes: int | None = None) -> None:
    """Prefetch the first `nbytes` (default: all) of contiguous tensor `t` into L2, on the
    current stream."""
    total = t.numel() * t.element_size()
    n = min(total, nbytes or total) // 16 * 16
    if not can_implement(n):
        return
    compile_kernel()(ptr(t.view(torch.uint8).reshape(-1)), Int32(n), current_stream())


if __name__ == "__main__":
    from kimi_decode.kernels.checks import main_prefetch
    main_prefetch()
