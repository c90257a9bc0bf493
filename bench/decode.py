"""Per-layer decode benchmark of kimi_decode variants on the GPU, written to bench/decode.md.

For each (variant, B, k): per-layer time from CUDA events around each replay of a CUDA graph
holding ONE layer (many replays; median, p10, p90 per layer kind), the same layers' cost inside
the step ("in-step": the increments of graphs holding the step's first 1, 2, .. n layers, see
prefix_increments), the full-step graph time,
kernels per layer (one profiled eager step, kernels attributed to `L{idx}.{kind}` ranges),
bytes one rank reads per layer (weights as used: experts = distinct selected experts x one
expert slice, the up-projection's row shard only; plus KDA state read+write and the MLA cache
read) and the floor bytes / copy bandwidth, with the device-to-device copy bandwidth
measured in the same run (bytes read + written).

    python -m bench.decode --variant stock --batch 1 8 64 --json out.json   # on the GPU
    python -m bench.decode --render out.json                                 # update decode.md
    python -m bench.decode --render out.json --md bench/decode_h100.md       # another card's run

decode.md keeps every variant's numbers in a JSON block at its end; rendering merges the new
results in (replacing the same variant and shape) and prints the variants side by side.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

MD_PATH = Path(__file__).with_name("decode.md")
DATA_RE = re.compile(r"<!-- decode-bench-data\n(.*?)\n-->", re.S)


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second (median of reps)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times[3:])


def time_replays(graph: torch.cuda.CUDAGraph, reps: int, warmup: int = 5,
                 warmup_s: float | None = None) -> list[float]:
    """Microseconds of each of `reps` back-to-back replays (one event pair each), after
    untimed ones: at least `warmup` and `warmup_s` seconds of them (default
    tracer.capture.GRAPH_WARMUP_S: with 5 replays only, the first layer timed after the
    profiled eager step ran ~8 % above the others, bench/profiler_overhead.md)."""
    from tracer.capture import GRAPH_WARMUP_S, warm_graph
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    seconds = GRAPH_WARMUP_S if warmup_s is None else warmup_s
    if warmup or seconds:
        warm_graph(graph, seconds, warmup)
    for a, b in evs:
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e3 for a, b in evs]


def capture_graph(fn: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `fn` (no autograd) captured on the step's capture stream, as
    runner.prepare captures the step: the bench's one-layer and prefix graphs and
    bench/graph_start's graphs are all made here."""
    from kimi_decode.runner import capture_stream

    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g, stream=capture_stream()):
        fn()
    torch.cuda.synchronize()
    return g


def run_layers(model: Any, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
               n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's first `n` layers as the step runs them: each layer's output feeds the next,
    and an all-gather the last of them left unfinished (kimi_decode.fused.Gathered) is finished
    as FusedDecoder.forward finishes it. Without the step's tail (the MLA positions' update,
    ~6 tiny kernels), which is no layer's cost."""
    from kimi_decode.fused import Gathered

    m, prefix, blocks = inputs
    for layer in model.layers[:n]:
        m, prefix = layer(m, prefix, blocks, model.pos)
    return (m.gather() if isinstance(m, Gathered) else m), prefix


def prefix_increments(model: Any, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                      reps: int) -> list[float | None]:
    """Each layer's cost inside the step: the median replay time of a CUDA graph holding the
    first i + 1 layers minus that of the graph holding the first i (None for the first layer,
    whose graph also holds the launch).

    Why beside the one-layer graphs: a one-layer graph's time includes one graph launch
    (~3.6 us per layer on the H200: the 4-layer step took 336.0 us against 336.5 for its layers'
    one-layer figures, though the step also runs ~14 us of tail kernels), and in it the layer's
    first kernel cannot overlap the previous layer's last (the PDL chain crosses layers inside
    the step). The increment is what a layer adds to the step a deployment replays. Each figure
    is a difference of two medians, so it carries both graphs' run-to-run noise."""
    totals = []
    for n in range(1, len(model.layers) + 1):
        g = capture_graph(lambda: run_layers(model, inputs, n))  # noqa: B023  (called at once)
        totals.append(statistics.median(time_replays(g, reps)))
        del g
    return increments(totals)


