"""`decodescope overlap [TRACE_OR_DB...]`: communication hidden under compute, per rank/step/layer."""
from __future__ import annotations

from typing import Any

import click

from analyzers.overlap import overlap
from cli.commands.bubbles import each_run, per_run
from cli.common import emit, format_option, verbose_option, with_boundary


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}%"


def _text(doc: dict[str, Any]) -> str:
    out: list[str] = []
    for r in each_run(doc):
        out.append(f"run {r['run_id']}")
        if "not_applicable" in r:
            out.append(f"  not applicable: {r['not_applicable']}")
            continue
        for k in r["ranks"]:
            out.append(f"  rank {k['rank']}: comm {k['comm_ns']} ns, overlapped {k['overlap_ns']} ns "
                       f"({_pct(k['overlap_pct'])}), exposed {k['exposed_comm_ns']} ns")
        for s in r["steps"]:
            out.append(f"    r{s['rank']} {s['step']}: comm {s['comm_ns']} exposed {s['exposed_comm_ns']} ({_pct(s['overlap_pct'])} hidden)")
        for la in r["layers"]:
            out.append(f"    r{la['rank']} layer {la['layer']}: comm {la['comm_ns']} exposed {la['exposed_comm_ns']}"
                       f" ({_pct(la['overlap_pct'])} hidden, {la['steps']} steps)")
    return "\n".join(out)


@click.command("overlap")
@click.argument("inputs", nargs=-1)
@click.option("--run", "run_id", type=int, default=None, help="Only this run id.")
@format_option("text", "json")
@verbose_option
@with_boundary
def command(inputs: tuple[str, ...], run_id: int | None, fmt: str, verbose: bool) -> None:
    """Compute-communication overlap: |comm ∩ compute| / |comm| and exposed communication
    |comm \\ compute|, per rank (as HTA), per step and per layer (summed over steps).
    Communication is the classifier's category, not a name regex.

    \b
    Example:
      decodescope overlap traces/ --format json
    """
    emit(per_run(inputs, run_id, overlap), fmt, _text)
