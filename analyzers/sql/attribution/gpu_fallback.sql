-- requires:
-- attribution.gpu_fallback: items whose launching call is not in the trace (an nsys or
-- profiler window that cut the host side, a missing CUPTI record) borrow the attribution
-- of the GPU time they fall in. The GPU span of a layer instance is [first start, last end]
-- of the items already attributed to it (per run, rank, step_index, layer and host range);
-- an unlaunched item lying wholly inside exactly one layer instance's span takes that
-- instance's step and layer, and its op when exactly one op span of that instance holds it.
-- Inside no layer span, it takes the step when exactly one step span holds it. Several
-- candidates mean ambiguous: the item stays unattributed and is counted as such.
-- The same applies to memcpy/memset nodes replayed from a CUDA graph: the capture map lists
-- kernels only, so a replayed memop takes the layer whose kernels' GPU span holds it.

-- work: relation shaped like attribution_by_range(...) (after graph attribution). One row per
-- unlaunched item: its new step, step_index, layer, layer_index, layer_kind, op (NULL when
-- not found) and n_layer_candidates / n_step_candidates (how many spans held it).
CREATE OR REPLACE MACRO attribution_gpu_fallback(work) AS TABLE
WITH _w AS (SELECT * FROM query_table(work)),
_lost AS (
  SELECT run_id, rank, item_kind, item_id, start_ns, end_ns
  FROM _w
  WHERE NOT launched OR (is_graph AND item_kind = 'memop' AND layer IS NULL)
),
_layer_spans AS (
  SELECT
    run_id, rank, step, step_index, layer, layer_index, layer_kind, layer_range_id,
    min(start_ns) AS s, max(end_ns) AS e
  FROM _w
  WHERE launched AND layer IS NOT NULL
  GROUP BY ALL
),
_op_spans AS (
  SELECT run_id, rank, step_index, layer, layer_range_id, op, min(start_ns) AS s, max(end_ns) AS e
  FROM _w
  WHERE launched AND layer IS NOT NULL AND op IS NOT NULL
  GROUP BY ALL
),
_step_spans AS (
  SELECT run_id, rank, step, step_index, min(start_ns) AS s, max(end_ns) AS e
  FROM _w
  WHERE launched AND step_index IS NOT NULL
  GROUP BY ALL
),
_l AS (
  SELECT
    x.run_id, x.item_kind, x.item_id,
    count(*) AS n, any_value(ls) AS ls
  FROM _lost x
  JOIN _layer_spans ls
    ON ls.run_id = x.run_id AND ls.rank = x.rank AND ls.s <= x.start_ns AND ls.e >= x.end_ns
  GROUP BY x.run_id, x.item_kind, x.item_id
),
_o AS (
  SELECT x.run_id, x.item_kind, x.item_id, count(*) AS n, any_value(os.op) AS op
  FROM _lost x
  JOIN _l ON _l.run_id = x.run_id AND _l.item_kind = x.item_kind AND _l.item_id = x.item_id
    AND _l.n = 1
  JOIN _op_spans os
    ON os.run_id = x.run_id AND os.rank = x.rank
    AND os.step_index IS NOT DISTINCT FROM _l.ls.step_index AND os.layer = _l.ls.layer
    AND os.layer_range_id IS NOT DISTINCT FROM _l.ls.layer_range_id
    AND os.s <= x.start_ns AND os.e >= x.end_ns
  GROUP BY x.run_id, x.item_kind, x.item_id
),
_s AS (
  SELECT x.run_id, x.item_kind, x.item_id, count(*) AS n, any_value(ss) AS ss
  FROM _lost x
  JOIN _step_spans ss
    ON ss.run_id = x.run_id AND ss.rank = x.rank AND ss.s <= x.start_ns AND ss.e >= x.end_ns
  GROUP BY x.run_id, x.item_kind, x.item_id
)
SELECT
  x.run_id, x.rank, x.item_kind, x.item_id,
  CASE WHEN _l.n = 1 THEN _l.ls.step WHEN _s.n = 1 THEN _s.ss.step END AS step,
  CASE WHEN _l.n = 1 THEN _l.ls.step_index WHEN _s.n = 1 THEN _s.ss.step_index END AS step_index,
  CASE WHEN _l.n = 1 THEN _l.ls.layer END AS layer,
  CASE WHEN _l.n = 1 THEN _l.ls.layer_index END AS layer_index,
  CASE WHEN _l.n = 1 THEN _l.ls.layer_kind END AS layer_kind,
  CASE WHEN _l.n = 1 AND _o.n = 1 THEN _o.op END AS op,
  coalesce(_l.n, 0) AS n_layer_candidates,
  coalesce(_s.n, 0) AS n_step_candidates
FROM _lost x
LEFT JOIN _l ON _l.run_id = x.run_id AND _l.item_kind = x.item_kind AND _l.item_id = x.item_id
LEFT JOIN _o ON _o.run_id = x.run_id AND _o.item_kind = x.item_kind AND _o.item_id = x.item_id
LEFT JOIN _s ON _s.run_id = x.run_id AND _s.item_kind = x.item_kind AND _s.item_id = x.item_id;