def increments(totals: list[float]) -> list[float | None]:
    """Per layer, the prefix graph's median minus the previous one's; None for the first."""
    return [None] + [b - a for a, b in zip(totals, totals[1:])]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def layer_bytes(layer: torch.nn.Module, cfg: Any) -> dict[str, int]:
    """Bytes one rank reads for this layer in one step (weights as used, plus state)."""
    w = 0
    for name, p in layer.named_parameters():
        size = p.numel() * p.element_size()
        if name in ("mlp.w13", "mlp.w2"):
            # distinct selected experts, without the zero padding of the intermediate (192 of
            # 256 rows are the model's: the padding is a layout artifact, not bytes a decode
            # step must read; the fused kernels skip it)
            idx = layer.mlp.last_idx
            size = size // p.shape[0] * int(torch.unique(idx).numel())
            size = size * cfg.expert_local_inter // cfg.expert_local_inter_padded
        elif name == "mlp.up":
            size = size * cfg.row_shard // cfg.hidden
        elif name == "attn.kv_b":  # absorbed into w_uk_t / w_uv at load, unused in decode
            size = 0
        w += size
    state = 0
    for name, b in layer.named_buffers():
        if not b.is_floating_point():
            continue    # int scratch (the fused routers' grid counters), not decode state
        size = b.numel() * b.element_size()
        state += size if name.endswith("cache") else 2 * size  # cache read; KDA state read + write
    return {"weight_bytes": w, "state_bytes": state}


def bench_config(variant: str, cfg: Any, reps: int) -> dict[str, Any]:
    from kimi_decode.runner import build, eager_step, prepare
    from tracer.capture import kernels_with_ops, profile_trace

    model, _ = build(variant, cfg, "cuda")
    m, prefix, blocks = model.make_inputs()
    prepare(model, (m, prefix, blocks), graph=False, warmup=3)
    kernels = kernels_with_ops(profile_trace(eager_step(model, (m, prefix, blocks)), 1, True))
    per_layer_kernels: dict[str, int] = defaultdict(int)
    for k in kernels:
        if k["layer"]:
            per_layer_kernels[k["layer"]] += 1
    layers = []
    for layer in model.layers:
        g = capture_graph(lambda: layer(m, prefix, blocks, model.pos))  # noqa: B023  (called at once)
        us = time_replays(g, reps)
        name = f"L{layer.idx}.{layer.kind}"
        layers.append({"layer": name, "kind": layer.kind, "median_us": statistics.median(us),
                       "p10_us": pct(us, 0.1), "p90_us": pct(us, 0.9),
                       "kernels": per_layer_kernels.get(name, 0), **layer_bytes(layer, cfg)})
        del g
    for row, inc in zip(layers, prefix_increments(model, (m, prefix, blocks), reps)):
        row["in_step_us"] = inc
    step = prepare(model, (m, prefix, blocks), graph=True, warmup=0)
    step_us = time_replays(step.graph, reps)
    del step, model
    torch.cuda.empty_cache()
    return {"variant": variant, "batch": cfg.batch, "spec_tokens": cfg.spec_tokens, "rows": cfg.rows,
            "layers": layers, "step_median_us": statistics.median(step_us),
            "step_p10_us": pct(step_us, 0.1), "step_p90_us": pct(step_us, 0.9),
            "config": cfg.to_dict()}


def by_kind(result: dict[str, Any], bw: float) -> dict[str, dict[str, float]]:
    """Per layer kind: median over that kind's layers of each figure."""
    out: dict[str, dict[str, float]] = {}
    kinds = sorted({r["kind"] for r in result["layers"]})
    for kind in kinds:
        rows = [r for r in result["layers"] if r["kind"] == kind]
        med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
        mb = med("weight_bytes") + med("state_bytes")
        stepped = [r for r in rows if r.get("in_step_us") is not None]
        in_step = [r["in_step_us"] for r in stepped]
        # the in-step figures' own floor: the same layers (their expert bytes differ at M > 1)
        step_mb = statistics.median(r["weight_bytes"] + r["state_bytes"] for r in stepped) if stepped else None
        out[kind] = {"n": len(rows), "median_us": med("median_us"), "p10_us": med("p10_us"),
                     "p90_us": med("p90_us"), "kernels": med("kernels"), "mb": mb / 1e6,
                     "floor_us": mb / bw * 1e6,
                     # runs before the in-step figures (and a kind whose only layer is the first) have none
                     "in_step_us": statistics.median(in_step) if in_step else None,
                     "in_step_n": len(in_step),
                     "in_step_floor_us": None if step_mb is None else step_mb / bw * 1e6}
    return out


