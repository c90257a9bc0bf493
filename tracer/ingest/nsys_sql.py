"""SQL of the Nsight Systems SQLite reader, as named constants beside the code that runs them.

Two dialects. The SQLite side (`staging_select`) only selects and resolves string ids: each
staged column is the first of its candidate source columns that the export has (column names
moved between nsys versions), NULL when it has none. Every identifier spliced into it comes
from the fixed `STAGING` lists below, checked against the file's PRAGMA table_info. The DuckDB
side turns the staged rows into store rows; its values are bound parameters.

Times stay as nsys wrote them: integer ns on the session clock.
"""
from __future__ import annotations

from dataclasses import dataclass

# globalTid / globalPid encode the process and thread: pid in bits 24..47, tid in bits 0..23.
PID_MASK = 0xFFFFFF
# CUPTI's "no stream / no event" marker (uint32 -1), stored as NULL.
INVALID_ID = 0xFFFFFFFF


@dataclass(frozen=True)
class Col:
    """One staged column: its name, arrow type ('int' or 'str') and its source candidates.

    `string_id=True`: the source holds an id into StringIds (or, in hand-made or very old
    exports, the text itself); the staged value is the resolved text.
    """

    name: str
    kind: str
    sources: tuple[str, ...]
    string_id: bool = False


@dataclass(frozen=True)
class Stage:
    """One nsys table staged into one DuckDB temp table."""

    table: str          # DuckDB temp table
    source: str         # nsys SQLite table
    cols: tuple[Col, ...]


def _ints(*pairs: tuple[str, str]) -> tuple[Col, ...]:
    return tuple(Col(name, "int", (src,)) for name, src in pairs)


_GPU_COMMON = _ints(("start_ns", "start"), ("end_ns", "end"), ("device", "deviceId"),
                    ("context", "contextId"), ("stream", "streamId"), ("correlation", "correlationId"),
                    ("gpid", "globalPid"))

STAGING: tuple[Stage, ...] = (
    Stage("_nsys_kernel", "CUPTI_ACTIVITY_KIND_KERNEL", _GPU_COMMON + (
        # Kineto names kernels by the demangled name; so do we, so traces of both compare.
        Col("name", "str", ("demangledName", "shortName", "mangledName"), string_id=True),
        *_ints(("grid_x", "gridX"), ("grid_y", "gridY"), ("grid_z", "gridZ"),
               ("block_x", "blockX"), ("block_y", "blockY"), ("block_z", "blockZ"),
               ("registers", "registersPerThread"), ("static_smem", "staticSharedMemory"),
               ("dynamic_smem", "dynamicSharedMemory"), ("graph_id", "graphId"),
               ("graph_node_id", "graphNodeId")),
    )),
    Stage("_nsys_memcpy", "CUPTI_ACTIVITY_KIND_MEMCPY", _GPU_COMMON + _ints(
        ("bytes", "bytes"), ("copy_kind", "copyKind"), ("src_kind", "srcKind"), ("dst_kind", "dstKind"),
        ("graph_id", "graphId"), ("graph_node_id", "graphNodeId"))),
    Stage("_nsys_memset", "CUPTI_ACTIVITY_KIND_MEMSET", _GPU_COMMON + _ints(
        ("bytes", "bytes"), ("mem_kind", "memKind"), ("graph_id", "graphId"),
        ("graph_node_id", "graphNodeId"))),
    Stage("_nsys_sync", "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION", _GPU_COMMON + _ints(
        ("sync_type", "syncType"), ("event_id", "eventId"))),
    # Event records (cudaEventRecord): which stream recorded each event, for stream waits.
    Stage("_nsys_event", "CUPTI_ACTIVITY_KIND_CUDA_EVENT", _ints(
        ("stream", "streamId"), ("correlation", "correlationId"), ("gpid", "globalPid"),
        ("event_id", "eventId"))),
    Stage("_nsys_runtime", "CUPTI_ACTIVITY_KIND_RUNTIME", _ints(
        ("start_ns", "start"), ("end_ns", "end"), ("event_class", "eventClass"),
        ("gtid", "globalTid"), ("correlation", "correlationId")) + (
        Col("name", "str", ("nameId", "name"), string_id=True),)),
    Stage("_nsys_driver", "CUPTI_ACTIVITY_KIND_DRIVER", _ints(
        ("start_ns", "start"), ("end_ns", "end"), ("event_class", "eventClass"),
        ("gtid", "globalTid"), ("correlation", "correlationId")) + (
        Col("name", "str", ("nameId", "name"), string_id=True),)),
    Stage("_nsys_nvtx", "NVTX_EVENTS", _ints(
        ("start_ns", "start"), ("end_ns", "end"), ("event_type", "eventType"),
        ("gtid", "globalTid"), ("domain_id", "domainId")) + (
        # Inline text first (the common case), else the id into StringIds.
        Col("name", "str", ("text", "textId"), string_id=True),)),
)


