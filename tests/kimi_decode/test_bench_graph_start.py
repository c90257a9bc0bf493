"""bench/graph_start.py on the CPU: the gap and span it reads from a graph replay's kernels
(hand-made replays with known answers, in integer ns), the lower median over replays, the
derived per-layer table, and a clear one-line error for a file that is not its JSON."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import graph_start


def _k(ts_us: float, dur_us: float, name: str = "k") -> dict:
    return {"name": name, "ts": ts_us, "dur": dur_us}


def test_gap_and_span_after_the_lead() -> None:
    # lead kernel 0..1 us, then the layer's kernels given out of order: 2.0..5.5, 4.25..9.125
    replay = [_k(4.25, 4.875, "second"), _k(0.0, 1.0, "lead"), _k(2.0, 3.5, "first"), _k(8.0, 0.5, "third")]
    assert graph_start.layer_gap_and_span(replay, skip=1) == (4250 - 5500, 9125 - 2000)   # overlap: < 0
    assert graph_start.layer_gap_and_span(replay, skip=0) == (2000 - 1000, 9125 - 0)


def test_gap_needs_two_kernels_after_the_skip() -> None:
    with pytest.raises(ValueError, match="1 kernel"):
        graph_start.layer_gap_and_span([_k(0, 1), _k(2, 1)], skip=1)


def test_summary_is_the_lower_median_over_replays() -> None:
    replays = [[_k(0, 1), _k(1 + g / 1000, 1)] for g in (300, 100, 200, 400)]   # gaps 300, 100, 200, 400 ns
    s = graph_start.summarize(replays, skip=0)
    assert s == {"gap_ns": 200, "span_ns": 2200, "replays": 4}


def _run() -> dict:
    rows = []
    for graph, us in (("layer", 80.0), ("lead", 3.0), ("lead+layer", 79.5), ("prev", 81.0), ("prev+layer", 155.0)):
        rows.append({"variant": "fused", "batch": 1, "spec": 0, "graph": graph, "median_us": us,
                     "first_pass_us": us + 1, "kernels": 10, "skip": 0, "gap_ns": 3870, "span_ns": 76543})
    return {"meta": {"gpu": "GPU X", "commit": "abc", "reps": 200, "profiled_replays": 8, "date": "2026-01-01"},
            "rows": rows}


def test_render_derives_alone_after_lead_and_in_step() -> None:
    md = graph_start.render(_run())
    assert "## GPU X, commit `abc`, 2026-01-01" in md
    assert "| fused | 1 | 0 | layer | 80.0 | 10 | 3,870 | 76,543 |  |" in md
    # lead+layer - alone 79.5 - 80.0; in-step 155.0 - 81.0; alone - in-step 80.0 - 74.0
    assert "| fused | 1 | 0 | 80.0 | -0.5 | 74.0 | +6.0 |" in md


def test_render_of_a_bad_file_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit) as e:
        graph_start.main(["--render", str(bad)])
    assert str(e.value).startswith(f"graph_start: {bad}: not a graph_start.json")
    assert "\n" not in str(e.value)


def test_committed_table_is_the_rendered_results() -> None:
    root = Path(__file__).resolve().parents[2]
    run = json.loads((root / "bench" / "graph_start_h100.json").read_text())
    assert (root / "bench" / "graph_start.md").read_text() == graph_start.render(run)


def test_a_step_row_is_listed_but_not_derived() -> None:
    run = _run()
    run["rows"].append({"variant": "fused", "batch": 1, "spec": 0, "graph": "step", "median_us": 336.0,
                        "first_pass_us": 337.0, "kernels": 49, "skip": 0, "gap_ns": 3870, "span_ns": 330000,
                        "graph_gap_ns": 3870})
    other = _run()
    other["meta"]["gpu"] = "GPU Y"
    md = graph_start.render([run, other])
    assert "| fused | 1 | 0 | step | 336.0 | 49 | 3,870 | 330,000 | 3,870 |" in md
    assert md.count("| fused | 1 | 0 | 80.0 |") == 2          # one derived row per run
    assert md.index("## GPU X") < md.index("## GPU Y")
