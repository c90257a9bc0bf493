"""The dashboard's one store accessor: connections, and the analyzer calls the pages need.

Pages never write SQL and never hold data between requests. Each request borrows a cursor
from a small per-process pool (`StorePool`, kept in the Flask app config, not in a module
global): DuckDB cursors of one connection share the database but each has its own TEMP
schema, so every pooled cursor gets the timeline macros loaded once. Analyzer functions that
other engineers own are looked up when called; one that does not exist yet makes the page
say "not available in this build" instead of showing made-up data.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import queue
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import duckdb
import flask

from analyzers import timeline
from analyzers.attribution import load_sql
from tracer.errors import BadInput
from tracer.store import open_store

CONFIG_KEY = "DECODESCOPE_STORE"
# The only SQL this module queries itself; each analyzer loads its own area when called, so a
# colleague's broken view elsewhere cannot take the whole dashboard down.
TIMELINE_SQL_AREA = "timeline"
NOT_AVAILABLE = "not available in this build"

RUNS_SQL = """
SELECT r.run_id, r.name, r.source, r.variant, r.gpu, r.world_size, r.graph_mode, r.tp_sim,
       r.path, CAST(r.created_at AS VARCHAR) AS created_at, CAST(r.config AS VARCHAR) AS config,
       (SELECT count(*) FROM kernels AS k WHERE k.run_id = r.run_id) AS kernels
FROM runs AS r
ORDER BY r.run_id
"""
STORE_FINGERPRINT_SQL = "SELECT count(*), coalesce(max(run_id), 0) FROM runs"


class StorePool:
    """One DuckDB database for this process, lent out as cursors with the timeline macros loaded.

    `writable` is False when the store could only be opened read-only (another process holds
    it); uploads are then refused with a message instead of failing half-way.

    DuckDB refuses concurrent catalog changes from two connections ("write-write conflict"),
    and loading views, analyzer calls (they (re)create their macros and TEMP tables) and
    ingests all change the catalog; they run one at a time under `exclusive()`. The timeline
    and kernel-table queries only read and run concurrently.
    """

    def __init__(self, con: duckdb.DuckDBPyConnection, label: str, writable: bool, size: int = 8) -> None:
        self._con = con
        self.label = label
        self.writable = writable
        self._free: queue.LifoQueue[duckdb.DuckDBPyConnection] = queue.LifoQueue(maxsize=size)
        self._catalog_lock = threading.RLock()
        load_sql(con, TIMELINE_SQL_AREA)

    @classmethod
    def open(cls, path: str | Path | None) -> StorePool:
        """Open the store at `path` (None: in memory) read-write, falling back to read-only."""
        if path is None:
            return cls(open_store(None), ":memory:", writable=True)
        try:
            return cls(open_store(path, read_only=False), str(path), writable=True)
        except BadInput as exc:
            if not Path(path).exists():
                raise
            try:
                return cls(open_store(path, read_only=True), str(path), writable=False)
            except BadInput:
                if "lock" in exc.problem.lower():  # DuckDB: one writing process excludes all others
                    pid = re.search(r"PID (\d+)", exc.problem)
                    who = f"PID {pid.group(1)}" if pid else "another process"
                    raise BadInput(path, f"in use by {who}; stop it, or serve another store with --db") from None
                raise

    @contextlib.contextmanager
    def cursor(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """Borrow a cursor for one request; it goes back to the pool afterwards."""
        try:
            cur = self._free.get_nowait()
        except queue.Empty:
            cur = self._con.cursor()
            with self._catalog_lock:
                load_sql(cur, TIMELINE_SQL_AREA)
        try:
            yield cur
        finally:
            try:
                self._free.put_nowait(cur)
            except queue.Full:
                cur.close()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the catalog lock (see the class docstring)."""
        with self._catalog_lock:
            yield

    def ingest(self, path: Path, name: str | None = None) -> list[Any]:
        """Ingest a trace into the store (one transaction per run; BadInput leaves it unchanged)."""
        if not self.writable:
            raise BadInput(self.label, "the store is open read-only (another process holds it)")
        from tracer.ingest import ingest_path

        with self._catalog_lock, self.cursor() as cur:
            return ingest_path(cur, path, name=name, progress=False)

    def close(self) -> None:
        while True:
            try:
                self._free.get_nowait().close()
            except queue.Empty:
                break
        self._con.close()


