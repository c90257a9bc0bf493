"""The PDL chain (kernel "pdl_chain"): the fused layer's kernels launched with programmatic
dependent launch, each starting on the weights it owns while its predecessor still runs.

Why: at B = 1 the layer is a chain of ~10 kernels; a third of its time is kernels that move
almost no bytes (AttnRes, the KDA recurrence, moe_up: bench/ncu_fused_b1.md) during which HBM
idles, and every kernel boundary costs a drain, a launch and a ramp to the first bytes. With
PDL the next kernel's CTAs become resident while the current one runs and, before
`griddepcontrol.wait`, touch only what no kernel of the step writes (their weights): an L2
prefetch of the first bytes of each weight row (`cp.async.bulk.prefetch.L2`, off by default:
DEFAULT_BUDGET), or weights into registers: the whole row where a kernel holds it (gemv_rmsnorm,
moe_up, uk_insert's W_UK, o_proj's K = 768 row: gemv.column_preloaded), the first
split-K round of in_proj (gemv.CHAIN_PEEL); kda_fast loads its state and conv history there
(written by the previous step).

The protocol every chained kernel follows (enter() / release()):
1. pre-wait: only weights, state of earlier steps, or prefetches (a prefetch is a hint: it
   changes no result whatever it touches);
2. `griddepcontrol.wait`: returns once the previous kernel of the stream has completed and
   its writes are visible (a no-op for a kernel launched without PDL);
3. `griddepcontrol.launch_dependents`, only after the wait: so when kernel N+1 starts, every
   CTA of N has passed its wait, i.e. N-1 and everything before it are complete. That keeps
   at most one kernel ahead prefetching (not two weights racing for the L2), and makes the
   pre-wait reads of the experts' FC2 (the router's ids, written two kernels earlier) safe.
Early release (EARLY_RELEASE_MAX_ROWS, off by default): a kernel whose successors, wherever
the step launches it, read only constants before their wait (attn_res_mc: in_proj, the MoE
front, qkv_a + g; the preloaded plain GEMV, o_proj: attn_res_mc) may release at its START
(release() first, wait() where enter() was), so its successor becomes resident and streams its
weights one kernel earlier, e.g. the MoE front's W_gate during o_proj and mlp_res instead of
during mlp_res alone. Still safe: the successor's own wait returns only once this kernel has
completed, which is after this kernel's wait. Not for a kernel whose successor reads a
result of two kernels back before its wait (FC1: FC2 reads the router's ids there).
Signalled entry (gemv_mma_pair.SIGNAL, an A/B, off): q_b after the MLA pair releases at its
start and enters on a counter the pair's qkv_a CTAs bump, not on the pair's completion; its
own griddepcontrol.wait comes after its stores, so its completion still implies the pair's
and its successor (mla_glue: W_UK before its wait) sees the chain as before.
A kernel launched with PDL must call the wait before reading anything an earlier kernel of
the step wrote (or, as above, acquire a counter its writer released); a kernel not in the chain is launched as before and starts after its
predecessor completes (it never triggers early, so its successor, chained or not, waits for
its end). Results are bit-identical with and without the chain (only scheduling changes). Not chained:
the shared expert's down GEMV (gemv_situ) on the side stream: off the critical path, and a
kernel made resident by a release on another stream is a wait no trace can tell from work.

The mode is a process-wide flag (set by fused.enable(), as gemv.set_tuned), read when a kernel
is traced; `_common.compiled` puts it in every compile key, so a kernel compiled with the
chain is never launched without it or the other way round.

L2 budget: a chained GEMV prefetches at most `budget` bytes in all (the first
`row_prefetch_bytes(row, rows)` bytes of each weight row), so its prefetch does not evict
itself from the H200's 50 MB L2 while the previous kernel runs. Measured: no budget helped
(DEFAULT_BUDGET below), so by default nothing is prefetched; the GEMVs' pre-wait part is
then empty and the register-row kernels keep their early loads.
"""
from __future__ import annotations

import kimi_decode.kernels  # noqa: F401  (sm_90a target)

import cutlass
import cutlass.cute as cute
from cutlass.experimental.primitives.nvvm_wrapper import cp_async_bulk_prefetch

