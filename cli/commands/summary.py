"""`decodescope summary [TRACE_OR_DB...]`: counts, GPU busy time, span, streams, categories."""
from __future__ import annotations

from typing import Any

import click

from analyzers.summary import summarize
from cli.common import emit, format_option, open_input, verbose_option, with_boundary
from tracer.errors import BadInput


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.3f} ms"


def _busy_line(r: dict[str, Any]) -> str:
    """Span and busy time in words that match their definitions.

    busy_ns is summed over ranks and span_ns is the largest single-rank span, so for several
    ranks busy / span can exceed 100%; the text divides by the rank count and says so.
    """
    n, span, busy = r["ranks"], r["span_ns"], r["busy_ns"]
    if n <= 1:
        pct = 100.0 * busy / span if span else 0.0
        return f"  span {span} ns ({_ms(span)}); GPU busy {busy} ns ({_ms(busy)}; {pct:.1f}% of span)"
    pct = 100.0 * busy / (n * span) if span else 0.0
    return (f"  span {span} ns ({_ms(span)}, the longest of {n} ranks); GPU busy {busy} ns ({_ms(busy)}, "
            f"summed over {n} ranks; per rank on average {pct:.1f}% of the longest span)")


def _text(doc: dict[str, Any]) -> str:
    out: list[str] = []
    for r in doc["runs"]:
        out.append(f"run {r['run_id']} {r['name']}: {r['ranks']} ranks, {r['kernels']} kernels, "
                   f"{r['memops']} memops, {r['api_calls']} API calls")
        out.append(_busy_line(r))
        out.append("  streams:")
        for s in r["streams"]:
            out.append(f"    rank {s['rank']} stream {s['stream']}: {s['kernels']} kernels, busy {s['busy_ns']} ns")
        out.append("  categories (busy ns): " + ", ".join(f"{c} {ns}" for c, ns in r["categories"].items()))
        out.append("  top kernels by total time:")
        for k in r["top_kernels"]:
            name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
            out.append(f"    {k['total_ns']:>14} ns  {k['count']:>6}x  {name}")
    return "\n".join(out) if out else "no runs"


@click.command("summary")
@click.argument("inputs", nargs=-1)
@click.option("--run", "run_id", type=int, default=None, help="Only this run id.")
@click.option("--top", type=click.IntRange(min=0), default=10, show_default=True, help="How many top kernels to list.")
@format_option("text", "json")
@verbose_option
@with_boundary
def command(inputs: tuple[str, ...], run_id: int | None, top: int, fmt: str, verbose: bool) -> None:
    """Summarise runs: kernels, memops, API calls, span, GPU busy time, streams, categories.

    TRACE_OR_DB: nothing (the bundled traces), a store (`runs.duckdb` or `runs.duckdb:3`), or
    trace files / per-rank folders (ingested in memory). GPU busy is the union of kernel and
    memop intervals on each rank, summed over ranks; span is first start to last end on each
    rank, the largest over ranks.

    \b
    Example:
      decodescope summary runs.duckdb --run 2 --format json
    """
    con, ids = open_input(inputs)
    if run_id is not None:
        if run_id not in ids:
            raise BadInput(inputs[0] if inputs else "traces/", f"no run {run_id} (runs: {ids})")
        ids = [run_id]
    emit(summarize(con, ids, top=top), fmt, _text)
