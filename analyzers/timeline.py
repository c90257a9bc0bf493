"""Timeline data for one rank of one run, cut to a time window on the server.

Question: which kernels ran on which stream between t0 and t1, where was the device idle,
and which layer was running? A million-kernel run cannot be shipped to a browser, so a window
holding more than `cap` kernels comes back aggregated into equal time bins per stream instead
(`mode == "binned"`); zooming in narrows the window until the raw kernels fit. The SQL is in
`analyzers/sql/timeline/timeline.sql` (macros taking bound parameters).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import duckdb
import pandas as pd

from analyzers.attribution import DEFAULT_LAYER_PATTERN

# Layer names: the attribution's default (`L3.mla`, `model.layers.3`), so the timeline's bands
# are the ones the other pages count; steps are the attribution's own (see steps()).
DEFAULT_LAYER_REGEX = DEFAULT_LAYER_PATTERN
DEFAULT_CAP = 3_000     # raw kernels above this come binned (the browser draws ~10k segments smoothly)
DEFAULT_BINS = 500      # bins per stream in a binned window

# Device-side layer bands from the attribution table (kernel_attribution, TEMP, built by
# analyzers.attribution.attribute): per step and layer, first start to last end of the
# layer's kernels that overlap the window.
ATTRIBUTION_BANDS_SQL = """
SELECT a.layer, a.step_index, min(k.start_ns) AS start_ns, max(k.end_ns) AS end_ns
FROM kernel_attribution AS a
JOIN kernels AS k
  ON k.run_id = a.run_id AND k.rank = a.rank AND k.kernel_id = a.item_id
WHERE a.item_kind = 'kernel' AND a.run_id = $run AND a.rank = $rank AND a.layer IS NOT NULL
  AND k.end_ns > $t0 AND k.start_ns < $t1
GROUP BY a.layer, a.step_index
ORDER BY start_ns
"""


@dataclass(frozen=True)
class Window:
    """What the timeline draws for [start_ns, end_ns): raw kernels or per-stream bins."""

    run_id: int
    rank: int
    start_ns: int
    end_ns: int
    total_kernels: int      # kernels overlapping the window, before any aggregation
    mode: str               # 'kernels' (one row per kernel) or 'binned' (one row per stream and bin)
    rows: pd.DataFrame
    idle: pd.DataFrame      # device-idle intervals (start_ns, end_ns, gap_ns); only in 'kernels' mode


def extent(con: duckdb.DuckDBPyConnection, run_id: int, rank: int = 0) -> dict[str, int] | None:
    """First kernel start, last kernel end, kernel and stream counts of a rank; None if no kernels."""
    row = con.execute("SELECT * FROM timeline_extent($run, $rank)", {"run": run_id, "rank": rank}).fetchall()[0]
    if row[2] == 0:
        return None
    return {"first_start_ns": int(row[0]), "last_end_ns": int(row[1]), "kernels": int(row[2]),
            "streams": int(row[3])}


# A run without any host annotation range (the only input a step can come from: see
# attribution_annotations) has no steps; saying so skips attributing it (1M kernels: ~1.2 s).
HAS_ANNOTATIONS_SQL = """
SELECT EXISTS (SELECT 1 FROM ranges WHERE run_id = $run AND kind IN ('nvtx', 'user_annotation'))
"""
NO_STEPS_SQL = """
SELECT CAST(NULL AS INTEGER) AS step_index, CAST(NULL AS VARCHAR) AS name,
       CAST(NULL AS BIGINT) AS dev_start_ns, CAST(NULL AS BIGINT) AS dev_end_ns,
       CAST(NULL AS BIGINT) AS kernels
