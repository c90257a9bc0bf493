"""Compare decodescope's temporal breakdown and comm/compute overlap with HTA 0.5.0.

Why: HTA (facebookresearch/HolisticTraceAnalysis) is the reference most users know; where our
definitions coincide the numbers must agree, and where they differ on purpose the difference
must be exactly the rows HTA counts differently. CI cannot install HTA, so this script

1. creates a side venv `.hta-venv` (gitignored) with `holistictraceanalysis==0.5.0`;
2. runs HTA there (this same file, `--hta-worker`) on every folder of the corpus with
   `HTA_DISABLE_NS_ROUNDING=1` (exact timestamps), and writes HTA's numbers per folder and rank
   to `tests/data/hta_reference.json`, together with the facts needed to re-derive them from our
   store: how many device rows HTA kept after its profiler-step filter, and every non-device
   row HTA counted as GPU time (cuda_sync rows, cpu_op rows with a `stream` arg), with its
   start relative to the first device row HTA kept, and HTA's per-stream idle time;
3. ingests every folder with decodescope and writes `bench/hta_compare.md` side by side.

Run: `.venv/bin/python bench/hta_compare.py [--corpus DIR] [--skip-hta]`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
HTA_VENV = REPO / ".hta-venv"
HTA_VERSION = "0.5.0"
# HTA 0.5.0 predates pandas 3 (its int16 downcast fails on pandas 3.1 for one corpus folder).
HTA_PANDAS = "pandas<3"
REFERENCE = REPO / "tests" / "data" / "hta_reference.json"
REPORT = REPO / "bench" / "hta_compare.md"
DEFAULT_CORPUS = REPO.parent / "shared" / "corpus" / "hta" / "kineto"
# Kineto event categories that are device work in our store (kernels and memops).
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _us_to_ns(us: float) -> int:
    """HTA keeps ts/dur as float µs with 3 decimals (ns rounding disabled): exact int ns."""
    return int(round(float(us) * 1000))


def hta_worker(corpus: Path, out: Path) -> None:
    """Inside .hta-venv: HTA's numbers and the rows it used, per folder and rank."""
    os.environ["HTA_DISABLE_NS_ROUNDING"] = "1"
    import logging
    import math

    import numpy as np
    from hta.trace_analysis import TraceAnalysis

    logging.disable(logging.WARNING)
    result: dict[str, Any] = {"hta_version": HTA_VERSION, "ns_rounding": "disabled", "folders": {}}
    for folder in sorted(p for p in corpus.iterdir() if p.is_dir()):
        entry: dict[str, Any] = {}
        try:
            ta = TraceAnalysis(trace_dir=str(folder))
            tb = ta.get_temporal_breakdown(visualize=False)
            try:
                ov = ta.get_comm_comp_overlap(visualize=False)
                ov_by_rank = {int(r): float(p) for r, p in zip(ov["rank"], ov["comp_comm_overlap_pctg"])}
            except Exception as exc:  # HTA divides by zero comm time: record why
                ov_by_rank = {}
                entry["overlap_error"] = f"{type(exc).__name__}: {exc}"
            sym = ta.t.symbol_table.get_sym_table()
            ranks: dict[str, Any] = {}
            for _, row in tb.iterrows():
                rank = int(row["rank"])
                df = ta.t.traces[rank]
                gpu = df[df["stream"].ne(-1)]
                cats = gpu["cat"].map(lambda i: sym[i])
                names = gpu["name"].map(lambda i: sym[i])
                kernel_rows = gpu[cats.isin(DEVICE_CATS)]
                first_ns = _us_to_ns(kernel_rows["ts"].min() + ta.t.min_ts) if len(kernel_rows) else None
                extra = gpu[~cats.isin(DEVICE_CATS)]
                extra_rows = [
                    {"cat": sym[int(e.cat)], "name": sym[int(e.name)], "stream": int(e.stream),
                     "rel_start_ns": _us_to_ns(e.ts + ta.t.min_ts) - first_ns, "dur_ns": _us_to_ns(e.dur)}
                    for e in extra.itertuples()
                ]
                idle_df, _ = ta.get_idle_time_breakdown(ranks=[rank], visualize=False)
                stream_idle = idle_df.groupby("stream")["idle_time"].sum()
                ranks[str(rank)] = {
                    # HTA's per-stream idle (get_idle_time_breakdown, all categories summed):
                    # sum over consecutive rows of the stream (by ts) of ts - previous row's end.
                    "stream_idle_ns": {str(int(k)): _us_to_ns(v) for k, v in stream_idle.items()},
                    "idle_ns": _us_to_ns(row["idle_time(us)"]),
                    "compute_ns": _us_to_ns(row["compute_time(us)"]),
                    "non_compute_ns": _us_to_ns(row["non_compute_time(us)"]),
                    "kernel_time_ns": _us_to_ns(row["kernel_time(us)"]),
                    "idle_pct": float(row["idle_time_pctg"]),
                    "compute_pct": float(row["compute_time_pctg"]),
                    "non_compute_pct": float(row["non_compute_time_pctg"]),
                    "comm_comp_overlap_pct": ov_by_rank.get(rank),
                    # HTA parses ts as float64 µs: at epoch-µs timestamps every endpoint may be
                    # off by up to half a ULP; tests widen their ns tolerance by this much.
                    "endpoint_error_ns": math.ceil(np.spacing(float(gpu["ts"].max() + ta.t.min_ts)) * 1000 / 2),
                    "device_rows": int(len(kernel_rows)),
                    "device_rows_by_cat": {c: int(n) for c, n in cats[cats.isin(DEVICE_CATS)].value_counts().items()},
                    "extra_rows": extra_rows,
                    "extra_rows_by_name": {n: int(k) for n, k in names[~cats.isin(DEVICE_CATS)].value_counts().items()},
                }
            entry["ranks"] = ranks
        except Exception as exc:  # a folder HTA cannot read is recorded, not hidden
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        result["folders"][folder.name] = entry
        print(f"hta: {folder.name}: {'error' if 'error' in entry else 'ok'}", file=sys.stderr)
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")


