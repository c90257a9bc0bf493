-- requires: intervals/intervals.sql
-- Timeline queries for the dashboard: the kernels of one rank of one run inside a time window,
-- or, when a window holds too many to draw, those kernels aggregated into equal time bins per
-- stream (server-side windowing: the browser only ever receives what the visible window needs).
-- All times are BIGINT ns on the rank's clock; a window is the half-open [t0_ns, t1_ns).

-- Decode steps of one rank, in time order: the host ranges whose name matches p_step_re (our
-- `step`), or p_fallback_re (`ProfilerStep#N`) when a rank has none (the attribution's step
-- patterns). step_index is 0-based. The device window of a step (dev_start_ns, dev_end_ns) is
-- the first start and last end of the kernels whose launching API call (same rank, same
-- correlation) starts inside the host range; a step with no such kernel keeps its host range.
CREATE OR REPLACE MACRO timeline_steps(p_run, p_rank, p_step_re, p_fallback_re) AS TABLE
WITH _named AS (
  SELECT
    range_id, name, start_ns, end_ns,
    CASE WHEN regexp_matches(name, p_step_re) THEN 0 ELSE 1 END AS _family
  FROM ranges
  WHERE run_id = p_run AND rank = p_rank
    AND (regexp_matches(name, p_step_re) OR regexp_matches(name, p_fallback_re))
),
_steps AS (
  SELECT
    range_id, name, start_ns, end_ns,
    CAST(row_number() OVER (ORDER BY start_ns, range_id) - 1 AS INTEGER) AS step_index
  FROM _named
  WHERE _family = (SELECT min(_family) FROM _named)
),
_launched AS (
  SELECT s.range_id, min(k.start_ns) AS dev_start_ns, max(k.end_ns) AS dev_end_ns,
         count(*) AS kernels
  FROM _steps AS s
  JOIN api_calls AS a
    ON a.run_id = p_run AND a.rank = p_rank
    AND a.start_ns >= s.start_ns AND a.start_ns < s.end_ns
  JOIN kernels AS k
    ON k.run_id = p_run AND k.rank = p_rank AND k.correlation = a.correlation
  GROUP BY s.range_id
)
SELECT
  s.step_index, s.name, s.start_ns AS host_start_ns, s.end_ns AS host_end_ns,
  coalesce(l.dev_start_ns, s.start_ns) AS dev_start_ns,
  coalesce(l.dev_end_ns, s.end_ns) AS dev_end_ns,
  coalesce(l.kernels, 0) AS kernels
FROM _steps AS s
LEFT JOIN _launched AS l USING (range_id)
ORDER BY s.step_index;

-- Extent of one rank of one run: first kernel start, last kernel end, kernel count, streams.
CREATE OR REPLACE MACRO timeline_extent(p_run, p_rank) AS TABLE
SELECT
  min(start_ns) AS first_start_ns,
  max(end_ns) AS last_end_ns,
  count(*) AS kernels,
  count(DISTINCT stream) AS streams
FROM kernels
WHERE run_id = p_run AND rank = p_rank;

-- Number of kernels of one rank that overlap the window [p_t0, p_t1).
CREATE OR REPLACE MACRO timeline_window_count(p_run, p_rank, p_t0, p_t1) AS TABLE
SELECT count(*) AS kernels
FROM kernels
WHERE run_id = p_run AND rank = p_rank AND end_ns > p_t0 AND start_ns < p_t1;

-- Every kernel of one rank that overlaps the window [p_t0, p_t1), unclipped, in start order.
CREATE OR REPLACE MACRO timeline_window_kernels(p_run, p_rank, p_t0, p_t1) AS TABLE
SELECT kernel_id, stream, name, category, start_ns, end_ns, end_ns - start_ns AS dur_ns
FROM kernels
WHERE run_id = p_run AND rank = p_rank AND end_ns > p_t0 AND start_ns < p_t1
ORDER BY start_ns, kernel_id;

-- The kernels of the window aggregated per stream into p_bins equal bins of the window. A
-- kernel falls in the bin of its start clipped to the window. Per bin: kernel count, the
-- first start and last end of its kernels (unclipped), busy_ns = sum of kernel durations
-- clipped to the window (kernels of one stream do not overlap, so this is the stream's busy
-- time there), and the name of its longest kernel.
CREATE OR REPLACE MACRO timeline_window_bins(p_run, p_rank, p_t0, p_t1, p_bins) AS TABLE
WITH _k AS (
  SELECT
    stream, name, start_ns, end_ns,
    least(end_ns, p_t1) - greatest(start_ns, p_t0) AS clipped_ns,
    least(
      (greatest(start_ns, p_t0) - p_t0) * p_bins // (p_t1 - p_t0),
      p_bins - 1
    ) AS bin
  FROM kernels
  WHERE run_id = p_run AND rank = p_rank AND end_ns > p_t0 AND start_ns < p_t1
)
SELECT
  stream, CAST(bin AS INTEGER) AS bin,
  count(*) AS kernels,
  min(start_ns) AS start_ns,
  max(end_ns) AS end_ns,
  CAST(sum(clipped_ns) AS BIGINT) AS busy_ns,
  arg_max(name, end_ns - start_ns) AS longest_name
FROM _k
GROUP BY stream, bin
ORDER BY stream, bin;

-- Device-idle intervals inside the window: the gaps of the union of every kernel and memop
-- interval of the rank, across all streams, restricted to [p_t0, p_t1). This is the bubble
-- interval definition (without the cause, which analyzers.bubbles assigns).
CREATE OR REPLACE MACRO timeline_window_idle(p_run, p_rank, p_t0, p_t1) AS TABLE
WITH _busy AS (
  SELECT 0 AS key, start_ns, end_ns FROM kernels
  WHERE run_id = p_run AND rank = p_rank AND end_ns > p_t0 AND start_ns < p_t1
  UNION ALL
  SELECT 0 AS key, start_ns, end_ns FROM memops
  WHERE run_id = p_run AND rank = p_rank AND end_ns > p_t0 AND start_ns < p_t1
)
SELECT start_ns, end_ns, gap_ns
FROM intervals_gaps(_busy)
ORDER BY start_ns;

-- Device-side layer bands in the window from the profiler's own projections of host
-- annotations (Kineto gpu_user_annotation), for names that match the layer pattern p_regex.
CREATE OR REPLACE MACRO timeline_window_annotation_bands(p_run, p_rank, p_t0, p_t1, p_regex) AS TABLE
SELECT name AS layer, start_ns, end_ns
FROM gpu_annotations
WHERE run_id = p_run AND rank = p_rank AND end_ns > p_t0 AND start_ns < p_t1
  AND regexp_matches(name, p_regex)
ORDER BY start_ns;