LIMIT 0
"""


def steps(con: duckdb.DuckDBPyConnection, run_id: int, rank: int = 0) -> pd.DataFrame:
    """The decode steps of a rank (step_index, name, dev_start_ns, dev_end_ns, kernels).

    One definition of a step: these are kernel_attribution's steps (see timeline_steps), so the
    first call for a run on `con` attributes it (TEMP table, kept for later calls, as
    layer_bands does); a run attributed earlier on `con` with a --step-pattern keeps it.
    """
    if not _attributed(con, run_id):
        if not con.execute(HAS_ANNOTATIONS_SQL, {"run": run_id}).fetchall()[0][0]:
            return con.execute(NO_STEPS_SQL).df()
        from analyzers.attribution import attribute

        attribute(con, run_ids=[run_id])
    return con.execute("SELECT * FROM timeline_steps('kernel_attribution', $run, $rank)",
                       {"run": run_id, "rank": rank}).df()


def ranks(con: duckdb.DuckDBPyConnection, run_id: int) -> list[int]:
    """The ranks that have kernels in a run."""
    rows = con.execute("SELECT DISTINCT rank FROM kernels WHERE run_id = $run ORDER BY rank",
                       {"run": run_id}).fetchall()
    return [int(r[0]) for r in rows]


def window(con: duckdb.DuckDBPyConnection, run_id: int, rank: int, start_ns: int, end_ns: int,
           cap: int = DEFAULT_CAP, bins: int = DEFAULT_BINS) -> Window:
    """The kernels of [start_ns, end_ns), or their per-stream bins when more than `cap` overlap it."""
    start_ns, end_ns = int(start_ns), int(end_ns)
    if end_ns <= start_ns:
        raise ValueError(f"empty window [{start_ns}, {end_ns})")
    params = {"run": run_id, "rank": rank, "t0": start_ns, "t1": end_ns}
    total = int(con.execute("SELECT kernels FROM timeline_window_count($run, $rank, $t0, $t1)",
                            params).fetchall()[0][0])
    if total <= cap:
        rows = con.execute("SELECT * FROM timeline_window_kernels($run, $rank, $t0, $t1)", params).df()
        idle = con.execute("SELECT * FROM timeline_window_idle($run, $rank, $t0, $t1)", params).df()
        return Window(run_id, rank, start_ns, end_ns, total, "kernels", rows, idle)
    rows = con.execute("SELECT * FROM timeline_window_bins($run, $rank, $t0, $t1, $bins)",
                       {**params, "bins": int(bins)}).df()
    idle = pd.DataFrame({"start_ns": pd.Series(dtype="int64"), "end_ns": pd.Series(dtype="int64"),
                         "gap_ns": pd.Series(dtype="int64")})
    return Window(run_id, rank, start_ns, end_ns, total, "binned", rows, idle)


def layer_bands(con: duckdb.DuckDBPyConnection, run_id: int, rank: int, start_ns: int, end_ns: int,
                layer_regex: str = DEFAULT_LAYER_REGEX) -> pd.DataFrame:
    """Device-side layer bands (layer, start_ns, end_ns) overlapping the window.

    From the profiler's gpu_user_annotation projections when the trace has them; otherwise
    from analyzers.attribution (launch ranges, or the capture map for CUDA-graph replays, which
    have no projections). The attribution TEMP table lives on `con`, so a pooled connection
    attributes a run once (runs never change after ingest). Empty when neither applies.
    """
    params = {"run": run_id, "rank": rank, "t0": int(start_ns), "t1": int(end_ns)}
    bands = con.execute("SELECT * FROM timeline_window_annotation_bands($run, $rank, $t0, $t1, $re)",
                        {**params, "re": layer_regex}).df()
    if len(bands):
        return bands
    if not _has_layers(con, run_id, layer_regex):
        return bands
    if not _attributed(con, run_id):
        from analyzers.attribution import attribute

        attribute(con, run_ids=[run_id], layer_pattern=layer_regex)
    return con.execute(ATTRIBUTION_BANDS_SQL, params).df()[["layer", "start_ns", "end_ns"]]


HAS_LAYERS_SQL = """
SELECT EXISTS (SELECT 1 FROM ranges WHERE run_id = $run AND regexp_matches(name, $re))
    OR EXISTS (SELECT 1 FROM graph_capture_map WHERE run_id = $run AND layer_name IS NOT NULL)
