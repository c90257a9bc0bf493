-- The decodescope store: the one contract between tracer (writers) and analyzers (readers).
-- Nothing else creates base tables. Times are BIGINT nanoseconds on one clock per rank
-- (absolute: Kineto baseTimeNanoseconds + ts, or the nsys session clock). Ids (`*_id`) are
-- unique within a run. Every reader writes all of these tables for one run in one transaction.

CREATE SEQUENCE IF NOT EXISTS run_id_seq START 1;

-- One ingested run: a trace file, or a folder of per-rank files of one run.
CREATE TABLE IF NOT EXISTS runs (
  run_id          INTEGER PRIMARY KEY,      -- from run_id_seq
  name            VARCHAR NOT NULL,         -- user-given or derived from the file name
  source          VARCHAR NOT NULL,         -- reader: 'kineto', 'nsys', 'cupti'
  path            VARCHAR NOT NULL,         -- the file or folder that was ingested
  file_hash       VARCHAR NOT NULL UNIQUE,  -- sha256 over the content of every file of the run
  variant         VARCHAR,                  -- 'stock' / 'fused' for kimi_decode captures, else NULL
  config          JSON,                     -- the capture metadata (`decodescope` object), else NULL
  metadata        JSON,                     -- reader facts: per-rank device props, unknown-event counts, warnings
  gpu             VARCHAR,                  -- device name as the trace gives it
  world_size      INTEGER NOT NULL,         -- ranks in the run (files, or distributedInfo.world_size)
  graph_mode      BOOLEAN,                  -- true when the capture replayed a CUDA graph
  tp_sim          BOOLEAN,                  -- true when collectives were simulated locally
  created_at      TIMESTAMP NOT NULL DEFAULT current_timestamp
);

-- GPU kernels, every one in the file (no step filtering).
CREATE TABLE IF NOT EXISTS kernels (
  run_id            INTEGER NOT NULL,
  kernel_id         BIGINT NOT NULL,        -- unique within the run, in (rank, start_ns) order
  rank              INTEGER NOT NULL,
  device            INTEGER,                -- GPU index on its host
  stream            BIGINT,
  correlation       BIGINT,                 -- links to api_calls.correlation of the launch (same rank)
  name              VARCHAR NOT NULL,
  start_ns          BIGINT NOT NULL,
  end_ns            BIGINT NOT NULL,        -- >= start_ns
  grid_x INTEGER, grid_y INTEGER, grid_z INTEGER,
  block_x INTEGER, block_y INTEGER, block_z INTEGER,
  registers_per_thread INTEGER,
  shared_mem_bytes  BIGINT,
  graph_id          BIGINT,                 -- CUDA graph id when launched by a graph replay
  graph_node_id     BIGINT,                 -- graph node id when known (CUPTI / nsys)
  category          VARCHAR NOT NULL        -- 'compute' | 'communication' | 'memory' | 'prefetch' (classifier)
);

-- GPU memory operations: memcpy and memset.
CREATE TABLE IF NOT EXISTS memops (
  run_id        INTEGER NOT NULL,
  memop_id      BIGINT NOT NULL,
  rank          INTEGER NOT NULL,
  device        INTEGER,
  stream        BIGINT,
  correlation   BIGINT,
  kind          VARCHAR NOT NULL,           -- 'memcpy' | 'memset'
  name          VARCHAR NOT NULL,           -- e.g. 'Memcpy HtoD (Pageable -> Device)'
  start_ns      BIGINT NOT NULL,
  end_ns        BIGINT NOT NULL,
  bytes         BIGINT,
  graph_id      BIGINT,
  graph_node_id BIGINT,
  category      VARCHAR NOT NULL            -- classifier, as for kernels ('memory' unless a rule says 'prefetch')
);

-- Host-side CUDA/HIP runtime and driver calls (launches, graph launches, syncs, ...).
CREATE TABLE IF NOT EXISTS api_calls (
  run_id       INTEGER NOT NULL,
  call_id      BIGINT NOT NULL,
  rank         INTEGER NOT NULL,
  pid          BIGINT,
  tid          BIGINT,
  kind         VARCHAR NOT NULL,            -- 'runtime' | 'driver'
  name         VARCHAR NOT NULL,            -- e.g. 'cudaLaunchKernel', 'cudaGraphLaunch'
  start_ns     BIGINT NOT NULL,
  end_ns       BIGINT NOT NULL,
  correlation  BIGINT
);

