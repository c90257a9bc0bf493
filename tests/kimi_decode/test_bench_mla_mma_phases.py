"""bench/mla_mma_phases.py's rendering, on hand-made stamps with known answers (the device part,
measure(), runs on the GPU machine only)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import mla_mma_phases as mp

PHASES = ["entry", "barrier", "end"]
# Three calls of three CTAs each (absolute ns; 0 = phase not reached). Relative to each call's
# first entry, calls 1 and 2 are the same; in call 3 the last CTA ends at 20 µs.
RUNS = [
    [[1000, 3000, 5000], [1100, 3200, 9000], [1050, 0, 4000]],
    [[7000, 9000, 11000], [7100, 9200, 15000], [7050, 0, 10000]],
    [[500, 2500, 4500], [600, 2700, 20500], [550, 0, 3500]],
]


def data() -> dict:
    base = {"R": 48, "C": 4160, "groups": 3, "splits": 44, "ctas": 132, "valid_tiles": 131, "plain_us": 17.31,
            "probe_equal_plain": True, "rel_vs_f64": 1.5e-3, "counters_zero": True}
    return {"gpu": "NVIDIA H200", "torch": "2.11", "commit": "abc1234", "date": "2026-12-08 03:00 UTC",
            "phases": PHASES, "runs": 3, "copies": 12,
            "variants": [{"name": "B = 1, k = 7, uv mode (the step's build)", **base, "stamps": RUNS},
                         {"name": "B = 1, k = 7, uv mode, ungrouped (G = 1)", "skipped": "plan does not fit"}]}


def test_rows_are_the_medians_and_the_critical_cta() -> None:
    """entry: CTAs at 0 / 50 / 100 ns in every call; barrier: two CTAs reach it (2.0, 2.2 µs:
    the median of two is the upper one); end: 3 / 4 / 8 µs in calls 1-2 and 20 µs in call 3, so
    the medians are 3.0 / 4.0 / 8.0. The critical CTA (latest end) is the second in every call:
    entry 0.10, barrier 2.20, end 8.00 (median of 8, 8, 20), its step 8.00 − 2.20 = 5.80."""
    md = mp.render(data())
    assert "| entry | 0.00 | 0.05 | 0.10 | 0.10 | - |" in md
    assert "| barrier | 2.00 | 2.20 | 2.20 | 2.20 | 2.10 |" in md
    assert "| end | 3.00 | 4.00 | 8.00 | 8.00 | 5.80 |" in md
    assert ("R = 48 rows, 3 row group(s) × 44 splits (132 CTAs), 131 valid tiles of 32 positions (C = 4160); "
            "plain 17.3 µs; probe output equal to plain: True; rel vs float64 1.50e-03; counters zero: True") in md
    assert "## B = 1, k = 7, uv mode, ungrouped (G = 1): skipped (plan does not fit)" in md
    assert "commit abc1234, 2026-12-08 03:00 UTC" in md


def test_the_variants_cover_the_steps_builds() -> None:
    """The step's three attention builds (B = 1 at k = 0 and 7, B = 8) and, at k = 7, the build
    without the uv tiles and the ungrouped one."""
    got = {(v["B"], v["k"], v["uv"], v["groups"]) for v in mp.variants()}
    assert got == {(1, 0, True, None), (1, 7, True, None), (1, 7, False, None), (1, 7, True, 1), (8, 0, True, None)}


def test_cli_renders_a_file_and_refuses_no_mode(tmp_path: Path) -> None:
    f = tmp_path / "mla_mma_phases.json"
    f.write_text(json.dumps(data()))
    root = Path(__file__).resolve().parents[2]
    ok = subprocess.run([sys.executable, "-m", "bench.mla_mma_phases", "--render", str(f)], cwd=root,
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "| end | 3.00 | 4.00 | 8.00 | 8.00 | 5.80 |" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "bench.mla_mma_phases"], cwd=root, capture_output=True, text=True)
    assert bad.returncode == 2 and "give --out DIR" in bad.stderr and "Traceback" not in bad.stderr


def test_measure_runs_every_variant_on_emulated_kernels(monkeypatch) -> None:
    """The device harness on the CPU, the kernel replaced by mla_attend's float64 contract (and
    uv_gate's), its probe rows filled with stamps that grow by phase: every variant runs, one
    stamp row per CTA of its launch (3 × 44 at R = 48 in groups, 132 ungrouped), the probe and
    plain outputs agree, the error against the float64 chain is bf16-sized, and the JSON renders."""
    import torch

    from kimi_decode.kernels import mla_attend_mma as km
    from tests.kimi_decode.test_kernel_mla_attend import _emulate_attend, _emulate_uv_gate

    def fill(probe: torch.Tensor | None) -> None:
        if probe is not None:
            cta = torch.arange(probe.shape[0], dtype=torch.int64)[:, None]
            probe.copy_(10_000 + 7 * cta + 1000 * torch.arange(probe.shape[1], dtype=torch.int64)[None, :])

    def attend(q, cache, last, h, c, scale, scratch=None, probe=None):
        fill(probe)
        return _emulate_attend(q, cache, last, h, c, scale)

    def attend_uv(q, cache, last, h, c, scale, w_uv, g, scratch, probe=None):
        fill(probe)
        o_lat = _emulate_attend(q, cache, last, h, c, scale)
        return _emulate_uv_gate(o_lat, w_uv, g), o_lat
    monkeypatch.setattr(km, "mla_attend_mma", attend)
    monkeypatch.setattr(km, "mla_attend_mma_uv", attend_uv)
    monkeypatch.setattr(mp, "COPIES", 2)
    timed: list[int] = []
    data = mp.measure(2, device="cpu", timer=lambda fn: (fn(), timed.append(1), 9.5)[2])
    rows = {v["name"]: v for v in data["variants"]}
    assert len(rows) == 5 and not any(v.get("skipped") for v in rows.values()) and len(timed) == 5
    grouped, ungrouped = rows["B = 1, k = 7, uv mode (the step's build)"], rows["B = 1, k = 7, uv mode, ungrouped (G = 1)"]
    assert (grouped["groups"], grouped["splits"], grouped["ctas"]) == (3, 44, 132)
    assert (ungrouped["groups"], ungrouped["ctas"]) == (1, 132)
    assert rows["B = 8, k = 0, uv mode"]["ctas"] == 8 * 16
    for v in rows.values():
        assert len(v["stamps"]) == 2 and len(v["stamps"][0]) == v["ctas"]
        assert len(v["stamps"][0][0]) == len(km.PROBE_PHASES)
        assert v["probe_equal_plain"] and v["counters_zero"] and v["rel_vs_f64"] < 1e-2
    md = mp.render(data)
    # CTA i stamps phase j at 10 µs + 7i ns + 1 µs·j: at 132 CTAs the median CTA (66) is 0.46 µs
    # and the last (131, the critical one) 0.92 µs after the first; "end" is phase 11
    assert "| end | 11.00 | 11.46 | 11.92 | 11.92 | 1.00 |" in md
    assert "| end | 11.00 | 11.45 | 11.89 | 11.89 | 1.00 |" in md       # B = 8: 128 CTAs