def pool() -> StorePool:
    """The pool of the app serving the current request."""
    return flask.current_app.config[CONFIG_KEY]


def analyzer(module: str, function: str) -> Callable[..., Any] | None:
    """`analyzers.<module>.<function>` if this build has it, else None."""
    try:
        mod = importlib.import_module(f"analyzers.{module}")
    except ImportError:
        return None
    fn = getattr(mod, function, None)
    return fn if callable(fn) else None


def call(module: str, function: str, *args: Any, **kwargs: Any) -> Any:
    """Call an analyzer on a pooled cursor.

    Raises NotAvailable when this build lacks the analyzer (or one it builds on), and
    AnalyzerFailed with the one-line reason when it refuses the run (BadInput) or the store
    query fails, so the page shows that line instead of a broken view.
    """
    fn = analyzer(module, function)
    if fn is None:
        raise NotAvailable(f"analyzers.{module}.{function}: {NOT_AVAILABLE}")
    store = pool()
    with store.cursor() as cur, store.exclusive():
        try:
            return fn(cur, *args, **kwargs)
        except ModuleNotFoundError as exc:  # the analyzer is here, one it builds on is not
            if not (exc.name or "").startswith("analyzers."):
                raise
            raise NotAvailable(f"analyzers.{module}.{function} needs {exc.name}: {NOT_AVAILABLE}") from None
        except BadInput as exc:
            raise AnalyzerFailed(f"error: {exc}") from None
        except duckdb.Error as exc:
            raise AnalyzerFailed(f"error: analyzers.{module}.{function}: store error: "
                                 f"{str(exc).strip().splitlines()[0]}") from None


def definition(module: str) -> str | None:
    """The analyzer module's docstring: the metric's definition in the words its author wrote."""
    try:
        mod = importlib.import_module(f"analyzers.{module}")
    except ImportError:
        return None
    return mod.__doc__.strip() if mod.__doc__ else None


class PageDataError(Exception):
    """Why a page section has no data; its text is shown in the page as one line."""


class NotAvailable(PageDataError):
    """An analyzer this page needs does not exist in this build."""


class AnalyzerFailed(PageDataError):
    """The analyzer refused the run or its query failed."""


# -- runs ----------------------------------------------------------------------------------
def runs() -> list[dict[str, Any]]:
    """Every run in the store with its metadata and kernel count, oldest first."""
    with pool().cursor() as cur:
        df = cur.execute(RUNS_SQL).df()
    return [{k: _plain(v) for k, v in row.items()} for row in df.to_dict("records")]


def store_fingerprint() -> tuple[int, int]:
    """(number of runs, highest run id): tells a test or a page whether the store changed."""
    with pool().cursor() as cur:
        n, top = cur.execute(STORE_FINGERPRINT_SQL).fetchall()[0]
    return int(n), int(top)


def _capture_config(r: dict[str, Any]) -> dict[str, Any] | None:
    """The model and run config our capture recorded (runs.config's "config"); None otherwise."""
    try:
        cfg = (json.loads(r.get("config") or "{}") or {}).get("config")
    except (TypeError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) and cfg else None


def workload(r: dict[str, Any]) -> tuple[Any, Any]:
    """(batch, speculative tokens) from our capture metadata; (None, None) for foreign traces."""
    cfg = _capture_config(r) or {}
    return cfg.get("batch"), cfg.get("spec_tokens")


def _preference(r: dict[str, Any]) -> tuple[Any, ...]:
    """Order in which runs are offered by default: CUDA-graph replays first (what decode
    serves), then no speculation, then small batches, then oldest."""
    batch, spec = workload(r)
    return (not r.get("graph_mode"), spec or 0, batch if batch is not None else 1 << 30, r["run_id"])


