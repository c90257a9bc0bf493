"""Kernel categories (compute, communication, memory, prefetch) from rules users can extend.

A rule matches a kernel when every field it sets matches (NULL fields match anything):
  name_regex  RE2 regex searched in the kernel name (add `(?i)` for case-insensitive);
  stream      the kernel's stream id;
  op_regex    RE2 regex searched in the innermost user annotation / NVTX range that encloses
              the host API call which launched the kernel (same rank and thread, via correlation).
Of the matching rules the lowest `priority` wins. Three origins, in this order:
  user      rules from `--rules FILE` (priority 0..999, in file order);
  metadata  from the trace's `decodescope` object: `comm_streams`/`prefetch_streams` (whole
            streams) and `comm_ops`/`prefetch_ops` (regexes on the launching annotation)
            (priority 1000..1999) -- so metadata always beats a kernel's name;
  default   name patterns (priority 2000..), then `compute` for everything else.
Memops (memcpy/memset) are 'memory' unless a matching rule says 'prefetch'.

A rules file is JSON or TOML with a list named `rules` (JSON may also be the bare list):
    {"rules": [{"category": "communication", "name_regex": "(?i)my_allreduce"},
               {"category": "prefetch", "stream": 13},
               {"category": "communication", "op_regex": "^o_proj\\+ar$"}]}
    # TOML
    [[rules]]
    category = "prefetch"
    op_regex = "prefetch"
Every rule is stored per run in `category_rules`, so a category can be explained later;
the classification itself runs as SQL inside the ingest transaction.
"""
from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from tracer.errors import BadInput

CATEGORIES = ("compute", "communication", "memory", "prefetch")
USER_PRIORITY, METADATA_PRIORITY, DEFAULT_PRIORITY, FALLBACK_PRIORITY = 0, 1000, 2000, 9999


@dataclass(frozen=True)
class Rule:
    """One classifier rule, as stored in category_rules."""

    priority: int
    category: str
    name_regex: str | None = None
    stream: int | None = None
    op_regex: str | None = None
    origin: str = "default"


DEFAULT_RULES: tuple[Rule, ...] = (
    # NCCL / RCCL collectives and point-to-point kernels.
    Rule(DEFAULT_PRIORITY + 0, "communication", name_regex=r"(?i)(nccl|rccl)"),
    # vLLM / SGLang custom all-reduce kernels.
    Rule(DEFAULT_PRIORITY + 1, "communication",
         name_regex=r"(?i)(cross_device_reduce|all_?reduce|lamport|one_shot|two_shot)"),
    Rule(DEFAULT_PRIORITY + 2, "prefetch", name_regex=r"(?i)prefetch"),
    # memcpy / memset done by kernels (CUDA copy kernels, ROCm rocclr blits).
    Rule(DEFAULT_PRIORITY + 3, "memory", name_regex=r"(?i)(memcpy|memset|rocclr_(copy|fill)buffer)"),
    Rule(FALLBACK_PRIORITY, "compute"),
)

INSERT_RULE_SQL = """
INSERT INTO category_rules (run_id, priority, category, name_regex, stream, op_regex, origin)
VALUES (?, ?, ?, ?, ?, ?, ?)
"""

# The innermost user annotation / NVTX range around each launching API call (same thread).
LAUNCH_OPS_SQL = """
CREATE OR REPLACE TEMP TABLE _launch_op AS
SELECT a.rank, a.correlation, arg_max(g.name, g.depth) AS op_name
FROM api_calls AS a
JOIN ranges AS g
  ON g.run_id = a.run_id AND g.rank = a.rank AND g.pid IS NOT DISTINCT FROM a.pid
 AND g.tid IS NOT DISTINCT FROM a.tid AND g.kind IN ('user_annotation', 'nvtx')
 AND g.start_ns <= a.start_ns AND g.end_ns >= a.end_ns
WHERE a.run_id = ? AND a.correlation IS NOT NULL
GROUP BY a.rank, a.correlation
"""
NO_LAUNCH_OPS_SQL = """
CREATE OR REPLACE TEMP TABLE _launch_op (rank INTEGER, correlation BIGINT, op_name VARCHAR)
"""

