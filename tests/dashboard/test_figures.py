"""The figure builders as pure functions: rows in, figure out, checked against the input rows."""
from __future__ import annotations

import pandas as pd

from dashboard.figures import bubbles as bubble_figs
from dashboard.figures import layers as layer_figs
from dashboard.figures.timeline import IDLE_ROW, timeline_figure
from dashboard.timeline_state import pack_state, unpack_state, window_from_relayout

ORIGIN = 1_700_000_000_000_000_000


def _kernels() -> pd.DataFrame:
    rows = [(0, 7, "gemm", "compute", 100, 350), (1, 7, "norm", "compute", 400, 420),
            (2, 20, "nccl_ar", "communication", 300, 500)]
    df = pd.DataFrame(rows, columns=["kernel_id", "stream", "name", "category", "start_ns", "end_ns"])
    df["start_ns"] += ORIGIN
    df["end_ns"] += ORIGIN
    df["dur_ns"] = df["end_ns"] - df["start_ns"]
    return df


def _empty(cols: list[str]) -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype="int64") for c in cols})


def _lines(fig: dict) -> dict:
    """name -> the line trace (the marker twin carries only hover text)."""
    return {t["name"]: t for t in fig["data"] if t["mode"] == "lines"}


def test_kernel_segments_are_exact_and_relative_to_origin() -> None:
    k = _kernels()
    idle = pd.DataFrame({"start_ns": [ORIGIN + 350], "end_ns": [ORIGIN + 400], "gap_ns": [50]})
    fig = timeline_figure(k, "kernels", idle, _empty(["layer", "start_ns", "end_ns"]), ORIGIN, ORIGIN + 50, ORIGIN + 600,
                          mark=(ORIGIN + 350, ORIGIN + 400))
    lines = _lines(fig)
    ticks = dict(zip(fig["layout"]["yaxis"]["tickvals"], fig["layout"]["yaxis"]["ticktext"]))
    assert lines["compute"]["x"] == [100, 350, None, 400, 420, None]
    assert [ticks.get(y) for y in lines["compute"]["y"]] == ["stream 7", "stream 7", None] * 2
    assert lines["communication"]["x"] == [300, 500, None]
    assert [ticks.get(y) for y in lines["communication"]["y"]] == ["stream 20", "stream 20", None]
    assert lines["device idle (bubble)"]["x"] == [350, 400, None]
    assert ticks[lines["device idle (bubble)"]["y"][0]] == IDLE_ROW
    assert all(t["type"] == "scattergl" for t in fig["data"])
    hover = {t["name"]: t for t in fig["data"] if t["mode"] == "markers"}
    assert hover["compute"]["x"] == [225, 410] and "gemm" in hover["compute"]["text"][0]
    assert fig["layout"]["xaxis"]["range"] == [50, 600]
    marks = [s for s in fig["layout"]["shapes"] if s["layer"] == "above"]
    assert [(s["x0"], s["x1"]) for s in marks] == [(350, 400)]


def test_binned_segments_are_clipped_to_the_window() -> None:
    bins = pd.DataFrame({"stream": [7, 7], "bin": [0, 1], "kernels": [10, 3], "start_ns": [ORIGIN - 40, ORIGIN + 500],
                         "end_ns": [ORIGIN + 90, ORIGIN + 2_000], "busy_ns": [80, 400], "longest_name": ["a", "b"]})
    fig = timeline_figure(bins, "binned", _empty(["start_ns", "end_ns", "gap_ns"]), _empty(["layer", "start_ns", "end_ns"]),
                          ORIGIN, ORIGIN, ORIGIN + 1_000)
    assert fig["data"][0]["x"] == [0, 90, None, 500, 1_000, None]
    assert "10 kernels" in fig["data"][1]["text"][0]


def test_layer_bands_become_shapes_with_labels() -> None:
    bands = pd.DataFrame({"layer": ["L0.kda", "L1.mla"], "start_ns": [ORIGIN + 0, ORIGIN + 300],
                          "end_ns": [ORIGIN + 300, ORIGIN + 700]})
    fig = timeline_figure(_kernels(), "kernels", _empty(["start_ns", "end_ns", "gap_ns"]), bands, ORIGIN, ORIGIN,
                          ORIGIN + 700)
    below = [(s["x0"], s["x1"]) for s in fig["layout"]["shapes"] if s["layer"] == "below"]
    assert below == [(0, 300), (300, 700)]
    assert [a["text"] for a in fig["layout"]["annotations"]] == ["L0.kda", "L1.mla"]


