"""Everything the GPU machine does in one call (device time is scarce):

1. probe torch._grouped_mm on this GPU (else the gather+bmm expert path);
2. check the real-size stock step (one KDA + one MLA layer, tp_sim rank 0 of 16, B = 2,
   2 steps) against the float64 reference of tests/kimi_decode/k3_reference.py;
   (the reference follows the model's expert choice; routing agreement is reported);
3. capture the 8 stock traces (B = 1, 8, 64 with k = 0 and B = 1 with k = 7; eager and graph);
4. run bench/decode.py.
Outputs under --out: traces.tar (split in <= 15 MiB parts if needed), check.json, bench.json.

    DECODESCOPE_COMMIT=$(git rev-parse HEAD) python3 -m kimi_decode.device_job --out $OUT
"""
from __future__ import annotations

import argparse
import json
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

import torch

from kimi_decode.config import k3_tp16

SHAPES = [(1, 0), (8, 0), (64, 0), (1, 7)]


def probe_grouped_mm() -> str:
    """'grouped_mm' if torch._grouped_mm runs here and matches per-group matmuls, else 'gather_bmm'."""
    try:
        E, L, N, rows = 8, 256, 128, 24
        a = torch.randn(rows, L, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(E, N, L, device="cuda", dtype=torch.bfloat16)
        offs = torch.tensor([3, 3, 10, 12, 12, 20, 24, 24], device="cuda", dtype=torch.int32)
        out = torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
        start, err = 0, 0.0
        for e, end in enumerate(offs.tolist()):
            ref = a[start:end].float() @ w[e].float().t()
            err = max(err, float((out[start:end].float() - ref).abs().max()) if end > start else 0.0)
            start = end
        print(f"grouped_mm probe: max abs err {err:.3g}", flush=True)
        return "grouped_mm" if err < 1.0 else "gather_bmm"
    except Exception as exc:  # any failure means: use the fallback, and say why
        print(f"grouped_mm probe failed: {exc!r}", flush=True)
        return "gather_bmm"


def check(impl: str, compile_ops: bool) -> dict:
    """Real-size stock layers vs the float64 reference (relative L2 errors, routing agreement).

    The reference follows the model's expert choice (`forced`), so the errors measure
    numerics; `routing_rows_same` says how often the reference's own fp64 choice agreed.
    """
    from kimi_decode.runner import build
    from tests.kimi_decode.k3_reference import Reference

    cfg = k3_tp16(batch=8, layers=(6, 7), tp_sim=True, expert_impl=impl, compile_ops=compile_ops)
    model, _ = build("stock", cfg, "cuda")
    ref = Reference(model, sim_world=cfg.sim_world, rank=cfg.rank)
    rel = lambda a, b: float((a.double() - b).norm() / b.norm())  # noqa: E731
    out: dict = {"config": f"k3_tp16 layers 6 (kda), 7 (mla), B=8, tp_sim rank 0/16, compile_ops={compile_ops}",
                 "steps": []}
    for s in range(3):
        m, prefix, blocks = model.make_inputs(seed=10 + s)
        with torch.no_grad():
            o_m, o_prefix = model(m, prefix, blocks)
        routes = [r.clone() for layer in model.layers for r in layer.mlp.last_idx]
        ref.routes.clear()
        ref.forced = list(routes)
        r_m, r_prefix, _ = ref.step(m, prefix, blocks)
        same = sum(set(a.tolist()) == set(b.tolist()) for a, b in zip(routes, ref.routes))
        out["steps"].append({"rel_m": rel(o_m, r_m), "rel_prefix": rel(o_prefix, r_prefix),
                             "routing_rows_same": f"{same}/{len(routes)}"})
    for layer, (_, _, _, st) in zip(model.layers, ref.layers):
        for name, buf in layer.named_buffers():
            out[f"L{layer.idx}.{name}"] = rel(buf, st[name])
    del model, ref
    torch.cuda.empty_cache()
    return out


def captures(impl: str, tmp: Path, steps: int, compile_ops: bool) -> list[dict]:
    from tracer.capture import capture

    done = []
    for b, k in SHAPES:
        for graph in (False, True):
            name = f"k3_stock_b{b}_k{k}_{'graph' if graph else 'eager'}.json.gz"
            t0 = time.time()
            try:
                cfg = k3_tp16(batch=b, spec_tokens=k, tp_sim=True, expert_impl=impl, compile_ops=compile_ops)
                meta = capture("stock", cfg, graph=graph, steps=steps, out=tmp / name)
                info = {"file": name, "seconds": round(time.time() - t0, 1),
                        "bytes": (tmp / name).stat().st_size, "map_kernels": len(meta["graph_capture_map"]),
                        "matched": meta["graph_capture_map_matched"], "comm_streams": meta["comm_streams"],
                        "notes": meta["notes"], "torch_comm_stream": meta["torch_comm_stream"]}
            except Exception:
                info = {"file": name, "error": traceback.format_exc()}
            print(json.dumps(info), flush=True)
            done.append(info)
            torch.cuda.empty_cache()
    return done


def pack(tmp: Path, out: Path, limit: int = 15 << 20) -> None:
    """Traces into tar files of at most ~limit bytes each (the tool returns <= 16 MiB a file)."""
    files = sorted(tmp.glob("*.json.gz"))
    part, size, n = None, 0, 0
    for f in files:
        if part is None or size + f.stat().st_size > limit:
            if part:
                part.close()
            n += 1
            part, size = tarfile.open(out / f"traces{n}.tar", "w"), 0
        part.add(f, arcname=f.name)
        size += f.stat().st_size
    if part:
        part.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--skip", nargs="*", default=[], choices=["check", "capture", "bench"])
    ap.add_argument("--eager-ops", action="store_true", help="no torch.compile of the op groups")
    args = ap.parse_args()
    compile_ops = not args.eager_ops
    if compile_ops:  # a function inductor cannot compile runs eagerly instead of failing the job
        torch._dynamo.config.suppress_errors = True
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__} cuda {torch.version.cuda} on {torch.cuda.get_device_name()}", flush=True)
    impl = probe_grouped_mm()
    t0 = time.time()
    if "check" not in args.skip:
        try:
            res = check(impl, compile_ops)
        except Exception:
            res = {"error": traceback.format_exc()}
        print("check:", json.dumps(res, indent=1), f"({time.time() - t0:.0f} s)", flush=True)
        (args.out / "check.json").write_text(json.dumps(res, indent=1))
    if "capture" not in args.skip:
        with tempfile.TemporaryDirectory() as tmp:
            info = captures(impl, Path(tmp), args.steps, compile_ops)
            pack(Path(tmp), args.out)
        (args.out / "captures.json").write_text(json.dumps(info, indent=1))
        print(f"captures done ({time.time() - t0:.0f} s)", flush=True)
    if "bench" not in args.skip:
        from bench.decode import main as bench_main
        try:
            bench_main(["--variant", "stock", "--batch", "1", "8", "64", "--spec", "0", "7",
                        "--reps", str(args.reps), "--expert-impl", impl, "--json", str(args.out / "bench.json")]
                       + ([] if compile_ops else ["--eager-ops"]))
        except Exception:
            traceback.print_exc()
        print(f"bench done ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
