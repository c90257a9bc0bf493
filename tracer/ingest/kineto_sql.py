"""SQL of the Kineto reader, as named constants beside the code that runs them.

Times: Kineto writes `ts`/`dur` in µs with up to three decimals, relative to
`baseTimeNanoseconds` when the trace has one. They are read as DECIMAL(38,3) (exact at any
size; DOUBLE is not exact above ~4.4e12 µs) and turned into BIGINT ns once, here.
Values are bound parameters; the only text spliced in is built from the fixed lists below.
"""
from __future__ import annotations

# Every top-level key the reader uses, with an explicit schema (no inference: faster, exact).
DOC_COLUMNS = (
    "{'traceEvents': 'STRUCT(ph VARCHAR, cat VARCHAR, name VARCHAR, ts DECIMAL(38,3), "
    "dur DECIMAL(38,3), pid VARCHAR, tid VARCHAR, args JSON)[]', "
    "'baseTimeNanoseconds': 'VARCHAR', 'distributedInfo': 'JSON', 'deviceProperties': 'JSON', "
    "'decodescope': 'JSON'}"
)

# Chunk files written by kineto_split: JSON arrays of events, read in parallel, file order kept.
EVENT_COLUMNS = ("{'ph': 'VARCHAR', 'cat': 'VARCHAR', 'name': 'VARCHAR', 'ts': 'DECIMAL(38,3)', "
                 "'dur': 'DECIMAL(38,3)', 'pid': 'VARCHAR', 'tid': 'VARCHAR', 'args': 'JSON'}")
INSERT_CHUNK_EVENTS_SQL = f"""
INSERT INTO _kineto_ev
SELECT ? AS file_idx, ? AS rank, ph, lower(cat), coalesce(name, ''),
       ? + CAST(ts * 1000 AS BIGINT), CAST(dur * 1000 AS BIGINT), pid, tid, args
FROM read_json(?, format='array', records=true, maximum_object_size=134217728, columns={EVENT_COLUMNS})
"""

# One file's document: a single row (more rows means the top level was not one object).
READ_DOC_SQL = f"""
CREATE OR REPLACE TEMP TABLE _kineto_doc AS
SELECT traceEvents AS events, baseTimeNanoseconds AS base, distributedInfo AS dist,
       deviceProperties AS props, decodescope AS ds
FROM read_json(?, format='unstructured', records=true, maximum_object_size=2147483647,
               columns={DOC_COLUMNS})
"""

DOC_FACTS_SQL = """
SELECT count(*) AS n_rows,
       any_value(events IS NULL) AS no_events,
       any_value(base) AS base,
       any_value(CAST(dist AS VARCHAR)) AS dist,
       any_value(CAST(props AS VARCHAR)) AS props,
       any_value(CAST(ds AS VARCHAR)) AS ds
FROM _kineto_doc
"""

# Every event of the run. Files are appended one statement each, in order, and DuckDB keeps
# insertion order, so `rowid` is the event's position: it breaks ties between equal times and
# names the offending event in errors (a row_number() window here would make the parallel
# JSON read single-threaded).
CREATE_EVENTS_SQL = """
CREATE OR REPLACE TEMP TABLE _kineto_ev (
  file_idx INTEGER, rank INTEGER, ph VARCHAR, cat VARCHAR, name VARCHAR,
  start_ns BIGINT, dur_ns BIGINT, pid VARCHAR, tid VARCHAR, args JSON
)
"""

# All events of one file, in file order; `cat` lower-cased (versions differ in case).
INSERT_EVENTS_SQL = """
INSERT INTO _kineto_ev
SELECT ? AS file_idx, ? AS rank, e.ev.ph, lower(e.ev.cat), coalesce(e.ev.name, ''),
       ? + CAST(e.ev.ts * 1000 AS BIGINT), CAST(e.ev.dur * 1000 AS BIGINT),
       e.ev.pid, e.ev.tid, e.ev.args
FROM (SELECT unnest(events) AS ev FROM _kineto_doc) AS e
"""

