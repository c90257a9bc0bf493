"""CUPTI backend on the CPU: activity records (plain objects with cupti-python's field names)
-> Kineto JSON -> the store's Kineto reader. The oracle is the hand-made record list itself:
every kernel / memop / API call / NVTX range must come back with its exact absolute ns,
correlation, stream and graph ids, and the NVTX ranges as nested user annotations that the
attribution puts kernels under. Also: no `cupti` import at module import, and the CLI says
in one line (exit 2) that `--backend cupti` needs a GPU.
"""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace as NS

from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from cli.exit_codes import BAD_INPUT
from cli.main import main
from tracer.cupti_convert import (KIND_CONCURRENT_KERNEL, KIND_DRIVER, KIND_MARKER, KIND_MEMCPY, KIND_MEMSET,
                                  KIND_RUNTIME, MARKER_END, MARKER_INSTANTANEOUS, MARKER_START, MAX_REL_NS, _us,
                                  demangle, refine, to_kineto)
from tracer.ingest import ingest_path
from tracer.store import open_store

T0 = 1_764_680_000_123_456_789  # absolute CUPTI ns (epoch-scale: µs floats would lose ns here)
PID, TID = 4242, 139_900_000_777
API = {(KIND_RUNTIME, 211): "cudaLaunchKernel_v7000", (KIND_RUNTIME, 311): "cudaGraphLaunch_v10000",
       (KIND_RUNTIME, 41): "cudaMemcpyAsync_v3020", (KIND_RUNTIME, 51): "cudaMemsetAsync_v3020",
       (KIND_DRIVER, 307): "cuLaunchKernel",
       # Kineto writes neither of these (see tracer.cupti_convert.keep_api): dropped
       (KIND_RUNTIME, 17): "cudaGetDevice_v3020", (KIND_DRIVER, 990): "cuKernelGetName"}
GEMM = "_ZN2at6native6kernelIfEEvPT_i"         # what CUPTI reports ...
GEMM_KINETO = "void at::native::kernel<float>(float*, int)"  # ... and what Kineto writes (Itanium ABI)


def _kernel(name, start, end, corr, stream, graph_id=0, node=0):
    return NS(kind=KIND_CONCURRENT_KERNEL, name=name, start=T0 + start, end=T0 + end, correlation_id=corr,
              device_id=0, context_id=1, stream_id=stream, grid_x=132, grid_y=1, grid_z=1, block_x=256,
              block_y=1, block_z=1, registers_per_thread=64, static_shared_memory=1024,
              dynamic_shared_memory=2048, graph_id=graph_id, graph_node_id=node)


def _api(kind, cbid, start, end, corr):
    return NS(kind=kind, cbid=cbid, start=T0 + start, end=T0 + end, correlation_id=corr, process_id=PID,
              thread_id=TID)


def _marker(flags, ts, mid, name=None):
    return NS(kind=KIND_MARKER, flags_=flags, timestamp=T0 + ts, id=mid, name=name, domain=None,
              object_kind=2, object_id=NS(pt=NS(process_id=PID, thread_id=TID)))


def records() -> list[NS]:
    """One eager step: step > L4.kda > in_proj with a runtime launch, a Triton driver launch,
    a memcpy and a memset, then a graph replay of two kernels inside a second `step` range.
    Odd ns everywhere; records arrive out of time order, as CUPTI buffers deliver them."""
    return [
        _kernel(GEMM, 1_501, 9_999, 1, 7),
        _kernel("triton_b", 10_003, 12_347, 2, 7),
        _kernel("graph_k0", 40_101, 45_003, 5, 13, graph_id=9, node=101),
        _kernel("graph_k1", 45_007, 50_011, 5, 14, graph_id=9, node=102),
        NS(kind=KIND_MEMCPY, start=T0 + 13_001, end=T0 + 13_999, correlation_id=3, device_id=0, context_id=1,
           stream_id=7, bytes=4096, copy_kind=1, src_kind=2, dst_kind=3, graph_id=0, graph_node_id=0),
        NS(kind=KIND_MEMSET, start=T0 + 14_001, end=T0 + 14_333, correlation_id=4, device_id=0, context_id=1,
           stream_id=7, bytes=512, value=0, memory_kind=3, graph_id=0, graph_node_id=0),
        _api(KIND_RUNTIME, 211, 1_001, 1_401, 1),
        _api(KIND_DRIVER, 307, 1_601, 1_901, 2),
        _api(KIND_RUNTIME, 41, 2_001, 2_201, 3),
        _api(KIND_RUNTIME, 51, 2_301, 2_501, 4),
        _api(KIND_RUNTIME, 311, 30_001, 30_501, 5),
        _api(KIND_RUNTIME, 17, 901, 911, 6), _api(KIND_DRIVER, 990, 1_411, 1_431, 7),
        _marker(MARKER_START, 11, 1, "step"), _marker(MARKER_START, 13, 2, "L4.kda"),
        _marker(MARKER_START, 17, 3, "in_proj"), _marker(MARKER_END, 2_601, 3),
        _marker(MARKER_END, 2_701, 2), _marker(MARKER_END, 2_801, 1),
        _marker(MARKER_START, 29_999, 4, "step"), _marker(MARKER_END, 30_777, 4),
        _marker(MARKER_INSTANTANEOUS, 500, 5, "a mark"),
        _marker(MARKER_START, 60_000, 6, "never closed"),
        _kernel("untimed", -T0, -T0, 6, 7),  # start = end = 0: CUPTI could not time it
        NS(kind=99),
    ]


