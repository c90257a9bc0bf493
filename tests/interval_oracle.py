"""Plain-Python interval oracles that tests compare our SQL interval algebra against.

Written once here (they were pasted into five test modules): a sort-and-sweep union, its length,
and maximal runs of integer points. Deliberately independent of analyzers/sql/intervals.
"""
from __future__ import annotations

from collections.abc import Iterable


def merge_intervals(rows: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Union of [s, e) intervals as sorted disjoint intervals, by the plain sort-and-sweep
    (touching intervals merge; an empty [s, s) adds no length)."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(rows):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def total_ns(rows: Iterable[tuple[int, int]]) -> int:
    """Summed length of intervals (disjoint ones, e.g. from merge_intervals)."""
    return sum(e - s for s, e in rows)


def union_ns(rows: Iterable[tuple[int, int]]) -> int:
    """|∪ rows|: the length of the union."""
    return total_ns(merge_intervals(rows))


def point_runs(points: set[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive integers as [start, end) pairs, sorted."""
    out: list[tuple[int, int]] = []
    for p in sorted(points):
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out