def staging_select(stage: Stage, present: set[str], has_string_ids: bool) -> str:
    """The SQLite SELECT for one stage: `rowid AS seq` plus each column or NULL when absent.

    `present` is the table's column set (PRAGMA table_info); only names from `STAGING`
    reach the SQL text.
    """
    parts = ["t.rowid AS seq"]
    for col in stage.cols:
        found = [s for s in col.sources if s in present]
        if not found:
            parts.append(f"NULL AS {col.name}")
            continue
        exprs = [_resolved(s, has_string_ids) if col.string_id else f't."{s}"' for s in found]
        expr = exprs[0] if len(exprs) == 1 else "coalesce(" + ", ".join(exprs) + ")"
        parts.append(f"{expr} AS {col.name}")
    return f'SELECT {", ".join(parts)} FROM "{stage.source}" AS t'


def _resolved(src: str, has_string_ids: bool) -> str:
    """A string-id column as text: looked up in StringIds when it holds an integer."""
    if not has_string_ids:
        return f'CAST(t."{src}" AS TEXT)'
    return (f"CASE WHEN typeof(t.\"{src}\") = 'integer' "
            f"THEN (SELECT s.value FROM StringIds AS s WHERE s.id = t.\"{src}\") "
            f"ELSE CAST(t.\"{src}\" AS TEXT) END")


# ---- Lookups (SQLite side) ---------------------------------------------------------------

SESSION_START_SQL = 'SELECT "{col}" FROM TARGET_INFO_SESSION_START_TIME LIMIT 1'   # col from a fixed list
EXPORT_META_SQL = 'SELECT name, value FROM "{table}"'   # META_DATA_EXPORT or EXPORT_META_DATA
GPU_INFO_COLUMNS = ("id", "name", "busLocation", "smCount", "totalMemory", "memoryBandwidth",
                    "clockRate", "computeMajor", "computeMinor", "cuDevice", "uuid")
THREAD_NAMES_SQL = """
SELECT t.globalTid, s.value FROM ThreadNames AS t JOIN StringIds AS s ON s.id = t.nameId
"""
ENUM_SQL = 'SELECT id, label FROM "{table}"'             # ENUM_* tables, when exported

# ---- Built-in enums (used when the export has no ENUM_* table) ----------------------------

# Memcpy kinds (copyKind), as Kineto spells them in "Memcpy HtoD (Pinned -> Device)".
COPY_KINDS = {0: "Unknown", 1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD",
              7: "DtoA", 8: "DtoD", 9: "HtoH", 10: "PtoP", 11: "UVM HtoD", 12: "UVM DtoH",
              13: "UVM DtoD"}
# Memory kinds (srcKind, dstKind, memKind) in nsys numbering (ENUM_CUDA_MEM_KIND: 0 is
# Pageable, unlike CUPTI where 0 is Unknown). The file's own enum wins when present.
MEM_KINDS = {0: "Pageable", 1: "Pinned", 2: "Device", 3: "Array", 4: "Managed",
             5: "Device Static", 6: "Managed Static", 7: "Unknown"}