def _write(tmp_path: Path) -> tuple[Path, dict]:
    trace, stats = to_kineto(records(), lambda kind, cbid: API[(kind, cbid)])
    trace["decodescope"] = {"model": "kimi-k3", "variant": "stock", "backend": "cupti", "graph_mode": False,
                            "graph_capture_map": []}
    path = tmp_path / "cupti.json.gz"
    path.write_bytes(gzip.compress(json.dumps(trace).encode()))
    return path, stats


def test_conversion_counts_and_skips(tmp_path):
    _, stats = _write(tmp_path)
    assert stats["kernel"] == 4 and stats["gpu_memcpy"] == 1 and stats["gpu_memset"] == 1
    assert stats["cuda_runtime"] == 4 and stats["cuda_driver"] == 1 and stats["user_annotation"] == 4
    assert stats["markers_unpaired"] == 1 and stats["markers_instant"] == 1
    assert stats["no_time"] == 1 and stats["skipped_kinds"] == 1 and stats["api_skipped"] == 2


def test_ingest_exact_ns_ids_and_names(tmp_path):
    path, _ = _write(tmp_path)
    con = open_store(None)
    (info,) = ingest_path(con, path, progress=False)
    rid = info.run_id
    recs = records()
    want_k = sorted((GEMM_KINETO if r.name == GEMM else r.name, r.start, r.end, r.correlation_id, r.stream_id, r.graph_id or None, r.graph_node_id or None)
                    for r in recs if r.kind == KIND_CONCURRENT_KERNEL and r.start)
    got_k = sorted(con.execute("SELECT name, start_ns, end_ns, correlation, stream, graph_id, graph_node_id "
                               "FROM kernels WHERE run_id = ?", [rid]).fetchall())
    assert got_k == want_k
    want_m = sorted((r.start, r.end, r.bytes, r.correlation_id) for r in recs if r.kind in (KIND_MEMCPY, KIND_MEMSET))
    assert sorted(con.execute("SELECT start_ns, end_ns, bytes, correlation FROM memops WHERE run_id = ?",
                              [rid]).fetchall()) == want_m
    want_a = sorted((API[(r.kind, r.cbid)].split("_v")[0], "runtime" if r.kind == KIND_RUNTIME else "driver",
                     r.start, r.end, r.correlation_id, PID, TID) for r in recs
                    if r.kind in (KIND_RUNTIME, KIND_DRIVER) and r.cbid not in (17, 990))
    assert sorted(con.execute("SELECT name, kind, start_ns, end_ns, correlation, pid, tid FROM api_calls "
                              "WHERE run_id = ?", [rid]).fetchall()) == want_a


def test_nvtx_ranges_become_nested_user_annotations(tmp_path):
    path, _ = _write(tmp_path)
    con = open_store(None)
    (info,) = ingest_path(con, path, progress=False)
    got = con.execute("SELECT name, kind, start_ns, end_ns, depth, pid, tid FROM ranges WHERE run_id = ? "
                      "ORDER BY start_ns", [info.run_id]).fetchall()
    assert got == [("step", "user_annotation", T0 + 11, T0 + 2_801, 0, PID, TID),
                   ("L4.kda", "user_annotation", T0 + 13, T0 + 2_701, 1, PID, TID),
                   ("in_proj", "user_annotation", T0 + 17, T0 + 2_601, 2, PID, TID),
                   ("step", "user_annotation", T0 + 29_999, T0 + 30_777, 0, PID, TID)]


