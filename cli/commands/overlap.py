"""`decodescope overlap [TRACE_OR_DB...]`: communication hidden under compute, per rank/step/layer."""
from __future__ import annotations

from typing import Any

import click

from analyzers.overlap import overlap
from cli.common import emit, format_option, verbose_option, with_boundary
from cli.per_run import per_run, run_option, run_text, step_label


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}%"


def _lines(r: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for k in r["ranks"]:
        out.append(f"  rank {k['rank']}: comm {k['comm_ns']} ns, overlapped {k['overlap_ns']} ns "
                   f"({_pct(k['overlap_pct'])}), exposed {k['exposed_comm_ns']} ns")
    for s in r["steps"]:
        out.append(f"    r{s['rank']} {step_label(s)}: comm {s['comm_ns']} exposed {s['exposed_comm_ns']}"
                   f" ({_pct(s['overlap_pct'])} hidden)")
    for la in r["layers"]:
        out.append(f"    r{la['rank']} layer {la['layer']}: comm {la['comm_ns']} exposed {la['exposed_comm_ns']}"
                   f" ({_pct(la['overlap_pct'])} hidden, {la['steps']} steps)")
    return out


def _text(doc: dict[str, Any]) -> str:
    return run_text(doc, _lines)


@click.command("overlap")
@click.argument("inputs", nargs=-1, metavar="[TRACE_OR_DB]...")
@run_option
@format_option("text", "json")
@verbose_option
@with_boundary
def command(inputs: tuple[str, ...], run_id: int | None, fmt: str, verbose: bool) -> None:
    """Compute-communication overlap: |comm ∩ compute| / |comm| and exposed communication
    |comm \\ compute|, per rank (as HTA), per step and per layer (summed over steps).
    Communication is the classifier's category, not a name regex.

    TRACE_OR_DB: nothing (the bundled traces), a store (`runs.duckdb` or `runs.duckdb:3`), or
    trace files / per-rank folders. With several runs and no --run, JSON is {"runs": [...]}.

    \b
    Example:
      decodescope overlap rank_dir/ --format json        # one run, a trace per rank
    """
    emit(per_run(inputs, run_id, overlap), fmt, _text)
