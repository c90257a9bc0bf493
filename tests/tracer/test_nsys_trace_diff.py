"""`trace-diff` on the nsys-ai before/after pair: a kernel-level report, checked against sqlite3.

These exports have no layer ranges of our convention and no step markers, so trace-diff
falls back to kernel names with the whole window as one step. Its documented values for that
mode (analyzers.diff): per kernel name, the summed kernel time and the kernel count on each
rank, then the max over ranks (the slowest rank gates); "all kernels" sums those per-name
values. The oracle recomputes them from CUPTI_ACTIVITY_KIND_KERNEL with plain sqlite3 (one
rank per device in these files), and the gate from them: a single step gives a point
estimate, so a row regresses when its change is above +5 % and above +1000 ns.
"""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

import cli.trace_diff as td
from cli.exit_codes import OK, REGRESSION

BEFORE, AFTER = "nsys-ai/mfu_2gpu_before.sqlite", "nsys-ai/mfu_2gpu_after.sqlite"


def per_name(path: Path) -> dict[str, tuple[int, int]]:
    """kernel name -> (max over devices of summed ns, max over devices of count)."""
    db = sqlite3.connect(f"{path.as_uri()}?mode=ro&immutable=1", uri=True)
    rows = db.execute("""
        SELECT d.value, k.deviceId, sum(k.end - k.start), count(*)
        FROM CUPTI_ACTIVITY_KIND_KERNEL AS k JOIN StringIds AS d ON d.id = k.demangledName
        GROUP BY 1, 2""").fetchall()
    out: dict[str, tuple[int, int]] = {}
    for name, _, ns, n in rows:
        t, c = out.get(name, (0, 0))
        out[name] = (max(t, ns), max(c, n))
    return out


def test_trace_diff_on_the_nsys_pair(corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        td.main([str(corpus / BEFORE), str(corpus / AFTER), "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    base, cand = per_name(corpus / BEFORE), per_name(corpus / AFTER)
    assert report["mode"] == "kernel-name fallback"
    kernel_rows = {r["kernel"]: r for r in report["rows"] if r["layer_kind"] == "kernel"}
    assert set(kernel_rows) == set(base) | set(cand)
    for name in set(base) & set(cand):
        row = kernel_rows[name]
        assert (row["base_busy_ns"], row["cand_busy_ns"]) == (base[name][0], cand[name][0]), name
        assert (row["base_kernels"], row["cand_kernels"]) == (base[name][1], cand[name][1]), name
    (total,) = [r for r in report["rows"] if r["layer_kind"] == "all kernels"]
    assert total["base_busy_ns"] == sum(t for t, _ in base.values())
    assert total["cand_busy_ns"] == sum(t for t, _ in cand.values())
    # the gate, recomputed: single step, so the point estimate decides
    want_regressions = {n for n in set(base) & set(cand)
                        if cand[n][0] - base[n][0] > 1000 and (cand[n][0] - base[n][0]) / base[n][0] > 0.05}
    got_regressions = {r.get("kernel") or r["layer"] for r in report["regressions"]}
    assert got_regressions == want_regressions
    assert any("nccl" in n.lower() for n in want_regressions)    # NCCL SendRecv got slower: 17.17 -> 23.75 ms
    assert exc.value.code == (REGRESSION if want_regressions else OK)
