-- requires: intervals/intervals.sql, temporal/device_items.sql
-- Compute-communication overlap per step and per layer: the communication items attributed to a
-- step (level 'step') or to a layer within a step (level 'layer', layer '' when the item has no
-- layer) by the attribution table `attr` (shaped as kernel_attribution); comm_ns is the union of
-- those items, overlap_ns the part of it during which any compute kernel of the rank runs (on
-- any stream, whatever its own step or layer), exposed_comm_ns = comm_ns - overlap_ns,
-- overlap_pct = 100 * overlap_ns / comm_ns. Same definition as overlap_per_rank, per group.
CREATE OR REPLACE MACRO overlap_by_layer(attr) AS TABLE
WITH _comm_items AS (
  SELECT d.run_id, d.rank, a.step_index, a.step, coalesce(a.layer, '') AS layer, d.start_ns, d.end_ns
  FROM device_items d
  JOIN query_table(attr) a
    ON a.run_id = d.run_id AND a.rank = d.rank AND a.item_kind = d.item_kind AND a.item_id = d.item_id
  WHERE d.category = 'communication' AND a.step_index IS NOT NULL
),
_comm AS (
  SELECT {'run_id': run_id, 'rank': rank, 'step_index': step_index, 'step': step, 'level': 'layer',
          'layer': layer} AS key, start_ns, end_ns
  FROM _comm_items
  UNION ALL
  SELECT {'run_id': run_id, 'rank': rank, 'step_index': step_index, 'step': step, 'level': 'step',
          'layer': ''} AS key, start_ns, end_ns
  FROM _comm_items
),
_hull AS (SELECT key, min(start_ns) AS lo, max(end_ns) AS hi FROM _comm GROUP BY key),
_compute AS (
  SELECT h.key, d.start_ns, d.end_ns
  FROM _hull h
  JOIN device_items d
    ON d.run_id = h.key.run_id AND d.rank = h.key.rank AND d.category = 'compute'
    AND d.start_ns < h.hi AND d.end_ns > h.lo
)
SELECT key.run_id AS run_id, key.rank AS rank, key.step_index AS step_index, key.step AS step,
  key.level AS level, key.layer AS layer,
  a_ns AS comm_ns, both_ns AS overlap_ns, a_only_ns AS exposed_comm_ns,
  100.0 * both_ns / nullif(a_ns, 0) AS overlap_pct
FROM intervals_overlap_totals('_comm', '_compute');
