"""`decodescope layers` and `decodescope compare` end to end: Kineto files written by the test
builder, ingested by the real reader, answers derived in tests/analyzers/decode_pair.py."""
from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from cli.exit_codes import BAD_INPUT, OK
from cli.main import main
from tests.analyzers.decode_pair import EXPECTED_LAYERS, KERNELS as KERNELS_PER_STEP, write_eager, write_graph


def _run(*args: str, code: int = OK) -> str:
    res = CliRunner().invoke(main, list(args))
    assert res.exit_code == code, (res.output, res.exception)
    return res.output


def test_layers_eager_json(tmp_path: Path) -> None:
    eager = write_eager(tmp_path / "eager.json.gz")
    doc = json.loads(_run("layers", str(eager), "--format", "json"))
    assert doc["steps"] == 3 and doc["layers"] == EXPECTED_LAYERS


def test_layers_graph_capture_map_equals_eager(tmp_path: Path) -> None:
    """The graph trace's replays take their layers from the capture map; the graph run has no
    `sample` kernel (outside layers anyway), so its breakdown equals the eager one."""
    graph = write_graph(tmp_path / "graph.json.gz")
    doc = json.loads(_run("layers", str(graph), "--format", "json"))
    assert doc["layers"] == EXPECTED_LAYERS


def test_layers_notes_a_map_without_capture_streams(tmp_path: Path) -> None:
    """A map without capture streams (written before they were recorded) gives the same
    breakdown here (no PDL overlap across streams) and one note on stderr saying what it may
    miss; a map with them gives none."""
    for streams in (True, False):
        graph = write_graph(tmp_path / f"graph{streams}.json.gz", capture_streams=streams)
        res = CliRunner().invoke(main, ["layers", str(graph), "--format", "json"])
        assert res.exit_code == OK
        assert json.loads(res.stdout)["layers"] == EXPECTED_LAYERS
        n = 3 * len(KERNELS_PER_STEP)   # write_graph's 3 replays
        expected = (f"note: run 1: {n} graph-replayed kernels have no capture stream" in res.stderr)
        assert expected is (not streams), res.stderr


def test_layers_graph_reference(tmp_path: Path) -> None:
    """No capture map: --graph-reference aligns each replay to the eager step's sequence."""
    eager = write_eager(tmp_path / "eager.json.gz")
    graph = write_graph(tmp_path / "graph.json.gz", with_map=False)
    doc = json.loads(_run("layers", str(graph), "--graph-reference", str(eager), "--format", "json"))
    assert doc["layers"] == EXPECTED_LAYERS


def test_layers_mismatch_is_reported(tmp_path: Path) -> None:
    """The last replay's 4th kernel is renamed `gemm_X`: that replay fails verification
    against the map (reported on stderr) and only 2 of 3 steps carry layers; with 2 samples
    the lower median of L0.kda's span is min(4800, 4900) = 4800."""
    graph = write_graph(tmp_path / "graph.json.gz",
                        names=["gemm_in", "conv1d", "kda_rec", "gemm_X", "allreduce"])
    res = CliRunner().invoke(main, ["layers", str(graph), "--format", "json"])
    assert res.exit_code == OK
    assert "differ from the capture map" in res.stderr
    doc = json.loads(res.stdout)
    assert doc["layers"][0]["span_ns"] == 4800


def test_layers_text_and_bad_pattern(tmp_path: Path) -> None:
    eager = write_eager(tmp_path / "eager.json.gz")
    out = _run("layers", str(eager))
    assert "L0.kda" in out and "kda_recurrence" in out and "4900" in out
    res = CliRunner().invoke(main, ["layers", str(eager), "--layer-pattern", r"L\d+"])
    assert res.exit_code == BAD_INPUT and "named group" in res.stderr


def test_compare_eager_vs_graph(tmp_path: Path) -> None:
    """Same workload both sides: per kind, 4900 ns (kda) and 2000 ns (mla) per layer, kernels
    3 and 2, ratios 1."""
    eager = write_eager(tmp_path / "eager.json.gz")
    graph = write_graph(tmp_path / "graph.json.gz")
    doc = json.loads(_run("compare", str(eager), str(graph), "--format", "json"))
    kinds = {k["kind"]: k for k in doc["kinds"]}
    assert kinds["kda"]["base"]["span_ns"] == 4900 and kinds["kda"]["cand"]["span_ns"] == 4900
    assert kinds["mla"]["base"]["kernels"] == 2.0 and kinds["mla"]["ratio_time"] == 1.0
    text = _run("compare", str(eager), str(graph))
    assert "4.900" in text and "(4900 ns)" in text


def test_layers_and_compare_on_read_only_store(tmp_path: Path) -> None:
    """A store is opened read-only: attribution's macros and tables are TEMP, so both commands
    work on it; the reference may be a run id of the store, not a new trace file."""
    eager = write_eager(tmp_path / "eager.json.gz")
    graph = write_graph(tmp_path / "graph.json.gz", with_map=False)
    db = tmp_path / "runs.duckdb"
    _run("ingest", str(eager), str(graph), "--db", str(db))
    doc = json.loads(_run("layers", f"{db}:2", "--graph-reference", "1", "--format", "json"))
    assert doc["layers"] == EXPECTED_LAYERS
    doc = json.loads(_run("compare", f"{db}:1", f"{db}:2", "--graph-reference", "1", "--format", "json"))
    assert {k["kind"]: k["ratio_time"] for k in doc["kinds"]} == {"kda": 1.0, "mla": 1.0}
    res = CliRunner().invoke(main, ["layers", f"{db}:2", "--graph-reference", str(eager)])
    assert res.exit_code == BAD_INPUT and "read-only" in res.stderr
