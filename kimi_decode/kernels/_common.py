"""Small pieces every kernel module shares: pointers from torch tensors, the current stream,
a compile cache, and a CTA-wide sum.

Kernels take raw pointers plus runtime sizes (as NVIDIA's CuTe DSL rmsnorm example does), so
one compiled kernel serves every call of a configuration and a call costs a few pointer
conversions instead of a DLPack export per tensor.
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sets the sm_90a target before cutlass is imported)

import functools
from collections.abc import Callable
from typing import Any

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.runtime import make_ptr

TORCH_TO_CUTE = {
    torch.bfloat16: cutlass.BFloat16,
    torch.float16: cutlass.Float16,
    torch.float32: cutlass.Float32,
    torch.int32: cutlass.Int32,
    torch.int64: cutlass.Int64,
    torch.uint8: cutlass.Uint8,
}
ALIGN = 16  # bytes: every pointer we pass is 16-byte aligned (checked in ptr())


H200_SMS = 132   # the SM count assumed where there is no CUDA device (the CPU tests)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device | str) -> int:
    """SMs of `device` (132 on the H200), from torch; H200_SMS on a CPU device."""
    device = torch.device(device)
    if device.type != "cuda":
        return H200_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def ptr(t: torch.Tensor) -> cute.Pointer:
    """A global-memory pointer to `t`'s data; `t` must be contiguous and 16-byte aligned."""
    if not t.is_contiguous():
        raise ValueError("kernel operands must be contiguous")
    if t.data_ptr() % ALIGN:
        raise ValueError(f"kernel operand not {ALIGN}-byte aligned")
    return make_ptr(TORCH_TO_CUTE[t.dtype], t.data_ptr(), cute.AddressSpace.gmem, assumed_align=ALIGN)


def dummy_ptr(dtype: torch.dtype) -> cute.Pointer:
    """A placeholder pointer with the right element type, for compiling without data."""
    return make_ptr(TORCH_TO_CUTE[dtype], ALIGN, cute.AddressSpace.gmem, assumed_align=ALIGN)


def compile_options(extra: str = "") -> str:
    """`--gpu-arch sm_90a` unless a GPU is present (then the DSL targets the GPU it finds).
    Passed explicitly because the environment default is read once, when cutlass is first
    imported, which may happen before this package is."""
    arch = "" if torch.cuda.is_available() else "--gpu-arch sm_90a"
    return " ".join(x for x in (arch, extra) if x)


def current_stream() -> cuda.CUstream:
    """torch's current CUDA stream (so kernels join CUDA-graph capture), or the null stream."""
    if torch.cuda.is_available():
        return cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    return cuda.CUstream(0)


_CACHE: dict[Any, Any] = {}


def compiled(key: Any, build: Callable[[], Any]) -> Any:
    """Compile once per key (a kernel class plus its compile-time configuration) and PDL chain
    mode (kernels/chain.py: a kernel traced with the chain is never launched without it)."""
    from kimi_decode.kernels import chain
    key = (key, chain.key())
    fn = _CACHE.get(key)
    if fn is None:
        fn = _CACHE[key] = build()
    return fn


@cute.jit
def block_sum(val: Float32, red: cute.Tensor, slot: Int32, num_warps: cutlass.Constexpr[int]) -> Float32:
    """Sum of `val` over all threads of the CTA: warp shuffles, then one value per warp in
    `red[slot, warp]` (shared memory), then every thread adds the warp sums. The caller makes
    sure `slot` is not reused before all threads have read it (two slots alternate, or a
    barrier)."""
    val = cute.arch.warp_reduction_sum(val)
    # warp_idx() is a full-warp shuffle (it makes the index warp-uniform): call it with all
    # 32 lanes, never inside the lane-0 branch (that deadlocked the GPU in the first check)
    warp = cute.arch.warp_idx()
    if cute.arch.lane_idx() == 0:
        red[slot, warp] = val
    cute.arch.sync_threads()
    total = Float32(0.0)
    for w in cutlass.range_constexpr(num_warps):
        total += red[slot, w]
    return total


