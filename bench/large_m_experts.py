"""The routed experts above the CuTe kernels' rows (B = 64): stock's call against the fused one.

Why: at M > 8 (M·K > 128) no CuTe experts kernel runs, and in the bundled H200 B = 64 fused
trace the four Triton kernels took ~860 µs of a ~1,050 µs KDA layer: the stable counting sort
85-97 µs (O(P²) at P = 1024 pairs), FC1 479 µs and FC2 282 µs reading the zero-padded 256
intermediate rows of which 192 are real. fused.LARGE_M_EXPERTS calls the same kernels with
`inter` (skip the padding) and `fast_align` (an O(P) sort with atomic places; stock's own call
has taken that sort too since session 34, stock_ops.STOCK_FAST_ALIGN, so the "stock" column
here is stock before it and "padded + fast sort" stock after it). This measures
both calls, and each sort alone, at the K3 TP16 rank shapes (E = 896 experts, top-16,
L = 3584, 192 of 256), and checks on the GPU that the outputs are bit-identical (the CPU
interpreter test's claim, tests/kimi_decode/test_stock_triton.py).

Weights: seeded random bf16 with the padding zero, as stock.LatentMoE stores them (4.9 GB, so
each M = 64 call streams ~3 GB: cold by construction). Routing: each row's top-16 of 896
uniformly at random (seeded). Times: median µs per call of a CUDA graph holding the call
(kernels/checks.replay_us).

    python3 -m bench.large_m_experts --out $OUT     (writes large_m_experts.json and .md)
    python -m bench.large_m_experts --render large_m_experts.json   (here)
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.render_cli import print_rendered

E, K, L, I, IP = 896, 16, 3584, 192, 256
ROWS = (8, 16, 64)


def _graph_us(call: Callable[[], object], reps: int) -> float:
    """Median µs per call of a CUDA graph holding `call` once (warmed up first)."""
    from kimi_decode.kernels.checks import replay_us
    call()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    us = replay_us(g, reps, 1, discard=2)
    del g
    return us


def padded_weights(dev: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2·IP, L] and w2 [E, L, IP] bf16 with rows / columns I..IP-1 zero."""
    g = torch.Generator(device=dev).manual_seed(seed)
    w13 = torch.zeros(E, 2 * IP, L, dtype=torch.bfloat16, device=dev)
    w2 = torch.zeros(E, L, IP, dtype=torch.bfloat16, device=dev)
    for e0 in range(0, E, 64):                      # in slices: no 4.9 GB float32 temporary
        e1 = min(E, e0 + 64)
        w13[e0:e1, :I] = (torch.randn(e1 - e0, I, L, generator=g, device=dev) * 0.02).to(torch.bfloat16)
        w13[e0:e1, IP:IP + I] = (torch.randn(e1 - e0, I, L, generator=g, device=dev) * 0.02).to(torch.bfloat16)
        w2[e0:e1, :, :I] = (torch.randn(e1 - e0, L, I, generator=g, device=dev) * 0.02).to(torch.bfloat16)
    return w13, w2


def routing(m: int, dev: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(m)]).to(dev)
    w = torch.rand(m, K, generator=g).to(dev)
    return idx.contiguous(), (w / w.sum(1, keepdim=True)).contiguous()


