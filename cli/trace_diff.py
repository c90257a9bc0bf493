"""`trace-diff BASE CAND` (also `decodescope diff`): the CI gate over two decode runs.

Exit 0: no regression; 1: regression; 2: bad input or runs that cannot be compared (one line
`error: ...`). The statistics live in `analyzers.diff`; this module opens the two sides, calls
it once and renders the report as text, markdown (a pull-request comment), JSON or JUnit XML.
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import click
import duckdb

from analyzers.diff import GATES, METRICS, DiffReport, RunSample, collect, compare, is_graph_replay, is_read_only
from cli.common import fail, open_input, usage_error_line, verbose_option, with_boundary
from cli.exit_codes import BAD_INPUT, OK, REGRESSION
from tracer.errors import BadInput

MAX_MD_DETAILS = 20  # folded explanations in a markdown comment
MAX_MD_CHARS = 60_000
FALLBACK_BANNER = "kernel-name fallback: these runs do not share our layer convention; kernels are aligned by name"


# -- opening the two sides ----------------------------------------------------------------------

def _exists(spec: str) -> bool:
    if Path(spec).exists():
        return True
    db, sep, _ = spec.rpartition(":")
    return bool(sep) and Path(db).is_file()


def open_side(spec: str, role: str, graph_reference: str | None, **attribution_kwargs: Any) -> RunSample:
    """Open BASE or CAND (trace file, run folder or DB:RUN) as exactly one run and collect it."""
    if not _exists(spec):
        raise BadInput(spec, f"{role}: no such trace, folder or database")
    con, ids = open_input([spec], progress=False)
    if len(ids) != 1:
        raise BadInput(spec, f"{role}: holds {len(ids)} runs {ids}; name one as {spec}:RUN")
    kwargs = dict(attribution_kwargs)
    replay = graph_reference is not None and is_graph_replay(con, ids[0])
    if replay:
        kwargs["graph_reference"] = _reference_run(con, graph_reference, spec)
    sample = collect(con, ids[0], name=f"{Path(spec).name}", **kwargs)
    if graph_reference is not None and not replay:
        sample.notes.append("--graph-reference not used: this side does not replay a CUDA graph")
    return sample


def _reference_run(con: duckdb.DuckDBPyConnection, reference: str, spec: str) -> int:
    """The eager reference's run id next to a graph-replay side: the same store's `STORE:RUN`,
    or a trace file ingested into the side's in-memory store."""
    from tracer.ingest import ingest_path

    side_db, ref_db, ref_run = spec.rpartition(":")[0], *reference.rpartition(":")[::2]
    if side_db and ref_db and Path(ref_db).resolve() == Path(side_db).resolve():
        if not ref_run.isdigit():
            raise BadInput(reference, "--graph-reference: name a run as STORE:RUN")
        return int(ref_run)
    if not Path(reference).exists():
        raise BadInput(reference, "--graph-reference: no such trace")
    if is_read_only(con):
        raise BadInput(reference, f"--graph-reference for a store side must be a run of that store ({side_db or spec}:RUN)")
    infos = ingest_path(con, Path(reference), progress=False)
    if len(infos) != 1:
        raise BadInput(reference, f"--graph-reference must be one run, found {len(infos)}")
    return infos[0].run_id


# -- rendering ----------------------------------------------------------------------------------

def _q(x: int | None, metric: str) -> str:
    """A median in its unit: kernels as counts, times (integer ns) as µs with ns precision."""
    if x is None:
        return "-"
    return f"{x:g}" if metric == "kernels" else f"{x / 1000:,.3f} µs"


def _pct(x: float | None) -> str:
    return "-" if x is None else ("+inf%" if x == float("inf") else f"{x:+.2f}%")


def _ci(m: dict[str, Any]) -> str:
    ci = f"[{_pct(m['ci_pct'][0])}, {_pct(m['ci_pct'][1])}]"
    return ci + (" (degenerate: point estimate)" if m.get("degenerate") else "")


def _short(name: str, width: int = 100) -> str:
    """Kernel names run to kilobytes of template arguments; JSON keeps them whole."""
    return name if len(name) <= width else name[: width - 1] + "…"


def _where(r: dict[str, Any]) -> str:
    if r.get("kernel"):
        return f"kernel {_short(r['kernel'])}"
    return r["layer"] + (f" / {r['op']}" if r["op"] else "")


