"""Write traces/README.md from the `decodescope` objects of the bundled stock traces.

    python -m kimi_decode.traces_readme [--extra notes.md]

Figures come from the traces themselves: kernels per step and per layer are counted from the
eager traces' annotations (and graph_capture_map for graph traces).
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import Counter
from pathlib import Path

from tracer.capture import kernels_with_ops

TRACES = Path(__file__).resolve().parent.parent / "traces"


def describe(path: Path) -> dict:
    trace = json.loads(gzip.decompress(path.read_bytes()))
    meta = trace["decodescope"]
    cfg = meta["config"]
    if meta["graph_mode"]:
        per_layer = Counter(m["layer"] for m in meta["graph_capture_map"])
        steps = 1
    else:
        ks = [k for k in kernels_with_ops(trace) if k["step"]]
        per_layer = Counter(k["layer"] for k in ks)
        steps = meta["steps"]
        per_op = Counter((k["layer"].split(".")[1], k["op"]) for k in ks if k["layer"])
    kinds: dict[str, list[float]] = {}
    for layer, n in per_layer.items():
        if layer:
            kinds.setdefault(layer.split(".")[1], []).append(n / steps)
    ops: dict[str, dict[str, float]] = {}
    if not meta["graph_mode"]:
        layers_of = Counter(layer.split(".")[1] for layer in per_layer if layer)
        for (kind, op), n in per_op.items():
            ops.setdefault(kind, {})[op] = n / steps / layers_of[kind]
    return {"file": path.name, "meta": meta, "cfg": cfg, "size": path.stat().st_size, "ops_per_layer": ops,
            "kernels_per_layer": {k: statistics.median(v) for k, v in sorted(kinds.items())},
            "kernels_per_step": sum(per_layer.values()) / steps}


def render(rows: list[dict], extra: str) -> str:
    first = rows[0]["meta"]
    lines = ["# Bundled traces", "",
             "Real PyTorch-profiler (Kineto) traces of the **stock** Kimi K3 decode step, one rank of TP16",
             "(6 local KDA/MLA heads, all 896 experts with the 192→256-padded intermediate slice, bf16",
             "de-quantised expert weights), layers 4-7 of the model (KDA, KDA, KDA, MLA), captured by",
             "`kimi_decode/device_job.py` (`decodescope capture`) on the GPU machine. Collectives are",
             "simulated on one GPU (`tp_sim`: each all-reduce / reduce-scatter / all-gather is a local",
             "kernel reading 16 partials on its own stream, the other ranks' partials zero).",
             "Each file holds a top-level `decodescope` object (config, GPU, versions, commit, graph mode,",
             "tp_sim, comm streams and ops, `graph_capture_map` for graph traces).", "",
             f"- GPU: {first['gpu']}; torch {first['torch_version']}, CUDA {first['cuda_version']}",
             f"- captured: {first.get('captured_at')}; commit `{first['commit']}`",
             f"- context: {first['config']['context_len']} cached MLA tokens per sequence; seed {first['config']['seed']};"
             f" experts via `{first['config']['expert_impl']}`; op fusion: "
             f"{op_fusion(first['config'])}", "",
             "| file | B | k | M | mode | profiled steps | kernels/step | kernels per KDA / MLA layer | comm_streams | map matched | size |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [file_row(r, matched=True) for r in rows]
    lines += op_table(rows)
    lines += ["", extra.strip(), ""] if extra.strip() else [""]
    return "\n".join(lines)


def file_row(r: dict, matched: bool) -> str:
    """One trace's table row; `matched` adds the capture-map verdict column."""
    m, c, kpl = r["meta"], r["cfg"], r["kernels_per_layer"]
    cells = [f"`{r['file']}`", c["batch"], c["spec_tokens"], c["derived"]["rows"],
             "graph" if m["graph_mode"] else "eager", m["steps"], f"{r['kernels_per_step']:.0f}",
             f"{kpl.get('kda', 0):.0f} / {kpl.get('mla', 0):.0f}", m["comm_streams"]]
    if matched:
        cells.append(m["graph_capture_map_matched"])
    cells.append(f"{r['size'] / 1e3:.0f} kB")
    return "| " + " | ".join(str(x) for x in cells) + " |"


