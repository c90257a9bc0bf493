"""CUPTI capture backend: the same decode-step capture as tracer/capture.py, but the trace
comes straight from CUPTI's activity API (cupti-python) instead of the PyTorch profiler.

Why: the PyTorch profiler also records every CPU op and runs Kineto's post-processing; this
backend only asks CUPTI for concurrent kernels (with graph and graph-node ids),
memcpy/memset, runtime and driver calls and NVTX ranges, then writes the same Kineto-format
JSON (tracer/cupti_convert.py) with the same `decodescope` object, plus `backend: "cupti"`.

NVTX: CUPTI sees NVTX ranges (activity kind MARKER) only when NVTX is injected into
libcupti, i.e. NVTX_INJECTION64_PATH names libcupti before the process's FIRST NVTX call
(kimi_decode/ranges.py opens every step/layer/op range as NVTX too). `capture_cupti` sets
it when unset; a process that already emitted NVTX ranges without it gets no user
annotations (reported in the metadata notes, never silently).

`import cupti` happens only inside these functions: the module imports on CPU machines.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tracer.cupti_convert import (KIND_CONCURRENT_KERNEL, KIND_DRIVER, KIND_MARKER, KIND_MEMCPY,
                                  KIND_MEMSET, KIND_RUNTIME, MARKER_START, keep_api, to_kineto)
from tracer.errors import BadInput

BACKEND_ARG = "--backend cupti"
KINDS = (KIND_CONCURRENT_KERNEL, KIND_MEMCPY, KIND_MEMSET, KIND_RUNTIME, KIND_DRIVER, KIND_MARKER)
# Fields copied out of each record inside the buffer callback (the records view CUPTI's
# buffer, which is reused once the callback returns).
_COMMON = ("kind", "start", "end", "correlation_id", "device_id", "context_id", "stream_id")
FIELDS: dict[int, tuple[str, ...]] = {
    KIND_CONCURRENT_KERNEL: _COMMON + ("name", "grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z",
                                       "registers_per_thread", "static_shared_memory",
                                       "dynamic_shared_memory", "graph_id", "graph_node_id"),
    KIND_MEMCPY: _COMMON + ("bytes", "copy_kind", "src_kind", "dst_kind", "graph_id", "graph_node_id"),
    KIND_MEMSET: _COMMON + ("bytes", "value", "memory_kind", "graph_id", "graph_node_id"),
    KIND_RUNTIME: ("kind", "start", "end", "correlation_id", "cbid", "process_id", "thread_id"),
    KIND_DRIVER: ("kind", "start", "end", "correlation_id", "cbid", "process_id", "thread_id"),
    KIND_MARKER: ("kind", "flags_", "timestamp", "id", "name", "domain"),
}

_state: dict[str, Any] = {"records": [], "registered": False, "cupti": None, "api_off": None}
_CBID_SUFFIX = re.compile(r"(_ptsz|_ptds)?(_v\d+)?$")
_CBID_NOT_CALLS = ("INVALID", "SIZE", "FORCE_INT")


def load_cupti() -> Any:
    """The `cupti.cupti` module, its enum values checked against the converter's constants."""
    if _state["cupti"] is not None:
        return _state["cupti"]
    try:
        from cupti import cupti
    except Exception as exc:  # ImportError, or a libcupti that does not load
        raise BadInput(BACKEND_ARG, f"cupti-python is not usable here ({type(exc).__name__}: {exc}); "
                                    "pip install cupti-python matching the CUDA driver") from None
    want = {"CONCURRENT_KERNEL": KIND_CONCURRENT_KERNEL, "MEMCPY": KIND_MEMCPY, "MEMSET": KIND_MEMSET,
            "RUNTIME": KIND_RUNTIME, "DRIVER": KIND_DRIVER, "MARKER": KIND_MARKER}
    bad = {k: int(getattr(cupti.ActivityKind, k)) for k, v in want.items() if int(getattr(cupti.ActivityKind, k)) != v}
    # (cupti-python's ActivityFlag has no MARKER_END member: its value 1<<2 is aliased by the enum)
    if int(cupti.ActivityFlag.MARKER_START) != MARKER_START:
        bad["MARKER_START"] = int(cupti.ActivityFlag.MARKER_START)
    if bad:
        raise BadInput(BACKEND_ARG, f"cupti-python enum values differ from tracer/cupti_convert.py: {bad}")
    _state["cupti"] = cupti
    return cupti


