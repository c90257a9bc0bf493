"""What a layer pays for being the first thing in its CUDA graph, measured (device only).

Why: bench/decode.md's headline figures time CUDA graphs holding ONE layer. In the bundled
H200 step-graph traces (cd24720) the fused step's first kernel (AttnRes) ends and the second
(in_proj's GEMV) starts 3.6-4.3 us later, in every step at B = 1 (k = 0 and 7), where stock's
step has 0.38-0.42 us between its first two kernels, as between any two of its kernels; in
the fused step's later layers in_proj is already resident under PDL and ends 11.8-13.8 us after
AttnRes, against 18.6-20.5 us in each step's first layer. A one-layer graph is such a first
layer, so its figure may carry a start-up cost that the layer never pays inside a step (and
that a real step pays once, not per layer). This script measures it, per variant and shape,
on one KDA layer (the model's second, L5), with graphs holding:

- `layer`:      the layer alone (as bench/decode.py times it);
- `lead`:       one plain elementwise kernel (no PDL);
- `lead+layer`: that kernel, then the layer;
- `prev`:       the layer before it (L4), fed as in the step;
- `prev+layer`: L4 then L5 (so `prev+layer` - `prev` is L5's in-step increment, as
                bench/decode.prefix_increments computes it; here neither graph finishes the
                last layer's all-gather, where both of its graphs do).

For each graph: the median of `reps` CUDA-event-timed replays (us; the second of two passes
over the five graphs), and from a profiled run
of a few replays the median over replays of the layer's first inter-kernel gap (its second
kernel's start minus its first kernel's end, ns; negative: the second was resident before
the first ended, as under PDL) and of the layer's span (its first kernel's start to its last
kernel's end, ns). Which kernels are the layer's: the graph's kernels after the lead's (the
`lead` and `prev` graphs give their counts).

Answer on an H100 (bench/graph_start.md, session 30): no start-up cost of the fused layer's
own. In its one-layer graph in_proj is resident 3.7 us (k = 0) / 6.0 us (k = 7) before AttnRes
ends, as behind a lead kernel or the previous layer; the one-layer figure exceeds the in-step
increment by 2.8 / 1.4 us for fused and 2.3 / 2.3 us for stock (the graph launch), so the
headline ratio is not biased against fused. The whole step's graph (`--step`, cabd309) does
show it on the H100 too: its first two kernels 3.36 us (k = 0) / 3.33 us (k = 7) apart, where
graphs of one or two layers have in_proj resident early. So the gap belongs to the step graph,
not to the card, and costs the step's first layer only; which part of the step graph brings it
(its size, or its tail) is what `--step`'s 3- and 4-layer graphs and every graph's own first
gap (`graph_gap_ns`, added after that run) are there to tell, with the fused step captured
once more with fused.POS_UPDATE_IN_PLACE flipped (its tail with or without the memcpy node).

The answer (5a0a1f9, an H100, session 31): the size. A graph's own first gap (AttnRes's end
to in_proj's start) is -3.2 us with one layer, -0.8 with two, +1.3 with three, +3.6 / +3.2
(k = 0 / 7) with four and +3.4 / +3.6 in the step; the step with its positions updated in
place has the same gap (+3.4 / +3.6) but is 2.9 us faster (no memcpy node; now the default,
fused.POS_UPDATE_IN_PLACE). So the graph executor releases the first PDL successor later the
more nodes the graph has; a one-layer graph is not charged it, and a step pays it once.

    python3 -m bench.graph_start --out $OUT [--step]   (writes graph_start.json, prints rows)
    python -m bench.graph_start --render bench/graph_start_h100.json > bench/graph_start.md
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from bench.render_cli import print_rendered

GRAPHS = ("layer", "lead", "lead+layer", "prev", "prev+layer")
STEP = "step"      # with --step: the model's whole step graph (runner.prepare), as the traces hold it,
                   # after graphs of its first 3 and 4 layers (bench/decode.run_layers, no tail)
# fused only: the step once more with fused.POS_UPDATE_IN_PLACE flipped, named by that setting
# (in place: add_ + masked_fill_; by copy: StockDecoder's copy_(where(..)), a memcpy node)
STEP_POS = {True: "step, pos in place", False: "step, pos by copy"}
SHAPES = ((1, 0), (1, 7))
LAYER = 1          # index into model.layers: L5.kda of the bench's layers 4-7
PROFILED_REPLAYS = 8


def layer_gap_and_span(replay: list[dict[str, Any]], skip: int) -> tuple[int, int]:
    """One graph replay's kernels (tracer.capture.kernels_with_ops rows, `ts`/`dur` in us):
    the gap between the first and second kernel after the first `skip` ones (start of the
    second minus end of the first) and the span of those kernels (first start to last end),
    both in integer ns. Kernels are ordered by start; an overlap gives a negative gap."""
    ks = sorted(replay, key=lambda k: k["ts"])[skip:]
    if len(ks) < 2:
        raise ValueError(f"a replay has {len(ks)} kernel(s) after the first {skip}: need 2")
    ns = lambda us: round(us * 1000)  # noqa: E731  (Kineto's floats are us with ns digits)
    first, second = ks[0], ks[1]
    gap = ns(second["ts"]) - ns(first["ts"] + first["dur"])
    span = max(ns(k["ts"] + k["dur"]) for k in ks) - ns(first["ts"])
    return gap, span


def summarize(replays: list[list[dict[str, Any]]], skip: int) -> dict[str, int]:
    """Medians over replays of layer_gap_and_span (lower median: a measured value)."""
    gaps, spans = zip(*(layer_gap_and_span(r, skip) for r in replays))
    return {"gap_ns": int(statistics.median_low(gaps)), "span_ns": int(statistics.median_low(spans)),
            "replays": len(replays)}


def measure(variant: str, batch: int, spec: int, reps: int, step: bool = False) -> list[dict[str, Any]]:
    """The five graphs of one (variant, B, k): CUDA-event medians and the profiled gaps; with
    `step`, also the whole step's graph (its first gap is the step's first two kernels')."""
    import torch

    from bench.decode import capture_graph, run_layers, time_replays
    from kimi_decode.config import k3_tp16
    from kimi_decode.runner import build, prepare
    from tracer.capture import graph_replays, kernels_with_ops, profile_trace

    # as bench/decode.py builds it (compiled op groups: stock's runs use them)
    cfg = k3_tp16(batch=batch, spec_tokens=spec, layers=(4, 5, 6, 7), tp_sim=True, compile_ops=True)
    model, _ = build(variant, cfg, "cuda")
    inputs = model.make_inputs()
    m, prefix, blocks = inputs
    prepare(model, inputs, graph=False, warmup=3)
    lead_buf = torch.zeros(1024, device="cuda")
    layer = model.layers[LAYER]

    def lead() -> None:
        lead_buf.add_(1.0)

    def one_layer() -> None:
        layer(m, prefix, blocks, model.pos)

    def prev() -> None:
        model.layers[LAYER - 1](m, prefix, blocks, model.pos)

    def prev_and_layer() -> None:
        out, pre = model.layers[LAYER - 1](m, prefix, blocks, model.pos)
        layer(out, pre, blocks, model.pos)

    fns = {"layer": one_layer, "lead": lead, "lead+layer": lambda: (lead(), one_layer()),
           "prev": prev, "prev+layer": prev_and_layer}
    graphs = {name: capture_graph(fns[name]) for name in GRAPHS}
    if step:
        # the step's first 3 and 4 layers (their all-gather finished, no tail), then the step
        for n in (3, len(model.layers)):
            graphs[f"first {n} layers"] = capture_graph(lambda n=n: run_layers(model, inputs, n))
        graphs[STEP] = prepare(model, inputs, graph=True, warmup=0).graph
        if variant == "fused":   # the step again with the other position update in its tail
            import kimi_decode.fused as fused_mod
            saved = fused_mod.POS_UPDATE_IN_PLACE
            fused_mod.POS_UPDATE_IN_PLACE = not saved
            try:
                graphs[STEP_POS[not saved]] = prepare(model, inputs, graph=True, warmup=0).graph
            finally:
                fused_mod.POS_UPDATE_IN_PLACE = saved
    # two timing passes over all the graphs, the second reported: the first configuration
    # timed in a process can read slow (a warm-up effect, bench/fc2_layout.md)
    first = {name: statistics.median(time_replays(g, reps)) for name, g in graphs.items()}
    again = {name: statistics.median(time_replays(g, reps)) for name, g in graphs.items()}
    rows, counts = [], {}
    for name, g in graphs.items():
        trace = profile_trace(lambda g=g: [g.replay() for _ in range(PROFILED_REPLAYS)], 1, True)
        replays = [r for r in graph_replays(kernels_with_ops(trace)) if r]
        counts[name] = statistics.median_low(len(r) for r in replays)
        skip = {"lead+layer": "lead", "prev+layer": "prev"}.get(name)
        skip = counts[skip] if skip else 0
        row = {"variant": variant, "batch": batch, "spec": spec, "graph": name,
               "median_us": again[name], "first_pass_us": first[name], "kernels": counts[name], "skip": skip}
        if counts[name] - skip >= 2:
            row.update(summarize(replays, skip))
        if counts[name] >= 2:
            row["graph_gap_ns"] = summarize(replays, 0)["gap_ns"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    del graphs
    del model
    torch.cuda.empty_cache()
    return rows


def render(runs: dict[str, Any] | list[dict[str, Any]]) -> str:
    """The markdown of a graph_start.json (one run, or a list of runs: a section each), with
    the derived per-layer figures."""
    runs = runs if isinstance(runs, list) else [runs]
    lines = ["# A layer's cost as the first thing in its CUDA graph", "",
             "Written by `bench/graph_start.py` (see its docstring for why and how). Gaps and spans "
             "in ns, medians over the profiled replays; the graph's own first gap is that of its "
             "first two kernels (the layer's, for the graphs without a lead)."]
    for run in runs:
        lines += [""] + _run_lines(run)
    return "\n".join(lines) + "\n"


def _fmt_ns(r: dict[str, Any], key: str) -> str:
    return "" if key not in r else f"{r[key]:,}"


def _run_lines(run: dict[str, Any]) -> list[str]:
    meta = run["meta"]
    lines = [f"## {meta['gpu']}, commit `{meta['commit']}`, {meta['date']}",
             "",
             f"{meta['reps']} timed replays per graph, {meta['profiled_replays']} profiled.",
             "",
             "| variant | B | k | graph | median us | kernels | layer's first gap ns | layer span ns | "
             "graph's first gap ns |",
             "|---|---|---|---|---|---|---|---|---|"]
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in run["rows"]:
        by_key.setdefault((r["variant"], r["batch"], r["spec"]), {})[r["graph"]] = r
        lines.append(f"| {r['variant']} | {r['batch']} | {r['spec']} | {r['graph']} | {r['median_us']:.1f} | "
                     f"{r['kernels']} | {_fmt_ns(r, 'gap_ns')} | {_fmt_ns(r, 'span_ns')} | "
                     f"{_fmt_ns(r, 'graph_gap_ns')} |")
    lines += ["", "Derived, us: the layer alone; what a plain kernel in front of it adds (`lead+layer` - "
              "`layer`: about that kernel's own time if the layer pays no start-up cost a predecessor "
              "could hide); the layer inside the step (`prev+layer` - `prev`, the in-step increment). "
              "(`lead` alone is no layer figure: a graph that short is bound by the host's launches.)", "",
              "| variant | B | k | alone | lead+layer - alone | in-step | alone - in-step |",
              "|---|---|---|---|---|---|---|"]
    for (variant, b, k), g in by_key.items():
        if not all(n in g for n in GRAPHS):
            continue
        alone = g["layer"]["median_us"]
        lead_adds = g["lead+layer"]["median_us"] - alone
        in_step = g["prev+layer"]["median_us"] - g["prev"]["median_us"]
        lines.append(f"| {variant} | {b} | {k} | {alone:.1f} | {lead_adds:+.1f} | {in_step:.1f} | "
                     f"{alone - in_step:+.1f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="where graph_start.json goes (the device's $OUT)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--variant", nargs="+", default=["stock", "fused"])
    ap.add_argument("--step", action="store_true", help="also time and profile the whole step's graph")
    ap.add_argument("--render", type=Path, help="print the table of a graph_start.json (no GPU)")
    a = ap.parse_args(argv)
    if a.render:
        print_rendered(a.render, render, "graph_start", "a graph_start.json")
        return
    if a.out is None:
        raise SystemExit("graph_start: --out (on the GPU machine) or --render (here) is required")
    import datetime as _dt

    import torch

    from tracer.capture import git_commit
    a.out.mkdir(parents=True, exist_ok=True)
    run = {"meta": {"gpu": torch.cuda.get_device_name(), "commit": git_commit(), "reps": a.reps,
                    "profiled_replays": PROFILED_REPLAYS, "date": _dt.date.today().isoformat()}, "rows": []}
    for b, k in SHAPES:
        for variant in a.variant:
            try:
                run["rows"] += measure(variant, b, k, a.reps, a.step)
            except Exception as e:   # noqa: BLE001  (a device run keeps the other rows)
                run.setdefault("errors", []).append(f"{variant} B={b} k={k}: {type(e).__name__}: {e}")
                print(run["errors"][-1], flush=True)
            (a.out / "graph_start.json").write_text(json.dumps(run, indent=1))


if __name__ == "__main__":
    main()
