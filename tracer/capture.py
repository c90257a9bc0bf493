"""Run a kimi_decode step under the PyTorch profiler and write a Kineto trace that carries
its own metadata: a top-level `decodescope` object (read by the ingest into `runs` and
`graph_capture_map`, tracer/schema.sql).

Eager mode: the profiled steps show every kernel under its `step` / `L{idx}.{kind}` / op
annotations. Graph mode: replayed kernels have no enclosing annotation, so the same process
first profiles ONE eager step of the identical model and inputs, and records its kernels in
start order with their (step, layer, op) as `graph_capture_map`; the first profiled replay is
then checked against that list, kernel name by kernel name (`graph_capture_map_matched`).
`comm_streams` are read off the written trace itself (Kineto's `args.stream` numbering): the
streams that only collective ops (`comm_ops`) launched kernels on.
"""
from __future__ import annotations

import datetime as _dt
import gzip
import json
import os
import platform
import re
import subprocess
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kimi_decode.config import KimiConfig
from kimi_decode.ranges import COMM_OPS, COMM_OPS_REGEX, OPS, PREFETCH_OPS, PREFETCH_OPS_REGEX, STEP
from kimi_decode.runner import Step, build, eager_step, prepare

LAYER_RE = re.compile(r"^L\d+\.(kda|mla|dense)$")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
# Graph mode replays the captured step for this long (and at least GRAPH_WARMUP_MIN_REPLAYS
# times) before the profiled steps. Measured (bench/profiler_overhead.md, H200): after the
# CPU-only stretch of a capture, the first ~8-13 ms of replays ran 3-8 % slower than steady
# state, in some processes and not others; the traces used to profile exactly the first 3
# replays and ran 5-9 % above the CUDA-event figures, and bench/decode.py's first timed
# layer of each configuration ran ~8 % above the others.
GRAPH_WARMUP_S = 0.05
GRAPH_WARMUP_MIN_REPLAYS = 10


def git_commit() -> str | None:
    """HEAD of the checkout (DECODESCOPE_COMMIT wins: the GPU machine gets no .git)."""
    if os.environ.get("DECODESCOPE_COMMIT"):
        return os.environ["DECODESCOPE_COMMIT"]
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, cwd=here)
        head = out.stdout.strip()
        if not head:
            return None
        # a tree that differs from HEAD (the GPU machine's copy carries a stale .git) must not
        # pass for HEAD: say so
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], capture_output=True, text=True,
                               timeout=10, cwd=here).stdout.strip()
        return f"{head}+dirty" if dirty else head
    except (OSError, subprocess.SubprocessError):
        return None