def loaded_libcupti() -> list[str]:
    """Paths of the libcupti copies this process has mapped (NVTX must go to the one in use;
    more than one copy means torch's and cupti-python's differ, which the metadata reports)."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                path = line.split()[-1]
                if "libcupti.so" in path and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


def versions() -> dict[str, str | None]:
    """cupti-python and the libcupti package versions (for the trace's metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for pkg in ("cupti-python", "nvidia-cuda-cupti"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def route_nvtx_to_cupti(cupti: Any) -> str | None:
    """Set NVTX_INJECTION64_PATH to the loaded libcupti unless set; the path used, if any."""
    if os.environ.get("NVTX_INJECTION64_PATH"):
        return os.environ["NVTX_INJECTION64_PATH"]
    cupti.get_timestamp()  # the first call loads libcupti
    paths = loaded_libcupti()
    if paths:
        os.environ["NVTX_INJECTION64_PATH"] = paths[-1]  # the last mapped: cupti-python's own
    return paths[-1] if paths else None


def snapshot(rec: Any) -> SimpleNamespace:
    """A plain copy of one activity record's fields the converter reads."""
    kind = int(rec.kind)
    out = SimpleNamespace(**{f: getattr(rec, f, None) for f in FIELDS.get(kind, ("kind",))})
    out.kind = kind
    if kind == KIND_MARKER:
        pt = rec.object_id.pt
        out.object_id = SimpleNamespace(pt=SimpleNamespace(process_id=pt.process_id, thread_id=pt.thread_id))
    return out


def _requested() -> tuple[int, int]:
    return 8 << 20, 0


def _completed(activities: list) -> None:
    _state["records"].extend(snapshot(a) for a in activities)


def start(cupti: Any) -> None:
    """Register the buffer callbacks (once per process) and enable the activity kinds."""
    if not _state["registered"]:
        cupti.activity_register_callbacks(_requested, _completed)
        _state["registered"] = True
    _state["records"] = []
    for k in KINDS:
        cupti.activity_enable(cupti.ActivityKind(k))
    _state["api_off"] = silence_unkept_apis(cupti)


def api_call_name(member: str) -> str:
    """A callback-id enum member (`cudaLaunchKernel_ptsz_v7000`) -> the API name
    (`cudaLaunchKernel`), as `keep_api` and Kineto spell it."""
    return _CBID_SUFFIX.sub("", member)


def unkept_cbids(enum_cls: Any, cat: str) -> list[int]:
    """Ids of the calls in `enum_cls` (a CUPTI callback-id enum) that the converter would drop
    (`keep_api`): recording them only to drop them costs a record per call."""
    out: set[int] = set()
    for member in enum_cls:
        name = member.name
        if name.upper() in _CBID_NOT_CALLS or not name.startswith("cu"):
            continue
        if not keep_api(cat, api_call_name(name)):
            out.add(int(member))
    return sorted(out)


def silence_unkept_apis(cupti: Any) -> dict[str, int] | str:
    """Turn off, at the source, the runtime and driver calls the converter drops anyway
    (cudaGetDevice, cuDevicePrimaryCtxGetState, ... : ~9 000 records a step in the first
    device run, bench/cupti_backend.md), so CUPTI never writes them. Counts per domain, or
    the reason it could not (an older CUPTI without per-cbid switches: then they are still
    recorded and dropped by the converter, as before)."""
    done: dict[str, int] = {}
    try:
        for cat, enum_name, fn in (("cuda_runtime", "RuntimeApiTraceCbid", cupti.activity_enable_runtime_api),
                                   ("cuda_driver", "DriverApiTraceCbid", cupti.activity_enable_driver_api)):
            ids = unkept_cbids(getattr(cupti, enum_name), cat)
            refused = 0
            for cbid in ids:
                # an id this libcupti does not know (the enum comes from a newer CUPTI header;
                # the device run of 2026-12-02 15:33 stopped at the first such id with
                # ERROR_INVALID_PARAMETER) is skipped, not fatal
                try:
                    fn(cbid, 0)
                except Exception:
                    refused += 1
            done[cat] = len(ids) - refused
            if refused:
                done[f"{cat}_refused"] = refused
    except Exception as exc:  # no per-cbid switches at all: the converter still drops them
        return f"{type(exc).__name__}: {exc}"
    return done


def stop(cupti: Any) -> list[SimpleNamespace]:
    """Flush every buffer, disable the kinds; the records collected since `start`."""
    cupti.activity_flush_all(1)
    for k in KINDS:
        cupti.activity_disable(cupti.ActivityKind(k))
    records, _state["records"] = _state["records"], []
    return records


def api_namer(cupti: Any):
    """(RUNTIME|DRIVER, cbid) -> the function's name, via cuptiGetCallbackName."""
    domains = {KIND_RUNTIME: cupti.CallbackDomain.RUNTIME_API, KIND_DRIVER: cupti.CallbackDomain.DRIVER_API}
    cache: dict[tuple[int, int], str] = {}

    def name(kind: int, cbid: int) -> str:
        key = (kind, cbid)
        if key not in cache:
            try:
                cache[key] = str(cupti.get_callback_name(domains[kind], cbid))
            except Exception:  # an id this CUPTI cannot name: keep it visible
                cache[key] = f"{'cuda' if kind == KIND_RUNTIME else 'cu'}_cbid_{cbid}"
        return cache[key]

    return name


def profile_cupti(step: Any, n: int, cuda: bool) -> dict[str, Any]:
    """The CUPTI counterpart of tracer.capture.profile_trace: n steps -> Kineto-format trace."""
    import torch

    cupti = load_cupti()
    start(cupti)
    try:
        for _ in range(n):
            step()
        if cuda:
            torch.cuda.synchronize()
    finally:
        records = stop(cupti)
    trace, stats = to_kineto(records, api_namer(cupti))
    notes = []
    if not stats.get("user_annotation"):
        notes.append("no NVTX ranges reached CUPTI: NVTX_INJECTION64_PATH must name libcupti before "
                     "the process's first NVTX call; kernels carry no step/layer/op ranges")
    trace["cupti"] = {"stats": stats, "versions": versions(), "libcupti": loaded_libcupti(),
                      "nvtx_injection": os.environ.get("NVTX_INJECTION64_PATH"), "notes": notes,
                      "api_calls_off_at_source": _state["api_off"]}
    return trace


def require_gpu(device: str | None) -> None:
    """The CUPTI backend traces CUDA work only: a clear one-line error without a GPU."""
    import torch

    if (device or "cuda").startswith("cpu") or not torch.cuda.is_available():
        raise BadInput(BACKEND_ARG, "needs a CUDA GPU (torch sees none here); use the default "
                                    "--backend pytorch on this machine")


def capture_cupti(variant: str, cfg: Any, graph: bool, steps: int, out: Path, warmup: int = 3,
                  device: str | None = None) -> dict[str, Any]:
    """tracer.capture.capture with the CUPTI backend: same flow, same `decodescope` metadata."""
    require_gpu(device)
    cupti = load_cupti()
    nvtx_path = route_nvtx_to_cupti(cupti)
    from tracer.capture import capture

    meta = capture(variant, cfg, graph=graph, steps=steps, out=out, warmup=warmup, device=device,
                   profiler=profile_cupti, backend="cupti")
    meta["nvtx_injection"] = nvtx_path
    return meta
