"""bench/stream_bw.py's table on the CPU (the measurement itself needs the GPU): every cold row
and the sweep are rendered with their figures, and the module imports without Triton."""
from __future__ import annotations

from bench import stream_bw


def test_render_lists_every_row() -> None:
    res = {"date": "2026-12-03 00:00 UTC", "commit": "0123456789abcdef", "gpu": "H200", "sms": 132,
           "torch": "2.11", "copy_2gib_tbs": 4.25, "read_sum_rel_err": 1e-7,
           "read_2gib_sweep": [{"block": 1024, "warps": 4, "programs_per_sm": 4, "us": 500.0, "read_tbs": 4.3},
                               {"block": 2048, "warps": 8, "programs_per_sm": 8, "us": 480.0, "read_tbs": 4.47}],
           "cold": [{"size": "in_proj 3216x7168", "bytes": 46_104_576, "copies": 12, "read_us": 11.0,
                     "read_tbs": 4.19, "copy_us": 12.0, "copy_tbs": 3.84, "gemv_us": 13.5, "gemv_tbs": 3.42},
                    {"size": "o_proj 7168x768", "bytes": 11_010_048, "copies": 49, "read_us": 3.1,
                     "read_tbs": 3.55, "copy_us": 3.3, "copy_tbs": 3.34}]}
    res["read_2gib_best"] = res["read_2gib_sweep"][1]
    md = stream_bw.render(res)
    assert "4.25 TB/s" in md and "4.47 TB/s" in md and "block 2048, 8 warps, 8 programs per SM" in md
    assert "| in_proj 3216x7168 | 46.1 | 11.00 | 4.19 | 12.00 | 3.84 | 13.50 | 3.42 |" in md
    assert "| o_proj 7168x768 | 11.0 | 3.10 | 3.55 | 3.30 | 3.34 | - | - |" in md
    assert md.count("\n| 1024 |") + md.count("\n| 2048 |") == 2
