"""timeline_steps (analyzers/sql/timeline/timeline.sql, analyzers.timeline.steps) is the
attribution's definition of a step, not a second one: on hand-made traces the timeline's steps
equal kernel_attribution's (same step_index, same device bounds) and a plain-Python oracle.

The trace, one rank and one host thread, four step ranges s = 0..3 at host [1000 s, 1000 s + 600):
- in every step but s = 2 (empty: nothing launched), three launches j = 0..2 start at
  1000 s + 10 + 50 j (each call lasts 5 ns) and their kernels run later on the device, at
  1000 s + 400 + 100 j for 80 ns: the last one ends at 1000 s + 680, after its host range ended;
- a range `stepper` [1000 s + 100, 1000 s + 200) inside each step (not a step name: the default
  pattern wants `step`, `step N` or `step[...]`), which holds launch j = 2;
- one more launch at 5000, outside every step, whose kernel runs at [5100, 5150).
So the steps are s = 0, 1, 3 (index 2 has no kernel and is not listed, the numbering is the
attribution's: 0-based among all step ranges), each with device window [1000 s + 400,
1000 s + 680) and 3 kernels. With ProfilerStep#N ranges instead of `step` the answer is the same,
and so it is when both are present (`step` wins; ProfilerStep#N then encloses each step).
"""
from __future__ import annotations

import duckdb
import pytest

from analyzers import timeline
from analyzers.attribution import attribute
from analyzers.views import SQL_ROOT
from tracer.store import open_store

STEPS = 4
EMPTY_STEP = 2
LAUNCHES = 3
OUTSIDE_LAUNCH_NS = 5_000


def _kernels() -> list[tuple[int, int, int, int]]:
    """(kernel_id == correlation, launch start, device start, device end) of the whole trace."""
    out = []
    for s in range(STEPS):
        if s == EMPTY_STEP:
            continue
        for j in range(LAUNCHES):
            out.append((len(out), 1000 * s + 10 + 50 * j, 1000 * s + 400 + 100 * j, 1000 * s + 480 + 100 * j))
    out.append((len(out), OUTSIDE_LAUNCH_NS, OUTSIDE_LAUNCH_NS + 100, OUTSIDE_LAUNCH_NS + 150))
    return out


def _step_ranges(family: str) -> list[tuple[str, int, int]]:
    """(name, start, end) of the ranges of a family: `step`, ProfilerStep#N, SGLang's, `stepper`."""
    names = {"step": lambda s: "step", "profiler": lambda s: f"ProfilerStep#{s + 5}",
             "sglang": lambda s: f"step[DECODE bs={s + 1}]"}
    if family == "stepper":
        return [("stepper", 1000 * s + 100, 1000 * s + 200) for s in range(STEPS)]
    if family == "profiler_outer":
        return [(f"ProfilerStep#{s}", 1000 * s, 1000 * s + 900) for s in range(STEPS)]
    return [(names[family](s), 1000 * s, 1000 * s + 600) for s in range(STEPS)]


def _store(families: list[str]) -> duckdb.DuckDBPyConnection:
    con = open_store(None)
    for rel in ("intervals/intervals.sql", "timeline/timeline.sql"):
        con.execute((SQL_ROOT / rel).read_text())
    con.execute("INSERT INTO runs (run_id, name, source, path, file_hash, world_size) VALUES (1, 'r', 'test', 'x', 'h', 1)")
    ranges = [r for f in families for r in _step_ranges(f)]
    for i, (n, a, b) in enumerate(ranges):
        con.execute("INSERT INTO ranges (run_id, range_id, rank, pid, tid, kind, name, start_ns, end_ns, depth) "
                    "VALUES (1, ?, 0, 1, 1, 'nvtx', ?, ?, ?, 0)", [i, n, a, b])
    ks = _kernels()
    con.executemany("INSERT INTO api_calls (run_id, call_id, rank, pid, tid, kind, name, start_ns, end_ns, correlation) "
                    "VALUES (1, ?, 0, 1, 1, 'runtime', 'cudaLaunchKernel', ?, ?, ?)",
                    [(k, launch, launch + 5, k) for k, launch, _, _ in ks])
    con.executemany("INSERT INTO kernels (run_id, kernel_id, rank, stream, correlation, name, start_ns, end_ns, category) "
                    "VALUES (1, ?, 0, 7, ?, ?, ?, ?, 'compute')",
                    [(k, k, f"k{k}", a, b) for k, _, a, b in ks])
    return con


