-- requires:
-- kernels_exposed: every kernel of run `run` with its EXPOSED start: the latest of its start,
-- the latest end of the earlier kernels of its (rank, stream), and, for a graph kernel whose
-- capture stream is known, the latest end of the earlier kernels captured on the same stream
-- (same rank); capped at end_ns. Kernels of one stream overlap only under programmatic
-- dependent launch (PDL): the next kernel is resident early and waits in griddepcontrol.wait
-- until its predecessor ends, so from its raw start it would count that wait (a layer whose
-- first kernel became resident during the previous layer's last kernel would own that time
-- too). In a CUDA-graph replay the executor picks the streams itself: the chain captured on
-- one stream can hop between replay streams (at a side stream's fork / join), so a PDL wait
-- shows as overlap across replay streams; the capture stream (attr.capture_stream, from the
-- capture map or an eager reference run) keeps that chain's order. Without PDL (no such overlap) the exposed start is the
-- start; kernels with no stream and no capture stream keep their start. Used wherever kernel
-- time is attributed to layers and ops (layers_steps, the diff's kernel rows).
-- attr: relation shaped like kernel_attribution (item_kind, item_id, run_id, capture_stream).
--   kernel_id, rank, stream, capture_stream, start_ns (raw), exposed_start_ns, end_ns  (ns)
CREATE OR REPLACE MACRO kernels_exposed(attr, run) AS TABLE
WITH _k AS (
  SELECT k.kernel_id, k.rank, k.stream, a.capture_stream, k.start_ns, k.end_ns
  FROM kernels k
  LEFT JOIN (SELECT item_id, capture_stream FROM query_table(attr)
             WHERE run_id = run AND item_kind = 'kernel' AND capture_stream IS NOT NULL) a
    ON a.item_id = k.kernel_id
  WHERE k.run_id = run
),
_prev AS (
  SELECT *,
         CASE WHEN stream IS NOT NULL THEN max(end_ns) OVER (
                PARTITION BY rank, stream ORDER BY start_ns, kernel_id
                ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) END AS prev_stream_end,
         CASE WHEN capture_stream IS NOT NULL THEN max(end_ns) OVER (
                PARTITION BY rank, capture_stream ORDER BY start_ns, kernel_id
                ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) END AS prev_capture_end
  FROM _k
)
SELECT kernel_id, rank, stream, capture_stream, start_ns, end_ns,
       least(end_ns, greatest(start_ns, coalesce(prev_stream_end, start_ns),
                              coalesce(prev_capture_end, start_ns))) AS exposed_start_ns
FROM _prev;
