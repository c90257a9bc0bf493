"""CUPTI activity records -> Kineto-format trace JSON (pure Python, no `cupti` import).

Why Kineto format: the store's Kineto reader (tracer/ingest/) and every analysis then work
unchanged on CUPTI-backend captures. What maps to what:

| CUPTI activity kind            | Kineto event (ph X)                                          |
|--------------------------------|--------------------------------------------------------------|
| CONCURRENT_KERNEL / KERNEL     | cat kernel, pid device, tid stream, args incl. graph (node) id |
| MEMCPY                         | cat gpu_memcpy, name `Memcpy HtoD (Pinned -> Device)`         |
| MEMSET                         | cat gpu_memset, name `Memset (Device)`                        |
| RUNTIME / DRIVER               | cat cuda_runtime / cuda_driver, pid process, tid thread      |
| MARKER START + END (same id)   | cat user_annotation (an NVTX push/pop or start/end range)    |

Times: CUPTI gives absolute integer ns. `ts`/`dur` are written in µs relative to
`baseTimeNanoseconds` (the earliest record), as Kineto does; a relative time below 2^41 ns
(~36 min) is a float whose shortest repr is exactly `{us}.{ns:03}`, so the reader's
DECIMAL(38,3) parse gets the integer ns back (checked per value, see `_us`).

Names as Kineto writes them: kernel names demangled with libstdc++'s `__cxa_demangle` (what
Kineto calls; CUPTI reports mangled names), and the API calls Kineto leaves out dropped
(`keep_api`): its runtime blocklist (cudaGetDevice, cudaSetDevice, cudaGetLastError,
cudaEventCreate[WithFlags], cudaEventDestroy: tens of thousands per eager step, nothing
launched) and every driver call that issues no work (Kineto keeps only driver launches; we
keep cuLaunch*, cuGraphLaunch*, cuMemcpy*, cuMemset*). `refine` applies the same to a trace
written before these rules (device run of 2026-12-02, bench/cupti_backend.md).

Records are read by attribute, with the names cupti-python exposes (`start`, `end`,
`correlation_id`, `graph_node_id`, `flags_`, `object_id.pt.thread_id`, ...), so plain
objects with those fields work (tests). Activity-kind and flag numbers are CUPTI's C ABI
values; tracer/capture_cupti.py checks them against `cupti.ActivityKind` on the device.
"""
from __future__ import annotations

import ctypes
import functools
import re
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

# CUpti_ActivityKind (C ABI, cupti_activity.h)
KIND_MEMCPY = 1
KIND_MEMSET = 2
KIND_KERNEL = 3
KIND_DRIVER = 4
KIND_RUNTIME = 5
KIND_CONCURRENT_KERNEL = 10
KIND_MARKER = 12
# CUpti_ActivityFlag marker bits
MARKER_INSTANTANEOUS = 1 << 0
MARKER_START = 1 << 1
MARKER_END = 1 << 2

# CUpti_ActivityMemcpyKind / CUpti_ActivityMemoryKind, spelled as Kineto writes them
MEMCPY_KINDS = {0: "Unknown", 1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD",
                7: "DtoA", 8: "DtoD", 9: "HtoH", 10: "PtoP"}
MEMORY_KINDS = {0: "Unknown", 1: "Pageable", 2: "Pinned", 3: "Device", 4: "Array", 5: "Managed",
                6: "Device Static", 7: "Managed Static"}

# Largest relative time (ns) whose µs float repr is exact to the ns (see module doc).
MAX_REL_NS = 1 << 41
_VERSION_SUFFIX = re.compile(r"_v\d+$")

ApiNamer = Callable[[int, int], str]  # (activity kind RUNTIME|DRIVER, cbid) -> function name

# Kineto's isBlockListedRuntimeCbid, by name; driver calls are kept only when they issue work.
RUNTIME_SKIPPED = frozenset({"cudaGetDevice", "cudaSetDevice", "cudaGetLastError", "cudaEventCreate",
                             "cudaEventCreateWithFlags", "cudaEventDestroy"})
