-- requires: intervals/intervals.sql, kernels/exposed.sql
-- layers: per-layer and per-op kernel time, per step and summarised over steps. Reads the
-- TEMP table written by analyzers.attribution (passed by name, since it exists only once
-- attribution has run) joined to kernels. Memops are not counted: these are kernel metrics.

-- layers_steps: one row per (rank, step_index, layer, op) of run `run`, op NULL for the row
-- of the whole layer (an op row exists for every non-NULL op; kernels attributed to the
-- layer but to no op count only in the layer row). Only kernels attributed to a layer.
--   kernels    number of kernels;
--   span_ns    first kernel (exposed) start to last kernel end (DURATION, ns);
--   busy_ns    length of the union of the kernels' intervals, all streams (DURATION, ns);
--   bubble_ns  span_ns - busy_ns: time inside the span with none of these kernels running;
--   first_start_ns  start of the first kernel (TIMESTAMP, ns), to order ops within a layer.
-- Kernel intervals start at their exposed start (kernels/exposed.sql: under PDL a kernel is
-- resident before its stream predecessor ends; that wait is not its time).
-- Groups are keyed by hash(rank, step_index, layer, op): the interval macros run about 3x
-- faster on a BIGINT key than on a STRUCT (a 64-bit collision is negligible).
CREATE OR REPLACE MACRO layers_steps(attr, run) AS TABLE
WITH _k AS (
  SELECT a.rank, a.step_index, a.layer, a.layer_index, a.layer_kind, a.op,
         k.exposed_start_ns AS start_ns, k.end_ns
  FROM query_table(attr) a
  JOIN kernels_exposed(attr, run) k ON k.kernel_id = a.item_id
  WHERE a.run_id = run AND a.item_kind = 'kernel' AND a.layer IS NOT NULL
),
_iv AS (
  SELECT rank, step_index, layer, layer_index, layer_kind, NULL::VARCHAR AS op, start_ns, end_ns,
         hash(rank, step_index, layer, NULL::VARCHAR) AS key
  FROM _k
  UNION ALL
  SELECT rank, step_index, layer, layer_index, layer_kind, op, start_ns, end_ns,
         hash(rank, step_index, layer, op) AS key
  FROM _k WHERE op IS NOT NULL
),
_n AS (
  SELECT key, any_value(rank) AS rank, any_value(step_index) AS step_index,
         any_value(layer) AS layer, any_value(op) AS op,
         any_value(layer_index) AS layer_index, any_value(layer_kind) AS layer_kind,
         count(*) AS kernels, min(start_ns) AS first_start_ns, max(end_ns) - min(start_ns) AS span_ns
  FROM _iv GROUP BY key
),
_t AS (SELECT key, busy_ns FROM intervals_totals('_iv'))
SELECT
  run AS run_id, _n.rank, _n.step_index, _n.layer, _n.layer_index, _n.layer_kind, _n.op,
  CAST(_n.kernels AS BIGINT) AS kernels,
  CAST(_n.span_ns AS BIGINT) AS span_ns,
  CAST(coalesce(_t.busy_ns, 0) AS BIGINT) AS busy_ns,
  CAST(_n.span_ns - coalesce(_t.busy_ns, 0) AS BIGINT) AS bubble_ns,
  _n.first_start_ns
FROM _n LEFT JOIN _t ON _t.key = _n.key;

-- layers_summary: the rows of layers_steps (relation `steps`) summarised over steps, per
-- (layer, op): the lower median (the element at position floor((n-1)/2) of the sorted values,
-- an integer like its inputs; DuckDB's quantile_disc at 0.5) of kernels, span_ns, busy_ns,
-- bubble_ns and of the offset of the first kernel from the layer's first kernel; samples are
-- the (rank, step) pairs where the layer (or op) ran, rows outside any step excluded unless
-- the run has no step at all (then that one pseudo-step is the sample).
CREATE OR REPLACE MACRO layers_summary(steps) AS TABLE
WITH _s AS (SELECT * FROM query_table(steps)),
_use AS (
  SELECT * FROM _s
  WHERE step_index IS NOT NULL OR NOT EXISTS (SELECT 1 FROM _s WHERE step_index IS NOT NULL)
),
_layer_start AS (
  SELECT rank, step_index, layer, first_start_ns AS layer_start_ns FROM _use WHERE op IS NULL
)
SELECT
  u.layer, any_value(u.layer_index) AS layer_index, any_value(u.layer_kind) AS layer_kind, u.op,
  count(*) AS samples,
  CAST(quantile_disc(u.kernels, 0.5) AS BIGINT) AS kernels,
  CAST(quantile_disc(u.span_ns, 0.5) AS BIGINT) AS span_ns,
  CAST(quantile_disc(u.busy_ns, 0.5) AS BIGINT) AS busy_ns,
  CAST(quantile_disc(u.bubble_ns, 0.5) AS BIGINT) AS bubble_ns,
  CAST(quantile_disc(u.first_start_ns - ls.layer_start_ns, 0.5) AS BIGINT) AS offset_ns
FROM _use u
JOIN _layer_start ls
  ON ls.rank = u.rank AND ls.step_index IS NOT DISTINCT FROM u.step_index AND ls.layer = u.layer
GROUP BY u.layer, u.op;
