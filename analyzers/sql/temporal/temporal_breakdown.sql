-- requires: intervals/intervals.sql, temporal/device_items.sql
-- Temporal breakdown per rank, in HTA's sense (get_temporal_breakdown): over the GPU span
-- (first device item start to last device item end, all streams), idle time is the part of
-- the span when no kernel or memop runs on any stream, compute time is the union of compute
-- kernels, non-compute time is the rest of the busy time (communication, memory, prefetch not
-- under a compute kernel). idle + compute + non-compute = span, exactly, in ns.
-- Differences from HTA on purpose: every kernel in the file counts (HTA drops kernels not
-- launched before the last ProfilerStep when there are two or more steps) and only kernels and
-- memops are device time (HTA also counts cuda_sync rows and cpu_op rows carrying a stream).
CREATE OR REPLACE VIEW temporal_breakdown(
  -- Keys: run and rank.
  run_id, rank,
  -- First device item start to last device item end, ns.
  span_ns,
  -- Union of all device items (kernels and memops, all streams), ns.
  busy_ns,
  -- span_ns - busy_ns: no device item runs on any stream, ns.
  idle_ns,
  -- Union of compute kernels, ns.
  compute_ns,
  -- busy_ns - compute_ns: device busy with anything but compute, ns.
  non_compute_ns,
  -- The three shares of span_ns, in percent (NULL when the span is 0).
  idle_pct, compute_pct, non_compute_pct
) AS
WITH _all AS (SELECT * FROM intervals_totals('device_items_by_rank')),
_comp AS (SELECT * FROM intervals_totals('device_compute_by_rank'))
SELECT
  _all.key.run_id, _all.key.rank,
  _all.span_ns,
  _all.busy_ns,
  _all.span_ns - _all.busy_ns,
  coalesce(_comp.busy_ns, 0),
  _all.busy_ns - coalesce(_comp.busy_ns, 0),
  100.0 * (_all.span_ns - _all.busy_ns) / nullif(_all.span_ns, 0),
  100.0 * coalesce(_comp.busy_ns, 0) / nullif(_all.span_ns, 0),
  100.0 * (_all.busy_ns - coalesce(_comp.busy_ns, 0)) / nullif(_all.span_ns, 0)
FROM _all LEFT JOIN _comp ON _all.key = _comp.key;
