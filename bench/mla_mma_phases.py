"""Where mla_attend_mma's time goes: a %globaltimer timeline of every CTA, on the GPU.

Why: in the B = 1, k = 7 step (R = 48 query rows, 3 row groups of 44 splits, uv mode) the
kernel ends ~17 µs after mla_glue for ~1.2 µs of cache bytes (bench/fused_runs.md, session
39: the bundled 9f4d4c2 H200 trace), and that attention chain is most of the MLA layer's gap
to the stock/fused ≥ 2 goal (issue 6); at B = 1, k = 0 (R = 6) it takes ~11 µs in the step.
ncu's totals (0.19 instructions per scheduler cycle, stalls spread over barriers, the load
queue and fixed-latency dependencies) do not say which phase holds the time: the cache's first
tile, the tiles after it, the partials, the row group's barrier, the merge or the uv tiles.
The probe build (MMAConfig.probe, mla_attend_mma.PROBE_PHASES) has thread 0 of each CTA stamp
the global nanosecond timer after the barriers between phases. This script runs the probe and
the plain build on the K3 TP16 shapes with the cache and W_UV cold (each call reads another of
COPIES copies, beyond the 50 MB L2, as the step reads them) and reports, over `--runs` calls,
the median of:
  - per phase, the time from the kernel's first CTA entry to the phase's first / median /
    last CTA (the spread says how far the CTAs drift apart);
  - the critical path: the CTA that ends last, phase by phase, and its step from the phase
    before (where the time is spent);
beside the plain build's time (CUDA-graph replays, the same cold cycling) so the probe's own
cost shows, and the probe build's output against the plain one's (must be bit-equal).
Variants: the step's builds at B = 1, k = 0 and k = 7 (uv mode) and B = 8, k = 0; at k = 7 also
the build without the uv tiles and the ungrouped one (G = 1, the A/B of row_groups).

    python3 -m bench.mla_mma_phases --out $OUT      (device: writes mla_mma_phases.json)
    python3 -m bench.mla_mma_phases --render mla_mma_phases.json > bench/mla_mma_phases.md
"""
from __future__ import annotations

import itertools

from bench.mla_phases import cli, summarise   # the command line; per phase (first, median, last CTA)

COPIES = 12          # 12 × (4.8 MB cache + W_UV) cycled: beyond the L2 between reuses


def variants() -> list[dict]:
    """The builds timed: (B, k), uv mode, row groups (None: row_groups' default, the step's)."""
    return [{"name": "B = 1, k = 0, uv mode (the step's build)", "B": 1, "k": 0, "uv": True, "groups": None},
            {"name": "B = 1, k = 7, uv mode (the step's build)", "B": 1, "k": 7, "uv": True, "groups": None},
            {"name": "B = 1, k = 7, o_lat only", "B": 1, "k": 7, "uv": False, "groups": None},
            {"name": "B = 1, k = 7, uv mode, ungrouped (G = 1)", "B": 1, "k": 7, "uv": True, "groups": 1},
            {"name": "B = 8, k = 0, uv mode", "B": 8, "k": 0, "uv": True, "groups": None}]


