"""The same decode steps written as an nsys export and as a Kineto trace analyse identically.

One plan (seeded random durations, integer ns): 3 steps of `step` > `L{i}.{kind}` > op ranges
on the host, one launch call per op on the same thread, each kernel on the device after its
launch, an NCCL kernel on a second stream overlapping the next layer's compute. The plan is
written with NsysExportBuilder and with KinetoTraceBuilder; both are ingested into one store.
Every analysis must then see the same thing: attribution (step, layer, op per kernel), the
per-(rank, step, layer, op) layer table, and compute/communication overlap.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from analyzers.attribution import attribute
from analyzers.layers import layer_steps
from analyzers.views import load_views
from tests.kineto_builder import KinetoTraceBuilder
from tests.nsys_builder import NsysExportBuilder
from tracer.ingest import ingest_path
from tracer.store import open_store

LAYERS = [("L0.kda", ("in_proj", "kda_recurrence", "o_proj")), ("L1.mla", ("q_proj", "attn", "o_proj+ar"))]
PID, TID = 4242, 4243


def plan(seed: int) -> tuple[list[tuple[str, int, int]], list[dict]]:
    """(host ranges, launches) in integer ns: each launch has call times, kernel times, stream."""
    rng = random.Random(seed)
    ranges: list[tuple[str, int, int]] = []
    launches: list[dict] = []
    t = 1_000_000
    gpu = t
    for _ in range(3):
        step_start = t
        for layer, ops in LAYERS:
            layer_start = t
            for op in ops:
                op_start = t
                call = t + rng.randint(200, 900)
                call_end = call + rng.randint(1_000, 3_000)
                gpu = max(gpu, call_end) + rng.randint(0, 2_000)
                dur = rng.randint(5_000, 40_000)
                nccl = op.endswith("+ar")
                launches.append({"call": (call, call_end), "kernel": (gpu, gpu + dur),
                                 "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL" if nccl else f"{op}_kernel",
                                 "stream": 9 if nccl else 7})
                if not nccl:
                    gpu += dur
                t = call_end + rng.randint(300, 1_500)
                ranges.append((op, op_start, t))
                t += rng.randint(1, 500)
            ranges.append((layer, layer_start, t))
            t += rng.randint(1, 500)
        ranges.append(("step", step_start, t))
        t += rng.randint(5_000, 20_000)
    return ranges, launches


def write_both(tmp_path: Path, seed: int) -> tuple[Path, Path]:
    ranges, launches = plan(seed)
    n = NsysExportBuilder()
    k = KinetoTraceBuilder(host_pid=PID)
    for name, s, e in ranges:
        n.push_pop(name, s, e, pid=PID, tid=TID)
        k.annotation(name, s, e - s, tid=TID)
    for i, l in enumerate(launches, start=1):
        (cs, ce), (ks, ke) = l["call"], l["kernel"]
        n.runtime("cudaLaunchKernel_v7000", cs, ce, pid=PID, tid=TID, correlation=i)
        n.kernel(l["name"], ks, ke, pid=PID, stream=l["stream"], correlation=i)
        k.runtime("cudaLaunchKernel", cs, ce - cs, correlation=i, tid=TID)
        k.kernel(l["name"], ks, ke - ks, stream=l["stream"], correlation=i)
    return n.write(tmp_path / "plan.sqlite"), k.write(tmp_path / "plan.json")


@pytest.mark.parametrize("seed", [1, 2])
def test_analyses_agree_across_formats(tmp_path: Path, seed: int) -> None:
    nsys_path, kineto_path = write_both(tmp_path, seed)
    con = open_store(None)
    (a,) = ingest_path(con, nsys_path, progress=False)
    (b,) = ingest_path(con, kineto_path, progress=False)
    assert (a.kernels, a.ranks, a.streams) == (b.kernels, b.ranks, b.streams) == (18, 1, 2)

    kernels = "SELECT name, start_ns, end_ns, stream, category FROM kernels WHERE run_id = ? ORDER BY kernel_id"
    assert con.execute(kernels, [a.run_id]).fetchall() == con.execute(kernels, [b.run_id]).fetchall()

    attribute(con, [a.run_id, b.run_id])
    attributed = """SELECT k.name, k.start_ns, x.step_index, x.layer, x.layer_kind, x.op, x.method
                    FROM kernel_attribution AS x JOIN kernels AS k
                      ON k.run_id = x.run_id AND k.kernel_id = x.item_id AND x.item_kind = 'kernel'
                    WHERE x.run_id = ? ORDER BY k.kernel_id"""
    got_nsys = con.execute(attributed, [a.run_id]).fetchall()
    assert got_nsys == con.execute(attributed, [b.run_id]).fetchall()
    # and it is the plan's answer: kernel i belongs to op i of the plan
    ops = [op for _ in range(3) for _, layer_ops in LAYERS for op in layer_ops]
    assert [(r[2], r[3], r[5], r[6]) for r in got_nsys] == [
        (i // 6, LAYERS[(i // 3) % 2][0], ops[i], "range") for i in range(18)]

    steps_a = layer_steps(con, a.run_id).drop(columns="run_id")
    steps_b = layer_steps(con, b.run_id).drop(columns="run_id")
    assert len(steps_a) == 3 * 2 * 4
    assert steps_a.to_dict("records") == steps_b.to_dict("records")

    load_views(con)
    overlap = "SELECT comm_ns, overlap_ns, exposed_comm_ns FROM overlap_per_rank WHERE run_id = ?"
    assert con.execute(overlap, [a.run_id]).fetchall() == con.execute(overlap, [b.run_id]).fetchall()
