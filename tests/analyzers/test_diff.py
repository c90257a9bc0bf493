"""analyzers.diff on hand-made runs: alignment by (layer kind, index, op), bootstrap gate, detail.

The layer_steps rows come from a brute-force stub of the documented contract
(test_diff_synth.layer_steps_stub), so these tests do not depend on the attribution code.
Expected verdicts are derived from the synthetic spec (durations + gaps), not read off output.
Every time is an integer ns: medians are the ceil(n/2)-th smallest, p90 the ceil(0.9 n)-th
(DuckDB's quantile_disc), recomputed here with sorted() where a test needs them.
"""
from __future__ import annotations

import json
import math
from typing import Any

import duckdb
import numpy as np
import pandas as pd
import pytest

from analyzers.diff import (ALL_LAYERS, MEDIAN, P90, RunSample, bootstrap_change, compare, kernel_changes,
                            nearest_rank)
from tests.analyzers.test_diff_synth import FUSED, GAP_NS, LAYERS, STOCK, Synth, kernel_rows, sample


def _span(ops: dict, kind: str, op: str) -> int:
    """Noise-free span of one op: its kernels back to back with GAP_NS between them."""
    durs = [d for o, ks in ops[kind] if o == op for _, d in ks]
    return sum(durs) + GAP_NS * (len(durs) - 1)


def _keys(rows: list[dict]) -> set[tuple[str, str | None]]:
    return {(r["layer"], r["op"]) for r in rows}


def test_stock_to_fused_passes_and_reports_improvement() -> None:
    rep = compare(sample(Synth(STOCK, seed=1), "stock"), sample(Synth(FUSED, seed=2), "fused", 2))
    assert rep.mode == "layers" and not rep.regressions
    improved = _keys(rep.improvements)
    assert (ALL_LAYERS, None) in improved
    for idx, kind in LAYERS:
        assert (f"L{idx}.{kind}", None) in improved
    assert rep.kernel_count_increases == []


def test_fused_to_stock_fails_naming_layers_and_ops() -> None:
    """An op regresses iff its noise-free stock span exceeds the fused one by more than 5 %."""
    rep = compare(sample(Synth(FUSED, seed=3), "fused"), sample(Synth(STOCK, seed=4), "stock", 2))
    expected_ops = {(f"L{idx}.{kind}", op) for idx, kind in LAYERS for op, _ in STOCK[kind]
                    if _span(STOCK, kind, op) / _span(FUSED, kind, op) - 1 > 0.05}
    assert expected_ops  # the spec really has slower stock ops
    got = _keys(rep.regressions)
    assert {k for k in got if k[1] is not None} == expected_ops
    assert {(f"L{idx}.{kind}", None) for idx, kind in LAYERS} <= got
    # every regression is explained: its ops and the kernels that changed (stock has more, other names)
    layer_reg = next(r for r in rep.regressions if r["layer"] == "L0.kda" and r["op"] is None)
    ex = layer_reg["explanation"]
    assert ex["ops"][0]["op"] == max((op for op, _ in STOCK["kda"]),
                                     key=lambda op: _span(STOCK, "kda", op) - _span(FUSED, "kda", op))
    changes = {c["change"] for c in ex["kernels"]}
    assert {"renamed", "added"} <= changes
    # read at the median-span step of each side: span delta = kernel time + bubbles, exactly
    assert ex["kernel_time_delta_ns"] + ex["bubble_delta_ns"] == ex["span_delta_ns"] == layer_reg["median"]["delta"]
    assert all(type(ex[k]) is int for k in ("kernel_time_delta_ns", "bubble_delta_ns", "span_delta_ns"))
    assert ex["bubble_delta_ns"] == GAP_NS * (sum(len(k) for _, k in STOCK["kda"]) - sum(len(k) for _, k in FUSED["kda"]))
    assert ex["exposed_comm_delta_ns"] is None  # no overlap data in these samples