def _one_side(rep: DiffReport, limit: int = 10) -> list[tuple[str, dict[str, Any], int]]:
    """Keys present on one side only, largest kernel time first: (verdict, row, busy ns)."""
    rows = [(r["verdict"], r, (r["cand_busy_ns"] if r["verdict"] == "added" else r["base_busy_ns"]) or 0)
            for r in rep.rows if r["verdict"] in ("added", "removed")]
    return sorted(rows, key=lambda x: -x[2])[:limit]


def _ns(x: int | None) -> str:
    return "unavailable" if x is None else f"{x:+,d} ns"


def _explanation_lines(r: dict[str, Any], metric: str) -> list[str]:
    ex = r.get("explanation") or {}
    lines = []
    if ex.get("ops"):
        unit = "" if metric == "kernels" else " ns"
        lines.append("ops: " + ", ".join(
            f"{_where({**o, 'kernel': None})} {o['delta']:+,.0f}{unit}"
            + (f" ({o['base_kernels']:g}→{o['cand_kernels']:g} kernels)" if o["verdict"] not in ("added", "removed")
               else f" ({o['verdict']})") for o in ex["ops"][:5]))
    for k in ex.get("kernels", [])[:6]:
        bk, ck = _short(k["base_kernel"] or "", 80), _short(k["cand_kernel"] or "", 80)
        what = {"renamed": f"{bk} → {ck}", "added": f"+ {ck}", "removed": f"- {bk}", "same": bk}[k["change"]]
        change = k["change"] if k["change"] != "same" else ("slower" if k["delta_ns"] > 0 else "faster")
        lines.append(f"kernel {change} in {_where({**k, 'kernel': None})}: {what} ({k['delta_ns']:+,.0f} ns)")
    if ex and r.get("base_kernels") is not None and r.get("cand_kernels") is not None \
            and r["base_kernels"] != r["cand_kernels"]:
        lines.append(f"kernels per step {r['base_kernels']:g} → {r['cand_kernels']:g}")
    if ex:
        comm = ex.get("exposed_comm_delta_ns")
        comm_text = _ns(comm) if comm is not None or r.get("op") is None else "per layer only"
        lines.append(f"kernel time {_ns(ex.get('kernel_time_delta_ns'))}, bubbles {_ns(ex.get('bubble_delta_ns'))}, "
                     f"exposed comm {comm_text}")
    return lines


BELOW_GATE = "Slower below the --gate level (reported, not failing)"


def _header(rep: DiffReport) -> list[str]:
    s = rep.settings
    verdict = f"REGRESSION ({len(rep.regressions)})" if rep.regressions else "PASS"
    lines = [f"trace-diff: {verdict}"]
    for role, side in (("base", rep.base), ("cand", rep.cand)):
        pct = "-" if side["kernels_in_layers_pct"] is None else f"{side['kernels_in_layers_pct']}%"
        lines.append(f"{role}: {side['name']} (run {side['run_id']}, {side['steps']} steps, {side['kernels']} kernels, "
                     f"{pct} in layers)")
    lines.append(f"metric {s['metric']}, gate {s.get('gate', 'op')}, threshold {s['threshold_pct']}%, min delta {s['min_delta']:g}, "
                 f"{int(s['confidence'] * 100)}% bootstrap CI of the median over steps ({s['resamples']} resamples, seed {s['seed']})")
    lines.append(f"aligned by {rep.alignment['aligned_by']}: {rep.alignment['matched']} matched, "
                 f"{rep.alignment['base_only']} only in base, {rep.alignment['cand_only']} only in candidate")
    if rep.fallback:
        lines.append(f"{FALLBACK_BANNER} ({rep.alignment['fallback_reason']})")
    return lines


