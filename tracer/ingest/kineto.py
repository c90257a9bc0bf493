"""Kineto / PyTorch-profiler Chrome-trace reader (`.json`, `.json.gz`; one file per rank).

Two phases. `stage` (outside the store transaction) parses every file with DuckDB and an
explicit schema (ts/dur as DECIMAL(38,3): exact ns at any magnitude) into one TEMP table of
every event, and validates it; each file is first cut into event chunks that parse in
parallel and in less memory (kineto_split), and read as one document when that is not possible
(runs.metadata.files[].parsed_as says which). `write`
(inside the transaction) fills kernels, memops, api_calls, ranges, gpu_annotations and
gpu_syncs with SQL. Python touches only metadata, the failure diagnosis, and the nesting of
host ranges (tracer.ingest.nesting), which runs on a thread beside the SQL inserts.

Rank: `distributedInfo.rank` of each file when every file has one, else the file's position in
name order; two files claiming the same rank are refused (kineto_runs.rank_clash). Which files
of a folder form one run is decided before staging (kineto_runs.folder_runs). Event kinds the store has no table for (flows, instant events,
metadata, profiler spans) are counted in `runs.metadata.unhandled_events`, never silently lost.
"""
from __future__ import annotations

import importlib
import json
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb

from tracer.errors import BadInput
from tracer.ingest import KINETO_SUFFIXES
from tracer.ingest import kineto_sql as q
from tracer.ingest.diagnose import diagnose_json
from tracer.ingest.kineto_split import split_trace
from tracer.ingest.kineto_runs import rank_clash
from tracer.ingest.nesting import nest
from tracer.ingest.progress import Progress
from tracer.ingest.runmeta import RunMeta

SUFFIXES = KINETO_SUFFIXES  # declared in tracer.ingest, which picks readers without importing them


@dataclass
class DocFacts:
    """Top-level facts of one trace file (the metadata Python looks at)."""

    path: Path
    base_ns: int
    dist: dict[str, Any] | None
    props: Any
    decodescope: dict[str, Any] | None
    parsed_as: str = "whole document"


def _loads(text: str | None) -> Any:
    return json.loads(text) if text is not None else None


def _facts(path: Path, base: Any, dist: Any, props: Any, ds: Any) -> DocFacts:
    """Check and keep the top-level metadata of one file."""
    try:
        base_ns = int(base) if base not in (None, "") else 0
    except (TypeError, ValueError):
        raise BadInput(path, f"baseTimeNanoseconds is not an integer: {base!r}") from None
    if ds is not None and not isinstance(ds, dict):
        raise BadInput(path, "the top-level 'decodescope' entry is not an object")
    return DocFacts(path, base_ns, dist if isinstance(dist, dict) else None, props, ds)


def _read_doc(con: duckdb.DuckDBPyConnection, path: Path) -> DocFacts:
    """Parse one file as a whole document into `_kineto_doc`; BadInput with a precise reason."""
    try:
        con.execute(q.READ_DOC_SQL, [str(path)])
    except duckdb.Error as exc:
        raise diagnose_json(path, exc) from None
    n_rows, no_events, base, dist, props, ds = con.execute(q.DOC_FACTS_SQL).fetchall()[0]
    if n_rows == 0:
        raise BadInput(path, "is empty (no JSON value)")
    if n_rows != 1:
        raise BadInput(path, f"holds {n_rows} top-level JSON values; a Kineto trace is one object")
    if no_events:
        raise BadInput(path, "no traceEvents list (not a Kineto / Chrome trace)")
    return _facts(path, base, _loads(dist), _loads(props), _loads(ds))


def _stage_file(con: duckdb.DuckDBPyConnection, path: Path, idx: int, workdir: Path) -> DocFacts:
    """Append one file's events to `_kineto_ev`: chunked when the layout allows, else whole."""
    split = split_trace(path, workdir)
    if split is not None:
        m = split.meta
        doc = _facts(path, m.get("baseTimeNanoseconds"), m.get("distributedInfo"), m.get("deviceProperties"),
                     m.get("decodescope"))
        rank = _declared_rank(doc)
        if not split.chunks:
            return doc  # an empty traceEvents list
        try:
            con.execute(q.INSERT_CHUNK_EVENTS_SQL, [idx, rank if rank is not None else idx, doc.base_ns,
                                                    [str(c) for c in split.chunks]])
            doc.parsed_as = f"{len(split.chunks)} chunks"
            return doc
        except duckdb.Error as exc:
            # A chunk did not parse (a cut inside a string, or a bad event): the whole-document
            # read below decides, and explains a real error; the reason is kept in metadata.
            fallback = f"whole document (chunked read failed: {str(exc).splitlines()[0][:200]})"
        finally:
            for c in split.chunks:
                c.unlink(missing_ok=True)
    else:
        fallback = "whole document"
    doc = _read_doc(con, path)
    doc.parsed_as = fallback
    rank = _declared_rank(doc)
    con.execute(q.INSERT_EVENTS_SQL, [idx, rank if rank is not None else idx, doc.base_ns])
    con.execute("DROP TABLE _kineto_doc")
    return doc


