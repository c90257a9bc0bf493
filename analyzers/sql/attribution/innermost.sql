-- requires:
-- attribution.innermost: the innermost enclosing interval of each point, for intervals that
-- nest properly within each key (NVTX push/pop ranges and record_function scopes on one
-- thread do). Intervals are half-open [start_ns, end_ns): a point at an interval's end is
-- outside it; zero-length intervals contain nothing and are dropped.
--
-- No range join: two ASOF joins, so it scales to millions of points (O(n log n)).
--   1. depth: a +1/-1 sweep over interval edges gives open_n(t), the number of intervals
--      open at t. An interval r's depth (0 = outermost) is open_n(r.start) minus the
--      intervals that start at the same instant and nest inside r (same start, shorter; ties
--      broken by range_id), counted by their position among same-start intervals.
--   2. for a point t with D = open_n(t) > 0, the innermost enclosing interval is the one of
--      depth D - 1 that started last at or before t: any later-starting interval of the same
--      depth would lie inside it and so have a greater depth.
-- If the intervals of a key do not nest, step 2 can land on an interval that does not
-- contain t; such points get range_id NULL and nested_ok = false, so callers can count them.

-- ranges: relation with key, range_id, start_ns, end_ns. points: relation with key,
-- point_id, t_ns. Returns one row per point: key, point_id, t_ns, range_id (NULL when no
-- interval encloses the point), nested_ok.
CREATE OR REPLACE MACRO attribution_innermost(ranges, points) AS TABLE
WITH _r AS (
  SELECT key, range_id, start_ns, end_ns
  FROM query_table(ranges)
  WHERE end_ns > start_ns
),
_edges AS (
  SELECT key, ts, CAST(sum(delta) AS BIGINT) AS delta
  FROM (
    SELECT key, start_ns AS ts, 1 AS delta FROM _r
    UNION ALL
    SELECT key, end_ns AS ts, -1 AS delta FROM _r
  )
  GROUP BY key, ts
),
_open AS (
  SELECT
    key, ts,
    sum(delta) OVER (PARTITION BY key ORDER BY ts ROWS UNBOUNDED PRECEDING) AS open_n
  FROM _edges
),
_same_start AS (
  SELECT
    key, range_id, start_ns, end_ns,
    count(*) OVER (PARTITION BY key, start_ns) AS _n_same,
    row_number() OVER (
      PARTITION BY key, start_ns ORDER BY end_ns DESC, range_id
    ) - 1 AS _pos
  FROM _r
),
_depth AS (
  SELECT
    s.key, s.range_id, s.start_ns, s.end_ns,
    CAST(o.open_n - (s._n_same - s._pos) AS BIGINT) AS depth
  FROM _same_start s
  JOIN _open o ON o.key = s.key AND o.ts = s.start_ns
),
_p AS (
  SELECT p.key, p.point_id, p.t_ns, coalesce(o.open_n, 0) AS open_n
  FROM query_table(points) p
  ASOF LEFT JOIN _open o ON o.key = p.key AND p.t_ns >= o.ts
)
SELECT
  _p.key, _p.point_id, _p.t_ns,
  CASE WHEN d.end_ns > _p.t_ns THEN d.range_id END AS range_id,
  (_p.open_n = 0 OR d.end_ns > _p.t_ns) AS nested_ok
FROM _p
ASOF LEFT JOIN _depth d
  ON d.key = _p.key AND d.depth = _p.open_n - 1 AND _p.t_ns >= d.start_ns;
