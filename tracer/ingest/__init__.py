"""Ingest trace files into the store: one reader per format, one transaction per run.

`ingest_path` resolves a file or a folder into runs (a folder is normally the per-rank files
of one run; a reader's `group` may split it, e.g. Kineto folders of independent world-size-1
captures become one run per file), hashes each run's content (a re-ingest of the same bytes
returns the existing run instead of a duplicate), picks the reader by file name, and runs
reader + classifier inside one transaction per run, so a failing run leaves nothing of itself.
Runs of one folder are written in name order; when one fails, the runs before it stay
committed (each is whole, and a retry finds them by hash) and the error names the bad file.

Adding a format is one line in `READERS`: a `Reader` with the file suffixes it claims and
three functions. `stage(con, files, progress)` parses and checks the files OUTSIDE the store
transaction (TEMP tables or Python objects only; raises BadInput), so a parse error can never
leave a transaction aborted; `write(con, staged, run_id, progress) -> RunMeta` fills every
per-run table (kernels, memops, api_calls, ranges, ...) inside the transaction and returns the
facts for the `runs` row; `discard(con)` drops whatever `stage` left. This module writes the
runs row (name, path, hash) and runs the classifier. A reader that parses and writes in one
call, `read_run(con, files, run_id, progress) -> RunMeta`, registers with `Reader.one_phase`.
An optional `group(folder, files) -> list[list[Path]]` says which files of a folder form each
run (default: all of them, one run).
"""
from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from tracer.errors import BadInput
from tracer.ingest.progress import Progress
from tracer.ingest.runmeta import RunMeta, insert_run
from tracer.store import transaction


@dataclass(frozen=True)
class RunInfo:
    """What one ingest produced (or found already there, `reused=True`)."""

    run_id: int
    name: str
    kernels: int
    ranks: int
    streams: int
    reused: bool


Stage = Callable[[duckdb.DuckDBPyConnection, list[Path], Progress], Any]
Write = Callable[[duckdb.DuckDBPyConnection, Any, int, Progress], RunMeta]
Discard = Callable[[duckdb.DuckDBPyConnection], None]
ReadRun = Callable[[duckdb.DuckDBPyConnection, list[Path], int, Progress], RunMeta]
Group = Callable[[Path, list[Path]], list[list[Path]]]


@dataclass(frozen=True)
class Reader:
    """A trace format: the file suffixes it claims, and how it stages and writes one run."""

    source: str
    suffixes: tuple[str, ...]
    stage: Stage
    write: Write
    discard: Discard
    group: Group | None = None

    def claims(self, path: Path) -> bool:
        return path.name.lower().endswith(self.suffixes)

    @classmethod
    def one_phase(cls, source: str, suffixes: tuple[str, ...], read_run: ReadRun) -> Reader:
        """A reader that parses and writes in one call, inside the transaction."""
        return cls(source, suffixes, stage=lambda _con, files, _prog: files,
                   write=lambda con, files, run_id, prog: read_run(con, files, run_id, prog),
                   discard=lambda _con: None)


def _lazy(module: str, attr: str) -> Any:
    """A function of `module` that is imported only when first called."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), attr)(*args, **kwargs)

    return call


# Readers are imported on first use: `decodescope ingest x.json.gz` does not load the nsys
# reader, and commands that only open a store (`summary runs.duckdb`) load neither.
KINETO_SUFFIXES = (".json", ".json.gz")  # the Kineto reader's files (tracer.ingest.kineto.SUFFIXES)
READERS: tuple[Reader, ...] = (
    Reader("kineto", KINETO_SUFFIXES, _lazy("tracer.ingest.kineto", "stage"),
           _lazy("tracer.ingest.kineto", "write"), _lazy("tracer.ingest.kineto", "discard"),
           _lazy("tracer.ingest.kineto_runs", "folder_runs")),
    Reader("nsys", (".sqlite",), _lazy("tracer.ingest.nsys_sqlite", "stage"),
           _lazy("tracer.ingest.nsys_sqlite", "write"), _lazy("tracer.ingest.nsys_sqlite", "discard")),
)

_RUN_FACTS_SQL = """
SELECT count(*) AS kernels,
       count(DISTINCT rank) AS ranks,
       count(DISTINCT (rank, stream)) AS streams