DRIVER_KEPT_PREFIXES = ("cuLaunch", "cuGraphLaunch", "cuMemcpy", "cuMemset")


def keep_api(cat: str, name: str) -> bool:
    """Whether Kineto would write this API call (see module doc)."""
    if cat == "cuda_runtime":
        return name not in RUNTIME_SKIPPED
    return name.startswith(DRIVER_KEPT_PREFIXES)


@functools.lru_cache(maxsize=1)
def _cxa() -> tuple[Any, Any] | None:
    try:
        lib = ctypes.CDLL("libstdc++.so.6")
        fn = lib.__cxa_demangle
        fn.restype = ctypes.c_void_p
        fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        free = ctypes.CDLL(None).free
        free.argtypes = [ctypes.c_void_p]
        return fn, free
    except (OSError, AttributeError):
        return None


@functools.lru_cache(maxsize=65536)
def demangle(name: str) -> str:
    """Itanium-ABI demangled name, as Kineto writes kernel names; the name itself when it is
    not mangled, or cannot be demangled here (no libstdc++)."""
    cxa = _cxa() if name.startswith("_Z") else None
    if cxa is None:
        return name
    fn, free = cxa
    status = ctypes.c_int()
    ptr = fn(name.encode(), None, None, ctypes.byref(status))
    if status.value != 0 or not ptr:
        return name
    try:
        return ctypes.string_at(ptr).decode("utf-8", "replace")
    finally:
        free(ptr)


def kineto_names(events: list[dict[str, Any]], stats: Counter[str] | None = None) -> list[dict[str, Any]]:
    """Kernel names demangled, API calls Kineto omits dropped (counted as `api_skipped`)."""
    out = []
    for e in events:
        cat = e.get("cat")
        if cat in ("cuda_runtime", "cuda_driver") and not keep_api(cat, e["name"]):
            if stats is not None:
                stats["api_skipped"] += 1
            continue
        if cat == "kernel":
            e["name"] = demangle(e["name"])
        out.append(e)
    return out


def refine(trace: dict[str, Any]) -> dict[str, int]:
    """Apply `kineto_names` to an already written CUPTI-backend trace (and its capture map)."""
    stats: Counter[str] = Counter()
    trace["traceEvents"] = kineto_names(trace["traceEvents"], stats)
    for m in (trace.get("decodescope") or {}).get("graph_capture_map") or []:
        m["kernel_name"] = demangle(m["kernel_name"])
    return dict(stats)


def api_display_name(raw: str) -> str:
    """`cudaLaunchKernel_v7000` -> `cudaLaunchKernel` (Kineto's spelling of API calls)."""
    return _VERSION_SUFFIX.sub("", raw)


def _us(rel_ns: int) -> float:
    """ns relative to the base -> µs float whose JSON text is exactly `{us}.{ns:03}`."""
    if not 0 <= rel_ns < MAX_REL_NS:
        raise ValueError(f"relative time {rel_ns} ns outside [0, 2^41): base chosen wrongly")
    v = rel_ns / 1000
    if round(float(repr(v)) * 1000) != rel_ns:  # cannot happen below 2^41; a cheap guard
        raise ValueError(f"{rel_ns} ns does not round-trip as µs")
    return v


def _thread(rec: Any) -> tuple[int | None, int | None]:
    """(process, thread) of a marker record (`object_id.pt`), None where absent."""
    pt = getattr(getattr(rec, "object_id", None), "pt", None)
    return getattr(pt, "process_id", None), getattr(pt, "thread_id", None)


def _x(cat: str, name: str, pid: Any, tid: Any, start: int, end: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "_start": int(start),
            "_dur": int(end) - int(start), "args": args}


def _kernel(r: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "device": r.device_id, "context": r.context_id, "stream": r.stream_id,
        "correlation": r.correlation_id,
        "registers per thread": r.registers_per_thread,
        "shared memory": int(r.static_shared_memory) + int(r.dynamic_shared_memory),
        "grid": [r.grid_x, r.grid_y, r.grid_z], "block": [r.block_x, r.block_y, r.block_z],
    }
    if getattr(r, "graph_id", 0):  # 0: not launched from a graph
        args["graph id"] = r.graph_id
        args["graph node id"] = r.graph_node_id
    return _x("kernel", str(r.name), r.device_id, r.stream_id, r.start, r.end, args)


