"""A/B runs of fused settings on the GPU machine, one process per setting, into ONE result file
and one markdown table (the rows of bench/fused_runs.md).

Why: every fused-path session measured its candidates the same way (`bench/fused_device.py
--skip step ref capture --bench-variants fused --patch ...`, one process per setting, in a
known order, the default set in between) with a throwaway shell loop and a throwaway script
that turned the bench.json files into the KDA-range / MLA table; the device returns at most 8
files per call, so the loop also had to juggle folders. This does both: the variants run in
order, each `bench.fused_device` process with its own settings; what comes back is `ab.json`
(every variant's bench.json, its command, start clock, exit code and wall time) and `ab.md`.

On the GPU machine (one command line; a variant is 'NAME: fused_device arguments'):
    python3 -m bench.fused_ab --out $OUT --variant 'base:' \
        --variant 's4w8: --patch kimi_decode.kernels.router_mma:SPLITS=4 kimi_decode.kernels.router_mma:WARPS=8' \
        --variant 'pair: --opt-in gemv_mma_pair'
Here, to render a fetched result again:
    python -m bench.fused_ab --render ab.json

Every variant runs the default kernel set (fused.DEFAULT_KERNELS: those that passed their device
checks in the pipeline whose figures are committed) plus the opt-in kernels its `--opt-in`
names; its other arguments are passed through (`--patch`, `--opt-in`, ...). A variant that
fails or times out gets a row saying so; the others still run. `--captures` runs the captures
instead of the bench and keeps each variant's traces*.tar (compare two with `decodescope diff`).
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.render_cli import print_rendered

KINDS = ("kda", "mla")
MAX_CAPTURE_VARIANTS = 6   # a tar each, plus ab.json and ab.md: the 8 files a device call returns


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """'NAME: ARGS' -> (NAME, shlex-split ARGS); ValueError names what is wrong."""
    name, sep, rest = spec.partition(":")
    name = name.strip()
    if not sep or not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"--variant {spec!r}: expected 'NAME: fused_device arguments' (NAME letters, digits, - or _)")
    return name, shlex.split(rest)


def kernels_for(args: list[str], default: frozenset[str]) -> list[str]:
    """The --kernels list of a variant: the default set plus the kernels its --opt-in names."""
    extra: list[str] = []
    for i, a in enumerate(args):
        if a.startswith("--opt-in="):
            extra.append(a.split("=", 1)[1])
        elif a == "--opt-in":
            for name in args[i + 1:]:
                if name.startswith("--"):
                    break
                extra.append(name)
    return sorted(default | frozenset(extra))


def command(name: str, args: list[str], work: Path, default: frozenset[str], batches: list[int],
            specs: list[int], reps: int, captures: bool) -> list[str]:
    """The bench.fused_device command line of one variant."""
    what = ["--skip", "step", "ref", "bench"] if captures else [
        "--skip", "step", "ref", "capture", "--bench-variants", "fused",
        "--bench-batch", *map(str, batches), "--bench-spec", *map(str, specs)]
    return [sys.executable, "-m", "bench.fused_device", "--out", str(work / name),
            "--kernels", *kernels_for(args, default), *what, "--reps", str(reps), *args]


def run(variants: list[tuple[str, list[str]]], out: Path, work: Path, default: frozenset[str],
        batches: list[int], specs: list[int], reps: int, timeout_s: float, captures: bool,
        runner: Any = subprocess.run) -> dict[str, Any]:
    """Run the variants in order; write out/ab.json and out/ab.md (and, with captures, one
    out/NAME.traces.tar per variant); return the result."""
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    result = {"batches": batches, "specs": specs, "reps": reps, "captures": captures, "variants": rows}
    for name, args in variants:
        cmd = command(name, args, work, default, batches, specs, reps, captures)
        clock = time.strftime("%H:%M", time.gmtime())
        t0 = time.time()
        print(f"[{clock}] {name}: {shlex.join(cmd[1:])}", flush=True)
        try:
            rc = runner(cmd, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        row: dict[str, Any] = {"name": name, "args": args, "clock_utc": clock, "rc": rc,
                               "wall_s": round(time.time() - t0, 1)}
        bench = work / name / "bench.json"
        if not captures and bench.exists():
            row["bench"] = json.loads(bench.read_text())
        for tar in sorted((work / name).glob("traces*.tar")) if captures else []:
            dst = out / f"{name}.{tar.name}"
            dst.write_bytes(tar.read_bytes())
            row.setdefault("traces", []).append(dst.name)
        rows.append(row)
        print(f"  {name}: rc={rc}, {row['wall_s']} s", flush=True)
        # rewritten after every variant: a device call cut off at its time limit keeps the rows so far
        result = {"batches": batches, "specs": specs, "reps": reps, "captures": captures, "variants": rows}
        (out / "ab.json").write_text(json.dumps(result))
        (out / "ab.md").write_text(render(result))
    return result


def shapes(result: dict[str, Any]) -> list[tuple[int, int]]:
    """The (B, k) columns: every shape some variant's bench has, B = 1 first, then by M."""
    seen = {(r["batch"], r["spec_tokens"]) for v in result["variants"] for r in v.get("bench", {}).get("results", [])}
    return sorted(seen, key=lambda s: (s[0] * (1 + s[1]), s[0]))


