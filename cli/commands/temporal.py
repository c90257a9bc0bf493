"""`decodescope temporal [TRACE_OR_DB...]`: idle / compute / non-compute per rank, as HTA."""
from __future__ import annotations

from typing import Any

import click

from analyzers.temporal import temporal_breakdown
from cli.commands.bubbles import each_run, per_run
from cli.common import emit, format_option, verbose_option, with_boundary


def _text(doc: dict[str, Any]) -> str:
    out: list[str] = []
    for r in each_run(doc):
        out.append(f"run {r['run_id']}")
        if "not_applicable" in r:
            out.append(f"  not applicable: {r['not_applicable']}")
            continue
        for k in r["ranks"]:
            out.append(f"  rank {k['rank']}: span {k['span_ns']} ns: idle {k['idle_pct']:.2f}%, compute "
                       f"{k['compute_pct']:.2f}%, non-compute {k['non_compute_pct']:.2f}%")
    return "\n".join(out)


@click.command("temporal")
@click.argument("inputs", nargs=-1)
@click.option("--run", "run_id", type=int, default=None, help="Only this run id.")
@format_option("text", "json")
@verbose_option
@with_boundary
def command(inputs: tuple[str, ...], run_id: int | None, fmt: str, verbose: bool) -> None:
    """Temporal breakdown in HTA's sense, per rank: over the GPU span, idle (no kernel or memop
    on any stream), compute (union of compute kernels) and non-compute time. Differences from
    HTA are listed in bench/hta_compare.md.

    \b
    Example:
      decodescope temporal trace_dir/ --format json
    """
    emit(per_run(inputs, run_id, temporal_breakdown), fmt, _text)
