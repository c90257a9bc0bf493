"""`decodescope prefetch [TRACE_OR_DB...] [--baseline TRACE]`: is each prefetch hidden and early?"""
from __future__ import annotations

from typing import Any

import click

from analyzers.prefetch import prefetch
from cli.common import emit, format_option, open_input, verbose_option, with_boundary
from cli.per_run import extra_run, one_or_many, pick_runs, run_option, run_text


def _lines(r: dict[str, Any]) -> list[str]:
    s = r["summary"]
    out = [f"  {s['count']} prefetches, {s['hidden_pct']:.1f}% of their time hidden, {s['late']} late, "
           f"median lead {s['median_lead_ns']} ns"]
    for p in r["prefetches"]:
        change = p.get("consumer_dur_change_ns")
        out.append(f"    r{p['rank']} {p['layer']} {p['name'][:40]}: {p['dur_ns']} ns, hidden {p['hidden_pct']:.1f}%,"
                   f" lead {p['lead_ns']} ns{' LATE' if p['late'] else ''}, consumer {p['consumer_name']}"
                   + ("" if change is None else f" ({change:+d} ns vs baseline)"))
    return out


def _text(doc: dict[str, Any]) -> str:
    return run_text(doc, _lines)


@click.command("prefetch")
@click.argument("inputs", nargs=-1, metavar="[TRACE_OR_DB]...")
@run_option
@click.option("--baseline", default=None,
              help="The same workload without prefetch: a trace file or folder, or a run id of the given store.")
@format_option("text", "json")
@verbose_option
@with_boundary
def command(inputs: tuple[str, ...], run_id: int | None, baseline: str | None, fmt: str, verbose: bool) -> None:
    """Prefetch effectiveness: for each prefetch kernel or copy, the share of its time hidden
    under other work on other streams, its lead over the first consumer kernel (the first kernel
    on another stream, starting after it starts, in a later layer), whether the consumer started
    before it ended (late), and with --baseline the consumer's duration change (by layer+op).

    TRACE_OR_DB: nothing (the bundled traces), a store (`runs.duckdb` or `runs.duckdb:3`), or
    trace files / per-rank folders. With several runs and no --run, JSON is {"runs": [...]}.

    \b
    Example:
      decodescope prefetch fused_prefetch.json.gz --baseline fused.json.gz --format json
    """
    con, ids = open_input(inputs, progress=False)
    ids = pick_runs(inputs, ids, run_id)
    base = extra_run(con, baseline, "--baseline")  # ingested once, after the runs it compares
    emit(one_or_many([prefetch(con, i, baseline=base) for i in ids if i != base]), fmt, _text)
