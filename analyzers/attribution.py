"""Attribute every kernel and memop to (step, layer, op), eager and inside CUDA graphs.

The method is Nsight Systems' projection: an item belongs to the innermost annotation range
(NVTX or user annotation) that encloses, on the same thread, the host call that launched it,
found through the correlation id (analyzers/sql/attribution/by_range.sql). Graph-replayed
kernels share their graph launch's correlation and no range is open around them, so their
layer and op come from the capture map our tracer records (capture_map.sql), or, for foreign
traces, from aligning each replay's kernel names to an eager reference run of the same
workload (here, with difflib: names must match in order; what does not match is counted and
left unattributed). Their step is the step range enclosing the graph launch. Items whose
launch call is missing fall back to the GPU span of the layer they lie in, when exactly one
holds them (gpu_fallback.sql). The SQL does the work; this module binds the patterns, runs
the steps in order and writes the TEMP table `kernel_attribution`, whose columns are the
contract other analyses code against:

    run_id, rank, item_kind ('kernel'|'memop'), item_id, step, step_index (0-based per run and
    rank, NULL outside any step), layer, layer_index, layer_kind, op,
    method ('range'|'capture_map'|'reference'|'gpu_range'|'none'),
    capture_stream (the stream a graph kernel was captured on, from the capture map or the
    reference kernel it is aligned to, NULL otherwise: the order it follows in its replay,
    which kernels/exposed.sql needs because the graph executor picks the replay's streams)
"""
from __future__ import annotations

import difflib
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import duckdb
import pandas as pd

from analyzers.views import SQL_ROOT, _requires, ordered_sql_files
from tracer.errors import BadInput

# Our `L{idx}.{kind}` ranges and HF/vLLM module names (`model.layers.{idx}`, whose children
# `model.layers.{idx}.self_attn` name the layer too and give the op `self_attn`).
DEFAULT_LAYER_PATTERN = (
    r"(?:^|\W)(?P<layer>L\d+\.(?P<kind>[A-Za-z]\w*)|(?:\w+\.)*layers\.\d+)(?:\.|$)"
)
# Our `step` ranges win; the profiler's ProfilerStep#N is used on ranks that have none.
DEFAULT_STEP_PATTERN = r"^step(?:[^A-Za-z0-9].*|\d+)?$"
FALLBACK_STEP_PATTERN = r"^ProfilerStep#\d+$"
GRAPH_LAUNCH_PATTERN = r"(?i)graph_?launch"
METHODS = ("range", "capture_map", "reference", "gpu_range", "none")
MAX_LISTED_MISMATCHES = 20

KERNEL_ATTRIBUTION_DDL = """
CREATE TEMP TABLE IF NOT EXISTS kernel_attribution (
  run_id INTEGER, rank INTEGER, item_kind VARCHAR, item_id BIGINT, step VARCHAR,
  step_index INTEGER, layer VARCHAR, layer_index INTEGER, layer_kind VARCHAR, op VARCHAR,
  method VARCHAR, capture_stream BIGINT
)"""
# Work table: every item with its launch, the range-method result and a method column.
WORK_SQL = """
CREATE OR REPLACE TEMP TABLE _attr_work AS
SELECT *,
  CASE WHEN launched AND (step_index IS NOT NULL OR layer IS NOT NULL OR op IS NOT NULL)
    THEN 'range' ELSE 'none' END AS method,
  NULL::BIGINT AS capture_stream
FROM attribution_by_range('_attr_ann', '_attr_items')"""
# The runs' capture-map rows; `{stream}` is the column or NULL (_capture_map_rows_sql).
CAPTURE_MAP_ROWS_SQL = """
CREATE OR REPLACE TEMP TABLE _attr_gcm AS
SELECT run_id, rank, graph_id, node_order, graph_node_id, kernel_name, step_name, layer_name,
       op_name, {stream} AS capture_stream
FROM graph_capture_map WHERE list_contains(?, run_id)"""
HAS_CAPTURE_STREAM_SQL = """
SELECT count(*) FROM duckdb_columns()
WHERE NOT internal AND database_name <> 'temp' AND table_name = 'graph_capture_map'
  AND column_name = 'capture_stream'"""
