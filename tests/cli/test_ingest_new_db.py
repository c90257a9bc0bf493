"""A failed `decodescope ingest ... --db NEW.duckdb` leaves no store behind; an existing one
is kept byte for byte; a successful one is created."""
from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from cli.exit_codes import BAD_INPUT, OK
from cli.main import main
from tests.kineto_builder import KinetoTraceBuilder


def _good(path: Path) -> Path:
    b = KinetoTraceBuilder()
    b.launch("gemm", 0, 10, 100, 50)
    return b.write(path)


def _bad(path: Path) -> Path:
    """Parses as JSON, fails in the reader's checks (negative duration), after the store opened."""
    b = KinetoTraceBuilder()
    b.kernel("k", 1_000, -7)
    return b.write(path)


def _leftovers(db: Path) -> list[str]:
    return sorted(p.name for p in db.parent.iterdir() if p.name.startswith(db.name))


def test_failed_ingest_removes_the_new_store(tmp_path: Path) -> None:
    db = tmp_path / "new.duckdb"
    res = CliRunner().invoke(main, ["ingest", str(_bad(tmp_path / "neg.json")), "--db", str(db)])
    assert res.exit_code == BAD_INPUT, res.output
    assert len(res.stderr.strip().splitlines()) == 1 and res.stderr.startswith("error: ")
    assert _leftovers(db) == []


def test_good_then_bad_path_removes_the_new_store(tmp_path: Path) -> None:
    """The first path's run was committed, but the command failed: the new store goes too."""
    db = tmp_path / "new.duckdb"
    args = ["ingest", str(_good(tmp_path / "good.json")), str(_bad(tmp_path / "neg.json")), "--db", str(db)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == BAD_INPUT, res.output
    assert _leftovers(db) == []


def test_failed_ingest_keeps_an_existing_store(tmp_path: Path) -> None:
    db = tmp_path / "old.duckdb"
    ok = CliRunner().invoke(main, ["ingest", str(_good(tmp_path / "good.json")), "--db", str(db)])
    assert ok.exit_code == OK, ok.output
    before = db.read_bytes()
    res = CliRunner().invoke(main, ["ingest", str(_bad(tmp_path / "neg.json")), "--db", str(db)])
    assert res.exit_code == BAD_INPUT, res.output
    assert db.read_bytes() == before


def test_successful_ingest_creates_the_store(tmp_path: Path) -> None:
    db = tmp_path / "new.duckdb"
    res = CliRunner().invoke(main, ["ingest", str(_good(tmp_path / "good.json")), "--db", str(db)])
    assert res.exit_code == OK, res.output
    assert db.exists() and res.output.startswith("run 1 good: 1 kernels, 1 ranks")
