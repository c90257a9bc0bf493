"""Device job for the CUPTI backend (issue 9): do the PyTorch-profiler and the CUPTI backends
see the same decode step, and what does each cost?

One call on the GPU machine runs, in separate processes (CUPTI's activity callbacks and the
NVTX injection are per process, and the PyTorch profiler drives CUPTI itself):

- `--role smoke` per staged cupti-python build (PYTHONPATH dirs in --cupti-paths): does it
  load against this driver's libcupti and return sane kernel / NVTX / graph records? The
  first build that passes is used;
- `--role pytorch` and `--role cupti`: capture the step (graph and eager) with that backend,
  then time it: median wall time of a step (launch + synchronize) over --reps steps with no
  profiler, then under that backend (PyTorch profiler CPU+CUDA, or CUPTI activities);
- the parent compares the traces: the kernel name sequence of every profiled step (first
  graph replay / first eager step must be identical across backends) and per-layer span and
  busy time (median over steps) from the JSON, in plain Python.

    DECODESCOPE_COMMIT=$(git rev-parse HEAD) python3 -m bench.cupti_device --out $OUT \
        --cupti-paths /tmp/site:/tmp/site130

Results: $OUT/cupti_results.json and the four traces k3_stock_b1_k0_{graph,eager}_{pytorch,cupti}.json.gz.
Locally (no GPU) `--preset tiny --device cpu --modes eager --roles pytorch` runs the same code.
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

ROLES = ("pytorch", "cupti")


def trace_name(mode: str, role: str, batch: int = 1, k: int = 0) -> str:
    return f"k3_stock_b{batch}_k{k}_{mode}_{role}.json.gz"


# ---------------------------------------------------------------- analysis (plain Python)

def load(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as fh:
        return json.load(fh)


def ns(v: float) -> int:
    """Kineto µs (3 decimals) -> integer ns."""
    return round(float(v) * 1000)


def step_kernels(trace: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Kernels of each profiled step, start order: graph replays (the kernels sharing one
    cudaGraphLaunch correlation, layer/op by position from the capture map), else eager steps
    (kernels whose launch lies in the i-th `step` range of the launching thread)."""
    from tracer.capture import graph_replays, kernels_with_ops

    ds = trace.get("decodescope", {})
    kernels = kernels_with_ops(trace)
    ends = {(e.get("args", {}).get("correlation"), e["name"], float(e["ts"])): float(e["ts"]) + float(e["dur"])
            for e in trace["traceEvents"] if e.get("cat") == "kernel"}
    for k in kernels:
        k["end"] = ends[(k["correlation"], k["name"], k["ts"])]
    if ds.get("graph_mode"):
        cmap = ds.get("graph_capture_map") or []
        steps = graph_replays(kernels)
        for rep in steps:
            if len(rep) == len(cmap):
                for k, m in zip(rep, cmap):
                    k["layer"], k["op"] = m["layer"], m["op"]
        return steps
    ranges = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in trace["traceEvents"]
                    if e.get("cat") == "user_annotation" and e["name"] == "step")
    launches = {e["args"]["correlation"]: float(e["ts"]) for e in trace["traceEvents"]
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    out: list[list[dict[str, Any]]] = [[] for _ in ranges]
    starts = [r[0] for r in ranges]
    for k in kernels:
        t = launches.get(k["correlation"])
        i = bisect.bisect_right(starts, t) - 1 if t is not None else -1
        if i >= 0 and t <= ranges[i][1]:
            out[i].append(k)
    return out


def union_ns(iv: list[tuple[int, int]]) -> int:
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(iv):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0)