def op_fusion(cfg: dict) -> str:
    if not cfg.get("compile_ops"):
        return "none (plain eager PyTorch ops)"
    if not cfg.get("triton_ops", False):
        return "torch.compile per op"
    off = cfg.get("triton_off") or []
    return ("Triton kernels of `kimi_decode/stock_triton.py` for skinny GEMMs, AttnRes, conv, recurrent KDA, "
            "routing, experts and latent up-proj, torch.compile per op elsewhere"
            + (f"; op groups kept torch after their device check failed: {', '.join(off)}" if off else ""))


def op_table(rows: list[dict]) -> list[str]:
    """Kernels per op and layer (per step) in the eager traces, one column per (B, k)."""
    eager = [r for r in rows if r["ops_per_layer"]]
    if not eager:
        return []
    cols = [(r["cfg"]["batch"], r["cfg"]["spec_tokens"]) for r in eager]
    lines = ["", "Kernels per op and layer, one eager step (counted from the annotations):", "",
             "| layer kind | op | " + " | ".join(f"B={b} k={k}" for b, k in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    keys = sorted({(kind, op) for r in eager for kind, d in r["ops_per_layer"].items() for op in d},
                  key=lambda ko: (ko[0], ko[1] or ""))
    for kind, op in keys:
        cells = " | ".join(f"{r['ops_per_layer'].get(kind, {}).get(op, 0):g}" for r in eager)
        lines.append(f"| {kind} | {op or '(none)'} | {cells} |")
    return lines


FUSED_HEADING = "## Fused traces"


def fused_section(rows: list[dict]) -> str:
    """The section for the fused traces (kimi_decode/fused.py, bench/fused_device.py): same
    shapes and naming as the stock ones; the kernels that ran are in each file's metadata."""
    first = rows[0]["meta"]
    lines = [FUSED_HEADING, "",
             "The **fused** step (kimi_decode/fused.py, CuTe DSL kernels) captured the same way, beside each",
             "stock trace (`bench/fused_device.py` on the GPU machine). Collectives are still simulated, but",
             "finished inside kernels: the producers write their slot of the collective's buffer and the",
             "consumers sum (or gather) the slots, so there is no separate collective kernel or stream at",
             "B ≤ 8 (comm_streams empty); at B = 64 some ops fall back to stock ops (per-M table).",
             "Graph traces: the side stream reorders kernel starts against the eager capture map, so the",
             "map matches as a multiset (`map matched` False here); decodescope attributes such replays",
             "by (name, occurrence), counted apart as 'reordered' (analyzers/sql/attribution/capture_map.sql).", "",
             f"- GPU: {first['gpu']}; torch {first['torch_version']}, CUDA {first['cuda_version']}",
             f"- captured: {first.get('captured_at')}; commit `{first['commit']}`",
             f"- kernels on: {', '.join(first.get('fused_kernels') or [])}", "",
             "| file | B | k | M | mode | profiled steps | kernels/step | kernels per KDA / MLA layer | comm_streams | size |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [file_row(r, matched=False) for r in rows]
    lines += op_table(rows)
    return "\n".join(lines) + "\n"


def bundled_rows(variant: str) -> list[dict]:
    """describe() of the bundled traces of one variant ('stock' or 'fused'), in the README's
    order: by k, then B, eager before graph."""
    rows = [describe(p) for p in sorted(TRACES.glob(f"k3_{variant}_*.json.gz"))]
    rows.sort(key=lambda r: (r["cfg"]["spec_tokens"], r["cfg"]["batch"], r["meta"]["graph_mode"]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--extra", type=Path, help="markdown appended (notes, checks)")
    ap.add_argument("--fused", action="store_true",
                    help="only (re)write the fused traces' section of the existing README")
    args = ap.parse_args()
    if args.fused:
        readme = (TRACES / "README.md").read_text()
        keep = readme.split(FUSED_HEADING)[0].rstrip() + "\n\n"
        (TRACES / "README.md").write_text(keep + fused_section(bundled_rows("fused")))
        return
    extra = args.extra.read_text() if args.extra else ""
    (TRACES / "README.md").write_text(render(bundled_rows("stock"), extra))


if __name__ == "__main__":
    main()
