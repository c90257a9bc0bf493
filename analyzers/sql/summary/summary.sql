-- requires: intervals/intervals.sql
-- Device work of a run: every kernel and every memop (memcpy + memset) as one interval list,
-- with the stream and category the classifier gave it.
CREATE OR REPLACE VIEW summary_device_work(
  -- Keys: run, rank, stream (as in kernels / memops).
  run_id, rank, stream,
  -- Classifier category: compute, communication, memory or prefetch.
  category,
  -- True for a kernel, false for a memop.
  is_kernel,
  -- Kernel or memop name.
  name,
  -- Interval on the device, ns.
  start_ns, end_ns
) AS
SELECT run_id, rank, stream, category, true, name, start_ns, end_ns FROM kernels
UNION ALL
SELECT run_id, rank, stream, category, false, name, start_ns, end_ns FROM memops;

-- Device work keyed per (run, rank), for the interval macros.
CREATE OR REPLACE VIEW _summary_rank_work AS
SELECT {'run_id': run_id, 'rank': rank} AS key, start_ns, end_ns FROM summary_device_work;

-- Device work keyed per (run, rank, stream).
CREATE OR REPLACE VIEW _summary_stream_work AS
SELECT {'run_id': run_id, 'rank': rank, 'stream': stream} AS key, start_ns, end_ns FROM summary_device_work;

-- Device work keyed per (run, rank, category).
CREATE OR REPLACE VIEW _summary_category_work AS
SELECT {'run_id': run_id, 'rank': rank, 'category': category} AS key, start_ns, end_ns FROM summary_device_work;

-- One line per run. GPU busy time is the union of kernel AND memop intervals on each rank
-- (time when the device runs anything, on any stream, counted once), summed over ranks.
-- Span is, per rank, the first device-work start to the last device-work end; the run's span
-- is the largest over its ranks.
CREATE OR REPLACE VIEW summary_runs(
  -- Run id and name (runs).
  run_id, name,
  -- Ranks with at least one kernel or memop.
  ranks,
  -- Number of kernels, of memops (memcpy + memset) and of host runtime/driver API calls.
  kernels, memops, api_calls,
  -- max over ranks of (last end - first start) of device work, ns.
  span_ns,
  -- sum over ranks of |union of kernel and memop intervals|, ns.
  busy_ns
) AS
WITH per_rank AS (
  SELECT run_id, rank, max(end_ns) - min(start_ns) AS span_ns
  FROM summary_device_work GROUP BY run_id, rank
),
busy AS (
  SELECT key.run_id AS run_id, CAST(sum(busy_ns) AS BIGINT) AS busy_ns
  FROM intervals_totals('_summary_rank_work') GROUP BY key.run_id
)
SELECT
  r.run_id, r.name,
  (SELECT count(*) FROM per_rank AS p WHERE p.run_id = r.run_id),
  (SELECT count(*) FROM kernels AS k WHERE k.run_id = r.run_id),
  (SELECT count(*) FROM memops AS m WHERE m.run_id = r.run_id),
  (SELECT count(*) FROM api_calls AS a WHERE a.run_id = r.run_id),
  coalesce((SELECT max(span_ns) FROM per_rank AS p WHERE p.run_id = r.run_id), 0),
  coalesce((SELECT b.busy_ns FROM busy AS b WHERE b.run_id = r.run_id), 0)
FROM runs AS r;

-- Per stream: kernel count and busy time, the union of the stream's kernel and memop
-- intervals (overlapping work on one stream, rare but possible, counted once).
CREATE OR REPLACE VIEW summary_streams(
  -- Keys: run, rank, stream.
  run_id, rank, stream,
  -- Kernels on the stream.
  kernels,
  -- |union of kernel and memop intervals on the stream|, ns.
  busy_ns
) AS
WITH counts AS (
  SELECT run_id, rank, stream, count(*) FILTER (WHERE is_kernel) AS kernels
  FROM summary_device_work GROUP BY run_id, rank, stream
),
busy AS (
  SELECT key.run_id AS run_id, key.rank AS rank, key.stream AS stream, busy_ns
  FROM intervals_totals('_summary_stream_work')
)
SELECT c.run_id, c.rank, c.stream, c.kernels, coalesce(b.busy_ns, 0)
FROM counts AS c
LEFT JOIN busy AS b
  ON b.run_id = c.run_id AND b.rank = c.rank AND b.stream IS NOT DISTINCT FROM c.stream;

-- Per category: the union of that category's kernel and memop intervals on each rank,
-- summed over ranks (categories may overlap each other in time, so they need not add up to
-- busy_ns).
CREATE OR REPLACE VIEW summary_categories(
  -- Keys: run, classifier category.
  run_id, category,
  -- sum over ranks of |union of the category's intervals|, ns.
  busy_ns
) AS
SELECT key.run_id, key.category, CAST(sum(busy_ns) AS BIGINT)
FROM intervals_totals('_summary_category_work')
GROUP BY key.run_id, key.category;

-- Kernels by name: how many and their summed duration (not a union: concurrent instances
-- of one kernel each count).
CREATE OR REPLACE VIEW summary_kernel_totals(
  -- Keys: run, kernel name.
  run_id, name,
  -- Number of kernels with this name.
  kernel_count,
  -- sum of (end_ns - start_ns), ns.
  total_ns
) AS
SELECT run_id, name, count(*), CAST(sum(end_ns - start_ns) AS BIGINT)
FROM kernels GROUP BY run_id, name;