-- Host-side ranges: NVTX ranges, PyTorch user annotations (record_function), CPU ops.
-- Nesting is per (rank, pid, tid): parent_id is the innermost enclosing range of any kind.
CREATE TABLE IF NOT EXISTS ranges (
  run_id     INTEGER NOT NULL,
  range_id   BIGINT NOT NULL,
  rank       INTEGER NOT NULL,
  pid        BIGINT,
  tid        BIGINT,
  kind       VARCHAR NOT NULL,              -- 'nvtx' | 'user_annotation' | 'cpu_op' | 'python_function' | 'other'
  name       VARCHAR NOT NULL,
  start_ns   BIGINT NOT NULL,
  end_ns     BIGINT NOT NULL,
  depth      INTEGER NOT NULL,              -- 0 for a top-level range on its thread
  parent_id  BIGINT,                        -- range_id of the enclosing range, NULL at depth 0
  external_id BIGINT                        -- Kineto 'External id' (links to gpu_annotations), else NULL
);

-- Device-side projections of host annotations as the profiler wrote them (Kineto
-- gpu_user_annotation). Kept apart from ranges: they are the profiler's own attribution.
CREATE TABLE IF NOT EXISTS gpu_annotations (
  run_id      INTEGER NOT NULL,
  rank        INTEGER NOT NULL,
  device      INTEGER,
  stream      BIGINT,
  name        VARCHAR NOT NULL,
  start_ns    BIGINT NOT NULL,
  end_ns      BIGINT NOT NULL,
  external_id BIGINT
);

-- Device-side synchronisation records (Kineto cuda_sync, nsys SYNCHRONIZATION): event
-- waits and stream/context syncs, used to explain bubbles.
CREATE TABLE IF NOT EXISTS gpu_syncs (
  run_id       INTEGER NOT NULL,
  rank         INTEGER NOT NULL,
  device       INTEGER,
  stream       BIGINT,
  name         VARCHAR NOT NULL,            -- e.g. 'Event Sync', 'Stream Wait Event', 'Context Sync'
  start_ns     BIGINT NOT NULL,
  end_ns       BIGINT NOT NULL,
  correlation  BIGINT,
  wait_on_stream BIGINT                     -- for a stream wait: the stream whose event is awaited, when known
);

-- CUDA-graph capture map written by our tracer: which (layer, op) each captured kernel
-- belongs to, keyed by launch order within one replay (and graph node id when known).
CREATE TABLE IF NOT EXISTS graph_capture_map (
  run_id        INTEGER NOT NULL,
  rank          INTEGER NOT NULL,
  graph_id      BIGINT,
  node_order    INTEGER NOT NULL,           -- 0-based position of the kernel in one replay, by start time
  graph_node_id BIGINT,
  kernel_name   VARCHAR NOT NULL,           -- expected name, checked against the replay
  step_name     VARCHAR,
  layer_name    VARCHAR,                    -- e.g. 'L3.mla'
  op_name       VARCHAR,                    -- e.g. 'o_proj+ar'
  capture_stream BIGINT                     -- stream the kernel was captured on (its eager map
                                            -- step's stream): the order it follows in a replay,
                                            -- whose CUPTI streams the graph executor picks
);
-- Stores made before capture_stream existed get the column (NULL: replay streams are used).
ALTER TABLE graph_capture_map ADD COLUMN IF NOT EXISTS capture_stream BIGINT;

-- Classifier rules that decided `category` (defaults plus the user's), kept per run so the
-- decision can be explained. Lower priority wins; NULL fields match anything.
CREATE TABLE IF NOT EXISTS category_rules (
  run_id        INTEGER NOT NULL,
  priority      INTEGER NOT NULL,
  category      VARCHAR NOT NULL,
  name_regex    VARCHAR,
  stream        BIGINT,
  op_regex      VARCHAR,                    -- innermost annotation enclosing the launch
  origin        VARCHAR NOT NULL            -- 'default' | 'metadata' | 'user'
);