# Synchronization types (syncType), named as Kineto names its cuda_sync events.
SYNC_TYPES = {0: "Unknown Sync", 1: "Event Sync", 2: "Stream Wait Event", 3: "Stream Sync",
              4: "Context Sync"}
# NVTX eventType ids (ENUM_NSYS_EVENT_TYPE; identical in the 2022.2 to 2026.2 exports read here).
NVTX_PUSH_POP = 59
NVTX_START_END = 60
NVTX_DOMAIN_CREATE = 75
NVTX_EVENT_TYPES = {33: "NvtxCategory", 34: "NvtxMark", 39: "NvtxThread", 59: "NvtxPushPopRange",
                    60: "NvtxStartEndRange", 75: "NvtxDomainCreate", 76: "NvtxDomainDestroy"}
# Runtime-table event classes (ENUM_NSYS_EVENT_CLASS): 0 runtime and 1 driver calls are API
# calls; older exports also hold class 67 "CUDA backtrace" rows that duplicate a call with its
# call stack, which are skipped and counted.
EVENT_CLASS_KIND = {0: "runtime", 1: "driver"}
EVENT_CLASSES = {0: "CUDA runtime", 1: "CUDA driver", 67: "CUDA backtrace"}

# ---- DuckDB side ---------------------------------------------------------------------------

ENUM_TABLE_SQL = """
CREATE OR REPLACE TEMP TABLE _nsys_enum (family VARCHAR, id BIGINT, label VARCHAR)
"""
ENUM_INSERT_SQL = "INSERT INTO _nsys_enum VALUES (?, ?, ?)"

# Synchronization records of nsys 2026.2 carry deviceId 0 for every process (seen in the
# two-GPU nsys-ai exports: the process whose kernels all run on device 1 has its syncs on
# "device 0" in the same context as those kernels). The context is right, so a sync takes the
# device of the kernels and copies of its (process, context); returns how many moved.
SYNC_DEVICE_FROM_CONTEXT_SQL = f"""
WITH ctx AS (
  SELECT (gpid >> 24) & {PID_MASK} AS pid, context, min(device) AS device, count(DISTINCT device) AS n
  FROM (SELECT gpid, context, device FROM _nsys_kernel UNION ALL SELECT gpid, context, device FROM _nsys_memcpy
        UNION ALL SELECT gpid, context, device FROM _nsys_memset)
  WHERE context IS NOT NULL
  GROUP BY ALL
)
UPDATE _nsys_sync AS s SET device = ctx.device
FROM ctx
WHERE ctx.pid IS NOT DISTINCT FROM ((s.gpid >> 24) & {PID_MASK}) AND ctx.context = s.context
  AND ctx.n = 1 AND s.device IS DISTINCT FROM ctx.device
"""

# pid and tid from globalPid / globalTid.
DERIVE_IDS_SQL = f"""
CREATE OR REPLACE TEMP TABLE _nsys_gpu AS
SELECT 'kernel' AS src, seq, (gpid >> 24) & {PID_MASK} AS pid, device, stream, correlation,
       start_ns, end_ns FROM _nsys_kernel
UNION ALL SELECT 'memcpy', seq, (gpid >> 24) & {PID_MASK}, device, stream, correlation, start_ns, end_ns FROM _nsys_memcpy
UNION ALL SELECT 'memset', seq, (gpid >> 24) & {PID_MASK}, device, stream, correlation, start_ns, end_ns FROM _nsys_memset
UNION ALL SELECT 'sync', seq, (gpid >> 24) & {PID_MASK}, device, stream, correlation, start_ns, end_ns FROM _nsys_sync
"""

# Activity rows that cannot be intervals: a missing start or end, or an end before the start.
BAD_ROWS_SQL = """
SELECT src, count(*) FROM (
  SELECT src, start_ns, end_ns FROM _nsys_gpu
  UNION ALL SELECT CASE src WHEN 0 THEN 'runtime' ELSE 'driver' END, start_ns, end_ns FROM _nsys_calls
)
WHERE start_ns IS NULL OR end_ns IS NULL OR end_ns < start_ns
GROUP BY src ORDER BY src
"""

