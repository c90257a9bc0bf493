"""What a pure read stream reaches on the GPU, beside the copy the floor divides by.

Why: bench/decode.md's floor is bytes / the bandwidth of a 2 GiB device copy (bytes read +
written). A decode layer only reads its weights. If a read-only stream cannot reach the copy's
rate, part of fused/floor is the memory system, not the kernels; if it can, the fused GEMVs
(60-70 % of DRAM peak in bench/ncu_fused_b1.md) have that much room. One GPU call measures:

1. the copy (bench.decode.copy_bandwidth, 2 GiB);
2. a read-only Triton kernel (grid-stride 128-bit loads, one fp32 sum per program) at 2 GiB,
   over a sweep of block size, warps and programs per SM; the best is reported;
3. cold reads at the layer's weight sizes (o_proj 11 MB, in_proj 46 MB, the MoE front 75 MB,
   a whole B = 1 KDA layer 208 MB): each call reads another copy (copies totalling ≥ 512 MB,
   beyond the 50 MB L2), N calls in one CUDA graph, time / N; the same for the copy of half
   the bytes (read + write = the same bytes moved) and for the fused GEMV (kernels/gemv.py,
   gemv.TUNED) on in_proj's weight.

    python3 -m bench.stream_bw --out $OUT      (writes stream_bw.json and stream_bw.md)
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

MB = 1 << 20
SIZES = {"o_proj 7168x768": 7168 * 768 * 2, "in_proj 3216x7168": 3216 * 7168 * 2,
         "MoE front 75 MB": 75 * 10**6 // 16 * 16, "KDA layer 208 MB": 208 * 10**6 // 16 * 16}


def _graph_us(calls: list[Callable[[], object]], reps: int = 20) -> float:
    """Median µs per call of a CUDA graph holding `calls` once each (warmed up first)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    from kimi_decode.kernels.checks import replay_us
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    us = replay_us(g, reps, len(calls), discard=2)
    del g
    return us


def _read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n, step):
            idx = start + offs
            acc += tl.load(x_ptr + idx, mask=idx < n, other=0.0)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    return read_sum


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from bench.decode import copy_bandwidth
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "commit": os.environ.get("DECODESCOPE_COMMIT", "unknown"), "gpu": torch.cuda.get_device_name(),
                 "torch": torch.__version__, "sms": sms}
    res["copy_2gib_tbs"] = copy_bandwidth() / 1e12
    read_sum = _read_kernel()
    out = torch.empty(sms * 64, dtype=torch.float32, device="cuda")

    def reader(x: torch.Tensor, block: int, warps: int, per_sm: int) -> Callable[[], object]:
        n = x.numel()
        return lambda: read_sum[(sms * per_sm,)](x, out, n, BLOCK=block, num_warps=warps)

    big = torch.rand((2 << 30) // 4, device="cuda")               # fp32: 16-byte loads of 4 values
    sweep = []
    for block in (1024, 2048, 4096):
        for warps in (4, 8):
            for per_sm in (4, 8, 16):
                us = _graph_us([reader(big, block, warps, per_sm)], reps=10)
                sweep.append({"block": block, "warps": warps, "programs_per_sm": per_sm,
                              "us": us, "read_tbs": big.numel() * 4 / us / 1e6})
    best = max(sweep, key=lambda r: r["read_tbs"])
    res["read_2gib_sweep"] = sweep
    res["read_2gib_best"] = best
    ref = big.double().sum()
    reader(big, best["block"], best["warps"], best["programs_per_sm"])()
    got = out[: sms * best["programs_per_sm"]].double().sum()
    res["read_sum_rel_err"] = float(abs(got - ref) / ref.abs().clamp_min(1.0))
    del big

    from kimi_decode.kernels import gemv as kg
    kg.set_tuned(True)
    cold = []
    for name, nbytes in SIZES.items():
        copies = max(2, -(-(512 * MB) // nbytes))
        xs = [torch.randn(nbytes // 4, device="cuda") for _ in range(copies)]
        us_read = _graph_us([reader(x, best["block"], best["warps"], best["programs_per_sm"]) for x in xs])
        half = [x[: x.numel() // 2] for x in xs]
        dst = [torch.empty_like(h) for h in half]
        us_copy = _graph_us([lambda s=s, d=d: d.copy_(s) for s, d in zip(half, dst)])
        row = {"size": name, "bytes": nbytes, "copies": copies, "read_us": us_read,
               "read_tbs": nbytes / us_read / 1e6, "copy_us": us_copy, "copy_tbs": nbytes / us_copy / 1e6}
        del half, dst
        if name.startswith("in_proj"):
            ws = [x.view(torch.bfloat16).view(3216, 7168) for x in xs]
            xv = torch.randn(1, 7168, device="cuda").bfloat16()
            us_gemv = _graph_us([lambda w=w: kg.gemv(xv, w) for w in ws])
            row.update(gemv_us=us_gemv, gemv_tbs=nbytes / us_gemv / 1e6)
        cold.append(row)
        del xs
        torch.cuda.empty_cache()
    res["cold"] = cold
    (args.out / "stream_bw.json").write_text(json.dumps(res, indent=1))
    (args.out / "stream_bw.md").write_text(render(res))
    print(render(res))


def render(res: dict) -> str:
    b = res["read_2gib_best"]
    lines = ["# Read-only stream vs copy bandwidth (GPU)", "",
             f"- {res['date']}, commit {res['commit'][:12]}, {res['gpu']} ({res['sms']} SMs), torch {res['torch']}; "
             "`python3 -m bench.stream_bw` (bench/stream_bw.py says what each row measures)",
             f"- copy, 2 GiB, read + write counted (bench/decode.md's floor divisor): {res['copy_2gib_tbs']:.2f} TB/s",
             f"- read-only Triton stream, 2 GiB, best of {len(res['read_2gib_sweep'])} configurations "
             f"(block {b['block']}, {b['warps']} warps, {b['programs_per_sm']} programs per SM): "
             f"{b['read_tbs']:.2f} TB/s (sum checked against float64: rel err {res['read_sum_rel_err']:.1e})", "",
             "Cold (each call reads another copy, copies ≥ 512 MB in all; N calls in one CUDA graph, per-call median):", "",
             "| size | MB | read-only µs | read TB/s | copy of half µs | copy TB/s (read + write) | fused GEMV µs | GEMV TB/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["cold"]:
        g = (f"{r['gemv_us']:.2f} | {r['gemv_tbs']:.2f}" if "gemv_us" in r else "- | -")
        lines.append(f"| {r['size']} | {r['bytes'] / 1e6:.1f} | {r['read_us']:.2f} | {r['read_tbs']:.2f} | "
                     f"{r['copy_us']:.2f} | {r['copy_tbs']:.2f} | {g} |")
    lines += ["", "Sweep at 2 GiB:", "", "| block | warps | programs/SM | µs | TB/s |", "|---|---|---|---|---|"]
    for r in res["read_2gib_sweep"]:
        lines.append(f"| {r['block']} | {r['warps']} | {r['programs_per_sm']} | {r['us']:.1f} | {r['read_tbs']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
