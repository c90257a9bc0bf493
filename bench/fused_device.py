"""The fused path's GPU job, everything in one device call (device time is scarce):

1. each CuTe DSL kernel against the stock op it replaces, and timed against it
   (kimi_decode/kernels/checks.py); a kernel passes only if every case passes;
2. the fused step (only passing kernels on) against the stock step from the same weights and
   state: B ∈ {1, 8, 64}, k ∈ {0, 7}, 3 steps with state carried; and both against the float64
   reference (tests/kimi_decode/k3_reference.py) on a two-layer slice;
3. the fused traces `k3_fused_b{B}_k{k}_{eager|graph}.json.gz` (same shapes as the stock ones),
   with `prefetch_ops` / `prefetch_streams` filled in the metadata;
4. bench/decode.py for the fused variant (same settings as the stock run), if time is left.
Outputs under --out (the device tool returns at most 8 files): results.json (kernels, step,
reference, captures), bench.json, traces*.tar, and fused_correctness.md (the report committed
as bench/fused_correctness.md). Phases past --budget-s seconds are skipped, so the command
ends inside the device tool's 10-minute limit with what it has.

    source .device-wheels/p2/install.sh && python3 -m bench.fused_device --out $OUT

An A/B of one fused setting (one process per setting; `--patch` sets module constants first,
apply_patch; --bench-spec 0 is what includes the k = 0 shapes):

    python3 -m bench.fused_device --out $OUT/a --kernels <set> --skip step ref capture
        --bench-variants fused --bench-batch 8 --bench-spec 0 7
        --patch 'kimi_decode.kernels.gemv_mma:TUNED[(3584, 7168)]=(16, 4)'
(one command line). An opt-in kernel (fused.OPT_IN) is timed only when named in --kernels and
in --opt-in. bench/fused_ab.py runs several such settings in order and returns one table.
"""
from __future__ import annotations

import argparse
import ast
import gzip
import importlib
import importlib.util
import json
import time
import traceback
from pathlib import Path
from typing import Any, Iterable

import torch

# Verified but not used in the timed runs (bench, captures): fused.OPT_IN (slower where they
# would run, see there), so the headline runs without them.
from kimi_decode.fused import OPT_IN

STEP_SHAPES = [(1, 0), (8, 0), (64, 0), (1, 7), (8, 7), (64, 7)]
CAPTURE_SHAPES = [(1, 0), (8, 0), (64, 0), (1, 7)]
STEP_TOL = 2e-2      # fused vs stock, relative L2 (outputs and states) over 3 steps and 4 layers


