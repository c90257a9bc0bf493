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


def _with_in_step(result: dict, in_step: list) -> dict:
    for row, inc in zip(result["layers"], in_step):
        row["in_step_us"] = inc
    return result


def test_in_step_column_and_its_side_by_side() -> None:
    """In-step figures: a kind's is the median over its layers that have one (the first layer
    of the step has none), its ratios computed by hand; runs without them render '-' and no
    in-step table."""
    stock = _with_in_step(_result("stock", [210.0, 212.0, 208.0], 23), [None, 205.0, 207.0])
    fused = _with_in_step(_result("fused", [100.0, 98.0, 104.0], 13), [None, 95.0, 96.0])
    md = render({"results": [stock, fused], "meta": {"stock": _meta("abc"), "fused": _meta("abc")}})
    main_row = next(x for x in md.splitlines() if x.startswith("| fused | 1 | 0 | 1 | kda | 3 |"))
    assert [c.strip() for c in main_row.strip("|").split("|")][6:10] == ["100.0", "99.0", "101.0", "95.5"]
    table = md.split("## Inside the step")[1]
    row = next(x for x in table.splitlines() if x.startswith("| 1 | 0 | kda |"))
    # stock median(205, 207) = 206, fused median(95, 96) = 95.5, floor 57.5
    assert [c.strip() for c in row.strip("|").split("|")][3:] == ["206.0", "95.5", "2.16", "57.5", "1.66"]

    # the in-step floor is over the layers with an in-step figure: the first layer's bytes
    # (here 4x the others') stay out of it, while the one-layer floor is their median
    fused["layers"][0]["weight_bytes"] = 4 * 228_000_000
    fused["layers"][2]["weight_bytes"] = 298_000_000
    md = render({"results": [stock, fused], "meta": {"stock": _meta("abc"), "fused": _meta("abc")}})
    side = next(x for x in md.split("## Inside")[0].splitlines() if x.startswith("| 1 | 0 | kda | 210.0 |"))
    assert [c.strip() for c in side.strip("|").split("|")][8] == "75.0"        # median(912, 230, 300) MB / 4 TB/s
    row = next(x for x in md.split("## Inside the step")[1].splitlines() if x.startswith("| 1 | 0 | kda |"))
    assert [c.strip() for c in row.strip("|").split("|")][6:] == ["66.2", "1.44"]   # (230 + 300) / 2 MB

    old = render({"results": [_result("stock", [210.0], 23), _result("fused", [100.0], 13)],
                  "meta": {"stock": _meta("abc"), "fused": _meta("abc")}})
    assert "## Inside the step" not in old
    old_row = next(x for x in old.splitlines() if x.startswith("| fused | 1 | 0 | 1 | kda | 1 |"))
    assert [c.strip() for c in old_row.strip("|").split("|")][9] == "-"


def test_increments_are_prefix_differences() -> None:
    from bench.decode import increments

    assert increments([90.0, 170.0, 251.5, 345.0]) == [None, 80.0, 81.5, 93.5]
    assert increments([90.0]) == [None]


def test_run_layers_all_of_them_is_the_step_without_its_tail() -> None:
    """run_layers over every layer gives the step's output (the decoders' forward, which also
    advances the MLA positions: the tail the prefix graphs leave out), on two copies of one
    model so both start from the same state."""
    import copy

    import torch

    from bench.decode import run_layers
    from kimi_decode.config import tiny
    from kimi_decode.stock import StockDecoder

    model = StockDecoder(tiny(layers=(2, 3, 4), batch=2))
    twin = copy.deepcopy(model)
    inputs = model.make_inputs()
    with torch.no_grad():
        want_m, want_prefix = model(*inputs)
        got_m, got_prefix = run_layers(twin, inputs, len(twin.layers))
        assert torch.equal(got_m, want_m) and torch.equal(got_prefix, want_prefix)
        assert not torch.equal(twin.pos, model.pos)        # the step advanced pos, the layers did not
        part_m, _ = run_layers(copy.deepcopy(twin), inputs, 1)
        assert part_m.shape == want_m.shape and not torch.equal(part_m, got_m)


def test_layer_bytes_leaves_int_scratch_out() -> None:
    """bench/decode.py layer_bytes: the state is the floating buffers (KDA state read + written,
    the MLA cache read); an int32 counter buffer (the fused routers' grid counter, with
    front_mma.TAIL_SPLIT 263 KB) adds nothing to the floor."""
    import torch

    from bench.decode import layer_bytes
    from kimi_decode.config import tiny
    from kimi_decode.stock import StockDecoder
    cfg = tiny(layers=(3, 4), batch=1)
    layer = StockDecoder(cfg).layers[0]
    layer.mlp.last_idx = torch.zeros(1, cfg.top_k, dtype=torch.int64)
    before = layer_bytes(layer, cfg)
    want = sum((1 if n.endswith("cache") else 2) * b.numel() * b.element_size() for n, b in layer.named_buffers())
    assert before["state_bytes"] == want > 0
    layer.mlp.register_buffer("router_counter", torch.zeros(65793, dtype=torch.int32))
    assert layer_bytes(layer, cfg) == before
