"""`decodescope layers [TRACE_OR_DB...]`: per layer and op, medians over steps of kernels,
span, busy and bubble ns (kernels attributed by analyzers.attribution)."""
from __future__ import annotations

from typing import Any

import click
import duckdb

from analyzers.attribution import attribute
from analyzers.layers import layer_breakdown
from cli.common import emit, format_option, open_input, verbose_option, with_boundary
from cli.per_run import each_run, extra_run, one_or_many, pick_runs, run_option


def pattern_options(fn: Any) -> Any:
    """--layer-pattern / --step-pattern / --graph-reference, shared with `compare`."""
    fn = click.option("--graph-reference", "graph_reference", default=None, metavar="TRACE",
                      help="Eager trace (or run id in the store) of the same workload, to attribute "
                           "CUDA-graph replays that have no capture map (and to give capture streams "
                           "to a map that has none).")(fn)
    fn = click.option("--step-pattern", default=None, metavar="RE",
                      help="Regex naming step ranges (default: `step`, else ProfilerStep#N).")(fn)
    fn = click.option("--layer-pattern", default=None, metavar="RE",
                      help="Regex with a named group `layer` (optional `kind`, `idx`); default: "
                           "L{idx}.{kind} and model.layers.{idx}.")(fn)
    return fn


def resolve_reference(con: duckdb.DuckDBPyConnection, ref: str | None) -> int | None:
    """--graph-reference: a run id in the store, or a trace ingested into the in-memory store."""
    return extra_run(con, ref, "--graph-reference")


def attribution_kwargs(layer_pattern: str | None, step_pattern: str | None,
                       reference: int | None) -> dict[str, Any]:
    return {"layer_pattern": layer_pattern, "step_pattern": step_pattern,
            "graph_reference": reference}


def _text(doc: dict[str, Any]) -> str:
    out: list[str] = []
    if not each_run(doc):
        return "no runs"
    for d in each_run(doc):
        out.append(f"run {d['run']}: {d['steps']} steps; medians over steps (lower median), ns")
        if not d["layers"]:
            out.append(f"  not applicable: {d.get('not_applicable', 'no layers')}")
            continue
        out.append(f"  {'layer / op':<28} {'kind':<8} {'kernels':>7} {'span_ns':>12} "
                   f"{'busy_ns':>12} {'bubble_ns':>12}")
        for layer in d["layers"]:
            out.append(f"  {layer['layer'][:28]:<28} {str(layer['kind'] or '-'):<8} "
                       f"{layer['kernels']:>7} {layer['span_ns']:>12} {layer['busy_ns']:>12} "
                       f"{layer['bubble_ns']:>12}")
            for op in layer["ops"]:
                out.append(f"    {op['op'][:26]:<26} {'':<8} {op['kernels']:>7} {'':>12} "
                           f"{op['busy_ns']:>12}")
    return "\n".join(out)


def warn_mismatches(report: Any) -> None:
    """Verification failures go to stderr, never silently."""
    for r in report.runs.values():
        if r.mismatches:
            n_cap = r.capture_map.get("replays_mismatched", 0)
            n_ref = r.reference.get("kernels_unmatched", 0)
            click.echo(f"warning: run {r.run_id}: {n_cap} graph replays differ from the capture map, "
                       f"{n_ref} replayed kernels not found in the reference; left without layer "
                       f"(first: {r.mismatches[0]})", err=True)


def note_missing_capture_streams(report: Any) -> None:
    """Graph kernels without a capture stream: their op's busy time may include a PDL wait the
    replay moved across streams (analyzers/sql/kernels/exposed.sql). Said once per run, on stderr."""
    for r in report.runs.values():
        n = r.graph_kernels_without_capture_stream
        if n:
            click.echo(f"note: run {r.run_id}: {n} graph-replayed kernels have no capture stream (a capture "
                       f"map written before capture streams were recorded); where the replay moved a PDL "
                       f"chain across streams, the wait stays in that op's busy_ns (--graph-reference "
                       f"EAGER_TRACE gives them the eager run's streams)", err=True)


@click.command("layers")
@click.argument("inputs", nargs=-1, metavar="[TRACE_OR_DB]...")
@run_option
@pattern_options
@format_option("text", "json")
@verbose_option
@with_boundary
def command(inputs: tuple[str, ...], run_id: int | None, layer_pattern: str | None,
            step_pattern: str | None, graph_reference: str | None, fmt: str, verbose: bool) -> None:
    """Per layer and op: kernels, span, busy and bubble ns, medians over steps.

    A kernel belongs to the innermost annotation range around the call that launched it
    (same thread, through the correlation id); CUDA-graph replays take their layers from the
    capture map, or from --graph-reference. Span: first kernel start to last kernel end;
    busy: union of the kernel intervals; bubble: span - busy. With several runs and no --run,
    JSON is {"runs": [...]}.

    \b
    Examples:
      decodescope layers traces/k3_stock_b1_k0_eager.json.gz --format json
      decodescope layers vllm_graph.json.gz --graph-reference vllm_eager.json.gz
      decodescope layers runs.duckdb:2 --layer-pattern 'blocks\\.(?P<layer>\\d+)'
    """
    con, ids = open_input(inputs, progress=False)
    ref = resolve_reference(con, graph_reference)
    ids = [i for i in pick_runs(inputs, ids, run_id) if i != ref]
    kw = attribution_kwargs(layer_pattern, step_pattern, ref)
    report = attribute(con, ids, **kw)
    warn_mismatches(report)
    note_missing_capture_streams(report)
    docs = [layer_breakdown(con, i, attributed=True, **kw) for i in ids]
    emit(one_or_many(docs), fmt, _text)