def test_relayout_to_window_round_trips_epoch_ns() -> None:
    state = unpack_state(pack_state(run=1, rank=0, step=None, origin=ORIGIN + 7, t0=ORIGIN + 7, t1=ORIGIN + 1_007,
                                    mark=None, extent=(ORIGIN + 7, ORIGIN + 5_007)))
    assert state["t1"] == ORIGIN + 1_007  # strings in the browser, exact ints here
    assert window_from_relayout({"xaxis.range[0]": 100.4, "xaxis.range[1]": 250.6}, state) == (ORIGIN + 107, ORIGIN + 258)
    assert window_from_relayout({"xaxis.range": [10, 20]}, state) == (ORIGIN + 17, ORIGIN + 27)
    assert window_from_relayout({"xaxis.autorange": True}, state) == (ORIGIN + 7, ORIGIN + 5_007)
    assert window_from_relayout({"yaxis.range[0]": 1}, state) is None
    assert window_from_relayout({"xaxis.range[0]": 5, "xaxis.range[1]": 5}, state) is None


BREAKDOWN = {"run": 1, "steps": 3, "layers": [
    {"layer": "L0.kda", "index": 0, "kind": "kda", "kernels": 5, "span_ns": 1_000, "busy_ns": 800, "bubble_ns": 200,
     "ops": [{"op": "in_proj", "kernels": 2, "busy_ns": 300}, {"op": "attn", "kernels": 3, "busy_ns": 500}]},
    {"layer": "L1.mla", "index": 1, "kind": "mla", "kernels": 4, "span_ns": 2_000, "busy_ns": 1_500, "bubble_ns": 500,
     "ops": [{"op": "attn", "kernels": 4, "busy_ns": 1_500}]},
]}


def test_breakdown_bars_stack_to_busy_plus_bubble() -> None:
    fig = layer_figs.breakdown_bars(BREAKDOWN, "t")
    for i, layer in enumerate(BREAKDOWN["layers"]):
        stacked_ns = sum(t.customdata[i] for t in fig.data)
        assert stacked_ns == layer["busy_ns"] + layer["bubble_ns"] == layer["span_ns"]
    assert [t.name for t in fig.data] == ["in_proj", "attn", "bubble"]


def test_kernel_bars_stack_to_layer_kernels() -> None:
    fig = layer_figs.kernel_bars(BREAKDOWN, "t")
    for i, layer in enumerate(BREAKDOWN["layers"]):
        assert sum(t.y[i] for t in fig.data) == layer["kernels"]


def test_bubble_causes_sum_per_step() -> None:
    result = {"steps": [{"rank": 0, "step_index": 0, "by_cause": {"launch_bound": 3_000, "other": 500}},
                        {"rank": 0, "step_index": 1, "by_cause": {"other": 2_000}}]}
    fig = bubble_figs.by_cause_bars(result)
    got = {t.name: list(t.customdata) for t in fig.data}
    assert got == {"launch_bound": [3_000, 0], "other": [500, 2_000]}
    assert list(fig.data[0].x) == ["step 0", "step 1"]


def test_op_colors_are_shared_across_runs() -> None:
    other = {"layers": [{"layer": "L0.kda", "ops": [{"op": "fused_proj", "kernels": 1, "busy_ns": 9},
                                                    {"op": "attn", "kernels": 1, "busy_ns": 9}]}]}
    colors = layer_figs.op_colors(BREAKDOWN, other)
    assert list(colors) == ["in_proj", "attn", "fused_proj"] and len(set(colors.values())) == 3
    a = {t.name: t.marker.color for t in layer_figs.breakdown_bars(BREAKDOWN, "a", colors).data}
    b = {t.name: t.marker.color for t in layer_figs.breakdown_bars(other, "b", colors).data}
    assert a["attn"] == b["attn"] == colors["attn"]


def test_bubbles_replace_idle_row_one_trace_per_cause() -> None:
    bubbles = pd.DataFrame({"start_ns": [ORIGIN + 350, ORIGIN + 420], "end_ns": [ORIGIN + 400, ORIGIN + 500],
                            "gap_ns": [50, 80], "cause": ["launch_bound", "host_sync"],
                            "prev_name": ["gemm", "norm"], "next_name": ["norm", "x"], "layer": ["L0.kda", None],
                            "op": ["attn", None]})
    idle = pd.DataFrame({"start_ns": [ORIGIN + 350], "end_ns": [ORIGIN + 400], "gap_ns": [50]})
    fig = timeline_figure(_kernels(), "kernels", idle, _empty(["layer", "start_ns", "end_ns"]), ORIGIN, ORIGIN,
                          ORIGIN + 600, bubbles=bubbles)
    lines = _lines(fig)
    assert "device idle (bubble)" not in lines
    assert lines["bubble: launch_bound"]["x"] == [350, 400, None]
    assert lines["bubble: host_sync"]["x"] == [420, 500, None]
    assert fig["layout"]["yaxis"]["ticktext"][0] == "bubbles"
    hover = [t for t in fig["data"] if t["mode"] == "markers" and t["name"] == "bubble: host_sync"][0]
    assert hover["text"][0].startswith("bubble 80 ns: host_sync")
