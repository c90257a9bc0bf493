"""Write tiny Kineto (PyTorch profiler) Chrome-trace JSON files for hand-made test traces.

Tests give every time as integer nanoseconds; the builder writes them the way Kineto does, as
microseconds with exactly three decimals (`"ts": 1234.567`), relative to `baseTimeNanoseconds`
when a base is set. So a test's expected answer is derived from the same integers it wrote, and
an ingest that rounds through DOUBLE or truncates to µs shows up as a mismatch.

Example:
    b = KinetoTraceBuilder(rank=0, world_size=1)
    b.annotation("L0.mla", 0, 10_000)
    corr = b.runtime("cudaLaunchKernel", 1_000, 500)
    b.kernel("gemm", 2_000, 3_000, stream=7, correlation=corr)
    b.write(tmp_path / "t.json.gz", gz=True, decodescope_meta={"variant": "stock"})
"""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

_US = re.compile(r'"__us__(-?\d+\.\d{3})__"')


def ns_to_us_text(ns: int) -> str:
    """Integer ns as Kineto's µs text with three decimals, exact (no float on the way)."""
    sign = "-" if ns < 0 else ""
    a = abs(int(ns))
    return f"{sign}{a // 1000}.{a % 1000:03d}"


def _us(ns: int) -> str:
    """A placeholder that `to_json` turns into a bare JSON number with three decimals."""
    return f"__us__{ns_to_us_text(ns)}__"