# One rank per (process, device) pair with GPU activity, numbered by device id, then pid.
# A process that exports no globalPid (hand-made subsets) has pid NULL: one rank per device.
RANKS_SQL = """
CREATE OR REPLACE TEMP TABLE _nsys_ranks AS
SELECT CAST(row_number() OVER (ORDER BY device NULLS LAST, pid NULLS LAST) - 1 AS INTEGER) AS rank,
       pid, device
FROM (SELECT DISTINCT pid, device FROM _nsys_gpu)
"""

# GPU activity by (pid, correlation): the rank that launched it (a launch call goes there).
LAUNCHED_SQL = """
CREATE OR REPLACE TEMP TABLE _nsys_launched AS
SELECT g.pid, g.correlation, min(r.rank) AS rank
FROM _nsys_gpu AS g JOIN _nsys_ranks AS r ON r.pid IS NOT DISTINCT FROM g.pid AND r.device = g.device
WHERE g.correlation IS NOT NULL
GROUP BY g.pid, g.correlation
"""

# Host calls: runtime rows of class 0/1 (or no class column) and every driver-table row.
HOST_CALLS_SQL = f"""
CREATE OR REPLACE TEMP TABLE _nsys_calls AS
SELECT seq, 0 AS src, (gtid >> 24) & {PID_MASK} AS pid, gtid & {PID_MASK} AS tid,
       CASE coalesce(event_class, 0) WHEN 0 THEN 'runtime' ELSE 'driver' END AS kind,
       regexp_replace(coalesce(name, '(unnamed)'), '_v[0-9]+$', '') AS name,
       start_ns, end_ns, correlation
FROM _nsys_runtime WHERE coalesce(event_class, 0) IN (0, 1)
UNION ALL
SELECT seq, 1, (gtid >> 24) & {PID_MASK}, gtid & {PID_MASK}, 'driver',
       regexp_replace(coalesce(name, '(unnamed)'), '_v[0-9]+$', ''), start_ns, end_ns, correlation
FROM _nsys_driver
"""

# A host row's process maps to its ranks; when GPU rows carry no pid, to the pid-less ranks.
_PROC_MATCH = "(r.pid = h.pid OR (r.pid IS NULL AND NOT EXISTS (SELECT 1 FROM _nsys_ranks WHERE pid IS NOT NULL)))"

# A call goes to the rank of the GPU work it launched, else to the first rank of its process.
INSERT_API_CALLS_SQL = f"""
INSERT INTO _nsys_out_api_calls
SELECT ?, row_number() OVER (ORDER BY rank, start_ns, end_ns, src, seq) - 1,
       rank, pid, tid, kind, name, start_ns, end_ns, correlation
FROM (
  SELECT h.*, coalesce(
      (SELECT l.rank FROM _nsys_launched AS l
       WHERE l.correlation = h.correlation
         AND (l.pid = h.pid OR (l.pid IS NULL AND NOT EXISTS (SELECT 1 FROM _nsys_ranks WHERE pid IS NOT NULL)))),
      (SELECT min(r.rank) FROM _nsys_ranks AS r WHERE {_PROC_MATCH})) AS rank
  FROM _nsys_calls AS h
)
WHERE rank IS NOT NULL
"""

_GPU_RANK_JOIN = """JOIN _nsys_ranks AS r
  ON r.pid IS NOT DISTINCT FROM ((g.gpid >> 24) & {mask}) AND r.device = g.device""".format(mask=PID_MASK)

_STREAM = f"nullif(g.stream, {INVALID_ID})"