def render(data: dict[str, Any]) -> str:
    """decode.md from all stored results."""
    runs, meta = data["results"], data["meta"]
    lines = ["# Kimi K3 decode step: per-layer benchmark", "",
             "Written by `bench/decode.py` (run on the GPU machine; `--render` merges its JSON here).",
             "Per-layer time: CUDA events around each replay of a CUDA graph holding one layer (so each",
             "figure includes one graph launch, ~4 us on this GPU), after at least 50 ms of untimed",
             "replays of that graph (since 86e5bc7: with 5 only, the first layer timed in a configuration",
             "ran 6-9 % above the identical others, bench/profiler_overhead.md). Bytes: weights as one rank reads them",
             "(experts: distinct selected experts x one expert slice without its zero padding, i.e. 192 of",
             "the 256 intermediate rows stored; up-projection: row shard)",
             "plus KDA state read+write and the whole MLA cache buffer read. Floor = bytes / measured",
             "copy bandwidth (a 2 GiB device copy; from bench/fused_device.py measured when its process",
             "starts: later in a process that has run the checks and captures the same copy measured",
             "~11 % slower on the H200 while the layer times did not move, which would lower the floor).",
             "Kernels: one profiled eager step, attributed to `L{idx}.{kind}` ranges.",
             "In-step us (runs since session 28): what the layer adds inside the step, the median replay",
             "time of a graph holding the step's first i + 1 layers minus that of the first i (no launch of",
             "its own, the PDL chain crossing the layer boundary as in the step; the first layer has none,",
             "so a KDA figure is the median over the later KDA layers and the MLA one is the step's last",
             "layer); a difference of two medians, so noisier than the one-layer figures.", ""]
    for variant, m in sorted(meta.items()):
        lines.append(f"- **{variant}**: {m['date']}, commit `{m['commit']}`, {m['gpu']}, torch {m['torch']} "
                     f"(CUDA {m['cuda']}), copy bandwidth {m['copy_bw_tbs']:.2f} TB/s"
                     + (f" (at process start; {m['copy_bw_late_tbs']:.2f} TB/s just before the bench)"
                        if "copy_bw_late_tbs" in m else "")
                     + f", {m['reps']} replays, "
                     f"layers {m['layers']}, tp_sim={m['tp_sim']}, experts {m['expert_impl']}, "
                     f"compile_ops={m.get('compile_ops')}"
                     + (f", Triton op groups kept torch: {m['triton_off'] or 'none'}" if "triton_off" in m else ""))
    lines += ["", "| variant | B | k | M | kind | layers | median us | p10 us | p90 us | in-step us | kernels/layer | MB read/layer | floor us | step median us |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (r["spec_tokens"], r["batch"], r["variant"])):
        bw = meta[r["variant"]]["copy_bw_tbs"] * 1e12
        for kind, s in by_kind(r, bw).items():
            lines.append(f"| {r['variant']} | {r['batch']} | {r['spec_tokens']} | {r['rows']} | {kind} | {s['n']} | "
                         f"{s['median_us']:.1f} | {s['p10_us']:.1f} | {s['p90_us']:.1f} | {_us(s['in_step_us'])} | "
                         f"{s['kernels']:.0f} | {s['mb']:.1f} | {s['floor_us']:.1f} | {r['step_median_us']:.1f} |")
    variants = sorted(meta)
    if len(variants) > 1:
        lines += side_by_side(runs, meta)
    lines += ["", "<!-- decode-bench-data", json.dumps(data), "-->", ""]
    return "\n".join(lines)


def _us(x: float | None) -> str:
    """A table cell: µs to one decimal, '-' where the run has no such figure."""
    return "-" if x is None else f"{x:.1f}"


def side_by_side(runs: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    """Stock vs fused per (B, k, layer kind): µs and kernels per layer, stock/fused, the byte
    floor and fused/floor (the issue's goals: ratio ≥ 2 at B = 1, fused ≤ 1.5 × floor).
    Only pairs measured in the same run (same commit) are set side by side."""
    lines = ["", "## Side by side: stock vs fused (same run)", "",
             "| B | k | kind | stock us | stock kernels | fused us | fused kernels | stock/fused | floor us | fused/floor |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    table: dict[tuple, dict[str, dict[str, float]]] = defaultdict(dict)
    for r in runs:
        bw = meta[r["variant"]]["copy_bw_tbs"] * 1e12
        for kind, s in by_kind(r, bw).items():
            table[(r["batch"], r["spec_tokens"], kind)][r["variant"]] = s
    same_run = meta.get("stock", {}).get("commit") == meta.get("fused", {}).get("commit")
    for (b, k, kind), vals in sorted(table.items()):
        st, fu = vals.get("stock"), vals.get("fused")
        if st is None or fu is None:
            continue
        lines.append(f"| {b} | {k} | {kind} | {st['median_us']:.1f} | {st['kernels']:.0f} | {fu['median_us']:.1f} | "
                     f"{fu['kernels']:.0f} | {st['median_us'] / fu['median_us']:.2f} | {fu['floor_us']:.1f} | "
                     f"{fu['median_us'] / fu['floor_us']:.2f} |")
    if not same_run:
        lines += ["", "(stock and fused rows come from different runs: compare with care)"]
    goals = []
    for (b, k, kind), vals in sorted(table.items()):
        st, fu = vals.get("stock"), vals.get("fused")
        if b != 1 or st is None or fu is None:
            continue
        ratio, floor = st["median_us"] / fu["median_us"], fu["median_us"] / fu["floor_us"]
        goals.append(f"- B = 1, k = {k}, {kind}: stock/fused {ratio:.2f} (goal ≥ 2.0: "
                     f"{'met' if ratio >= 2 else 'not met'}); fused/floor {floor:.2f} (goal ≤ 1.5: "
                     f"{'met' if floor <= 1.5 else 'not met'}); {fu['kernels']:.0f} kernels per layer "
                     f"(goal ≤ 13: {'met' if fu['kernels'] <= 13 else 'not met'})")
    if goals:
        lines += ["", "Against the fused path's goals (issue 6), computed from the rows above:", ""] + goals
    lines += in_step_side_by_side(table)
    return lines


def in_step_side_by_side(table: dict[tuple, dict[str, dict[str, float]]]) -> list[str]:
    """The side-by-side ratios again from the in-step figures (by_kind's in_step_us), for the
    (B, k, kind) rows where both variants have one; nothing for runs without them."""
    rows = []
    for (b, k, kind), vals in sorted(table.items()):
        st, fu = vals.get("stock"), vals.get("fused")
        if st is None or fu is None or st.get("in_step_us") is None or fu.get("in_step_us") is None:
            continue
        s_us, f_us, floor = st["in_step_us"], fu["in_step_us"], fu["in_step_floor_us"]
        rows.append(f"| {b} | {k} | {kind} | {s_us:.1f} | {f_us:.1f} | {s_us / f_us:.2f} | {floor:.1f} | "
                    f"{f_us / floor:.2f} |")
    if not rows:
        return []
    return ["", "## Inside the step: stock vs fused from the in-step figures", "",
            "The same comparison with each layer's cost inside the step (the in-step column above)",
            "instead of its one-layer graph, the floor over the same layers (all but the step's first);",
            "the goal lines above read the one-layer figures.", "",
            "| B | k | kind | stock in-step us | fused in-step us | stock/fused | floor us | fused/floor |",
            "|---|---|---|---|---|---|---|---|"] + rows


def merge(new: dict[str, Any], md_path: Path = MD_PATH) -> dict[str, Any]:
    """Stored results with `new` merged in (same variant and shape replaced)."""
    old: dict[str, Any] = {"results": [], "meta": {}}
    if md_path.exists():
        found = DATA_RE.search(md_path.read_text())
        if found:
            old = json.loads(found.group(1))
    key = lambda r: (r["variant"], r["batch"], r["spec_tokens"])  # noqa: E731
    fresh = {key(r) for r in new["results"]}
    return {"results": [r for r in old["results"] if key(r) not in fresh] + new["results"],
            "meta": {**old["meta"], **new["meta"]}}


def main(argv: list[str] | None = None, copy_bw: float | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", nargs="+", default=["stock"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--spec", type=int, nargs="+", default=[0], help="k values; k=7 runs at B=1 only")
    ap.add_argument("--layers", default="4-7")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--expert-impl", default="auto", choices=["auto", "grouped_mm", "gather_bmm"])
    ap.add_argument("--eager-ops", action="store_true", help="no torch.compile of the op groups")
    ap.add_argument("--triton-off", nargs="*", default=[], help="op groups kept torch (stock_ops.TRITON_OPS)")
    ap.add_argument("--json", type=Path, help="write results here (GPU run)")
    ap.add_argument("--render", type=Path, help="merge this results JSON into decode.md")
    ap.add_argument("--md", type=Path, default=MD_PATH,
                    help="the table to merge into (default bench/decode.md, the H200 run the "
                         "bundled traces match; a run on another card, or a later run whose traces "
                         "were not captured, gets its own file: decode_h100.md, decode_latest.md)")
    args = ap.parse_args(argv)
    if args.render:
        body = render(merge(json.loads(args.render.read_text()), args.md))
        args.md.write_text(body)
        print(body.split("<!-- decode-bench-data")[0])
        return
    from kimi_decode.config import k3_tp16, parse_layers
    from tracer.capture import git_commit

    # copy_bw: measured by the caller at its process start (bench/fused_device.py); the copy
    # measured here, late in such a process, is then recorded beside it
    late = copy_bandwidth()
    bw = late if copy_bw is None else copy_bw
    shapes = [(b, 0) for b in args.batch if 0 in args.spec] + [(1, k) for k in args.spec if k]
    shapes.sort(key=lambda s: (s[0] != 1, s[0], s[1]))     # B = 1 first: the headline shapes
    results: list[dict[str, Any]] = []
    meta = {variant: {"date": _dt.date.today().isoformat(), "commit": git_commit(),
                      "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                      "copy_bw_tbs": bw / 1e12, **({} if copy_bw is None else {"copy_bw_late_tbs": late / 1e12}),
                      "reps": args.reps, "layers": args.layers, "tp_sim": True,
                      "expert_impl": k3_tp16(expert_impl=args.expert_impl).expert_impl,
                      "compile_ops": not args.eager_ops, "triton_off": list(args.triton_off)}
            for variant in args.variant}
    # shape outer, variant inner, results written after each: a run cut short by the device
    # tool's time limit still leaves complete stock/fused pairs for the shapes it reached
    for b, k in shapes:
        for variant in args.variant:
            cfg = k3_tp16(batch=b, spec_tokens=k, layers=parse_layers(args.layers), tp_sim=True,
                          expert_impl=args.expert_impl, compile_ops=not args.eager_ops,
                          triton_off=tuple(args.triton_off))
            r = bench_config(variant, cfg, args.reps)
            results.append(r)
            for kind, s in by_kind(r, bw).items():
                print(f"{variant} B={b} k={k} {kind}: {s['median_us']:.1f} us (p10 {s['p10_us']:.1f}, p90 "
                      f"{s['p90_us']:.1f}), {s['kernels']:.0f} kernels, {s['mb']:.1f} MB, floor {s['floor_us']:.1f} us",
                      flush=True)
            if args.json:
                args.json.write_text(json.dumps({"results": results, "meta": meta}))
    out = {"results": results, "meta": meta}
    if args.json:
        args.json.write_text(json.dumps(out))
    else:
        args.md.write_text(render(merge(out, args.md)))

if __name__ == "__main__":
    main()
