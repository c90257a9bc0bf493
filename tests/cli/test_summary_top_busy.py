"""`decodescope summary`: --top must be >= 0 (one usage line, exit 2), and the busy/span text
says what it divides. Oracle for the percentages: the JSON's own integer ns, recomputed."""
from __future__ import annotations

import json
import re
from pathlib import Path

from click.testing import CliRunner

from cli.exit_codes import BAD_INPUT, OK
from cli.main import main
from tests.kineto_builder import KinetoTraceBuilder


def _rank(folder: Path, rank: int, kernels: list[tuple[int, int]]) -> None:
    b = KinetoTraceBuilder(rank=rank, world_size=2)
    for i, (start, dur) in enumerate(kernels):
        b.launch(f"k{i}", max(start - 50, 0), 10, start, dur)
    b.write(folder / f"rank{rank}.json")


def test_negative_top_is_a_usage_error(tmp_path: Path) -> None:
    _rank(tmp_path / "one", 0, [(100, 50)])
    res = CliRunner().invoke(main, ["summary", str(tmp_path / "one"), "--top", "-1"])
    assert res.exit_code == BAD_INPUT
    assert len(res.stderr.strip().splitlines()) == 1 and "--top" in res.stderr
    assert "Binder" not in res.stderr


def test_multi_rank_busy_text_divides_by_ranks(tmp_path: Path) -> None:
    """Rank 0: kernels [100, 1100) and [1100, 2100): span 2000, busy 2000. Rank 1: [100, 600):
    span 500, busy 500. Summed busy 2500 over the longest span 2000 is 125%; per rank on
    average 2500 / (2 * 2000) = 62.5%."""
    d = tmp_path / "two"
    _rank(d, 0, [(100, 1000), (1100, 1000)])
    _rank(d, 1, [(100, 500)])
    doc = json.loads(CliRunner().invoke(main, ["summary", str(d), "--format", "json"]).output)
    [r] = doc["runs"]
    assert (r["ranks"], r["span_ns"], r["busy_ns"]) == (2, 2000, 2500)
    res = CliRunner().invoke(main, ["summary", str(d)])
    assert res.exit_code == OK, res.output
    line = next(x for x in res.output.splitlines() if "GPU busy" in x)
    assert "summed over 2 ranks" in line and "the longest of 2 ranks" in line
    pct = float(re.search(r"average ([\d.]+)% of the longest span", line).group(1))
    assert pct == round(100 * r["busy_ns"] / (r["ranks"] * r["span_ns"]), 1) == 62.5
