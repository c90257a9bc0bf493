"""`decodescope ingest` and `decodescope runs`: output lines, re-ingest, names, JSON listing."""
from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from cli.exit_codes import OK
from cli.main import main
from tests.kineto_builder import KinetoTraceBuilder


def _trace(path: Path, streams: tuple[int, ...] = (7,), gz: bool = False) -> Path:
    b = KinetoTraceBuilder()
    for i, s in enumerate(streams):
        b.launch(f"k{i}", 10 * i, 5, 100 + 100 * i, 50, stream=s)
    return b.write(path, gz=gz)


def test_ingest_prints_one_line_per_run_and_detects_reingest(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    a = _trace(tmp_path / "a.pt.trace.json.gz", streams=(7, 9, 9), gz=True)
    folder = tmp_path / "two"
    for rank in (0, 1):
        b = KinetoTraceBuilder(rank=rank, world_size=2)
        b.launch("g", 0, 5, 100, 50, stream=7)
        b.write(folder / f"r{rank}.json")
    res = CliRunner().invoke(main, ["ingest", str(a), str(folder), "--db", str(db)])
    assert res.exit_code == OK, res.output
    assert res.stderr == ""  # no progress output when stderr is not a terminal
    assert res.stdout.splitlines() == ["run 1 a: 3 kernels, 1 ranks, 2 streams",
                                       "run 2 two: 2 kernels, 2 ranks, 2 streams"]
    res = CliRunner().invoke(main, ["ingest", str(a), "--db", str(db), "--name", "renamed"])
    assert res.stdout.splitlines() == ["run 1 a: 3 kernels, 1 ranks, 2 streams (already ingested)"]
    res = CliRunner().invoke(main, ["runs", "--db", str(db), "--format", "json"])
    assert res.exit_code == OK
    runs = json.loads(res.stdout)["runs"]
    assert [(r["run_id"], r["name"], r["kernels"], r["world_size"]) for r in runs] == [(1, "a", 3, 1), (2, "two", 2, 2)]


def test_name_and_rules_options(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    rules = tmp_path / "r.toml"
    rules.write_text('[[rules]]\ncategory = "communication"\nstream = 9\n')
    t = _trace(tmp_path / "t.json", streams=(7, 9))
    res = CliRunner().invoke(main, ["ingest", str(t), "--db", str(db), "--name", "mine", "--rules", str(rules)])
    assert res.exit_code == OK, res.output
    assert res.stdout.startswith("run 1 mine: 2 kernels")
    res = CliRunner().invoke(main, ["runs", "--db", str(db)])
    assert res.stdout.splitlines()[0].startswith("run 1 mine: 2 kernels")
    res = CliRunner().invoke(main, ["summary", str(db), "--format", "json"])
    assert json.loads(res.stdout)["runs"][0]["categories"] == {"communication": 50, "compute": 50}