"""


def _has_layers(con: duckdb.DuckDBPyConnection, run_id: int, layer_regex: str) -> bool:
    """Whether attribution could find any layer in the run (a layer-named range or a capture map)."""
    return bool(con.execute(HAS_LAYERS_SQL, {"run": run_id, "re": layer_regex}).fetchall()[0][0])


# Bubbles (analyzers.bubbles: device-idle intervals inside a step, each with its cause) that
# overlap the window. bubbles_in_steps classifies a whole run (~0.02 s for a bundled run), too
# slow per zoom: a run's bubbles are copied once into a TEMP table of the connection (runs never
# change after ingest), as attribution keeps kernel_attribution, and windows read that table.
# The macro reads only the run asked for (p_run), so its cost does not grow with the other runs
# of the store (a bundled run next to a 1M-kernel run: 0.44-0.81 s with a filter after the
# macro, 0.02 s with p_run).
BUBBLE_CACHE_DDL = """
CREATE TEMP TABLE IF NOT EXISTS _timeline_bubble_runs (run_id INTEGER);
CREATE TEMP TABLE IF NOT EXISTS _timeline_bubbles (
  run_id INTEGER, rank INTEGER, start_ns BIGINT, end_ns BIGINT, gap_ns BIGINT, cause VARCHAR,
  prev_name VARCHAR, next_name VARCHAR, layer VARCHAR, op VARCHAR)
"""
BUBBLE_CACHED_SQL = "SELECT count(*) FROM _timeline_bubble_runs WHERE run_id = $run"
BUBBLE_FILL_SQL = """
INSERT INTO _timeline_bubbles
SELECT run_id, rank, start_ns, end_ns, gap_ns, cause, prev_name, next_name, layer, op
FROM bubbles_in_steps('kernel_attribution', p_run := $run)
"""
BUBBLE_MARK_SQL = "INSERT INTO _timeline_bubble_runs VALUES ($run)"
BUBBLES_IN_WINDOW_SQL = """
SELECT start_ns, end_ns, gap_ns, cause, prev_name, next_name, layer, op
FROM _timeline_bubbles
WHERE run_id = $run AND rank = $rank AND end_ns > $t0 AND start_ns < $t1
ORDER BY start_ns
"""


def bubble_causes(con: duckdb.DuckDBPyConnection, run_id: int, rank: int, start_ns: int,
                  end_ns: int) -> pd.DataFrame | None:
    """The run's bubbles with their cause that overlap the window (start_ns, end_ns, gap_ns,
    cause, prev_name, next_name, layer, op), or None when the bubbles analyzer is missing from
    this build. The first call for a run on `con` classifies that run only (and builds its
    attribution if needed); later windows read the connection's TEMP copy."""
    try:
        import analyzers.bubbles  # noqa: F401  (its SQL area is what we query)
        from analyzers.attribution import attribute, load_sql
    except ImportError:
        return None
    con.execute(BUBBLE_CACHE_DDL)
    if not con.execute(BUBBLE_CACHED_SQL, {"run": run_id}).fetchall()[0][0]:
        load_sql(con, "temporal", "launch", "bubbles")
        if not _attributed(con, run_id):
            attribute(con, run_ids=[run_id])
        con.execute(BUBBLE_FILL_SQL, {"run": run_id})
        con.execute(BUBBLE_MARK_SQL, {"run": run_id})
    return con.execute(BUBBLES_IN_WINDOW_SQL, {"run": run_id, "rank": rank, "t0": int(start_ns),
                                               "t1": int(end_ns)}).df()


def _attributed(con: duckdb.DuckDBPyConnection, run_id: int) -> bool:
    """Whether `con` already holds kernel_attribution rows of this run."""
    if not _has_table(con, "kernel_attribution"):
        return False
    rows = con.execute("SELECT count(*) FROM kernel_attribution WHERE run_id = $run", {"run": run_id}).fetchall()
    return bool(rows[0][0])


