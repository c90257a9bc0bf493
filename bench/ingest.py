"""Benchmark: `decodescope ingest` + `summary` of the largest corpus trace, as whole processes,
against the parse floor (orjson; DuckDB's explicit-schema read) and HTA's parse of the same folder.

Every case runs as a fresh process (imports included, as a user pays them); wall time is
measured around the process and peak RSS comes from `os.wait4` of that one child. Each case
runs REPEATS times; the table shows the fastest run, the median, and the largest peak RSS.
HTA is installed into a side venv `.hta-venv` (`pip install holistictraceanalysis`) on first
use, so its pandas never touches the project venv.

    .venv/bin/python bench/ingest.py            # writes bench/ingest.md
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRACE_DIR = REPO.parent / "shared" / "corpus" / "hta" / "kineto" / "tracelens_mi300x_xdit_sd3.5"
HTA_VENV = REPO / ".hta-venv"
PY = sys.executable

ORJSON_FLOOR = """
import gzip, sys, orjson
with gzip.open(sys.argv[1], "rb") as fh:
    doc = orjson.loads(fh.read())
print(len(doc["traceEvents"]))
"""
# ENVIRONMENT.md section 5: the fastest exact DuckDB query (explicit schema, DECIMAL ts).
DUCKDB_FLOOR = """
import sys, duckdb
con = duckdb.connect()
con.execute('''CREATE TABLE k AS
SELECT e.name, CAST(e.ts*1000 AS BIGINT) AS ts_ns, CAST(e.dur*1000 AS BIGINT) AS dur_ns,
       CAST(e.args->>'correlation' AS BIGINT) AS correlation
FROM (SELECT unnest(traceEvents) AS e
      FROM read_json(?, format='unstructured', records=true, maximum_object_size=2147483647,
           columns={'traceEvents': 'STRUCT(ph VARCHAR, cat VARCHAR, name VARCHAR, ts DECIMAL(38,3), dur DECIMAL(38,3), pid VARCHAR, tid VARCHAR, args JSON)[]'}))
WHERE e.ph='X' AND e.cat='kernel' ''', [sys.argv[1]])
print(con.execute("SELECT count(*) FROM k").fetchall()[0][0])
"""
HTA_PARSE = """
import sys
from hta.trace_analysis import TraceAnalysis
TraceAnalysis(trace_dir=sys.argv[1])
"""


@dataclass
class Sample:
    wall_s: float
    rss_mb: float
    cpu_s: float = 0.0   # user + system CPU of the process (all its threads)


def run_once(cmd: list[str]) -> Sample:
    """Run one process to completion; its wall time and its own peak RSS."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"benchmark command failed: {' '.join(cmd)}\n{err}")
    return Sample(wall, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime)


def ensure_hta() -> str:
    """Python of the side venv with HTA, created on first use; returns its interpreter."""
    py = HTA_VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(HTA_VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "holistictraceanalysis"], check=True)
    return str(py)