# Kernels replayed from a CUDA graph share the graph launch's correlation, and the launch sits
# in no op annotation, so their launching op comes from the capture map our tracer records
# (graph_capture_map: node_order -> op). A replay is the kernels of one cudaGraphLaunch, in
# start order; it takes the map's ops only when it has exactly the map's kernel count and each
# kernel's name equals the map's name at its position -- a strict check, never a guess (the
# attribution analyzer also handles reordered concurrent streams; such replays stay unmatched
# here and keep their name/stream-based category).
GRAPH_OPS_SQL = """
CREATE OR REPLACE TEMP TABLE _graph_op AS
WITH _replay AS (
  SELECT k.kernel_id, k.rank, k.name,
         row_number() OVER (PARTITION BY k.rank, k.correlation ORDER BY k.start_ns, k.kernel_id) - 1 AS node_order,
         count(*) OVER (PARTITION BY k.rank, k.correlation) AS n_replay
  FROM kernels AS k
  WHERE k.run_id = ? AND EXISTS (
    SELECT 1 FROM api_calls AS a
    WHERE a.run_id = k.run_id AND a.rank = k.rank AND a.correlation = k.correlation
      AND a.name ILIKE '%GraphLaunch%')
),
_map AS (
  SELECT rank, node_order, kernel_name, op_name, count(*) OVER (PARTITION BY rank) AS n_map
  FROM graph_capture_map WHERE run_id = ?
),
_aligned AS (
  SELECT r.kernel_id, r.rank, r.n_replay, m.op_name,
         r.name = m.kernel_name AS same_name
  FROM _replay AS r
  JOIN _map AS m ON m.rank = r.rank AND m.node_order = r.node_order AND m.n_map = r.n_replay
)
SELECT 'kernels' AS item_table, kernel_id AS item_id, op_name
FROM _aligned
WHERE same_name
"""
NO_GRAPH_OPS_SQL = "CREATE OR REPLACE TEMP TABLE _graph_op (item_table VARCHAR, item_id BIGINT, op_name VARCHAR)"

# Matching runs one statement per rule, with the regex as a bound constant (RE2 compiles it
# once; a per-row pattern from a join compiles it per row, ~50x slower). Items a rule matches
# are collected in _rule_hits; the lowest priority per item wins. `{table}`/`{id}` come from
# the fixed pair list below, the WHERE clauses from the fixed _CLAUSES.
_HITS_SQL = """
INSERT INTO _rule_hits
SELECT x.{id}, ?, ?
FROM {table} AS x
LEFT JOIN _launch_op AS o ON o.rank = x.rank AND o.correlation = x.correlation
LEFT JOIN _graph_op AS go ON go.item_table = '{table}' AND go.item_id = x.{id}
WHERE x.run_id = ? {clauses}
"""
_CLAUSES = {
    "name_regex": "AND regexp_matches(x.name, ?)",
    "stream": "AND x.stream = ?",
    "op_regex": "AND regexp_matches(coalesce(go.op_name, o.op_name), ?)",
}
_APPLY_SQL = """
UPDATE {table} SET category = m.category
FROM (SELECT item_id, arg_min(category, priority) AS category FROM _rule_hits GROUP BY item_id) AS m
WHERE {table}.run_id = ? AND {table}.{id} = m.item_id
"""
_TARGETS = (("kernels", "kernel_id", False), ("memops", "memop_id", True))  # (table, id, prefetch rules only)
HITS_TABLE_SQL = "CREATE OR REPLACE TEMP TABLE _rule_hits (item_id BIGINT, priority INTEGER, category VARCHAR)"


def _apply_rules(con: duckdb.DuckDBPyConnection, run_id: int, rules: list[Rule]) -> None:
    """Set category on kernels and memops of the run: first matching rule by priority."""
    for table, id_col, prefetch_only in _TARGETS:
        con.execute(HITS_TABLE_SQL)
        for r in rules:
            if prefetch_only and r.category != "prefetch":
                continue
            fields = {"name_regex": r.name_regex, "stream": r.stream, "op_regex": r.op_regex}
            used = [k for k, v in fields.items() if v is not None]
            sql = _HITS_SQL.format(table=table, id=id_col, clauses=" ".join(_CLAUSES[k] for k in used))
            con.execute(sql, [r.priority, r.category, run_id, *(fields[k] for k in used)])
        con.execute(_APPLY_SQL.format(table=table, id=id_col), [run_id])
    con.execute("DROP TABLE IF EXISTS _rule_hits")


RUN_CONFIG_SQL = "SELECT path, CAST(config AS VARCHAR) FROM runs WHERE run_id = ?"


