"""bench/large_m_experts.py's table from a result file (the GPU part runs on the device)."""
from __future__ import annotations

import json

import pytest

from bench import large_m_experts as lme


def result() -> dict:
    row = {"rows": 64, "pairs": 1024, "distinct_experts": 600, "bytes_padded": 600 * 5_505_024,
           "bytes_unpadded": 600 * 4_128_768, "bit_equal": True, "stock_us": 800.0, "fused_us": 600.0,
           "padded_fast_sort_us": 720.0, "sort_stable_us": 90.0, "sort_atomic_us": 4.0}
    return {"rows": [row], "meta": {"gpu": "NVIDIA H200", "torch": "2.11", "commit": "abc", "date": "d", "reps": 20}}


def test_render_computes_rates_from_bytes_and_times() -> None:
    """TB/s = bytes / µs / 1e6: 600 x 5.505 MB in 800 µs = 4.13; 600 x 4.129 MB in 600 µs = 4.13."""
    md = lme.render(result())
    row = [line for line in md.splitlines() if line.startswith("| 64 |")][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["64", "1024", "600", "800.0", "4.13", "600.0", "4.13", "720.0", "90.0", "4.0", "True"]
    assert lme.IP * 3 * lme.L * 2 == 5_505_024 and lme.I * 3 * lme.L * 2 == 4_128_768


def test_render_cli_names_a_bad_file(tmp_path, capsys) -> None:
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"rows": [{}]}))
    with pytest.raises(SystemExit, match=r"x\.json: not a large_m_experts\.json"):
        lme.main(["--render", str(bad)])
    good = tmp_path / "r.json"
    good.write_text(json.dumps(result()))
    lme.main(["--render", str(good)])
    assert "| 64 | 1024 |" in capsys.readouterr().out
