"""Write tiny Nsight Systems SQLite exports for hand-made test traces.

Only the tables and columns the reader looks at, in the shapes real exports have them: names
are ids into StringIds, globalPid/globalTid pack pid and tid (pid << 24 | tid, plus the
hardware-id bits real exports carry), times are integer ns. Three schema flavours:

- "2026": nsys 2026.2 / export schema 3.25 (graphId, deprecatedSyncType + syncType,
  META_DATA_EXPORT, ENUM tables);
- "2022": nsys 2022.2 / schema 2.9 (no graphId, a `name` column in RUNTIME, EXPORT_META_DATA,
  "CUDA backtrace" duplicates of runtime calls with eventClass 67, no ENUM tables);
- "subset": a hand-written subset like nsys-ai's synthetic fixture (no globalPid or contextId
  in the GPU tables, no NVTX or sync tables).

Example:
    b = NsysExportBuilder()
    b.push_pop("L0.mla", 0, 10_000, pid=10, tid=11)
    corr = b.runtime("cudaLaunchKernel_v7000", 1_000, 1_500, pid=10, tid=11)
    b.kernel("gemm", 2_000, 3_000, pid=10, correlation=corr)
    b.write(tmp_path / "t.sqlite")
"""
from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

HW_BITS = 1 << 48  # the vm/hw id bits above the pid in real globalTid values


def global_pid(pid: int) -> int:
    return HW_BITS | (pid << 24)


def global_tid(pid: int, tid: int) -> int:
    return HW_BITS | (pid << 24) | tid


_KERNEL_COLS = {
    "2026": ["start", "end", "deviceId", "contextId", "greenContextId", "streamId", "correlationId", "globalPid",
             "demangledName", "shortName", "mangledName", "gridX", "gridY", "gridZ", "blockX", "blockY", "blockZ",
             "registersPerThread", "staticSharedMemory", "dynamicSharedMemory", "graphNodeId", "graphId"],
    "2022": ["start", "end", "deviceId", "contextId", "streamId", "correlationId", "globalPid", "demangledName",
             "shortName", "mangledName", "gridX", "gridY", "gridZ", "blockX", "blockY", "blockZ",
             "registersPerThread", "staticSharedMemory", "dynamicSharedMemory", "graphNodeId"],
    "subset": ["start", "end", "deviceId", "streamId", "correlationId", "shortName", "demangledName",
               "gridX", "gridY", "gridZ", "blockX", "blockY", "blockZ"],
}