def cell(bench: dict[str, Any], shape: tuple[int, int]) -> str:
    """'KDA min-max / MLA µs (kernels KDA/MLA)' of the fused variant at one shape; layers of a
    kind that differ in kernel count show their range (e.g. 12-13/20)."""
    res = [r for r in bench.get("results", []) if (r["batch"], r["spec_tokens"]) == shape and r["variant"] == "fused"]
    if not res:
        return "-"
    times, kern = [], []
    for kind in KINDS:
        ls = [layer for layer in res[0]["layers"] if layer["kind"] == kind]
        if not ls:
            times.append("-")
            kern.append("-")
            continue
        us = [layer["median_us"] for layer in ls]
        ks = sorted({layer["kernels"] for layer in ls})
        times.append(f"{min(us):.1f}" if len(us) == 1 else f"{min(us):.1f}-{max(us):.1f}")
        kern.append(f"{ks[0]}-{ks[-1]}" if len(ks) > 1 else str(ks[0]))
    return f"{times[0]} / {times[1]} ({kern[0]}/{kern[1]})"


def render(result: dict[str, Any]) -> str:
    """The markdown table: one row per variant in run order, µs per layer (CUDA events, median
    of the bench's replays), the KDA layers' range / the MLA layer, kernels per layer kind."""
    cols = shapes(result)
    head = ["device clock (UTC)", "variant", "settings"] + ([f"B = {b}, k = {k}" for b, k in cols] or ["result"])
    width = max(1, len(cols))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in result["variants"]:
        settings = shlex.join(v["args"]) or "(default)"
        if "bench" in v:
            cells = [cell(v["bench"], s) for s in cols] or ["bench.json without fused results"]
        else:
            what = ", ".join(v.get("traces", [])) or "no bench.json"
            cells = [f"{what} (rc {v['rc']})"] + [""] * (width - 1)
        lines.append("| " + " | ".join([v["clock_utc"], v["name"], f"`{settings}`", *cells]) + " |")
    meta = next((v["bench"].get("meta", {}).get("fused", {}) for v in result["variants"] if "bench" in v), {})
    if meta:
        lines += ["", f"{meta.get('gpu', '?')}, commit {meta.get('commit', '?')}, {meta.get('date', '?')}, "
                      f"{result['reps']} replays per layer, copy bandwidth {meta.get('copy_bw_tbs', 0):.2f} TB/s "
                      "(first variant's process); µs per layer: KDA layers' range / MLA layer (kernels KDA/MLA)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="where ab.json and ab.md go (the device's $OUT)")
    ap.add_argument("--variant", action="append", default=[], help="'NAME: fused_device arguments', in run order")
    ap.add_argument("--batch", type=int, nargs="+",
                    help="B at k = 0 (default 1 8; runs only when --spec includes 0, as in bench/decode.py)")
    ap.add_argument("--spec", type=int, nargs="+", default=[0, 7], help="k at B = 1")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--timeout-s", type=float, default=150.0, help="per variant")
    ap.add_argument("--captures", action="store_true", help="captures instead of the bench (traces kept)")
    ap.add_argument("--work", type=Path, help="the variants' own output folders (default: a temporary one)")
    ap.add_argument("--render", type=Path, help="print the table of an ab.json (no GPU)")
    a = ap.parse_args(argv)
    if a.render is not None:
        print_rendered(a.render, render, "fused_ab", "an ab.json")
        return
    if a.out is None or not a.variant:
        raise SystemExit("fused_ab: --out and at least one --variant are needed (or --render FILE)")
    try:
        variants = [parse_variant(v) for v in a.variant]
    except ValueError as e:
        raise SystemExit(f"fused_ab: {e}") from None
    names = [n for n, _ in variants]
    if len(set(names)) != len(names):
        raise SystemExit(f"fused_ab: variant names repeat: {names} (name each run: base, base2, ...)")
    if a.captures and len(variants) > MAX_CAPTURE_VARIANTS:
        raise SystemExit(f"fused_ab: --captures keeps one trace tar per variant and the GPU machine returns 8 "
                         f"files: at most {MAX_CAPTURE_VARIANTS} variants, got {len(variants)}")
    if a.batch is not None and 0 not in a.spec:
        # bench/decode.py times B > 1 at k = 0 only, and only when 0 is among the k values:
        # without this the B column would silently be missing (session 15's first try)
        raise SystemExit(f"fused_ab: --batch {' '.join(map(str, a.batch))} runs at k = 0, but --spec "
                         f"{' '.join(map(str, a.spec))} has no 0: add 0 to --spec or leave --batch out")
    batches = a.batch if a.batch is not None else [1, 8]
    from kimi_decode.fused import DEFAULT_KERNELS
    work = a.work or Path(tempfile.mkdtemp(prefix="fused_ab_"))
    run(variants, a.out, work, frozenset(DEFAULT_KERNELS), batches, a.spec, a.reps, a.timeout_s, a.captures)
    print((a.out / "ab.md").read_text(), end="")


if __name__ == "__main__":
    main()
