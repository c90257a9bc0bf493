"""What the profiler itself adds to a CUDA-graph decode step, measured on the GPU.

The bundled traces are taken with the PyTorch profiler (CUPTI concurrent-kernel tracing) over
graph replays, and `compare` on them is checked against bench/decode.md's CUDA events, taken
with no profiler. When the two disagree, the question is whether the tool mis-measures or the
profiler slows the step it records. This script answers it per configuration, in one process
and on one captured graph (the bundled traces' config: K3 TP16 rank 0, layers 4-7, tp_sim,
the op groups compiled):

- `first`: CUDA events around the first FIRST (10) replays right after the graph is captured, no
  profiler and no warm-up: the state the captures profiled before tracer/capture.py's
  graph warm-up; then the graph is warmed as the capture now does (`warm_graph`), and:
- `none`: CUDA events around each of `reps` back-to-back replays, no profiler (bench/decode.py's
  `time_replays`, the figure bench/decode.md reports per layer);
- `cpu`: the same events inside torch.profiler with CPU activity only (no CUPTI);
- `cupti`: the same events inside torch.profiler with CPU + CUDA activity, exactly as
  tracer/capture.py profiles the bundled traces; and, from that profile's own trace, each
  replay's GPU span (first kernel start to last kernel end, integer ns).

Fused also runs without `pdl_chain` (programmatic dependent launch off), to see whether the
profiler's cost depends on PDL overlap.

    python -m bench.profiler_overhead --json out.json              # on the GPU
    python -m bench.profiler_overhead --render out.json            # here: bench/profiler_overhead.md
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

MD_PATH = Path(__file__).with_name("profiler_overhead.md")
LAYERS = (4, 5, 6, 7)
SHAPES = ((1, 0), (1, 7), (8, 0))
MODES = ("none", "cpu", "cupti")
FIRST = 10          # replays timed right after capture


def replay_spans_ns(trace: dict[str, Any]) -> list[int]:
    """Per cudaGraphLaunch in `trace` (tracer.capture's grouping): last kernel end - first
    kernel start, integer ns (Kineto writes µs with ns decimals; rounded once, here)."""
    from tracer.capture import graph_replays, kernels_with_ops
    spans = []
    for replay in graph_replays(kernels_with_ops(trace)):
        starts = [round(k["ts"] * 1000) for k in replay]
        ends = [s + round(k["dur"] * 1000) for s, k in zip(starts, replay)]
        spans.append(max(ends) - min(starts))
    return spans


def measure(variant: str, batch: int, spec: int, kernels: frozenset[str] | None, reps: int) -> dict[str, Any]:
    """One configuration: build, capture the step graph, time it under the three modes."""
    import torch

    import kimi_decode.fused as fused_mod
    from bench.decode import time_replays
    from kimi_decode.config import k3_tp16
    from kimi_decode.device_job import probe_grouped_mm
    from kimi_decode.runner import build, prepare
    from tracer.capture import warm_graph

    if kernels is not None:
        fused_mod.VERIFIED = fused_mod.DEFAULT_KERNELS = kernels
    cfg = k3_tp16(batch=batch, spec_tokens=spec, layers=LAYERS, tp_sim=True,
                  expert_impl=probe_grouped_mm(), compile_ops=True)
    model, _ = build(variant, cfg, "cuda")
    inputs = model.make_inputs()
    prepare(model, inputs, graph=False, warmup=3)
    step = prepare(model, inputs, graph=True, warmup=0)
    first = time_replays(step.graph, FIRST, warmup=0, warmup_s=0)
    out: dict[str, Any] = {"variant": variant, "batch": batch, "spec_tokens": spec,
                           "kernel_set": None if kernels is None else sorted(kernels),
                           "first_ns": [round(u * 1000) for u in first], "warm_replays": warm_graph(step.graph)}
    acts = {"cpu": [torch.profiler.ProfilerActivity.CPU],
            "cupti": [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]}
    for mode in MODES:
        if mode == "none":
            us = time_replays(step.graph, reps)
        else:
            with torch.profiler.profile(activities=acts[mode]) as prof:
                us = time_replays(step.graph, reps)
            if mode == "cupti":
                with tempfile.TemporaryDirectory() as tmp:
                    path = Path(tmp) / "t.json"
                    prof.export_chrome_trace(str(path))
                    spans = replay_spans_ns(json.loads(path.read_text()))
                out["trace_spans_ns"] = spans
        out[f"{mode}_ns"] = [round(u * 1000) for u in us]
    del step, model
    torch.cuda.empty_cache()
    return out


def run(reps: int) -> dict[str, Any]:
    import torch

    import kimi_decode.fused as fused_mod
    torch._dynamo.config.suppress_errors = True      # as bench/fused_device.py's timed runs
    default = frozenset(fused_mod.DEFAULT_KERNELS)
    rows = []
    for b, k in SHAPES:
        rows.append(measure("stock", b, k, None, reps))
        rows.append(measure("fused", b, k, default, reps))
        rows.append(measure("fused", b, k, default - {"pdl_chain"}, reps))
        print(json.dumps({x: rows[-1][x] for x in ("variant", "batch", "spec_tokens")}), flush=True)
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "commit": os.environ.get("DECODESCOPE_COMMIT"), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "reps": reps,
            "layers": list(LAYERS), "default_kernels": sorted(default), "rows": rows}


def _med_us(ns: list[int]) -> float:
    return statistics.median(ns) / 1000


def render(data: dict[str, Any]) -> str:
    """bench/profiler_overhead.md from one run's JSON."""
    lines = [
        "# What the profiler adds to a graph-replayed decode step",
        "",
        "`python -m bench.profiler_overhead` (its docstring says what each mode is). One process per",
        "run, one captured step graph per row; µs are medians of the replays, computed from integer ns.",
        "What the runs showed, and what changed because of it (the capture and bench/decode.py warm",
        "each graph before timing it): bench/fused_runs.md, session 8.",
        "",
        f"- **date**: {data['date']}  **commit**: {data['commit']}  **GPU**: {data['gpu']}",
        f"- torch {data['torch']} (CUDA {data['cuda']}); {data['reps']} replays per mode; K3 TP16 rank 0,"
        f" layers {', '.join(map(str, data['layers']))}, tp_sim, op groups compiled",
        "",
        "| variant | B | k | kernels | first 3 replays after capture µs | warmed, no profiler µs | CPU-only profiler µs "
        "| CUPTI profiler µs | CUPTI / no profiler | trace span µs | span / no profiler |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    default = set(data["default_kernels"])
    for r in data["rows"]:
        ks = "stock" if r["kernel_set"] is None else (
            "default" if set(r["kernel_set"]) == default else
            "default - " + ", ".join(sorted(default - set(r["kernel_set"]))))
        none, cpu, cupti = _med_us(r["none_ns"]), _med_us(r["cpu_ns"]), _med_us(r["cupti_ns"])
        span = _med_us(r["trace_spans_ns"]) if r.get("trace_spans_ns") else float("nan")
        first = _med_us(r["first_ns"][:3])
        lines.append(f"| {r['variant']} | {r['batch']} | {r['spec_tokens']} | {ks} | {first:.1f} | {none:.1f} | {cpu:.1f} | "
                     f"{cupti:.1f} | {cupti / none:.3f} | {span:.1f} | {span / none:.3f} |")
    lines.append("")
    lines.append(f"<!-- profiler-overhead-data\n{json.dumps(data)}\n-->")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="run on the GPU, write the raw figures here")
    ap.add_argument("--render", type=Path, help="render a run's JSON into bench/profiler_overhead.md")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    if args.render:
        MD_PATH.write_text(render(json.loads(args.render.read_text())))
    elif args.json:
        args.json.write_text(json.dumps(run(args.reps)))
    else:
        ap.error("give --json (GPU) or --render")


if __name__ == "__main__":
    main()
