"""Which runs a folder holds: per-rank files of one run, or independent world-size-1 captures.

Oracles: hand-made traces whose kernel counts are the number of kernels each file was given,
and, for the bundled `traces/` folder, each file ingested alone into a fresh store.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.kineto_builder import KinetoTraceBuilder
from tracer.errors import BadInput
from tracer.ingest import ingest_path
from tracer.store import open_store

REPO = Path(__file__).resolve().parents[2]


def _trace(path: Path, kernels: int, rank: int | None = 0, world_size: int | None = 1,
           ds: dict | None = None, bad: bool = False) -> Path:
    """A trace with `kernels` launched kernels (one more with a negative duration when `bad`)."""
    b = KinetoTraceBuilder(rank=rank, world_size=world_size)
    for i in range(kernels):
        b.launch(f"k{i}", i * 1_000, 10, i * 1_000 + 100, 50)
    if bad:
        b.kernel("broken", 90_000, -7)
    return b.write(path, gz=path.name.endswith(".gz"), decodescope_meta=ds)


def _runs(con) -> list[tuple[str, int, int]]:
    """(name, kernels, ranks) of every run, by name, counted straight from the tables."""
    return con.execute("""
        SELECT r.name, count(k.run_id), count(DISTINCT k.rank)
        FROM runs AS r LEFT JOIN kernels AS k USING (run_id) GROUP BY r.name ORDER BY r.name
    """).fetchall()


def test_world_size_1_files_are_one_run_each(tmp_path: Path) -> None:
    """distributedInfo.world_size == 1 in every file: 3 files, 3 runs of 2, 3 and 4 kernels."""
    d = tmp_path / "captures"
    for name, n in (("a", 2), ("b", 3), ("c", 4)):
        _trace(d / f"{name}.json", n)
    con = open_store(None)
    infos = ingest_path(con, d, progress=False)
    assert [(i.name, i.kernels, i.ranks, i.reused) for i in infos] == [
        ("a", 2, 1, False), ("b", 3, 1, False), ("c", 4, 1, False)]
    assert _runs(con) == [("a", 2, 1), ("b", 3, 1), ("c", 4, 1)]
    paths = [Path(p).name for (p,) in con.execute("SELECT path FROM runs ORDER BY run_id").fetchall()]
    assert paths == ["a.json", "b.json", "c.json"]
    # The same folder again: every run found by its hash, nothing written.
    again = ingest_path(con, d, progress=False)
    assert [(i.run_id, i.reused) for i in again] == [(i.run_id, True) for i in infos]
    assert con.execute("SELECT count(*) FROM runs").fetchall()[0][0] == 3


def test_decodescope_world_size_1_without_distributed_info(tmp_path: Path) -> None:
    """No distributedInfo, `decodescope.world_size == 1` in both files: two runs."""
    d = tmp_path / "ds"
    _trace(d / "x.json", 1, rank=None, ds={"world_size": 1})
    _trace(d / "y.json.gz", 2, rank=None, ds={"world_size": 1})
    con = open_store(None)
    assert [(i.name, i.kernels) for i in ingest_path(con, d, progress=False)] == [("x", 1), ("y", 2)]


def test_name_option_prefixes_each_run(tmp_path: Path) -> None:
    d = tmp_path / "n"
    _trace(d / "a.json", 1)
    _trace(d / "b.json", 2)  # not the same bytes: identical files would be one run by hash
    con = open_store(None)
    assert [i.name for i in ingest_path(con, d, name="mine", progress=False)] == ["mine/a", "mine/b"]


@pytest.mark.parametrize("second", [
    {"rank": 1, "world_size": 2, "ds": None},     # a real rank of a 2-rank run
    {"rank": None, "world_size": None, "ds": None},  # says nothing: cannot be split off
])
def test_folder_stays_one_run_unless_every_file_is_world_size_1(tmp_path: Path, second: dict) -> None:
    """Rank 0 (world size 2 or 1) next to a file that is not a world-size-1 capture: one run,
    2 ranks, 3 + 4 kernels."""
    d = tmp_path / "mixed"
    _trace(d / "r0.json", 3, rank=0, world_size=2 if second["rank"] == 1 else 1)
    _trace(d / "r1.json", 4, rank=second["rank"], world_size=second["world_size"], ds=second["ds"])
    con = open_store(None)
    [info] = ingest_path(con, d, progress=False)
    assert (info.name, info.kernels, info.ranks) == ("mixed", 7, 2)
    assert _runs(con) == [("mixed", 7, 2)]


def test_two_files_claiming_one_rank_are_refused(tmp_path: Path) -> None:
    """Two files of a world-size-2 folder both say rank 0: one BadInput naming both, nothing stored."""
    d = tmp_path / "clash"
    _trace(d / "a.json", 1, rank=0, world_size=2)
    _trace(d / "b.json", 1, rank=0, world_size=2)
    _trace(d / "c.json", 1, rank=1, world_size=2)
    con = open_store(None)
    with pytest.raises(BadInput) as err:
        ingest_path(con, d, progress=False)
    assert str(err.value.path) == str(d)
    assert err.value.problem == ("2 files claim rank 0 (a.json, b.json): "
                                 "a folder must hold the per-rank files of one run")
    assert con.execute("SELECT count(*) FROM runs").fetchall()[0][0] == 0


def test_a_bad_file_keeps_the_runs_before_it(tmp_path: Path) -> None:
    """Documented behaviour: runs of a split folder commit one by one in name order; a bad
    file stops the call with its own name, the runs before it stay whole, none after it."""
    d = tmp_path / "partial"
    _trace(d / "a.json", 2)
    _trace(d / "b.json", 2, bad=True)
    _trace(d / "c.json", 2)
    con = open_store(None)
    with pytest.raises(BadInput) as err:
        ingest_path(con, d, progress=False)
    assert Path(err.value.path).name == "b.json"
    assert _runs(con) == [("a", 2, 1)]


def test_bundled_traces_folder_is_one_run_per_file() -> None:
    """traces/: independent captures (stock and fused, 8 each), one run per file, each with the
    kernels of that file alone."""
    folder = REPO / "traces"
    files = sorted(folder.glob("*.json.gz"))
    assert len(files) == 16
    con = open_store(None)
    infos = ingest_path(con, folder, progress=False)
    assert len(infos) == len(files)
    for info, f in zip(infos, files):
        alone = open_store(None)
        [single] = ingest_path(alone, f, progress=False)
        assert (info.name, info.kernels, info.ranks) == (single.name, single.kernels, 1)
        assert info.kernels > 0
