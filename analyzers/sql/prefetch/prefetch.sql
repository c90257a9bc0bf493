-- requires: intervals/intervals.sql, temporal/device_items.sql
-- Prefetch effectiveness, one row per prefetch item, for the attribution table `attr` (shaped
-- as kernel_attribution). A prefetch item is a kernel or memop whose classifier category is
-- 'prefetch' or whose attributed op name contains 'prefetch'.
--   hidden_ns: the part of the item's interval during which non-prefetch work runs on another
--     stream of the rank (|P ∩ ∪ other-stream work|); hidden_pct = 100 * hidden_ns / dur_ns.
--   consumer: the first non-prefetch kernel on another stream of the rank that starts at or after
--     the prefetch starts and lies in a later layer (same step, higher layer index) when the
--     prefetch has a layer index; without one, in another op than the prefetch's (an
--     unattributed kernel counts as another op). Ties: lowest kernel id.
--   lead_ns = consumer start - prefetch end (how long the data was ready before it was needed;
--     negative when late); late = the consumer started before the prefetch ended.
CREATE OR REPLACE MACRO prefetch_items(attr) AS TABLE
WITH _items AS (
  SELECT d.*, a.step_index, a.layer, a.layer_index, a.op,
    d.category = 'prefetch' OR coalesce(a.op ILIKE '%prefetch%', false) AS is_prefetch
  FROM device_items d
  LEFT JOIN query_table(attr) a
    ON a.run_id = d.run_id AND a.rank = d.rank AND a.item_kind = d.item_kind AND a.item_id = d.item_id
),
_p AS (SELECT * FROM _items WHERE is_prefetch),
_pa AS (
  SELECT {'run_id': run_id, 'rank': rank, 'item_kind': item_kind, 'item_id': item_id} AS key,
         start_ns, end_ns
  FROM _p
),
_other AS (
  SELECT {'run_id': p.run_id, 'rank': p.rank, 'item_kind': p.item_kind, 'item_id': p.item_id} AS key,
         o.start_ns, o.end_ns
  FROM _p p
  JOIN _items o
    ON o.run_id = p.run_id AND o.rank = p.rank AND o.stream IS DISTINCT FROM p.stream
    AND NOT o.is_prefetch AND o.start_ns < p.end_ns AND o.end_ns > p.start_ns
),
_hidden AS (SELECT * FROM intervals_overlap_totals('_pa', '_other')),
_consumer AS (
  SELECT p.run_id, p.rank, p.item_kind, p.item_id,
         c.item_id AS consumer_id, c.name AS consumer_name, c.layer AS consumer_layer,
         c.op AS consumer_op, c.step_index AS consumer_step_index,
         c.start_ns AS consumer_start_ns, c.end_ns - c.start_ns AS consumer_dur_ns
  FROM _p p
  JOIN _items c
    ON c.run_id = p.run_id AND c.rank = p.rank AND c.item_kind = 'kernel' AND NOT c.is_prefetch
    AND c.stream IS DISTINCT FROM p.stream AND c.start_ns >= p.start_ns
    AND CASE WHEN p.layer_index IS NOT NULL
             THEN c.layer_index > p.layer_index AND c.step_index IS NOT DISTINCT FROM p.step_index
             ELSE c.op IS NULL OR c.op IS DISTINCT FROM p.op END
  QUALIFY row_number() OVER (PARTITION BY p.run_id, p.rank, p.item_kind, p.item_id
                             ORDER BY c.start_ns, c.item_id) = 1
)
SELECT p.run_id, p.rank, p.item_kind, p.item_id, p.name, p.stream, p.step_index, p.layer, p.op,
  p.start_ns, p.end_ns, p.end_ns - p.start_ns AS dur_ns,
  coalesce(h.both_ns, 0) AS hidden_ns,
  100.0 * coalesce(h.both_ns, 0) / nullif(p.end_ns - p.start_ns, 0) AS hidden_pct,
  c.consumer_id, c.consumer_name, c.consumer_layer, c.consumer_op, c.consumer_start_ns,
  c.consumer_dur_ns,
  c.consumer_start_ns - p.end_ns AS lead_ns,
  c.consumer_start_ns < p.end_ns AS late
FROM _p p
LEFT JOIN _hidden h
  ON h.key = {'run_id': p.run_id, 'rank': p.rank, 'item_kind': p.item_kind, 'item_id': p.item_id}
LEFT JOIN _consumer c
  ON c.run_id = p.run_id AND c.rank = p.rank AND c.item_kind = p.item_kind AND c.item_id = p.item_id;

-- The first kernel of each (step, layer, op) of a rank, with its duration: the consumer
-- counterpart in a run without prefetch, matched by layer and op (never by kernel name).
CREATE OR REPLACE MACRO first_kernel_by_layer_op(attr) AS TABLE
SELECT d.run_id, d.rank, a.step_index, a.layer, a.op, d.item_id, d.name, d.end_ns - d.start_ns AS dur_ns
FROM device_items d
JOIN query_table(attr) a
  ON a.run_id = d.run_id AND a.rank = d.rank AND a.item_kind = d.item_kind AND a.item_id = d.item_id
WHERE d.item_kind = 'kernel' AND a.layer IS NOT NULL AND a.step_index IS NOT NULL
QUALIFY row_number() OVER (PARTITION BY d.run_id, d.rank, a.step_index, a.layer, a.op
                           ORDER BY d.start_ns, d.item_id) = 1;