def _check_regex(where: str | Path, regex: Any, field: str) -> str | None:
    if regex is None:
        return None
    if not isinstance(regex, str):
        raise BadInput(where, f"{field} must be a string regex, got {regex!r}")
    try:
        duckdb.execute("SELECT regexp_matches('', ?)", [regex]).fetchall()
    except duckdb.Error as exc:
        raise BadInput(where, f"{field} {regex!r} is not a valid RE2 regex ({str(exc).splitlines()[0]})") from None
    return regex


def _rule_from(where: str | Path, item: Any, priority: int, origin: str, label: str) -> Rule:
    if not isinstance(item, dict):
        raise BadInput(where, f"{label} is not a table/object")
    unknown = set(item) - {"category", "name_regex", "stream", "op_regex"}
    if unknown:
        raise BadInput(where, f"{label} has unknown keys {sorted(unknown)} (allowed: category, name_regex, stream, op_regex)")
    category = item.get("category")
    if category not in CATEGORIES:
        raise BadInput(where, f"{label}.category must be one of {', '.join(CATEGORIES)}, got {category!r}")
    stream = item.get("stream")
    if stream is not None and (isinstance(stream, bool) or not isinstance(stream, int)):
        raise BadInput(where, f"{label}.stream must be an integer, got {stream!r}")
    rule = Rule(priority, category, _check_regex(where, item.get("name_regex"), f"{label}.name_regex"), stream,
                _check_regex(where, item.get("op_regex"), f"{label}.op_regex"), origin)
    if rule.name_regex is None and rule.stream is None and rule.op_regex is None:
        raise BadInput(where, f"{label} matches everything; give name_regex, stream or op_regex")
    return rule


def load_user_rules(path: Path) -> list[Rule]:
    """Rules from a JSON or TOML file (format by suffix: .toml is TOML, anything else JSON)."""
    if not path.is_file():
        raise BadInput(path, "no such rules file")
    try:
        text = path.read_text()
        doc: Any = tomllib.loads(text) if path.suffix.lower() == ".toml" else json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        kind = "TOML" if path.suffix.lower() == ".toml" else "JSON"
        raise BadInput(path, f"not valid {kind} ({exc})") from None
    items = doc.get("rules") if isinstance(doc, dict) else doc
    if not isinstance(items, list):
        raise BadInput(path, "expected a list of rules under 'rules'")
    return [_rule_from(path, item, USER_PRIORITY + i, "user", f"rules[{i}]") for i, item in enumerate(items)]


def metadata_rules(where: str | Path, config: dict[str, Any] | None) -> list[Rule]:
    """Rules implied by the capture metadata: comm/prefetch streams and op regexes."""
    if not config:
        return []
    rules: list[Rule] = []
    spec = (("comm_streams", "communication", "stream"), ("prefetch_streams", "prefetch", "stream"),
            ("comm_ops", "communication", "op_regex"), ("prefetch_ops", "prefetch", "op_regex"))
    for key, category, field in spec:
        values = config.get(key) or []
        if isinstance(values, str) and field == "op_regex":
            values = [values]  # one regex is as good as a list of one
        if not isinstance(values, list):
            raise BadInput(where, f"decodescope.{key} must be a list")
        for i, v in enumerate(values):
            rules.append(_rule_from(where, {"category": category, field: v},
                                    METADATA_PRIORITY + len(rules), "metadata", f"decodescope.{key}[{i}]"))
    return rules


def classify_run(con: duckdb.DuckDBPyConnection, run_id: int, user_rules: list[Rule]) -> list[Rule]:
    """Store this run's rules and set kernels/memops category for it; returns the rules used."""
    path, config_text = con.execute(RUN_CONFIG_SQL, [run_id]).fetchall()[0]
    config = json.loads(config_text) if config_text else None
    rules = [*user_rules, *metadata_rules(path, config), *DEFAULT_RULES]
    con.executemany(INSERT_RULE_SQL, [[run_id, r.priority, r.category, r.name_regex, r.stream, r.op_regex, r.origin]
                                      for r in rules])
    if any(r.op_regex for r in rules):
        con.execute(LAUNCH_OPS_SQL, [run_id])
        con.execute(GRAPH_OPS_SQL, [run_id, run_id])
    else:
        con.execute(NO_LAUNCH_OPS_SQL)
        con.execute(NO_GRAPH_OPS_SQL)
    try:
        _apply_rules(con, run_id, rules)
    finally:
        con.execute("DROP TABLE IF EXISTS _launch_op")
        con.execute("DROP TABLE IF EXISTS _graph_op")
    return rules
