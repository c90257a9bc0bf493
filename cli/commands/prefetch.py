"""`decodescope prefetch [TRACE_OR_DB...] [--baseline TRACE]`: is each prefetch hidden and early?"""
from __future__ import annotations

from typing import Any

import click

from analyzers.prefetch import prefetch
from cli.commands.bubbles import each_run, per_run
from cli.common import emit, format_option, verbose_option, with_boundary
from tracer.errors import BadInput


def _text(doc: dict[str, Any]) -> str:
    out: list[str] = []
    for r in each_run(doc):
        out.append(f"run {r['run_id']}")
        if "not_applicable" in r:
            out.append(f"  not applicable: {r['not_applicable']}")
            continue
        s = r["summary"]
        out.append(f"  {s['count']} prefetches, {s['hidden_pct']:.1f}% of their time hidden, {s['late']} late, "
                   f"median lead {s['median_lead_ns']} ns")
        for p in r["prefetches"]:
            change = p.get("consumer_dur_change_ns")
            out.append(f"    r{p['rank']} {p['layer']} {p['name'][:40]}: {p['dur_ns']} ns, hidden {p['hidden_pct']:.1f}%,"
                       f" lead {p['lead_ns']} ns{' LATE' if p['late'] else ''}, consumer {p['consumer_name']}"
                       + ("" if change is None else f" ({change:+d} ns vs baseline)"))
    return "\n".join(out)


@click.command("prefetch")
@click.argument("inputs", nargs=-1)
@click.option("--run", "run_id", type=int, default=None, help="Only this run id.")
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

    \b
    Example:
      decodescope prefetch fused_prefetch.json.gz --baseline fused.json.gz --format json
    """
    def analyse(con: Any, i: int) -> dict[str, Any]:
        base = None
        if baseline is not None and baseline.isdigit():
            base = int(baseline)  # a run id of the same store
        elif baseline is not None:
            from tracer.ingest import ingest_path

            read_only = con.execute("SELECT readonly FROM duckdb_databases() WHERE database_name = current_database()"
                                    ).fetchall()[0][0]
            if read_only:
                raise BadInput(baseline, "a store is opened read-only: give --baseline as a run id of that store,"
                                         " or pass the run and the baseline both as trace files")
            runs = ingest_path(con, baseline, progress=False)
            if len(runs) != 1:
                raise BadInput(baseline, "--baseline must be one run")
            base = runs[0].run_id
        return prefetch(con, i, baseline=base)

    emit(per_run(inputs, run_id, analyse), fmt, _text)