# Complete events that break the format: negative duration, or no timestamp.
BAD_EVENT_SQL = """
SELECT file_idx, rowid - (SELECT min(rowid) FROM _kineto_ev AS f WHERE f.file_idx = b.file_idx) AS idx,
       name, dur_ns, start_ns IS NULL AS no_ts
FROM _kineto_ev AS b
WHERE ph = 'X' AND (dur_ns < 0 OR start_ns IS NULL)
ORDER BY rowid
LIMIT 1
"""

EVENT_COUNTS_SQL = """
SELECT coalesce(ph, '') AS ph, coalesce(cat, '') AS cat, count(*) AS n
FROM _kineto_ev GROUP BY ALL ORDER BY n DESC, ph, cat
"""

# Which (ph, lower(cat)) pairs land in which table. Anything else is counted in metadata.
KERNEL_CATS = ("kernel",)
MEMCPY_CATS = ("gpu_memcpy", "memcpy")
MEMSET_CATS = ("gpu_memset", "memset")
RUNTIME_CATS = ("cuda_runtime", "runtime", "hip_runtime")
DRIVER_CATS = ("cuda_driver", "driver", "hip_driver")
RANGE_CATS = {"user_annotation": "user_annotation", "cpu_op": "cpu_op",
              "python_function": "python_function", "nvtx": "nvtx"}
GPU_ANNOTATION_CATS = ("gpu_user_annotation",)
SYNC_CATS = ("cuda_sync",)

# args keys as Kineto versions spell them (they differ in case and spacing).
ARG_KEYS: dict[str, tuple[str, ...]] = {
    "correlation": ("correlation", "Correlation", "correlation id", "Correlation ID"),
    "stream": ("stream", "Stream"),
    "device": ("device", "Device"),
    "external_id": ("External id", "External ID", "external id", "external_id"),
    "grid": ("grid", "Grid"),
    "block": ("block", "Block"),
    "registers": ("registers per thread", "Registers Per Thread", "registers_per_thread"),
    "shared_mem": ("shared memory", "Shared Memory", "shared_memory"),
    "bytes": ("bytes", "Bytes"),
    "graph_id": ("graph id", "Graph id", "Graph ID", "graph_id", "graphId"),
    "graph_node_id": ("graph node id", "Graph node id", "graph_node_id", "graphNodeId"),
    "wait_on_stream": ("wait_on_stream", "wait on stream"),
}


class ArgsPlan:
    """Extract many args fields with ONE JSON parse per event.

    `json_extract_string(args, [paths])` parses the args text once and returns every path's
    value; each field is then `coalesce` over the positions of its spellings. (One `->>` per
    field and spelling would parse the same text dozens of times.) Paths come only from the
    fixed ARG_KEYS; `[i]` fields (grid, block) are requested per dimension.
    """

    def __init__(self, fields: tuple[str, ...]) -> None:
        self.fields = fields
        self.paths: list[str] = []
        self.slots: dict[str, list[int]] = {}
        for f in fields:
            if f in ("grid", "block"):
                for d in range(3):
                    self.slots[f"{f}{d}"] = [self._add(f'$."{k}"[{d}]') for k in ARG_KEYS[f]]
            else:
                self.slots[f] = [self._add(f'$."{k}"') for k in ARG_KEYS[f]]

    def _add(self, path: str) -> int:
        self.paths.append(path)
        return len(self.paths)  # DuckDB lists are 1-based

    def select(self, guard: str | None = None) -> str:
        """The list expression to compute once per row, as `_a`.

        With `guard`, a text that every spelling of every field contains, the JSON is parsed
        only for rows whose args text holds `guard`; the others cannot have the fields, and
        get NULL as a parse would give them. DuckDB stores JSON re-serialised (a key written
        "\\u0045xternal id" reads back as "External id"); a \\u left in the text also
        parses, in case a version keeps escapes. Most python_function ranges carry no
        External id: this skips ~135k parses of the 162k ranges of the largest corpus trace.
        """
        extract = "json_extract_string(args, [" + ", ".join(f"'{p}'" for p in self.paths) + "])"
        if guard is None:
            return extract + " AS _a"
        keys = [k for f in self.fields for k in ARG_KEYS[f]]
        if not guard.isalnum() or not all(guard in k for k in keys):
            raise ValueError(f"guard {guard!r} is not in every key spelling")
        return (f"CASE WHEN contains(CAST(args AS VARCHAR), '{guard}') OR contains(CAST(args AS VARCHAR), '\\u') "
                f"THEN {extract} END AS _a")

    def text(self, field: str) -> str:
        return "coalesce(" + ", ".join(f"_a[{i}]" for i in self.slots[field]) + ")"

    def int(self, field: str, sql_type: str = "BIGINT") -> str:
        return f"TRY_CAST({self.text(field)} AS {sql_type})"