def default_pair(all_runs: list[dict[str, Any]]) -> tuple[int | None, int | None]:
    """The runs to compare by default: stock vs fused of the same workload (graph mode, B, k)
    if both exist, else the latest stock vs the latest fused, else the two preferred runs
    (e.g. stock B=1 vs stock B=8, graph replays), else the only run."""
    stock = sorted((r for r in all_runs if r.get("variant") == "stock"), key=_preference)
    fused = sorted((r for r in all_runs if r.get("variant") == "fused"), key=_preference)
    for s in stock:
        for f in fused:
            if (workload(s), bool(s.get("graph_mode"))) == (workload(f), bool(f.get("graph_mode"))):
                return s["run_id"], f["run_id"]
    if stock and fused:
        return stock[-1]["run_id"], fused[-1]["run_id"]
    ids = [r["run_id"] for r in sorted(all_runs, key=_preference)]
    if len(ids) >= 2:
        return ids[0], ids[1]
    return (ids[0], None) if ids else (None, None)


def eager_sibling(all_runs: list[dict[str, Any]], run_id: int | None) -> int | None:
    """For a CUDA-graph run of ours, an eager run of the same variant and config (the lowest
    id), else None. Its step order gives graph kernels their capture streams where the trace's
    capture map has none (analyzers.attribution, graph_reference), so per-op busy time can
    leave out PDL waits the replay moved across streams. Foreign runs (no recorded config)
    are never paired: the same workload cannot be told from names alone."""
    me = next((r for r in all_runs if r["run_id"] == run_id), None)
    if me is None or not me.get("graph_mode") or _capture_config(me) is None:
        return None
    same = [r["run_id"] for r in all_runs
            if not r.get("graph_mode") and r.get("variant") == me.get("variant")
            and _capture_config(r) == _capture_config(me)]
    return min(same) if same else None


def run_label(r: dict[str, Any]) -> str:
    """A short human label: `#3 k3_stock_b1 (stock)`."""
    variant = f" ({r['variant']})" if r.get("variant") else ""
    return f"#{r['run_id']} {r['name']}{variant}"


# -- timeline and kernels (our own analyzer) -----------------------------------------------
def timeline_extent(run_id: int, rank: int) -> dict[str, int] | None:
    with pool().cursor() as cur:
        return timeline.extent(cur, run_id, rank)


def timeline_steps(run_id: int, rank: int) -> list[dict[str, Any]]:
    """The attribution's steps of a rank (analyzers.timeline.steps)."""
    store = pool()
    with store.cursor() as cur, store.exclusive():  # may build the run's attribution on this cursor
        df = timeline.steps(cur, run_id, rank)
    return [{k: _plain(v) for k, v in row.items()} for row in df.to_dict("records")]


def timeline_ranks(run_id: int) -> list[int]:
    with pool().cursor() as cur:
        return timeline.ranks(cur, run_id)


def timeline_window(run_id: int, rank: int, start_ns: int, end_ns: int,
                    cap: int = timeline.DEFAULT_CAP) -> tuple[timeline.Window, Any, Any]:
    """The window's kernels (or bins), its layer bands, and its bubbles with their cause (None
    when not available: see analyzers.timeline.bubble_causes; only for drawn kernels)."""
    store = pool()
    with store.cursor() as cur:
        win = timeline.window(cur, run_id, rank, start_ns, end_ns, cap=cap)
        with store.exclusive():  # may build the run's attribution (TEMP table, macros) on this cursor
            bands = timeline.layer_bands(cur, run_id, rank, start_ns, end_ns)
            causes = (timeline.bubble_causes(cur, run_id, rank, start_ns, end_ns)
                      if win.mode == "kernels" else None)
    return win, bands, causes


def kernel_rows(run_id: int, offset: int, limit: int, sort: list[dict[str, str]] | None,
                filters: dict[str, dict[str, Any]] | None) -> tuple[list[dict[str, Any]], int]:
    """One page of the kernels table (sorted and filtered in the store) and the matching count."""
    with pool().cursor() as cur:
        df, total = timeline.kernel_rows(cur, run_id, offset, limit, sort or [], filters or {})
    return [{k: _plain(v) for k, v in row.items()} for row in df.to_dict("records")], total


def _plain(v: Any) -> Any:
    """Numpy/pandas scalars to plain Python (JSON-able); NaN/NA to None."""
    if v is None:
        return None
    try:
        import pandas as pd

        if pd.isna(v):
            return None
    except (TypeError, ValueError):
        pass
    if hasattr(v, "item"):
        return v.item()
    return v
