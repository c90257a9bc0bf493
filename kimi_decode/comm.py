"""Collectives and side streams for one rank's decode step.

The model calls three collectives and never asks how they are done:
- `all_reduce(x)`: sum of the tp partials of x [M, N];
- `reduce_scatter_cols(x)`: sum of the partials, keeping this rank's column slice [M, N/tp];
- `all_gather_cols(x)`: the tp column slices concatenated [M, N].
`LocalComm` (tp = 1) is the identity, `DistComm` uses torch.distributed (NCCL on GPUs, gloo on
the CPU), `SimComm` stands in for TP on one GPU: each collective is a local kernel that reads
the `world` partials it would receive from a persistent [world, M, N] buffer (this rank's
partial in its slot, the other ranks' slots zero, so the math is "the other ranks contributed
zero") on its own stream, with event waits so the dependency is real.

`SideStream` runs a block on a second stream (vLLM's aux stream for the latent down-projection
and MLA g_proj) with a fork/join that CUDA-graph capture records; on the CPU it is a no-op.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist


# CUDA priority of the aux stream (lower is higher; 0, CUDA's lowest, is every stream's
# default). Measured on the H200 against runner.MAIN_STREAM_PRIORITY: see there.
SIDE_STREAM_PRIORITY = 0


class SideStream:
    """Fork onto `stream` and join back; outputs made there are marked as used on the main stream."""

    def __init__(self, device: torch.device) -> None:
        self.stream = (torch.cuda.Stream(device, priority=SIDE_STREAM_PRIORITY)
                       if device.type == "cuda" else None)

    @contextlib.contextmanager
    def run(self, *inputs: torch.Tensor) -> Iterator[list[torch.Tensor]]:
        """`with side.run(x) as outs: outs.append(f(x))`: f runs on the side stream."""
        outs: list[torch.Tensor] = []
        if self.stream is None:
            yield outs
            return
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        for t in inputs:
            t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            yield outs
        main.wait_stream(self.stream)
        for t in outs:
            t.record_stream(main)


class LocalComm:
    """tp = 1: every collective is the identity."""

    simulated = False
    tp, rank = 1, 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def reduce_scatter_cols(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather_cols(self, x: torch.Tensor) -> torch.Tensor:
        return x


class DistComm:
    """Real collectives over the default torch.distributed process group."""

    simulated = False

    def __init__(self) -> None:
        self.tp, self.rank = dist.get_world_size(), dist.get_rank()
        self.nccl = dist.get_backend() == "nccl"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x)
        return x

    def reduce_scatter_cols(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1] // self.tp
        if self.nccl:  # scatter along dim 0 of the transpose = columns of x
            out = torch.empty(n, x.shape[0], dtype=x.dtype, device=x.device)
            dist.reduce_scatter_tensor(out, x.t().contiguous())
            return out.t()
        full = self.all_reduce(x)  # gloo has no reduce-scatter: same result, more bytes
        return full[:, self.rank * n:(self.rank + 1) * n]

    def all_gather_cols(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.tp)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=1)


class SimComm:
    """tp_sim: each collective is a local kernel of the real size on its own stream.

    Buffers persist across steps (made on the first, eager, call), so a captured graph
    replays only the collective's own kernels: a copy of this rank's partial into its slot
    and the reduction (or gather) over all `world` slots.
    """

    simulated = True

    def __init__(self, device: torch.device, world: int, rank: int = 0) -> None:
        self.tp, self.rank, self.world = world, rank, world
        self.side = SideStream(device)
        self.bufs: dict[tuple, torch.Tensor] = {}

    def _buf(self, key: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        k = (key, shape, like.dtype)
        if k not in self.bufs:
            self.bufs[k] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return self.bufs[k]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        buf = self._buf("ar", (self.world, *x.shape), x)
        with self.side.run(x) as outs:
            buf[self.rank].copy_(x)
            outs.append(buf.sum(0))
        return outs[0]

    def reduce_scatter_cols(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1] // self.world
        buf = self._buf("rs", (self.world, x.shape[0], n), x)
        with self.side.run(x) as outs:
            buf[self.rank].copy_(x[:, self.rank * n:(self.rank + 1) * n])
            outs.append(buf.sum(0))
        return outs[0]

    def all_gather_cols(self, x: torch.Tensor) -> torch.Tensor:
        buf = self._buf("ag", (self.world, *x.shape), x)
        with self.side.run(x) as outs:
            buf[self.rank].copy_(x)
            outs.append(torch.cat(buf.unbind(0), dim=1))                             # reads all slots
        return outs[0]

    # Slot access for fused kernels (kimi_decode/fused.py). A one-shot collective over NVLink
    # is "every rank writes its partial into a slot of every peer's buffer, then each consumer
    # reads all slots"; a fused producer kernel writes its output straight into slot `rank`
    # (no copy kernel) and a fused consumer kernel reads the `world` slots itself (no reduction
    # kernel). These return the same persistent buffers the collectives above use, so the
    # other ranks' slots hold what they hold there (zero: "the others contributed zero").

    def ar_slots(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """The all-reduce buffer [world, *shape] for partials of `shape`."""
        return self._buf("ar", (self.world, *shape), like)

    def rs_slots(self, shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
        """The reduce-scatter buffer [world, M, N / world] for partials [M, N]."""
        return self._buf("rs", (self.world, shape[0], shape[1] // self.world), like)

    def ag_slots(self, shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
        """The all-gather buffer [world, M, n] for slices [M, n]."""
        return self._buf("ag", (self.world, *shape), like)

    def gather_slots(self, buf: torch.Tensor) -> torch.Tensor:
        """all_gather_cols' result from a filled all-gather buffer: one concatenation kernel,
        on the current stream."""
        return torch.cat(buf.unbind(0), dim=1)
