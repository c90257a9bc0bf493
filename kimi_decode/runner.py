"""Owns how a decode step runs: collectives (real, simulated or none), warm-up, eager or
CUDA-graph execution, N replays. Returns new callables; nothing global is rebound.

    model, rt = build("stock", cfg, device)
    step = prepare(model, model.make_inputs(), graph=True)   # warmed up (and captured)
    for _ in range(n): step()                                  # one `step` range each
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kimi_decode.comm import DistComm, LocalComm, SideStream, SimComm
from kimi_decode.config import KimiConfig
from kimi_decode.ranges import step_range
from kimi_decode.stock import Runtime
from kimi_decode.variants import variant_class


# CUDA priority of the stream a step's graph is captured on (bench/decode.py's per-layer graphs
# too); lower is higher, 0 (CUDA's lowest) is every stream's default, comm.SIDE_STREAM_PRIORITY
# the aux stream's. torch instantiates graphs with cudaGraphInstantiateFlagUseNodePriority, so a
# captured kernel keeps its stream's priority. Why it is a setting: in the d9ea8dc B = 1, k = 7
# and B = 8 traces router_topk (main stream) starts ~5-6 us after the router's logits end while
# latent_down (aux stream) places its last CTAs, and FC1 then waits ~5 us for it. Measured on
# the H200 (2026-12-04, bench/fused_runs.md "Session 13"), fused layers in us: main at -1 makes
# B = 1, k = 7 KDA 202-206 -> 213-216 and B = 8 198-203 -> 206-211 (B = 1, k = 0 +1); the aux
# stream at -1 changes nothing (within 0.5 us), and router_topk still starts ~5 us late, so
# the delay is not the block scheduler's priority order. Both stay 0. (Session 14: with the
# selection in the logits grid's last CTA, router_mma at one K slice, FC1 follows latent_down
# within 0.4-2.4 us: the delay comes with router_topk as a kernel of its own, its late start
# and ~7 us run; what inside it costs the time is not isolated.)
# Session 28 (H100, ce8a1dd): the aux stream at -1 again, now that the shared expert's down
# GEMV sits beside FC1 (in the profiled step graphs it starts behind FC1's grid in every layer
# but the first): layer and step graphs within 0.9 us of 0 at B = 1 (k = 0, 7) and B = 8.
MAIN_STREAM_PRIORITY = 0

_capture_streams: dict[tuple[torch.device, int], torch.cuda.Stream] = {}


def capture_stream(device: torch.device | str | None = None) -> torch.cuda.Stream:
    """The stream steps are captured on: one per device and MAIN_STREAM_PRIORITY, created on
    first use (torch clamps the priority to the device's range)."""
    dev = torch.device("cuda" if device is None else device)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (dev, int(MAIN_STREAM_PRIORITY))
    if key not in _capture_streams:
        _capture_streams[key] = torch.cuda.Stream(dev, priority=key[1])
    return _capture_streams[key]


def make_runtime(cfg: KimiConfig, device: torch.device) -> Runtime:
    """Real collectives when a process group of world > 1 exists, tp_sim when asked, else tp = 1."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_world_size() != cfg.tp or dist.get_rank() != cfg.rank:
            raise ValueError(f"config tp={cfg.tp} rank={cfg.rank} does not match the process group")
        comm: object = DistComm()
    elif cfg.tp_sim:
        comm = SimComm(device, cfg.sim_world, cfg.rank)
    elif cfg.tp == 1:
        comm = LocalComm()
    else:
        raise ValueError(f"tp={cfg.tp} needs torch.distributed with {cfg.tp} ranks, or tp_sim")
    return Runtime(comm=comm, aux=SideStream(device))


def build(variant: str, cfg: KimiConfig, device: torch.device | str) -> tuple[torch.nn.Module, Runtime]:
    """The decoder of `variant` for cfg's rank, with its runtime, on `device`."""
    device = torch.device(device)
    rt = make_runtime(cfg, device)
    with torch.no_grad():
        model = variant_class(variant)(cfg, rt, device)
    return model.eval(), rt


@dataclass
class Step:
    """A prepared step: call it to run one decode step (one `step` range)."""

    fn: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    graph: torch.cuda.CUDAGraph | None

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn()


def eager_step(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> Step:
    """Each call runs the model's forward (which opens its own `step` range)."""

    def fn() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return model(*inputs)

    return Step(fn, None)


def prepare(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], graph: bool,
            warmup: int = 3) -> Step:
    """Warm up eagerly (`warmup` steps, on a side stream as graph capture requires), then
    return the eager step or a captured CUDA graph whose replay is one step."""
    eager = eager_step(model, inputs)
    cuda = inputs[0].is_cuda
    if cuda:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(warmup):
                eager()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
    else:
        for _ in range(warmup):
            eager()
    if not graph:
        return eager
    if not cuda:
        raise ValueError("CUDA-graph mode needs a CUDA device")
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g, stream=capture_stream(inputs[0].device)):
        outs = model(*inputs)
    torch.cuda.synchronize()

    def replay() -> tuple[torch.Tensor, torch.Tensor]:
        with step_range():
            g.replay()
        return outs

    return Step(replay, g)


def run_steps(step: Step, n: int) -> None:
    """N steps, then wait for the device."""
    for _ in range(n):
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
