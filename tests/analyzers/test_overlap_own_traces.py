"""On our own bundled K3 traces (traces/*.json.gz, tp_sim): the simulated collectives must show
as communication, so overlap and exposed communication are measured, not "not applicable".

Oracle, independent of the classifier: the capture metadata names the collective ops
(`comm_ops`, a regex over op names); attribution (NVTX op ranges for eager runs, the capture map
for graph replays) tells which op each kernel belongs to. Every kernel attributed to such an op
must have category 'communication', and the overlap per rank must equal |comm ∩ compute|
recounted here by a plain sweep over those kernels.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from analyzers.attribution import attribute
from analyzers.overlap import overlap
from tests.interval_oracle import merge_intervals
from tracer.ingest import ingest_path
from tracer.store import open_store

TRACES = sorted((Path(__file__).resolve().parents[2] / "traces").glob("*.json.gz"))


def params() -> list:
    if not TRACES:
        return [pytest.param(None, marks=pytest.mark.skip(reason="no bundled traces under traces/ yet"))]
    # Graph replays too: their collectives are classified through the capture map (tracer/classify).
    return [pytest.param(p, id=p.name) for p in TRACES]


@pytest.mark.parametrize("trace", params())
def test_simulated_collectives_are_communication(trace: Path) -> None:
    con = open_store(None)
    [run] = ingest_path(con, trace, progress=False)
    config = json.loads(con.execute("SELECT config FROM runs WHERE run_id = ?", [run.run_id]).fetchall()[0][0])
    comm_ops = re.compile(config["comm_ops"])
    attribute(con, [run.run_id])
    rows = con.execute(
        "SELECT k.start_ns, k.end_ns, k.category, a.op FROM kernels k JOIN kernel_attribution a"
        " ON a.run_id = k.run_id AND a.item_kind = 'kernel' AND a.item_id = k.kernel_id WHERE k.run_id = ?",
        [run.run_id]).fetchall()
    collectives = [(s, e, c) for s, e, c, op in rows if op is not None and comm_ops.search(op)]
    assert collectives, "the capture ran collectives (tp_sim), attribution must find their ops"
    assert {c for _, _, c in collectives} == {"communication"}
    comm = merge_intervals([(s, e) for s, e, c, _ in rows if c == "communication"])
    comp = merge_intervals([(s, e) for s, e, c, _ in rows if c == "compute"])
    both = sum(max(0, min(e, e2) - max(s, s2)) for s, e in comm for s2, e2 in comp)
    [r] = overlap(con, run.run_id)["ranks"]
    assert (r["comm_ns"], r["overlap_ns"]) == (sum(e - s for s, e in comm), both)