def render_text(rep: DiffReport) -> str:
    """Plain text for a terminal or a CI log."""
    m = rep.settings["metric"]
    out = _header(rep)
    for title, rows in (("Regressions", rep.regressions), (BELOW_GATE, rep.below_gate),
                        ("Improvements", rep.improvements)):
        if rows:
            out += ["", f"{title}:"]
            for r in rows:
                out.append(f"  {_where(r)}: {_q(r['median']['base'], m)} → {_q(r['median']['cand'], m)} "
                           f"{_pct(r['median']['change_pct'])} CI {_ci(r['median'])}, p90 {_pct(r['p90']['change_pct'])}")
                out += [f"      {line}" for line in (_explanation_lines(r, m) if title != "Improvements" else [])]
    if rep.kernel_count_increases:
        out += ["", "Kernel count increases:"]
        out += [f"  {_where(x)}: {x['base_kernels']:g} → {x['cand_kernels']:g}" for x in rep.kernel_count_increases]
    one_side = _one_side(rep)
    if one_side:
        out += ["", "Only on one side (largest first):"]
        out += [f"  {v}: {_where(r)} ({_q(t, 'span')} kernel time)" for v, r, t in one_side]
    if rep.notes:
        out += ["", "Notes:"] + [f"  {n}" for n in rep.notes]
    return "\n".join(out)


def render_markdown(rep: DiffReport) -> str:
    """A pull-request comment: verdict first, a table per section, explanations folded."""
    m = rep.settings["metric"]
    head = _header(rep)
    icon = "❌" if rep.regressions else "✅"
    out = [f"### {icon} {head[0]}", ""]
    if rep.fallback:
        out += [f"> **Kernel-name fallback**: {rep.alignment['fallback_reason']}; kernels are aligned by name, "
                "not by (layer kind, layer index, op).", ""]
    out += [f"- {line}" for line in head[1:] if not line.startswith(FALLBACK_BANNER)] + [""]
    table_head = ["| where | base median | cand median | change | 95% CI | p90 change |", "|---|---:|---:|---:|---|---:|"]
    for title, rows in (("Regressions", rep.regressions), (BELOW_GATE, rep.below_gate),
                        ("Improvements", rep.improvements)):
        if not rows:
            continue
        out += [f"#### {title}", ""] + table_head
        out += [f"| `{_where(r)}` | {_q(r['median']['base'], m)} | {_q(r['median']['cand'], m)} | "
                f"{_pct(r['median']['change_pct'])} | {_ci(r['median'])} | {_pct(r['p90']['change_pct'])} |" for r in rows]
        out.append("")
        if title == "Regressions":
            for r in rows[:MAX_MD_DETAILS]:
                lines = _explanation_lines(r, m)
                if lines:
                    out += [f"<details><summary>{_where(r)}: why</summary>", ""] + [f"- {x}" for x in lines] + ["", "</details>", ""]
            if len(rows) > MAX_MD_DETAILS:
                out += [f"_Explanations of {len(rows) - MAX_MD_DETAILS} more regressions: `--format json`._", ""]
    if rep.kernel_count_increases:
        out += ["#### Kernel count increases", "", "| where | base | cand |", "|---|---:|---:|"]
        out += [f"| `{_where(x)}` | {x['base_kernels']:g} | {x['cand_kernels']:g} |"
                for x in rep.kernel_count_increases] + [""]
    one_side = _one_side(rep)
    if one_side:
        out += ["#### Only on one side (largest first)", "", "| where | side | kernel time |", "|---|---|---:|"]
        out += [f"| `{_where(r)}` | {'candidate only' if v == 'added' else 'base only'} | {_q(t, 'span')} |"
                for v, r, t in one_side] + [""]
    if rep.notes:
        out += ["#### Notes", ""] + [f"- {n}" for n in rep.notes]
    body = "\n".join(out).rstrip() + "\n"
    if len(body) > MAX_MD_CHARS:  # GitHub rejects comments over 65,536 characters
        cut = body.rfind("\n", 0, MAX_MD_CHARS - 200)
        body = body[:cut] + "\n\n_Report truncated to fit a comment; `--format json` has everything._\n"
    return body


def render_json(rep: DiffReport) -> str:
    return json.dumps(rep.to_dict(), indent=2, default=str)


def render_junit(rep: DiffReport) -> str:
    """JUnit XML: one test case per aligned key, a failure per regression, so CI lists them."""
    rows = [r for r in rep.rows if r["verdict"] not in ("added", "removed")]
    suite = ET.Element("testsuite", name="trace-diff" + (" (kernel-name fallback)" if rep.fallback else ""),
                       tests=str(len(rows)), failures=str(len(rep.regressions)), errors="0", skipped="0")
    props = ET.SubElement(suite, "properties")
    for k, v in {**rep.settings, "mode": rep.mode, "base": rep.base["name"], "cand": rep.cand["name"]}.items():
        ET.SubElement(props, "property", name=str(k), value=str(v))
    m = rep.settings["metric"]
    for r in rows:
        cls = "trace-diff.kernel-name-fallback" if rep.fallback else f"trace-diff.{r['layer']}"
        case = ET.SubElement(suite, "testcase", classname=cls, name=r.get("kernel") or r["op"] or "(whole layer)", time="0")
        if r["verdict"] == "regression":
            msg = (f"{_where(r)}: {m} median {_q(r['median']['base'], m)} → {_q(r['median']['cand'], m)} "
                   f"{_pct(r['median']['change_pct'])}, CI {_ci(r['median'])}")
            fail_el = ET.SubElement(case, "failure", message=msg, type="regression")
            fail_el.text = "\n".join([msg] + _explanation_lines(r, m))
    ET.indent(suite)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"