# Verified capture-map replays overwrite layer and op (the step stays the launch's).
APPLY_CAPTURE_MAP_SQL = """
UPDATE _attr_work w SET
  layer = c.layer_name,
  layer_index = attribution_layer_index(c.layer_name, c.layer_name, ?, ?, ?),
  layer_kind = attribution_layer_kind(c.layer_name, c.layer_name, ?, ?, ?),
  op = c.op_name,
  method = 'capture_map',
  capture_stream = c.capture_stream
FROM _attr_cmap c
WHERE c.verified AND w.run_id = c.run_id AND w.item_kind = 'kernel' AND w.item_id = c.item_id"""
CAPTURE_SUMMARY_SQL = """
SELECT run_id, rank, correlation, map_graph_id, any_value(n_replay), any_value(n_map),
       any_value(n_equal), any_value(match),
       min(node_order) FILTER (WHERE expected_name IS DISTINCT FROM name) AS first_bad,
       arg_min(expected_name, node_order) FILTER (WHERE expected_name IS DISTINCT FROM name),
       arg_min(name, node_order) FILTER (WHERE expected_name IS DISTINCT FROM name)
FROM _attr_cmap GROUP BY ALL ORDER BY run_id, rank, correlation"""
REFERENCE_ROWS_SQL = """
SELECT rank, step_index, name, layer, layer_index, layer_kind, op, stream
FROM _attr_work
WHERE run_id = ? AND item_kind = 'kernel' AND step_index IS NOT NULL
ORDER BY rank, step_index, start_ns, item_id"""
REPLAY_ROWS_SQL = """
SELECT run_id, rank, correlation, item_id, name
FROM _attr_work
WHERE is_graph AND launched AND item_kind = 'kernel' AND method <> 'capture_map'
  AND run_id <> ? AND list_contains(?, run_id)
ORDER BY run_id, rank, correlation, start_ns, item_id"""
# Kernels the capture map attributed but could give no capture stream (maps written before it
# was recorded), per replay in start order: with a reference run, its stream fills the gap.
MAP_WITHOUT_STREAM_SQL = """
SELECT run_id, rank, correlation, item_id, name
FROM _attr_work
WHERE method = 'capture_map' AND item_kind = 'kernel' AND capture_stream IS NULL
  AND run_id <> ? AND list_contains(?, run_id)
ORDER BY run_id, rank, correlation, start_ns, item_id"""
APPLY_REFERENCE_STREAMS_SQL = """
UPDATE _attr_work w SET capture_stream = r.capture_stream
FROM _attr_ref_streams r
WHERE w.run_id = r.run_id AND w.item_kind = 'kernel' AND w.item_id = r.item_id"""
APPLY_REFERENCE_SQL = """
UPDATE _attr_work w SET
  layer = r.layer, layer_index = r.layer_index, layer_kind = r.layer_kind, op = r.op,
  method = 'reference', capture_stream = r.capture_stream
FROM _attr_ref r
WHERE w.run_id = r.run_id AND w.item_kind = 'kernel' AND w.item_id = r.item_id"""
APPLY_FALLBACK_SQL = """
UPDATE _attr_work w SET
  step = f.step, step_index = f.step_index, layer = f.layer, layer_index = f.layer_index,
  layer_kind = f.layer_kind, op = f.op, method = 'gpu_range'
FROM _attr_fb f
WHERE (f.step_index IS NOT NULL OR f.layer IS NOT NULL)
  AND w.run_id = f.run_id AND w.item_kind = f.item_kind AND w.item_id = f.item_id"""
