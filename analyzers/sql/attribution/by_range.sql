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
  SELECT {'run_id': run_id, 'rank': rank, 'pid': pid, 'tid': tid} AS key, range_id, start_ns, end_ns
  FROM _ann WHERE is_step
),
_layer_r AS (
  SELECT {'run_id': run_id, 'rank': rank, 'pid': pid, 'tid': tid} AS key, range_id, start_ns, end_ns
  FROM _ann WHERE layer IS NOT NULL
),
_any_r AS (
  SELECT {'run_id': run_id, 'rank': rank, 'pid': pid, 'tid': tid} AS key, range_id, start_ns, end_ns
  FROM _ann
),
_calls AS (
  SELECT DISTINCT
    {'run_id': run_id, 'rank': rank, 'pid': pid, 'tid': tid} AS key,
    call_id AS point_id, call_start_ns AS t_ns
  FROM _items WHERE launched
),
_in_step AS (SELECT * FROM attribution_innermost('_step_r', '_calls')),
_in_layer AS (SELECT * FROM attribution_innermost('_layer_r', '_calls')),
_in_any AS (SELECT * FROM attribution_innermost('_any_r', '_calls')),
_per_call AS (
  SELECT
    s.key.run_id AS run_id, s.point_id AS call_id,
    s.range_id AS step_range_id, l.range_id AS layer_range_id, a.range_id AS op_range_id,
    (s.nested_ok AND l.nested_ok AND a.nested_ok) AS nested_ok
  FROM _in_step s
  JOIN _in_layer l ON l.key = s.key AND l.point_id = s.point_id
  JOIN _in_any a ON a.key = s.key AND a.point_id = s.point_id
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
LEFT JOIN _per_call pc ON pc.run_id = i.run_id AND pc.call_id = i.call_id
LEFT JOIN _steps st ON st.run_id = i.run_id AND st.range_id = pc.step_range_id
LEFT JOIN _ann la ON la.run_id = i.run_id AND la.range_id = pc.layer_range_id
LEFT JOIN _ann o ON o.run_id = i.run_id AND o.range_id = pc.op_range_id;
