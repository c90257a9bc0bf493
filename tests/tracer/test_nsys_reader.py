"""The nsys reader on hand-made exports (tests/nsys_builder.py) whose answers follow from the rows written."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.nsys_builder import NsysExportBuilder
from tracer.errors import BadInput
from tracer.ingest import ingest_path
from tracer.store import RUN_TABLES, open_store


def _rows(con, sql: str, *params):
    return con.execute(sql, list(params)).fetchall()


def _ingest(path: Path):
    con = open_store(None)
    (info,) = ingest_path(con, path, progress=False)
    return con, info


def nested_export() -> NsysExportBuilder:
    """pid 10. Thread 11: step [0,100000) > L0.mla [1000,50000) > in_proj [2000,10000),
    o_proj+ar [12000,20000) > ncclAllReduce (domain 1, textId) [13100,13300); L1.kda [50000,90000)
    touches L0.mla's end and is its sibling; tail [95000, open) is cut at the export's last
    timestamp, 100000. Thread 12: prefetch, a start/end range [5000,40000) ended on thread 13,
    encloses copy_w [6000,7000). Launches: in_proj at 3000 -> gemm_a, o_proj+ar at 13000 ->
    nccl kernel, L1.kda at 60000 -> kda_fwd; thread 12 launches copy_w's memcpy at 6500."""
    b = NsysExportBuilder()
    b.domain(1, "NCCL", 0, tid=11)
    b.mark("iteration 0", 0, tid=11)
    b.push_pop("step", 0, 100_000, tid=11)
    b.push_pop("L0.mla", 1_000, 50_000, tid=11)
    b.push_pop("in_proj", 2_000, 10_000, tid=11)
    b.push_pop("o_proj+ar", 12_000, 20_000, tid=11)
    b.push_pop("ncclAllReduce", 13_100, 13_300, tid=11, domain=1, text_id=True)
    b.push_pop("L1.kda", 50_000, 90_000, tid=11)
    b.push_pop("tail", 95_000, None, tid=11)
    b.start_end("prefetch", 5_000, 40_000, tid=12, end_tid=13, text_id=True)
    b.push_pop("copy_w", 6_000, 7_000, tid=12)
    c1 = b.runtime("cudaLaunchKernel_v7000", 3_000, 3_500, tid=11)
    b.kernel("void gemm_a<128>(float*)", 20_000, 25_000, correlation=c1, grid=(4, 2, 1), static_smem=100,
             dynamic_smem=28)
    c2 = b.runtime("cudaLaunchKernel_v7000", 13_000, 13_400, tid=11)
    b.kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 26_000, 30_000,
             stream=9, correlation=c2)
    c3 = b.runtime("cuLaunchKernelEx", 60_000, 60_500, tid=11, event_class=1)
    b.kernel("kda_fwd", 61_000, 70_000, correlation=c3)
    c4 = b.runtime("cudaMemcpyAsync_v3020", 6_500, 6_800, tid=12)
    b.memcpy(8_000, 9_000, bytes_=4096, copy_kind=1, src_kind=1, dst_kind=2, stream=13, correlation=c4)
    b.thread(10, 11, "python")
    return b


def test_nvtx_nesting_rebuilt_per_thread(tmp_path: Path) -> None:
    con, _ = _ingest(nested_export().write(tmp_path / "n.sqlite"))
    got = _rows(con, """SELECT c.tid, c.name, c.start_ns, c.end_ns, c.depth, p.name FROM ranges AS c
                        LEFT JOIN ranges AS p ON p.range_id = c.parent_id ORDER BY c.tid, c.start_ns""")
    assert got == [
        (11, "step", 0, 100_000, 0, None),
        (11, "L0.mla", 1_000, 50_000, 1, "step"),
        (11, "in_proj", 2_000, 10_000, 2, "L0.mla"),
        (11, "o_proj+ar", 12_000, 20_000, 2, "L0.mla"),
        (11, "ncclAllReduce", 13_100, 13_300, 3, "o_proj+ar"),
        (11, "L1.kda", 50_000, 90_000, 1, "step"),
        (11, "tail", 95_000, 100_000, 1, "step"),
        (12, "prefetch", 5_000, 40_000, 0, None),
        (12, "copy_w", 6_000, 7_000, 1, "prefetch"),
    ]
    assert _rows(con, "SELECT DISTINCT kind, rank, pid FROM ranges") == [("nvtx", 0, 10)]
    meta = json.loads(_rows(con, "SELECT metadata FROM runs")[0][0])
    assert meta["ranges_cut"] == 1
    assert meta["nvtx_event_types"] == {"34 NvtxMark": 1, "59 NvtxPushPopRange": 8, "60 NvtxStartEndRange": 1,
                                        "75 NvtxDomainCreate": 1}
    assert meta["nvtx_domains"] == {"1": "NCCL"}
    assert meta["threads"] == {"10/11": "python"}