def measure(reps: int) -> dict:
    from kimi_decode import stock_triton as kt
    dev = torch.device("cuda")
    w13, w2 = padded_weights(dev)
    rows = []
    for m in ROWS:
        idx, w = routing(m, dev, seed=m)
        z = (torch.randn(m, L, device=dev) * 0.5).to(torch.bfloat16)
        distinct = int(torch.unique(idx).numel())
        stock_out = kt.experts(z, idx, w, w13, w2, 4.0, 25.0)
        fused_out = kt.experts(z, idx, w, w13, w2, 4.0, 25.0, inter=I, fast_align=True)
        P = m * K
        sp = torch.empty(P, dtype=torch.int32, device=dev)
        seg = torch.empty(min(E, P), 3, dtype=torch.int32, device=dev)
        nseg = torch.empty(1, dtype=torch.int32, device=dev)
        starts = torch.empty(E, dtype=torch.int32, device=dev)
        bp, be = kt._pow2(P), kt._pow2(E + 1)
        row = {
            "rows": m, "pairs": P, "distinct_experts": distinct,
            "bytes_padded": distinct * (2 * IP * L + L * IP) * 2, "bytes_unpadded": distinct * 3 * I * L * 2,
            "bit_equal": bool(torch.equal(stock_out, fused_out)),
            "stock_us": _graph_us(lambda: kt.experts(z, idx, w, w13, w2, 4.0, 25.0), reps),
            "fused_us": _graph_us(lambda: kt.experts(z, idx, w, w13, w2, 4.0, 25.0, inter=I, fast_align=True),
                                  reps),
            "padded_fast_sort_us": _graph_us(lambda: kt.experts(z, idx, w, w13, w2, 4.0, 25.0, fast_align=True),
                                             reps),
            "sort_stable_us": _graph_us(lambda: kt._moe_align_kernel[(1,)](
                idx, sp, seg, nseg, starts, P, E, BLOCK_P=bp, BLOCK_E=be, CHUNK=16, num_warps=8), reps),
            "sort_atomic_us": _graph_us(lambda: kt._moe_align_atomic_kernel[(1,)](
                idx, sp, seg, nseg, starts, P, E, BLOCK_P=bp, BLOCK_E=be, num_warps=8), reps),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"rows": rows}


def render(res: dict) -> str:
    m = res["meta"]
    lines = ["# Routed experts above the CuTe rows: stock's call vs the fused one (`bench/large_m_experts.py`)", "",
             f"- GPU: {m['gpu']}, torch {m['torch']}; commit {m['commit']}, {m['date']}; {m['reps']} replays",
             "- K3 TP16 rank shapes: E = 896, top-16, L = 3584, 192 of 256 intermediate rows real; random",
             "  routing (top-16 uniform per row), seeded bf16 weights with the padding zero (4.9 GB: cold)",
             "- stock: align (stable sort) + FC1 + FC2 + finalize reading the padding, as stock ran until",
             "  session 34; fused: `inter` = 192 and the atomic sort (fused.LARGE_M_EXPERTS); padded + fast",
             "  sort: the sort alone changed, which is stock's call since session 34 (stock_ops.STOCK_FAST_ALIGN)",
             "- bytes: distinct experts x (w13 + w2) slices; TB/s = bytes / the call's time", "",
             "| M | pairs | distinct experts | stock µs | stock TB/s (padded bytes) | fused µs | fused TB/s (unpadded) "
             "| padded + fast sort µs | sort stable µs | sort atomic µs | bit-equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['rows']} | {r['pairs']} | {r['distinct_experts']} | {r['stock_us']:.1f} | "
                     f"{r['bytes_padded'] / r['stock_us'] / 1e6:.2f} | {r['fused_us']:.1f} | "
                     f"{r['bytes_unpadded'] / r['fused_us'] / 1e6:.2f} | {r['padded_fast_sort_us']:.1f} | "
                     f"{r['sort_stable_us']:.1f} | {r['sort_atomic_us']:.1f} | {r['bit_equal']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--render", type=Path, help="print the table of a large_m_experts.json (no GPU)")
    a = ap.parse_args(argv)
    if a.render is not None:
        print_rendered(a.render, render, "large_m_experts", "a large_m_experts.json")
        return
    if a.out is None:
        raise SystemExit("large_m_experts: --out (on the GPU machine) or --render FILE")
    res = measure(a.reps)
    res["meta"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "commit": os.environ.get("DECODESCOPE_COMMIT", "unknown"),
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "reps": a.reps}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "large_m_experts.json").write_text(json.dumps(res, indent=1))
    (a.out / "large_m_experts.md").write_text(render(res))
    print(render(res), end="")


if __name__ == "__main__":
    main()