class KinetoTraceBuilder:
    """Accumulates Kineto events (all times in integer ns) and writes one trace file per rank.

    GPU events go to pid=device, tid=stream as Kineto writes them; host events to
    pid=`host_pid` and the given tid. Correlation ids are handed out automatically when not
    given, and each call returns the correlation (or external id) it used so launches can be
    linked to kernels.
    """

    def __init__(self, rank: int | None = 0, world_size: int | None = 1, base_time_ns: int | None = None,
                 device: int = 0, host_pid: int = 1000, end_event: bool = True,
                 device_name: str = "NVIDIA H200") -> None:
        self.rank = rank
        self.world_size = world_size
        self.base_time_ns = base_time_ns
        self.device = device
        self.host_pid = host_pid
        self.end_event = end_event
        self.device_name = device_name
        self.events: list[dict[str, Any]] = []
        self.extra_top: dict[str, Any] = {}
        self._next_corr = 1
        self._next_ext = 1

    # -- helpers --------------------------------------------------------------------------
    def _ts(self, start_ns: int) -> str:
        return _us(start_ns - (self.base_time_ns or 0))

    def _corr(self, correlation: int | None) -> int:
        if correlation is None:
            correlation = self._next_corr
        self._next_corr = max(self._next_corr, correlation + 1)
        return correlation

    def _x(self, cat: str, name: str, start_ns: int, dur_ns: int, pid: Any, tid: Any,
           args: dict[str, Any] | None) -> dict[str, Any]:
        ev: dict[str, Any] = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid,
                              "ts": self._ts(start_ns), "dur": _us(dur_ns)}
        if args is not None:
            ev["args"] = args
        self.events.append(ev)
        return ev

    # -- device events --------------------------------------------------------------------
    def kernel(self, name: str, start_ns: int, dur_ns: int, stream: int = 7, correlation: int | None = None,
               device: int | None = None, grid: tuple[int, int, int] | None = (1, 1, 1),
               block: tuple[int, int, int] | None = (128, 1, 1), registers: int | None = 32,
               shared_mem: int | None = 0, external_id: int | None = None, graph_id: int | None = None,
               cat: str = "kernel", **extra_args: Any) -> int:
        """A GPU kernel; returns its correlation id."""
        corr = self._corr(correlation)
        dev = self.device if device is None else device
        args: dict[str, Any] = {"device": dev, "stream": stream, "correlation": corr}
        if external_id is not None:
            args["External id"] = external_id
        if grid is not None:
            args["grid"] = list(grid)
        if block is not None:
            args["block"] = list(block)
        if registers is not None:
            args["registers per thread"] = registers
        if shared_mem is not None:
            args["shared memory"] = shared_mem
        if graph_id is not None:
            args["graph id"] = graph_id
        args.update(extra_args)
        self._x(cat, name, start_ns, dur_ns, dev, stream, args)
        return corr

    def memcpy(self, start_ns: int, dur_ns: int, stream: int = 7, nbytes: int = 4096,
               correlation: int | None = None, name: str = "Memcpy HtoD (Pageable -> Device)",
               device: int | None = None, cat: str = "gpu_memcpy") -> int:
        """A memcpy on the device; returns its correlation id."""
        corr = self._corr(correlation)
        dev = self.device if device is None else device
        self._x(cat, name, start_ns, dur_ns, dev, stream,
                {"device": dev, "stream": stream, "correlation": corr, "bytes": nbytes})
        return corr

    def memset(self, start_ns: int, dur_ns: int, stream: int = 7, nbytes: int = 4096,
               correlation: int | None = None, name: str = "Memset (Device)",
               device: int | None = None, cat: str = "gpu_memset") -> int:
        """A memset on the device; returns its correlation id."""
        return self.memcpy(start_ns, dur_ns, stream, nbytes, correlation, name, device, cat)

    def gpu_annotation(self, name: str, start_ns: int, dur_ns: int, stream: int = 7,
                       external_id: int | None = None, device: int | None = None) -> int:
        """Kineto's device-side projection of a host annotation; returns its external id."""
        ext = self._ext(external_id)
        dev = self.device if device is None else device
        self._x("gpu_user_annotation", name, start_ns, dur_ns, dev, stream,
                {"device": dev, "stream": stream, "External id": ext})
        return ext

    def sync(self, name: str, start_ns: int, dur_ns: int, stream: int = 7, wait_on_stream: int | None = None,
             correlation: int | None = None, device: int | None = None) -> int:
        """A cuda_sync record (e.g. 'Event Sync', 'Stream Wait Event'); returns its correlation."""
        corr = self._corr(correlation)
        dev = self.device if device is None else device
        args: dict[str, Any] = {"device": dev, "stream": stream, "correlation": corr}
        if wait_on_stream is not None:
            args["wait_on_stream"] = wait_on_stream
        self._x("cuda_sync", name, start_ns, dur_ns, dev, stream, args)
        return corr

    # -- host events ----------------------------------------------------------------------
    def _ext(self, external_id: int | None) -> int:
        if external_id is None:
            external_id = self._next_ext
        self._next_ext = max(self._next_ext, external_id + 1)
        return external_id

    def runtime(self, name: str, start_ns: int, dur_ns: int, correlation: int | None = None, tid: int = 1,
                cat: str = "cuda_runtime", external_id: int | None = None) -> int:
        """A CUDA runtime call on the host (cudaLaunchKernel, cudaGraphLaunch...); returns its correlation."""
        corr = self._corr(correlation)
        args: dict[str, Any] = {"correlation": corr, "cbid": 211}
        if external_id is not None:
            args["External id"] = external_id
        self._x(cat, name, start_ns, dur_ns, self.host_pid, tid, args)
        return corr

    def driver(self, name: str, start_ns: int, dur_ns: int, correlation: int | None = None, tid: int = 1) -> int:
        """A CUDA driver call (cuLaunchKernel...); returns its correlation."""
        return self.runtime(name, start_ns, dur_ns, correlation, tid, cat="cuda_driver")

    def launch(self, kernel_name: str, call_start_ns: int, call_dur_ns: int, kernel_start_ns: int,
               kernel_dur_ns: int, stream: int = 7, tid: int = 1, api: str = "cudaLaunchKernel",
               **kernel_kwargs: Any) -> int:
        """A launch call and the kernel it launched, linked by one correlation id."""
        corr = self.runtime(api, call_start_ns, call_dur_ns, tid=tid)
        self.kernel(kernel_name, kernel_start_ns, kernel_dur_ns, stream=stream, correlation=corr, **kernel_kwargs)
        return corr

    def annotation(self, name: str, start_ns: int, dur_ns: int, tid: int = 1, cat: str = "user_annotation",
                   external_id: int | None = None) -> int:
        """A host range (record_function / NVTX-like user annotation); returns its external id."""
        ext = self._ext(external_id)
        self._x(cat, name, start_ns, dur_ns, self.host_pid, tid, {"External id": ext})
        return ext

    def cpu_op(self, name: str, start_ns: int, dur_ns: int, tid: int = 1) -> int:
        """An aten op on the host; returns its external id."""
        return self.annotation(name, start_ns, dur_ns, tid, cat="cpu_op")

    def raw(self, event: Any) -> None:
        """Append any event verbatim (for odd or malformed inputs)."""
        self.events.append(event)

    # -- output ---------------------------------------------------------------------------
    def to_json(self, decodescope_meta: dict[str, Any] | None = None) -> str:
        """The trace as JSON text, times written as exact µs numbers with three decimals."""
        top: dict[str, Any] = {"schemaVersion": 1,
                               "deviceProperties": [{"id": self.device, "name": self.device_name}]}
        if self.rank is not None:
            top["distributedInfo"] = {"backend": "nccl", "rank": self.rank,
                                      "world_size": self.world_size if self.world_size is not None else 1}
        events = [{"name": "process_name", "ph": "M", "ts": self._ts(self.base_time_ns or 0),
                   "pid": self.host_pid, "tid": 0, "args": {"name": "python"}}]
        events.extend(self.events)
        if self.end_event:
            last = max((self._end_of(e) for e in self.events if isinstance(e, dict)), default=0)
            events.append({"name": "Record Window End", "ph": "i", "s": "g", "pid": "", "tid": "",
                           "ts": self._ts(last)})
        top["traceEvents"] = events
        top["traceName"] = "builder"
        top["displayTimeUnit"] = "ms"
        if self.base_time_ns is not None:
            top["baseTimeNanoseconds"] = self.base_time_ns
        if decodescope_meta is not None:
            top["decodescope"] = decodescope_meta
        top.update(self.extra_top)
        return _US.sub(r"\1", json.dumps(top))

    def _end_of(self, ev: dict[str, Any]) -> int:
        def back(v: Any) -> int:
            if isinstance(v, str) and v.startswith("__us__"):
                whole, frac = v[6:-2].lstrip("-").split(".")
                sign = -1 if v[6] == "-" else 1
                return sign * (int(whole) * 1000 + int(frac))
            return 0
        return back(ev.get("ts")) + max(back(ev.get("dur")), 0) + (self.base_time_ns or 0)

    def write(self, path: str | Path, gz: bool = False, decodescope_meta: dict[str, Any] | None = None) -> Path:
        """Write the trace to `path` (gzip when `gz`); returns the path."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        text = self.to_json(decodescope_meta).encode()
        if gz:
            with gzip.open(p, "wb") as fh:
                fh.write(text)
        else:
            p.write_bytes(text)
        return p
