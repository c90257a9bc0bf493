-- requires: attribution/innermost.sql
-- attribution.by_range: the Nsight Systems projection. Each kernel or memop belongs to the
-- innermost annotation range that encloses, on the same (rank, pid, tid), the start of the
-- host call that launched it (found through the correlation id). Computed per class:
--   step   innermost enclosing step range; step_index = its 0-based order among the step
--          ranges of its (run, rank), by start time;
--   layer  innermost enclosing range whose name carries a layer;
--   op     innermost enclosing annotation of any name, unless that is the step range or the
--          layer's own range; a child named `<layer>.<rest>` gives op `<rest>` (HF/vLLM
--          module names: `model.layers.3.self_attn` -> op `self_attn`).
-- Items without a launching call get NULLs here (see attribution/gpu_fallback.sql).
-- Only one innermost lookup runs per launch (any annotation): the step and layer of a launch
-- are those of its innermost range r, looked up once per range (the innermost step / layer
-- range holding r.start that also reaches r.end, i.e. encloses r). With proper nesting the
-- ranges enclosing a launch are exactly r and r's ancestors, so this equals a per-launch
-- lookup, at the cost of the ranges (thousands) instead of the launches (millions). One
-- exception, left NULL: a step/layer range that starts at the same instant as r but ends
-- inside it (it does not enclose r).
-- Threads are keyed by hash(run_id, rank, pid, tid): ASOF joins on a BIGINT key run about 5x
-- faster than on a STRUCT (1M launches: 0.5 s against 2.3 s); a 64-bit collision between two
-- threads of one store is negligible, and would show up as nested_ok = false.

-- ann: relation shaped like attribution_annotations(...); items: like attribution_items(...).
-- One row per item, with the ids of the ranges used (NULL when none encloses the launch) and
-- nested_ok = false where the thread's ranges do not nest, so a lookup could not be trusted.
CREATE OR REPLACE MACRO attribution_by_range(ann, items) AS TABLE
WITH _ann AS (SELECT * FROM query_table(ann)),
_items AS (SELECT * FROM query_table(items)),
_steps AS (
  SELECT
    run_id, range_id, name,
    row_number() OVER (PARTITION BY run_id, rank ORDER BY start_ns, range_id) - 1 AS step_index
  FROM _ann WHERE is_step
),
_step_r AS (
  SELECT hash(run_id, rank, pid, tid) AS key, range_id, start_ns, end_ns FROM _ann WHERE is_step
),
_layer_r AS (
  SELECT hash(run_id, rank, pid, tid) AS key, range_id, start_ns, end_ns
  FROM _ann WHERE layer IS NOT NULL
),
_any_r AS (
  SELECT hash(run_id, rank, pid, tid) AS key, range_id, start_ns, end_ns FROM _ann
),
_range_pts AS (
  SELECT hash(run_id, rank, pid, tid) AS key, run_id * 4294967296 + range_id AS point_id,
         start_ns AS t_ns, end_ns
  FROM _ann
),
_calls AS (
  SELECT DISTINCT
    hash(run_id, rank, pid, tid) AS key,
    run_id * 4294967296 + call_id AS point_id, call_start_ns AS t_ns
  FROM _items WHERE launched
),
_range_step AS (
  SELECT p.point_id, CASE WHEN r.end_ns >= p.end_ns THEN i.range_id END AS step_range_id,
         i.nested_ok
  FROM attribution_innermost('_step_r', '_range_pts') i
  JOIN _range_pts p ON p.point_id = i.point_id
  LEFT JOIN _step_r r ON r.key = i.key AND r.range_id = i.range_id
),
_range_layer AS (
  SELECT p.point_id, CASE WHEN r.end_ns >= p.end_ns THEN i.range_id END AS layer_range_id,
         i.nested_ok
  FROM attribution_innermost('_layer_r', '_range_pts') i
  JOIN _range_pts p ON p.point_id = i.point_id
  LEFT JOIN _layer_r r ON r.key = i.key AND r.range_id = i.range_id
),
_in_any AS (SELECT * FROM attribution_innermost('_any_r', '_calls')),
_per_call AS (
  SELECT
    a.point_id AS call_id, a.range_id AS op_range_id,
    rs.step_range_id, rl.layer_range_id,
    a.nested_ok AND coalesce(rs.nested_ok, true) AND coalesce(rl.nested_ok, true) AS nested_ok
  FROM _in_any a
  LEFT JOIN _range_step rs
    ON rs.point_id = (a.point_id // 4294967296) * 4294967296 + a.range_id
  LEFT JOIN _range_layer rl
    ON rl.point_id = (a.point_id // 4294967296) * 4294967296 + a.range_id
)
SELECT
  i.run_id, i.rank, i.item_kind, i.item_id, i.name, i.start_ns, i.end_ns, i.stream,
  i.correlation, i.graph_id, i.call_id, i.launched, i.is_graph,
  st.name AS step, CAST(st.step_index AS INTEGER) AS step_index,
  la.layer, la.layer_index, la.layer_kind,
  CASE
    WHEN o.range_id IS NULL OR o.is_step THEN NULL
    WHEN la.range_id IS NOT NULL AND o.range_id = la.range_id AND o.name = la.layer THEN NULL
    WHEN la.layer IS NOT NULL AND starts_with(o.name, la.layer || '.')
      THEN substr(o.name, length(la.layer) + 2)
    ELSE o.name
  END AS op,
  pc.step_range_id, pc.layer_range_id, pc.op_range_id,
  coalesce(pc.nested_ok, true) AS nested_ok
FROM _items i
LEFT JOIN _per_call pc ON pc.call_id = i.run_id * 4294967296 + i.call_id
LEFT JOIN _steps st ON st.run_id = i.run_id AND st.range_id = pc.step_range_id
LEFT JOIN _ann la ON la.run_id = i.run_id AND la.range_id = pc.layer_range_id
LEFT JOIN _ann o ON o.run_id = i.run_id AND o.range_id = pc.op_range_id;
