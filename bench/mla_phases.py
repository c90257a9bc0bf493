"""Where mla_attend's time goes at B = 1: a %globaltimer timeline of every CTA, on the GPU.

Why: the kernel was designed for ≲ 6 µs at B = 1, k = 0 (4.8 MB of latent cache over ~130
CTAs) but takes 16-17 µs alone and ~22 µs in the step with uv_gate inside
(bench/fused_correctness.md, bench/ncu_fused_b1.md); ncu's totals do not say which phase. The
probe build of the kernel (MLAConfig.probe, kernels/mla_attend.PROBE_PHASES) has thread 0 of
each CTA stamp the global nanosecond timer after each phase's barrier; this script runs it on
the K3 TP16 shape with the cache cold (each call reads another copy, copies beyond the 50 MB
L2, as in the step) and reports, over `--runs` calls, the median of:
  - per phase, the time from the kernel's first CTA entry to the phase's first / median /
    last CTA (spread = how far the CTAs drift apart);
  - the critical path: the CTA that ends last (the final merge), phase by phase;
and beside it the plain build's time (CUDA graph, same cold cycling) so the probe's own cost
shows. Variants: the two merges (two-level: groups, then the groups, each by the last CTA to
finish; grid: every CTA merges its share after a barrier), each with the default plan, fewer
splits (sms 66: 2 tiles per CTA) and the uv mode (the step's default at B = 1).

    python3 -m bench.mla_phases --out $OUT      (writes mla_phases.json; render here:)
    python3 -m bench.mla_phases --render mla_phases.json > bench/mla_phases.md
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

COPIES = 12          # 12 × 4.8 MB cache (+ W_UV) cycled: beyond the L2 between reuses


def _variants() -> list[dict]:
    return [{"name": "two-level merge", "sms": 132, "uv": False, "grid": False},
            {"name": "two-level merge, uv mode", "sms": 132, "uv": True, "grid": False},
            {"name": "two-level merge, sms 66 (2 tiles per CTA)", "sms": 66, "uv": False, "grid": False},
            {"name": "grid merge", "sms": 132, "uv": False, "grid": True},
            {"name": "grid merge, uv mode", "sms": 132, "uv": True, "grid": True},
            {"name": "grid merge, sms 66 (2 tiles per CTA)", "sms": 66, "uv": False, "grid": True}]


def measure(runs: int) -> dict:
    """Device side: stamps of `runs` cold calls per variant, and the plain build's time."""
    import torch

    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels.checks import time_us
    from kimi_decode.kernels.mla_attend import (PROBE_PHASES, make_scratch, mla_attend, mla_attend_uv,
                                                reference)
    dev = torch.device("cuda")
    cfg = k3_tp16(batch=1, spec_tokens=0)
    H, T, c, rope = cfg.mla_local_heads, cfg.tokens_per_seq, cfg.kv_lora_rank, cfg.qk_rope_dim
    C, vd, scale = cfg.cache_len, cfg.v_head_dim, (cfg.qk_nope_dim + rope) ** -0.5
    gen = torch.Generator(device=dev).manual_seed(7)
    cache = torch.randn(1, C, c + rope, generator=gen, device=dev)
    cache[..., :c] = torch.nn.functional.rms_norm(cache[..., :c], (c,))
    cache = cache.bfloat16()
    q = (torch.randn(1, T * H, c + rope, generator=gen, device=dev) * 0.5).bfloat16()
    w_uv = (torch.randn(H, c, vd, generator=gen, device=dev) * c ** -0.5).bfloat16()
    g = (torch.randn(T, H * vd, generator=gen, device=dev) * 2.0).bfloat16()
    last = torch.tensor([cfg.context_len + 5], device=dev)
    sets = [(cache.clone(), w_uv.clone()) for _ in range(COPIES)]
    ref = reference(q, cache, last, H, c, scale)
    out: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "C": C,
                 "phases": list(PROBE_PHASES), "runs": runs, "variants": []}
    for v in _variants():
        sc = make_scratch(1, T * H, C, c, dev, sms=v["sms"])
        probe = torch.zeros(sc.splits, len(PROBE_PHASES), dtype=torch.int64, device=dev)

        def call(ca, w, pr=None, sc=sc, v=v):
            if v["uv"]:
                return mla_attend_uv(q, ca, last, H, c, scale, w, g, sc, probe=pr, grid=v["grid"])[1]
            return mla_attend(q, ca, last, H, c, scale, sc, probe=pr, grid=v["grid"])
        o_plain = call(*sets[0])
        o_probe = call(*sets[0], pr=probe)
        torch.cuda.synchronize()
        cyc = itertools.cycle(sets)
        plain_us = time_us(lambda: call(*next(cyc)))
        stamps = []
        for i in range(runs):
            probe.zero_()
            call(*sets[i % COPIES], pr=probe)
            torch.cuda.synchronize()
            stamps.append(probe.cpu().tolist())
        out["variants"].append({
            **v, "splits": sc.splits, "group": sc.group, "groups": sc.groups,
            "tiles_per_split": sc.tiles_per_split, "plain_us": plain_us,
            "probe_equal_plain": bool(torch.equal(o_plain, o_probe)),
            "rel_vs_f64": float(((o_plain.double() - ref).norm() / ref.norm()).item()),
            "counters_zero": int(sc.counters.abs().sum()) == 0, "stamps": stamps})
    return out


