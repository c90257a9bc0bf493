-- requires:
-- kernels_exposed: every kernel of run `run` with its EXPOSED start: max(start_ns, the latest
-- end of the earlier kernels of the same (rank, stream)), capped at end_ns. Kernels of one
-- stream overlap only under programmatic dependent launch (PDL): the next kernel is resident
-- early and waits in griddepcontrol.wait until its predecessor ends, so from its raw start it
-- would count that wait (a layer whose first kernel became resident during the previous
-- layer's last kernel would own that time too). Without PDL (no same-stream overlap) the
-- exposed start is the start; kernels with no stream keep their start. Used wherever kernel
-- time is attributed to layers and ops (layers_steps, the diff's kernel rows).
--   kernel_id, rank, stream, start_ns (raw), exposed_start_ns, end_ns   (TIMESTAMP, ns)
CREATE OR REPLACE MACRO kernels_exposed(run) AS TABLE
SELECT kernel_id, rank, stream, start_ns, end_ns,
       CASE WHEN stream IS NULL THEN start_ns
            ELSE least(end_ns, greatest(start_ns, coalesce(max(end_ns) OVER (
                   PARTITION BY rank, stream ORDER BY start_ns, kernel_id
                   ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), start_ns))) END AS exposed_start_ns
FROM kernels WHERE run_id = run;
