"""Every analysis subcommand against every kind of input a user passes, and every bad input.

Good inputs: no argument (the bundled traces), one Kineto trace, a multi-rank folder, an Nsight
Systems `.sqlite`, a `.duckdb` store and `STORE:RUN`. One store is ingested once for the module
(through `tracer.ingest`, the contract API); the path cases ingest small files in memory. Each
good case must exit 0; `--format json` must parse, carry the command's documented keys, name the
run it was asked for, and hold every `*_ns` value as an integer (ns precision end to end).

Bad inputs (missing file, folder without traces, a text file, a truncated .gz, a file named
.duckdb that is not one, an unknown run, a bad regex, click usage mistakes) must exit 2 with
exactly one stderr line `error: <what>: <problem>` naming what the user passed, and no traceback.
"""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from cli.exit_codes import BAD_INPUT, OK
from cli.main import main
from tracer.ingest import ingest_path
from tracer.store import open_store

REPO = Path(__file__).resolve().parents[2]
OWN = REPO / "traces" / "k3_stock_b1_k0_graph.json.gz"
OWN_EAGER = REPO / "traces" / "k3_stock_b1_k0_eager.json.gz"

# The JSON keys each command documents for one run (its analyzer's result).
KEYS = {
    "bubbles": {"run_id", "min_ns", "steps", "layers", "top", "stream_gaps"},
    "launch": {"run_id", "ranks", "layers", "shorter_than_launch"},
    "layers": {"run", "steps", "layers"},
    "overlap": {"run_id", "ranks", "steps", "layers"},
    "prefetch": {"run_id", "prefetches", "summary"},
    "summary": {"runs"},
    "temporal": {"run_id", "ranks"},
}
PER_RUN = sorted(KEYS)


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], prog_name="decodescope")


