"""`decodescope dashboard` start-up rules: a taken port is one line and exit 2 (before any
ingest), and the bundled traces are ingested once into a store keyed by their content."""
from __future__ import annotations

import socket
from pathlib import Path

import duckdb
from click.testing import CliRunner

from cli.exit_codes import BAD_INPUT
from cli.main import main
from dashboard.bundled import bundled_store, content_hash
from tests.dashboard.decode_traces import DecodeSpec, write_decode_trace


def test_taken_port_is_one_line_and_exit_2(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = CliRunner().invoke(main, ["dashboard", "--db", str(tmp_path / "s.duckdb"), "--port", str(port)])
    assert result.exit_code == BAD_INPUT
    assert result.output == f"error: 127.0.0.1:{port}: port already in use; pick another with --port\n"
    assert not (tmp_path / "s.duckdb").exists()  # failed before opening or ingesting anything


def test_db_and_traces_together_are_refused(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["dashboard", "--db", str(tmp_path / "s.duckdb"), "a.json", "--port", "0"])
    assert result.exit_code == BAD_INPUT
    assert result.output.startswith("error: ") and result.output.count("\n") == 1


def test_bundled_store_is_built_once_per_content(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    a = write_decode_trace(traces / "k3_stock.json", DecodeSpec("stock", steps=1, layers=1))
    logs: list[str] = []
    first = bundled_store([a], tmp_path / "cache", log=logs.append)
    assert first.name == f"bundled-{content_hash([a])[:16]}.duckdb"
    con = duckdb.connect(str(first), read_only=True)
    assert con.execute("SELECT count(*) FROM runs").fetchall() == [(1,)]
    con.close()
    mtime, n_logs = first.stat().st_mtime_ns, len(logs)
    assert bundled_store([a], tmp_path / "cache", log=logs.append) == first
    assert first.stat().st_mtime_ns == mtime and len(logs) == n_logs  # reused, nothing ingested
    b = write_decode_trace(traces / "k3_fused.json", DecodeSpec("fused", steps=1, layers=1))
    second = bundled_store([a, b], tmp_path / "cache", log=logs.append)
    assert second != first and second.exists()
    assert not list((tmp_path / "cache").glob("*.partial"))


def test_working_copy_keeps_the_cache_as_built(tmp_path: Path) -> None:
    """The dashboard writes (macros, uploads) only to its private copy, removed afterwards."""
    from dashboard.bundled import working_copy

    a = write_decode_trace(tmp_path / "k3_stock.json", DecodeSpec("stock", steps=1, layers=1))
    cached = bundled_store([a], tmp_path / "cache")
    before = cached.read_bytes()
    with working_copy(cached) as copy:
        assert copy != cached and copy.read_bytes() == before
        con = duckdb.connect(str(copy))
        con.execute("DELETE FROM kernels")
        con.close()
    assert not copy.exists() and not copy.parent.exists()
    assert cached.read_bytes() == before
    assert not list(cached.parent.glob("*.wal"))
