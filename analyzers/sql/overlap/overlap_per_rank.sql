-- requires: intervals/intervals.sql, temporal/device_items.sql
-- Private: communication items (classifier category 'communication') keyed by (run, rank).
CREATE OR REPLACE VIEW _overlap_comm AS
SELECT {'run_id': run_id, 'rank': rank} AS key, start_ns, end_ns
FROM device_items
WHERE category = 'communication';

-- Compute-communication overlap per rank, as HTA's get_comm_comp_overlap: comm_ns is the
-- union of communication items, overlap_ns = |comm ∩ compute| (compute = union of compute
-- kernels on any stream of the rank), exposed_comm_ns = |comm \ compute| = comm_ns -
-- overlap_ns, overlap_pct = 100 * overlap_ns / comm_ns. Communication is what the classifier
-- says (kernels.category), never a name regex here. Ranks without communication have no row.
CREATE OR REPLACE VIEW overlap_per_rank(
  -- Keys: run and rank.
  run_id, rank,
  -- Union of communication items, ns.
  comm_ns,
  -- Part of comm_ns during which a compute kernel runs on some stream, ns.
  overlap_ns,
  -- comm_ns - overlap_ns: communication not hidden under compute, ns.
  exposed_comm_ns,
  -- 100 * overlap_ns / comm_ns, percent.
  overlap_pct
) AS
SELECT key.run_id, key.rank, a_ns, both_ns, a_only_ns, 100.0 * both_ns / nullif(a_ns, 0)
FROM intervals_overlap_totals('_overlap_comm', 'device_compute_by_rank');
