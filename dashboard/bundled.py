"""The bundled traces as a cached store: ingested once, keyed by their content hash.

`decodescope dashboard` with no argument serves traces/*.json.gz. Ingesting them takes
seconds, so the first start writes `<cache>/bundled-<hash>.duckdb` (hash over the files' names
and bytes) and later starts open it at once; changed traces get a new hash, hence a new file.
The store is built under a temporary name and renamed when complete, so an interrupted first
start never leaves a half-filled cache behind. The dashboard then serves a per-process working
copy of it (`working_copy`): the cache stays exactly as built, several dashboards can serve the
bundled traces at once (DuckDB lets one process write a file), and uploads go to the copy.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from tracer.errors import BadInput

CACHE_ENV = "DECODESCOPE_CACHE_DIR"


def cache_dir() -> Path:
    """$DECODESCOPE_CACHE_DIR, else $XDG_CACHE_HOME/decodescope, else ~/.cache/decodescope."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "decodescope"


def content_hash(paths: list[Path]) -> str:
    """sha256 over each file's name and bytes, in name order."""
    h = hashlib.sha256()
    for p in sorted(paths, key=lambda q: q.name):
        h.update(p.name.encode() + b"\0")
        with p.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def bundled_store(paths: list[Path], directory: Path | None = None,
                  log: Callable[[str], None] = lambda _m: None) -> Path:
    """The cached store holding `paths`, ingesting them first if this content was never seen."""
    from tracer.ingest import ingest_path
    from tracer.store import open_store

    if not paths:
        raise BadInput("traces/", "no bundled traces found; pass a trace or --db")
    directory = directory or cache_dir()
    target = directory / f"bundled-{content_hash(paths)[:16]}.duckdb"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + f".{os.getpid()}.partial")
    partial.unlink(missing_ok=True)
    log(f"ingesting {len(paths)} bundled traces into {target} (once; later starts reuse it)")
    con = open_store(partial)
    try:
        for i, p in enumerate(paths, 1):
            log(f"[{i}/{len(paths)}] {p.name}")
            ingest_path(con, p, progress=True)
    except BaseException:
        con.close()
        partial.unlink(missing_ok=True)
        raise
    con.close()
    os.replace(partial, target)
    return target


@contextlib.contextmanager
def working_copy(store: Path) -> Iterator[Path]:
    """A private copy of `store` (a few MB for the bundled traces), removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="decodescope-dashboard-") as tmp:
        copy = Path(tmp) / store.name
        shutil.copyfile(store, copy)
        yield copy