def test_launch_projects_onto_innermost_range(tmp_path: Path) -> None:
    """Kernel -> its launch call (same pid, correlation) -> innermost range enclosing the call on its thread."""
    con, _ = _ingest(nested_export().write(tmp_path / "n.sqlite"))
    got = _rows(con, """
        SELECT k.name, arg_max(r.name, r.depth) FROM kernels AS k
        JOIN api_calls AS a ON a.rank = k.rank AND a.correlation = k.correlation
        JOIN ranges AS r ON r.rank = a.rank AND r.tid = a.tid AND r.start_ns <= a.start_ns AND r.end_ns >= a.end_ns
        GROUP BY k.name ORDER BY k.name""")
    assert got == [("kda_fwd", "L1.kda"), ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                                           "o_proj+ar"), ("void gemm_a<128>(float*)", "in_proj")]
    assert _rows(con, "SELECT kind, name FROM api_calls ORDER BY start_ns") == [
        ("runtime", "cudaLaunchKernel"), ("runtime", "cudaMemcpyAsync"), ("runtime", "cudaLaunchKernel"),
        ("driver", "cuLaunchKernelEx")]
    assert _rows(con, "SELECT name, category FROM kernels ORDER BY start_ns") == [
        ("void gemm_a<128>(float*)", "compute"),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
        ("kda_fwd", "compute")]
    assert _rows(con, "SELECT grid_x, grid_y, grid_z, block_x, shared_mem_bytes, registers_per_thread FROM kernels"
                      " WHERE name LIKE 'void gemm%'") == [(4, 2, 1, 128, 128, 32)]
    assert _rows(con, "SELECT kind, name, bytes, stream, category FROM memops") == [
        ("memcpy", "Memcpy HtoD (Pinned -> Device)", 4096, 13, "memory")]


def two_process_export(schema: str = "2026") -> NsysExportBuilder:
    """pid 20 drives device 0 (context 1), pid 21 device 1 (context 2); both number their
    correlation ids from 1. pid 21's sync is written with deviceId 0 but context 2, as nsys
    2026.2 does. pid 20 records event 5 on stream 9 (corr 3), waits on it from stream 7
    (corr 4), records it again on stream 11 (corr 5) and waits again (corr 6): the waits are
    on streams 9 and 11."""
    b = NsysExportBuilder(schema=schema, gpus={0: "NVIDIA H200", 1: "NVIDIA H100"})
    for pid, dev, t0 in ((20, 0, 1_000), (21, 1, 1_200)):
        c = b.runtime("cudaLaunchKernel_v7000", t0, t0 + 300, pid=pid, tid=pid + 100)
        assert c == 1
        b.kernel(f"k_dev{dev}", t0 + 1_000, t0 + 2_000, pid=pid, device=dev, correlation=c)
        b.push_pop("fwd", t0 - 500, t0 + 5_000, pid=pid, tid=pid + 100)
    if schema != "subset":
        b.sync(5_000, 5_100, sync_type=3, pid=21, device=0, context=2, stream=15, correlation=2)
        b.event_record(event_id=5, stream=9, pid=20, correlation=3)
        b.sync(6_000, 6_100, sync_type=2, pid=20, stream=7, correlation=4, event_id=5)
        b.event_record(event_id=5, stream=11, pid=20, correlation=5)
        b.sync(7_000, 7_100, sync_type=2, pid=20, stream=7, correlation=6, event_id=5)
        b.sync(8_000, 8_100, sync_type=4, pid=20, correlation=7)
    return b


