"""Session fixtures: every corpus Kineto folder ingested once, into one store."""
from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from tracer.ingest import ingest_path
from tracer.store import open_store


@pytest.fixture(scope="session")
def kineto_folders(corpus: Path) -> list[Path]:
    folders = sorted(p for p in (corpus / "hta" / "kineto").iterdir() if p.is_dir())
    assert len(folders) >= 20
    return folders


@pytest.fixture(scope="session")
def corpus_store(tmp_path_factory: pytest.TempPathFactory, kineto_folders: list[Path]) -> tuple[duckdb.DuckDBPyConnection, dict[str, int]]:
    """(connection, {folder name: run_id}) with the whole Kineto corpus, one run per folder."""
    con = open_store(tmp_path_factory.mktemp("corpus") / "corpus.duckdb")
    ids: dict[str, int] = {}
    for folder in kineto_folders:
        (info,) = ingest_path(con, folder, progress=False)
        ids[folder.name] = info.run_id
    yield con, ids
    con.close()
