"""Insert hand-made store rows (tracer/schema.sql) for attribution and layer tests.

Tests state ranges, launch calls and kernels in integer ns; this writes them the way every
reader does (one run, ids unique within it), so expected answers derive from the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import duckdb


@dataclass
class RunRows:
    """Rows of one run. `launch` returns the correlation it used, to give to `kernel`."""

    run_id: int
    name: str = "run"
    ranges: list[tuple[Any, ...]] = field(default_factory=list)
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    kernels: list[tuple[Any, ...]] = field(default_factory=list)
    memops: list[tuple[Any, ...]] = field(default_factory=list)
    cmap: list[tuple[Any, ...]] = field(default_factory=list)
    _corr: int = 1000

    def range(self, name: str, start: int, end: int, tid: int = 1, rank: int = 0,
              kind: str = "user_annotation", depth: int = 0) -> int:
        rid = len(self.ranges)
        self.ranges.append((self.run_id, rid, rank, 1, tid, kind, name, start, end, depth, None, None))
        return rid

    def launch(self, start: int, tid: int = 1, rank: int = 0, name: str = "cudaLaunchKernel",
               dur: int = 5) -> int:
        self._corr += 1
        self.calls.append((self.run_id, len(self.calls), rank, 1, tid, "runtime", name, start,
                           start + dur, self._corr))
        return self._corr

    def kernel(self, name: str, start: int, end: int, corr: int | None, stream: int = 7,
               rank: int = 0) -> int:
        kid = len(self.kernels)
        self.kernels.append((self.run_id, kid, rank, 0, stream, corr, name, start, end,
                             None, None, None, None, None, None, None, None, None, None, "compute"))
        return kid

    def memop(self, name: str, start: int, end: int, corr: int | None, stream: int = 7,
              rank: int = 0) -> int:
        mid = len(self.memops)
        self.memops.append((self.run_id, mid, rank, 0, stream, corr, "memcpy", name, start, end,
                            64, None, None, "memory"))
        return mid

    def map_node(self, order: int, kernel_name: str, layer: str | None, op: str | None,
                 rank: int = 0, graph_id: int | None = None, capture_stream: int | None = None) -> None:
        self.cmap.append((self.run_id, rank, graph_id, order, None, kernel_name, "step", layer, op,
                          capture_stream))

    def insert(self, con: duckdb.DuckDBPyConnection, graph_mode: bool = False) -> None:
        con.execute("INSERT INTO runs (run_id, name, source, path, file_hash, world_size, graph_mode) "
                    "VALUES (?, ?, 'test', ?, ?, 1, ?)",
                    [self.run_id, self.name, self.name, f"hash-{self.run_id}", graph_mode])
        for table, rows in (("ranges", self.ranges), ("api_calls", self.calls),
                            ("kernels", self.kernels), ("memops", self.memops),
                            ("graph_capture_map", self.cmap)):
            if rows:
                marks = ", ".join("?" * len(rows[0]))
                con.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)


def attribution_rows(con: duckdb.DuckDBPyConnection, run_id: int) -> dict[tuple[str, int], tuple[Any, ...]]:
    """{(item_kind, item_id): (step_index, layer, layer_kind, op, method)} of one run."""
    rows = con.execute(
        "SELECT item_kind, item_id, step_index, layer, layer_kind, op, method "
        "FROM kernel_attribution WHERE run_id = ?", [run_id]).fetchall()
    return {(r[0], r[1]): tuple(r[2:]) for r in rows}
