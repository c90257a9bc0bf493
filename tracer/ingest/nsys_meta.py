"""What the nsys reader tells about a run besides its rows: `runs.metadata`, gpu, world size.

Per export (`file_facts`, while its TEMP tables exist): ranks, rows read, skipped rows, NVTX
event kinds, and what a window cut from a longer capture lost (kernels without a launch row,
launches without a kernel, ranges still open at the end), with one warning line per issue.
Per run (`run_meta`): the exports' facts merged, ranks renumbered across exports in file order.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb

from tracer.ingest import nsys_sql as q
from tracer.ingest.nsys_export import Lookups
from tracer.ingest.runmeta import RunMeta


@dataclass
class FileFacts:
    """One export's facts; ranks and rank keys are local to the export."""

    path: Path
    lookups: Lookups
    rows_read: dict[str, int]
    ranks: list[tuple[int, int | None, int | None]]      # (rank, pid, device)
    counts: tuple[int, int, int, int]                     # kernels, memops, api_calls, ranges stored
    facts: dict[str, Any]                                 # additive counts and per-export details
    warnings: list[str] = field(default_factory=list)
    n_kernels: int = 0
    graph_evidence: int = 0


def _labelled(rows: list[tuple[Any, int]], labels: dict[int, str]) -> dict[str, int]:
    return {f"{k} {labels.get(k, 'unknown')}" if k is not None else "none": int(n) for k, n in rows}


def _window(con: duckdb.DuckDBPyConnection, export: dict[str, str], ranges_cut: int,
            n_kernels: int) -> tuple[dict[str, Any], list[str]]:
    """Counts of what a cut window lost, and the warning lines that say so."""
    without: dict[str, dict[str, int]] = {}
    for rank, src, n in con.execute(q.WITHOUT_LAUNCH_SQL).fetchall():
        without.setdefault(src, {})[str(rank)] = int(n)
    launches_without = int(con.execute(q.LAUNCH_WITHOUT_KERNEL_SQL).fetchall()[0][0])
    facts: dict[str, Any] = {
        "kernels_without_launch": sum(without.get("kernel", {}).values()),
        "kernels_without_launch_by_rank": without.get("kernel", {}),
        "memops_without_launch": sum(without.get("memcpy", {}).values()) + sum(without.get("memset", {}).values()),
        "launches_without_kernel": launches_without,
        "ranges_cut": ranges_cut,
    }
    window = export.get("DERIVED_WINDOW_NS")
    warnings: list[str] = []
    where = f"window {window} ns cut from a longer capture" if window else "capture window edges"
    if facts["kernels_without_launch"]:
        warnings.append(f"{facts['kernels_without_launch']} of {n_kernels} kernels have no launch call in the "
                        f"export ({where}); they cannot be attributed to NVTX ranges through their launch")
    if launches_without:
        warnings.append(f"{launches_without} kernel launch calls have no kernel in the export ({where})")
    if ranges_cut:
        warnings.append(f"{ranges_cut} NVTX ranges were still open at the end of the capture; "
                        "they are cut at its last timestamp")
    if window:
        warnings.append("NVTX ranges that cross the window's edges are not in the export: outer ranges "
                        "(whole steps, forward passes) may be missing")
    return facts, warnings


def file_facts(con: duckdb.DuckDBPyConnection, idx: int, path: Path, lookups: Lookups,
               rows_read: dict[str, int], syncs_moved: int) -> FileFacts:
    """Facts of the export staged in the TEMP tables (its rows already in _nsys_out_*)."""
    ranks = [tuple(r) for r in con.execute("SELECT rank, pid, device FROM _nsys_ranks ORDER BY rank").fetchall()]
    n_kernels = int(con.execute("SELECT count(*) FROM _nsys_kernel").fetchall()[0][0])
    ranges_cut = int(con.execute(q.RANGES_CUT_SQL).fetchall()[0][0])
    window, warnings = _window(con, lookups.export, ranges_cut, n_kernels)
    skipped = [(k, n) for k, n in con.execute(q.RUNTIME_CLASSES_SQL).fetchall()
               if k is not None and k not in q.EVENT_CLASS_KIND]
    calls_dropped, ranges_dropped = con.execute(q.HOST_ROWS_DROPPED_SQL).fetchall()[0]
    if calls_dropped or ranges_dropped:
        warnings.append(f"{calls_dropped} API calls and {ranges_dropped} NVTX ranges belong to processes with no "
                        "GPU activity in the export; not stored")
    graph_kernels, graph_launches = con.execute(q.GRAPH_EVIDENCE_SQL).fetchall()[0]
    threads = {f"{pid}/{tid}": lookups.threads[(pid, tid)]
               for pid, tid in sorted(con.execute(q.HOST_THREADS_SQL).fetchall()) if (pid, tid) in lookups.threads}
    facts = {
        **window,
        "runtime_rows_skipped": _labelled(skipped, lookups.event_classes),
        "nvtx_event_types": _labelled(con.execute(q.NVTX_TYPES_SQL).fetchall(), lookups.event_types),
        "nvtx_domains": {str(d): n for d, n in con.execute(q.NVTX_DOMAINS_SQL).fetchall()},
        "host_rows_without_gpu_process": {"api_calls": int(calls_dropped), "nvtx_ranges": int(ranges_dropped)},
        "threads": threads,
        "graph_launches": int(graph_launches),
        "syncs_device_from_context": syncs_moved,
    }
    counts = tuple(int(n) for n in con.execute(q.OUT_COUNTS_SQL, [idx] * 4).fetchall()[0])
    return FileFacts(path, lookups, rows_read, ranks, counts, facts, warnings, n_kernels,   # type: ignore[arg-type]
                     int(graph_kernels) + int(graph_launches))