def measure(runs: int, device: str = "cuda", timer=None) -> dict:
    """Device side: stamps of `runs` cold calls per variant, and the plain build's time
    (`timer`: kernels/checks.time_us unless given; `device` and `timer` let the CPU tests run
    this harness on emulated kernels)."""
    import torch

    from kimi_decode.config import k3_tp16
    from kimi_decode.kernels import mla_attend as k_old
    from kimi_decode.kernels import mla_attend_mma as km
    from kimi_decode.kernels import mla_glue
    from kimi_decode.kernels._common import sm_count
    from kimi_decode.kernels.checks import rel, time_us
    dev = torch.device(device)
    timer = timer or time_us
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out: dict = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else str(dev), "torch": torch.__version__,
                 "phases": list(km.PROBE_PHASES), "runs": runs, "copies": COPIES, "variants": []}
    for v in variants():
        cfg = k3_tp16(batch=v["B"], spec_tokens=v["k"])
        H, T, c, rope = cfg.mla_local_heads, cfg.tokens_per_seq, cfg.kv_lora_rank, cfg.qk_rope_dim
        C, scale = cfg.cache_len, (cfg.qk_nope_dim + rope) ** -0.5
        row = {**v, "C": C, "R": T * H}
        if not km.fits(v["B"], T * H, C, c, sm_count(dev), groups=v["groups"]):
            out["variants"].append({**row, "skipped": "plan does not fit this GPU"})
            continue
        x = k_old.check_inputs(cfg, v["k"], 3000 * v["B"] + v["k"], dev, uv=True)
        q, cache, clean, last, w_uv, g = x["q_full"], x["cache"], x["clean"], x["last"], x["w_uv"], x["g"]
        sc = km.make_scratch(v["B"], T * H, C, c, dev, groups=v["groups"])
        probe = km.probe_buffer(sc)
        sets = [(cache, w_uv)] + [(cache.clone(), w_uv.clone()) for _ in range(COPIES - 1)]

        def call(ca, w, pr=None, sc=sc, v=v):
            if v["uv"]:
                return km.mla_attend_mma_uv(q, ca, last, H, c, scale, w, g, sc, probe=pr)[0]
            return km.mla_attend_mma(q, ca, last, H, c, scale, sc, probe=pr)
        try:
            with torch.no_grad():
                o_plain = call(*sets[0])
                o_probe = call(*sets[0], pr=probe)
        except ValueError as e:          # a wrapper's refusal (e.g. the uv rules on another GPU)
            out["variants"].append({**row, "skipped": str(e)})
            continue
        sync()
        ref = k_old.reference(q, clean, last, H, c, scale)
        if v["uv"]:
            ref = mla_glue.reference_uv(ref, w_uv, g)
        cyc = itertools.cycle(sets)
        plain_us = timer(lambda: call(*next(cyc)))
        stamps = []
        for i in range(runs):
            probe.zero_()
            call(*sets[(i + 1) % COPIES], pr=probe)      # a copy the previous call did not read
            sync()
            stamps.append(probe.cpu().tolist())
        n_valid = (int(last.max()) + 1 + km.TILE - 1) // km.TILE
        out["variants"].append({
            **row, "groups": sc.groups, "splits": sc.splits, "ctas": sc.units * sc.splits,
            "valid_tiles": n_valid, "plain_us": plain_us,
            "probe_equal_plain": bool(torch.equal(o_plain, o_probe)),
            "rel_vs_f64": rel(o_plain, ref),
            "counters_zero": km.arrivals_zero(sc) and int(sc.counters[2 * sc.units:].abs().sum()) == 0,
            "stamps": stamps})
        del sets, cache, clean, sc
    return out


def _us(ns: int | None) -> str:
    return "-" if ns is None else f"{ns / 1000:.2f}"


def render(data: dict) -> str:
    """bench/mla_mma_phases.md from the device JSON."""
    phases = data["phases"]
    lines = ["# mla_attend_mma phase timeline (`bench/mla_mma_phases.py`)", "",
             f"- GPU: {data['gpu']}, torch {data['torch']}; commit {data.get('commit', '?')}, "
             f"{data.get('date', '?')}",
             f"- K3 TP16 shapes; cache and W_UV cycled over {data['copies']} copies (cold, as in the step); "
             f"{data['runs']} probed calls per variant",
             "- times in µs from the first CTA's entry (%globaltimer, ns); each cell the median over the calls;",
             "  first / median / last: over the CTAs that reached the phase; critical: the CTA that ends last,",
             "  and its step from the phase before",
             "- phases (kernels/mla_attend_mma.PROBE_PHASES): waited = griddepcontrol.wait returned; q_staged = q in "
             "shared memory; tile1 = the CTA's first tile done; scores / softmax / pv = the CTA's last tile's "
             "steps; barrier = its row group's barrier passed; merged = its share of the merge; published = its "
             "o_lat share published (uv); end = the uv tile done (uv) or the merge",
             "- plain µs: the build without the probe, CUDA-graph replays (kernels/checks.time_us), same cold cycling",
             ""]
    for v in data["variants"]:
        if v.get("skipped"):
            lines += [f"## {v['name']}: skipped ({v['skipped']})", ""]
            continue
        s = summarise(v, phases)
        lines += [f"## {v['name']}", "",
                  f"R = {v['R']} rows, {v['groups']} row group(s) × {v['splits']} splits ({v['ctas']} CTAs), "
                  f"{v['valid_tiles']} valid tiles of 32 positions (C = {v['C']}); plain {v['plain_us']:.1f} µs; "
                  f"probe output equal to plain: {v['probe_equal_plain']}; rel vs float64 {v['rel_vs_f64']:.2e}; "
                  f"counters zero: {v['counters_zero']}", "",
                  "| phase | first CTA | median CTA | last CTA | critical path | critical step |",
                  "|---|---|---|---|---|---|"]
        prev = None
        for p in phases:
            t = s["phases"][p]
            cp = s["critical"][p]
            step = None if cp is None or prev is None else cp - prev
            lines.append(f"| {p} | {_us(t[0] if t else None)} | {_us(t[1] if t else None)} | "
                         f"{_us(t[2] if t else None)} | {_us(cp)} | {_us(step)} |")
            if cp is not None:
                prev = cp
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    cli(__doc__, "mla_mma_phases.json", measure, render)


if __name__ == "__main__":
    main()
