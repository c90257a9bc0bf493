"""What the per-run analysis commands share (bubbles, overlap, prefetch, launch, temporal, layers):
picking `--run` among the runs TRACE_OR_DB names, one JSON shape for one or several runs, and the
text frame around each run's lines.

One run gives its analyzer's dict; several give `{"runs": [...]}`, for every command alike, so a
script reading `--format json` never has to guess the shape from the command's name.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import click
import duckdb

from cli.common import open_input
from tracer.errors import BadInput

Analyse = Callable[[duckdb.DuckDBPyConnection, int], dict[str, Any]]


def run_option(fn: Any) -> Any:
    """`--run RUN`: only this run id of those the inputs hold."""
    return click.option("--run", "run_id", type=int, default=None, help="Only this run id.")(fn)


def pick_runs(inputs: tuple[str, ...], ids: list[int], run_id: int | None) -> list[int]:
    """All runs, or only `run_id`, refused in one line when the inputs do not hold it."""
    if run_id is None:
        return ids
    if run_id not in ids:
        raise BadInput(inputs[0] if inputs else "traces/", f"no run {run_id} (runs: {ids})")
    return [run_id]


def one_or_many(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's dict as it is; several as {"runs": [...]}."""
    return docs[0] if len(docs) == 1 else {"runs": docs}


def per_run(inputs: tuple[str, ...], run_id: int | None, analyse: Analyse) -> dict[str, Any]:
    """Open TRACE_OR_DB, pick `--run` (or every run) and analyse each run."""
    con, ids = open_input(inputs, progress=False)
    return one_or_many([analyse(con, i) for i in pick_runs(inputs, ids, run_id)])


def each_run(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The run dicts of a `per_run` result."""
    return doc["runs"] if "runs" in doc else [doc]


def run_text(doc: dict[str, Any], body: Callable[[dict[str, Any]], Iterable[str]], key: str = "run_id") -> str:
    """`run N` per run, then `  not applicable: why` or the lines `body` gives for that run."""
    out: list[str] = []
    if not each_run(doc):
        return "no runs"  # an empty store: say so rather than print nothing
    for r in each_run(doc):
        out.append(f"run {r[key]}")
        if r.get("not_applicable"):
            out.append(f"  not applicable: {r['not_applicable']}")
            continue
        out.extend(body(r))
    return "\n".join(out)


def extra_run(con: duckdb.DuckDBPyConnection, spec: str | None, option: str) -> int | None:
    """The run an option such as --baseline or --graph-reference names: a run id of the store, or
    a trace file / folder ingested into the (in-memory) store beside the analysed runs."""
    if spec is None:
        return None
    from tracer.store import run_ids

    if spec.isdigit():
        ids = run_ids(con)
        if int(spec) not in ids:
            raise BadInput(option, f"no run {spec} in this store (runs: {ids})")
        return int(spec)
    from pathlib import Path

    from tracer.ingest import ingest_path

    read_only = con.execute("SELECT readonly FROM duckdb_databases() "
                            "WHERE database_name = current_database()").fetchall()[0][0]
    if read_only:
        raise BadInput(spec, f"a store is opened read-only: give {option} as a run id of that store, "
                             "or pass the runs as trace files instead of the store")
    runs = ingest_path(con, Path(spec), progress=False)
    if len(runs) != 1:
        raise BadInput(spec, f"{option} must be one run (got {len(runs)})")
    return runs[0].run_id


def step_label(row: dict[str, Any]) -> str:
    """`step 2`, or `step 2 (ProfilerStep#14)` when the range has its own name: several steps of
    one rank share the name `step`, so text must show the 0-based index to tell them apart."""
    idx, name = row.get("step_index"), row.get("step")
    label = "step" if idx is None else f"step {idx}"
    if name in (None, "step"):
        return label
    return f"{label} {name}" if name.startswith("(") else f"{label} ({name})"