def _sum_dicts(dicts: list[dict[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for d in dicts:
        total.update(d)
    return dict(sorted(total.items()))


def run_meta(files: list[FileFacts], rank_bases: list[int]) -> RunMeta:
    """The runs-row facts of one run made of `files` (ranks of file i start at rank_bases[i])."""
    multi = len(files) > 1
    ranks: list[dict[str, Any]] = []
    for f, base in zip(files, rank_bases):
        for rank, pid, device in f.ranks:
            entry = {"rank": base + rank, "pid": pid, "device": device,
                     "gpu": f.lookups.gpus.get(int(device)) if device is not None else None}
            ranks.append({**entry, "file": f.path.name} if multi else entry)
    names = sorted({str(r["gpu"]["name"]) for r in ranks if r["gpu"] and r["gpu"].get("name")})

    def prefixed(f: FileFacts, text: str) -> str:
        return f"{f.path.name}: {text}" if multi else text

    per_file = []
    for f in files:
        entry: dict[str, Any] = {"file": f.path.name, "nsys_version": f.lookups.export.get("EXPORT_PRODUCT_VERSION"),
                                 "export_schema_version": f.lookups.export.get("EXPORT_SCHEMA_VERSION"),
                                 **f.lookups.session_start}
        if f.lookups.export.get("DERIVED_WINDOW_NS"):
            entry["derived_window_ns"] = f.lookups.export["DERIVED_WINDOW_NS"]
            entry["derived_from"] = f.lookups.export.get("DERIVED_FROM")
        per_file.append(entry)
    first = per_file[0]
    metadata: dict[str, Any] = {
        **{k: v for k, v in first.items() if k != "file"},            # single export: its facts up front
        "rank_source": "one rank per (process, device) with GPU activity, in device-id then pid order"
                       + (", exports in file-name order" if multi else ""),
        "ranks": ranks,
        "files": per_file,
        "rows_read": _sum_dicts([f.rows_read for f in files]),
        "unread_tables": _sum_dicts([f.lookups.unread for f in files]),
        "runtime_rows_skipped": _sum_dicts([f.facts["runtime_rows_skipped"] for f in files]),
        "nvtx_event_types": _sum_dicts([f.facts["nvtx_event_types"] for f in files]),
        "nvtx_domains": {k: v for f in files for k, v in f.facts["nvtx_domains"].items()},
        "host_rows_without_gpu_process": _sum_dicts([f.facts["host_rows_without_gpu_process"] for f in files]),
        "threads": {prefixed(f, k): v for f in files for k, v in f.facts["threads"].items()},
        "kernels_without_launch_by_rank": {str(base + int(r)): n for f, base in zip(files, rank_bases)
                                           for r, n in f.facts["kernels_without_launch_by_rank"].items()},
        "warnings": [prefixed(f, w) for f in files for w in f.warnings],
    }
    if multi:
        for key in ("nsys_version", "export_schema_version", "session_start_utc_epoch_ns", "session_start_clock_ns",
                    "derived_window_ns", "derived_from"):
            metadata.pop(key, None)
    for key in ("kernels_without_launch", "memops_without_launch", "launches_without_kernel", "ranges_cut",
                "graph_launches", "syncs_device_from_context"):
        metadata[key] = sum(int(f.facts[key]) for f in files)
    if not names:
        metadata["gpu_note"] = "the export has no TARGET_INFO_GPU row for the devices used: GPU model unknown"
    n_kernels = sum(f.n_kernels for f in files)
    return RunMeta(
        world_size=max(len(ranks), 1),
        metadata=metadata,
        gpu=" / ".join(names) if names else None,
        graph_mode=bool(sum(f.graph_evidence for f in files)) if n_kernels else None,
    )