def profile_trace(step: Step, n: int, cuda: bool) -> dict[str, Any]:
    """Profile n calls of `step` (CPU + CUPTI activities, no stacks or shapes); the Kineto JSON."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False,
                                profile_memory=False, with_flops=False) as prof:
        for _ in range(n):
            step()
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def warm_graph(graph: Any, seconds: float = GRAPH_WARMUP_S, min_replays: int = GRAPH_WARMUP_MIN_REPLAYS) -> int:
    """Replay a captured CUDA graph for `seconds` of wall time (and at least `min_replays`
    times), waiting for the device every 8 replays so the time is GPU time, not queueing;
    returns the number of replays (recorded in the trace's metadata). bench/decode.py warms
    each graph it times the same way."""
    n, t0 = 0, time.perf_counter()
    while n < min_replays or time.perf_counter() - t0 < seconds:
        graph.replay()
        n += 1
        if n % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return n


def _events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]


def kernels_with_ops(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Every kernel, start order, with the step / layer / op annotations enclosing its launch.

    A kernel's launch is the runtime or driver call with the same correlation id; the
    annotations are user_annotation ranges on the launching thread that contain that call.
    """
    evs = _events(trace)
    anns: dict[tuple, list[dict]] = defaultdict(list)
    launches: dict[int, dict] = {}
    kernels = []
    for e in evs:
        cat = e.get("cat")
        if cat == "user_annotation":
            anns[(e.get("pid"), e.get("tid"))].append(e)
        elif cat in LAUNCH_CATS and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e
        elif cat == "kernel":
            kernels.append(e)
    out = []
    for k in sorted(kernels, key=lambda e: float(e["ts"])):
        args = k.get("args", {})
        launch = launches.get(args.get("correlation"))
        step = layer = op = None
        if launch is not None:
            t = float(launch["ts"])
            enclosing = [a for a in anns[(launch.get("pid"), launch.get("tid"))]
                         if float(a["ts"]) <= t <= float(a["ts"]) + float(a.get("dur", 0))]
            for a in sorted(enclosing, key=lambda a: float(a["ts"])):  # outermost first
                if a["name"] == STEP:
                    step = a["name"]
                elif LAYER_RE.match(a["name"]):
                    layer = a["name"]
                elif a["name"] in OPS:
                    op = a["name"]
        out.append({"name": k["name"], "ts": float(k["ts"]), "dur": float(k.get("dur", 0)), "stream": args.get("stream"),
                    "correlation": args.get("correlation"),
                    "launch": launch["name"] if launch else None,
                    "step": step, "layer": layer, "op": op})
    return out


def capture_map(eager_kernels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`graph_capture_map` from the eager map step's kernels (kernels_with_ops, start order):
    node_order, kernel_name, step, layer, op, and `capture_stream`, the stream the eager step
    launched the kernel on.

    Why the stream: in a graph replay CUPTI reports the executor's streams, and the fused
    step's main chain moves between them at the shared expert's fork and join, so a kernel
    that is resident early under PDL (waiting in griddepcontrol.wait) can sit on another
    replay stream than the kernel it waits for. The capture stream is the one on which
    same-stream PDL overlap is defined (analyzers/sql/kernels/exposed.sql orders a graph
    kernel after the earlier kernels of its capture stream as well as of its replay stream).
    """
    return [{"node_order": i, "kernel_name": k["name"], "step": k["step"], "layer": k["layer"], "op": k["op"],
             "capture_stream": k.get("stream")} for i, k in enumerate(eager_kernels)]


def graph_replays(kernels: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Kernels grouped by the cudaGraphLaunch that replayed them, replays in time order."""
    groups: dict[Any, list] = defaultdict(list)
    for k in kernels:
        if k["launch"] and "GraphLaunch" in k["launch"]:
            groups[k["correlation"]].append(k)
    return sorted(groups.values(), key=lambda g: g[0]["ts"])


def comm_streams(kernels: list[dict[str, Any]], ops: tuple[str, ...] = COMM_OPS) -> list[int]:
    """Streams on which only `ops` (default: the collectives) launched kernels (Kineto numbering)."""
    mine = {k["stream"] for k in kernels if k["op"] in ops}
    other = {k["stream"] for k in kernels if k["op"] not in ops}
    return sorted(s for s in mine - other if s is not None)


def capture(variant: str, cfg: KimiConfig, graph: bool, steps: int, out: Path,
            warmup: int = 3, device: str | None = None,
            profiler: Callable[[Step, int, bool], dict[str, Any]] | None = None,
            backend: str = "pytorch") -> dict[str, Any]:
    """Build, warm up, (capture,) profile `steps` steps, write `out` (.json or .json.gz).

    `profiler` turns (step, n, cuda) into a Kineto-format trace: the PyTorch profiler by
    default; tracer.capture_cupti passes its CUPTI one (recorded as `backend`).
    Returns the `decodescope` metadata object written into the trace.
    """
    profile = profiler or profile_trace
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    model, rt = build(variant, cfg, device)
    inputs = model.make_inputs()
    notes: list[str] = []
    graph_warmup = 0
    cmap: list[dict[str, Any]] = []
    eager_kernels: list[dict[str, Any]] = []
    if graph:
        prepare(model, inputs, graph=False, warmup=warmup)
        # Same process, same model and inputs: one eager step gives the launch order and ops.
        eager_kernels = [k for k in kernels_with_ops(profile(eager_step(model, inputs), 1, cuda))
                         if k["step"] == STEP]
        cmap = capture_map(eager_kernels)
        step = prepare(model, inputs, graph=True, warmup=0)
        graph_warmup = warm_graph(step.graph)
    else:
        step = prepare(model, inputs, graph=False, warmup=warmup)
    trace = profile(step, steps, cuda)
    kernels = kernels_with_ops(trace)
    matched: bool | None = None
    if graph:
        replays = graph_replays(kernels)
        first = [k["name"] for k in replays[0]] if replays else []
        matched = bool(replays) and first == [m["kernel_name"] for m in cmap]
        if not matched:
            same_set = sorted(first) == sorted(m["kernel_name"] for m in cmap)
            notes.append(f"first replay has {len(first)} kernels vs {len(cmap)} in the eager map; "
                         f"same multiset: {same_set} (parallel streams can reorder starts)")
        else:  # attribute the replay's kernels by position to find the comm streams
            for k, m in zip(replays[0], cmap):
                k["op"] = m["op"]
        streams = comm_streams(replays[0]) if matched else []
        if matched and not streams:
            seen = sorted({k["stream"] for k in replays[0]})
            notes.append(f"graph replay: CUPTI reports the replayed kernels on streams {seen}, and no "
                         "stream carries only collective kernels, so comm_streams is empty; classify "
                         "replayed kernels through graph_capture_map (op matches comm_ops). In the "
                         f"eager map step the collectives ran on stream(s) {comm_streams(eager_kernels)}.")
    else:
        streams = comm_streams(kernels)
    attributed = [dict(k, op=m["op"]) for k, m in zip(replays[0], cmap)] if graph and matched else kernels
    has_prefetch = any(k["op"] in PREFETCH_OPS for k in (cmap if graph else kernels))
    comm = rt.comm
    meta: dict[str, Any] = {
        "model": "kimi-k3",
        "backend": backend,
        "variant": variant,
        "config": cfg.to_dict(),
        "gpu": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()})",
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "commit": git_commit(),
        "graph_mode": graph,
        "tp_sim": bool(getattr(comm, "simulated", False)),
        "comm_streams": streams,
        "prefetch_streams": comm_streams(attributed, PREFETCH_OPS) if has_prefetch else [],
        "comm_ops": COMM_OPS_REGEX,
        "prefetch_ops": PREFETCH_OPS_REGEX if has_prefetch else None,
        "graph_capture_map": cmap,
        "graph_capture_map_matched": matched,
        "steps": steps,
        "warmup_steps": warmup,
        "graph_warmup_replays": graph_warmup,
        "world_size": getattr(comm, "tp", 1) if not getattr(comm, "simulated", False) else 1,
        "captured_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch_comm_stream": ({"stream_id": comm.side.stream.stream_id, "cuda_stream": comm.side.stream.cuda_stream}
                              if getattr(comm, "simulated", False) and comm.side.stream is not None else None),
        "notes": notes,
    }
    trace["decodescope"] = meta
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    body = json.dumps(trace).encode()
    if out.name.endswith(".gz"):
        with gzip.open(out, "wb", compresslevel=9) as fh:
            fh.write(body)
    else:
        out.write_bytes(body)
    return meta