OUR_SQL = ("intervals/intervals.sql", "temporal/device_items.sql", "temporal/temporal_breakdown.sql",
           "temporal/stream_gaps.sql", "overlap/overlap_per_rank.sql")


def _fmt(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{x:.2f}"


def write_report(reference: dict[str, Any], corpus: Path, out: Path) -> None:
    """Ingest every corpus folder with decodescope and tabulate our numbers next to HTA's."""
    sys.path.insert(0, str(REPO))
    from tracer.ingest import ingest_path
    from tracer.store import open_store

    con = open_store(None)
    for rel in OUR_SQL:
        con.execute((REPO / "analyzers" / "sql" / rel).read_text())
    lines = [
        "# decodescope vs HTA 0.5.0 (HTA_DISABLE_NS_ROUNDING=1)", "",
        "Written by `bench/hta_compare.py`; HTA's numbers are in `tests/data/hta_reference.json`.",
        "Columns: idle / compute / non-compute % of the GPU span, and comm-compute overlap %.",
        "Where we differ, the cause is one of HTA's choices that we do not share (see",
        "`tests/analyzers/test_hta.py`, which re-derives HTA's ns values exactly from our store):",
        "`step filter` = device rows HTA drops because their launch is not before the last",
        "ProfilerStep; `extra rows` = non-kernel rows HTA counts as GPU time (cuda_sync, cpu_op with",
        "a stream); `reclassified` = kernels whose HTA name-regex type differs from our classifier.", "",
        "| folder | rank | ours idle/comp/non-comp/overlap | HTA idle/comp/non-comp/overlap | max Δ (pp) | step filter | extra rows | reclassified |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for folder, entry in sorted(reference["folders"].items()):
        if "ranks" not in entry:
            lines.append(f"| {folder} | – | – | HTA failed: {entry.get('error', '?')[:60]} | – | – | – | – |")
            continue
        [info] = ingest_path(con, corpus / folder, name=folder, progress=False)
        for rank, ref in sorted(entry["ranks"].items(), key=lambda kv: int(kv[0])):
            tb = con.execute("SELECT idle_pct, compute_pct, non_compute_pct FROM temporal_breakdown"
                             " WHERE run_id = ? AND rank = ?", [info.run_id, int(rank)]).fetchall()[0]
            ov = con.execute("SELECT overlap_pct FROM overlap_per_rank WHERE run_id = ? AND rank = ?",
                             [info.run_id, int(rank)]).fetchall()
            ours = (*tb, ov[0][0] if ov else None)
            hta = (ref["idle_pct"], ref["compute_pct"], ref["non_compute_pct"], ref["comm_comp_overlap_pct"])
            deltas = [abs(a - b) for a, b in zip(ours, hta) if a is not None and b is not None and b == b]
            ndev = con.execute("SELECT count(*) FROM device_items WHERE run_id = ? AND rank = ?",
                               [info.run_id, int(rank)]).fetchall()[0][0]
            lines.append(
                f"| {folder} | {rank} | {' / '.join(map(_fmt, ours))} | {' / '.join(map(_fmt, hta))} | "
                f"{max(deltas):.2f} | {ndev - ref['device_rows']} | {len(ref['extra_rows'])} | "
                f"{_reclassified(con, info.run_id, int(rank))} |")
    lines += _stream_table(con, reference)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}", file=sys.stderr)


def _stream_table(con: Any, reference: dict[str, Any]) -> list[str]:
    """Our stream_gaps total per stream next to HTA's per-stream idle time."""
    lines = ["", "## Per-stream idle: our `stream_gaps` vs HTA `get_idle_time_breakdown` (all categories)", "",
             "HTA sums, over a stream's rows sorted by start, start minus the previous row's end, after its",
             "step filter; ours is the gaps of the union per stream over every row. They coincide when the",
             "filter drops nothing and no two rows of the stream overlap (`tests/analyzers/test_hta.py`).", "",
             "| folder | rank | stream | ours ns | HTA ns | Δ ns |", "|---|---|---|---|---|---|"]
    runs = dict(con.execute("SELECT name, run_id FROM runs").fetchall())
    for folder, entry in sorted(reference["folders"].items()):
        for rank, ref in sorted(entry.get("ranks", {}).items(), key=lambda kv: int(kv[0])):
            ours = dict(con.execute("SELECT stream, CAST(sum(gap_ns) AS BIGINT) FROM stream_gaps WHERE run_id = ?"
                                    " AND rank = ? GROUP BY stream", [runs[folder], int(rank)]).fetchall())
            for stream, hta in sorted(ref["stream_idle_ns"].items(), key=lambda kv: int(kv[0])):
                mine = ours.get(int(stream), 0)
                lines.append(f"| {folder} | {rank} | {stream} | {mine} | {hta} | {mine - hta} |")
    return lines


def _reclassified(con: Any, run_id: int, rank: int) -> int:
    """Kernels whose HTA type (name regex, hta/common/types.py) differs from our category."""
    import re

    comm, mem = re.compile(r"(^nccl)"), re.compile(r"(^(hip)?Memcpy)|(^(hip)?Memset)|(^dma)")
    not_comp = re.compile(r"(^nccl)|(.*Memcpy)|(.*Memset)|(.*dma)|(^.*Sync)|(cuda.*LaunchKernel)|(^runFunction)")
    n = 0
    for name, cat in con.execute("SELECT name, category FROM device_items WHERE run_id = ? AND rank = ?",
                                 [run_id, rank]).fetchall():
        hta = "communication" if comm.match(name) else "memory" if mem.match(name) else (
            "other" if not_comp.match(name) else "compute")
        n += (hta == "compute") != (cat == "compute") or (hta == "communication") != (cat == "communication")
    return n


def ensure_hta_venv() -> Path:
    """Create .hta-venv with HTA pinned, once; return its python."""
    py = HTA_VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(HTA_VENV)], check=True)
    probe = subprocess.run([str(py), "-c", "import hta"], capture_output=True)
    if probe.returncode != 0:
        subprocess.run([str(py), "-m", "pip", "install", "-q", f"holistictraceanalysis=={HTA_VERSION}", HTA_PANDAS], check=True)
    return py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--hta-worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--skip-hta", action="store_true", help="reuse tests/data/hta_reference.json")
    args = ap.parse_args()
    if args.hta_worker:
        hta_worker(args.corpus, args.hta_worker)
        return
    if not args.skip_hta:
        py = ensure_hta_venv()
        env = {**os.environ, "HTA_DISABLE_NS_ROUNDING": "1"}
        subprocess.run([str(py), __file__, "--corpus", str(args.corpus), "--hta-worker", str(REFERENCE)],
                       check=True, env=env)
    write_report(json.loads(REFERENCE.read_text()), args.corpus, REPORT)


if __name__ == "__main__":
    main()