class NsysExportBuilder:
    """Accumulates nsys rows (times in integer ns) and writes one SQLite export."""

    def __init__(self, schema: str = "2026", gpus: dict[int, str] | None = None,
                 version: str = "2026.2.1.210") -> None:
        if schema not in _KERNEL_COLS:
            raise ValueError(f"unknown schema flavour {schema!r}")
        self.schema = schema
        self.gpus = {0: "NVIDIA H200"} if gpus is None else gpus
        self.version = version
        self.strings: dict[str, int] = {}
        self.rows: dict[str, list[dict[str, Any]]] = {}
        self.thread_names: list[tuple[int, int, str]] = []
        self.meta: dict[str, str] = {}
        self._corr: dict[int, int] = {}

    # -- helpers ---------------------------------------------------------------------------
    def sid(self, text: str) -> int:
        """The StringIds id of `text`, added on first use."""
        return self.strings.setdefault(text, len(self.strings) + 1)

    def next_corr(self, pid: int) -> int:
        """A fresh correlation id for process `pid` (ids are per process in CUPTI)."""
        self._corr[pid] = self._corr.get(pid, 0) + 1
        return self._corr[pid]

    def _add(self, table: str, **row: Any) -> None:
        self.rows.setdefault(table, []).append(row)

    # -- GPU activity ----------------------------------------------------------------------
    def kernel(self, name: str, start_ns: int, end_ns: int, *, pid: int = 10, device: int = 0, stream: int = 7,
               context: int | None = None, correlation: int | None = None, graph_id: int | None = None,
               graph_node_id: int | None = None, grid: tuple[int, int, int] = (1, 1, 1),
               block: tuple[int, int, int] = (128, 1, 1), registers: int = 32, static_smem: int = 0,
               dynamic_smem: int = 0, short_name: str | None = None) -> int:
        corr = self.next_corr(pid) if correlation is None else correlation
        self._add("CUPTI_ACTIVITY_KIND_KERNEL", start=start_ns, end=end_ns, deviceId=device,
                  contextId=device + 1 if context is None else context, greenContextId=None, streamId=stream,
                  correlationId=corr, globalPid=global_pid(pid), demangledName=self.sid(name),
                  shortName=self.sid(short_name or name.split("<")[0].split("(")[0].split()[-1]),
                  mangledName=None, gridX=grid[0], gridY=grid[1], gridZ=grid[2], blockX=block[0],
                  blockY=block[1], blockZ=block[2], registersPerThread=registers,
                  staticSharedMemory=static_smem, dynamicSharedMemory=dynamic_smem,
                  graphNodeId=graph_node_id, graphId=graph_id)
        return corr

    def memcpy(self, start_ns: int, end_ns: int, *, bytes_: int, copy_kind: int = 1, src_kind: int = 1,
               dst_kind: int = 2, pid: int = 10, device: int = 0, stream: int = 7, context: int | None = None,
               correlation: int | None = None) -> int:
        corr = self.next_corr(pid) if correlation is None else correlation
        self._add("CUPTI_ACTIVITY_KIND_MEMCPY", start=start_ns, end=end_ns, deviceId=device,
                  contextId=device + 1 if context is None else context, streamId=stream, correlationId=corr,
                  globalPid=global_pid(pid), bytes=bytes_, copyKind=copy_kind, srcKind=src_kind,
                  dstKind=dst_kind, graphNodeId=None)
        return corr

    def memset(self, start_ns: int, end_ns: int, *, bytes_: int, mem_kind: int = 2, pid: int = 10,
               device: int = 0, stream: int = 7, context: int | None = None, correlation: int | None = None) -> int:
        corr = self.next_corr(pid) if correlation is None else correlation
        self._add("CUPTI_ACTIVITY_KIND_MEMSET", start=start_ns, end=end_ns, deviceId=device,
                  contextId=device + 1 if context is None else context, streamId=stream, correlationId=corr,
                  globalPid=global_pid(pid), value=0, bytes=bytes_, graphNodeId=None, memKind=mem_kind)
        return corr

    def sync(self, start_ns: int, end_ns: int, *, sync_type: int, pid: int = 10, device: int = 0,
             stream: int = 0xFFFFFFFF, context: int | None = None, correlation: int | None = None,
             event_id: int = 0xFFFFFFFF) -> int:
        corr = self.next_corr(pid) if correlation is None else correlation
        self._add("CUPTI_ACTIVITY_KIND_SYNCHRONIZATION", start=start_ns, end=end_ns, deviceId=device,
                  contextId=device + 1 if context is None else context, streamId=stream, correlationId=corr,
                  globalPid=global_pid(pid), syncType=sync_type, eventId=event_id)
        return corr

    def event_record(self, *, event_id: int, stream: int, pid: int = 10, device: int = 0,
                     correlation: int | None = None) -> int:
        corr = self.next_corr(pid) if correlation is None else correlation
        self._add("CUPTI_ACTIVITY_KIND_CUDA_EVENT", deviceId=device, contextId=device + 1, streamId=stream,
                  correlationId=corr, globalPid=global_pid(pid), eventId=event_id)
        return corr

    # -- host ------------------------------------------------------------------------------
    def runtime(self, name: str, start_ns: int, end_ns: int, *, pid: int = 10, tid: int = 11,
                correlation: int | None = None, event_class: int = 0, driver_table: bool = False) -> int:
        """A runtime (class 0) or driver (class 1) call; `driver_table` writes it to _DRIVER."""
        corr = self.next_corr(pid) if correlation is None else correlation
        table = "CUPTI_ACTIVITY_KIND_DRIVER" if driver_table else "CUPTI_ACTIVITY_KIND_RUNTIME"
        self._add(table, start=start_ns, end=end_ns, eventClass=event_class, globalTid=global_tid(pid, tid),
                  correlationId=corr, nameId=self.sid(name), returnValue=0)
        return corr

    def push_pop(self, text: str, start_ns: int, end_ns: int | None, *, pid: int = 10, tid: int = 11,
                 domain: int = 0, text_id: bool = False) -> None:
        """An NVTX push/pop range; `end_ns=None` leaves it open (still open when capture stopped)."""
        self._nvtx(59, text, start_ns, end_ns, pid, tid, domain, text_id)

    def start_end(self, text: str, start_ns: int, end_ns: int | None, *, pid: int = 10, tid: int = 11,
                  end_tid: int | None = None, domain: int = 0, text_id: bool = False) -> None:
        self._nvtx(60, text, start_ns, end_ns, pid, tid, domain, text_id, end_tid)

    def mark(self, text: str, ts_ns: int, *, pid: int = 10, tid: int = 11) -> None:
        self._nvtx(34, text, ts_ns, None, pid, tid, 0, False)

    def domain(self, domain_id: int, name: str, ts_ns: int, *, pid: int = 10, tid: int = 11) -> None:
        self._nvtx(75, name, ts_ns, None, pid, tid, domain_id, False)

    def _nvtx(self, event_type: int, text: str, start_ns: int, end_ns: int | None, pid: int, tid: int,
              domain: int, text_id: bool, end_tid: int | None = None) -> None:
        self._add("NVTX_EVENTS", start=start_ns, end=end_ns, eventType=event_type,
                  text=None if text_id else text, textId=self.sid(text) if text_id else None,
                  globalTid=global_tid(pid, tid),
                  endGlobalTid=global_tid(pid, end_tid) if end_tid is not None else None, domainId=domain)

    def thread(self, pid: int, tid: int, name: str) -> None:
        self.thread_names.append((pid, tid, name))

    # -- output ----------------------------------------------------------------------------
    def _columns(self, table: str) -> list[str]:
        if table == "CUPTI_ACTIVITY_KIND_KERNEL":
            return _KERNEL_COLS[self.schema]
        cols = list(self.rows[table][0])
        if self.schema == "subset":
            cols = [c for c in cols if c not in ("globalPid", "contextId", "greenContextId")]
        if table == "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION" and self.schema == "2026":
            cols.insert(cols.index("syncType"), "deprecatedSyncType")
        if table in ("CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_DRIVER") and self.schema == "2022":
            cols.append("name")
        return cols

    def write(self, path: str | Path, backtraces: bool = False) -> Path:
        """Write the export; `backtraces` adds 2022-style class-67 duplicates of runtime calls."""
        path = Path(path)
        if path.exists():
            path.unlink()
        db = sqlite3.connect(path)
        if backtraces:
            for row in list(self.rows.get("CUPTI_ACTIVITY_KIND_RUNTIME", [])):
                plain = [k for k, v in self.strings.items() if v == row["nameId"]][0].split("_v")[0]
                self._add("CUPTI_ACTIVITY_KIND_RUNTIME", **{**row, "eventClass": 67, "nameId": self.sid(plain),
                                                             "start": row["start"] - 1})
        for table, rows in self.rows.items():
            cols = self._columns(table)
            db.execute(f'CREATE TABLE "{table}" ({", ".join(f"{c!r}" for c in cols)})')
            db.executemany(f'INSERT INTO "{table}" VALUES ({", ".join("?" for _ in cols)})',
                           [[r.get(c) for c in cols] for r in rows])
        for name, tid_pairs in (("ThreadNames", self.thread_names),):
            if tid_pairs:
                db.execute(f"CREATE TABLE {name} (nameId INTEGER, priority INTEGER, globalTid INTEGER)")
                db.executemany(f"INSERT INTO {name} VALUES (?, 0, ?)",
                               [(self.sid(n), global_tid(p, t)) for p, t, n in tid_pairs])
        db.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)")
        db.executemany("INSERT INTO StringIds VALUES (?, ?)", [(i, s) for s, i in self.strings.items()])
        if self.gpus:
            db.execute("CREATE TABLE TARGET_INFO_GPU (id INTEGER, name TEXT, smCount INTEGER)")
            db.executemany("INSERT INTO TARGET_INFO_GPU VALUES (?, ?, 132)", list(self.gpus.items()))
        meta_table = "EXPORT_META_DATA" if self.schema == "2022" else "META_DATA_EXPORT"
        db.execute(f"CREATE TABLE {meta_table} (name TEXT, value TEXT)")
        db.executemany(f"INSERT INTO {meta_table} VALUES (?, ?)",
                       [("EXPORT_PRODUCT_VERSION", self.version), *self.meta.items()])
        if self.schema == "2026":
            db.execute("CREATE TABLE ENUM_CUDA_MEM_KIND (id INTEGER PRIMARY KEY, name TEXT, label TEXT)")
            db.executemany("INSERT INTO ENUM_CUDA_MEM_KIND VALUES (?, ?, ?)",
                           [(0, "PAGEABLE", "Pageable"), (1, "PINNED", "Pinned"), (2, "DEVICE", "Device")])
        db.commit()
        db.close()
        return path