def _has_table(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    rows = con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = $n", {"n": name}).fetchall()
    return bool(rows[0][0])


# -- the kernels table: one page of a run's kernels, sorted and filtered in the store --------
# Identifiers come from these fixed lists; every value is a bound parameter.
KERNEL_COLUMNS = ("kernel_id", "rank", "stream", "name", "category", "start_ns", "end_ns", "dur_ns",
                  "correlation", "grid_x", "block_x", "registers_per_thread", "shared_mem_bytes")
_TEXT_OPS = {"contains": ("ILIKE", "%{}%"), "notContains": ("NOT ILIKE", "%{}%"),
             "equals": ("=", "{}"), "notEqual": ("<>", "{}"),
             "startsWith": ("ILIKE", "{}%"), "endsWith": ("ILIKE", "%{}")}
_NUMBER_OPS = {"equals": "=", "notEqual": "<>", "greaterThan": ">", "greaterThanOrEqual": ">=",
               "lessThan": "<", "lessThanOrEqual": "<="}
KERNEL_ROWS_SQL = """
SELECT * FROM (
  SELECT kernel_id, rank, stream, name, category, start_ns, end_ns, end_ns - start_ns AS dur_ns,
         correlation, grid_x, block_x, registers_per_thread, shared_mem_bytes
  FROM kernels WHERE run_id = $run
) WHERE {where}
ORDER BY {order}
LIMIT $limit OFFSET $offset
"""
KERNEL_COUNT_SQL = """
SELECT count(*) FROM (
  SELECT kernel_id, rank, stream, name, category, start_ns, end_ns, end_ns - start_ns AS dur_ns,
         correlation, grid_x, block_x, registers_per_thread, shared_mem_bytes
  FROM kernels WHERE run_id = $run
) WHERE {where}
"""


def kernel_rows(con: duckdb.DuckDBPyConnection, run_id: int, offset: int, limit: int,
                sort: list[dict[str, str]], filters: dict[str, dict[str, Any]]) -> tuple[pd.DataFrame, int]:
    """Rows [offset, offset+limit) of a run's kernels and how many match, for a paged grid.

    `sort` and `filters` are AG Grid's sortModel and filterModel: [{"colId", "sort"}] and
    {col: {"filterType": "text"|"number", "type": op, "filter": value}}. Unknown columns or
    operators raise ValueError rather than being ignored.
    """
    where, params = ["TRUE"], {"run": run_id}
    for i, (col, spec) in enumerate(sorted(filters.items())):
        if col not in KERNEL_COLUMNS:
            raise ValueError(f"unknown kernel column {col!r}")
        op, key = spec.get("type", "contains"), f"f{i}"
        if spec.get("filterType") == "number":
            if op not in _NUMBER_OPS:
                raise ValueError(f"unsupported number filter {op!r}")
            where.append(f"{col} {_NUMBER_OPS[op]} ${key}")
            params[key] = int(spec["filter"])
        else:
            if op not in _TEXT_OPS:
                raise ValueError(f"unsupported text filter {op!r}")
            sql_op, pattern = _TEXT_OPS[op]
            where.append(f"CAST({col} AS VARCHAR) {sql_op} ${key}")
            params[key] = pattern.format(str(spec.get("filter", "")))
    order = []
    for s in sort:
        if s.get("colId") not in KERNEL_COLUMNS or s.get("sort") not in ("asc", "desc"):
            raise ValueError(f"bad sort {s!r}")
        order.append(f"{s['colId']} {s['sort'].upper()}")
    order.append("kernel_id")
    clause = " AND ".join(where)
    total = int(con.execute(KERNEL_COUNT_SQL.format(where=clause), params).fetchall()[0][0])
    rows = con.execute(KERNEL_ROWS_SQL.format(where=clause, order=", ".join(order)),
                       {**params, "limit": int(limit), "offset": int(offset)}).df()
    return rows, total
