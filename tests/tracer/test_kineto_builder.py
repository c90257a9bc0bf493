"""The test-trace builder writes exact µs text that decodes back to the ns it was given."""
from __future__ import annotations

import gzip
import json
from decimal import Decimal

from tests.kineto_builder import KinetoTraceBuilder, ns_to_us_text


def test_ns_to_us_text_round_trips() -> None:
    for ns in (0, 1, 999, 1000, 4_460_000_000_000_123_456, -1, -1500):
        assert int(Decimal(ns_to_us_text(ns)) * 1000) == ns


def test_written_trace_holds_exact_times(tmp_path) -> None:
    base = 1_700_000_000_000_000_000
    b = KinetoTraceBuilder(rank=3, world_size=4, base_time_ns=base)
    corr = b.launch("gemm", base + 1_001, 499, base + 2_002, 3_003, stream=9)
    b.gpu_annotation("L0.mla", base + 2_000, 5_000)
    p = b.write(tmp_path / "t.json.gz", gz=True, decodescope_meta={"variant": "stock"})
    raw = gzip.open(p, "rt").read()
    doc = json.loads(raw, parse_float=Decimal)
    assert doc["distributedInfo"]["rank"] == 3 and doc["decodescope"] == {"variant": "stock"}
    kern = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"][0]
    assert kern["args"]["correlation"] == corr and kern["tid"] == 9
    assert base + int(kern["ts"] * 1000) == base + 2_002 and int(kern["dur"] * 1000) == 3_003
    assert '"ts": 2.002' in raw