def _memop(r: Any, kind: int) -> dict[str, Any]:
    args: dict[str, Any] = {"device": r.device_id, "context": r.context_id, "stream": r.stream_id,
                            "correlation": r.correlation_id, "bytes": r.bytes}
    if getattr(r, "graph_id", 0):
        args["graph id"] = r.graph_id
        args["graph node id"] = r.graph_node_id
    if kind == KIND_MEMCPY:
        name = (f"Memcpy {MEMCPY_KINDS.get(r.copy_kind, 'Unknown')} "
                f"({MEMORY_KINDS.get(r.src_kind, 'Unknown')} -> {MEMORY_KINDS.get(r.dst_kind, 'Unknown')})")
        return _x("gpu_memcpy", name, r.device_id, r.stream_id, r.start, r.end, args)
    args["value"] = getattr(r, "value", None)
    name = f"Memset ({MEMORY_KINDS.get(getattr(r, 'memory_kind', 0), 'Unknown')})"
    return _x("gpu_memset", name, r.device_id, r.stream_id, r.start, r.end, args)


def to_kineto(records: Iterable[Any], api_name: ApiNamer) -> tuple[dict[str, Any], dict[str, int]]:
    """Kineto-format trace dict (no `decodescope` object yet) and counts of what was converted.

    Counts: one key per written category, plus `markers_unpaired` (a START without END or
    the reverse: a range still open when the window closed), `markers_instant` (NVTX marks,
    not ranges; skipped), `skipped_kinds` (records of kinds not listed above), `no_time`
    (records CUPTI could not time: start 0 or end before start; dropped, not guessed) and
    `api_skipped` (API calls Kineto does not write, see `keep_api`).
    """
    events: list[dict[str, Any]] = []
    opened: dict[int, Any] = {}
    stats: Counter[str] = Counter()
    for r in records:
        kind = int(r.kind)
        if kind in (KIND_CONCURRENT_KERNEL, KIND_KERNEL):
            events.append(_kernel(r))
        elif kind in (KIND_MEMCPY, KIND_MEMSET):
            events.append(_memop(r, kind))
        elif kind in (KIND_RUNTIME, KIND_DRIVER):
            cat = "cuda_runtime" if kind == KIND_RUNTIME else "cuda_driver"
            events.append(_x(cat, api_display_name(api_name(kind, r.cbid)), r.process_id, r.thread_id,
                             r.start, r.end, {"cbid": r.cbid, "correlation": r.correlation_id}))
        elif kind == KIND_MARKER:
            flags = int(getattr(r, "flags_", 0))
            if flags & MARKER_START:
                opened[r.id] = r
            elif flags & MARKER_END:
                s = opened.pop(r.id, None)
                if s is None:
                    stats["markers_unpaired"] += 1
                    continue
                pid, tid = _thread(s)
                args = {"domain": getattr(s, "domain", None) or ""}
                events.append(_x("user_annotation", str(s.name), pid, tid, s.timestamp, r.timestamp, args))
            else:
                stats["markers_instant"] += 1
        else:
            stats["skipped_kinds"] += 1
    stats["markers_unpaired"] += len(opened)
    good = [e for e in events if e["_start"] > 0 and e["_dur"] >= 0]  # CUPTI writes 0 when it has no time
    stats["no_time"] += len(events) - len(good)
    events = kineto_names(good, stats)
    base = min((e["_start"] for e in events), default=0)
    events.sort(key=lambda e: (e["_start"], -e["_dur"]))  # outer range before inner at equal start
    for e in events:
        stats[e["cat"]] += 1
        e["ts"] = _us(e.pop("_start") - base)
        e["dur"] = _us(e.pop("_dur"))
    trace = {"schemaVersion": 1, "displayTimeUnit": "ms", "baseTimeNanoseconds": base,
             "traceName": "decodescope cupti", "traceEvents": events}
    return trace, dict(stats)