def log(*a: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


T0 = time.time()
RESULTS: dict[str, Any] = {}
ISO_ROWS: dict[str, list[dict]] = {}   # kernel -> its isolated check's rows (untimed)
DEVICE = "cuda"      # the CPU dry run of this job (tests/kimi_decode/test_fused_device.py)
LAYERS = (4, 5, 6, 7)
REF_LAYERS = (6, 7)  # one KDA and one MLA layer


def make_cfg(**kw: Any) -> Any:
    """The config of every run here: K3 TP16 rank 0 (the dry run swaps in a tiny one)."""
    from kimi_decode.config import k3_tp16
    return k3_tp16(**kw)


def _free() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def save(out: Path, key: str, value: Any) -> None:
    """Results so far into results.json (rewritten after every phase)."""
    RESULTS[key] = value
    (out / "results.json").write_text(json.dumps(RESULTS, indent=1))


def isolated_checks(out: Path, names: tuple[str, ...] | None = None,
                    patches: list[str] | None = None) -> frozenset[str]:
    """Correctness of each kernel in its own process, all at once: a kernel that faults
    (an illegal address poisons the CUDA context) cannot take this process down with it,
    and the four compiles overlap. `patches` (the run's --patch settings) go to every child:
    an A/B setting of a kernel is checked as it will run, not at the module's default."""
    import os
    import subprocess
    import sys
    from kimi_decode.kernels import KERNELS
    procs = {k: subprocess.Popen([sys.executable, "-m", "bench.fused_device", "--out", str(out),
                                  "--isolated", k, *(["--patch", *patches] if patches else [])],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 env=dict(os.environ)) for k in (names or KERNELS)}
    ok, notes = set(), {}
    for k, p in procs.items():
        try:
            text = p.communicate(timeout=240)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            p.kill()
            text = "timeout"
        notes[k] = text[-3000:]
        ISO_ROWS[k] = []
        for line in text.splitlines():
            if line.startswith("{"):
                try:
                    ISO_ROWS[k].append(json.loads(line))
                except ValueError:
                    pass
        if p.returncode == 0 and "ISOLATED-OK" in text:
            ok.add(k)
        log("isolated", k, "ok" if k in ok else "FAIL", text[-1500:] if k not in ok else "")
    save(out, "isolated", {"passed": sorted(ok), "logs": notes})
    return frozenset(ok)


def run_isolated(name: str) -> None:
    """Child process: one kernel's correctness check, no timing; exit 0 and a marker if ok."""
    from kimi_decode.kernels.checks import CHECKS
    res = CHECKS[name](timing=False)
    for r in res:
        print(json.dumps(r, default=str), flush=True)
    torch.cuda.synchronize()
    if all(r["ok"] for r in res):
        print("ISOLATED-OK", flush=True)


def kernel_checks(out: Path, names: frozenset[str],
                  checked: frozenset[str] | None = None) -> tuple[frozenset[str], list[dict]]:
    """Full checks with timings, in this process, for the kernels that passed in isolation."""
    from kimi_decode.kernels.checks import CHECKS
    checked = frozenset(CHECKS) if checked is None else checked
    rows: list[dict] = []
    passed = set()
    for name, fn in CHECKS.items():
        if name not in checked:
            continue
        if name not in names:
            rows.append({"kernel": name, "ok": False, "error": "failed its isolated check (results.json: isolated)"})
            continue
        t0 = time.time()
        try:
            res = fn()
            ok = all(r["ok"] for r in res)
        except Exception:
            res, ok = [{"kernel": name, "ok": False, "error": traceback.format_exc()}], False
        if ok:
            passed.add(name)
        rows += res
        log(name, "PASS" if ok else "FAIL", f"{time.time() - t0:.0f} s")
        for r in res:
            log("  ", json.dumps(r)[:400])
        save(out, "kernels", rows)
    return frozenset(passed), rows


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def step_parity(kernels: frozenset[str], base: dict[str, Any], forced: bool = False,
                shapes: list[tuple[int, int]] | None = None) -> list[dict]:
    """Fused vs stock over 3 steps per shape: outputs, blocks and every state buffer.

    A routing near-tie (the 16th and 17th expert scores within a bf16 rounding of each other)
    may pick a different expert in one path; that row, and through the shared KDA/MLA state
    every later row of its sequence, then legitimately differ. Such sequences are reported and
    left out of the comparison from that step on (`sequences_compared`); all others must agree
    within STEP_TOL."""
    from kimi_decode.fused import FusedDecoder
    from kimi_decode.runner import build
    res = []
    for b, k in shapes or STEP_SHAPES:
        t0 = time.time()
        try:
            cfg = make_cfg(batch=b, spec_tokens=k, layers=LAYERS, tp_sim=True, **base)
            stock, _ = build("stock", cfg, DEVICE)
            fused = FusedDecoder.from_stock(stock, kernels)
            T = cfg.tokens_per_seq
            errs: dict[str, float] = {}
            seq_ok = torch.ones(b, dtype=torch.bool, device=stock.pos.device)
            same_routes, rows = 0, 0
            for s in range(3):
                m, prefix, blocks = stock.make_inputs(seed=100 + s)
                blocks_f = blocks.clone()
                with torch.no_grad():
                    if forced:   # fused follows stock's expert choice layer by layer (see fused.py)
                        o_s = stock_forcing(stock, fused, m, prefix, blocks)
                    else:
                        o_s = stock(m, prefix, blocks)
                    o_f = fused(m, prefix, blocks_f)
                for ls, lf in zip(stock.layers, fused.layers):
                    if getattr(ls.mlp, "last_idx", None) is not None:
                        a, c = ls.mlp.last_idx.sort(-1).values, lf.mlp.last_idx.sort(-1).values
                        same = (a == c).all(-1)
                        same_routes += int(same.sum())
                        rows += a.shape[0]
                        if not forced:
                            seq_ok &= same.reshape(b, T).all(-1)
                keep = seq_ok.repeat_interleave(T)
                if bool(keep.any()):
                    for name, x, y in (("m", o_f[0], o_s[0]), ("prefix", o_f[1], o_s[1]),
                                       ("blocks", blocks_f, blocks)):
                        errs[name] = max(errs.get(name, 0.0), rel(x[keep], y[keep]))
            bufs_f = dict(fused.named_buffers())
            for name, buf in stock.named_buffers():
                if buf.is_floating_point() and bool(seq_ok.any()):
                    x, y = (bufs_f[name][seq_ok], buf[seq_ok]) if buf.shape[0] == b else (bufs_f[name], buf)
                    errs[f"state {name}"] = rel(x, y)
            worst = max(errs.values()) if errs else float("nan")
            res.append({"B": b, "k": k, "routing": "forced (stock's)" if forced else "own",
                        "kernels": sorted(fused.kernels), "errors": errs,
                        "max_rel": worst, "routing_rows_same": f"{same_routes}/{rows}",
                        "sequences_compared": f"{int(seq_ok.sum())}/{b}",
                        "ok": bool(errs) and worst <= STEP_TOL, "seconds": round(time.time() - t0, 1)})
            del stock, fused
        except Exception:
            res.append({"B": b, "k": k, "routing": "forced" if forced else "own", "ok": False, "error": traceback.format_exc()})
        _free()
        log("step", json.dumps(res[-1])[:600])
    return res


def stock_forcing(stock: Any, fused: Any, m: torch.Tensor, prefix: torch.Tensor,
                  blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One stock step, then hand each MoE layer's routing (ids and weights) to the fused
    layer of the same index for its next step. The fused router still runs (its own choice
    stays in last_idx, counted in `routing rows same`), but the experts follow stock's, so a
    near-tie cannot make the two paths diverge and every sequence is compared."""
    out = stock(m, prefix, blocks)
    for ls, lf in zip(stock.layers, fused.layers):
        if getattr(ls.mlp, "last_idx", None) is not None and hasattr(lf.mlp, "forced_routing"):
            lf.mlp.forced_routing = (ls.mlp.last_idx.clone(), ls.mlp.last_w.clone())
    return out


def reference_check(kernels: frozenset[str], base: dict[str, Any]) -> list[dict]:
    """Stock and fused each against its own float64 reference (layers 6 KDA + 7 MLA, 2 steps),
    each reference following its model's expert choice, so the errors measure numerics and
    not a routing near-tie the two paths resolved differently.
    Pass: fused's relative error at most twice stock's own bf16 error (+1e-3)."""
    from kimi_decode.fused import FusedDecoder
    from kimi_decode.runner import build
    from tests.kimi_decode.k3_reference import Reference
    res = []
    for b, k in ((1, 0), (1, 7)):
        try:
            cfg = make_cfg(batch=b, spec_tokens=k, layers=REF_LAYERS, tp_sim=True, **base)
            stock, _ = build("stock", cfg, DEVICE)
            fused = FusedDecoder.from_stock(stock, kernels)
            ref_s = Reference(stock, sim_world=cfg.sim_world, rank=cfg.rank)
            ref_f = Reference(stock, sim_world=cfg.sim_world, rank=cfg.rank)   # same start state
            row: dict[str, Any] = {"B": b, "k": k, "steps": []}
            for s in range(2):
                m, prefix, blocks = stock.make_inputs(seed=10 + s)
                with torch.no_grad():
                    o_s = stock(m, prefix, blocks.clone())
                    o_f = fused(m, prefix, blocks.clone())
                ref_s.forced = [r.clone() for layer in stock.layers for r in layer.mlp.last_idx]
                ref_f.forced = [r.clone() for layer in fused.layers for r in layer.mlp.last_idx]
                rs_m, rs_prefix, _ = ref_s.step(m, prefix, blocks.clone())
                rf_m, rf_prefix, _ = ref_f.step(m, prefix, blocks.clone())
                row["steps"].append({"stock_rel_m": rel(o_s[0], rs_m), "fused_rel_m": rel(o_f[0], rf_m),
                                     "stock_rel_prefix": rel(o_s[1], rs_prefix),
                                     "fused_rel_prefix": rel(o_f[1], rf_prefix)})
            row["ok"] = all(st["fused_rel_m"] <= 2 * st["stock_rel_m"] + 1e-3 for st in row["steps"])
            res.append(row)
            del stock, fused, ref_s, ref_f
        except Exception:
            res.append({"B": b, "k": k, "ok": False, "error": traceback.format_exc()})
        _free()
        log("reference", json.dumps(res[-1])[:600])
    return res


def timed_set(passed: frozenset[str], opt_in: Iterable[str] = ()) -> frozenset[str]:
    """The kernels the bench and the captures run: those that passed, less fused.OPT_IN (slower
    where they would run) except the ones named in --opt-in (an A/B of one of them)."""
    return frozenset(passed) - (OPT_IN - frozenset(opt_in))


def needs_cute_dsl(skip: Iterable[str], bench_variants: Iterable[str]) -> bool:
    """Whether this run builds fused kernels: everything but a stock-only bench with the kernel
    checks, step parity, reference and captures skipped."""
    return not ({"kernels", "step", "ref", "capture"} <= set(skip) and "fused" not in set(bench_variants))


def missing_cute_dsl() -> str | None:
    """The one-line reason CUTLASS DSL cannot be imported here, or None. Without it every
    fused kernel fails on its own, each check and step row with its own traceback, so a
    device call made without the wheels (its install call got no machine) would spend its
    time printing them; the job stops at once instead."""
    if importlib.util.find_spec("cutlass") is None:
        return ("CUTLASS DSL is not installed on this machine (no module 'cutlass'): install "
                "nvidia-cutlass-dsl first (on the GPU machine: ../shared/device/stage-wheels.sh's calls)")
    return None


def apply_patch(spec: str) -> str:
    """One A/B setting of a module constant, applied before anything is built:
    'package.module:NAME=LITERAL' sets an attribute, 'package.module:NAME[KEY]=LITERAL' an item
    of a dict attribute (KEY and LITERAL are Python literals: ast.literal_eval, no code runs).
    E.g. 'kimi_decode.kernels.gemv_mma:TUNED[(3584, 7168)]=(16, 4)' or
    'kimi_decode.fused:MAX_ROWS["kda"]=8'. Returns the spec as applied (for the log and
    results.json); ValueError names what is wrong."""
    try:
        mod_name, rest = spec.split(":", 1)
        target, value = (p.strip() for p in rest.split("=", 1))
        val = ast.literal_eval(value)
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"--patch {spec!r}: expected module:NAME=LITERAL or module:NAME[KEY]=LITERAL ({e})") from None
    mod = importlib.import_module(mod_name)
    if target.endswith("]") and "[" in target:
        name, key = target[:-1].split("[", 1)
        table = getattr(mod, name.strip(), None)
        if not isinstance(table, dict):
            raise ValueError(f"--patch {spec!r}: {mod_name}.{name.strip()} is not a dict")
        table[ast.literal_eval(key)] = val
    else:
        if not target.isidentifier() or not hasattr(mod, target):
            raise ValueError(f"--patch {spec!r}: {mod_name} has no attribute {target!r}")
        setattr(mod, target, val)
    return spec


def bench(out: Path, kernels: frozenset[str], impl: str, reps: int, compile_ops: bool,
          batches: tuple[int, ...] = (1, 8, 64), specs: tuple[int, ...] = (0, 7),
          copy_bw: float | None = None, variants: tuple[str, ...] = ("stock", "fused"),
          layers: str = "4-7") -> None:
    """bench/decode.py for `variants` (B in `batches` at k = 0, k in `specs` at B = 1) over
    `layers` (the committed tables: 4-7; deeper layers mix more AttnRes blocks, which some
    per-M rules depend on, fused.ATTN_RES_MC_WIDE_MAX_NB); `copy_bw`: the copy bandwidth
    measured at this process's start (the floor's divisor)."""
    import kimi_decode.fused as fused_mod
    from bench.decode import main as bench_main
    fused_mod.VERIFIED = fused_mod.DEFAULT_KERNELS = kernels   # this run's verdict, all on
    bench_main(["--variant", *variants, "--batch", *map(str, batches), "--spec", *map(str, specs),
                "--layers", layers, "--reps", str(reps), "--expert-impl", impl, "--json", str(out / "bench.json")]
               + ([] if compile_ops else ["--eager-ops"]), copy_bw=copy_bw)


def captures(out: Path, kernels: frozenset[str], base: dict[str, Any], steps: int,
             budget_s: float, variants: tuple[str, ...] = ("fused",)) -> list[dict]:
    """The traces of `variants` (fused, and stock when asked: then both come from one session,
    as bench/decode.md's figures they are checked against) for CAPTURE_SHAPES."""
    import kimi_decode.fused as fused_mod
    from kimi_decode.device_job import pack
    from tracer.capture import capture, kernels_with_ops
    fused_mod.VERIFIED = fused_mod.DEFAULT_KERNELS = kernels   # this run's verdict, all on
    tmp = out / "tmp_traces"
    tmp.mkdir(exist_ok=True)
    done = []
    for b, k, variant in [(b, k, v) for b, k in CAPTURE_SHAPES for v in variants]:
        for graph in (False, True):
            name = f"k3_{variant}_b{b}_k{k}_{'graph' if graph else 'eager'}.json.gz"
            t0 = time.time()
            if t0 - T0 > budget_s:
                done.append({"file": name, "error": "skipped: device-time budget"})
                continue
            try:
                if graph and DEVICE != "cuda":
                    continue
                cfg = make_cfg(batch=b, spec_tokens=k, layers=LAYERS, tp_sim=True, **base)
                meta = capture(variant, cfg, graph=graph, steps=steps, out=tmp / name, device=DEVICE)
                with gzip.open(tmp / name, "rb") as fh:
                    trace = json.loads(fh.read())
                ks = kernels_with_ops(trace)
                pf = sorted({int(x["stream"]) for x in ks if x.get("op") == "prefetch" and x.get("stream") is not None})
                if not pf and graph:  # replayed kernels carry no op: find the prefetch kernel by name
                    pf = sorted({int(x["stream"]) for x in ks if "L2Prefetch" in x["name"] and x.get("stream") is not None})
                if variant == "fused":
                    trace["decodescope"].update(prefetch_ops="^prefetch$", prefetch_streams=pf,
                                                fused_kernels=sorted(kernels))
                with gzip.open(tmp / name, "wb", compresslevel=9) as fh:
                    fh.write(json.dumps(trace).encode())
                info = {"file": name, "seconds": round(time.time() - t0, 1), "bytes": (tmp / name).stat().st_size,
                        "kernels_per_step": len(meta["graph_capture_map"]) or None,
                        "matched": meta["graph_capture_map_matched"], "comm_streams": meta["comm_streams"],
                        "prefetch_streams": pf, "notes": meta["notes"]}
            except Exception:
                info = {"file": name, "error": traceback.format_exc()}
            log("capture", json.dumps(info)[:500])
            done.append(info)
            save(out, "captures", done)
            _free()
    pack(tmp, out)
    for f in tmp.glob("*"):
        f.unlink()
    tmp.rmdir()
    return done


def step_verdict(r: dict) -> str:
    """A step-parity row's result: pass / FAIL, or "not compared" for an own-routing row whose
    every sequence took another expert than stock in the first step (a routing near-tie: from
    there on the two paths legitimately differ, step_parity drops them, and nothing is left to
    compare; the forced-routing row of the same shape compares every sequence)."""
    if r["ok"]:
        return "pass"
    if not r["errors"] and r.get("routing") == "own" and r["sequences_compared"].startswith("0/"):
        return "not compared (routing diverged in step 0; see the forced row)"
    return "FAIL"


def report(kernel_rows: list[dict], steps: list[dict], refs: list[dict], passed: frozenset[str]) -> str:
    """bench/fused_correctness.md."""
    L = ["# Fused vs stock correctness (GPU)", "",
         f"- GPU: {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'none (dry run)'}; torch {torch.__version__}; "
         f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
         f"- kernels that passed every check (used by `fused.py`): {', '.join(sorted(passed)) or 'none'}",
         "- tolerances: see kimi_decode/kernels/checks.py (kernels) and bench/fused_device.py "
         f"(step: relative L2 ≤ {STEP_TOL} for outputs, blocks and every state buffer)", "",
         "## Kernels against the stock ops they replace", "",
         "Times: CUDA-graph replays of 20 calls, median; stock = the ops the kernel replaces as"
         " plain eager torch (the whole-step comparison with stock's Triton/compiled ops is"
         " bench/decode.md).", "",
         "| kernel | case | result | errors | stock µs | kernel µs |", "|---|---|---|---|---|---|"]
    for r in kernel_rows:
        case = ", ".join(f"{k}={r[k]}" for k in ("op", "mode", "M", "N", "K", "nb", "write", "B", "k") if k in r)
        errs = ", ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                         if k not in ("kernel", "op", "mode", "M", "N", "K", "nb", "write", "B", "k", "ok",
                                      "stock_us", "kernel_us", "error"))
        if "error" in r:
            errs = "error: " + r["error"].strip().splitlines()[-1][:200]
        su, ku = (f"{t:.1f}" if t is not None else "-" for t in (r.get("stock_us"), r.get("kernel_us")))
        L.append(f"| {r['kernel']} | {case} | {'pass' if r['ok'] else 'FAIL'} | {errs} | {su} | {ku} |")
    L += ["", "## Fused step against the stock step (same weights and state, 3 steps, layers 4-7)", "",
          "| B | k | routing | result | max rel L2 | m | prefix | blocks | worst state | routing rows same | sequences compared | kernels on |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in steps:
        if "error" in r:
            L.append(f"| {r['B']} | {r['k']} | {r.get('routing', 'own')} | FAIL | error: {r['error'].strip().splitlines()[-1][:200]} ||||||||")
            continue
        e = r["errors"]
        f = lambda key: f"{e[key]:.2e}" if key in e else "-"  # noqa: E731
        st = max(((v, n) for n, v in e.items() if n.startswith("state")), default=(float("nan"), "state -"))
        L.append(f"| {r['B']} | {r['k']} | {r.get('routing', 'own')} | {step_verdict(r)} | {r['max_rel']:.2e} | {f('m')} | "
                 f"{f('prefix')} | {f('blocks')} | {st[0]:.2e} ({st[1][6:]}) | {r['routing_rows_same']} | "
                 f"{r['sequences_compared']} | {', '.join(r['kernels'])} |")
    L += ["", "## Against the float64 reference (layers 6 KDA + 7 MLA, 2 steps)", "",
          "| B | k | step | stock rel m | fused rel m | stock rel prefix | fused rel prefix | result |",
          "|---|---|---|---|---|---|---|---|"]
    for r in refs:
        if "error" in r:
            L.append(f"| {r['B']} | {r['k']} | - | error: {r['error'].strip().splitlines()[-1][:200]} |||||")
            continue
        for i, s in enumerate(r["steps"]):
            L.append(f"| {r['B']} | {r['k']} | {i} | {s['stock_rel_m']:.2e} | {s['fused_rel_m']:.2e} | "
                     f"{s['stock_rel_prefix']:.2e} | {s['fused_rel_prefix']:.2e} | {'pass' if r['ok'] else 'FAIL'} |")
    return "\n".join(L) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--eager-ops", action="store_true",
                    help="bench and captures without torch.compile'd op groups (stock's runs use them)")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--bench-s", type=float, default=90.0, help="time the bench needs after captures")
    ap.add_argument("--isolated", help="(child process) check one kernel and exit")
    ap.add_argument("--kernels", nargs="*", help="skip the kernel checks: these passed them earlier")
    ap.add_argument("--skip", nargs="*", default=[], choices=["kernels", "step", "ref", "bench", "capture"])
    ap.add_argument("--passed-file", type=Path,
                    help="write the kernels that passed here (a path on the GPU machine, outside the tree: "
                         "a second call on the same machine reads it with --kernels-from)")
    ap.add_argument("--check", nargs="*", help="check only these kernels")
    ap.add_argument("--capture-stock", action="store_true", help="capture the stock traces too (same session)")
    ap.add_argument("--no-timing", action="store_true", help="with --check: skip the timed re-run of the checks")
    ap.add_argument("--kernels-ok", nargs="*", help="with --check: kernels that passed in an earlier run")
    ap.add_argument("--kernels-from", type=Path, help="skip the kernel checks: read the passing set from this file")
    ap.add_argument("--bench-batch", type=int, nargs="+", default=[1, 8, 64], help="bench: B at k = 0 (only when --bench-spec includes 0)")
    ap.add_argument("--bench-spec", type=int, nargs="+", default=[0, 7], help="bench: k (k > 0 at B = 1)")
    ap.add_argument("--bench-layers", default="4-7", help="bench: the layers (bench/decode.py --layers)")
    ap.add_argument("--step-shapes", nargs="+", help="step parity only at these B:k (default: all)")
    ap.add_argument("--bench-variants", nargs="+", default=["stock", "fused"], choices=["stock", "fused"],
                    help="bench: the variants timed (an A/B of fused settings needs fused only)")
    ap.add_argument("--patch", nargs="*", default=[],
                    help="A/B settings applied first, each 'module:NAME=LITERAL' or "
                         "'module:NAME[KEY]=LITERAL' (apply_patch), recorded in results.json")
    ap.add_argument("--opt-in", nargs="*", default=[], choices=sorted(OPT_IN),
                    help="opt-in kernels (fused.OPT_IN) the bench and captures run too when they pass "
                         "(an A/B of a kernel kept out of the headline set)")
    args = ap.parse_args()
    # before the patches: a patch naming a kernel module would fail on its import first
    why = missing_cute_dsl() if needs_cute_dsl(args.skip, args.bench_variants) else None
    if why is not None:
        raise SystemExit(f"fused_device: {why}")
    try:
        patches = [apply_patch(p) for p in args.patch]
    except (ValueError, ImportError) as e:
        raise SystemExit(f"fused_device: {e}") from None
    if args.isolated:
        run_isolated(args.isolated)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if patches:
        log("patches:", patches)
        save(args.out, "patches", patches)
    log(f"torch {torch.__version__} cuda {torch.version.cuda} on {torch.cuda.get_device_name()}")
    # the floor's copy bandwidth, before anything else touches the GPU: measured after the
    # checks and captures, the same 2 GiB copy came out ~11 % slower (3.79 vs 4.25 TB/s on the
    # H200, 2026-12-02) while the layer times did not move
    copy_bw = None
    if "bench" not in args.skip and DEVICE == "cuda":
        from bench.decode import copy_bandwidth
        copy_bw = copy_bandwidth()
        log(f"copy bandwidth at start: {copy_bw / 1e12:.2f} TB/s")
    from kimi_decode.device_job import probe_grouped_mm
    impl = probe_grouped_mm()
    # Correctness runs the unfused ops eagerly (fused and stock share them, so the comparison
    # isolates the kernels, and no inductor compile eats device time); bench and captures
    # compile them as the stock runs did.
    base = {"expert_impl": impl, "compile_ops": False}
    timed = {"expert_impl": impl, "compile_ops": not args.eager_ops}
    if timed["compile_ops"]:  # as kimi_decode/device_job.py: an op inductor cannot compile runs eagerly
        torch._dynamo.config.suppress_errors = True
    from kimi_decode.kernels import KERNELS
    if args.kernels_from is not None:
        passed, krows = frozenset(json.loads(args.kernels_from.read_text())) & frozenset(KERNELS), []
    elif args.kernels is not None:
        passed, krows = frozenset(args.kernels) & frozenset(KERNELS), []
    elif "kernels" in args.skip:
        passed, krows = frozenset(KERNELS), []
    elif args.check:
        # only these are checked now; the others count as passed when listed in --kernels-ok
        names = tuple(args.check)
        iso = isolated_checks(args.out, names, args.patch)
        if args.no_timing:   # device time is short: the isolated verdicts, no timed re-run
            krows = [r for k in names for r in (ISO_ROWS.get(k) or [{"kernel": k, "ok": False,
                                                                     "error": "no rows (see results.json: isolated)"}])]
            passed = iso
        else:
            passed, krows = kernel_checks(args.out, iso, frozenset(names))
        passed |= frozenset(args.kernels_ok or ())
    else:
        passed, krows = kernel_checks(args.out, isolated_checks(args.out, patches=args.patch))
    log("kernels passing:", sorted(passed))
    import kimi_decode.fused as fused_mod
    fused_mod.VERIFIED = passed          # this run's verdict: the step checks use these kernels
    if args.passed_file is not None:
        args.passed_file.write_text(json.dumps(sorted(passed)))
    shapes = [tuple(int(v) for v in x.split(":")) for x in args.step_shapes] if args.step_shapes else None
    steps = step_parity(passed, base, shapes=shapes) if "step" not in args.skip else []
    if "step" not in args.skip:
        steps += step_parity(passed, base, forced=True, shapes=shapes)
    save(args.out, "step", steps)
    refs = reference_check(passed, base) if "ref" not in args.skip else []
    save(args.out, "reference", refs)
    if krows or steps or refs:
        (args.out / "fused_correctness.md").write_text(report(krows, steps, refs, passed))
    timed_kernels = timed_set(passed, args.opt_in)
    # Captures first: they compile the op groups for the four shapes, which bench then reuses.
    if "capture" not in args.skip:
        captures(args.out, timed_kernels, timed, args.steps, args.budget_s,
                 variants=("stock", "fused") if args.capture_stock else ("fused",))
    if "bench" not in args.skip and time.time() - T0 < args.budget_s - args.bench_s:
        try:
            bench(args.out, timed_kernels, impl, args.reps, timed["compile_ops"],
                  tuple(args.bench_batch), tuple(args.bench_spec), copy_bw, tuple(args.bench_variants),
                  args.bench_layers)
        except Exception:
            traceback.print_exc()
        log("bench done")
    else:
        log("bench skipped (device-time budget)")
    log("done")


if __name__ == "__main__":
    main()