INSERT_KERNELS_SQL = f"""
INSERT INTO _nsys_out_kernels
SELECT ?, row_number() OVER (ORDER BY r.rank, g.start_ns, g.end_ns, g.seq) - 1, r.rank,
       CAST(g.device AS INTEGER), {_STREAM}, g.correlation, coalesce(g.name, '(unnamed)'),
       g.start_ns, g.end_ns,
       g.grid_x, g.grid_y, g.grid_z, g.block_x, g.block_y, g.block_z, g.registers,
       CASE WHEN g.static_smem IS NULL AND g.dynamic_smem IS NULL THEN NULL
            ELSE coalesce(g.static_smem, 0) + coalesce(g.dynamic_smem, 0) END,
       g.graph_id, g.graph_node_id,
       'compute'  -- the classifier's starting point: tracer.classify sets every kernel's category
FROM _nsys_kernel AS g {_GPU_RANK_JOIN}
"""

_MEM_KIND = "coalesce((SELECT e.label FROM _nsys_enum AS e WHERE e.family = 'mem' AND e.id = {col}), 'Unknown')"

INSERT_MEMOPS_SQL = f"""
INSERT INTO _nsys_out_memops
SELECT ?, row_number() OVER (ORDER BY rank, start_ns, end_ns, kind, seq) - 1, rank, device, stream,
       correlation, kind, name, start_ns, end_ns, bytes, graph_id, graph_node_id, 'memory'
FROM (
  SELECT r.rank, CAST(g.device AS INTEGER) AS device, {_STREAM} AS stream, g.correlation,
         'memcpy' AS kind,
         'Memcpy ' || coalesce((SELECT e.label FROM _nsys_enum AS e WHERE e.family = 'copy' AND e.id = g.copy_kind), 'Unknown')
           || ' (' || {_MEM_KIND.format(col='g.src_kind')} || ' -> ' || {_MEM_KIND.format(col='g.dst_kind')} || ')' AS name,
         g.start_ns, g.end_ns, g.bytes, g.graph_id, g.graph_node_id, g.seq
  FROM _nsys_memcpy AS g {_GPU_RANK_JOIN}
  UNION ALL
  SELECT r.rank, CAST(g.device AS INTEGER), {_STREAM}, g.correlation, 'memset',
         'Memset (' || {_MEM_KIND.format(col='g.mem_kind')} || ')',
         g.start_ns, g.end_ns, g.bytes, g.graph_id, g.graph_node_id, g.seq
  FROM _nsys_memset AS g {_GPU_RANK_JOIN}
)
"""

# A stream wait's awaited stream: the stream of the latest record of the same event in the
# same process before the wait call (correlation ids grow in call order within a process).
INSERT_GPU_SYNCS_SQL = f"""
INSERT INTO _nsys_out_gpu_syncs
SELECT ?, s.rank, s.device, s.stream, s.name, s.start_ns, s.end_ns, s.correlation,
       CASE WHEN s.sync_type = 2 THEN nullif(e.stream, {INVALID_ID}) END
FROM (
  SELECT r.rank, CAST(g.device AS INTEGER) AS device, {_STREAM} AS stream,
         coalesce((SELECT x.label FROM _nsys_enum AS x WHERE x.family = 'sync' AND x.id = g.sync_type),
                  'Unknown Sync') AS name,
         g.start_ns, g.end_ns, g.correlation, g.sync_type, nullif(g.event_id, {INVALID_ID}) AS event_id,
         (g.gpid >> 24) & {PID_MASK} AS pid, g.seq
  FROM _nsys_sync AS g {_GPU_RANK_JOIN}
) AS s
ASOF LEFT JOIN (
  SELECT (gpid >> 24) & {PID_MASK} AS pid, event_id, correlation, stream FROM _nsys_event
) AS e
  ON e.pid IS NOT DISTINCT FROM s.pid AND e.event_id = s.event_id AND s.correlation > e.correlation
ORDER BY s.rank, s.start_ns, s.seq
"""

