"""bench/fc2_layout.py's rendering, on the CPU: the committed bench/fc2_layout.md is what
`--render bench/fc2_layout_h100.json` prints (so the table cannot drift from its results), and a
hand-made run renders the figures it holds (MB, µs and TB/s as given, the equality verdicts)."""
from __future__ import annotations

import json
from pathlib import Path

from bench import fc2_layout

ROOT = Path(__file__).resolve().parents[2]


def test_committed_table_is_the_rendered_results() -> None:
    runs = json.loads((ROOT / "bench" / "fc2_layout_h100.json").read_text())
    assert (ROOT / "bench" / "fc2_layout.md").read_text() == fc2_layout.render(runs) + "\n"


def test_hand_made_run() -> None:
    run = {"date": "2026-01-01 00:00 UTC", "commit": "abcdef0123456789", "gpu": "GPU X", "sms": 4,
           "copy_2gib_tbs": 3.5,
           "pattern": [{"what": "read-only, contiguous", "bytes": 164e6, "us": 41.0, "tbs": 4.0},
                       {"what": "strided reader's sum rel err vs float64", "rel_err": 2e-10}],
           "fc2": [{"M": 8, "what": "rows padded", "us": 50.0, "mb": 164.0, "tbs": 3.28, "equal_to_first": True},
                   {"M": 8, "what": "rows broken", "us": 40.0, "mb": 164.0, "tbs": 4.1, "equal_to_first": False}],
           "per_row": [{"M": 8, "per_row": 115, "formula": True, "ctas": 920, "max_blocks_per_cta": 8,
                        "us": 60.0, "tbs": 2.73, "equal_to_formula": True}],
           "notes": ["a note"]}
    md = fc2_layout.render([run])
    assert "## 2026-01-01 00:00 UTC, commit abcdef012345, GPU X (4 SMs)" in md
    assert "- copy, 2 GiB, read + write counted: 3.50 TB/s" in md
    assert "| read-only, contiguous | 164.0 | 41.0 | 4.00 |" in md
    assert "| strided reader's sum rel err vs float64: 2.0e-10 | | | |" in md
    assert "| 8 | rows padded | 164.0 | 50.0 | 3.28 | yes |" in md
    assert "| 8 | rows broken | 164.0 | 40.0 | 4.10 | NO |" in md
    assert "| 8 | 115 | 920 | 8 | 60.0 | 2.73 | yes | yes |" in md
    assert md.rstrip().endswith("- a note")