@cute.jit
def arrive_count(mC: cute.Tensor, flag: cute.Tensor, tidx: Int32):
    """Grid completion, the arrival (router.py's pattern, also router_fast's and router_mma's):
    a CTA barrier, then thread 0 fences and bumps counter mC[0] (atom.add acq_rel, gpu scope)
    and leaves the value it read in flag[0] (shared memory), then a barrier. The CTA that reads
    gridDim − 1 is the last: every other CTA's writes are visible to it after its own fence.
    Each thread that stored something the last CTA reads fences (fence.acq_rel.gpu) before."""
    cute.arch.sync_threads()
    if tidx == 0:
        cute.arch.fence_acq_rel_gpu()
        old = cute.arch.atomic_add(mC.iterator, Int32(1), sem="acq_rel", scope="gpu")
        flag[0] = old
    cute.arch.sync_threads()


@cute.jit
def grid_arrive_and_wait(mCnt: cute.Tensor, cnt: Int32, ep: Int32, arrivals: Int32):
    """One thread per CTA (the caller's thread 0, between two CTA barriers, then a
    fence.acq_rel.gpu by every thread): a grid barrier of `arrivals` CTAs by sense reversal on
    counter mCnt[cnt] and epoch mCnt[ep] (int32, zero at creation). Read the epoch E (acquire),
    fence, arrive on the counter; the last to arrive re-zeroes it and bumps the epoch (release),
    the others poll until the epoch is no longer E. E is read before the arrival and the epoch
    moves only once all have arrived, so no CTA can take the new epoch for its E; the epoch is
    never re-zeroed, so the counter is zero between calls (CUDA-graph replays need no reset).
    Every CTA must be resident at once. Used by mla_attend's grid merge and moe_up_grid."""
    epp = mCnt.iterator + ep
    epoch = cute.arch.load(epp.llvm_ptr, Int32, sem="acquire", scope="gpu")
    cute.arch.fence_acq_rel_gpu()
    old = cute.arch.atomic_add(mCnt.iterator + cnt, Int32(1), sem="acq_rel", scope="gpu")
    if old == arrivals - 1:               # the last to arrive: every CTA's writes are done
        mCnt[cnt] = Int32(0)
        cute.arch.atomic_add(epp, Int32(1), sem="release", scope="gpu")
    else:
        seen = epoch
        while seen == epoch:
            seen = cute.arch.load(epp.llvm_ptr, Int32, sem="acquire", scope="gpu")


@cute.jit
def signal_count(mC: cute.Tensor, tidx: Int32):
    """A producer CTA's "my results are written" to CTAs of another grid (the CUTLASS
    semaphore pattern, as grid_arrive_and_wait's arrival): a CTA barrier (every thread's stores
    issued), then thread 0 fences (fence.acq_rel.gpu) and bumps mC[0] (atom.add release, gpu
    scope). Consumers: wait_count."""
    cute.arch.sync_threads()
    if tidx == 0:
        cute.arch.fence_acq_rel_gpu()
        cute.arch.atomic_add(mC.iterator, Int32(1), sem="release", scope="gpu")


@cute.jit
def wait_count(mC: cute.Tensor, target: cutlass.Constexpr[int], tidx: Int32):
    """A consumer CTA waits until `target` producers have signalled (signal_count): thread 0
    polls mC[0] (ld.acquire.gpu) until it reaches `target`, a CTA barrier, then every thread
    fences (fence.acq_rel.gpu), as after grid_arrive_and_wait. The producers must be resident or
    sure to become so without this CTA's resources (no deadlock otherwise); the counter is
    re-zeroed by whoever knows every consumer has passed."""
    if tidx == 0:
        seen = cute.arch.load(mC.iterator.llvm_ptr, Int32, sem="acquire", scope="gpu")
        while seen < target:
            seen = cute.arch.load(mC.iterator.llvm_ptr, Int32, sem="acquire", scope="gpu")
    cute.arch.sync_threads()
    cute.arch.fence_acq_rel_gpu()


@cute.jit
def sigmoid(x: Float32) -> Float32:
    """1 / (1 + exp(-x))."""
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x))


def cuda_available() -> bool:
    """True when kernels can be launched (a GPU and its driver are present)."""
    return torch.cuda.is_available()


__all__ = ["ptr", "dummy_ptr", "compile_options", "current_stream", "compiled", "block_sum", "arrive_count",
           "grid_arrive_and_wait", "signal_count", "wait_count",
           "sigmoid", "Int32", "Float32"]
