"""traces/README.md holds what kimi_decode.traces_readme writes from the bundled traces, so a
re-capture that forgets to regenerate it fails here (the fused section once still described
the 421b9f0 bundle, 12 / 16 kernels per layer at B = 8, after the cd24720 re-capture)."""
from __future__ import annotations

from kimi_decode.traces_readme import FUSED_HEADING, TRACES, bundled_rows, fused_section, render


def test_fused_section_is_the_render_of_the_bundled_fused_traces() -> None:
    readme = (TRACES / "README.md").read_text()
    assert readme.count(FUSED_HEADING) == 1
    assert FUSED_HEADING + readme.split(FUSED_HEADING)[1] == fused_section(bundled_rows("fused"))


def test_stock_tables_are_the_render_of_the_bundled_stock_traces() -> None:
    """The generated head (metadata, file table, per-op table) starts the README; the
    hand-written notes (--extra) follow it."""
    readme = (TRACES / "README.md").read_text()
    assert readme.startswith(render(bundled_rows("stock"), "").rstrip() + "\n")


def test_both_variants_have_the_same_eight_shapes_and_modes() -> None:
    shapes = {v: [(r["cfg"]["batch"], r["cfg"]["spec_tokens"], r["meta"]["graph_mode"]) for r in bundled_rows(v)]
              for v in ("stock", "fused")}
    assert shapes["stock"] == shapes["fused"] and len(shapes["stock"]) == 8
