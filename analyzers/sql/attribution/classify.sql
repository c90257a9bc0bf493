-- requires:
-- attribution.classify: the inputs of kernel attribution, cut to the runs asked for.
-- Patterns arrive as macro arguments, which the caller binds as prepared-statement
-- parameters (never spliced into the SQL text).

-- The kind of the layer a name carries: capture group kind_grp of layer_re when the pattern
-- has a `kind` group (has_kind), else NULL.
CREATE OR REPLACE MACRO attribution_layer_kind(name, layer, layer_re, has_kind, kind_grp) AS
  CASE WHEN layer IS NOT NULL AND has_kind
    THEN nullif(regexp_extract(name, layer_re, kind_grp), '') END;

-- The index of the layer a name carries: capture group idx_grp of layer_re when the pattern
-- has an `idx` group (has_idx), else the last run of digits in the layer name
-- (`L3.mla` -> 3, `model.layers.12` -> 12).
CREATE OR REPLACE MACRO attribution_layer_index(name, layer, layer_re, has_idx, idx_grp) AS
  CASE WHEN layer IS NULL THEN NULL
    WHEN has_idx THEN TRY_CAST(nullif(regexp_extract(name, layer_re, idx_grp), '') AS INTEGER)
    ELSE TRY_CAST(nullif(regexp_extract(layer, '(\d+)\D*$', 1), '') AS INTEGER)
  END;

-- attribution_annotations: host annotation ranges (NVTX and user annotations such as
-- record_function; CPU ops and Python frames are not annotations) of `run_ids`, each
-- classified:
--   is_step      the name matches step_re; where no range of the (run, rank) matches
--                step_re, step_re_fallback is used instead (so our `step` ranges win over
--                the profiler's own ProfilerStep#N when both are present);
--   layer        the `layer` capture group (group number layer_grp) of layer_re, searched
--                anywhere in the name (so `model.layers.3.mlp` names layer `model.layers.3`);
--   layer_kind   group kind_grp when has_kind, else NULL;
--   layer_index  group idx_grp when has_idx, else the last run of digits in the layer name.
CREATE OR REPLACE MACRO attribution_annotations(
  run_ids, step_re, step_re_fallback, layer_re, layer_grp, has_kind, kind_grp, has_idx, idx_grp
) AS TABLE
WITH _a AS (
  SELECT
    run_id, rank, pid, tid, range_id, name, start_ns, end_ns,
    regexp_matches(name, step_re) AS _m1,
    regexp_matches(name, step_re_fallback) AS _m2,
    nullif(regexp_extract(name, layer_re, layer_grp), '') AS layer
  FROM ranges
  WHERE list_contains(run_ids, run_id)
    AND kind IN ('nvtx', 'user_annotation')
    AND end_ns > start_ns
),
_pref AS (
  SELECT run_id, rank, bool_or(_m1) AS _has1 FROM _a GROUP BY run_id, rank
)
SELECT
  _a.run_id, _a.rank, pid, tid, range_id, name, start_ns, end_ns,
  CASE WHEN _pref._has1 THEN _m1 ELSE _m2 END AS is_step,
  layer,
  attribution_layer_kind(name, layer, layer_re, has_kind, kind_grp) AS layer_kind,
  attribution_layer_index(name, layer, layer_re, has_idx, idx_grp) AS layer_index
FROM _a
JOIN _pref ON _pref.run_id = _a.run_id AND _pref.rank = _a.rank;

-- attribution_items: every kernel and memop of `run_ids` with the host call that launched
-- it, found by (run_id, rank, correlation). When several calls share a correlation (a
-- runtime call and the driver call under it), the earliest-starting one is the launch.
--   launched   a launching call was found;
--   is_graph   the item was replayed from a CUDA/HIP graph: it carries a graph_id, or its
--              launching call's name matches graph_launch_re (cudaGraphLaunch, hipGraphLaunch).
CREATE OR REPLACE MACRO attribution_items(run_ids, graph_launch_re) AS TABLE
WITH _items AS (
  SELECT 'kernel' AS item_kind, kernel_id AS item_id, run_id, rank, stream, correlation,
         name, start_ns, end_ns, graph_id
  FROM kernels WHERE list_contains(run_ids, run_id)
  UNION ALL
  SELECT 'memop' AS item_kind, memop_id AS item_id, run_id, rank, stream, correlation,
         name, start_ns, end_ns, graph_id
  FROM memops WHERE list_contains(run_ids, run_id)
),
_calls AS (
  SELECT run_id, rank, correlation, call_id, pid, tid, name, start_ns
  FROM api_calls
  WHERE list_contains(run_ids, run_id) AND correlation IS NOT NULL
  QUALIFY row_number() OVER (
    PARTITION BY run_id, rank, correlation ORDER BY start_ns, call_id
  ) = 1
)
SELECT
  i.item_kind, i.item_id, i.run_id, i.rank, i.stream, i.correlation, i.name,
  i.start_ns, i.end_ns, i.graph_id,
  c.call_id, c.pid, c.tid, c.name AS call_name, c.start_ns AS call_start_ns,
  c.call_id IS NOT NULL AS launched,
  (i.graph_id IS NOT NULL OR coalesce(regexp_matches(c.name, graph_launch_re), false)) AS is_graph
FROM _items i
LEFT JOIN _calls c
  ON c.run_id = i.run_id AND c.rank = i.rank AND c.correlation = i.correlation;