def _in(cats: tuple[str, ...]) -> str:
    return "(" + ", ".join(f"'{c}'" for c in cats) + ")"


_K = ArgsPlan(("device", "stream", "correlation", "grid", "block", "registers", "shared_mem", "graph_id",
               "graph_node_id"))
INSERT_KERNELS_SQL = f"""
INSERT INTO kernels
SELECT ?, row_number() OVER (ORDER BY rank, start_ns, dur_ns, seq) - 1, rank,
       {_K.int('device', 'INTEGER')}, {_K.int('stream')}, {_K.int('correlation')}, name,
       start_ns, start_ns + coalesce(dur_ns, 0),
       {_K.int('grid0', 'INTEGER')}, {_K.int('grid1', 'INTEGER')}, {_K.int('grid2', 'INTEGER')},
       {_K.int('block0', 'INTEGER')}, {_K.int('block1', 'INTEGER')}, {_K.int('block2', 'INTEGER')},
       {_K.int('registers', 'INTEGER')}, {_K.int('shared_mem')},
       {_K.int('graph_id')}, {_K.int('graph_node_id')}, 'compute'
FROM (SELECT *, rowid AS seq, {_K.select()} FROM _kineto_ev WHERE ph = 'X' AND cat IN {_in(KERNEL_CATS)})
"""

_M = ArgsPlan(("device", "stream", "correlation", "bytes", "graph_id", "graph_node_id"))
INSERT_MEMOPS_SQL = f"""
INSERT INTO memops
SELECT ?, row_number() OVER (ORDER BY rank, start_ns, dur_ns, seq) - 1, rank,
       {_M.int('device', 'INTEGER')}, {_M.int('stream')}, {_M.int('correlation')},
       CASE WHEN cat IN {_in(MEMSET_CATS)} THEN 'memset' ELSE 'memcpy' END, name,
       start_ns, start_ns + coalesce(dur_ns, 0), {_M.int('bytes')},
       {_M.int('graph_id')}, {_M.int('graph_node_id')}, 'memory'
FROM (SELECT *, rowid AS seq, {_M.select()} FROM _kineto_ev WHERE ph = 'X' AND cat IN {_in(MEMCPY_CATS + MEMSET_CATS)})
"""

_C = ArgsPlan(("correlation",))
INSERT_API_CALLS_SQL = f"""
INSERT INTO api_calls
SELECT ?, row_number() OVER (ORDER BY rank, start_ns, dur_ns, seq) - 1, rank,
       TRY_CAST(pid AS BIGINT), TRY_CAST(tid AS BIGINT),
       CASE WHEN cat IN {_in(DRIVER_CATS)} THEN 'driver' ELSE 'runtime' END, name,
       start_ns, start_ns + coalesce(dur_ns, 0), {_C.int('correlation')}
FROM (SELECT *, rowid AS seq, {_C.select()} FROM _kineto_ev WHERE ph = 'X' AND cat IN {_in(RUNTIME_CATS + DRIVER_CATS)})
"""

_RANGE_KIND = "CASE cat " + " ".join(f"WHEN '{c}' THEN '{k}'" for c, k in RANGE_CATS.items()) + " END"