# NVTX ranges (push/pop and start/end) on the thread that opened them, copied to every rank of
# their process. A range with no end (still open when the capture stopped) is cut: it ends at
# the last timestamp of the export, and is counted.
STAGE_RANGES_SQL = f"""
CREATE OR REPLACE TEMP TABLE _nsys_ranges AS
SELECT row_number() OVER (ORDER BY rank, pid, tid, start_ns, end_ns DESC, seq) - 1 AS range_id,
       rank, pid, tid, name, start_ns, end_ns, cut
FROM (
  SELECT r.rank, h.pid, h.tid, h.name, h.start_ns,
         CASE WHEN h.end_ns IS NULL OR h.end_ns < h.start_ns THEN greatest(?, h.start_ns) ELSE h.end_ns END AS end_ns,
         h.end_ns IS NULL OR h.end_ns < h.start_ns AS cut, h.seq
  FROM (
    SELECT seq, (gtid >> 24) & {PID_MASK} AS pid, gtid & {PID_MASK} AS tid,
           coalesce(name, '(unnamed)') AS name, start_ns, end_ns
    FROM _nsys_nvtx
    WHERE event_type IN ({NVTX_PUSH_POP}, {NVTX_START_END}) AND start_ns IS NOT NULL
  ) AS h
  JOIN _nsys_ranks AS r ON {_PROC_MATCH}
)
"""

NVTX_RANGES_FOR_NESTING_SQL = """
SELECT dense_rank() OVER (ORDER BY rank, pid, tid) AS thread, start_ns, end_ns, range_id
FROM _nsys_ranges ORDER BY range_id
"""

INSERT_RANGES_SQL = """
INSERT INTO _nsys_out_ranges
SELECT ?, r.range_id, r.rank, r.pid, r.tid, 'nvtx', r.name, r.start_ns, r.end_ns,
       n.depth, n.parent_id, NULL
FROM _nsys_ranges AS r JOIN _nsys_nesting AS n USING (range_id)
"""

# The last timestamp anywhere in the export: where cut ranges end.
LAST_NS_SQL = """
SELECT max(t) FROM (
  SELECT max(greatest(start_ns, end_ns)) AS t FROM _nsys_gpu
  UNION ALL SELECT max(greatest(start_ns, end_ns)) FROM _nsys_calls
  UNION ALL SELECT max(greatest(start_ns, coalesce(end_ns, start_ns))) FROM _nsys_nvtx
)
"""

# ---- Facts for runs.metadata ----------------------------------------------------------------

# GPU work whose launch call is not in the export (window cut after the launch was made).
WITHOUT_LAUNCH_SQL = f"""
SELECT r.rank, g.src, count(*) AS n
FROM _nsys_gpu AS g JOIN _nsys_ranks AS r ON r.pid IS NOT DISTINCT FROM g.pid AND r.device = g.device
WHERE g.src IN ('kernel', 'memcpy', 'memset')
  AND NOT EXISTS (SELECT 1 FROM _nsys_calls AS h
                  WHERE h.correlation = g.correlation AND (g.pid IS NULL OR h.pid = g.pid))
GROUP BY ALL ORDER BY ALL
"""

# Kernel-launch calls whose kernel is not in the export (it ran after the window's end).
LAUNCH_WITHOUT_KERNEL_SQL = """
SELECT count(*) FROM _nsys_calls AS h
WHERE (h.name ILIKE 'cudaLaunch%' OR h.name ILIKE 'cuLaunch%')
  AND NOT EXISTS (SELECT 1 FROM _nsys_gpu AS g
                  WHERE g.correlation = h.correlation AND (g.pid IS NULL OR g.pid = h.pid))
"""

RUNTIME_CLASSES_SQL = "SELECT event_class, count(*) FROM _nsys_runtime GROUP BY ALL ORDER BY ALL"
NVTX_TYPES_SQL = "SELECT event_type, count(*) FROM _nsys_nvtx GROUP BY ALL ORDER BY ALL"
NVTX_DOMAINS_SQL = f"""
SELECT DISTINCT domain_id, name FROM _nsys_nvtx WHERE event_type = {NVTX_DOMAIN_CREATE} ORDER BY ALL
"""
RANGES_CUT_SQL = "SELECT count(*) FROM _nsys_ranges WHERE cut"