def _oracle(step_ranges: list[tuple[str, int, int]]) -> list[list[int]]:
    """[step_index, dev_start, dev_end, kernels] from the ranges and kernels in plain Python:
    index = order of the range among the step ranges; its kernels are those launched inside it
    (the step ranges of one family do not nest); steps without kernels are left out."""
    out = []
    for idx, (_, a, b) in enumerate(sorted(step_ranges, key=lambda r: r[1])):
        mine = [(s, e) for _, launch, s, e in _kernels() if a <= launch < b]
        if mine:
            out.append([idx, min(s for s, _ in mine), max(e for _, e in mine), len(mine)])
    return out


def _attribution_steps(con: duckdb.DuckDBPyConnection) -> list[list[int]]:
    """kernel_attribution's steps, bounds recomputed in Python from its (step_index, kernel) rows."""
    rows = con.execute("SELECT step_index, item_id FROM kernel_attribution "
                       "WHERE run_id = 1 AND rank = 0 AND item_kind = 'kernel' AND step_index IS NOT NULL").fetchall()
    by_id = {k: (s, e) for k, _, s, e in _kernels()}
    steps: dict[int, list[tuple[int, int]]] = {}
    for idx, kid in rows:
        steps.setdefault(idx, []).append(by_id[kid])
    return [[i, min(s for s, _ in v), max(e for _, e in v), len(v)] for i, v in sorted(steps.items())]


def _timeline_steps(con: duckdb.DuckDBPyConnection) -> list[list[int]]:
    df = timeline.steps(con, 1, 0)
    return [[int(x) for x in r] for r in df[["step_index", "dev_start_ns", "dev_end_ns", "kernels"]].values.tolist()]


@pytest.mark.parametrize("families,step_family", [
    (["step", "stepper"], "step"),
    (["profiler", "stepper"], "profiler"),
    (["sglang", "stepper"], "sglang"),
    (["step", "profiler_outer", "stepper"], "step"),
])
def test_timeline_steps_are_the_attribution_steps(families: list[str], step_family: str) -> None:
    con = _store(families)
    want = [[s, 1000 * s + 400, 1000 * s + 680, LAUNCHES] for s in range(STEPS) if s != EMPTY_STEP]
    assert _oracle(_step_ranges(step_family)) == want  # the docstring's derivation
    got = _timeline_steps(con)   # attributes the run on first use
    assert got == want
    assert got == _attribution_steps(con)
    names = timeline.steps(con, 1, 0)["name"].tolist()
    assert names == [_step_ranges(step_family)[s][0] for s in range(STEPS) if s != EMPTY_STEP]


def test_timeline_follows_a_user_step_pattern() -> None:
    """Attributed with --step-pattern '^stepper$', the steps are the `stepper` ranges: each holds
    launch j = 2 only, so every listed step has one kernel on [1000 s + 600, 1000 s + 680)."""
    con = _store(["step", "stepper"])
    attribute(con, [1], step_pattern=r"^stepper$")
    want = [[s, 1000 * s + 600, 1000 * s + 680, 1] for s in range(STEPS) if s != EMPTY_STEP]
    assert _oracle(_step_ranges("stepper")) == want
    assert _timeline_steps(con) == want == _attribution_steps(con)


def test_no_annotation_ranges_no_steps() -> None:
    """Without any nvtx / user_annotation range nothing can be a step: the timeline lists none,
    as the attribution (built separately here) has none, and the columns keep their types."""
    con = _store([])
    got = timeline.steps(con, 1, 0)
    assert len(got) == 0
    assert list(got.columns) == ["step_index", "name", "dev_start_ns", "dev_end_ns", "kernels"]
    attribute(con, [1])
    assert _attribution_steps(con) == [] and len(timeline.steps(con, 1, 0)) == 0