def test_self_and_same_configuration_pass() -> None:
    s = sample(Synth(STOCK, seed=5), "a")
    same = compare(s, s)
    assert not same.regressions and not same.improvements
    # the two sides are resampled independently, so the interval is not [0, 0] but holds 0
    assert all(r["median"]["change_pct"] == 0.0 for r in same.rows)
    assert all(r["median"]["ci_pct"][0] <= 0.0 <= r["median"]["ci_pct"][1] for r in same.rows)
    again = compare(s, sample(Synth(STOCK, seed=6), "b", 2))
    assert not again.regressions


@pytest.mark.parametrize("pct,caught", [(3, False), (10, True)])
def test_synthetic_regression_in_one_op_caught_only_beyond_threshold(pct: int, caught: bool) -> None:
    base = sample(Synth(STOCK, seed=7), "base")
    cand = sample(Synth(STOCK, seed=8, scale={(1, "kda_recurrence"): 1 + pct / 100}), "cand", 2)
    rep = compare(base, cand, threshold_pct=5.0)
    row = next(r for r in rep.rows if r["layer"] == "L1.kda" and r["op"] == "kda_recurrence")
    lo, hi = row["median"]["ci_pct"]
    assert lo < hi and row["median"]["degenerate"] is None
    # the op's kernels grow by pct %, the gaps do not: the true change of the span is below pct
    true_pct = pct * (_span(STOCK, "kda", "kda_recurrence") - 2 * GAP_NS) / _span(STOCK, "kda", "kda_recurrence")
    assert lo - 1 < true_pct < hi + 1
    if caught:
        assert _keys(rep.regressions) == {("L1.kda", "kda_recurrence")}
    else:
        assert rep.regressions == []


def test_kernels_metric_fails_on_count_increase() -> None:
    rep = compare(sample(Synth(FUSED, seed=1), "fused"), sample(Synth(FUSED, seed=1), "fused"), metric="kernels")
    assert not rep.regressions
    rep = compare(sample(Synth(FUSED, seed=1), "fused"), sample(Synth(STOCK, seed=1), "stock", 2), metric="kernels")
    per_op = {(x["layer"], x["op"]): x["cand_kernels"] - x["base_kernels"] for x in rep.kernel_count_increases}
    expected = {(f"L{i}.{k}", op): len(dict(STOCK[k])[op]) - len(dict(FUSED[k])[op]) for i, k in LAYERS
                for op, _ in STOCK[k] if len(dict(STOCK[k])[op]) > len(dict(FUSED[k])[op])}
    assert {k: v for k, v in per_op.items() if k[1] is not None} == expected
    assert {k for k in _keys(rep.regressions) if k[1] is not None} == set(expected)


def test_single_step_is_degenerate_point_estimate() -> None:
    base = sample(Synth(STOCK, steps=1, seed=1), "one")
    cand = sample(Synth(STOCK, steps=5, seed=2, scale={(0, "in_proj"): 1.2}), "five", 2)
    rep = compare(base, cand)
    row = next(r for r in rep.rows if r["layer"] == "L0.kda" and r["op"] == "in_proj")
    assert "single step on base" in row["median"]["degenerate"]
    assert row["median"]["ci_pct"][0] == row["median"]["ci_pct"][1] == row["median"]["change_pct"]
    assert row["verdict"] == "regression"
    assert any(n.startswith("single step on base: the confidence intervals are degenerate") for n in rep.notes)


def _lower_median(x: list[int]) -> int:
    return sorted(x)[math.ceil(len(x) / 2) - 1]