def version_of(py: str, dist: str) -> str:
    out = subprocess.run([py, "-c", f"import importlib.metadata as m; print(m.version('{dist}'))"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "?"


def machine() -> str:
    cpu = "?"
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores, {mem_gb:.0f} GiB RAM"


def git_commit() -> str:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return sha or "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "ingest.md")
    args = ap.parse_args()

    trace_file = next(p for p in sorted(TRACE_DIR.iterdir()) if p.name.endswith((".json", ".json.gz")))
    hta_py = ensure_hta()
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    rows: dict[str, list[Sample]] = {k: [] for k in
                                     ("ingest", "summary", "e2e", "orjson", "duckdb", "hta")}
    try:
        for _ in range(args.repeats):
            db = work / "bench.duckdb"
            db.unlink(missing_ok=True)
            ing = run_once([PY, "-m", "cli.main", "ingest", str(TRACE_DIR), "--db", str(db)])
            summ = run_once([PY, "-m", "cli.main", "summary", str(db), "--format", "json"])
            rows["ingest"].append(ing)
            rows["summary"].append(summ)
            rows["e2e"].append(Sample(ing.wall_s + summ.wall_s, max(ing.rss_mb, summ.rss_mb), ing.cpu_s + summ.cpu_s))
            rows["orjson"].append(run_once([PY, "-c", ORJSON_FLOOR, str(trace_file)]))
            rows["duckdb"].append(run_once([PY, "-c", DUCKDB_FLOOR, str(trace_file)]))
            rows["hta"].append(run_once([hta_py, "-c", HTA_PARSE, str(TRACE_DIR)]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()

    best = {k: min(v, key=lambda s: s.wall_s) for k, v in rows.items()}
    med = {k: statistics.median(s.wall_s for s in v) for k, v in rows.items()}
    peak = {k: max(s.rss_mb for s in v) for k, v in rows.items()}
    cpu = {k: min(s.cpu_s for s in v) for k, v in rows.items()}
    labels = {
        "ingest": "`decodescope ingest DIR --db FILE` (fresh store)",
        "summary": "`decodescope summary FILE --format json`",
        "e2e": "**ingest + summary (end to end)**",
        "orjson": "parse floor: `orjson.loads` of the decompressed file",
        "duckdb": "parse floor: DuckDB explicit-schema read (kernels, exact ns)",
        "hta": "HTA `TraceAnalysis(trace_dir=DIR)` (parse only)",
    }
    floor = best["duckdb"].wall_s
    lines = [
        "# Ingest benchmark",
        "",
        f"Generated by `bench/ingest.py` on {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"commit `{git_commit()}`.",
        f"Machine: {machine()}. Load average before/after: {load_before[0]:.1f} / {load_after[0]:.1f} "
        "(the machine is shared; other work ran at the same time, so absolute times are noisy).",
        f"Trace: `{TRACE_DIR.name}/{trace_file.name}` ({trace_file.stat().st_size / 2**20:.1f} MiB gzip, "
        "62 MB JSON, 239k events, 8,042 kernels).",
        f"Versions: Python {platform.python_version()}, duckdb {version_of(PY, 'duckdb')}, "
        f"orjson {version_of(PY, 'orjson')}; HTA {version_of(hta_py, 'HolisticTraceAnalysis')} with pandas "
        f"{version_of(hta_py, 'pandas')} in `.hta-venv`.",
        f"Each case is a fresh process, {args.repeats} runs; wall is the fastest run (median in brackets), "
        "CPU the least user+system seconds of the process over the runs (all threads; on a shared, "
        "loaded machine it is the steadier measure), RSS the largest peak over the runs (`os.wait4`).",
        "",
        "| case | wall s (median) | CPU s | peak RSS MB |",
        "|---|---:|---:|---:|",
    ]
    for k in ("ingest", "summary", "e2e", "orjson", "duckdb", "hta"):
        lines.append(f"| {labels[k]} | {best[k].wall_s:.2f} ({med[k]:.2f}) | {cpu[k]:.2f} | {peak[k]:.0f} |")
    e2e = best["e2e"].wall_s
    speedup = best["hta"].wall_s / e2e
    cpu_speedup = cpu["hta"] / cpu["e2e"]
    lines += [
        "",
        "Targets (wall; CPU in brackets):",
        f"- end to end vs HTA's parse alone: **{speedup:.1f}x faster** ({cpu_speedup:.1f}x) (target >= 4x: "
        f"{'met' if speedup >= 4 else 'NOT met'} on wall).",
        f"- end to end vs the DuckDB parse floor: **{e2e / floor:.2f}x** the floor's time "
        f"({cpu['e2e'] / cpu['duckdb']:.2f}x) (target <= 2x: {'met' if e2e <= 2 * floor else 'NOT met'} on wall); "
        f"vs orjson: {e2e / best['orjson'].wall_s:.2f}x.",
        f"- peak memory: ingest {peak['ingest']:.0f} MB, summary {peak['summary']:.0f} MB vs HTA "
        f"{peak['hta']:.0f} MB (target below HTA: {'met' if peak['e2e'] < peak['hta'] else 'NOT met'}).",
        "",
        "Notes: the ingest cuts the event list into ~8 MB chunks that DuckDB parses in parallel "
        "(`tracer/ingest/kineto_split.py`); a whole-document parse of this file alone peaks near "
        "430 MB. Each CLI process pays Python + DuckDB start-up (about 0.2 CPU s). On a loaded "
        "2-core machine wall times swing by 2x between runs, so read the CPU column beside them: "
        "in CPU seconds the HTA ratio is the bracketed figure above. Where the ingest CPU goes "
        "(measured in-process): decompress + cut 0.16 s, DuckDB parse 0.38 s, table inserts "
        "0.09 s, range nesting 0.27 s (135k python_function ranges), classifier 0.05 s.",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
