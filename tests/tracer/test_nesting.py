"""Range nesting against a brute-force oracle: the parent is the latest-starting range of the
same thread that is open at the child's start (ends after it) and precedes it in sort order."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tracer.ingest.nesting import nest


def _brute(rows: list[tuple[int, int, int]]) -> tuple[list[int], list[int | None]]:
    """rows sorted by (thread, start, -end); ids are positions. Well-nested input only."""
    parents: list[int | None] = []
    for i, (t, s, e) in enumerate(rows):
        enclosing = [j for j in range(i) if rows[j][0] == t and rows[j][1] <= s and rows[j][2] > s and rows[j][2] >= e]
        parents.append(max(enclosing, key=lambda j: (rows[j][1], j)) if enclosing else None)
    depth = []
    for i in range(len(rows)):
        d, p = 0, parents[i]
        while p is not None:
            d, p = d + 1, parents[p]
        depth.append(d)
    return depth, parents


@st.composite
def nested_ranges(draw) -> list[tuple[int, int, int]]:
    """Well-nested ranges on up to 3 threads, built by recursive splitting of [0, 1000]."""
    rows: list[tuple[int, int, int]] = []

    def fill(t: int, lo: int, hi: int, level: int) -> None:
        cur = lo
        for _ in range(draw(st.integers(0, 3 if level < 3 else 0))):
            if cur >= hi:
                break
            s = draw(st.integers(cur, hi))
            e = draw(st.integers(s, hi))
            rows.append((t, s, e))
            if e > s:
                fill(t, s, e, level + 1)
            cur = e if e > s else e + 1

    for t in range(draw(st.integers(1, 3))):
        fill(t, 0, 1000, 0)
    return sorted(rows, key=lambda r: (r[0], r[1], -r[2]))


@given(nested_ranges())
def test_nest_matches_brute_force(rows: list[tuple[int, int, int]]) -> None:
    depth, parent = nest([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], list(range(len(rows))))
    assert (depth, parent) == _brute(rows)


def test_partial_overlap_nests_under_open_range() -> None:
    # A [0,10], B [2,12] overlaps A's end, C [11,13] starts after A ended but inside B.
    depth, parent = nest([0, 0, 0], [0, 2, 11], [10, 12, 13], [100, 101, 102])
    assert depth == [0, 1, 2] and parent == [None, 100, 101]
