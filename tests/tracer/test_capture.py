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
    assert meta["graph_warmup_replays"] == 0          # eager: no graph to warm
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


def _x(cat, name, ts, dur, tid=10, pid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args}


def test_kernel_attribution_replays_and_comm_streams_on_a_hand_made_trace():
    """Hand-made Kineto events, answers derived by reading them:
    - k1 (launch corr 1 at ts 3) lies in step > L4.kda > in_proj; k2 (corr 2 at 11) in all_reduce;
      k3 (corr 3 at 21) in router; k4 (corr 4 at 150) outside every annotation;
      an `experts` annotation on ANOTHER thread covering ts 3 must not claim k1;
    - comm streams: all_reduce ran on 22 only, compute on 7 -> [22];
    - two cudaGraphLaunch calls (corr 5, 6) -> two replays; the first holds 3 kernels in start
      order 210, 212, 215 whatever their order in the file."""
    from tracer.capture import comm_streams, graph_replays, kernels_with_ops

    ev = [
        _x("user_annotation", "step", 0, 100), _x("user_annotation", "L4.kda", 1, 60),
        _x("user_annotation", "in_proj", 2, 5), _x("user_annotation", "all_reduce", 10, 5),
        _x("user_annotation", "router", 20, 5), _x("user_annotation", "experts", 0, 50, tid=11),
        _x("cuda_runtime", "cudaLaunchKernel", 3, 1, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 11, 1, correlation=2),
        _x("cuda_driver", "cuLaunchKernelEx", 21, 1, correlation=3),
        _x("cuda_runtime", "cudaLaunchKernel", 150, 1, correlation=4),
        _x("user_annotation", "step", 200, 10), _x("cuda_runtime", "cudaGraphLaunch", 201, 2, correlation=5),
        _x("user_annotation", "step", 300, 10), _x("cuda_runtime", "cudaGraphLaunch", 301, 2, correlation=6),
        _x("kernel", "k3", 30, 2, pid=0, tid=7, stream=7, correlation=3),
        _x("kernel", "k1", 10, 2, pid=0, tid=7, stream=7, correlation=1),
        _x("kernel", "k2", 20, 2, pid=0, tid=22, stream=22, correlation=2),
        _x("kernel", "k4", 160, 2, pid=0, tid=7, stream=7, correlation=4),
        _x("kernel", "g_c", 215, 1, pid=0, tid=9, stream=9, correlation=5),
        _x("kernel", "g_a", 210, 1, pid=0, tid=7, stream=7, correlation=5),
        _x("kernel", "g_b", 212, 1, pid=0, tid=7, stream=7, correlation=5),
        _x("kernel", "g_a", 310, 1, pid=0, tid=7, stream=7, correlation=6),
    ]
    ks = kernels_with_ops({"traceEvents": ev})
    by_name = {k["name"]: k for k in ks if not k["name"].startswith("g_")}
    assert [k["name"] for k in ks][:4] == ["k1", "k2", "k3", "k4"]
    assert (by_name["k1"]["step"], by_name["k1"]["layer"], by_name["k1"]["op"]) == ("step", "L4.kda", "in_proj")
    assert by_name["k2"]["op"] == "all_reduce" and by_name["k3"]["op"] == "router"
    assert (by_name["k4"]["step"], by_name["k4"]["layer"], by_name["k4"]["op"]) == (None, None, None)
    eager = [k for k in ks if not k["name"].startswith("g_")]
    assert comm_streams(eager) == [22]
    replays = graph_replays(ks)
    assert [[k["name"] for k in r] for r in replays] == [["g_a", "g_b", "g_c"], ["g_a"]]
    assert all(k["step"] == "step" and k["layer"] is None for k in replays[0])
    # the capture map: the eager step's kernels by start order, each with the stream it ran on
    from tracer.capture import capture_map
    cmap = capture_map([k for k in eager if k["step"] == "step"])
    assert [(m["node_order"], m["kernel_name"], m["layer"], m["op"], m["capture_stream"]) for m in cmap] == [
        (0, "k1", "L4.kda", "in_proj", 7), (1, "k2", "L4.kda", "all_reduce", 22), (2, "k3", "L4.kda", "router", 7)]


def test_capture_on_cuda_without_a_gpu_is_one_error_line(tmp_path):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "t.json.gz"
    res = CliRunner().invoke(main, ["capture", "--variant", "stock", "--preset", "tiny", "--device", "cuda",
                                    "--out", str(out)])
    assert res.exit_code == BAD_INPUT
    assert res.output.strip().splitlines() == ["error: --device cuda: no CUDA GPU on this machine (use --device cpu)"]
    assert not out.exists()


def test_warm_graph_replays_for_the_time_and_at_least_the_minimum(monkeypatch):
    """The graph warm-up before the profiled steps (tracer/capture.py GRAPH_WARMUP_S) replays
    until both the wall time and the replay minimum are reached, syncing every 8 replays and
    at the end: a fake clock that advances 1 ms per replay gives exactly 50 replays for
    50 ms, and the minimum wins when the time is short."""
    import torch

    from tracer import capture as cap
    now = [0.0]
    syncs = []

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1
            now[0] += 0.001

    monkeypatch.setattr(cap.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: syncs.append(Graph.replays))
    assert cap.warm_graph(Graph(), seconds=0.05, min_replays=10) == Graph.replays == 50
    assert syncs[:3] == [8, 16, 24] and syncs[-1] == 50
    Graph.replays, now[0] = 0, 0.0
    assert cap.warm_graph(Graph(), seconds=0.002, min_replays=10) == 10
