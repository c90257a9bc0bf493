"""Pieces every subcommand shares: the error boundary, --format, and opening TRACE_OR_DB.

A subcommand body parses its options, calls one library function and formats the result;
user mistakes surface as `tracer.errors.BadInput` and become one line on stderr, exit 2.
"""
from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import click
import duckdb

from cli.exit_codes import BAD_INPUT
from tracer.errors import BadInput

F = TypeVar("F", bound=Callable[..., Any])

# The bundled real traces, the default data of every analysis command.
REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_TRACES = REPO_ROOT / "traces"
DB_SUFFIXES = (".duckdb", ".db", ".ddb")


def fail(message: str, code: int = BAD_INPUT) -> None:
    """Print `error: <message>` as one line on stderr and exit with `code`."""
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


@contextlib.contextmanager
def error_boundary(verbose: bool = False) -> Iterator[None]:
    """Turn user mistakes into one line and exit 2; a traceback only with --verbose."""
    try:
        yield
    except BadInput as exc:
        if verbose:
            import traceback

            traceback.print_exc()
        fail(str(exc))
    except duckdb.Error as exc:
        if verbose:
            raise
        fail(f"store error: {str(exc).splitlines()[0]}")
    except OSError as exc:  # a file the user named (--output, --junit, --db) cannot be written or read
        if verbose or exc.filename is None:
            raise
        fail(f"{exc.filename}: {(exc.strerror or str(exc)).lower()}")


class OneLineUsageError(click.ClickException):
    """A click usage mistake (unknown option, bad value, missing argument) shown as the same one
    line as every other bad input, instead of click's usage block; exit 2 like BadInput."""

    exit_code = BAD_INPUT

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.message}", err=True)


def usage_error_line(exc: click.UsageError) -> str:
    """`<command path>: <click's message> (see --help)`, one line, for `error: ...`."""
    where = exc.ctx.command_path if exc.ctx is not None else "decodescope"
    message = " ".join(exc.format_message().split())
    return f"{where}: {message} (see {where} --help)"


@contextlib.contextmanager
def one_line_usage_errors() -> Iterator[None]:
    """Re-raise click usage errors as OneLineUsageError (used by the command groups)."""
    try:
        yield
    except (OneLineUsageError, click.exceptions.NoArgsIsHelpError):
        raise  # no arguments at all: click shows the help, as a user expects
    except click.UsageError as exc:
        raise OneLineUsageError(usage_error_line(exc)) from exc


def format_option(*choices: str) -> Callable[[F], F]:
    """`--format` with the given choices, the first one the default."""
    return click.option("--format", "fmt", type=click.Choice(list(choices)), default=choices[0],
                        show_default=True, help="Output format.")


def verbose_option(fn: F) -> F:
    return click.option("--verbose", is_flag=True, help="Show tracebacks and details on errors.")(fn)


def with_boundary(fn: F) -> F:
    """Decorator: run a click command body inside the error boundary (reads its `verbose`)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with error_boundary(bool(kwargs.get("verbose", False))):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def is_database(path: Path) -> bool:
    """A store is named by a DuckDB suffix, or is a file that starts with DuckDB's magic."""
    if path.suffix in DB_SUFFIXES:
        return True
    if path.is_file():
        with path.open("rb") as fh:
            head = fh.read(16)
        return head[8:12] == b"DUCK"
    return False


def bundled_trace_paths() -> list[Path]:
    """Every trace file committed under traces/, sorted by name."""
    return sorted(p for p in BUNDLED_TRACES.glob("*.json*") if p.is_file())


def open_input(inputs: tuple[str, ...] | list[str], progress: bool = True) -> tuple[duckdb.DuckDBPyConnection, list[int]]:
    """Open TRACE_OR_DB arguments as one store and return it with the runs they name.

    - no argument: the bundled traces in traces/, ingested into memory;
    - a DuckDB file (optionally `FILE:RUN`): opened read-only, all its runs (or RUN);
    - trace files or per-rank folders: ingested into an in-memory store, one run each.
    """
    from tracer.ingest import ingest_path
    from tracer.store import open_store, run_ids

    if not inputs:
        paths = bundled_trace_paths()
        if not paths:
            raise BadInput(BUNDLED_TRACES, "no bundled traces found; pass a trace or a --db")
        inputs = [str(p) for p in paths]
    if len(inputs) == 1:
        spec = inputs[0]
        db_part, _, run_part = spec.rpartition(":") if ":" in spec and not Path(spec).exists() else (spec, "", "")
        db_path = Path(db_part)
        if db_path.exists() and is_database(db_path):
            con = open_store(db_path, read_only=True)
            ids = run_ids(con)
            if run_part:
                if not run_part.isdigit() or int(run_part) not in ids:
                    raise BadInput(spec, f"no run {run_part} in this store (runs: {ids})")
                ids = [int(run_part)]
            return con, ids
    con = open_store(None)
    ids: list[int] = []
    for spec in inputs:
        p = Path(spec)
        if p.exists() and is_database(p):
            raise BadInput(p, "a store cannot be mixed with trace files; pass it alone")
        ids.extend(r.run_id for r in ingest_path(con, p, progress=progress))
    return con, ids


def emit(obj: Any, fmt: str, text: Callable[[Any], str], output: str | None = None) -> None:
    """Write a result as JSON or as text (from `text`) to stdout or `output`."""
    body = json.dumps(obj, indent=2, default=str) if fmt == "json" else text(obj)
    if output:
        Path(output).write_text(body + ("\n" if not body.endswith("\n") else ""))
    else:
        click.echo(body)
