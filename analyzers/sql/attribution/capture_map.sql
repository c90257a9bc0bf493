-- requires:
-- attribution.capture_map: layer and op of kernels replayed from a CUDA graph, from the map
-- our tracer records at capture (graph_capture_map: node_order -> kernel name, layer, op).
-- A replay is the set of kernels sharing one graph launch's correlation; its kernels are
-- numbered 0.. in start order (ties by kernel_id) and matched to the map's node_order. A
-- replay is attributed only when it verifies: as many kernels as the map has nodes and every
-- name equal, position by position ('exact'). Kernels on concurrent streams can start in
-- another order than at capture; so a replay whose names equal the map's as a multiset is
-- matched by (name, occurrence): the k-th kernel named X in the replay is the map's k-th node
-- named X ('reordered', counted apart). This holds when kernels of one name keep their order,
-- which they do on one stream. Anything else is a mismatch: not attributed, reported. Where
-- the map holds several graphs, each replay takes the graph that verifies (one whose graph_id
-- agrees when both sides know it).

-- items: relation shaped like attribution_items(...); cmap: relation shaped like
-- graph_capture_map (all its columns; capture_stream NULL where the map has none). One row per
-- (replay, kernel), for the graph candidate chosen for the replay (the verified one, else the
-- closest): n_replay and n_map (kernel counts), n_equal (positions whose names agree), n_occ
-- (kernels whose (name, occurrence) is in the map), verified, match ('exact' | 'reordered' |
-- NULL), and per kernel expected_name (at its position), layer_name, op_name and
-- capture_stream (from the node it is matched to).
CREATE OR REPLACE MACRO attribution_capture_map(items, cmap, run_ids) AS TABLE
WITH _g AS (
  SELECT
    run_id, rank, correlation, item_id, name, graph_id,
    row_number() OVER (PARTITION BY run_id, rank, correlation ORDER BY start_ns, item_id) - 1
      AS node_order,
    row_number() OVER (PARTITION BY run_id, rank, correlation, name ORDER BY start_ns, item_id)
      AS occ,
    count(*) OVER (PARTITION BY run_id, rank, correlation) AS n_replay
  FROM query_table(items)
  WHERE is_graph AND launched AND item_kind = 'kernel'
),
_m AS (
  SELECT
    run_id, rank, graph_id AS map_graph_id, node_order, kernel_name, layer_name, op_name,
    capture_stream,
    row_number() OVER (PARTITION BY run_id, rank, graph_id, kernel_name ORDER BY node_order) AS occ,
    count(*) OVER (PARTITION BY run_id, rank, graph_id) AS n_map
  FROM query_table(cmap)
  WHERE list_contains(run_ids, run_id)
),
_replays AS (
  SELECT run_id, rank, correlation, any_value(graph_id) AS graph_id, any_value(n_replay) AS n_replay
  FROM _g GROUP BY run_id, rank, correlation
),
_graphs AS (
  SELECT DISTINCT run_id, rank, map_graph_id, n_map FROM _m
),
_cand AS (
  SELECT r.run_id, r.rank, r.correlation, r.n_replay, g.map_graph_id, g.n_map
  FROM _replays r
  JOIN _graphs g
    ON g.run_id = r.run_id AND g.rank = r.rank
    AND (g.map_graph_id IS NULL OR r.graph_id IS NULL OR g.map_graph_id = r.graph_id)
),
_pairs AS (
  SELECT
    c.run_id, c.rank, c.correlation, c.map_graph_id, c.n_replay, c.n_map,
    g.item_id, g.node_order, g.name, m.kernel_name AS expected_name,
    m.layer_name AS pos_layer, m.op_name AS pos_op, m.capture_stream AS pos_stream,
    o.node_order IS NOT NULL AS occ_found, o.layer_name AS occ_layer, o.op_name AS occ_op,
    o.capture_stream AS occ_stream
  FROM _cand c
  JOIN _g g ON g.run_id = c.run_id AND g.rank = c.rank AND g.correlation = c.correlation
  LEFT JOIN _m m
    ON m.run_id = c.run_id AND m.rank = c.rank
    AND m.map_graph_id IS NOT DISTINCT FROM c.map_graph_id AND m.node_order = g.node_order
  LEFT JOIN _m o
    ON o.run_id = c.run_id AND o.rank = c.rank
    AND o.map_graph_id IS NOT DISTINCT FROM c.map_graph_id
    AND o.kernel_name = g.name AND o.occ = g.occ
),
_verdict AS (
  SELECT
    run_id, rank, correlation, map_graph_id,
    count(*) FILTER (WHERE expected_name = name) AS n_equal,
    count(*) FILTER (WHERE occ_found) AS n_occ,
    CASE
      WHEN any_value(n_replay) <> any_value(n_map) THEN NULL
      WHEN count(*) FILTER (WHERE expected_name = name) = any_value(n_replay) THEN 'exact'
      WHEN count(*) FILTER (WHERE occ_found) = any_value(n_replay) THEN 'reordered'
    END AS match
  FROM _pairs
  GROUP BY run_id, rank, correlation, map_graph_id
),
_best AS (
  SELECT *
  FROM _verdict
  QUALIFY row_number() OVER (
    PARTITION BY run_id, rank, correlation
    ORDER BY match = 'exact' DESC NULLS LAST, match = 'reordered' DESC NULLS LAST,
             n_equal DESC, map_graph_id NULLS FIRST
  ) = 1
)
SELECT
  p.run_id, p.rank, p.correlation, p.map_graph_id, p.n_replay, p.n_map, p.item_id,
  p.node_order, p.name, p.expected_name,
  CASE WHEN b.match = 'reordered' THEN p.occ_layer ELSE p.pos_layer END AS layer_name,
  CASE WHEN b.match = 'reordered' THEN p.occ_op ELSE p.pos_op END AS op_name,
  CASE WHEN b.match = 'reordered' THEN p.occ_stream ELSE p.pos_stream END AS capture_stream,
  b.n_equal, b.n_occ, b.match, b.match IS NOT NULL AS verified
FROM _pairs p
JOIN _best b
  ON b.run_id = p.run_id AND b.rank = p.rank AND b.correlation = p.correlation
  AND b.map_graph_id IS NOT DISTINCT FROM p.map_graph_id;
