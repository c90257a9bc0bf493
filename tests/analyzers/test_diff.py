"""analyzers.diff on hand-made runs: alignment by (layer kind, index, op), bootstrap gate, detail.

The layer_steps rows come from a brute-force stub of the documented contract
(test_diff_synth.layer_steps_stub), so these tests do not depend on the attribution code.
Expected verdicts are derived from the synthetic spec (durations + gaps), not read off output.
"""
from __future__ import annotations

import numpy as np
import pytest

from analyzers.diff import ALL_LAYERS, RunSample, bootstrap_change, compare, kernel_changes
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
    # bubbles are constant per layer here (GAP_NS per inner gap), so span delta = kernel time + bubbles
    assert ex["kernel_time_delta_ns"] + ex["bubble_delta_ns"] == pytest.approx(layer_reg["median"]["delta"])
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


def test_bootstrap_is_seeded_and_brackets_the_point() -> None:
    rng = np.random.default_rng(0)
    b, c = 1000 + rng.normal(0, 10, 20), 1100 + rng.normal(0, 10, 15)
    one, two = bootstrap_change(b, c), bootstrap_change(b, c)
    assert one == two
    assert one["ci_pct"][0] <= one["change_pct"] <= one["ci_pct"][1]
    assert one["change_pct"] == pytest.approx((np.median(c) / np.median(b) - 1) * 100)
    # brute force: the same resampling by hand gives the same interval
    from analyzers.diff import SEED, _resample_index

    ib, ic = _resample_index(len(b), 0, SEED, 2000), _resample_index(len(c), 1, SEED, 2000)
    rels = [(np.median(c[ic[i]]) / np.median(b[ib[i]]) - 1) * 100 for i in range(2000)]
    rels.sort()  # the percentile interval: order statistics ceil(2000 p) of the sorted changes
    assert one["ci_pct"] == pytest.approx([rels[int(np.ceil(2000 * 0.025)) - 1], rels[int(np.ceil(2000 * 0.975)) - 1]])


def test_kernel_changes_by_position_within_op() -> None:
    out = kernel_changes((["a", "b", "c"], [10.0, 20.0, 30.0]), (["a", "x", "c", "d"], [10.0, 25.0, 30.0, 5.0]))
    assert [(o["change"], o["base_kernel"], o["cand_kernel"], o["delta_ns"]) for o in out] == [
        ("same", "a", "a", 0.0), ("renamed", "b", "x", 5.0), ("same", "c", "c", 0.0), ("added", None, "d", 5.0)]
    out = kernel_changes((["a", "b"], [1.0, 2.0]), ([], []))
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
