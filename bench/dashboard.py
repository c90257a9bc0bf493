"""Dashboard callback latency and first page load, against a naive baseline in the same run.

Usage: .venv/bin/python bench/dashboard.py [--kernels 1000000] [--out bench/dashboard.md]

What is measured
- A synthetic run of N kernels (default 1M: 4 streams, 1,000 steps) inserted straight into a
  DuckDB store with SQL, plus the bundled traces (traces/*.json.gz) when they ingest.
- Timeline zoom: the real Dash callback (HTTP POST /_dash-update-component through Flask's test
  client, JSON encoding included) for windows from the whole run down to 0.01 % of it;
  p50/p95/max over all requests.
- Kernels grid: the paged callback (sort by duration, a name filter) on the same run.
- Baseline ("naive"): what a straightforward Dash app does: the run's kernels held as one
  pandas DataFrame (loaded once, not timed), filtered with a boolean mask per request, every
  kernel in the window sent to the browser as one plotly figure (no windowing, no
  aggregation), and the grid sorted/filtered in pandas. Timed in-process (no HTTP), so the
  comparison flatters the baseline.
- First page load in headless Chromium (/usr/bin/chromium via Playwright): from goto to the
  timeline graph drawn, for the synthetic run and one bundled run.
Writes a markdown table (date, commit, machine) to --out.
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import duckdb  # noqa: E402
import pandas as pd  # noqa: E402
import plotly.graph_objects as go  # noqa: E402

from tracer.store import open_store  # noqa: E402

BASE_NS = 1_700_000_000_000_000_000
STREAMS = 4
SLOT_NS = 5_000
STEP_PAUSE_NS = 50_000
KERNELS_PER_STEP = 1_000
FRACTIONS = (1.0, 0.1, 0.01, 0.001, 0.0001)
REPEATS = 12
NAIVE_EVERY = 4
CHROME_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage"]

# Kernel i runs on stream 7 + i % 4 in slot i // 4 of its step; steps are separated by a pause.
SYNTH_KERNELS_SQL = """
INSERT INTO kernels (run_id, kernel_id, rank, device, stream, correlation, name, start_ns, end_ns, category)
SELECT $run, i, 0, 0, 7 + i % 4, i, 'synthetic_kernel_' || (i % 37),
       $base + (i // 4) * $slot + (i // $per_step) * $pause + (i % 4) * 300,
       $base + (i // 4) * $slot + (i // $per_step) * $pause + (i % 4) * 300 + 1000 + (i * 7919) % 3000,
       CASE WHEN i % 4 = 3 THEN 'communication' ELSE 'compute' END
FROM range($n) AS t(i)
"""
SYNTH_STEPS_SQL = """
INSERT INTO ranges (run_id, range_id, rank, pid, tid, kind, name, start_ns, end_ns, depth)
SELECT $run, s, 0, 1, 1, 'user_annotation', 'step',
       $base + s * ($per_step // 4) * $slot + s * $pause,
       $base + (s + 1) * ($per_step // 4) * $slot + s * $pause, 0
FROM range($steps) AS t(s)
"""


def build_synthetic(path: Path, n: int) -> int:
    """A store at `path` with one synthetic run of n kernels; returns its run id."""
    con = open_store(path)
    run = int(con.execute("SELECT nextval('run_id_seq')").fetchall()[0][0])
    con.execute("INSERT INTO runs (run_id, name, source, path, file_hash, world_size, variant) "
                "VALUES ($run, 'synthetic-1M', 'synthetic', 'bench/dashboard.py', 'synthetic', 1, NULL)", {"run": run})
    params = {"run": run, "base": BASE_NS, "slot": SLOT_NS, "pause": STEP_PAUSE_NS, "per_step": KERNELS_PER_STEP}
    con.execute(SYNTH_KERNELS_SQL, {**params, "n": n})
    con.execute(SYNTH_STEPS_SQL, {**params, "steps": max(1, n // KERNELS_PER_STEP)})
    con.close()
    return run


def ingest_bundled(con: duckdb.DuckDBPyConnection) -> tuple[list[int], str | None]:
    """Ingest traces/*.json.gz into `con`; returns run ids and the error if any trace failed."""
    from cli.common import bundled_trace_paths
    from tracer.errors import BadInput
    from tracer.ingest import ingest_path

    ids: list[int] = []
    for p in bundled_trace_paths():
        try:
            ids += [r.run_id for r in ingest_path(con, p, progress=False)]
        except BadInput as exc:
            return ids, str(exc)
    return ids, None


def percentiles(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    p95 = s[min(len(s) - 1, int(round(0.95 * (len(s) - 1))))]
    return {"n": len(s), "p50": statistics.median(s), "p95": p95, "max": s[-1]}


class CallbackClient:
    """Posts Dash callback requests the way the renderer does, through Flask's test client."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.client = app.server.test_client()
        self.client.get("/_dash-dependencies")  # Dash registers the callbacks on the first request
        self.bytes: list[int] = []

    def _output_key(self, first_output: str) -> str:
        return next(k for k in self.app.callback_map if first_output in k)

    def post(self, first_output: str, outputs: list[tuple[str, str]], inputs: list[tuple[str, str, Any]],
             changed: str, state: list[tuple[str, str, Any]]) -> tuple[float, dict[str, Any]]:
        body = {"output": self._output_key(first_output),
                "outputs": [{"id": i, "property": p} for i, p in outputs],
                "inputs": [{"id": i, "property": p, "value": v} for i, p, v in inputs],
                "changedPropIds": [changed],
                "state": [{"id": i, "property": p, "value": v} for i, p, v in state]}
        t = time.perf_counter()
        resp = self.client.post("/_dash-update-component", json=body)
        ms = (time.perf_counter() - t) * 1000
        if resp.status_code != 200:
            raise RuntimeError(f"callback failed: {resp.status_code} {resp.data[:300]!r}")
        self.bytes.append(len(resp.data))
        return ms, json.loads(resp.data)

    def timeline_zoom(self, state: dict[str, Any], t0: int, t1: int) -> float:
        origin = int(state["origin"])
        relayout = {"xaxis.range[0]": t0 - origin, "xaxis.range[1]": t1 - origin}
        ms, _ = self.post("timeline-graph.figure",
                          [("timeline-graph", "figure"), ("timeline-info", "children"),
                           ("timeline-permalink", "href"), ("timeline-state", "data")],
                          [("timeline-graph", "relayoutData", relayout), ("timeline-step", "value", state["step"])],
                          "timeline-graph.relayoutData", [("timeline-state", "data", state)])
        return ms

    def grid(self, run: int, request: dict[str, Any]) -> float:
        ms, _ = self.post("kernels-grid.getRowsResponse",
                          [("kernels-grid", "getRowsResponse"), ("kernels-count", "children")],
                          [("kernels-grid", "getRowsRequest", request)], "kernels-grid.getRowsRequest",
                          [("kernels-run", "children", str(run))])
        return ms


def windows(first: int, last: int) -> list[tuple[int, int]]:
    """REPEATS windows per fraction of the run, spread evenly over it."""
    out = []
    span = last - first
    for f in FRACTIONS:
        width = max(1_000, int(span * f))
        for r in range(REPEATS):
            t0 = first + (span - width) * r // max(1, REPEATS - 1)
            out.append((t0, t0 + width))
    return out


def timeline_state(run: int, first: int, last: int) -> dict[str, Any]:
    from dashboard.timeline_state import pack_state

    return pack_state(run=run, rank=0, step=None, origin=first, t0=first, t1=last, mark=None, extent=(first, last))


def naive_timeline(frame: pd.DataFrame, t0: int, t1: int, origin: int) -> tuple[float, int]:
    """The baseline: mask the full frame, send every kernel in the window as one figure."""
    t = time.perf_counter()
    part = frame[(frame["end_ns"] > t0) & (frame["start_ns"] < t1)]
    fig = go.Figure()
    for cat, rows in part.groupby("category"):
        xs, ys = [], []
        for s, e, st in zip(rows["start_ns"].tolist(), rows["end_ns"].tolist(), rows["stream"].tolist()):
            xs += [s - origin, e - origin, None]
            ys += [f"stream {st}", f"stream {st}", None]
        fig.add_trace(go.Scattergl(x=xs, y=ys, mode="lines", name=str(cat)))
    payload = fig.to_json()
    return (time.perf_counter() - t) * 1000, len(payload)


def naive_grid(frame: pd.DataFrame) -> float:
    t = time.perf_counter()
    part = frame[frame["name"].str.contains("kernel_1", case=False)]
    part = part.assign(dur_ns=part["end_ns"] - part["start_ns"]).sort_values("dur_ns", ascending=False)
    part.iloc[0:100].to_json(orient="records")
    return (time.perf_counter() - t) * 1000


def first_load_ms(url: str, runs: int = 3, selector: str = "#timeline-graph .scatterlayer, "
                  "#timeline-graph .gl-container canvas") -> list[float]:
    """goto -> the page's first graph drawn, in a fresh browser context each time (cold page cache)."""
    from playwright.sync_api import sync_playwright

    out = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=os.environ.get("CHROMIUM_BIN", "/usr/bin/chromium"),
                                    args=CHROME_FLAGS)
        for _ in range(runs):
            ctx = browser.new_context()
            page = ctx.new_page()
            t = time.perf_counter()
            page.goto(url)
            page.wait_for_selector(selector, state="attached", timeout=60_000)
            out.append((time.perf_counter() - t) * 1000)
            ctx.close()
        browser.close()
    return out


def serve(app: Any) -> tuple[Any, str]:
    from werkzeug.serving import make_server

    srv = make_server("127.0.0.1", 0, app.server, threaded=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_port}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=1_000_000)
    ap.add_argument("--out", default=str(REPO / "bench" / "dashboard.md"))
    args = ap.parse_args()

    from dashboard.app import create_app
    from dashboard.data import StorePool

    tmp = Path(tempfile.mkdtemp(prefix="decodescope-bench-"))
    db = tmp / "bench.duckdb"
    t = time.perf_counter()
    synth = build_synthetic(db, args.kernels)
    build_s = time.perf_counter() - t
    pool = StorePool.open(db)
    with pool.cursor() as cur:
        bundled, bundled_error = ingest_bundled(cur)
        first, last = cur.execute("SELECT min(start_ns), max(end_ns) FROM kernels WHERE run_id = ?", [synth]).fetchall()[0]
        frame = cur.execute("SELECT kernel_id, stream, name, category, start_ns, end_ns FROM kernels WHERE run_id = ?",
                            [synth]).df()
    app = create_app(pool)
    client = CallbackClient(app)
    results: dict[str, Any] = {}

    # warm-up: one request per cursor path (the first builds the run's attribution on that cursor)
    state = timeline_state(synth, first, last)
    t = time.perf_counter()
    client.timeline_zoom(state, first, last)
    results["cold_first_zoom_ms"] = (time.perf_counter() - t) * 1000
    wins = windows(first, last)
    ours = [client.timeline_zoom(state, a, b) for a, b in wins]
    ours_bytes = client.bytes[-len(wins):]
    # the baseline takes ~30 s per whole-run window: every NAIVE_EVERY-th window only
    naive = {i: naive_timeline(frame, a, b, first) for i, (a, b) in enumerate(wins) if i % NAIVE_EVERY == 0}
    results["synthetic"] = {
        "ours": percentiles(ours), "naive": percentiles([m for m, _ in naive.values()]),
        "ours_max_bytes": max(ours_bytes), "naive_max_bytes": max(b for _, b in naive.values()),
        "by_fraction": {f: {"ours": percentiles(ours[i * REPEATS:(i + 1) * REPEATS]),
                            "naive": percentiles([naive[j][0] for j in range(i * REPEATS, (i + 1) * REPEATS)
                                                  if j in naive])}
                        for i, f in enumerate(FRACTIONS)},
    }
    grid_req = [{"startRow": s, "endRow": s + 100, "sortModel": [{"colId": "dur_ns", "sort": "desc"}],
                 "filterModel": {"name": {"filterType": "text", "type": "contains", "filter": "kernel_1"}}}
                for s in range(0, 100 * REPEATS, 100)]
    results["grid"] = {"ours": percentiles([client.grid(synth, r) for r in grid_req]),
                       "naive": percentiles([naive_grid(frame) for _ in grid_req])}

    bundled_ms: list[float] = []
    bundled_cold: list[float] = []
    for run in bundled:
        with pool.cursor() as cur:
            b0, b1 = cur.execute("SELECT min(start_ns), max(end_ns) FROM kernels WHERE run_id = ?", [run]).fetchall()[0]
        st = timeline_state(run, b0, b1)
        bundled_cold.append(client.timeline_zoom(st, b0, b1))  # first: attribution + bubble causes on this cursor
        bundled_ms += [client.timeline_zoom(st, a, b) for a, b in windows(b0, b1)[::3]]
    results["bundled"] = percentiles(bundled_ms) if bundled_ms else None
    results["bundled_cold"] = percentiles(bundled_cold) if bundled_cold else None

    # the browser measurements share this interpreter with the server: drop the baseline's
    # million-row frame and its garbage first, so GC pauses of the naive run do not count here
    del frame, naive
    gc.collect()
    results["load_before"] = os.getloadavg()[0]
    srv, url = serve(app)
    try:
        results["load_synthetic"] = percentiles(first_load_ms(f"{url}/timeline?run={synth}"))
        results["load_bundled"] = percentiles(first_load_ms(f"{url}/timeline?run={bundled[0]}")) if bundled else None
        graph = "#_pages_content .js-plotly-plot .main-svg"
        results["load_home"] = percentiles(first_load_ms(f"{url}/", selector=graph)) if bundled else None
        results["load_layers"] = percentiles(first_load_ms(f"{url}/layers", selector=graph)) if bundled else None
    finally:
        srv.shutdown()
    results["load_after"] = os.getloadavg()[0]
    pool.close()
    shutil.rmtree(tmp, ignore_errors=True)
    write_report(Path(args.out), args.kernels, build_s, results, len(bundled), bundled_error)
    print(Path(args.out).read_text())


def write_report(out: Path, n: int, build_s: float, r: dict[str, Any], n_bundled: int, bundled_error: str | None) -> None:
    def row(name: str, p: dict[str, float] | None, extra: str = "") -> str:
        if p is None:
            return f"| {name} | – | – | – | – | {extra} |"
        return f"| {name} | {p['n']} | {p['p50']:.1f} | {p['p95']:.1f} | {p['max']:.1f} | {extra} |"

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    import dash

    s = r["synthetic"]
    lines = [
        "# Dashboard benchmark",
        "",
        f"- date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; commit `{commit}`",
        f"- machine: {platform.platform()}, {os.cpu_count()} cores (shared with other work), Python "
        f"{platform.python_version()}, duckdb {duckdb.__version__}, dash {dash.__version__}, pandas {pd.__version__}",
        f"- synthetic run: {n:,} kernels on {STREAMS} streams, {max(1, n // KERNELS_PER_STEP):,} steps, inserted with SQL "
        f"in {build_s:.1f} s; bundled runs: {n_bundled}" + (f" (ingest stopped: `{bundled_error}`)" if bundled_error else ""),
        f"- command: `.venv/bin/python bench/dashboard.py --kernels {n}`",
        "",
        "Callback latency in ms (timeline: windows of 100 %, 10 %, 1 %, 0.1 %, 0.01 % of the run, "
        f"{REPEATS} each; ours through HTTP incl. JSON; the naive baseline in-process, every {NAIVE_EVERY}th window).",
        "",
        "| what | requests | p50 ms | p95 ms | max ms | notes |",
        "|---|---|---|---|---|---|",
        row(f"timeline zoom, synthetic {n:,}: **ours** (server-side window, bins above the cap)", s["ours"],
            f"largest response {s['ours_max_bytes'] / 1e6:.2f} MB"),
        row(f"timeline zoom, synthetic {n:,}: naive (pandas mask + every kernel in the figure)", s["naive"],
            f"largest figure {s['naive_max_bytes'] / 1e6:.1f} MB"),
    ]
    for f, v in s["by_fraction"].items():
        lines.append(row(f"  window = {f:g} of the run: ours", v["ours"],
                         f"naive: p50 {v['naive']['p50']:.1f} ms, max {v['naive']['max']:.1f} ms ({v['naive']['n']} requests)"))
    lines += [
        row(f"kernels grid page (filter + sort by duration), synthetic {n:,}: **ours** (SQL, paged)", r["grid"]["ours"]),
        row(f"kernels grid page, synthetic {n:,}: naive (pandas filter + sort)", r["grid"]["naive"]),
        row("timeline zoom, bundled runs: ours", r["bundled"]),
        row("first timeline request per bundled run on a connection (attribution and bubble causes of "
            "that run, once; the 1M-kernel run is in the same store)",
            r["bundled_cold"]),
        row("first timeline request on a fresh connection (synthetic; includes attribution)",
            {"n": 1, "p50": r["cold_first_zoom_ms"], "p95": r["cold_first_zoom_ms"], "max": r["cold_first_zoom_ms"]}),
        "",
        "First page load in headless Chromium (goto until the page's first graph is drawn, fresh context each; "
        f"1-min load average {r['load_before']:.1f} before, {r['load_after']:.1f} after, on 2 cores):",
        "",
        "| page | loads | p50 ms | p95 ms | max ms | notes |",
        "|---|---|---|---|---|---|",
        row(f"/timeline, synthetic {n:,}-kernel run", r["load_synthetic"]),
        row("/timeline, first bundled run", r["load_bundled"]),
        row("/ (overview: seed table + chart of the default pair), bundled runs", r["load_home"]),
        row("/layers (two runs side by side), bundled runs", r["load_layers"]),
        "",
        "Targets: callback p95 < 250 ms, first load < 3 s.",
    ]
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
