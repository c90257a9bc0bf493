"""bench/decode.py's side-by-side table: ratios and floors recomputed by hand from the stored
per-layer figures (the table is what the issue's goals are read from)."""
from __future__ import annotations

from bench.decode import render


def _result(variant: str, us: list[float], kernels: int) -> dict:
    layers = [{"layer": f"L{4 + i}.kda", "kind": "kda", "median_us": u, "p10_us": u - 1, "p90_us": u + 1,
               "kernels": kernels, "weight_bytes": 228_000_000, "state_bytes": 2_000_000} for i, u in enumerate(us)]
    return {"variant": variant, "batch": 1, "spec_tokens": 0, "rows": 1, "layers": layers,
            "step_median_us": sum(us), "step_p10_us": sum(us), "step_p90_us": sum(us), "config": {}}


def _meta(commit: str) -> dict:
    return {"date": "2026-12-02", "commit": commit, "gpu": "H200", "torch": "2.11", "cuda": "13.0",
            "copy_bw_tbs": 4.0, "reps": 10, "layers": "4-6", "tp_sim": True, "expert_impl": "grouped_mm"}


def test_side_by_side_ratio_and_floor() -> None:
    data = {"results": [_result("stock", [210.0, 212.0, 208.0], 23), _result("fused", [100.0, 98.0, 104.0], 13)],
            "meta": {"stock": _meta("abc"), "fused": _meta("abc")}}
    md = render(data)
    row = next(line for line in md.splitlines() if line.startswith("| 1 | 0 | kda | 210.0 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # medians: stock 210, fused 100; floor = 230 MB / 4 TB/s = 57.5 us
    assert cells[4:] == ["23", "100.0", "13", "2.10", "57.5", "1.74"]
    assert "different runs" not in md


def test_side_by_side_flags_rows_from_different_runs() -> None:
    data = {"results": [_result("stock", [210.0], 23), _result("fused", [100.0], 13)],
            "meta": {"stock": _meta("abc"), "fused": _meta("def")}}
    assert "different runs" in render(data)


def test_goals_lines_follow_the_numbers() -> None:
    data = {"results": [_result("stock", [210.0, 212.0, 208.0], 23), _result("fused", [100.0, 98.0, 104.0], 13)],
            "meta": {"stock": _meta("abc"), "fused": _meta("abc")}}
    line = next(x for x in render(data).splitlines() if x.startswith("- B = 1, k = 0, kda"))
    assert "stock/fused 2.10 (goal ≥ 2.0: met)" in line
    assert "fused/floor 1.74 (goal ≤ 1.5: not met)" in line and "13 kernels per layer (goal ≤ 13: met)" in line


def test_render_into_another_file_leaves_decode_md_alone(tmp_path) -> None:
    """`--md`: another card's run is merged into its own table, never into bench/decode.md."""
    import json

    from bench import decode

    before = decode.MD_PATH.read_text()
    data = {"results": [_result("stock", [210.0], 23), _result("fused", [100.0], 13)],
            "meta": {"stock": _meta("abc"), "fused": _meta("abc")}}
    src, md = tmp_path / "run.json", tmp_path / "decode_other.md"
    src.write_text(json.dumps(data))
    decode.main(["--render", str(src), "--md", str(md)])
    decode.main(["--render", str(src), "--md", str(md)])     # a second merge replaces, not appends
    assert decode.MD_PATH.read_text() == before
    text = md.read_text()
    assert text.count("| 1 | 0 | kda | 210.0 |") == 1
    assert json.loads(decode.DATA_RE.search(text).group(1))["results"] == data["results"]