def _declared_rank(doc: DocFacts) -> int | None:
    rank = (doc.dist or {}).get("rank")
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else None


def _check_events(con: duckdb.DuckDBPyConnection, files: list[Path]) -> None:
    bad = con.execute(q.BAD_EVENT_SQL).fetchall()
    if bad:
        file_idx, idx, name, dur_ns, no_ts = bad[0]
        what = "has no ts" if no_ts else f"has a negative duration ({dur_ns} ns)"
        raise BadInput(files[file_idx], f"traceEvents[{idx}] ({name!r}) {what}")


class _Nesting(threading.Thread):
    """Depth and parent of every staged range, computed on a thread beside the table inserts.

    The stack (tracer.ingest.nesting) is plain Python holding the GIL; DuckDB releases it while
    it runs the kernel / memop / API-call inserts, so on two cores the two overlap (~0.05 s of
    the ingest's wall time). The ranges are fetched on the caller's thread before it starts (a
    DuckDB connection is used by one thread at a time); `store` registers the result.
    """

    def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
        super().__init__(name="decodescope-nesting", daemon=True)
        con.execute(q.STAGE_RANGES_SQL)
        self._cols = con.execute(q.RANGES_FOR_NESTING_SQL).fetchnumpy()  # in range_id order (0..n-1)
        self._result: tuple[list[int], list[int | None]] | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            cols = self._cols
            self._result = nest(cols["thread"].tolist(), cols["start_ns"].tolist(), cols["end_ns"].tolist(),
                                range(len(cols["thread"])))
        except BaseException as exc:  # re-raised on the caller's thread by store()
            self._error = exc

    def store(self, con: duckdb.DuckDBPyConnection) -> None:
        """Wait for the stack and write `_kineto_nesting` (range_id, depth, parent_id).

        The result goes back as a dict of numpy arrays (no pyarrow: converting Python lists
        with pyarrow imports pandas, ~0.7 s); parent -1 stands for NULL.
        """
        import numpy as np  # already imported by fetchnumpy; `summary` imports this module and needs no numpy

        self.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        depth, parent = self._result
        n = len(depth)
        nesting = {"range_id": np.arange(n, dtype=np.int64), "depth": np.asarray(depth, dtype=np.int32),
                   "parent_id": np.fromiter((-1 if x is None else x for x in parent), dtype=np.int64, count=n)}
        con.register("_kineto_nesting_np", nesting)
        try:
            con.execute("CREATE OR REPLACE TEMP TABLE _kineto_nesting AS "
                        "SELECT range_id, depth, NULLIF(parent_id, -1) AS parent_id FROM _kineto_nesting_np "
                        "ORDER BY range_id")
        finally:
            con.unregister("_kineto_nesting_np")


def _capture_map_rows(run_id: int, ds: dict[str, Any], rank: int, path: Path) -> list[list[Any]]:
    entries = ds.get("graph_capture_map") or []
    if not isinstance(entries, list):
        raise BadInput(path, "decodescope.graph_capture_map is not a list")
    rows = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("node_order"), int) or not isinstance(e.get("kernel_name"), str):
            raise BadInput(path, f"decodescope.graph_capture_map[{i}] needs an integer node_order and a kernel_name")
        cs = e.get("capture_stream")
        if cs is not None and (not isinstance(cs, int) or isinstance(cs, bool)):
            raise BadInput(path, f"decodescope.graph_capture_map[{i}].capture_stream is not an integer")
        rows.append([run_id, e.get("rank", rank), e.get("graph_id"), e["node_order"], e.get("graph_node_id"),
                     e["kernel_name"], e.get("step"), e.get("layer"), e.get("op"), cs])
    return rows


def _gpu_name(props: Any) -> str | None:
    if isinstance(props, list) and props and isinstance(props[0], dict):
        name = props[0].get("name")
        return str(name) if name else None
    return None


@dataclass
class Staged:
    """Parsed and validated files of one run, waiting in TEMP tables for `write`."""

    files: list[Path]
    docs: list[DocFacts]
    ranks: list[int]
    by_declared: bool
    counts: list[tuple[str, str, int]] = field(default_factory=list)
    graph_launches: int = 0


