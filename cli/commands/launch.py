"""`decodescope launch [TRACE_OR_DB...]`: launch-to-start delays and kernels shorter than their launch."""
from __future__ import annotations

from typing import Any

import click

from analyzers.launch import launch_stats
from cli.common import emit, format_option, verbose_option, with_boundary
from cli.per_run import per_run, run_option, run_text


def _line(d: dict[str, Any]) -> str:
    return (f"{d['items']} items, delay p50 {d['p50_delay_ns']} p90 {d['p90_delay_ns']} p99 {d['p99_delay_ns']}"
            f" max {d['max_delay_ns']} ns, {d['shorter_than_launch']} shorter than their launch call")


def _lines(r: dict[str, Any]) -> list[str]:
    out = [f"  rank {k['rank']} {k['launch']}: {_line(k)}" for k in r["ranks"]]
    out.append("  per layer:")
    out.extend(f"    r{la['rank']} {la['layer'] or '(none)'} {la['launch']}: {_line(la)}" for la in r["layers"])
    out.append("  most often shorter than their launch call:")
    out.extend(f"    {s['items']:>6}x  {s['name'][:70]}  (median {s['median_dur_ns']} ns vs launch "
               f"{s['median_launch_dur_ns']} ns)" for s in r["shorter_than_launch"])
    return out


def _text(doc: dict[str, Any]) -> str:
    return run_text(doc, _lines)


@click.command("launch")
@click.argument("inputs", nargs=-1, metavar="[TRACE_OR_DB]...")
@run_option
@click.option("--top", type=click.IntRange(min=0), default=10, show_default=True,
              help="How many kernel names shorter than their launch to list.")
@format_option("text", "json")
@verbose_option
@with_boundary
def command(inputs: tuple[str, ...], run_id: int | None, top: int, fmt: str, verbose: bool) -> None:
    """Launch stats: launch-to-start delay (kernel start - launch call start; p50/p90/p99/max,
    nearest-rank) per rank and launch kind (direct or graph replay) and per layer, and the
    kernels that ran shorter than their launch call took.

    TRACE_OR_DB: nothing (the bundled traces), a store (`runs.duckdb` or `runs.duckdb:3`), or
    trace files / per-rank folders. With several runs and no --run, JSON is {"runs": [...]}.

    \b
    Example:
      decodescope launch runs.duckdb:2 --format json
    """
    emit(per_run(inputs, run_id, lambda con, i: launch_stats(con, i, top=top)), fmt, _text)