def summarise(variant: dict, phases: list[str]) -> dict:
    """Per phase: median over runs of (first, median, last) CTA stamp − the run's first entry,
    in ns; and the critical path (the CTA with the latest end) phase by phase."""
    per_phase: dict[str, list[tuple[int, int, int]]] = {p: [] for p in phases}
    crit: dict[str, list[int]] = {p: [] for p in phases}
    for run in variant["stamps"]:
        t0 = min(row[0] for row in run)
        for j, p in enumerate(phases):
            vals = sorted(row[j] - t0 for row in run if row[j] > 0)
            if vals:
                per_phase[p].append((vals[0], vals[len(vals) // 2], vals[-1]))
        last = max(run, key=lambda row: row[-1])
        for j, p in enumerate(phases):
            if last[j] > 0:
                crit[p].append(last[j] - t0)
    med = lambda xs: int(statistics.median(xs)) if xs else None  # noqa: E731
    return {"phases": {p: (tuple(med([t[i] for t in per_phase[p]]) for i in range(3)) if per_phase[p] else None)
                       for p in phases},
            "critical": {p: med(crit[p]) for p in phases}}


def render(data: dict) -> str:
    """bench/mla_phases.md from the device JSON."""
    phases = data["phases"]
    lines = [f"# mla_attend phase timeline at B = 1, k = 0 (`bench/mla_phases.py`)", "",
             f"- GPU: {data['gpu']}, torch {data['torch']}; commit {data.get('commit', '?')}, {data.get('date', '?')}",
             f"- K3 TP16 shape: 6 query rows (6 local heads, T = 1), C = {data['C']} cached positions "
             f"(4.8 MB bf16), cache cycled over {COPIES} copies (cold, as in the step); {data['runs']} probed calls per variant",
             "- times in µs from the first CTA's entry (%globaltimer, ns); each cell the median over the calls;",
             "  first / median / last: over the CTAs that reached the phase; critical: the CTA that ends last",
             "- plain µs: the build without the probe, CUDA-graph replays (kernels/checks.time_us), same cold cycling",
             "- phases: counter = the CTA passed its group counter (two-level) or the sequence barrier (grid); "
             "merge = its merge done; counter2 / merge2: the group partials' counter and merge (two-level only)",
             "- what the timelines showed, and what changed because of them: bench/fused_runs.md", ""]
    for v in data["variants"]:
        s = summarise(v, phases)
        merge = ("one merge by every CTA" if v.get("grid")
                 else f"{v['groups']} merge groups of ≤ {v['group']}, then the groups")
        lines += [f"## {v['name']}: {v['splits']} splits × {v['tiles_per_split']} tile(s), {merge}", "",
                  f"plain {v['plain_us']:.1f} µs; probe build output equal to plain: {v['probe_equal_plain']}; "
                  f"rel vs float64 {v['rel_vs_f64']:.2e}; counters zero: {v['counters_zero']}", "",
                  "| phase | first CTA | median CTA | last CTA | critical path |", "|---|---|---|---|---|"]
        for p in phases:
            t = s["phases"][p]
            cp = s["critical"][p]
            f = lambda ns: "-" if ns is None else f"{ns / 1000:.2f}"  # noqa: E731
            lines.append(f"| {p} | {f(t[0] if t else None)} | {f(t[1] if t else None)} | "
                         f"{f(t[2] if t else None)} | {f(cp)} |")
        lines.append("")
    return "\n".join(lines)


def cli(doc: str, json_name: str, measure_fn, render_fn, argv: list[str] | None = None) -> None:
    """The probe benches' command line (this one and bench/mla_mma_phases.py): `--out DIR` on
    the device (measure, stamp date and commit, write DIR/json_name, print the markdown),
    `--render FILE` here."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, help=f"device: write {json_name} here")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--render", type=Path, help="here: print the markdown of a device JSON")
    a = ap.parse_args(argv)
    if a.render:
        print(render_fn(json.loads(a.render.read_text())))
        return
    if a.out is None:
        ap.error("give --out DIR (on the device) or --render FILE (here)")
    data = measure_fn(a.runs)
    data["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    data["commit"] = os.environ.get("DECODESCOPE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / json_name).write_text(json.dumps(data))
    print(render_fn(data))


def main() -> None:
    cli(__doc__, "mla_phases.json", measure, render)


if __name__ == "__main__":
    main()