def per_layer(steps: list[list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per layer: median over steps of span (first kernel start to last end) and busy (union
    of its kernels), in ns; kernels per step."""
    acc: dict[str, dict[str, list[int]]] = defaultdict(lambda: {"span": [], "busy": [], "kernels": []})
    for ks in steps:
        by: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for k in ks:
            if k.get("layer"):
                by[k["layer"]].append((ns(k["ts"]), ns(k["end"])))
        for layer, iv in by.items():
            acc[layer]["span"].append(max(e for _, e in iv) - min(s for s, _ in iv))
            acc[layer]["busy"].append(union_ns(iv))
            acc[layer]["kernels"].append(len(iv))
    return {layer: {key: statistics.median(v) for key, v in d.items()} for layer, d in sorted(acc.items())}


def compare(base: dict[str, Any], cand: dict[str, Any]) -> dict[str, Any]:
    """Kernel sequences and per-layer times of two traces of the same step (base: PyTorch)."""
    sb, sc = step_kernels(base), step_kernels(cand)
    nb = [[k["name"] for k in s] for s in sb]
    nc = [[k["name"] for k in s] for s in sc]
    first_same = bool(nb and nc and nb[0] == nc[0])
    diverge = None
    if nb and nc and not first_same:
        diverge = next((i for i, (a, b) in enumerate(zip(nb[0], nc[0])) if a != b), min(len(nb[0]), len(nc[0])))
    lb, lc = per_layer(sb), per_layer(sc)
    layers = []
    for layer in sorted(set(lb) | set(lc)):
        row: dict[str, Any] = {"layer": layer}
        for key in ("span", "busy", "kernels"):
            b, c = lb.get(layer, {}).get(key), lc.get(layer, {}).get(key)
            row[f"{key}_pytorch"], row[f"{key}_cupti"] = b, c
            if key != "kernels" and b and c is not None:
                row[f"{key}_diff_pct"] = round(100.0 * (c - b) / b, 3)
        layers.append(row)
    return {"steps_pytorch": len(sb), "steps_cupti": len(sc),
            "kernels_per_step_pytorch": [len(s) for s in nb], "kernels_per_step_cupti": [len(s) for s in nc],
            "first_step_same_sequence": first_same, "first_divergence": diverge,
            "all_steps_same_sequence": bool(nb) and all(s == nb[0] for s in nb + nc),
            "layers": layers,
            "max_abs_span_diff_pct": max((abs(r["span_diff_pct"]) for r in layers if "span_diff_pct" in r), default=None),
            "max_abs_busy_diff_pct": max((abs(r["busy_diff_pct"]) for r in layers if "busy_diff_pct" in r), default=None)}


# ---------------------------------------------------------------- roles (child processes)

def _config(args: argparse.Namespace) -> Any:
    from kimi_decode.config import PRESETS

    cfg = PRESETS[args.preset](batch=1, spec_tokens=0, layers=(4, 5, 6, 7) if args.preset == "k3_tp16" else (0, 1, 2, 3),
                               compile_ops=args.compile_ops)
    return cfg.with_(tp_sim=cfg.tp > 1)


def time_steps(step: Any, n: int, cuda: bool) -> list[int]:
    """Wall ns of n steps, each launch + synchronize."""
    import torch

    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        step()
        if cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter_ns() - t0)
    return out


def _summary(v: list[int]) -> dict[str, float]:
    q = statistics.quantiles(v, n=10)
    return {"median_us": statistics.median(v) / 1000, "p10_us": q[0] / 1000, "p90_us": q[-1] / 1000, "n": len(v)}


def role_main(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    res: dict[str, Any] = {"role": args.role}
    cuda = args.device.startswith("cuda")
    if args.role in ("cupti", "smoke"):
        from tracer.capture_cupti import load_cupti, route_nvtx_to_cupti, versions

        cupti = load_cupti()
        res["nvtx_injection"] = route_nvtx_to_cupti(cupti)  # before any NVTX call
        res["versions"] = versions()
    if args.role == "smoke":
        return smoke(res)
    from kimi_decode.runner import build, prepare
    from tracer.capture import capture

    cfg = _config(args)
    res["config"] = {"preset": args.preset, "batch": 1, "spec_tokens": 0, "layers": list(cfg.layers),
                     "tp_sim": cfg.tp_sim, "compile_ops": cfg.compile_ops, "expert_impl": cfg.expert_impl}
    kw = {"profiler": None, "backend": "pytorch"}
    if args.role == "cupti":
        from tracer.capture_cupti import profile_cupti

        kw = {"profiler": profile_cupti, "backend": "cupti"}
    for mode in args.modes:
        t0 = time.time()
        path = Path(args.out) / trace_name(mode, args.role)
        meta = capture("stock", cfg, graph=mode == "graph", steps=args.steps, out=path, warmup=3,
                       device=args.device, **kw)
        res[f"capture_{mode}"] = {"seconds": round(time.time() - t0, 1), "bytes": path.stat().st_size,
                                  "map_kernels": len(meta["graph_capture_map"]),
                                  "matched": meta["graph_capture_map_matched"], "notes": meta["notes"]}
        print(json.dumps(res[f"capture_{mode}"]), flush=True)
    model, _ = build("stock", cfg, args.device)
    inputs = model.make_inputs()
    for mode in args.modes:
        step = prepare(model, inputs, graph=mode == "graph", warmup=3)
        time_steps(step, 5, cuda)
        res[f"time_{mode}_none"] = _summary(time_steps(step, args.reps, cuda))
        if args.role == "pytorch":
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            with torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False) as prof:
                t = time_steps(step, args.reps, cuda)
            t_post = time.perf_counter()
            prof.key_averages()  # Kineto's post-processing, paid once per window (reported apart)
            res[f"time_{mode}_pytorch_post_s"] = round(time.perf_counter() - t_post, 3)
        else:
            from tracer.capture_cupti import start, stop

            start(cupti)
            t = time_steps(step, args.reps, cuda)
            t_post = time.perf_counter()
            records = stop(cupti)
            res[f"time_{mode}_cupti_post_s"] = round(time.perf_counter() - t_post, 3)
            res[f"time_{mode}_cupti_records"] = len(records)
        res[f"time_{mode}_{args.role}"] = _summary(t)
        print(mode, json.dumps({k: v for k, v in res.items() if k.startswith(f"time_{mode}")}), flush=True)
    return res


def smoke(res: dict[str, Any]) -> dict[str, Any]:
    """A matmul in an NVTX range, eagerly and from a CUDA graph, under CUPTI: sane records?"""
    import torch

    from tracer.capture_cupti import load_cupti, profile_cupti

    cupti = load_cupti()
    a = torch.randn(256, 256, device="cuda")
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a @ a
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        b = a @ a

    def step() -> None:
        torch.cuda.nvtx.range_push("smoke")
        a @ a
        g.replay()
        torch.cuda.nvtx.range_pop()

    trace = profile_cupti(step, 2, True)
    ev = trace["traceEvents"]
    ks = [e for e in ev if e["cat"] == "kernel"]
    res.update(cupti=trace["cupti"], kernels=len(ks), kernel_names=sorted({e["name"][:60] for e in ks}),
               graph_kernels=sum("graph node id" in e["args"] for e in ks),
               annotations=sum(e["cat"] == "user_annotation" for e in ev),
               api_names=sorted({e["name"] for e in ev if e["cat"] in ("cuda_runtime", "cuda_driver")}),
               durations_positive=all(0 < e["dur"] < 1e6 for e in ks))
    res["ok"] = bool(ks) and res["durations_positive"] and res["graph_kernels"] > 0
    del b
    return res


# ---------------------------------------------------------------- parent

def run_child(args: argparse.Namespace, role: str, extra_env: dict[str, str], timeout: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.cupti_device", "--role", role, "--out", str(args.out),
           "--preset", args.preset, "--device", args.device, "--steps", str(args.steps), "--reps", str(args.reps),
           "--modes", *args.modes] + (["--compile-ops"] if args.compile_ops else [])
    env = dict(os.environ, **extra_env)
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return {"role": role, "error": f"timed out after {timeout} s", "stderr": str(exc.stderr)[-3000:]}
    sys.stdout.write(proc.stdout[-6000:])
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        return {"role": role, "error": f"exit {proc.returncode}", "stderr": proc.stderr[-4000:],
                "seconds": round(time.time() - t0, 1)}
    res = json.loads(line[len("RESULT "):])
    res["seconds"] = round(time.time() - t0, 1)
    return res


def compare_only(args: argparse.Namespace) -> dict[str, Any]:
    """Compare the traces already in --out; with --refine, first rewrite the CUPTI ones with
    tracer.cupti_convert.refine (traces captured before the Kineto naming rules)."""
    from tracer.cupti_convert import refine

    out, res = Path(args.out), {}
    for mode in args.modes:
        paths = [out / trace_name(mode, r) for r in ROLES]
        base, cand = load(paths[0]), load(paths[1])
        if args.refine:
            res[f"refine_{mode}"] = refine(cand)
            cand.setdefault("cupti", {}).setdefault("notes", []).append(
                f"names refined after capture by tracer.cupti_convert.refine ({res[f'refine_{mode}']})")
            body = json.dumps(cand).encode()
            with gzip.open(paths[1], "wb", compresslevel=9) as fh:
                fh.write(body)
        res[mode] = compare(base, cand)
        res[mode]["bytes"] = {r: p.stat().st_size for r, p in zip(ROLES, paths)}
    (out / "cupti_compare.json").write_text(json.dumps(res, indent=1))
    return res


def parent(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"commit": os.environ.get("DECODESCOPE_COMMIT"),
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        import torch

        results["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        results["torch"], results["cuda"] = torch.__version__, torch.version.cuda
    except Exception as exc:
        results["gpu"] = repr(exc)
    cupti_env: dict[str, str] | None = None
    if "cupti" in args.roles:
        results["smoke"] = []
        base = os.environ.get("PYTHONPATH", "")
        for p in [p for p in args.cupti_paths.split(":") if p]:
            env = {"PYTHONPATH": p + (":" + base if base else "")}
            r = run_child(args, "smoke", env, 60)
            r["path"] = p
            results["smoke"].append(r)
            print("smoke", json.dumps(r)[:3000], flush=True)
            if r.get("ok"):
                cupti_env = env
                break
    for role in args.roles:
        if role == "cupti" and cupti_env is None:
            results[role] = {"error": "no staged cupti-python build passed the smoke test"}
            continue
        results[role] = run_child(args, role, cupti_env if role == "cupti" else {}, args.child_timeout)
        print(role, json.dumps(results[role])[:4000], flush=True)
    results["compare"] = {}
    for mode in args.modes:
        paths = [out / trace_name(mode, r) for r in ROLES]
        if all(p.exists() for p in paths):
            try:
                results["compare"][mode] = compare(load(paths[0]), load(paths[1]))
            except Exception:
                results["compare"][mode] = {"error": traceback.format_exc()}
    (out / "cupti_results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results["compare"], indent=1), flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--role", choices=("parent", "smoke", "compare") + ROLES, default="parent")
    ap.add_argument("--refine", action="store_true", help="with --role compare: apply cupti_convert.refine first")
    ap.add_argument("--roles", nargs="*", default=list(ROLES), choices=ROLES)
    ap.add_argument("--modes", nargs="*", default=["graph", "eager"], choices=["graph", "eager"])
    ap.add_argument("--preset", default="k3_tp16", choices=["k3_tp16", "tiny"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=5, help="profiled steps per captured trace")
    ap.add_argument("--reps", type=int, default=50, help="timed steps per (mode, profiler)")
    ap.add_argument("--compile-ops", action="store_true", help="torch.compile the op groups (slower start)")
    ap.add_argument("--cupti-paths", default="", help="':'-separated PYTHONPATH dirs, one cupti-python build each")
    ap.add_argument("--child-timeout", type=int, default=200)
    args = ap.parse_args(argv)
    if args.role == "parent":
        parent(args)
        return
    if args.role == "compare":
        print(json.dumps(compare_only(args), indent=1))
        return
    res = role_main(args)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