def test_bootstrap_is_seeded_and_brackets_the_point() -> None:
    rng = np.random.default_rng(0)
    b = [int(v) for v in np.round(100_000 + rng.normal(0, 1_000, 20))]  # even counts: the lower median
    c = [int(v) for v in np.round(110_000 + rng.normal(0, 1_000, 14))]
    one, two = bootstrap_change(b, c), bootstrap_change(b, c)
    assert one == two
    assert one["ci_pct"][0] <= one["change_pct"] <= one["ci_pct"][1]
    assert (one["base"], one["cand"]) == (_lower_median(b), _lower_median(c))
    assert one["delta"] == _lower_median(c) - _lower_median(b) and type(one["delta"]) is int
    assert one["change_pct"] == (_lower_median(c) / _lower_median(b) - 1) * 100
    # brute force: the same resampling by hand, lower medians of every resample, then the
    # percentile interval's ends, order statistics ceil(2000 * 0.025) and ceil(2000 * 0.975)
    from analyzers.diff import SEED, _resample_index

    ib, ic = _resample_index(len(b), 0, SEED, 2000), _resample_index(len(c), 1, SEED, 2000)
    pairs = [(_lower_median([b[j] for j in ib[i]]), _lower_median([c[j] for j in ic[i]])) for i in range(2000)]
    rels = sorted((mc / mb - 1) * 100 for mb, mc in pairs)
    deltas = sorted(mc - mb for mb, mc in pairs)
    assert one["ci_pct"] == [rels[49], rels[1949]]
    assert one["ci_delta"] == [deltas[49], deltas[1949]] and all(type(d) is int for d in one["ci_delta"])
    p90 = bootstrap_change(b, c, q=P90)
    assert (p90["base"], p90["cand"]) == (sorted(b)[18 - 1], sorted(c)[13 - 1])  # ceil(0.9 * 20), ceil(0.9 * 14)
    with pytest.raises(ValueError):
        bootstrap_change([1.5, 2.0], [2.0, 3.0])  # times are integer ns end to end


@pytest.mark.parametrize("q", [MEDIAN, P90, 0.5, 0.9, 0.99, 0.025, 0.975])
def test_nearest_rank_is_duckdbs_quantile_disc(q: Any) -> None:
    """The one order statistic of the diff is the one analyzers.layers and analyzers.launch use
    in SQL (quantile_disc): the same sample for every n from 1 to 60, in random order."""
    rng = np.random.default_rng(7)
    con = duckdb.connect()
    for n in range(1, 61):
        values = [int(v) for v in rng.integers(0, 1_000_000, n)]
        want = con.execute("SELECT quantile_disc(v, ?) FROM unnest(?::BIGINT[]) AS t(v)", [float(q), values]).fetchone()[0]
        assert nearest_rank(values, q) == want, (n, q)


def _two_rank_sample(run_id: int, name: str, rows: dict[int, list[tuple[int, int]]]) -> RunSample:
    """One layer L0.kda with one op `x`: per rank, per step (busy_ns, bubble_ns); span = sum.
    One kernel per (rank, step) as long as busy, so the kernel-level detail has something."""
    steps, kernels = [], []
    for rank, per_step in rows.items():
        for step, (busy, bubble) in enumerate(per_step):
            for op in (None, "x"):
                steps.append({"run_id": run_id, "rank": rank, "step_index": step, "layer": "L0.kda",
                              "layer_index": 0, "layer_kind": "kda", "op": op, "kernels": 1,
                              "span_ns": busy + bubble, "busy_ns": busy, "bubble_ns": bubble})
            t = 1_000_000 * (step + 1)
            kernels.append({"rank": rank, "step_index": step, "layer": "L0.kda", "layer_kind": "kda", "layer_index": 0,
                            "op": "x", "name": "k", "start_ns": t, "end_ns": t + busy, "category": "compute"})
    return RunSample(run_id, name, pd.DataFrame(steps), pd.DataFrame(kernels))


# cand, per step: rank 0 has the longer span, rank 1 the longer busy time
CAND_RANK0 = [(150_000, 10_000), (120_000, 50_000), (160_000, 20_000), (130_000, 60_000)]  # spans 160k..190k
CAND_RANK1 = [(155_000, 0), (165_000, 0), (170_000, 0), (180_000, 0)]                      # spans below rank 0's