def test_two_processes_two_devices(tmp_path: Path) -> None:
    con, info = _ingest(two_process_export().write(tmp_path / "two.sqlite"))
    assert info.ranks == 2
    assert _rows(con, "SELECT rank, device, name, correlation FROM kernels ORDER BY rank") == [
        (0, 0, "k_dev0", 1), (1, 1, "k_dev1", 1)]
    assert _rows(con, "SELECT rank, pid, tid, correlation FROM api_calls ORDER BY rank") == [
        (0, 20, 120, 1), (1, 21, 121, 1)]
    assert _rows(con, "SELECT rank, pid, name FROM ranges ORDER BY rank") == [(0, 20, "fwd"), (1, 21, "fwd")]
    assert _rows(con, "SELECT rank, device, stream, name, wait_on_stream FROM gpu_syncs ORDER BY start_ns") == [
        (1, 1, 15, "Stream Sync", None),
        (0, 0, 7, "Stream Wait Event", 9),
        (0, 0, 7, "Stream Wait Event", 11),
        (0, 0, None, "Context Sync", None)]
    gpu, world = _rows(con, "SELECT gpu, world_size FROM runs")[0]
    assert (gpu, world) == ("NVIDIA H100 / NVIDIA H200", 2)
    meta = json.loads(_rows(con, "SELECT metadata FROM runs")[0][0])
    assert meta["syncs_device_from_context"] == 1
    assert [(r["rank"], r["pid"], r["device"], r["gpu"]["name"]) for r in meta["ranks"]] == [
        (0, 20, 0, "NVIDIA H200"), (1, 21, 1, "NVIDIA H100")]


@pytest.mark.parametrize("schema", ["2026", "2022", "subset"])
def test_schema_flavours_read_alike(tmp_path: Path, schema: str) -> None:
    """The same rows written in three export schemas give the same kernels and calls."""
    b = two_process_export(schema)
    con, _ = _ingest(b.write(tmp_path / f"{schema}.sqlite", backtraces=schema == "2022"))
    kernels = _rows(con, "SELECT device, name, start_ns, end_ns, correlation FROM kernels ORDER BY start_ns")
    assert kernels == [(0, "k_dev0", 2_000, 3_000, 1), (1, "k_dev1", 2_200, 3_200, 1)]
    calls = _rows(con, "SELECT name, start_ns, end_ns FROM api_calls ORDER BY start_ns")
    assert calls == [("cudaLaunchKernel", 1_000, 1_300), ("cudaLaunchKernel", 1_200, 1_500)]
    meta = json.loads(_rows(con, "SELECT metadata FROM runs")[0][0])
    assert meta["runtime_rows_skipped"] == ({"67 CUDA backtrace": 2} if schema == "2022" else {})
    if schema == "subset":
        # no globalPid: one rank per device; calls follow their kernel through the correlation id
        # alone (both processes used id 1, so each call matches both kernels: it goes to the lower rank)
        assert _rows(con, "SELECT DISTINCT rank, device FROM kernels ORDER BY rank") == [(0, 0), (1, 1)]


def test_memop_names_follow_kineto(tmp_path: Path) -> None:
    b = NsysExportBuilder()
    b.memcpy(0, 10, bytes_=1, copy_kind=2, src_kind=2, dst_kind=0)
    b.memcpy(20, 30, bytes_=2, copy_kind=8, src_kind=2, dst_kind=2)
    b.memcpy(40, 50, bytes_=3, copy_kind=10, src_kind=2, dst_kind=2)
    b.memset(60, 70, bytes_=4, mem_kind=2)
    b.kernel("k", 80, 90)
    con, _ = _ingest(b.write(tmp_path / "m.sqlite"))
    assert _rows(con, "SELECT memop_id, kind, name, bytes FROM memops ORDER BY memop_id") == [
        (0, "memcpy", "Memcpy DtoH (Device -> Pageable)", 1), (1, "memcpy", "Memcpy DtoD (Device -> Device)", 2),
        (2, "memcpy", "Memcpy PtoP (Device -> Device)", 3), (3, "memset", "Memset (Device)", 4)]


