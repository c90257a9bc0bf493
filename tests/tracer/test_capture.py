"""`decodescope capture` on the CPU with the tiny config: the trace carries the `decodescope`
object with exactly the keys the ingest reads, and the user annotations nest as
step > L{idx}.{kind} > op, one op set per layer, derived from the config (not read off output)."""
from __future__ import annotations

import gzip
import json

from click.testing import CliRunner

from cli.exit_codes import BAD_INPUT, OK
from cli.main import main
from kimi_decode.ranges import OPS

KEYS = {"model", "variant", "config", "gpu", "torch_version", "cuda_version", "commit", "graph_mode", "tp_sim",
        "comm_streams", "prefetch_streams", "comm_ops", "prefetch_ops", "graph_capture_map", "steps"}


def test_capture_cpu_tiny_writes_annotated_trace(tmp_path):
    out = tmp_path / "t.json.gz"
    res = CliRunner().invoke(main, ["capture", "--preset", "tiny", "--eager", "--steps", "2", "--warmup", "1",
                                    "--layers", "2-4", "--batch", "2", "--device", "cpu", "--out", str(out)])
    assert res.exit_code == OK, res.output
    trace = json.loads(gzip.decompress(out.read_bytes()))
    meta = trace["decodescope"]
    assert KEYS <= set(meta)
    assert meta["variant"] == "stock" and meta["graph_mode"] is False and meta["tp_sim"] is False
    assert meta["steps"] == 2 and meta["graph_capture_map"] == []
    assert meta["config"]["layers"] == [2, 3, 4] and meta["config"]["batch"] == 2
    assert meta["config"]["layer_kinds"] == ["kda", "mla", "kda"]   # tiny: MLA at 1-indexed 4
    anns = sorted((e for e in trace["traceEvents"] if e.get("cat") == "user_annotation"),
                  key=lambda e: (float(e["ts"]), -float(e["dur"])))
    inside = lambda a, b: float(b["ts"]) <= float(a["ts"]) and float(a["ts"]) + float(a["dur"]) <= float(b["ts"]) + float(b["dur"])  # noqa: E731
    steps = [a for a in anns if a["name"] == "step"]
    assert len(steps) == 2
    for step in steps:
        layers = [a for a in anns if a["name"].startswith("L") and inside(a, step)]
        assert [a["name"] for a in layers] == ["L2.kda", "L3.mla", "L4.kda"]
        for layer in layers:
            ops = [a["name"] for a in anns if a["name"] in OPS and inside(a, layer)]
            assert ops.count("attn_res") == 1 and ops.count("mlp_res") == 1
            assert ("kda_recurrence" in ops) == layer["name"].endswith("kda")
            assert ("mla_decode" in ops) == layer["name"].endswith("mla")
            assert {"router", "experts", "moe_tail", "moe_gather"} <= set(ops)
    # every op annotation lies inside some layer, every layer inside some step
    for a in anns:
        if a["name"] in OPS:
            assert any(inside(a, l) for l in anns if l["name"].startswith("L")), a
    assert all(any(inside(l, s) for s in steps) for l in anns if l["name"].startswith("L"))


def test_capture_rejects_bad_config(tmp_path):
    res = CliRunner().invoke(main, ["capture", "--preset", "tiny", "--batch", "65", "--eager", "--device", "cpu",
                                    "--out", str(tmp_path / "x.json.gz")])
    assert res.exit_code == BAD_INPUT
    assert "batch must be in 1..64" in res.output