def test_decomposition_is_exact_when_bubbles_vary_and_ranks_differ() -> None:
    """Base: 4 steps of 100 µs busy, no bubble. Cand (4 steps, 2 ranks): rank 0 gates every
    step's span (160, 170, 180, 190 µs), so its rows are the step's values: busy 150, 120,
    160, 130 µs; bubbles 10, 50, 20, 60 µs. Lower median span = 170 µs (step 1): +70 µs.
    Separate lower medians would give busy 130 + bubble 20 = 150 µs: they do not add up; the
    decomposition at the median step does: kernel time 120 - 100 = +20 µs, bubbles +50 µs.
    Taking the max over ranks column by column (busy 165 µs from rank 1 at step 1) would not
    either."""
    base = _two_rank_sample(1, "base", {0: [(100_000, 0)] * 4})
    cand = _two_rank_sample(2, "cand", {0: CAND_RANK0, 1: CAND_RANK1})
    rep = compare(base, cand)
    row = next(r for r in rep.rows if r["layer"] == "L0.kda" and r["op"] is None)
    assert row["verdict"] == "regression"
    assert (row["median"]["base"], row["median"]["cand"], row["median"]["delta"]) == (100_000, 170_000, 70_000)
    assert (row["base_busy_ns"], row["cand_busy_ns"], row["cand_bubble_ns"]) == (100_000, 130_000, 20_000)
    assert row["p90"]["cand"] == 190_000  # ceil(0.9 * 4) = 4th smallest span
    ex = row["explanation"]
    assert ex["median_step"] == {"base": 1, "cand": 1}  # base: four equal spans, the 2nd by step index
    assert (ex["span_delta_ns"], ex["kernel_time_delta_ns"], ex["bubble_delta_ns"]) == (70_000, 20_000, 50_000)
    # --metric busy: rank 1 gates every step (155, 165, 170, 180 µs); its lower median 165 µs
    # is at step 1, where rank 1 has no bubble
    rep = compare(base, cand, metric="busy")
    row = next(r for r in rep.rows if r["layer"] == "L0.kda" and r["op"] is None)
    assert row["median"]["cand"] == row["cand_busy_ns"] == 165_000
    ex = row["explanation"]
    assert (ex["kernel_time_delta_ns"], ex["bubble_delta_ns"], ex["span_delta_ns"]) == (65_000, 0, 65_000)


def _not_int_times(doc: Any, path: str = "") -> list[str]:
    """Paths of time or count values that are not ints (None allowed): every *_ns field, the
    medians' and p90s' base/cand/delta and ci_delta, ops' delta, kernel counts, min_delta."""
    bad: list[str] = []
    if isinstance(doc, dict):
        stats = path.endswith(("median", "p90"))
        for k, v in doc.items():
            timed = (k.endswith("_ns") or k in ("base_kernels", "cand_kernels", "min_delta", "delta")
                     or (stats and k in ("base", "cand", "ci_delta")))
            values = v if isinstance(v, list) and k == "ci_delta" else [v]
            if timed and not all(x is None or type(x) is int for x in values):
                bad.append(f"{path}.{k}={v!r}")
            bad += _not_int_times(v, f"{path}.{k}")
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            bad += _not_int_times(v, f"{path}[{i}]")
    return bad


@pytest.mark.parametrize("metric", ["span", "busy", "bubbles", "kernels"])
def test_every_time_in_the_json_is_an_int_with_an_even_number_of_steps(metric: str) -> None:
    """12 steps a side: a mean of the two middle values would give x.5 ns; nearest rank does not.
    Relative changes stay floats."""
    rep = compare(sample(Synth(FUSED, steps=12, seed=3), "fused"), sample(Synth(STOCK, steps=12, seed=4), "stock", 2),
                  metric=metric)
    assert rep.regressions and rep.base["steps"] == rep.cand["steps"] == 12
    doc = json.loads(json.dumps(rep.to_dict(), allow_nan=False))
    assert _not_int_times(doc) == []
    stats = [r[s] for r in doc["rows"] for s in ("median", "p90") if r[s]]
    floats = [x for m in stats for x in (m["change_pct"], *m["ci_pct"])]
    assert floats and all(x is None or type(x) is float for x in floats)  # null: a change over a zero base
    assert any(r["explanation"]["kernels"] for r in doc["regressions"])  # the kernel-level deltas were walked


