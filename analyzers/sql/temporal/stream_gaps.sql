-- requires: intervals/intervals.sql, temporal/device_items.sql
-- Private: device items keyed by (run, rank, stream).
CREATE OR REPLACE VIEW _stream_items AS
SELECT {'run_id': run_id, 'rank': rank, 'stream': stream} AS key, start_ns, end_ns
FROM device_items;

-- Stream gaps: per stream, the maximal intervals between consecutive work on THAT stream (the
-- union of its kernels and memops), as HTA's idle time is per stream. Not bubbles: a stream
-- gap may be fully covered by work on another stream; a bubble (bubbles_in_steps) is time
-- when no stream of the rank runs anything.
CREATE OR REPLACE VIEW stream_gaps(
  -- Keys: run, rank, stream.
  run_id, rank, stream,
  -- Gap start (end of the stream's previous work) and end (start of its next work), ns.
  start_ns, end_ns,
  -- end_ns - start_ns, > 0, ns.
  gap_ns
) AS
SELECT key.run_id, key.rank, key.stream, start_ns, end_ns, gap_ns
FROM intervals_gaps('_stream_items');
