-- requires: intervals/intervals.sql
-- Device items: every kernel and every memory operation (memcpy, memset) of a run, one row
-- each, as the one relation that "the device runs something" is computed from. A bubble, an
-- idle gap or busy time is always about this union across all streams of a rank.
CREATE OR REPLACE VIEW device_items(
  -- Keys: run, rank, and which table the item comes from ('kernel' | 'memop') with its id there.
  run_id, rank, item_kind, item_id,
  -- Stream the item ran on, and the correlation id of the API call that launched it.
  stream, correlation,
  -- Kernel or memop name as the trace gives it.
  name,
  -- Classifier category: 'compute' | 'communication' | 'memory' | 'prefetch'.
  category,
  -- Device start and end, ns (one clock per rank).
  start_ns, end_ns,
  -- CUDA graph id when the item was replayed from a graph, else NULL.
  graph_id
) AS
SELECT run_id, rank, 'kernel', kernel_id, stream, correlation, name, category, start_ns, end_ns,
       graph_id
FROM kernels
UNION ALL
SELECT run_id, rank, 'memop', memop_id, stream, correlation, name, category, start_ns, end_ns,
       graph_id
FROM memops;

-- Every device item keyed by (run, rank), in the shape the interval macros take.
CREATE OR REPLACE VIEW device_items_by_rank(
  -- {run_id, rank}.
  key,
  -- Device start and end, ns.
  start_ns, end_ns
) AS
SELECT {'run_id': run_id, 'rank': rank}, start_ns, end_ns FROM device_items;

-- Compute items (classifier category 'compute') keyed by (run, rank): the one "compute" side
-- of the temporal breakdown and of compute-communication overlap.
CREATE OR REPLACE VIEW device_compute_by_rank(
  -- {run_id, rank}.
  key,
  -- Device start and end, ns.
  start_ns, end_ns
) AS
SELECT {'run_id': run_id, 'rank': rank}, start_ns, end_ns FROM device_items
WHERE category = 'compute';