# Host rows of processes that have no GPU activity in the export: not stored, counted.
HOST_ROWS_DROPPED_SQL = f"""
WITH nv AS (
  SELECT (gtid >> 24) & {PID_MASK} AS pid FROM _nsys_nvtx
  WHERE event_type IN ({NVTX_PUSH_POP}, {NVTX_START_END}) AND start_ns IS NOT NULL
)
SELECT
  (SELECT count(*) FROM _nsys_calls AS h WHERE NOT EXISTS (SELECT 1 FROM _nsys_ranks AS r WHERE {_PROC_MATCH})),
  (SELECT count(*) FROM nv AS h WHERE NOT EXISTS (SELECT 1 FROM _nsys_ranks AS r WHERE {_PROC_MATCH}))
"""

HOST_THREADS_SQL = """
SELECT DISTINCT pid, tid FROM (SELECT pid, tid FROM _nsys_calls UNION ALL SELECT pid, tid FROM _nsys_ranges)
"""

GRAPH_EVIDENCE_SQL = """
SELECT (SELECT count(*) FROM _nsys_kernel WHERE graph_id IS NOT NULL OR graph_node_id IS NOT NULL),
       (SELECT count(*) FROM _nsys_calls WHERE name ILIKE '%GraphLaunch%')
"""

# ---- Several exports, one run ----------------------------------------------------------------
# Each export is staged on its own; its store rows go to _nsys_out_<table> with the export's
# index in run_id and ids and ranks local to the export. `write` offsets them by the counts of
# the exports before (ids stay 0..n-1 in (rank, start) order: ranks of later exports are higher).
OUT_TABLES = ("kernels", "memops", "api_calls", "gpu_syncs", "ranges")
CREATE_OUT_SQL = "; ".join(f"CREATE OR REPLACE TEMP TABLE _nsys_out_{t} AS SELECT * FROM {t} LIMIT 0"
                           for t in OUT_TABLES)
BASES_TABLE_SQL = """
CREATE OR REPLACE TEMP TABLE _nsys_bases (file_idx INTEGER, rank_base INTEGER, kernel_base BIGINT,
                                          memop_base BIGINT, call_base BIGINT, range_base BIGINT)
"""
BASES_INSERT_SQL = "INSERT INTO _nsys_bases VALUES (?, ?, ?, ?, ?, ?)"
_OFFSETS = {
    "kernels": "o.kernel_id + b.kernel_base AS kernel_id",
    "memops": "o.memop_id + b.memop_base AS memop_id",
    "api_calls": "o.call_id + b.call_base AS call_id",
    "gpu_syncs": None,
    "ranges": "o.range_id + b.range_base AS range_id, o.parent_id + b.range_base AS parent_id",
}
WRITE_SQL = {
    t: f"""INSERT INTO {t}
SELECT o.* REPLACE (? AS run_id, o.rank + b.rank_base AS rank{', ' + off if off else ''})
FROM _nsys_out_{t} AS o JOIN _nsys_bases AS b ON b.file_idx = o.run_id"""
    for t, off in _OFFSETS.items()
}
OUT_COUNTS_SQL = "SELECT " + ", ".join(
    f"(SELECT count(*) FROM _nsys_out_{t} WHERE run_id = ?)" for t in ("kernels", "memops", "api_calls", "ranges"))

_FILE_TABLES = (*(s.table for s in STAGING), "_nsys_enum", "_nsys_gpu", "_nsys_ranks", "_nsys_launched",
                "_nsys_calls", "_nsys_ranges", "_nsys_nesting")
DROP_FILE_STAGING_SQL = "; ".join(f"DROP TABLE IF EXISTS {t}" for t in _FILE_TABLES)
DROP_STAGING_SQL = "; ".join(f"DROP TABLE IF EXISTS {t}" for t in (
    *_FILE_TABLES, *(f"_nsys_out_{t}" for t in OUT_TABLES), "_nsys_bases"))