def test_graph_ids_and_graph_mode(tmp_path: Path) -> None:
    b = NsysExportBuilder()
    c = b.runtime("cudaGraphLaunch_v10000", 0, 100)
    b.kernel("a", 200, 300, correlation=c, graph_id=7, graph_node_id=70)
    b.kernel("b", 300, 400, correlation=c, graph_id=7, graph_node_id=71)
    con, _ = _ingest(b.write(tmp_path / "g.sqlite"))
    assert _rows(con, "SELECT name, graph_id, graph_node_id FROM kernels ORDER BY start_ns") == [
        ("a", 7, 70), ("b", 7, 71)]
    assert _rows(con, "SELECT graph_mode FROM runs") == [(True,)]
    assert _rows(con, "SELECT name FROM api_calls") == [("cudaGraphLaunch",)]


def _not_nsys(tmp_path: Path) -> Path:
    import sqlite3
    p = tmp_path / "other.sqlite"
    db = sqlite3.connect(p)
    db.execute("CREATE TABLE foo (a INTEGER)")
    db.commit()
    db.close()
    return p


def _corrupt(tmp_path: Path) -> Path:
    good = nested_export().write(tmp_path / "good.sqlite").read_bytes()
    p = tmp_path / "corrupt.sqlite"
    p.write_bytes(good[:100] + b"\x00\xff" * 2000)
    return p


def _text(tmp_path: Path) -> Path:
    p = tmp_path / "text.sqlite"
    p.write_text("not a database")
    return p


def _nvtx_only(tmp_path: Path) -> Path:
    b = NsysExportBuilder()
    b.push_pop("step", 0, 10)
    b.runtime("cudaGetDeviceCount_v3020", 1, 2)
    return b.write(tmp_path / "nvtx_only.sqlite")


def _backwards_kernel(tmp_path: Path) -> Path:
    b = NsysExportBuilder()
    b.kernel("ok", 0, 10)
    b.kernel("backwards", 30, 20)
    return b.write(tmp_path / "backwards.sqlite")


@pytest.mark.parametrize("make, problem", [
    (_not_nsys, "not an Nsight Systems export"),
    (_backwards_kernel, "ending before they start (1 kernel)"),
    (_nvtx_only, "no CUDA GPU activity in the export"),
    (_corrupt, "corrupt"),
    (_text, "not an SQLite database"),
])
def test_bad_exports_raise_and_leave_store_unchanged(tmp_path: Path, make, problem: str) -> None:
    con = open_store(None)
    path = make(tmp_path)
    with pytest.raises(BadInput) as err:
        ingest_path(con, path, progress=False)
    assert problem in err.value.problem and err.value.path == str(path)
    for table in ("runs", *RUN_TABLES):
        assert _rows(con, f"SELECT count(*) FROM {table}") == [(0,)]


def test_reingest_is_detected(tmp_path: Path) -> None:
    path = nested_export().write(tmp_path / "n.sqlite")
    con = open_store(None)
    (first,) = ingest_path(con, path, progress=False)
    (again,) = ingest_path(con, path, progress=False)
    assert (again.run_id, again.reused, first.reused) == (first.run_id, True, False)
    assert _rows(con, "SELECT count(*) FROM kernels") == [(3,)]


# A random push/pop program on two threads: ("push", thread) or ("pop", thread); every event gets
# the next timestamp, so ranges have positive length and the generator's stack is the truth.
programs = st.lists(st.tuples(st.sampled_from(["push", "pop"]), st.sampled_from([11, 12])), max_size=40)


@settings(max_examples=25)  # each example is a whole ingest (~0.3 s)
@given(programs)
def test_nesting_matches_the_push_pop_stack(program: list[tuple[str, int]]) -> None:
    import tempfile
    b = NsysExportBuilder()
    stacks: dict[int, list[int]] = {11: [], 12: []}
    ranges: list[dict] = []
    t = 0
    for op, tid in program:
        t += 10
        if op == "push":
            parent = stacks[tid][-1] if stacks[tid] else None
            ranges.append({"tid": tid, "name": f"r{len(ranges)}", "start": t, "end": None, "parent": parent,
                           "depth": len(stacks[tid])})
            stacks[tid].append(len(ranges) - 1)
        elif stacks[tid]:
            ranges[stacks[tid].pop()]["end"] = t
    b.kernel("k", 0, t + 10)           # the export's last timestamp: open ranges end here
    for r in ranges:
        b.push_pop(r["name"], r["start"], r["end"], tid=r["tid"])
    with tempfile.TemporaryDirectory() as d:
        con, _ = _ingest(b.write(Path(d) / "p.sqlite"))
    got = {n: (depth, parent, end) for n, depth, parent, end in _rows(
        con, "SELECT c.name, c.depth, p.name, c.end_ns FROM ranges AS c LEFT JOIN ranges AS p ON p.range_id = c.parent_id")}
    want = {r["name"]: (r["depth"], ranges[r["parent"]]["name"] if r["parent"] is not None else None,
                        r["end"] if r["end"] is not None else t + 10) for r in ranges}
    assert got == want
    meta = json.loads(_rows(con, "SELECT metadata FROM runs")[0][0])
    assert meta["ranges_cut"] == sum(r["end"] is None for r in ranges)


