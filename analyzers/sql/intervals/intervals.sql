-- requires:
-- Interval algebra over integer-ns intervals, written once and reused by every analysis
-- (summary, layers, bubbles, overlap, prefetch). Each macro takes the NAME of a relation
-- (table or view) through query_table(); the relation must have the columns
--   key       any type: intervals are only combined within the same key (e.g. a STRUCT of
--             run_id, rank, step), so one call handles every group at once;
--   start_ns  BIGINT;
--   end_ns    BIGINT, >= start_ns.
-- Zero-length intervals (end_ns = start_ns) carry no time and are ignored everywhere.

-- Union: the maximal disjoint intervals covered by at least one input interval, per key.
-- Algorithm: sort by start; an interval opens a new island when it starts strictly after the
-- running maximum end of every earlier interval (touching intervals merge); each island is
-- [min start, max end] of its members. O(n log n), one window pass.
CREATE OR REPLACE MACRO intervals_union(rel) AS TABLE
WITH _ordered AS (
  SELECT
    key, start_ns, end_ns,
    max(end_ns) OVER (
      PARTITION BY key ORDER BY start_ns, end_ns
      ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING
    ) AS _prev_max_end
  FROM query_table(rel)
  WHERE end_ns > start_ns
),
_islands AS (
  SELECT
    key, start_ns, end_ns,
    sum(CASE WHEN _prev_max_end IS NULL OR start_ns > _prev_max_end THEN 1 ELSE 0 END) OVER (
      PARTITION BY key ORDER BY start_ns, end_ns ROWS UNBOUNDED PRECEDING
    ) AS _island
  FROM _ordered
)
SELECT key, min(start_ns) AS start_ns, max(end_ns) AS end_ns
FROM _islands
GROUP BY key, _island;

-- Gaps: the maximal intervals between consecutive islands of the union, per key (the idle
-- time strictly inside [first start, last end]). gap_ns = end_ns - start_ns > 0.
CREATE OR REPLACE MACRO intervals_gaps(rel) AS TABLE
WITH _u AS (SELECT * FROM intervals_union(rel)),
_n AS (
  SELECT key, end_ns AS start_ns, lead(start_ns) OVER (PARTITION BY key ORDER BY start_ns) AS end_ns
  FROM _u
)
SELECT key, start_ns, end_ns, end_ns - start_ns AS gap_ns
FROM _n
WHERE end_ns IS NOT NULL AND end_ns > start_ns;

-- Intersection: the pieces of time covered by both relation a and relation b, per key.
-- Both sides are unioned first, so the pieces are disjoint and their lengths add up to
-- |A ∩ B| exactly (a range join of two disjoint interval sets).
CREATE OR REPLACE MACRO intervals_intersect(a, b) AS TABLE
WITH _ua AS (SELECT * FROM intervals_union(a)),
_ub AS (SELECT * FROM intervals_union(b))
SELECT
  _ua.key AS key,
  greatest(_ua.start_ns, _ub.start_ns) AS start_ns,
  least(_ua.end_ns, _ub.end_ns) AS end_ns
FROM _ua
JOIN _ub
  ON _ua.key = _ub.key
  AND _ub.start_ns < _ua.end_ns
  AND _ub.end_ns > _ua.start_ns;

-- Per-key totals of the union: busy_ns = |∪ intervals|, span_ns = last end - first start.
CREATE OR REPLACE MACRO intervals_totals(rel) AS TABLE
SELECT
  key,
  min(start_ns) AS first_start_ns,
  max(end_ns) AS last_end_ns,
  max(end_ns) - min(start_ns) AS span_ns,
  CAST(sum(end_ns - start_ns) AS BIGINT) AS busy_ns
FROM intervals_union(rel)
GROUP BY key;

-- Per-key |A ∩ B| and |A \ B| = |A| - |A ∩ B| (keys of A only; keys of A with no B give 0 overlap).
CREATE OR REPLACE MACRO intervals_overlap_totals(a, b) AS TABLE
WITH _ta AS (SELECT key, busy_ns AS a_ns FROM intervals_totals(a)),
_ti AS (
  SELECT key, CAST(sum(end_ns - start_ns) AS BIGINT) AS both_ns
  FROM intervals_intersect(a, b) GROUP BY key
)
SELECT
  _ta.key AS key,
  _ta.a_ns AS a_ns,
  coalesce(_ti.both_ns, 0) AS both_ns,
  _ta.a_ns - coalesce(_ti.both_ns, 0) AS a_only_ns
FROM _ta LEFT JOIN _ti ON _ta.key = _ti.key;
