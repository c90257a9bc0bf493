"""`decodescope runs --db FILE`: list the runs in a store."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from analyzers.summary import list_runs
from cli.common import emit, format_option, verbose_option, with_boundary
from tracer.errors import BadInput
from tracer.store import open_store


def _text(runs: list[dict[str, Any]]) -> str:
    if not runs:
        return "no runs"
    lines = []
    for r in runs:
        extra = ", ".join(f"{k} {r[k]}" for k in ("variant", "gpu") if r.get(k))
        lines.append(f"run {r['run_id']} {r['name']}: {r['kernels']} kernels, world size {r['world_size']}, "
                     f"{r['source']}" + (f", {extra}" if extra else ""))
    return "\n".join(lines)


@click.command("runs")
@click.option("--db", "db", required=True, type=click.Path(path_type=Path), help="DuckDB store.")
@format_option("text", "json")
@verbose_option
@with_boundary
def command(db: Path, fmt: str, verbose: bool) -> None:
    """List the runs in a store (id, name, kernels, world size, source, variant, GPU).

    \b
    Example:
      decodescope runs --db runs.duckdb --format json
    """
    if not db.exists():
        raise BadInput(db, "no such database")
    con = open_store(db, read_only=True)
    try:
        runs = list_runs(con)
    finally:
        con.close()
    emit({"runs": runs} if fmt == "json" else runs, fmt, _text)