def test_driver_table_rows_are_driver_calls(tmp_path: Path) -> None:
    """CUPTI_ACTIVITY_KIND_DRIVER (exported with --trace=cuda,...driver) holds cu* calls."""
    b = NsysExportBuilder()
    c = b.runtime("cuLaunchKernel", 100, 200, driver_table=True)
    b.kernel("k", 300, 400, correlation=c)
    b.runtime("cudaDeviceSynchronize_v3020", 500, 900)
    con, _ = _ingest(b.write(tmp_path / "d.sqlite"))
    assert _rows(con, "SELECT kind, name, correlation FROM api_calls ORDER BY start_ns") == [
        ("driver", "cuLaunchKernel", c), ("runtime", "cudaDeviceSynchronize", c + 1)]
    meta = json.loads(_rows(con, "SELECT metadata FROM runs")[0][0])
    assert meta["kernels_without_launch"] == 0 and meta["rows_read"]["CUPTI_ACTIVITY_KIND_DRIVER"] == 1


def test_stage_write_discard(tmp_path: Path) -> None:
    """stage reads outside any transaction, write inserts inside one, discard leaves no TEMP table."""
    from tracer.ingest import nsys_sqlite
    from tracer.ingest.progress import Progress
    from tracer.store import transaction
    con = open_store(None)
    staged = nsys_sqlite.stage(con, [nested_export().write(tmp_path / "n.sqlite")], Progress(False))
    assert _rows(con, "SELECT count(*) FROM kernels") == [(0,)]
    with transaction(con):
        meta = nsys_sqlite.write(con, staged, 7, Progress(False))
    nsys_sqlite.discard(con)
    assert meta.world_size == 1 and meta.gpu == "NVIDIA H200"
    assert _rows(con, "SELECT run_id, count(*) FROM kernels GROUP BY 1") == [(7, 3)]
    assert _rows(con, "SELECT count(*) FROM duckdb_tables() WHERE table_name LIKE '\\_nsys%' ESCAPE '\\'") == [(0,)]
    with pytest.raises(BadInput):
        nsys_sqlite.stage(con, [_not_nsys(tmp_path)], Progress(False))