def ns_not_int(obj: Any, path: str = "") -> list[str]:
    """Paths of `*_ns` values that are not integers (None is allowed: not measured)."""
    bad: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k.endswith("_ns") and v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                bad.append(f"{path}.{k}={v!r}")
            bad += ns_not_int(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for v in obj:
            bad += ns_not_int(v, f"{path}[]")
    return bad


def run_docs(cmd: str, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-run dicts of a JSON result: summary always lists runs; the others list them
    only when there are several."""
    if cmd == "summary" or "runs" in doc:
        return doc["runs"]
    return [doc]


def check_json(cmd: str, res: Result) -> list[dict[str, Any]]:
    assert res.exit_code == OK, (res.output, res.exception)
    doc = json.loads(res.stdout)
    docs = run_docs(cmd, doc)
    assert docs
    for d in docs:
        keys = {"run_id"} if cmd == "summary" else KEYS[cmd]
        assert keys <= set(d), (cmd, sorted(d))
        if "not_applicable" in d:
            assert isinstance(d["not_applicable"], str) and d["not_applicable"]
    assert ns_not_int(doc) == []
    return docs


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> dict[str, Any]:
    """One store with our own trace, a one-file corpus trace, a multi-rank folder and an nsys export."""
    db = tmp_path_factory.mktemp("matrix") / "runs.duckdb"
    sources = {"own": OWN, "single": corpus / "hta/kineto/hta_alexnet_a100",
               "multirank": corpus / "hta/kineto/param_dlrm_8rank_v100",
               "nsys": corpus / "nsys-ai/healthy_1pct.sqlite"}
    con = open_store(db)
    runs = {kind: ingest_path(con, path, progress=False)[0].run_id for kind, path in sources.items()}
    con.close()
    return {"db": db, "runs": runs, "sources": sources}


@pytest.mark.parametrize("kind", ["own", "single", "multirank", "nsys"])
@pytest.mark.parametrize("cmd", PER_RUN)
def test_json_for_one_run_of_a_store(store: dict[str, Any], cmd: str, kind: str) -> None:
    run = store["runs"][kind]
    [d] = check_json(cmd, invoke(cmd, f"{store['db']}:{run}", "--format", "json"))
    assert d.get("run_id", d.get("run")) in (run, store["sources"][kind].name.split(".")[0])


@pytest.mark.parametrize("cmd", PER_RUN)
def test_whole_store_and_run_option(store: dict[str, Any], cmd: str) -> None:
    """A store with four runs gives four results (text and JSON); --run picks one."""
    docs = check_json(cmd, invoke(cmd, store["db"], "--format", "json"))
    assert len(docs) == len(store["runs"])
    res = invoke(cmd, store["db"])
    assert res.exit_code == OK and res.stdout.strip(), res.output
    run = store["runs"]["nsys"]
    assert len(check_json(cmd, invoke(cmd, store["db"], "--run", run, "--format", "json"))) == 1


def test_multirank_folder_has_every_rank(store: dict[str, Any]) -> None:
    """The folder holds one trace per worker; each becomes a rank of one run."""
    folder = store["sources"]["multirank"]
    workers = len(list(folder.glob("worker*.json*")))
    [d] = check_json("temporal", invoke("temporal", folder, "--format", "json"))
    assert sorted(r["rank"] for r in d["ranks"]) == list(range(workers))


@pytest.mark.parametrize("cmd", PER_RUN)
def test_trace_paths(store: dict[str, Any], cmd: str) -> None:
    """Trace files given directly (ingested in memory): one Kineto trace and one nsys export."""
    for path in (store["sources"]["single"], store["sources"]["nsys"]):
        [d] = check_json(cmd, invoke(cmd, path, "--format", "json"))
        assert d.get("run_id", d.get("run")) in (1, path.name.split(".")[0])


@pytest.mark.parametrize("cmd", ["summary", "bubbles"])
def test_no_argument_is_the_bundled_traces(cmd: str) -> None:
    bundled = sorted((REPO / "traces").glob("*.json*"))
    assert len(check_json(cmd, invoke(cmd, "--format", "json"))) == len(bundled)


def test_compare_and_diff_on_a_store(store: dict[str, Any]) -> None:
    run = store["runs"]["own"]
    res = invoke("compare", f"{store['db']}:{run}", f"{store['db']}:{run}", "--format", "json")
    assert res.exit_code == OK, res.output
    doc = json.loads(res.stdout)
    assert {"base", "cand", "kinds"} <= set(doc) and doc["kinds"]
    assert all(k["ratio_time"] == 1.0 for k in doc["kinds"])  # a run against itself
    res = invoke("diff", f"{store['db']}:{run}", f"{store['db']}:{run}", "--format", "json")
    assert res.exit_code == OK, res.output
    assert json.loads(res.stdout)["regressions"] == []


def _step_ranges(trace: Path) -> int:
    """Step annotations on the host, counted with plain json."""
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    return sum(1 for e in events if e.get("name") == "step" and e.get("cat") == "user_annotation")


@pytest.mark.parametrize("cmd", ["bubbles", "overlap"])
def test_text_shows_the_step_index(cmd: str) -> None:
    """Several steps share the range name `step`; the text tells them apart by index."""
    steps = _step_ranges(OWN_EAGER)
    assert steps > 1
    res = invoke(cmd, OWN_EAGER)
    assert res.exit_code == OK, res.output
    shown = re.findall(r"^\s+r0 step (\d+):", res.stdout, flags=re.M)
    assert sorted(map(int, shown)) == list(range(steps))
    assert "r0 step:" not in res.stdout


# -- bad inputs ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad")
    (d / "empty").mkdir()
    (d / "notes.txt").write_text("hello\n")
    full = OWN.read_bytes()
    (d / "trunc.json.gz").write_bytes(full[: len(full) // 2])
    (d / "fake.duckdb").write_bytes(b"not a duckdb file")
    return {"missing": d / "nope.json", "no traces": d / "empty", "text file": d / "notes.txt",
            "truncated gz": d / "trunc.json.gz", "not duckdb": d / "fake.duckdb"}


def assert_one_line(res: Result, where: str) -> None:
    assert res.exit_code == BAD_INPUT, (res.output, res.exception)
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(f"error: {where}: "), lines[0]
    assert "Traceback" not in res.output


@pytest.mark.parametrize("case", ["missing", "no traces", "text file", "truncated gz", "not duckdb"])
@pytest.mark.parametrize("cmd", PER_RUN + ["compare", "diff"])
def test_bad_path(bad: dict[str, Path], cmd: str, case: str) -> None:
    path = bad[case]
    args = [path, OWN] if cmd in ("compare", "diff") else [path]
    assert_one_line(invoke(cmd, *args), str(path))


@pytest.mark.parametrize("cmd", PER_RUN)
def test_bad_run(store: dict[str, Any], cmd: str) -> None:
    missing = max(store["runs"].values()) + 1
    assert_one_line(invoke(cmd, store["db"], "--run", missing), str(store["db"]))
    assert_one_line(invoke(cmd, f"{store['db']}:{missing}"), f"{store['db']}:{missing}")


def test_runs_command(store: dict[str, Any], bad: dict[str, Path]) -> None:
    res = invoke("runs", "--db", store["db"], "--format", "json")
    assert res.exit_code == OK
    assert sorted(r["run_id"] for r in json.loads(res.stdout)["runs"]) == sorted(store["runs"].values())
    for case in ("missing", "not duckdb", "text file"):
        assert_one_line(invoke("runs", "--db", bad[case]), str(bad[case]))


@pytest.mark.parametrize("cmd,option", [("layers", "--layer-pattern"), ("layers", "--step-pattern"),
                                        ("bubbles", "--step-pattern"), ("compare", "--layer-pattern"),
                                        ("diff", "--layer-pattern")])
def test_bad_regex(cmd: str, option: str) -> None:
    args = [OWN, OWN] if cmd in ("compare", "diff") else [OWN]
    assert_one_line(invoke(cmd, *args, option, "(unclosed"), option)


@pytest.mark.parametrize("args,where", [
    (["nosuchcommand"], "decodescope"),
    (["--bogus"], "decodescope"),
    (["layers", "--run", "x"], "decodescope layers"),
    (["bubbles", "--top", "-1"], "decodescope bubbles"),
    (["diff", "only-one"], "decodescope diff"),
    (["compare", "a", "b", "c"], "decodescope compare"),
    (["runs"], "decodescope runs"),
    (["summary", "--format", "yaml"], "decodescope summary"),
    (["dashboard", "--port", "99999"], "decodescope dashboard"),
])
def test_usage_mistakes_are_one_line(args: list[str], where: str) -> None:
    res = invoke(*args)
    assert_one_line(res, where)
    assert "Usage:" not in res.stderr


def test_no_arguments_show_the_help() -> None:
    """`decodescope` alone lists the commands (click's help on stderr), not a one-line error."""
    res = invoke()
    assert res.exit_code == BAD_INPUT
    assert "Commands:" in res.stderr and "bubbles" in res.stderr and not res.stderr.startswith("error:")


def test_trace_diff_script_usage_mistake(capsys: pytest.CaptureFixture[str]) -> None:
    from cli.trace_diff import main as trace_diff

    with pytest.raises(SystemExit) as exc:
        trace_diff(["only-one"])
    assert exc.value.code == BAD_INPUT
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: trace-diff: Missing argument"), err


def test_compare_refuses_runs_of_two_stores(store: dict[str, Any], tmp_path: Path) -> None:
    """compare needs both runs in one store; a second store is refused in one line."""
    other = tmp_path / "other.duckdb"
    other.write_bytes(store["db"].read_bytes())
    run = store["runs"]["own"]
    assert_one_line(invoke("compare", f"{store['db']}:{run}", f"{other}:{run}"), f"{store['db']}:{run}")
    assert_one_line(invoke("compare", f"{store['db']}:{run}", OWN), f"{store['db']}:{run}")


def test_compare_without_argument_is_the_bundled_pair() -> None:
    """The bundled stock/fused B=1 graph pair; while the fused trace is missing, one line naming it."""
    fused = REPO / "traces" / "k3_fused_b1_k0_graph.json.gz"
    res = invoke("compare", "--format", "json")
    if fused.exists():
        assert res.exit_code == OK and json.loads(res.stdout)["kinds"], res.output
    else:
        assert_one_line(res, str(fused))


@pytest.mark.parametrize("cmd", PER_RUN)
def test_empty_store(tmp_path: Path, cmd: str) -> None:
    """A store without runs: text says so (not an empty page), JSON lists no runs."""
    db = tmp_path / "empty.duckdb"
    open_store(db).close()
    res = invoke(cmd, db)
    assert res.exit_code == OK and res.stdout.strip() == "no runs", res.output
    res = invoke(cmd, db, "--format", "json")
    assert res.exit_code == OK and json.loads(res.stdout)["runs"] == []


@pytest.mark.parametrize("option", ["--output", "--junit"])
def test_unwritable_report_file_is_one_line(tmp_path: Path, option: str) -> None:
    target = tmp_path / "no such dir" / "report.xml"
    assert_one_line(invoke("diff", OWN, OWN, option, target), str(target))
    assert not target.parent.exists()


def test_compare_without_layers_says_not_applicable(store: dict[str, Any]) -> None:
    """Corpus runs carry no L{idx}.{kind} ranges: the table is empty and the text says why."""
    runs = store["runs"]
    res = invoke("compare", f"{store['db']}:{runs['single']}", f"{store['db']}:{runs['nsys']}")
    assert res.exit_code == OK and "not applicable: no kernel of either run" in res.stdout, res.output
