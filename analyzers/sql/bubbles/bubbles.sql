-- requires: intervals/intervals.sql, temporal/device_items.sql, launch/launch_delays.sql
-- Private: host calls that block the host until the device (or a stream, or an event) is done:
-- cuda/hip Device/Stream/Event/Ctx Synchronize, and synchronous memcpy calls.
CREATE OR REPLACE VIEW _bubble_host_syncs AS
SELECT run_id, rank, name, start_ns, end_ns FROM api_calls
WHERE regexp_matches(name, '(?i)(synchroni[sz]e|^(cuda|hip)Memcpy(2D|3D|FromSymbol|ToSymbol)?$|^cuMemcpy[DH]to[DH](_v2)?$)')
UNION ALL
SELECT run_id, rank, name, start_ns, end_ns FROM gpu_syncs
WHERE name IN ('Context Sync', 'Stream Sync', 'Event Sync');

-- Bubbles: maximal intervals inside a step when the device runs nothing, i.e. the gaps of the
-- union of all kernels and memops of a rank across every stream, at ns precision. A step spans
-- from the first start to the last end of the items attributed to it (table `attr`, shaped as
-- kernel_attribution); a gap belongs to the step whose span contains it (the lowest step index
-- if spans overlap); gaps between steps are not bubbles. Each bubble sits between prev (the
-- item whose end opens the gap; latest start wins a tie) and next (the item whose start closes
-- it; lowest stream, then id, wins a tie), and its layer and op are next's (prev's when next
-- has none). Its cause is the first that holds, in this order:
--   graph_boundary: next was launched by a graph launch (cudaGraphLaunch, or it has a graph id)
--     and prev was not launched by that same launch call (new replay, or first graph kernel);
--   host_sync: a blocking host call (cuda/hip *Synchronize, synchronous cudaMemcpy) or a
--     Context/Stream/Event Sync record overlaps the gap, and next had not been issued when the
--     gap began (its launch call ended after the gap start, or is unknown); a sync while the
--     device still had queued work (e.g. inside one graph replay) is not the cause;
--   launch_bound: next is not graph-launched and its launching host call ended after the gap
--     began (the device finished prev before the host had issued next);
--   event_wait: a 'Stream Wait Event' record on next's stream, waiting on another stream, lies
--     between the end of the previous item on next's stream and next's start;
--   in_graph: prev and next are nodes of one graph replay (same graph launch): the device idled
--     between two nodes of one CUDA graph (node launch latency, or next waiting for a node on
--     another branch of the graph); nothing on the host explains it;
--   other: none of the above.
-- p_run (optional): only that run. Every run is partitioned on its own, so a run's rows are
-- the same either way; the filter sits in the first scans (items, syncs), so one small run
-- costs its own size, not the store's (a 615-kernel run next to a 1M-kernel run: see
-- analyzers/bubbles.py). NULL (the default): every run of the store.
CREATE OR REPLACE MACRO bubbles_in_steps(attr, p_run := NULL) AS TABLE
WITH _items AS (
  SELECT d.*, a.step, a.step_index, a.layer, a.op,
         max(d.end_ns) OVER (
           PARTITION BY d.run_id, d.rank, d.stream ORDER BY d.start_ns, d.item_kind, d.item_id
           ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING
         ) AS prev_on_stream_end_ns
  FROM device_items d
  LEFT JOIN query_table(attr) a
    ON a.run_id = d.run_id AND a.rank = d.rank AND a.item_kind = d.item_kind AND a.item_id = d.item_id
  WHERE p_run IS NULL OR d.run_id = p_run
),
-- Device-wide idle gaps per rank over the whole timeline (no stream runs anything).
_keyed AS (
  SELECT {'run_id': run_id, 'rank': rank} AS key, start_ns, end_ns FROM _items
),
_gaps AS (
  SELECT key.run_id AS run_id, key.rank AS rank, start_ns, end_ns, gap_ns
  FROM intervals_gaps('_keyed')
),
_syncs AS (
  SELECT * FROM _bubble_host_syncs WHERE p_run IS NULL OR run_id = p_run
),
_launches AS (
  SELECT * FROM launch_calls WHERE p_run IS NULL OR run_id = p_run
),
_steps AS (
  SELECT run_id, rank, step_index, any_value(step) AS step,
         min(start_ns) AS step_start_ns, max(end_ns) AS step_end_ns
  FROM _items WHERE step_index IS NOT NULL
  GROUP BY run_id, rank, step_index
),
_in_step AS (
  SELECT g.run_id, g.rank, s.step_index, s.step, g.start_ns, g.end_ns, g.gap_ns
  FROM _gaps g
  JOIN _steps s
    ON g.run_id = s.run_id AND g.rank = s.rank
    AND g.start_ns >= s.step_start_ns AND g.end_ns <= s.step_end_ns
  QUALIFY row_number() OVER (PARTITION BY g.run_id, g.rank, g.start_ns ORDER BY s.step_index) = 1
),
_with_prev AS (
  SELECT b.*, p.item_kind AS prev_kind, p.item_id AS prev_id, p.name AS prev_name,
         p.stream AS prev_stream, p.layer AS prev_layer, p.op AS prev_op,
         p.correlation AS prev_correlation
  FROM _in_step b
  JOIN _items p ON p.run_id = b.run_id AND p.rank = b.rank AND p.end_ns = b.start_ns
  QUALIFY row_number() OVER (PARTITION BY b.run_id, b.rank, b.start_ns
                             ORDER BY p.start_ns DESC, p.stream, p.item_kind, p.item_id) = 1
),
_with_next AS (
  SELECT b.*, n.item_kind AS next_kind, n.item_id AS next_id, n.name AS next_name,
         n.stream AS next_stream, n.layer AS next_layer, n.op AS next_op,
         n.correlation AS next_correlation, n.graph_id AS next_graph_id,
         n.start_ns AS next_start_ns, n.prev_on_stream_end_ns
  FROM _with_prev b
  JOIN _items n ON n.run_id = b.run_id AND n.rank = b.rank AND n.start_ns = b.end_ns
  QUALIFY row_number() OVER (PARTITION BY b.run_id, b.rank, b.start_ns
                             ORDER BY n.stream, n.item_kind, n.item_id) = 1
),
_facts AS (
  SELECT b.*,
    l.end_ns AS launch_end_ns,
    coalesce(regexp_matches(l.name, '(?i)graph_?launch'), false) OR b.next_graph_id IS NOT NULL
      AS next_graph_launched,
    EXISTS (SELECT 1 FROM _syncs h
            WHERE h.run_id = b.run_id AND h.rank = b.rank
              AND h.start_ns < b.end_ns AND h.end_ns > b.start_ns) AS host_sync,
    EXISTS (SELECT 1 FROM gpu_syncs w
            WHERE w.run_id = b.run_id AND w.rank = b.rank AND w.name = 'Stream Wait Event'
              AND w.stream = b.next_stream
              AND (w.wait_on_stream IS NULL OR w.wait_on_stream <> b.next_stream)
              AND w.start_ns >= coalesce(b.prev_on_stream_end_ns, b.start_ns)
              AND w.start_ns <= b.next_start_ns) AS event_wait
  FROM _with_next b
  LEFT JOIN _launches l
    ON l.run_id = b.run_id AND l.rank = b.rank AND l.correlation = b.next_correlation
)
SELECT
  run_id, rank, step_index, step, start_ns, end_ns, gap_ns,
  CASE
    WHEN next_graph_launched AND prev_correlation IS DISTINCT FROM next_correlation THEN 'graph_boundary'
    WHEN host_sync AND (launch_end_ns IS NULL OR launch_end_ns > start_ns) THEN 'host_sync'
    WHEN NOT next_graph_launched AND launch_end_ns > start_ns THEN 'launch_bound'
    WHEN event_wait THEN 'event_wait'
    WHEN next_graph_launched AND prev_correlation = next_correlation THEN 'in_graph'
    ELSE 'other'
  END AS cause,
  coalesce(next_layer, prev_layer) AS layer,
  CASE WHEN next_layer IS NOT NULL OR prev_layer IS NULL THEN next_op ELSE prev_op END AS op,
  prev_kind, prev_id, prev_name, prev_stream, prev_layer, prev_op,
  next_kind, next_id, next_name, next_stream, next_layer, next_op