RENDERERS = {"text": render_text, "markdown": render_markdown, "json": render_json}


# -- the command --------------------------------------------------------------------------------

@click.command("diff", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("base")
@click.argument("cand")
@click.option("--threshold", "threshold_pct", type=float, default=5.0, show_default=True,
              help="Relative change (%) the whole CI must exceed to count.")
@click.option("--metric", type=click.Choice(list(METRICS)), default="span", show_default=True,
              help="Per-layer/op value compared over steps.")
@click.option("--min-delta", type=click.IntRange(min=0), default=None,
              help="Absolute change the CI must also exceed (integer ns; kernels for --metric kernels). Default 1000 ns / 0.")
@click.option("--layer-pattern", default=None, help="Regex for layer ranges (default L{idx}.{kind}, model.layers.{idx}).")
@click.option("--step-pattern", default=None, help="Regex for step ranges (default step, ProfilerStep#N).")
@click.option("--graph-reference", default=None, help="Eager trace attributing the kernels of a CUDA-graph side.")
@click.option("--gate", type=click.Choice(list(GATES)), default="op", show_default=True,
              help="Finest level whose regressions fail the run: op, layer or step (all layers). "
                   "Use layer to compare variants whose ops differ in granularity (stock vs fused).")
@click.option("--format", "fmt", type=click.Choice(["text", "markdown", "json"]), default="text", show_default=True)
@click.option("--junit", default=None, help="Also write JUnit XML here (one failed case per regression).")
@click.option("--output", default=None, help="Write the report here instead of stdout.")
@verbose_option
@with_boundary
def command(base: str, cand: str, threshold_pct: float, metric: str, min_delta: int | None,
            layer_pattern: str | None, step_pattern: str | None, graph_reference: str | None, gate: str,
            fmt: str, junit: str | None, output: str | None, verbose: bool) -> None:
    """Compare CAND against BASE per (layer kind, layer index, op); exit 1 on a regression.

    BASE and CAND are trace files, run folders or DB:RUN. A change fails only when its 95%
    bootstrap interval over steps lies beyond --threshold.

    \b
    Example:
      trace-diff traces/k3_stock_b8_k0_eager.json.gz traces/k3_stock_b1_k0_eager.json.gz --format markdown
      trace-diff traces/k3_stock_b1_k0_graph.json.gz traces/k3_fused_b1_k0_graph.json.gz --gate layer
      decodescope diff runs.duckdb:1 runs.duckdb:2 --metric busy --format json
    """
    if not threshold_pct > 0:
        fail(f"--threshold must be > 0 (got {threshold_pct})")
    kw = {k: v for k, v in (("layer_pattern", layer_pattern), ("step_pattern", step_pattern)) if v is not None}
    b = open_side(base, "BASE", graph_reference, **kw)
    c = open_side(cand, "CAND", graph_reference, **kw)
    rep = compare(b, c, threshold_pct=threshold_pct, metric=metric, min_delta=min_delta, gate=gate)
    body = RENDERERS[fmt](rep)
    if output:
        Path(output).write_text(body if body.endswith("\n") else body + "\n")
    else:
        click.echo(body.rstrip("\n"))
    if junit:
        Path(junit).write_text(render_junit(rep))
    sys.exit(REGRESSION if rep.regressions else OK)


def main(argv: list[str] | None = None) -> None:
    """Console script `trace-diff`: usage errors also become one `error:` line and exit 2."""
    try:
        command.main(args=argv, prog_name="trace-diff", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.UsageError as exc:
        fail(usage_error_line(exc), BAD_INPUT)
    sys.exit(OK)


if __name__ == "__main__":
    main()