def test_attribution_puts_launched_kernels_under_their_ranges(tmp_path):
    """The two eager kernels were launched inside step > L4.kda > in_proj: the attribution
    (which knows nothing of CUPTI) must say so; the replayed ones have no layer (no map)."""
    from analyzers.attribution import attribute

    path, _ = _write(tmp_path)
    con = open_store(None)
    (info,) = ingest_path(con, path, progress=False)
    attribute(con, [info.run_id])
    rows = dict(con.execute("SELECT k.name, a.layer || '/' || coalesce(a.op, '-') FROM kernel_attribution a "
                            "JOIN kernels k ON k.run_id = a.run_id AND k.kernel_id = a.item_id "
                            "WHERE a.item_kind = 'kernel'").fetchall())
    assert rows[GEMM_KINETO] == "L4.kda/in_proj" and rows["triton_b"] == "L4.kda/in_proj"
    assert rows["graph_k0"] is None and rows["graph_k1"] is None


def test_demangle_agrees_with_cxxfilt():
    """Kernel names as Kineto writes them: the Itanium demangling (c++filt, when installed,
    is the independent oracle); unmangled Triton names and broken manglings stay as they are."""
    import shutil

    names = [GEMM, "_Z3fooi", "_ZN3c1011CUDAFunctorIN2at8BFloat16EEclEv", "triton_poi_fused_add_0", "_Znotvalid"]
    got = [demangle(n) for n in names]
    assert got[0] == GEMM_KINETO and got[1] == "foo(int)" and got[3:] == names[3:]
    if shutil.which("c++filt"):
        ref = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
        assert got == ref.stdout.splitlines()


def test_refine_matches_live_conversion():
    """`refine` (for traces written before the naming rules) gives what `to_kineto` gives."""
    live, _ = to_kineto(records(), lambda kind, cbid: API[(kind, cbid)])
    raw, _ = to_kineto(records(), lambda kind, cbid: API[(kind, cbid)])
    raw["traceEvents"] = [dict(e, name=GEMM) if e["name"] == GEMM_KINETO else e for e in raw["traceEvents"]]
    raw["traceEvents"].append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGetDevice", "pid": PID, "tid": TID,
                               "ts": 0.5, "dur": 0.01, "args": {}})
    raw["decodescope"] = {"graph_capture_map": [{"node_order": 0, "kernel_name": GEMM}]}
    assert refine(raw) == {"api_skipped": 1}
    assert raw["traceEvents"] == live["traceEvents"]
    assert raw["decodescope"]["graph_capture_map"][0]["kernel_name"] == GEMM_KINETO


@given(st.integers(min_value=0, max_value=MAX_REL_NS - 1))
def test_us_text_is_exact_ns(n):
    """The JSON text of every relative time is `{us}.{ns:03}`: Decimal(text) * 1000 == n."""
    assert Decimal(json.dumps(_us(n))) * 1000 == n


def test_module_does_not_import_cupti():
    code = "import sys, tracer.capture_cupti, tracer.cupti_convert; print('cupti' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_backend_cupti_without_gpu_is_one_line_exit_2(tmp_path):
    res = CliRunner().invoke(main, ["capture", "--backend", "cupti", "--preset", "tiny", "--device", "cpu",
                                    "--out", str(tmp_path / "t.json.gz")])
    assert res.exit_code == BAD_INPUT
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --backend cupti: needs a CUDA GPU")
    assert not (tmp_path / "t.json.gz").exists()