def stage(con: duckdb.DuckDBPyConnection, files: list[Path], prog: Progress) -> Staged:
    """Parse and check every file of the run into TEMP staging tables; writes nothing to the store."""
    con.execute(q.CREATE_EVENTS_SQL)
    if "numpy" not in sys.modules:
        # The nesting write-back needs numpy (~0.07 s to import); import it now on a thread,
        # while this thread reads and cuts the file (inflate releases the GIL, and one core
        # is otherwise idle then). Whoever imports numpy first waits for the other; not a
        # daemon, so an early error exit waits for the import instead of finalizing under it.
        threading.Thread(target=importlib.import_module, args=("numpy",), daemon=False,
                         name="decodescope-import-numpy").start()
    docs: list[DocFacts] = []
    workdir = Path(tempfile.mkdtemp(prefix="decodescope-kineto-"))
    try:
        for idx, path in enumerate(files):
            prog.step(f"parsing {path.name}")
            docs.append(_stage_file(con, path, idx, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    declared_ranks = [_declared_rank(d) for d in docs]
    if len(docs) > 1:
        rank_clash(files[0].parent, files, declared_ranks)
    by_declared = None not in declared_ranks and len(set(declared_ranks)) == len(docs)
    ranks = [int(r) for r in declared_ranks] if by_declared else list(range(len(docs)))  # type: ignore[arg-type]
    if not by_declared and len(docs) > 1:
        con.execute("UPDATE _kineto_ev SET rank = file_idx")
    _check_events(con, files)
    counts = [(str(a), str(b), int(n)) for a, b, n in con.execute(q.EVENT_COUNTS_SQL).fetchall()]
    graph_launches = int(con.execute(q.GRAPH_LAUNCHES_SQL).fetchall()[0][0])
    return Staged(files, docs, ranks, by_declared, counts, graph_launches)


def discard(con: duckdb.DuckDBPyConnection) -> None:
    """Drop the staging tables (after write, or after a failure)."""
    con.execute(q.DROP_STAGING_SQL)


def write(con: duckdb.DuckDBPyConnection, staged: Staged, run_id: int, prog: Progress) -> RunMeta:
    """Fill every per-run table from the staging tables; return the facts for the runs row."""
    prog.step("writing tables")
    nesting = _Nesting(con)
    nesting.start()
    try:
        for sql in (q.INSERT_KERNELS_SQL, q.INSERT_MEMOPS_SQL, q.INSERT_API_CALLS_SQL,
                    q.INSERT_GPU_ANNOTATIONS_SQL, q.INSERT_GPU_SYNCS_SQL):
            con.execute(sql, [run_id])
    finally:
        nesting.join()  # never leave the thread running past a failed insert
    prog.step("nesting ranges")
    nesting.store(con)
    con.execute(q.INSERT_RANGES_SQL, [run_id])
    docs, ranks, by_declared, counts = staged.docs, staged.ranks, staged.by_declared, staged.counts
    graph_launches = staged.graph_launches

    ds = next((d.decodescope for d in docs if d.decodescope is not None), None)
    capture_rows: list[list[Any]] = []
    for doc, rank in zip(docs, ranks):
        if doc.decodescope is not None:
            capture_rows.extend(_capture_map_rows(run_id, doc.decodescope, rank, doc.path))
    if capture_rows:
        con.executemany(q.INSERT_CAPTURE_MAP_SQL, capture_rows)

    handled = {f"{ph}/{cat}": n for ph, cat, n in counts if ph == "X" and cat in q.HANDLED_CATS}
    unhandled = {f"{ph}/{cat}": n for ph, cat, n in counts if not (ph == "X" and cat in q.HANDLED_CATS)}
    world_sizes = [d.dist.get("world_size") for d in docs if d.dist and isinstance(d.dist.get("world_size"), int)]
    metadata = {
        "files": [{"file": d.path.name, "rank": r, "base_time_ns": d.base_ns, "parsed_as": d.parsed_as,
                   "distributedInfo": d.dist, "deviceProperties": d.props} for d, r in zip(docs, ranks)],
        "rank_source": "distributedInfo.rank" if by_declared else "file order",
        "events": handled,
        "unhandled_events": unhandled,
        "graph_launches": graph_launches,
    }
    ds = ds or {}
    return RunMeta(
        world_size=max(world_sizes + [len(docs)]),
        variant=ds.get("variant"),
        config=ds or None,
        metadata=metadata,
        gpu=ds.get("gpu") or _gpu_name(docs[0].props),
        graph_mode=ds.get("graph_mode") if isinstance(ds.get("graph_mode"), bool) else None,
        tp_sim=ds.get("tp_sim") if isinstance(ds.get("tp_sim"), bool) else None,
    )
