"""The facts a reader returns for a run's `runs` row, and the one INSERT that writes it."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb

INSERT_RUN_SQL = """
INSERT INTO runs (run_id, name, source, path, file_hash, variant, config, metadata, gpu,
                  world_size, graph_mode, tp_sim)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
"""


@dataclass
class RunMeta:
    """Reader-side facts about a run (capture metadata and what the reader saw)."""

    world_size: int
    variant: str | None = None
    config: dict[str, Any] | None = None          # the trace's `decodescope` object, verbatim
    metadata: dict[str, Any] = field(default_factory=dict)  # device props, event counts, warnings
    gpu: str | None = None
    graph_mode: bool | None = None
    tp_sim: bool | None = None


def insert_run(con: duckdb.DuckDBPyConnection, run_id: int, name: str, source: str, path: Path,
               file_hash: str, meta: RunMeta) -> None:
    """Write the runs row of one ingested run."""
    con.execute(INSERT_RUN_SQL, [
        run_id, name, source, str(path.resolve()), file_hash, meta.variant,
        json.dumps(meta.config) if meta.config is not None else None,
        json.dumps(meta.metadata, default=str), meta.gpu, meta.world_size, meta.graph_mode, meta.tp_sim,
    ])
