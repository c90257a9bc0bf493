"""Load the analyzers' SQL (views and macros) into a store connection.

Every `analyzers/sql/<area>/<name>.sql` file holds only CREATE OR REPLACE VIEW / MACRO
statements and starts with a `-- requires: a/b.sql, c/d.sql` line naming the files it builds
on (paths relative to analyzers/sql). `load_views` runs every file once, dependencies first.
The comment block directly above each `CREATE OR REPLACE VIEW name` is copied into DuckDB with
COMMENT ON VIEW, so `duckdb_views()`, reports and dashboard tooltips quote the same definition.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import duckdb

SQL_ROOT = Path(__file__).resolve().parent / "sql"
_REQUIRES = re.compile(r"^--\s*requires:(.*)$", re.MULTILINE)
_VIEW = re.compile(r"((?:^--.*\n)+)CREATE OR REPLACE VIEW\s+(\w+)", re.MULTILINE)


def _requires(text: str) -> list[str]:
    match = _REQUIRES.search(text)
    if not match:
        return []
    return [part.strip() for part in match.group(1).split(",") if part.strip()]


@lru_cache(maxsize=1)
def ordered_sql_files() -> tuple[Path, ...]:
    """Every SQL file under analyzers/sql, each after the files it requires."""
    files = {p.relative_to(SQL_ROOT).as_posix(): p for p in sorted(SQL_ROOT.rglob("*.sql"))}
    ordered: list[str] = []
    visiting: set[str] = set()

    def visit(rel: str) -> None:
        if rel in ordered:
            return
        if rel not in files:
            raise FileNotFoundError(f"analyzers/sql/{rel}: required but missing")
        if rel in visiting:
            raise ValueError(f"analyzers/sql/{rel}: circular -- requires:")
        visiting.add(rel)
        for dep in _requires(files[rel].read_text()):
            visit(dep)
        visiting.discard(rel)
        ordered.append(rel)

    for rel in files:
        visit(rel)
    return tuple(files[r] for r in ordered)


def _definition(comment_block: str) -> str:
    lines = [ln[2:].strip() for ln in comment_block.strip().splitlines() if ln.startswith("--")]
    return " ".join(ln for ln in lines if ln and not ln.lower().startswith("requires:"))


def load_views(con: duckdb.DuckDBPyConnection) -> None:
    """Create (or replace) every analyzer view and macro on `con`, with its definition as comment.

    Views are created as TEMP objects when the store is read-only, so analyses also run on a
    store opened read-only.
    """
    read_only = _is_read_only(con)
    for path in ordered_sql_files():
        text = path.read_text()
        if read_only:
            text = text.replace("CREATE OR REPLACE VIEW", "CREATE OR REPLACE TEMP VIEW")
            text = text.replace("CREATE OR REPLACE MACRO", "CREATE OR REPLACE TEMP MACRO")
        con.execute(text)
        for block, name in _VIEW.findall(path.read_text()):
            definition = _definition(block)
            if definition and not read_only:
                con.execute(f"COMMENT ON VIEW {name} IS " + _quote(definition))


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _is_read_only(con: duckdb.DuckDBPyConnection) -> bool:
    row = con.execute(
        "SELECT readonly FROM duckdb_databases() WHERE database_name = current_database()"
    ).fetchall()
    return bool(row and row[0][0])
