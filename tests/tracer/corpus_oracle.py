"""An independent reading of Kineto traces with plain json/gzip, for checking the ingest.

Times are parsed from the raw text with Decimal (parse_float=Decimal), so the expected ns are
exact whatever the magnitude; nothing here shares code with tracer.ingest.
"""
from __future__ import annotations

import gzip
import json
from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

KERNEL = {"kernel"}
MEMOP = {"gpu_memcpy", "gpu_memset", "memcpy", "memset"}
API = {"cuda_runtime", "cuda_driver", "runtime", "driver"}
RANGE = {"user_annotation", "cpu_op", "python_function"}


@dataclass
class Expected:
    """Per-rank counts and the exact kernel intervals of one run."""

    kernels: Counter = field(default_factory=Counter)      # rank -> n
    memops: Counter = field(default_factory=Counter)
    api_calls: Counter = field(default_factory=Counter)
    ranges: Counter = field(default_factory=Counter)
    gpu_annotations: int = 0
    gpu_syncs: int = 0
    events: int = 0
    kernel_times: Counter = field(default_factory=Counter)  # (rank, name, start_ns, end_ns) -> n
    memop_times: Counter = field(default_factory=Counter)
    api_times: Counter = field(default_factory=Counter)


def trace_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith((".json", ".json.gz")))


def load(path: Path) -> dict:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as fh:
        return json.load(fh, parse_float=Decimal)


def to_ns(us: int | Decimal) -> int:
    ns = Decimal(us) * 1000
    assert ns == ns.to_integral_value(), f"sub-ns timestamp {us}"
    return int(ns)


def expected_for(folder: Path) -> Expected:
    docs = [load(p) for p in trace_files(folder)]
    declared = [(d.get("distributedInfo") or {}).get("rank") for d in docs]
    if None in declared or len(set(declared)) != len(docs):
        declared = list(range(len(docs)))
    exp = Expected()
    for doc, rank in zip(docs, declared):
        base = int(doc.get("baseTimeNanoseconds", 0) or 0)
        for ev in doc["traceEvents"]:
            exp.events += 1
            if ev.get("ph") != "X":
                continue
            cat = str(ev.get("cat", "")).lower()
            start = base + to_ns(ev["ts"])
            key = (rank, ev["name"], start, start + to_ns(ev.get("dur", 0)))
            if cat in KERNEL:
                exp.kernels[rank] += 1
                exp.kernel_times[key] += 1
            elif cat in MEMOP:
                exp.memops[rank] += 1
                exp.memop_times[key] += 1
            elif cat in API:
                exp.api_calls[rank] += 1
                exp.api_times[key] += 1
            elif cat in RANGE:
                exp.ranges[rank] += 1
            elif cat == "gpu_user_annotation":
                exp.gpu_annotations += 1
            elif cat == "cuda_sync":
                exp.gpu_syncs += 1
    return exp