FROM _facts;

-- Bubble totals per step: span_ns is the step's span (first item start to last item end),
-- bubble_ns the sum of its bubbles, busy_ns = span_ns - bubble_ns (the union of device items
-- inside the span), and bubble_ns split by cause. Steps without bubbles have zeros.
-- p_run (optional) as in bubbles_in_steps: only that run; NULL, every run.
CREATE OR REPLACE MACRO bubble_steps(attr, p_run := NULL) AS TABLE
WITH _items AS (
  SELECT d.run_id, d.rank, d.start_ns, d.end_ns, a.step_index, a.step
  FROM device_items d
  JOIN query_table(attr) a
    ON a.run_id = d.run_id AND a.rank = d.rank AND a.item_kind = d.item_kind AND a.item_id = d.item_id
  WHERE a.step_index IS NOT NULL AND (p_run IS NULL OR d.run_id = p_run)
),
_steps AS (
  SELECT run_id, rank, step_index, any_value(step) AS step,
         max(end_ns) - min(start_ns) AS span_ns
  FROM _items GROUP BY run_id, rank, step_index
),
_b AS (
  SELECT run_id, rank, step_index,
    CAST(sum(gap_ns) AS BIGINT) AS bubble_ns,
    CAST(coalesce(sum(gap_ns) FILTER (WHERE cause = 'launch_bound'), 0) AS BIGINT) AS launch_bound_ns,
    CAST(coalesce(sum(gap_ns) FILTER (WHERE cause = 'graph_boundary'), 0) AS BIGINT) AS graph_boundary_ns,
    CAST(coalesce(sum(gap_ns) FILTER (WHERE cause = 'host_sync'), 0) AS BIGINT) AS host_sync_ns,
    CAST(coalesce(sum(gap_ns) FILTER (WHERE cause = 'event_wait'), 0) AS BIGINT) AS event_wait_ns,
    CAST(coalesce(sum(gap_ns) FILTER (WHERE cause = 'in_graph'), 0) AS BIGINT) AS in_graph_ns,
    CAST(coalesce(sum(gap_ns) FILTER (WHERE cause = 'other'), 0) AS BIGINT) AS other_ns,
    count(*) AS bubbles
  FROM bubbles_in_steps(attr, p_run := p_run) GROUP BY run_id, rank, step_index
)
SELECT s.run_id, s.rank, s.step_index, s.step, s.span_ns,
  s.span_ns - coalesce(b.bubble_ns, 0) AS busy_ns,
  coalesce(b.bubble_ns, 0) AS bubble_ns,
  coalesce(b.bubbles, 0) AS bubbles,
  coalesce(b.launch_bound_ns, 0) AS launch_bound_ns,
  coalesce(b.graph_boundary_ns, 0) AS graph_boundary_ns,
  coalesce(b.host_sync_ns, 0) AS host_sync_ns,
  coalesce(b.event_wait_ns, 0) AS event_wait_ns,
  coalesce(b.in_graph_ns, 0) AS in_graph_ns,
  coalesce(b.other_ns, 0) AS other_ns
FROM _steps s
LEFT JOIN _b b ON b.run_id = s.run_id AND b.rank = s.rank AND b.step_index = s.step_index;