# Items the GPU-span fallback could not place because several spans held them.
FALLBACK_AMBIGUOUS_SQL = """
SELECT run_id, count(*) FROM _attr_fb
WHERE n_layer_candidates > 1 OR (n_layer_candidates = 0 AND n_step_candidates > 1)
GROUP BY run_id"""
PUBLISH_SQL = """
INSERT INTO kernel_attribution
SELECT run_id, rank, item_kind, item_id, step, step_index, layer, layer_index, layer_kind, op,
       method, capture_stream
FROM _attr_work WHERE list_contains(?, run_id)
ORDER BY run_id, rank, item_kind, item_id"""
# Graph kernels attributed (capture map or reference) that got no capture stream: a map
# written before it was recorded and no reference. Their exposed start sees only the replay
# stream, so a PDL wait across replay streams stays in their op's busy time (kernels/exposed.sql).
WITHOUT_CAPTURE_STREAM = ("item_kind = 'kernel' AND method IN ('capture_map', 'reference') "
                          "AND capture_stream IS NULL")
RUN_SUMMARY_SQL = f"""
SELECT run_id, count(*) AS items,
  count(*) FILTER (WHERE item_kind = 'kernel') AS kernels,
  count(*) FILTER (WHERE NOT launched) AS unlaunched,
  count(*) FILTER (WHERE is_graph) AS graph_items,
  count(*) FILTER (WHERE NOT nested_ok) AS not_nested,
  count(*) FILTER (WHERE method = 'range') AS m_range,
  count(*) FILTER (WHERE method = 'capture_map') AS m_capture_map,
  count(*) FILTER (WHERE method = 'reference') AS m_reference,
  count(*) FILTER (WHERE method = 'gpu_range') AS m_gpu_range,
  count(*) FILTER (WHERE method = 'none') AS m_none,
  count(*) FILTER (WHERE layer IS NOT NULL) AS with_layer,
  count(*) FILTER (WHERE step_index IS NOT NULL) AS with_step,
  count(*) FILTER (WHERE {WITHOUT_CAPTURE_STREAM}) AS graph_without_stream
FROM _attr_work WHERE list_contains(?, run_id) GROUP BY run_id ORDER BY run_id"""


@dataclass
class LayerPattern:
    """A user regex with a named group `layer` (optional `kind`, `idx`), as group numbers."""

    regex: str
    layer_grp: int
    kind_grp: int | None
    idx_grp: int | None

    @classmethod
    def parse(cls, pattern: str | None) -> "LayerPattern":
        regex = pattern or DEFAULT_LAYER_PATTERN
        try:
            groups = re.compile(regex).groupindex
        except re.error as exc:
            raise BadInput("--layer-pattern", f"not a regular expression ({exc})") from None
        if "layer" not in groups:
            raise BadInput("--layer-pattern", "needs a named group (?P<layer>...)")
        return cls(regex, groups["layer"], groups.get("kind"), groups.get("idx"))

    def kind_args(self) -> list[Any]:
        return [self.regex, self.kind_grp is not None, self.kind_grp or self.layer_grp]

    def idx_args(self) -> list[Any]:
        return [self.regex, self.idx_grp is not None, self.idx_grp or self.layer_grp]


@dataclass
class RunAttribution:
    """How one run's items were attributed: counts per method and every verification result."""

    run_id: int
    items: int
    kernels: int
    by_method: dict[str, int]
    with_step: int
    with_layer: int
    unlaunched: int
    graph_items: int
    not_nested: int
    fallback_ambiguous: int = 0
    capture_map: dict[str, int] = field(default_factory=dict)
    reference: dict[str, int] = field(default_factory=dict)
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    graph_kernels_without_capture_stream: int = 0   # WITHOUT_CAPTURE_STREAM


@dataclass
class AttributionReport:
    """Per run: how many items each method attributed, and any alignment mismatches."""

    runs: dict[int, RunAttribution]
    layer_pattern: str
    step_pattern: str
    graph_reference: int | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer_pattern": self.layer_pattern,
            "step_pattern": self.step_pattern,
            "graph_reference": self.graph_reference,
            "runs": [asdict(r) for r in self.runs.values()],
        }

    @property
    def mismatch_count(self) -> int:
        """Replays (capture map) plus kernels (reference) that failed verification."""
        return sum(r.capture_map.get("replays_mismatched", 0)
                   + r.reference.get("kernels_unmatched", 0) for r in self.runs.values())


