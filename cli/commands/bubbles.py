"""`decodescope bubbles [TRACE_OR_DB...]`: device-idle bubbles per step and layer, by cause."""
from __future__ import annotations

from typing import Any

import click

from analyzers.bubbles import CAUSES, bubbles
from cli.common import emit, format_option, verbose_option, with_boundary
from cli.per_run import per_run, run_option, run_text, step_label


def _causes(by_cause: dict[str, int]) -> str:
    return ", ".join(f"{c} {by_cause[c]}" for c in CAUSES if by_cause.get(c))


def _lines(r: dict[str, Any]) -> list[str]:
    out: list[str] = []
    if r.get("note"):
        out.append(f"  note: {r['note']}")
    out.append("  per step (ns): rank step  span  busy  bubble  [by cause]")
    for s in r["steps"]:
        out.append(f"    r{s['rank']} {step_label(s)}: span {s['span_ns']} busy {s['busy_ns']} bubble {s['bubble_ns']}"
                   f" ({s['bubbles']} bubbles) [{_causes(s['by_cause'])}]")
    out.append(f"  per layer (bubbles >= {r['min_ns']} ns):")
    for la in r["layers"]:
        out.append(f"    {la['layer']}: {la['bubble_ns']} ns in {la['bubbles']} [{_causes(la['by_cause'])}]")
    out.append("  longest bubbles:")
    for b in r["top"]:
        out.append(f"    {b['gap_ns']:>12} ns  {b['cause']:<14} r{b['rank']} {step_label(b)} layer={b['layer'] or '-'}"
                   f" op={b['op'] or '-'}  {b['prev_name'][:40]} -> {b['next_name'][:40]}")
    out.append("  stream gaps (per-stream idle as HTA counts it; NOT bubbles):")
    for g in r["stream_gaps"]:
        out.append(f"    r{g['rank']} stream {g['stream']}: {g['gaps']} gaps, {g['gap_ns']} ns, max {g['max_gap_ns']} ns")
    return out


def _text(doc: dict[str, Any]) -> str:
    return run_text(doc, _lines)


@click.command("bubbles")
@click.argument("inputs", nargs=-1, metavar="[TRACE_OR_DB]...")
@run_option
@click.option("--step-pattern", default=None, help="Regex naming step ranges (default: `step`, else ProfilerStep#N).")
@click.option("--min-ns", type=click.IntRange(min=0), default=0, show_default=True,
              help="Leave shorter bubbles out of the layer totals and the ranked list.")
@click.option("--top", type=click.IntRange(min=0), default=20, show_default=True, help="How many bubbles to rank.")
@format_option("text", "json")
@verbose_option
@with_boundary
def command(inputs: tuple[str, ...], run_id: int | None, step_pattern: str | None, min_ns: int, top: int,
            fmt: str, verbose: bool) -> None:
    """Bubbles: intervals inside a step when the device runs nothing on any stream, per step and
    layer by cause (launch_bound, graph_boundary, host_sync, event_wait, in_graph, other), and the longest.

    TRACE_OR_DB: nothing (the bundled traces), a store (`runs.duckdb` or `runs.duckdb:3`), or
    trace files / per-rank folders. Per-stream gaps (HTA's idle time) are listed apart as
    stream_gaps. With several runs and no --run, JSON is {"runs": [...]}.

    \b
    Example:
      decodescope bubbles runs.duckdb --run 2 --min-ns 1000 --top 10 --format json
    """
    emit(per_run(inputs, run_id, lambda con, i: bubbles(con, i, step_pattern=step_pattern, min_ns=min_ns, top=top)),
         fmt, _text)
