"""`decodescope temporal [TRACE_OR_DB...]`: idle / compute / non-compute per rank, as HTA."""
from __future__ import annotations

from typing import Any

import click

from analyzers.temporal import temporal_breakdown
from cli.common import emit, format_option, verbose_option, with_boundary
from cli.per_run import per_run, run_option, run_text


def _lines(r: dict[str, Any]) -> list[str]:
    return [f"  rank {k['rank']}: span {k['span_ns']} ns: idle {k['idle_pct']:.2f}%, compute "
            f"{k['compute_pct']:.2f}%, non-compute {k['non_compute_pct']:.2f}%" for k in r["ranks"]]


def _text(doc: dict[str, Any]) -> str:
    return run_text(doc, _lines)


@click.command("temporal")
@click.argument("inputs", nargs=-1, metavar="[TRACE_OR_DB]...")
@run_option
@format_option("text", "json")
@verbose_option
@with_boundary
def command(inputs: tuple[str, ...], run_id: int | None, fmt: str, verbose: bool) -> None:
    """Temporal breakdown in HTA's sense, per rank: over the GPU span, idle (no kernel or memop
    on any stream), compute (union of compute kernels) and non-compute time. Differences from
    HTA are listed in bench/hta_compare.md.

    TRACE_OR_DB: nothing (the bundled traces), a store (`runs.duckdb` or `runs.duckdb:3`), or
    trace files / per-rank folders. With several runs and no --run, JSON is {"runs": [...]}.

    \b
    Example:
      decodescope temporal trace_dir/ --format json
    """
    emit(per_run(inputs, run_id, temporal_breakdown), fmt, _text)