# Bytes a chained kernel prefetches before its wait, in all. 0: PDL alone. The first device
# check (H200, 2026-12-03, bench/fused_runs.md) timed the B = 1 layers at 0 / 8 / 16 / 32 MB:
# KDA 85.7-85.9 / 85.4-86.0 / 86.7-86.9 / 88.3-88.6 us (90.2-90.5 without the chain), MLA
# 110.5 / 110.5 / 111.2 / 113.0 (114.0): the prefetch gains nothing and large ones cost, so
# the chain's gain is the hidden launch and ramp, and the default prefetches nothing.
DEFAULT_BUDGET = 0

_state: dict[str, object] = {"on": False, "budget": DEFAULT_BUDGET}
# Early release (module docstring) for launches of at most this many rows (M); 0: never.
# Measured at 1 (H100, d65a12f, bench/fused_runs.md session 20): B = 1 layers within 0.3 us of
# 0 (102.3-102.5 / 116.3 vs 102.0-102.5 / 116.2-116.6; 4-layer step graph 423.6 vs
# 423.2 / 423.3, where moe_up's early release acts too); in the graph trace in_proj started
# 3.4 us earlier but the layer's AttnRes ran 1.1 us longer under its weight loads. Kept off.
# Read by the wrappers when they build a config (attn_res_mc, gemv), so it is part of each
# compile key through the config's `early` field; `bench/fused_device.py --patch` A/Bs it.
EARLY_RELEASE_MAX_ROWS = 0


def set_chain(on: bool, budget: int | None = None) -> None:
    """Trace kernels with the PDL chain (on) or as before (off); `budget` caps each chained
    kernel's pre-wait L2 prefetch (bytes)."""
    _state["on"] = bool(on)
    if budget is not None:
        if budget < 0:
            raise ValueError(f"PDL chain prefetch budget must be >= 0 bytes, got {budget}")
        _state["budget"] = int(budget)


def chain_on() -> bool:
    return bool(_state["on"])


def key() -> tuple[bool, int]:
    """What a compile cache key must hold of the mode: (on, budget), or (False, 0) when off."""
    return (True, int(_state["budget"])) if chain_on() else (False, 0)


def early_release(rows: int) -> bool:
    """Whether a kernel that may release early (module docstring) does so at M = rows: the
    chain on and rows ≤ EARLY_RELEASE_MAX_ROWS."""
    return chain_on() and 1 <= rows <= EARLY_RELEASE_MAX_ROWS


def row_prefetch_bytes(row_bytes: int, rows: int) -> int:
    """Bytes of each of `rows` weight rows of `row_bytes` to prefetch before the wait: the
    budget shared equally, at most the row, a multiple of 16 (the bulk prefetch's unit); 0
    when the chain is off."""
    if not chain_on() or rows <= 0:
        return 0
    return min(row_bytes, int(_state["budget"]) // rows) // 16 * 16


@cute.jit
def prefetch(src: cute.Pointer, nbytes: cutlass.Constexpr[int]):
    """One bulk L2 prefetch of `nbytes` (a multiple of 16, > 0) from 16-byte aligned `src`
    (call it from one thread per row)."""
    if cutlass.const_expr(nbytes > 0):
        cp_async_bulk_prefetch(src, nbytes)


@cute.jit
def enter():
    """Step 2 and 3 of the protocol (wait, then release the next kernel); nothing when the
    chain is off, so the kernels' code is unchanged there."""
    if cutlass.const_expr(chain_on()):
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def wait():
    """Step 2 alone: a kernel that releases its successor later (router_mma: only once its
    grid has finished streaming, so the successor's waiting CTAs do not take the SMs the
    other stream's kernels still need) calls release() there; nothing when the chain is off."""
    if cutlass.const_expr(chain_on()):
        cute.arch.griddepcontrol_wait()


@cute.jit
def enter_or_wait(early: cutlass.Constexpr[bool]):
    """enter() where the kernel has not released yet; wait() alone where it released at its
    start (`early`, see begin())."""
    if cutlass.const_expr(early):
        wait()
    else:
        enter()


@cute.jit
def begin(early: cutlass.Constexpr[bool]):
    """At a kernel's start: release its successor now when `early` (module docstring: early
    release); nothing otherwise."""
    if cutlass.const_expr(early):
        release()


@cute.jit
def release():
    """Release the next kernel only (a kernel outside the chain whose successor may start
    prefetching now: it never reads before its own wait); nothing when the chain is off."""
    if cutlass.const_expr(chain_on()):
        cute.arch.griddepcontrol_launch_dependents()