FROM kernels WHERE run_id = ?
"""
_RUN_BY_HASH_SQL = "SELECT run_id, name FROM runs WHERE file_hash = ?"


def _reader_for(path: Path) -> Reader | None:
    return next((r for r in READERS if r.claims(path)), None)


def resolve_files(path: Path) -> tuple[Reader, list[Path]]:
    """The reader and the trace files of one run: a file, or every trace file in a folder."""
    if not path.exists():
        raise BadInput(path, "no such file or directory")
    if path.is_file():
        reader = _reader_for(path)
        if reader is None:
            known = ", ".join(s for r in READERS for s in r.suffixes)
            raise BadInput(path, f"unknown trace format (expected one of: {known})")
        return reader, [path]
    files = sorted(p for p in path.iterdir() if p.is_file() and _reader_for(p) is not None)
    if not files:
        known = ", ".join(s for r in READERS for s in r.suffixes)
        raise BadInput(path, f"no trace files ({known}) in this folder")
    readers = {_reader_for(p).source for p in files}  # type: ignore[union-attr]
    if len(readers) > 1:
        raise BadInput(path, f"folder mixes trace formats ({', '.join(sorted(readers))}); one run is one format")
    return _reader_for(files[0]), files  # type: ignore[return-value]


def content_hash(files: Sequence[Path]) -> str:
    """sha256 over the bytes of every file of the run, in file order (names do not count)."""
    h = hashlib.sha256()
    for f in files:
        fh = hashlib.sha256()
        with f.open("rb") as stream:
            for block in iter(lambda: stream.read(1 << 22), b""):
                fh.update(block)
        h.update(fh.digest())
    return h.hexdigest()


def default_name(path: Path) -> str:
    """A run's name from its file or folder name, without trace suffixes."""
    name = path.name
    for suffix in (".gz", ".json", ".trace", ".pt", ".sqlite"):
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
    return name or str(path)


def _facts(con: duckdb.DuckDBPyConnection, run_id: int, name: str, reused: bool) -> RunInfo:
    kernels, ranks, streams = con.execute(_RUN_FACTS_SQL, [run_id]).fetchall()[0]
    return RunInfo(run_id, name, int(kernels), int(ranks), int(streams), reused)


def ingest_path(con: duckdb.DuckDBPyConnection, path: str | Path, name: str | None = None,
                progress: bool = True, rules: str | Path | None = None) -> list[RunInfo]:
    """Ingest one trace file or folder; returns its runs (one, unless the reader splits a folder).

    `rules` is an optional user rules file (JSON or TOML, see tracer.classify). The same
    content ingested again returns the stored run with `reused=True` and writes nothing.
    A folder split into several runs names each after its file (`name/file` with `name`).
    """
    from tracer import classify  # here: importing tracer.ingest stays cheap for read-only commands

    p = Path(path)
    reader, files = resolve_files(p)
    user_rules = classify.load_user_rules(Path(rules)) if rules is not None else []
    groups = reader.group(p, files) if p.is_dir() and reader.group is not None else [files]
    if len(groups) == 1:
        return [_ingest_run(con, reader, p, groups[0], name or default_name(p), progress, user_rules)]
    return [_ingest_run(con, reader, g[0], g, f"{name}/{default_name(g[0])}" if name else default_name(g[0]),
                        progress, user_rules) for g in groups]


def _ingest_run(con: duckdb.DuckDBPyConnection, reader: Reader, p: Path, files: list[Path], run_name: str,
                progress: bool, user_rules: list[Any]) -> RunInfo:
    """One run: hash, reuse if known, else stage and write it in one transaction."""
    from tracer import classify

    with Progress(enabled=progress, label=p.name) as prog:
        prog.step("hashing")
        digest = content_hash(files)
        found = con.execute(_RUN_BY_HASH_SQL, [digest]).fetchall()
        if found:
            return _facts(con, int(found[0][0]), str(found[0][1]), reused=True)
        try:
            staged = reader.stage(con, files, prog)
            with transaction(con):
                run_id = int(con.execute("SELECT nextval('run_id_seq')").fetchall()[0][0])
                meta = reader.write(con, staged, run_id, prog)
                insert_run(con, run_id, run_name, reader.source, p, digest, meta)
                prog.step("classifying")
                classify.classify_run(con, run_id, user_rules)
                info = _facts(con, run_id, run_name, reused=False)
        finally:
            reader.discard(con)
    return info