_R = ArgsPlan(("external_id",))
# Ranges sorted the way nesting needs them: per thread, start ascending, end descending.
# range_id is the position in that order, `thread` a dense id of (rank, pid, tid); the table is
# written in range_id order so nesting can scan it without sorting again.
STAGE_RANGES_SQL = f"""
CREATE OR REPLACE TEMP TABLE _kineto_ranges AS
SELECT row_number() OVER w - 1 AS range_id, dense_rank() OVER (ORDER BY rank, pid_i, tid_i) AS thread,
       rank, pid_i AS pid, tid_i AS tid, kind, name, start_ns, end_ns, external_id
FROM (
  SELECT rank, TRY_CAST(pid AS BIGINT) AS pid_i, TRY_CAST(tid AS BIGINT) AS tid_i, {_RANGE_KIND} AS kind,
         name, start_ns, start_ns + coalesce(dur_ns, 0) AS end_ns, {_R.int('external_id')} AS external_id,
         seq
  FROM (SELECT *, rowid AS seq, {_R.select(guard='xternal')} FROM _kineto_ev
        WHERE ph = 'X' AND cat IN {_in(tuple(RANGE_CATS))})
)
WINDOW w AS (ORDER BY rank, pid_i, tid_i, start_ns, end_ns DESC, seq)
ORDER BY range_id
"""

RANGES_FOR_NESTING_SQL = "SELECT thread, start_ns, end_ns FROM _kineto_ranges"

# Both tables are in range_id order, so rows pair up by position (no hash join needed).
INSERT_RANGES_SQL = """
INSERT INTO ranges
SELECT ?, r.range_id, r.rank, r.pid, r.tid, r.kind, r.name, r.start_ns, r.end_ns,
       n.depth, n.parent_id, r.external_id
FROM _kineto_ranges AS r POSITIONAL JOIN _kineto_nesting AS n
"""

_A = ArgsPlan(("device", "stream", "external_id"))
INSERT_GPU_ANNOTATIONS_SQL = f"""
INSERT INTO gpu_annotations
SELECT ?, rank, {_A.int('device', 'INTEGER')}, {_A.int('stream')}, name,
       start_ns, start_ns + coalesce(dur_ns, 0), {_A.int('external_id')}
FROM (SELECT *, rowid AS seq, {_A.select()} FROM _kineto_ev WHERE ph = 'X' AND cat IN {_in(GPU_ANNOTATION_CATS)})
ORDER BY rank, start_ns
"""

_S = ArgsPlan(("device", "stream", "correlation", "wait_on_stream"))
INSERT_GPU_SYNCS_SQL = f"""
INSERT INTO gpu_syncs
SELECT ?, rank, {_S.int('device', 'INTEGER')}, {_S.int('stream')}, name,
       start_ns, start_ns + coalesce(dur_ns, 0), {_S.int('correlation')}, {_S.int('wait_on_stream')}
FROM (SELECT *, rowid AS seq, {_S.select()} FROM _kineto_ev WHERE ph = 'X' AND cat IN {_in(SYNC_CATS)})
ORDER BY rank, start_ns
"""

GRAPH_LAUNCHES_SQL = """
SELECT count(*) FROM _kineto_ev WHERE ph = 'X' AND name IN ('cudaGraphLaunch', 'hipGraphLaunch', 'cuGraphLaunch')
"""

INSERT_CAPTURE_MAP_SQL = """
INSERT INTO graph_capture_map (run_id, rank, graph_id, node_order, graph_node_id, kernel_name,
                               step_name, layer_name, op_name, capture_stream)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
"""

HANDLED_CATS: dict[str, str] = {
    **{c: "kernels" for c in KERNEL_CATS},
    **{c: "memops" for c in MEMCPY_CATS + MEMSET_CATS},
    **{c: "api_calls" for c in RUNTIME_CATS + DRIVER_CATS},
    **{c: "ranges" for c in RANGE_CATS},
    **{c: "gpu_annotations" for c in GPU_ANNOTATION_CATS},
    **{c: "gpu_syncs" for c in SYNC_CATS},
}

DROP_STAGING_SQL = """
DROP TABLE IF EXISTS _kineto_doc; DROP TABLE IF EXISTS _kineto_ev;
DROP TABLE IF EXISTS _kineto_ranges; DROP TABLE IF EXISTS _kineto_nesting;
"""