def load_sql(con: duckdb.DuckDBPyConnection, *areas: str) -> None:
    """Create the macros of the given analyzers/sql areas (and what they require) on `con`.

    Only these files, not every analysis: attribution must not fail because another area's
    SQL does. TEMP objects on a read-only store, as analyzers.views.load_views does.
    """
    need = {p for p in ordered_sql_files() if p.parent in {SQL_ROOT / a for a in areas}}
    todo = list(need)
    while todo:                          # and every file they require, transitively
        for rel in _requires(todo.pop().read_text()):
            dep = SQL_ROOT / rel
            if dep not in need:
                need.add(dep)
                todo.append(dep)
    files = [p for p in ordered_sql_files() if p in need or p.parent.name == "intervals"]
    read_only = bool(con.execute(
        "SELECT readonly FROM duckdb_databases() WHERE database_name = current_database()"
    ).fetchall()[0][0])
    for path in files:
        text = path.read_text()
        if read_only:
            text = text.replace("CREATE OR REPLACE VIEW", "CREATE OR REPLACE TEMP VIEW")
            text = text.replace("CREATE OR REPLACE MACRO", "CREATE OR REPLACE TEMP MACRO")
        con.execute(text)


def attribute(con: duckdb.DuckDBPyConnection, run_ids: list[int] | None = None,
              layer_pattern: str | None = None, step_pattern: str | None = None,
              graph_reference: int | None = None) -> AttributionReport:
    """Attribute the items of `run_ids` (all runs when None) and (re)write their rows of the
    TEMP table `kernel_attribution`; rows of other runs stay as they were.

    `graph_reference` is the run_id of an eager run of the same workload, used to attribute
    graph replays that have no capture map.
    """
    load_sql(con, "attribution")
    all_runs = [r[0] for r in con.execute("SELECT run_id FROM runs ORDER BY run_id").fetchall()]
    ids = list(all_runs if run_ids is None else run_ids)
    unknown = [i for i in ids + ([graph_reference] if graph_reference is not None else [])
               if i not in all_runs]
    if unknown:
        raise BadInput("--run", f"no run {unknown[0]} in this store (runs: {all_runs})")
    work_ids = sorted(set(ids) | ({graph_reference} if graph_reference is not None else set()))
    lp = LayerPattern.parse(layer_pattern)
    steps = [step_pattern, step_pattern] if step_pattern else [DEFAULT_STEP_PATTERN,
                                                               FALLBACK_STEP_PATTERN]
    if step_pattern:
        try:
            re.compile(step_pattern)
        except re.error as exc:
            raise BadInput("--step-pattern", f"not a regular expression ({exc})") from None

    try:
        con.execute(
            "CREATE OR REPLACE TEMP TABLE _attr_ann AS SELECT * FROM "
            "attribution_annotations(?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [work_ids, *steps, lp.regex, lp.layer_grp, *lp.kind_args()[1:], *lp.idx_args()[1:]])
    except duckdb.Error as exc:  # RE2 rejects some of what Python's re accepts
        raise BadInput("--layer-pattern", f"not usable by DuckDB's RE2 ({str(exc).splitlines()[0]})") from None
    con.execute("CREATE OR REPLACE TEMP TABLE _attr_items AS SELECT * FROM attribution_items(?, ?)",
                [work_ids, GRAPH_LAUNCH_PATTERN])
    con.execute(WORK_SQL)

    con.execute(_capture_map_rows_sql(con), [work_ids])
    con.execute("CREATE OR REPLACE TEMP TABLE _attr_cmap AS "
                "SELECT * FROM attribution_capture_map('_attr_work', '_attr_gcm', ?)", [work_ids])
    con.execute(APPLY_CAPTURE_MAP_SQL, [*lp.idx_args(), *lp.kind_args()])
    capture = _capture_summary(con)

    reference: dict[int, dict[str, Any]] = {}
    if graph_reference is not None:
        reference = _apply_reference(con, graph_reference, work_ids, lp)
        _streams_from_reference(con, graph_reference, work_ids, reference)

    con.execute("CREATE OR REPLACE TEMP TABLE _attr_fb AS "
                "SELECT * FROM attribution_gpu_fallback('_attr_work')")
    con.execute(APPLY_FALLBACK_SQL)

    con.execute(KERNEL_ATTRIBUTION_DDL)
    con.execute("DELETE FROM kernel_attribution WHERE list_contains(?, run_id)", [work_ids])
    con.execute(PUBLISH_SQL, [work_ids])
    return _report(con, work_ids, capture, reference, lp.regex, steps[0], graph_reference)


def _capture_map_rows_sql(con: duckdb.DuckDBPyConnection) -> str:
    """The statement that copies the runs' capture-map rows into `_attr_gcm`, with
    capture_stream NULL where the store predates that column (a store opened read-only is not
    migrated by tracer/schema.sql's ALTER)."""
    has_stream = con.execute(HAS_CAPTURE_STREAM_SQL).fetchall()[0][0] > 0
    return CAPTURE_MAP_ROWS_SQL.format(stream="capture_stream" if has_stream else "NULL::BIGINT")


def _capture_summary(con: duckdb.DuckDBPyConnection) -> dict[int, dict[str, Any]]:
    """Per run: replays matched against the capture map, verified or not, with examples."""
    out: dict[int, dict[str, Any]] = {}
    for (run_id, rank, corr, graph, n_replay, n_map, n_equal, match, first_bad, exp,
         found) in con.execute(CAPTURE_SUMMARY_SQL).fetchall():
        s = out.setdefault(run_id, {"replays": 0, "replays_verified": 0, "replays_reordered": 0,
                                    "replays_mismatched": 0, "kernels_attributed": 0,
                                    "mismatches": []})
        s["replays"] += 1
        if match is not None:
            s["replays_verified"] += 1
            s["replays_reordered"] += match == "reordered"
            s["kernels_attributed"] += n_replay
            continue
        s["replays_mismatched"] += 1
        if len(s["mismatches"]) < MAX_LISTED_MISMATCHES:
            s["mismatches"].append({
                "method": "capture_map", "rank": rank, "correlation": corr, "graph_id": graph,
                "kernels": n_replay, "map_nodes": n_map, "names_equal": n_equal,
                "first_mismatch": first_bad, "expected": exp, "found": found})
    return out


def _reference_sequence(con: duckdb.DuckDBPyConnection, ref_run: int) -> pd.DataFrame:
    """The reference step: the most common per-step kernel-name sequence of the eager run
    (steady state), earliest such step on the lowest rank, as rows (name, layer, ..., op)."""
    rows = con.execute(REFERENCE_ROWS_SQL, [ref_run]).df()
    if rows.empty:
        raise BadInput("--graph-reference", f"run {ref_run} has no kernels inside steps")
    rows = rows[rows["rank"] == rows["rank"].min()]
    by_step = {s: g for s, g in rows.groupby("step_index", sort=True)}
    seqs = Counter(tuple(g["name"]) for g in by_step.values())
    best = seqs.most_common(1)[0][0]
    for g in by_step.values():
        if tuple(g["name"]) == best:
            return g.reset_index(drop=True)
    raise AssertionError("unreachable")


def _occurrences(names: Iterable[str]) -> list[tuple[str, int]]:
    """(name, occurrence) of each name in order: the k-th `X` is (X, k), 1-based. The key by
    which replays whose concurrent streams started in another order are matched."""
    seen: Counter[str] = Counter()
    out = []
    for name in names:
        seen[name] += 1
        out.append((name, seen[name]))
    return out


def _align(ref_names: list[str], names: tuple[str, ...],
           ref_occ: dict[tuple[str, int], int]) -> tuple[list[int | None], bool]:
    """Reference position of each replayed kernel (None: unmatched) and whether the match is by
    (name, occurrence) because the order differs (see _apply_reference)."""
    if list(names) != ref_names and Counter(names) == Counter(ref_names):
        return [ref_occ[key] for key in _occurrences(names)], True
    pos: list[int | None] = [None] * len(names)
    sm = difflib.SequenceMatcher(None, ref_names, list(names), autojunk=False)
    for a, b, size in sm.get_matching_blocks():
        for k in range(size):
            pos[b + k] = a + k
    return pos, False


def _apply_reference(con: duckdb.DuckDBPyConnection, ref_run: int, work_ids: list[int],
                     lp: LayerPattern) -> dict[int, dict[str, Any]]:
    """Align each graph replay's kernel names to the reference step (difflib, no junk
    heuristic); kernels in matching blocks take the reference kernel's layer and op. A replay
    whose names equal the reference step's as a multiset but not in order (kernels on
    concurrent streams started in another order, e.g. the fused step's side stream) is matched
    by (name, occurrence) instead, as the capture map is (attribution/capture_map.sql), and
    counted apart as reordered. A matched kernel also takes the reference kernel's stream as its
    capture stream: the eager step ran the chain in the order the graph captured it."""
    ref = _reference_sequence(con, ref_run)
    ref_names = list(ref["name"])
    ref_occ = {key: i for i, key in enumerate(_occurrences(ref_names))}
    replays = con.execute(REPLAY_ROWS_SQL, [ref_run, work_ids]).df()
    out: dict[int, dict[str, Any]] = {}
    cache: dict[tuple[str, ...], list[int | None]] = {}
    picked_items: list[int] = []
    picked_runs: list[int] = []
    picked_ref: list[int] = []
    for (run_id, rank, corr), g in replays.groupby(["run_id", "rank", "correlation"], sort=True):
        names = tuple(g["name"])
        if names not in cache:
            cache[names] = _align(ref_names, names, ref_occ)
        pos, reordered = cache[names]
        s = out.setdefault(int(run_id), {"replays": 0, "replays_exact": 0, "replays_reordered": 0,
                                         "kernels_matched": 0, "kernels_unmatched": 0,
                                         "reference_kernels": len(ref_names), "mismatches": []})
        s["replays"] += 1
        unmatched = sum(p is None for p in pos)
        s["kernels_matched"] += len(pos) - unmatched
        s["kernels_unmatched"] += unmatched
        if unmatched == 0:
            s["replays_reordered" if reordered else "replays_exact"] += 1
        elif len(s["mismatches"]) < MAX_LISTED_MISMATCHES:
            first = next(i for i, p in enumerate(pos) if p is None)
            s["mismatches"].append({"method": "reference", "rank": int(rank), "correlation": int(corr),
                                    "kernels": len(pos), "unmatched": unmatched,
                                    "first_mismatch": first, "found": names[first]})
        for item_id, p in zip(g["item_id"], pos):
            if p is not None:
                picked_runs.append(int(run_id))
                picked_items.append(int(item_id))
                picked_ref.append(p)
    sel = ref.iloc[picked_ref].reset_index(drop=True) if picked_ref else ref.iloc[0:0]
    frame = pd.DataFrame({
        "run_id": pd.Series(picked_runs, dtype="int64"),
        "item_id": pd.Series(picked_items, dtype="int64"),
        "layer": sel["layer"].astype(object), "layer_index": sel["layer_index"].astype("Int64"),
        "layer_kind": sel["layer_kind"].astype(object), "op": sel["op"].astype(object),
        "capture_stream": sel["stream"].astype("Int64"),
    })
    con.register("_attr_ref_df", frame)
    con.execute("CREATE OR REPLACE TEMP TABLE _attr_ref AS SELECT run_id, item_id, "
                "CAST(layer AS VARCHAR) AS layer, CAST(layer_index AS INTEGER) AS layer_index, "
                "CAST(layer_kind AS VARCHAR) AS layer_kind, CAST(op AS VARCHAR) AS op, "
                "CAST(capture_stream AS BIGINT) AS capture_stream FROM _attr_ref_df")
    con.unregister("_attr_ref_df")
    con.execute(APPLY_REFERENCE_SQL)
    return out


def _streams_from_reference(con: duckdb.DuckDBPyConnection, ref_run: int, work_ids: list[int],
                            reference: dict[int, dict[str, Any]]) -> None:
    """Capture streams for kernels the capture map attributed without one (maps written before
    the tracer recorded it), from the reference step: the k-th kernel named X of a replay takes
    the stream of the reference step's k-th kernel named X, as the capture map's own
    (name, occurrence) match does. A replay whose (name, occurrence) pairs are not all in the
    reference step gets none. Counted per run as reference["capture_streams_filled"]."""
    rows = con.execute(MAP_WITHOUT_STREAM_SQL, [ref_run, work_ids]).df()
    if rows.empty:
        return
    ref = _reference_sequence(con, ref_run)
    ref_stream = dict(zip(_occurrences(ref["name"]), ref["stream"]))
    runs: list[int] = []
    items: list[int] = []
    streams: list[int] = []
    for (run_id, _rank, _corr), g in rows.groupby(["run_id", "rank", "correlation"], sort=True):
        found = [ref_stream.get(k) for k in _occurrences(g["name"])]
        if any(f is None or pd.isna(f) for f in found):
            continue
        runs += [int(run_id)] * len(found)
        items += [int(i) for i in g["item_id"]]
        streams += [int(f) for f in found]
    for run_id in set(runs):
        reference.setdefault(run_id, {})["capture_streams_filled"] = runs.count(run_id)
    frame = pd.DataFrame({"run_id": pd.Series(runs, dtype="int64"), "item_id": pd.Series(items, dtype="int64"),
                          "capture_stream": pd.Series(streams, dtype="int64")})
    con.register("_attr_ref_streams_df", frame)
    con.execute("CREATE OR REPLACE TEMP TABLE _attr_ref_streams AS SELECT * FROM _attr_ref_streams_df")
    con.unregister("_attr_ref_streams_df")
    con.execute(APPLY_REFERENCE_STREAMS_SQL)


def _report(con: duckdb.DuckDBPyConnection, work_ids: list[int],
            capture: dict[int, dict[str, Any]], reference: dict[int, dict[str, Any]],
            layer_regex: str, step_regex: str, graph_reference: int | None) -> AttributionReport:
    runs: dict[int, RunAttribution] = {}
    ambiguous = dict(con.execute(FALLBACK_AMBIGUOUS_SQL).fetchall())
    for row in con.execute(RUN_SUMMARY_SQL, [work_ids]).fetchall():
        (run_id, items, kernels, unlaunched, graph_items, not_nested, *by, with_layer,
         with_step, graph_without_stream) = row
        cap = dict(capture.get(run_id, {}))
        ref = dict(reference.get(run_id, {}))
        mismatches = cap.pop("mismatches", []) + ref.pop("mismatches", [])
        runs[run_id] = RunAttribution(
            run_id=run_id, items=items, kernels=kernels, by_method=dict(zip(METHODS, by)),
            with_step=with_step, with_layer=with_layer, unlaunched=unlaunched,
            graph_items=graph_items, not_nested=not_nested,
            fallback_ambiguous=ambiguous.get(run_id, 0), capture_map=cap, reference=ref,
            mismatches=mismatches, graph_kernels_without_capture_stream=graph_without_stream)
    for run_id in work_ids:
        runs.setdefault(run_id, RunAttribution(run_id, 0, 0, dict.fromkeys(METHODS, 0), 0, 0, 0,
                                               0, 0))
    return AttributionReport(runs, layer_regex, step_regex, graph_reference)