def test_one_process_two_gpus_and_a_launcher(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """pid 30 drives devices 0 and 1 from one thread: two ranks. Its launch calls follow their
    kernels (corr 1 -> device 1 -> rank 1, corr 2 -> device 0 -> rank 0), a cudaMalloc with no GPU
    work goes to the process's first rank, and its NVTX range is stored once per rank. pid 40 (a
    launcher) has a range and a call but no GPU work: counted, warned about, not stored."""
    b = NsysExportBuilder(gpus={0: "NVIDIA H200", 1: "NVIDIA H200"})
    b.push_pop("fwd", 0, 10_000, pid=30, tid=31)
    c1 = b.runtime("cudaLaunchKernel_v7000", 100, 200, pid=30, tid=31)
    b.kernel("on_dev1", 1_000, 2_000, pid=30, device=1, correlation=c1)
    c2 = b.runtime("cudaLaunchKernel_v7000", 300, 400, pid=30, tid=31)
    b.kernel("on_dev0", 1_500, 2_500, pid=30, device=0, correlation=c2)
    b.runtime("cudaMalloc_v3020", 500, 600, pid=30, tid=31)
    b.push_pop("launcher", 0, 20_000, pid=40, tid=41)
    b.runtime("cudaGetDeviceCount_v3020", 10, 20, pid=40, tid=41)
    con, info = _ingest(b.write(tmp_path / "one_proc.sqlite"))
    assert info.ranks == 2
    assert _rows(con, "SELECT rank, device, name FROM kernels ORDER BY rank") == [(0, 0, "on_dev0"), (1, 1, "on_dev1")]
    assert _rows(con, "SELECT rank, name, correlation FROM api_calls ORDER BY start_ns") == [
        (1, "cudaLaunchKernel", c1), (0, "cudaLaunchKernel", c2), (0, "cudaMalloc", c2 + 1)]
    assert _rows(con, "SELECT rank, pid, name FROM ranges ORDER BY rank") == [(0, 30, "fwd"), (1, 30, "fwd")]
    meta = json.loads(_rows(con, "SELECT metadata FROM runs")[0][0])
    assert meta["host_rows_without_gpu_process"] == {"api_calls": 1, "nvtx_ranges": 1}
    assert "1 API calls and 1 NVTX ranges belong to processes with no GPU activity" in capfd.readouterr().err



def test_folder_of_exports_is_one_run(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """a_node0.sqlite: pid 100 drives devices 0 and 1 (ranks 0, 1); b_node1.sqlite: pid 100 again
    (another host) on device 0 (rank 2), with the same correlation and thread ids. Each export
    also has a kernel whose launch (correlation 99) is not in it. Rows must not cross between
    exports, ids run 0..n-1 over the run in (rank, start) order, range parents stay in their
    export, and the cut-window counts and warnings add up per export."""
    folder = tmp_path / "job"
    folder.mkdir()
    for fname, devices in (("a_node0.sqlite", (0, 1)), ("b_node1.sqlite", (0,))):
        b = NsysExportBuilder(gpus={0: "NVIDIA H200", 1: "NVIDIA H200"})
        b.push_pop("step", 0, 100_000, pid=100, tid=101)
        b.push_pop("L0.mla", 10, 90_000, pid=100, tid=101)
        for dev in devices:
            c = b.runtime("cudaLaunchKernel_v7000", 100 + dev, 200 + dev, pid=100, tid=101)
            b.kernel(f"{fname[0]}_dev{dev}", 1_000 + dev, 2_000 + dev, pid=100, device=dev, correlation=c)
        b.kernel(f"{fname[0]}_orphan", 50_000, 60_000, pid=100, device=0, correlation=99)
        b.write(folder / fname)
    con, info = _ingest(folder)
    assert (info.ranks, info.kernels) == (3, 5)
    assert _rows(con, "SELECT kernel_id, rank, device, name, correlation FROM kernels ORDER BY kernel_id") == [
        (0, 0, 0, "a_dev0", 1), (1, 0, 0, "a_orphan", 99), (2, 1, 1, "a_dev1", 2),
        (3, 2, 0, "b_dev0", 1), (4, 2, 0, "b_orphan", 99)]
    assert _rows(con, "SELECT call_id, rank, correlation FROM api_calls ORDER BY call_id") == [
        (0, 0, 1), (1, 1, 2), (2, 2, 1)]
    ranges = _rows(con, "SELECT range_id, rank, name, depth, parent_id FROM ranges ORDER BY range_id")
    assert ranges == [(0, 0, "step", 0, None), (1, 0, "L0.mla", 1, 0), (2, 1, "step", 0, None),
                      (3, 1, "L0.mla", 1, 2), (4, 2, "step", 0, None), (5, 2, "L0.mla", 1, 4)]
    meta = json.loads(_rows(con, "SELECT metadata FROM runs")[0][0])
    assert [(r["rank"], r["file"], r["device"]) for r in meta["ranks"]] == [
        (0, "a_node0.sqlite", 0), (1, "a_node0.sqlite", 1), (2, "b_node1.sqlite", 0)]
    assert meta["kernels_without_launch"] == 2 and meta["kernels_without_launch_by_rank"] == {"0": 1, "2": 1}
    assert [f["file"] for f in meta["files"]] == ["a_node0.sqlite", "b_node1.sqlite"]
    err = capfd.readouterr().err
    assert "a_node0.sqlite: 1 of 3 kernels have no launch call" in err
    assert "b_node1.sqlite: 1 of 2 kernels have no launch call" in err
    assert _rows(con, "SELECT world_size FROM runs") == [(3,)]
