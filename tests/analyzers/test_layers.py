"""Layer breakdown on hand-made rows: busy time is recomputed by brute force (a set of covered
nanoseconds), medians by sorting, so the SQL's union and quantile are checked independently."""
from __future__ import annotations

import random

import duckdb
import pytest

from analyzers.layers import compare, layer_breakdown, layer_steps
from tests.analyzers.attribution_rows import RunRows
from tracer.store import open_store


def _lower_median(xs: list[int]) -> int:
    return sorted(xs)[(len(xs) - 1) // 2]


def _busy(intervals: list[tuple[int, int]]) -> int:
    covered: set[int] = set()
    for s, e in intervals:
        covered.update(range(s, e))
    return len(covered)


def _exposed(kernels: list[tuple[int, int, int, int]]) -> dict[int, tuple[int, int]]:
    """{kernel id: (exposed start, end)} for (id, stream, start, end) kernels, by brute force:
    walk each stream's kernels in (start, id) order and start each one no earlier than the
    latest end seen before it on that stream (capped at its own end): what a PDL-launched
    kernel adds to the timeline (analyzers/sql/layers/layers.sql)."""
    out = {}
    for stream in {k[1] for k in kernels}:
        latest = None
        for kid, _, start, end in sorted((k for k in kernels if k[1] == stream), key=lambda k: (k[2], k[0])):
            out[kid] = (start if latest is None else min(end, max(start, latest)), end)
            latest = end if latest is None else max(latest, end)
    return out


def _random_run(run_id: int, seed: int, n_steps: int) -> tuple[RunRows, dict]:
    """n_steps steps of 1000 ns on the host; layers L0.mla [100,400) with ops q [100,200),
    o [200,300), and L1.kda [400,800) with op e [400,600). Each launch lands in a known
    (layer, op); its kernel gets a random GPU interval on one of two streams, so kernels
    overlap (also on one stream: PDL) and the union differs from the sum. Returns the truth
    per (step, layer, op): exposed intervals (_exposed)."""
    rng = random.Random(seed)
    r = RunRows(run_id, name=f"r{run_id}")
    raw: dict[tuple[int, str, str | None], list[int]] = {}
    kernels: list[tuple[int, int, int, int]] = []
    spots = [("L0.mla", "q", 150), ("L0.mla", "o", 250), ("L0.mla", None, 350),
             ("L1.kda", "e", 500), ("L1.kda", None, 700)]
    for s in range(n_steps):
        b = 1000 * s
        r.range("step", b, b + 1000)
        r.range("L0.mla", b + 100, b + 400, depth=1)
        r.range("q", b + 100, b + 200, depth=2)
        r.range("o", b + 200, b + 300, depth=2)
        r.range("L1.kda", b + 400, b + 800, depth=1)
        r.range("e", b + 400, b + 600, depth=2)
        gpu0 = 100_000 + 10_000 * s
        for _ in range(rng.randint(3, 8)):
            layer, op, t = rng.choice(spots)
            start = gpu0 + rng.randint(0, 300) + (0 if layer == "L0.mla" else 2000)
            end = start + rng.randint(0, 120)
            stream = rng.choice((7, 8))
            kid = r.kernel("k", start, end, r.launch(b + t + rng.randint(0, 40)), stream=stream)
            kernels.append((kid, stream, start, end))
            raw.setdefault((s, layer, None), []).append(kid)
            if op:
                raw.setdefault((s, layer, op), []).append(kid)
    exposed = _exposed(kernels)
    return r, {key: [exposed[kid] for kid in kids] for key, kids in raw.items()}


@pytest.mark.parametrize("seed,n_steps", [(1, 3), (2, 4), (3, 5)])
def test_layer_steps_and_breakdown_brute_force(seed: int, n_steps: int) -> None:
    con = open_store(None)
    run, truth = _random_run(1, seed, n_steps)
    run.insert(con)
    df = layer_steps(con, 1)
    got = {(int(r.step_index), r.layer, None if r.op is None or r.op != r.op else r.op):
           (r.kernels, r.span_ns, r.busy_ns, r.bubble_ns) for r in df.itertuples()}
    exp = {}
    for key, ivs in truth.items():
        span = max(e for _, e in ivs) - min(s for s, _ in ivs)
        busy = _busy(ivs)
        exp[key] = (len(ivs), span, busy, span - busy)
    assert got == exp
    bd = layer_breakdown(con, 1)
    assert bd["steps"] == n_steps
    for layer in bd["layers"]:
        steps = [k for k in exp if k[1] == layer["layer"] and k[2] is None]
        for field, i in (("kernels", 0), ("span_ns", 1), ("busy_ns", 2), ("bubble_ns", 3)):
            assert layer[field] == _lower_median([exp[k][i] for k in steps]), field
        for op in layer["ops"]:
            keys = [k for k in exp if k[1] == layer["layer"] and k[2] == op["op"]]
            assert op["kernels"] == _lower_median([exp[k][0] for k in keys])
            assert op["busy_ns"] == _lower_median([exp[k][2] for k in keys])
    assert [x["layer"] for x in bd["layers"]] == sorted({k[1] for k in exp}, key=lambda n: n[1])


def test_compare_per_kind() -> None:
    """Base: per step, L0.mla has 2 kernels [0,100) and [100,130) -> span 130; L1.mla one kernel
    of 70 -> span 70; L2.kda one of 50. Cand halves every kernel length and drops the second
    kernel of L0.mla. Over 2 identical steps the medians equal the step values, so
    base mla: span (130 + 70) / 2 = 100 ns, kernels (2 + 1) / 2 = 1.5; kda 50 ns, 1 kernel.
    cand mla: (50 + 35) / 2 = 42.5 -> 42 (half to even), kernels 1; kda 25 ns.
    Ratios: mla 42/100, kernels 1/1.5; kda 25/50."""
    con = open_store(None)
    for run_id, scale, drop in ((1, 2, False), (2, 1, True)):
        r = RunRows(run_id, name=f"r{run_id}")
        for s in range(2):
            b, g = 1000 * s, 100_000 * (s + 1)
            r.range("step", b, b + 1000)
            r.range("L0.mla", b + 100, b + 200, depth=1)
            r.range("L1.mla", b + 200, b + 300, depth=1)
            r.range("L2.kda", b + 300, b + 400, depth=1)
            r.kernel("a", g, g + 50 * scale, r.launch(b + 150))
            if not drop:
                r.kernel("b", g + 100, g + 130, r.launch(b + 160))
            r.kernel("c", g + 1000, g + 1000 + 35 * scale, r.launch(b + 250))
            r.kernel("d", g + 2000, g + 2000 + 25 * scale, r.launch(b + 350))
        r.insert(con)
    out = compare(con, 1, 2)
    kinds = {k["kind"]: k for k in out["kinds"]}
    assert kinds["mla"]["base"] == {"layers": 2, "span_ns": 100, "us": 0.1, "kernels": 1.5}
    assert kinds["mla"]["cand"] == {"layers": 2, "span_ns": 42, "us": 0.042, "kernels": 1.0}
    assert kinds["kda"]["base"]["span_ns"] == 50 and kinds["kda"]["cand"]["span_ns"] == 25
    assert kinds["mla"]["ratio_time"] == pytest.approx(0.42)
    assert kinds["mla"]["ratio_kernels"] == pytest.approx(1 / 1.5)


def test_not_applicable_without_layers() -> None:
    con = open_store(None)
    r = RunRows(1)
    r.range("step", 0, 100)
    r.kernel("k", 1000, 1010, r.launch(10))
    r.insert(con)
    out = layer_breakdown(con, 1)
    assert out["layers"] == [] and "not_applicable" in out


def test_pdl_overlap_on_one_stream_counts_once() -> None:
    """Hand-made PDL step on one stream: L1's first kernel is resident from 150 while L0's last
    kernel runs until 200 (it waits in griddepcontrol.wait); it adds time only from 200. A
    kernel on another stream (a side stream) keeps its own start."""
    con = open_store(None)
    r = RunRows(1, name="pdl")
    r.range("step", 0, 1000)
    r.range("L0.kda", 0, 400, depth=1)
    r.range("L1.kda", 400, 800, depth=1)
    r.kernel("a", 100, 200, r.launch(10))                # L0
    r.kernel("b", 150, 260, r.launch(500))               # L1, PDL: resident at 150, runs after 200
    r.kernel("c", 240, 300, r.launch(600))               # L1, PDL behind b: exposed 260-300
    r.kernel("side", 120, 180, r.launch(700), stream=8)  # L1 on a side stream: its own start
    r.insert(con)
    got = {row.layer: (row.kernels, row.span_ns, row.busy_ns, row.bubble_ns)
           for row in layer_steps(con, 1).itertuples() if row.op is None or row.op != row.op}
    assert got == {"L0.kda": (1, 100, 100, 0),
                   "L1.kda": (3, 300 - 120, (180 - 120) + (300 - 200), 180 - 160)}


def _graph_pdl_run(with_capture_stream: bool) -> RunRows:
    """One graph replay of a fused-like step. The chain captured on stream 7 hops from replay
    stream 20 (a) to 21 (b, c) at a side stream's join; b is resident under PDL from 150
    while a runs until 200. `side` was captured on stream 8 (replay stream 22) and overlaps a
    for real. The map names each node's capture stream unless `with_capture_stream` is False
    (maps written before it was recorded)."""
    r = RunRows(1, name="graph-pdl")
    r.range("step", 0, 1000)
    corr = r.launch(10, name="cudaGraphLaunch")
    nodes = [("a", 100, 200, 20, 7, "L0.kda", "x"), ("side", 120, 180, 22, 8, "L1.kda", "sh"),
             ("b", 150, 260, 21, 7, "L1.kda", "y"), ("c", 240, 300, 21, 7, "L1.kda", "z")]
    for i, (name, start, end, stream, cap, layer, op) in enumerate(nodes):
        r.kernel(name, start, end, corr, stream=stream)
        r.map_node(i, name, layer, op, capture_stream=cap if with_capture_stream else None)
    return r


def test_pdl_wait_across_replay_streams_follows_the_capture_stream() -> None:
    """With the capture stream, b's wait for a (150-200) is not L1's time although the two
    ran on different replay streams; `side` keeps its own start (another capture stream).
    Without it (an older map) b counts from its raw start: the overcount this fixes."""
    got = {}
    for with_cs in (True, False):
        con = open_store(None)
        _graph_pdl_run(with_cs).insert(con, graph_mode=True)
        got[with_cs] = {(row.layer, None if row.op != row.op else row.op):
                        (row.kernels, row.span_ns, row.busy_ns, row.bubble_ns)
                        for row in layer_steps(con, 1).itertuples()}
    assert got[True][("L1.kda", None)] == (3, 300 - 120, (180 - 120) + (300 - 200), 200 - 180)
    assert got[True][("L1.kda", "y")] == (1, 60, 60, 0)
    assert got[True][("L1.kda", "sh")] == (1, 60, 60, 0)
    assert got[True][("L0.kda", None)] == (1, 100, 100, 0)
    assert got[False][("L1.kda", None)] == (3, 300 - 120, 300 - 120, 0)
    assert got[False][("L1.kda", "y")] == (1, 110, 110, 0)


def _exposed_two_keys(kernels: list[tuple[int, int, int | None, int, int]]) -> dict[int, int]:
    """{kernel id: exposed start} for (id, stream, capture stream, start, end) kernels, by
    brute force: the latest of its start and the ends of every earlier kernel (by (start, id))
    sharing its stream or its capture stream, capped at its end."""
    order = sorted(kernels, key=lambda k: (k[3], k[0]))
    out = {}
    for i, (kid, stream, cap, start, end) in enumerate(order):
        ends = [e for (_, st, c, _, e) in order[:i] if st == stream] + \
               [e for (_, st, c, _, e) in order[:i] if cap is not None and c == cap]
        out[kid] = min(end, max([start, *ends]))
    return out


@pytest.mark.parametrize("seed", [11, 12, 13, 14])
def test_graph_exposed_starts_brute_force(seed: int) -> None:
    """Random graph replays (one per step) of eight uniquely named nodes with fixed capture
    streams (7 or 8, one node without), each on a random replay stream with a random start,
    so replays reorder (matched by name) and overlap on both keys. Per-op busy time equals
    the brute-force union of the exposed intervals (_exposed_two_keys)."""
    rng = random.Random(seed)
    r = RunRows(1, name=f"graph-rand{seed}")
    caps = [7, 7, 8, 7, 8, 7, None, 7]
    for i, cap in enumerate(caps):
        r.map_node(i, f"n{i}", "L0.kda", f"op{i % 3}", capture_stream=cap)
    kernels, ops = [], {}
    for s in range(3):
        r.range("step", 1000 * s, 1000 * s + 1000)
        corr = r.launch(1000 * s + 10, name="cudaGraphLaunch")
        base = 100_000 + 10_000 * s
        for i, cap in enumerate(caps):
            start = base + 20 * i + rng.randint(0, 60)
            end = start + rng.randint(1, 120)
            stream = rng.choice((20, 21, 22))
            kid = r.kernel(f"n{i}", start, end, corr, stream=stream)
            kernels.append((kid, stream, cap, start, end))
            ops.setdefault((s, f"op{i % 3}"), []).append(kid)
    con = open_store(None)
    r.insert(con, graph_mode=True)
    exposed = _exposed_two_keys(kernels)
    ends = {k[0]: k[4] for k in kernels}
    got = {(int(row.step_index), row.op): row.busy_ns
           for row in layer_steps(con, 1).itertuples() if row.op == row.op and row.op is not None}
    assert got == {key: _busy([(exposed[k], ends[k]) for k in kids]) for key, kids in ops.items()}
