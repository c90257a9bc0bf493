"""`decodescope compare [STOCK FUSED]`: per layer kind, µs and kernels per layer of two runs
and their ratio (the seed's stock-vs-fused table)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from analyzers.layers import compare
from cli.commands.layers import attribution_kwargs, pattern_options, resolve_reference
from cli.common import BUNDLED_TRACES, emit, format_option, is_database, open_input, verbose_option, with_boundary
from tracer.errors import BadInput

DEFAULT_PAIR = ("k3_stock_b1_k0_graph.json.gz", "k3_fused_b1_k0_graph.json.gz")


def _cell(side: dict[str, Any] | None) -> tuple[str, str, str]:
    if side is None:
        return "-", "", "-"
    return f"{side['us']:.3f}", f"({side['span_ns']} ns)", f"{side['kernels']:.1f}"


def _text(doc: dict[str, Any]) -> str:
    b, c = doc["base"]["run"], doc["cand"]["run"]
    out = [f"base {b} ({doc['base']['steps']} steps) vs cand {c} ({doc['cand']['steps']} steps); "
           "µs per layer = mean over the layers of a kind of the median span over steps",
           f"{'kind':<8} {'base µs/layer':>14} {'':<16} {'kernels':>8} {'cand µs/layer':>14} "
           f"{'':<16} {'kernels':>8} {'time ratio':>10} {'kernel ratio':>12}"]
    if not doc["kinds"]:
        out.append("not applicable: no kernel of either run is attributed to a layer "
                   "(see --layer-pattern, --graph-reference)")
    for k in doc["kinds"]:
        bu, bn, bk = _cell(k["base"])
        cu, cn, ck = _cell(k["cand"])
        rt = f"{k['ratio_time']:.3f}" if k["ratio_time"] is not None else "-"
        rk = f"{k['ratio_kernels']:.3f}" if k["ratio_kernels"] is not None else "-"
        out.append(f"{k['kind']:<8} {bu:>14} {bn:<16} {bk:>8} {cu:>14} {cn:<16} {ck:>8} "
                   f"{rt:>10} {rk:>12}")
    return "\n".join(out)


def _open_pair(base: str | None, cand: str | None) -> tuple[Any, int, int]:
    """Two trace files (ingested in memory), or two runs `DB:RUN` of one store."""
    if base is None and cand is None:
        paths = [BUNDLED_TRACES / n for n in DEFAULT_PAIR]
        missing = [p for p in paths if not p.exists()]
        if missing:
            raise BadInput(missing[0], "not bundled (yet): pass STOCK FUSED, two traces or "
                                       "runs.duckdb:1 runs.duckdb:2")
        base, cand = str(paths[0]), str(paths[1])
    if base is None or cand is None:
        raise BadInput(base or cand or "", "compare needs two runs: STOCK FUSED")
    db_a, _, run_a = base.rpartition(":")
    db_b, _, run_b = cand.rpartition(":")
    if run_a.isdigit() and run_b.isdigit() and db_a == db_b and Path(db_a).exists():
        con, ids = open_input([db_a], progress=False)
        for r in (int(run_a), int(run_b)):
            if r not in ids:
                raise BadInput(db_a, f"no run {r} (runs: {ids})")
        return con, int(run_a), int(run_b)
    for spec, db in ((base, db_a), (cand, db_b)):
        if Path(db).is_file() and is_database(Path(db)):
            raise BadInput(spec, "compare takes two runs of one store (STORE:1 STORE:2) or two trace "
                                 "files, not a store and something else")
    con, ids = open_input([base, cand], progress=False)
    if len(ids) != 2:
        raise BadInput(base, f"expected one run per argument, got runs {ids}")
    return con, ids[0], ids[1]


@click.command("compare")
@click.argument("base", required=False, metavar="[STOCK]")
@click.argument("cand", required=False, metavar="[FUSED]")
@pattern_options
@format_option("text", "json")
@verbose_option
@with_boundary
def command(base: str | None, cand: str | None, layer_pattern: str | None,
            step_pattern: str | None, graph_reference: str | None, fmt: str, verbose: bool) -> None:
    """Per layer kind: µs and kernels per layer of STOCK and FUSED, and FUSED/STOCK.

    µs per layer: the median over steps of each layer's span (first kernel start to last
    kernel end), averaged over the layers of that kind (ns shown too). With no argument:
    traces/k3_stock_b1_k0_graph.json.gz and traces/k3_fused_b1_k0_graph.json.gz (exit 2 while
    the fused trace is not bundled). STOCK and FUSED may be any two runs (trace files, or
    STORE:RUN of one store).

    \b
    Examples:
      decodescope compare
      decodescope compare stock.json.gz fused.json.gz --format json
      decodescope compare runs.duckdb:1 runs.duckdb:2
      decodescope compare traces/k3_stock_b8_k0_graph.json.gz traces/k3_stock_b1_k0_graph.json.gz
    """
    con, b, c = _open_pair(base, cand)
    ref = resolve_reference(con, graph_reference)
    emit(compare(con, b, c, **attribution_kwargs(layer_pattern, step_pattern, ref)), fmt, _text)
