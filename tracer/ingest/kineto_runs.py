"""Which runs a folder of Kineto files holds: one multi-rank run, or one run per file.

Why: a folder is normally the per-rank files of one run, but a folder of independent
single-GPU captures (the bundled `traces/`) is not one 8-rank run. A file that declares itself
a whole run of world size 1 (`decodescope.world_size == 1` or `distributedInfo.world_size ==
1`) cannot be one rank of a larger run, so when EVERY file of the folder says so, each file is
its own run. Anything else (a file that says more, says nothing, or cannot be read here) keeps
the folder one run; the reader's `stage` then decides ranks and reports real errors, and
refuses two files claiming the same `distributedInfo.rank` (see `rank_clash`).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tracer.errors import BadInput
from tracer.ingest.kineto_split import read_meta


def _world_size(meta: dict[str, Any] | None) -> int | None:
    """The world size a file declares (decodescope first, then distributedInfo), or None."""
    for key in ("decodescope", "distributedInfo"):
        entry = (meta or {}).get(key)
        ws = entry.get("world_size") if isinstance(entry, dict) else None
        if isinstance(ws, int) and not isinstance(ws, bool):
            return ws
    return None


def folder_runs(folder: Path, files: Sequence[Path]) -> list[list[Path]]:
    """The files of each run in `folder`: one list per run, in name order.

    Stops peeking at the first file that is not a world-size-1 capture, so a real multi-rank
    folder costs one extra metadata read.
    """
    if len(files) < 2:
        return [list(files)]
    for f in files:
        if _world_size(read_meta(f)) != 1:
            return [list(files)]
    return [[f] for f in files]


def rank_clash(folder: Path, files: Sequence[Path], ranks: Sequence[int | None]) -> None:
    """BadInput when two or more files of one run declare the same rank.

    Why: falling back to file order would silently relabel ranks of what are probably
    unrelated captures; the user must separate them.
    """
    claims: dict[int, list[str]] = {}
    for f, r in zip(files, ranks):
        if r is not None:
            claims.setdefault(r, []).append(f.name)
    for rank, names in sorted(claims.items()):
        if len(names) > 1:
            raise BadInput(folder, f"{len(names)} files claim rank {rank} ({', '.join(names)}): "
                                   "a folder must hold the per-rank files of one run")