def test_kernel_changes_by_position_within_op() -> None:
    out = kernel_changes((["a", "b", "c"], [10, 20, 30]), (["a", "x", "c", "d"], [10, 25, 30, 5]))
    assert [(o["change"], o["base_kernel"], o["cand_kernel"], o["delta_ns"]) for o in out] == [
        ("same", "a", "a", 0), ("renamed", "b", "x", 5), ("same", "c", "c", 0), ("added", None, "d", 5)]
    assert all(type(o["delta_ns"]) is int for o in out)
    out = kernel_changes((["a", "b"], [1, 2]), ([], []))
    assert [o["change"] for o in out] == ["removed", "removed"]


def test_kernel_name_fallback_without_layers() -> None:
    """Runs without layer attribution are aligned by kernel name, and say so."""
    def bare(seed: int, scale: float, run_id: int) -> RunSample:
        k = kernel_rows(Synth(STOCK, seed=seed, scale={(0, "attention"): scale, (3, "attention"): scale}))
        k["layer"] = k["layer_kind"] = k["op"] = None
        k["layer_index"] = None
        from tests.analyzers.test_diff_synth import layer_steps_stub
        return RunSample(run_id, f"r{run_id}", layer_steps_stub(k.iloc[0:0]), k)

    rep = compare(bare(1, 1.0, 1), bare(2, 1.0, 2))
    assert rep.mode == "kernel-name fallback" and rep.fallback and not rep.regressions
    assert "no layer attribution" in rep.alignment["fallback_reason"]
    rep = compare(bare(1, 1.0, 1), bare(2, 1.3, 2))
    # only L3.mla has attention: flash_mla_decode and softmax_reduce grow by 30 %
    assert {r["kernel"] for r in rep.regressions} >= {"flash_mla_decode", "softmax_reduce"}
    assert all(r.get("kernel") or r["layer"] == "all kernels" for r in rep.regressions)


def test_bubbles_metric_in_fallback_compares_kernel_time() -> None:
    """Per kernel name there is no bubble: the gate falls back to kernel time, and says so."""
    def bare(seed: int, scale: float, run_id: int) -> RunSample:
        k = kernel_rows(Synth(STOCK, seed=seed, scale={(0, "in_proj"): scale}))
        k["layer"] = k["layer_kind"] = k["op"] = k["layer_index"] = None
        return RunSample(run_id, f"r{run_id}", k.iloc[0:0].assign(span_ns=0, busy_ns=0, bubble_ns=0, kernels=0), k)

    rep = compare(bare(1, 1.0, 1), bare(2, 1.5, 2), metric="bubbles")
    assert any("kernel time is compared instead" in n for n in rep.notes)
    # a name regresses when L0's in_proj share of its per-step time, grown by 50 %, is over 5 %
    total: dict[str, int] = {}
    grown: dict[str, float] = {}
    for idx, kind in LAYERS:
        for op, kernels in STOCK[kind]:
            for name, dur in kernels:
                total[name] = total.get(name, 0) + dur
                grown[name] = grown.get(name, 0) + (0.5 * dur if (idx, op) == (0, "in_proj") else 0)
    expected = {n for n in total if grown[n] / total[n] > 0.05}
    assert expected and {r["kernel"] for r in rep.regressions} == expected


def test_change_over_a_zero_base_is_strict_json() -> None:
    """A layer without bubbles in the base that gains some: +inf % internally, null in JSON."""
    import json

    base = sample(Synth(STOCK, seed=1), "base")
    cand = sample(Synth(STOCK, seed=2), "cand", 2)
    base.layer_steps["bubble_ns"] = 0  # base: no bubble anywhere; cand: the stub's GAP_NS gaps
    rep = compare(base, cand, metric="bubbles")
    row = next(r for r in rep.rows if r["layer"] == "L0.kda" and r["op"] is None)
    assert row["median"]["change_pct"] == float("inf") and row["verdict"] == "regression"
    text = json.dumps(rep.to_dict(), allow_nan=False)
    back = next(r for r in json.loads(text)["rows"] if r["layer"] == "L0.kda" and r["op"] is None)
    assert back["median"]["change_pct"] is None and back["median"]["delta"] == row["median"]["delta"]
