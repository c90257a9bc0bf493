"""trace-diff CLI: exit codes, one-line errors, and every output format (text, markdown, json, JUnit).

The renderer and exit-code tests feed `open_side` hand-made samples (the layer_steps contract
recomputed by brute force in tests/analyzers/test_diff_synth.py); the bad-input tests run the
real argument handling and ingest. End-to-end runs over real traces are in test_trace_diff_e2e.py.
"""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import cli.trace_diff as td
from cli.exit_codes import BAD_INPUT, OK, REGRESSION
from tests.analyzers.test_diff_synth import FUSED, STOCK, Synth, sample

SAMPLES = {"stock": lambda: sample(Synth(STOCK, seed=11), "stock", 1),
           "fused": lambda: sample(Synth(FUSED, seed=12), "fused", 2),
           "stock_again": lambda: sample(Synth(STOCK, seed=13), "stock_again", 3)}


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run `trace-diff argv` in-process; returns (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exc:
        td.main(argv)
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


@pytest.fixture
def synthetic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """BASE/CAND names resolve to hand-made samples instead of ingested traces."""
    for name in SAMPLES:
        (tmp_path / name).write_text("placeholder")
    monkeypatch.setattr(td, "open_side", lambda spec, role, ref, **kw: SAMPLES[Path(spec).name]())
    return tmp_path


def test_stock_to_fused_passes_with_improvements(synthetic: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run([str(synthetic / "stock"), str(synthetic / "fused")], capsys)
    assert code == OK, err
    assert out.startswith("trace-diff: PASS") and "Improvements:" in out and "Regressions:" not in out


def test_fused_to_stock_fails_in_every_format(synthetic: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    base, cand = str(synthetic / "fused"), str(synthetic / "stock")
    junit = tmp_path / "junit.xml"
    code, out, _ = run([base, cand, "--format", "json", "--junit", str(junit)], capsys)
    assert code == REGRESSION
    doc = json.loads(out)
    assert doc["verdict"] == "regression" and doc["mode"] == "layers"
    named = {(r["layer"], r["op"]) for r in doc["regressions"]}
    assert ("L0.kda", "kda_recurrence") in named and ("L3.mla", None) in named
    # JUnit, read back with the standard library: one failure per regression, named by layer and op
    suite = ET.parse(junit).getroot()
    failed = {(c.get("classname"), c.get("name")) for c in suite.iter("testcase") if c.find("failure") is not None}
    assert int(suite.get("failures")) == len(failed) == len(doc["regressions"])
    assert ("trace-diff.L0.kda", "kda_recurrence") in failed
    code, md, _ = run([base, cand, "--format", "markdown"], capsys)
    assert code == REGRESSION
    assert md.startswith("### ❌") and "| `L0.kda / kda_recurrence` |" in md and "<details>" in md
    out_file = tmp_path / "report.txt"
    code, out, _ = run([base, cand, "--output", str(out_file)], capsys)
    assert code == REGRESSION and out == "" and "Regressions:" in out_file.read_text()


def test_json_times_are_ints_and_min_delta_is_whole_ns(synthetic: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """12 steps a side (even): the JSON holds ints for every time, and --min-delta takes whole ns."""
    from tests.analyzers.test_diff import _not_int_times

    base, cand = str(synthetic / "fused"), str(synthetic / "stock")
    code, out, _ = run([base, cand, "--format", "json", "--min-delta", "2000"], capsys)
    doc = json.loads(out)
    assert code == REGRESSION and doc["base"]["steps"] == 12 and _not_int_times(doc) == []
    assert doc["settings"]["min_delta"] == 2000
    code, out, err = run([base, cand, "--min-delta", "1000.5"], capsys)
    assert code == BAD_INPUT and out == "" and len(err.strip().splitlines()) == 1 and "--min-delta" in err


def test_same_configuration_passes(synthetic: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([str(synthetic / "stock"), str(synthetic / "stock_again"), "--format", "json"], capsys)
    assert code == OK and json.loads(out)["regressions"] == []


def test_kernels_metric_gates_on_count(synthetic: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([str(synthetic / "fused"), str(synthetic / "stock"), "--metric", "kernels", "--format", "json"], capsys)
    assert code == REGRESSION
    doc = json.loads(out)
    assert doc["kernel_count_increases"] and all(r["median"]["delta"] > 0 for r in doc["regressions"])


@pytest.mark.parametrize("argv_fn,needle", [
    (lambda d: [str(d / "missing.json.gz"), str(d / "missing.json.gz")], "no such trace"),
    (lambda d: [str(d / "bad.json")], "Missing argument"),
    (lambda d: [str(d / "bad.json"), str(d / "bad.json"), "--threshold", "-1"], "--threshold must be > 0"),
    (lambda d: [str(d / "bad.json"), str(d / "bad.json"), "--metric", "nope"], "nope"),
    (lambda d: [str(d / "bad.json"), str(d / "bad.json")], "bad.json: "),
])
def test_bad_inputs_exit_2_with_one_line(argv_fn, needle: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.json").write_text("{ not json")
    code, out, err = run(argv_fn(tmp_path), capsys)
    assert code == BAD_INPUT
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("error: ") and needle in err


def test_unreadable_trace_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.json").write_text("{ not json")
    code, _, err = run([str(tmp_path / "bad.json"), str(tmp_path / "bad.json")], capsys)
    assert code == BAD_INPUT and err.startswith(f"error: {tmp_path / 'bad.json'}: ")


def test_store_with_several_runs_needs_db_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.analyzers.test_diff_synth import write_kineto
    from tracer.ingest import ingest_path
    from tracer.store import open_store

    db = tmp_path / "runs.duckdb"
    con = open_store(db)
    for seed in (1, 2):
        ingest_path(con, write_kineto(Synth(STOCK, steps=2, seed=seed), tmp_path / f"s{seed}.json.gz"), progress=False)
    con.close()
    code, _, err = run([str(db), f"{db}:1"], capsys)
    assert code == BAD_INPUT and "holds 2 runs" in err and len(err.strip().splitlines()) == 1
    code, _, err = run([f"{db}:7", f"{db}:1"], capsys)
    assert code == BAD_INPUT and "no run 7" in err and len(err.strip().splitlines()) == 1


def test_decodescope_diff_is_the_same_command() -> None:
    from click.testing import CliRunner

    from cli.main import main

    res = CliRunner().invoke(main, ["diff", "--help"])
    assert res.exit_code == OK and "--graph-reference" in res.output and "--junit" in res.output


def _write(path: Path, kernels: list[tuple[str, int, int]], step: bool = True) -> Path:
    """A tiny trace: optional `step` range, kernels launched inside it (no layer ranges)."""
    from tests.kineto_builder import KinetoTraceBuilder

    b = KinetoTraceBuilder()
    if step:
        b.annotation("step", 0, 1_000_000)
    for name, start, dur in kernels:
        b.launch(name, start - 5_000, 100, start, dur)
    if not kernels:
        b.annotation("idle", 10, 100)
    return b.write(path)


def test_runs_that_cannot_be_compared_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _write(tmp_path / "a.json", [("gemm_a", 10_000, 5_000), ("gemm_b", 20_000, 5_000)])
    b = _write(tmp_path / "b.json", [("other_x", 10_000, 5_000)])
    code, out, err = run([str(a), str(b)], capsys)
    assert code == BAD_INPUT and out == "" and len(err.strip().splitlines()) == 1
    assert "no kernel name in common" in err
    empty = _write(tmp_path / "empty.json", [])
    code, out, err = run([str(a), str(empty)], capsys)
    assert code == BAD_INPUT and out == "" and len(err.strip().splitlines()) == 1
    assert "empty.json" in err


def test_markdown_fits_a_pull_request_comment(synthetic: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the caps, explanations and then the whole body are cut, and the cut is said."""
    base, cand = str(synthetic / "fused"), str(synthetic / "stock")
    monkeypatch.setattr(td, "MAX_MD_DETAILS", 2)
    _, md, _ = run([base, cand, "--format", "markdown"], capsys)
    n = json.loads(run([base, cand, "--format", "json"], capsys)[1])["regressions"]
    assert md.count("<details>") == 2 and f"Explanations of {len(n) - 2} more regressions" in md
    monkeypatch.setattr(td, "MAX_MD_CHARS", 1500)
    _, md, _ = run([base, cand, "--format", "markdown"], capsys)
    assert len(md) <= 1500 and md.rstrip().endswith("has everything._")
