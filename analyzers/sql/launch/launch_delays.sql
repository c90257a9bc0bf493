-- requires: temporal/device_items.sql
-- Launch calls: the host call that launched each correlation id, one row per (run, rank,
-- correlation). When a runtime and a driver call share the id (cudaLaunchKernel over
-- cuLaunchKernel), the runtime call is the launch; among equals the earliest.
CREATE OR REPLACE VIEW launch_calls(
  -- Keys: run, rank, correlation id (links kernels/memops to this call).
  run_id, rank, correlation,
  -- Call name, e.g. cudaLaunchKernel, cudaGraphLaunch, cudaMemcpyAsync.
  name,
  -- Host start and end of the call, ns (same clock as the device on that rank).
  start_ns, end_ns
) AS
SELECT run_id, rank, correlation,
       arg_min(name, (kind <> 'runtime', start_ns)),
       arg_min(start_ns, (kind <> 'runtime', start_ns)),
       arg_min(end_ns, (kind <> 'runtime', start_ns))
FROM api_calls
WHERE correlation IS NOT NULL
GROUP BY run_id, rank, correlation;

-- Launch delays: for every kernel and memop whose launching host call is in the trace, the
-- launch-to-start delay = device start - launch call start (ns), and whether the item ran for
-- less time than its launch call took on the host (a sign of launch-bound work). Items
-- replayed from a CUDA graph share one graph launch, so their delay grows along the replay;
-- they are marked graph_launched and summarised apart.
CREATE OR REPLACE VIEW launch_delays(
  -- Keys: run, rank, item kind ('kernel' | 'memop') and id.
  run_id, rank, item_kind, item_id,
  -- Item name and stream.
  name, stream,
  -- The launching call's name and its duration, ns.
  launch_name, launch_dur_ns,
  -- Device duration of the item, ns.
  dur_ns,
  -- Device start - launch call start, ns (>= 0 on a consistent clock).
  delay_ns,
  -- True when launched by a graph launch (cudaGraphLaunch / hipGraphLaunch) or carrying a graph id.
  graph_launched,
  -- dur_ns < launch_dur_ns; NULL for graph-launched items, which have no launch call of their
  -- own (one cudaGraphLaunch starts the whole replay), so the comparison says nothing there.
  shorter_than_launch
) AS
SELECT d.run_id, d.rank, d.item_kind, d.item_id, d.name, d.stream,
  l.name, l.end_ns - l.start_ns,
  d.end_ns - d.start_ns,
  d.start_ns - l.start_ns,
  regexp_matches(l.name, '(?i)graph_?launch') OR d.graph_id IS NOT NULL,
  CASE WHEN regexp_matches(l.name, '(?i)graph_?launch') OR d.graph_id IS NOT NULL THEN NULL
       ELSE (d.end_ns - d.start_ns) < (l.end_ns - l.start_ns) END
FROM device_items d
JOIN launch_calls l ON l.run_id = d.run_id AND l.rank = d.rank AND l.correlation = d.correlation;