def test_device_cupti_graph_trace_attributes_through_capture_map():
    """The CUPTI graph trace captured on the H200 (docs/examples/traces): ingested, every
    replayed kernel takes its layer and op from the capture map. Oracle, with plain json:
    each replay (kernels sharing a cudaGraphLaunch correlation) in start order has exactly
    the map's kernel names, so per replay the (layer, op) counts equal the map's."""
    from collections import Counter

    from analyzers.attribution import attribute

    path = Path(__file__).resolve().parents[2] / "docs/examples/traces/k3_stock_b1_k0_graph_cupti.json.gz"
    trace = json.loads(gzip.decompress(path.read_bytes()))
    ds = trace["decodescope"]
    assert ds["backend"] == "cupti" and ds["graph_mode"] and ds["graph_capture_map_matched"]
    cmap = ds["graph_capture_map"]
    ev = trace["traceEvents"]
    graph_corr = {e["args"]["correlation"] for e in ev if e["cat"] == "cuda_runtime" and e["name"] == "cudaGraphLaunch"}
    replays: dict[int, list] = {}
    for e in ev:
        if e["cat"] == "kernel" and e["args"]["correlation"] in graph_corr:
            replays.setdefault(e["args"]["correlation"], []).append(e)
    assert len(replays) == ds["steps"]
    for ks in replays.values():
        assert [k["name"] for k in sorted(ks, key=lambda k: Decimal(str(k["ts"])))] == [m["kernel_name"] for m in cmap]
        assert all("graph node id" in k["args"] for k in ks)
    want = Counter((m["layer"], m["op"]) for m in cmap for _ in range(ds["steps"]))

    con = open_store(None)
    (info,) = ingest_path(con, path, progress=False)
    attribute(con, [info.run_id])
    got = Counter(con.execute("SELECT layer, op FROM kernel_attribution WHERE run_id = ? AND item_kind = 'kernel' "
                              "AND method = 'capture_map'", [info.run_id]).fetchall())
    assert got == want


def test_unkept_cbids_are_exactly_the_calls_the_converter_drops() -> None:
    """The per-cbid switch list (turned off at the source) = the enum members whose API name
    keep_api rejects; launches, graph launches, copies and memsets stay on. Oracle: the
    hand-written expectation per member name."""
    import enum

    from tracer.capture_cupti import api_call_name, silence_unkept_apis, unkept_cbids

    class Runtime(enum.IntEnum):
        INVALID = 0
        cudaGetDevice_v3020 = 1
        cudaLaunchKernel_v7000 = 2
        cudaLaunchKernel_ptsz_v7000 = 3
        cudaGetLastError_v3020 = 4
        cudaEventDestroy_v3020 = 5
        cudaGraphLaunch_v10000 = 6
        cudaStreamSynchronize_v3020 = 7
        SIZE = 8

    class Driver(enum.IntEnum):
        INVALID = 0
        cuDevicePrimaryCtxGetState = 1
        cuLaunchKernel = 2
        cuKernelGetName = 3
        cuMemcpyHtoD_v2 = 4
        cuGraphLaunch_ptsz = 5
        FORCE_INT = 6

    assert api_call_name("cudaLaunchKernel_ptsz_v7000") == "cudaLaunchKernel"
    assert api_call_name("cuMemcpyHtoD_v2") == "cuMemcpyHtoD"
    assert unkept_cbids(Runtime, "cuda_runtime") == [1, 4, 5]
    assert unkept_cbids(Driver, "cuda_driver") == [1, 3]

    calls: list[tuple[str, int, int]] = []
    fake = NS(
        RuntimeApiTraceCbid=Runtime, DriverApiTraceCbid=Driver,
        activity_enable_runtime_api=lambda cbid, on: calls.append(("rt", cbid, on)),
        activity_enable_driver_api=lambda cbid, on: calls.append(("drv", cbid, on)))
    assert silence_unkept_apis(fake) == {"cuda_runtime": 3, "cuda_driver": 2}
    assert calls == [("rt", 1, 0), ("rt", 4, 0), ("rt", 5, 0), ("drv", 1, 0), ("drv", 3, 0)]
    # an older cupti without the switches: a reason, not an exception
    assert "AttributeError" in silence_unkept_apis(NS(RuntimeApiTraceCbid=Runtime))

    # an id the loaded libcupti refuses is skipped and counted, the others still switched off
    def picky(cbid: int, on: int) -> None:
        if cbid == 4:
            raise RuntimeError("cuptiError: ERROR_INVALID_PARAMETER (1)")
        calls.append(("rt2", cbid, on))
    calls.clear()
    fake2 = NS(RuntimeApiTraceCbid=Runtime, DriverApiTraceCbid=Driver, activity_enable_runtime_api=picky,
               activity_enable_driver_api=lambda cbid, on: None)
    assert silence_unkept_apis(fake2) == {"cuda_runtime": 2, "cuda_runtime_refused": 1, "cuda_driver": 2}
    assert calls == [("rt2", 1, 0), ("rt2", 5, 0)]
