-- requires: intervals/intervals.sql
-- Timeline queries for the dashboard: the kernels of one rank of one run inside a time window,
-- or, when a window holds too many to draw, those kernels aggregated into equal time bins per
-- stream (server-side windowing: the browser only ever receives what the visible window needs).
-- All times are BIGINT ns on the rank's clock; a window is the half-open [t0_ns, t1_ns).

-- Decode steps of one rank, in step order: the steps of the attribution (table `attr`, shaped
-- as kernel_attribution, built by analyzers.attribution.attribute), so the timeline's steps are
-- the ones every other page counts: same step patterns (`step`, SGLang `step[DECODE ...]`, else
-- ProfilerStep#N, or the user's --step-pattern), same step_index. A step's device window
-- (dev_start_ns, dev_end_ns) is the first start and last end of the kernels attributed to it;
-- a step range to which no kernel is attributed is not listed (its index is skipped).
CREATE OR REPLACE MACRO timeline_steps(attr, p_run, p_rank) AS TABLE
SELECT
  a.step_index, min(a.step) AS name,
  min(k.start_ns) AS dev_start_ns, max(k.end_ns) AS dev_end_ns,
  count(*) AS kernels
FROM query_table(attr) AS a
JOIN kernels AS k
  ON k.run_id = a.run_id AND k.rank = a.rank AND k.kernel_id = a.item_id
WHERE a.item_kind = 'kernel' AND a.run_id = p_run AND a.rank = p_rank
  AND a.step_index IS NOT NULL
GROUP BY a.step_index
ORDER BY a.step_index;

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
