"""`decodescope ingest PATH... --db FILE`: add trace files or per-rank folders to a store."""
from __future__ import annotations

from pathlib import Path

import click

from cli.common import verbose_option, with_boundary
from tracer.classify import load_user_rules
from tracer.ingest import RunInfo, ingest_path, resolve_files
from tracer.store import open_store


def format_run(info: RunInfo) -> str:
    """`run <id> <name>: <kernels> kernels, <ranks> ranks, <streams> streams`."""
    line = f"run {info.run_id} {info.name}: {info.kernels} kernels, {info.ranks} ranks, {info.streams} streams"
    return line + (" (already ingested)" if info.reused else "")


@click.command("ingest")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--db", "db", required=True, type=click.Path(path_type=Path), help="DuckDB store (created if missing).")
@click.option("--name", default=None, help="Run name (default: the file or folder name).")
@click.option("--rules", type=click.Path(path_type=Path), default=None,
              help="Extra classifier rules, JSON or TOML (see tracer/classify.py).")
@verbose_option
@with_boundary
def command(paths: tuple[Path, ...], db: Path, name: str | None, rules: Path | None, verbose: bool) -> None:
    """Ingest traces: Kineto / PyTorch profiler (.json, .json.gz) or Nsight Systems SQLite exports (.sqlite).

    A folder is one run, one file per rank, all of one format (unless every file is a
    whole world-size-1 capture: then each file is its own run).

    Every path becomes one run, written in one transaction; the same content ingested
    again is reported as already ingested. Every input is checked before the store is
    opened, so a wrong path leaves the store untouched. A folder whose every file is a whole
    world-size-1 capture is one run per file. If the store did not exist and the ingest
    fails, the new store file is removed.

    \b
    Example:
      decodescope ingest traces/k3_stock_b1_k0_graph.json.gz trace_dir/ --db runs.duckdb
      decodescope ingest trace.json.gz --db runs.duckdb --rules my_rules.toml
      decodescope ingest profile.sqlite --db runs.duckdb
    """
    for p in paths:
        resolve_files(p)
    if rules is not None:
        load_user_rules(rules)
    created = not db.exists()
    con = open_store(db)
    try:
        for p in paths:
            for info in ingest_path(con, p, name=name, rules=rules):
                click.echo(format_run(info))
    except BaseException:
        con.close()
        if created:
            _remove_store(db)
        raise
    con.close()


def _remove_store(db: Path) -> None:
    """Delete a store this command created, and its WAL: a failed ingest into a NEW store
    leaves no file behind (no partial write), not even an empty store."""
    for f in (db, db.with_name(db.name + ".wal")):
        f.unlink(missing_ok=True)
