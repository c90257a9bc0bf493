"""Everything the GPU machine does in one call (device time is scarce):

1. probe torch._grouped_mm on this GPU (else the gather+bmm expert path); check each Triton
   kernel of stock_triton.py against its torch function at the real shapes (an op group whose
   kernel fails or disagrees stays torch: `triton_off`), and time the skinny GEMM against
   cuBLAS (`kernel_checks`; results in kernels.json);
2. check the real-size stock step (one KDA + one MLA layer, tp_sim rank 0 of 16, B = 2,
   2 steps) against the float64 reference of tests/kimi_decode/k3_reference.py;
   (the reference follows the model's expert choice; routing agreement is reported);
3. capture the 8 stock traces (B = 1, 8, 64 with k = 0 and B = 1 with k = 7; eager and graph);
4. run bench/decode.py.
Outputs under --out: traces.tar (split in <= 15 MiB parts if needed), kernels.json, check.json,
captures.json, bench.json.

    DECODESCOPE_COMMIT=$(git rev-parse HEAD) python3 -m kimi_decode.device_job --out $OUT
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# The bf16 bar: outputs are rounded to bf16 (relative step 2^-8), so 1e-2 relative L2 passes
# only a kernel that computes the same thing; a wrong tile, stride or mask moves it by O(1).
BF16_TOL = 1e-2


def gemms(cfg) -> dict[str, tuple[int, int]]:
    """(N, K) of every skinny GEMM of the stock step (at TP16: KIMI_K3.md Part 3's shapes)."""
    D = cfg.hidden
    return {"in_proj": (cfg.in_proj_rows, D), "f_b": (cfg.kda_local_dim, cfg.kda_head_dim),
            "o_proj": (D, cfg.kda_local_dim), "router": (cfg.num_experts, D), "latent_down": (cfg.latent_dim, D),
            "shared_gate_up": (2 * cfg.shared_local_inter, D), "shared_down": (D, cfg.shared_local_inter),
            "qkv_a": (cfg.qkv_a_rows, D), "q_b": (cfg.mla_local_heads * cfg.qk_head_dim, cfg.q_lora_rank),
            "g_proj": (cfg.mla_local_heads * cfg.v_head_dim, D), "up_proj": (cfg.row_shard, cfg.latent_dim)}


def gemm_bench() -> list[dict]:
    """Triton skinny GEMM vs cuBLAS (x @ w.t()) per shape and M: each timed over enough weight
    copies (>= 256 MB) that no call finds its weight in the 50 MB L2, launches in a CUDA graph."""
    from kimi_decode import stock_triton as kt
    from kimi_decode.kernels.checks import time_us

    rows = []
    for name, (N, K) in gemms(k3_tp16()).items():
        copies = max(2, min(16, -(-(256 << 20) // (N * K * 2))))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for M in (1, 8, 64):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            # one timed call = one GEMM per weight copy (CUDA-graph replays, kernels/checks.py)
            cub = time_us(lambda: [x @ w.t() for w in ws], calls=1) / len(ws)
            tri = time_us(lambda: [kt.skinny_mm(x, w) for w in ws], calls=1) / len(ws)
            rows.append({"gemm": name, "N": N, "K": K, "M": M, "cublas_us": round(cub, 2), "triton_us": round(tri, 2),
                         "triton_over_cublas": round(tri / cub, 3)})
        del ws
    return rows


def kernel_checks(impl: str, cfg=None, dev: str = "cuda", bf: torch.dtype = torch.bfloat16,
                  bench: bool = True) -> dict:
    """Each Triton kernel against the torch function it stands for, at the real TP16 shapes
    (M = 1, 8, 64; T = 8 for the state ops), bf16; the op groups that fail go to triton_off.
    (cfg, dev, bf: a small config on the CPU under TRITON_INTERPRET=1 dry-runs this.)"""
    from kimi_decode import stock_ops as ops
    from kimi_decode import stock_triton as kt

    cfg = cfg or k3_tp16()
    gen = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape, s=1.0, dt=bf: (torch.randn(*shape, generator=gen, device=dev) * s).to(dt)  # noqa: E731
    errs: dict[str, list] = {op: [] for op in ops.TRITON_OPS}

    def record(op: str, what: str, fn) -> None:
        try:
            err = fn()
            errs[op].append({"case": what, "rel_err": err, "ok": err < BF16_TOL})
        except Exception:
            errs[op].append({"case": what, "error": traceback.format_exc(limit=3), "ok": False})

    D, L, R = cfg.hidden, cfg.latent_dim, cfg.in_proj_rows
    P4 = 4 * cfg.kda_local_dim              # z columns: f_a, then the betas
    for M in (1, 8, 64):
        for name, (N, K) in gemms(cfg).items():
            w = rnd(N, K, s=K ** -0.5)
            x = rnd(M, R)[:, P4:P4 + K] if name == "f_b" else rnd(M, K)   # f_b reads a z slice
            record("mm", f"{name} M={M}", lambda: _rel(kt.skinny_mm(x, w), x @ w.t()))
        w = rnd(cfg.num_experts, D, s=D ** -0.5)
        x = rnd(M, D)
        record("mm", f"router fp32 M={M}", lambda: _rel(kt.skinny_mm(x, w, torch.float32), (x @ w.t()).float()))
        r, norm, up, sh = rnd(M, L), rnd(L).abs() + 0.5, rnd(cfg.row_shard, L, s=L ** -0.5), rnd(M, cfg.row_shard)
        record("up", f"M={M}", lambda: _rel(kt.skinny_mm(r, up, add=sh, norm_w=norm, eps=1e-5),
                                             ops.latent_up(r, norm, up, sh, 1e-5)))
        base, delta, blocks = rnd(M, D), rnd(M, D), rnd(M, 8, D)
        wres, nres = rnd(D, s=0.05, dt=torch.float32), rnd(D, dt=torch.float32).abs() + 0.5
        for nb, reset in ((1, False), (1, True), (0, False), (3, False)):
            def attn() -> float:
                p, o = kt.attn_res(base, delta, blocks, wres, nres, 1e-5, nb, reset)
                rp, ro = ops.res_mix(base, delta, blocks, wres, nres, 1e-5, nb, reset)
                return max(_rel(p, rp), _rel(o, ro))
            record("attn_res", f"M={M} nb={nb} reset={reset}", attn)
        logits, bias = rnd(M, cfg.num_experts, dt=torch.float32), rnd(cfg.num_experts, s=0.02, dt=torch.float32)

        def route() -> float:
            idx, wt = kt.route(logits, bias, cfg.top_k, 1.0)
            ri, rw = ops.route(logits, bias, cfg.top_k, 1.0)
            return 1.0 if not torch.equal(idx, ri) else _rel(wt, rw)
        record("route", f"M={M}", route)
    for B, T in ((1, 1), (8, 1), (64, 1), (1, 8)):
        C, H, d = 3 * cfg.kda_local_dim, cfg.kda_local_heads, cfg.kda_head_dim
        z = rnd(B * T, R)
        state, cw = rnd(B, C, 3), rnd(C, 4, s=0.5, dt=torch.float32)

        def conv() -> float:
            st = state.clone()
            act = kt.conv_update_(st, z[:, :C], cw, B)
            ra, rs = ops.conv_update(state, z[:, :C], cw, B)
            return max(_rel(act, ra), _rel(st, rs))
        record("conv", f"B={B} T={T}", conv)
        act, fb = rnd(B, T, C, dt=torch.float32), rnd(B * T, H * d)
        dtb, alog = rnd(H * d, s=0.5, dt=torch.float32), rnd(H, dt=torch.float32).abs()
        S0 = rnd(B, H, d, d, s=0.05, dt=torch.float32)

        def kda() -> float:
            S = S0.clone()
            beta = z[:, P4 + d:P4 + d + H]
            o = kt.kda_recurrence_(act, fb, beta, dtb, alog, S, -5.0, H)
            ro, rs = ops.kda_recurrence(act, fb, beta, dtb, alog, S0, -5.0, H)
            return max(_rel(o, ro), _rel(S, rs))
        record("kda", f"B={B} T={T}", kda)
    ql, c, rope, H = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_dim, cfg.mla_local_heads
    for B, T in ((1, 1), (8, 1), (64, 1), (1, 8)):
        M = B * T
        a = rnd(M, cfg.qkv_a_rows)
        qn, kvn = rnd(ql).abs() + 0.5, rnd(c).abs() + 0.5
        record("mla_norms", f"M={M}", lambda: max(_rel(x, y) for x, y in zip(
            kt.mla_norms(a, qn, kvn, ql, c, 1e-5), ops.mla_norms(a, qn, kvn, ql, c, 1e-5))))
        q_lat, q = rnd(H, M, c).transpose(0, 1), rnd(M, H, cfg.qk_head_dim)
        ckv, cache, pos = rnd(M, c), rnd(B, 64, c + rope), torch.tensor([40], device=dev)

        def kv() -> float:
            mine, ref = cache.clone(), cache.clone()
            got = kt.kv_insert(q_lat, q, ckv, a, ql + c, mine, pos, T)
            want = ops.OpSet(cfg).kv_insert(q_lat, q, ckv, a, ql + c, ref, pos, T)  # compile_ops off: torch
            return 0.0 if torch.equal(got, want) and torch.equal(mine, ref) else 1.0
        record("kv_insert", f"B={B} T={T}", kv)
    E, Ip = cfg.num_experts, cfg.expert_local_inter_padded
    w13, w2 = rnd(E, 2 * Ip, L, s=L ** -0.5), rnd(E, L, Ip, s=Ip ** -0.5)
    for M in (1, 8, 64):
        z = rnd(M, L)
        idx, wt = ops.route(rnd(M, E, dt=torch.float32), torch.zeros(E, device=dev), cfg.top_k, 1.0)
        record("experts", f"M={M}", lambda: _rel(kt.experts(z, idx, wt, w13, w2, cfg.situ_beta, cfg.situ_linear_beta),
                                                 ops.EXPERTS[impl](z, idx, wt, w13, w2, cfg.situ_beta,
                                                                   cfg.situ_linear_beta)))
    del w13, w2
    if dev == "cuda":
        torch.cuda.empty_cache()
    off = [op for op, cases in errs.items() if not cases or not all(c["ok"] for c in cases)]
    out: dict = {"triton_off": off, "checks": errs, "worst": {op: max((c.get("rel_err", 1.0) for c in cases), default=None)
                                                              for op, cases in errs.items()}}
    try:
        if bench:
            out["gemm_bench"] = gemm_bench()
    except Exception:
        out["gemm_bench_error"] = traceback.format_exc(limit=3)
    return out


def check(impl: str, compile_ops: bool, triton_off: tuple[str, ...] = ()) -> dict:
    """Real-size stock layers vs the float64 reference (relative L2 errors, routing agreement).

    The reference follows the model's expert choice (`forced`), so the errors measure
    numerics; `routing_rows_same` says how often the reference's own fp64 choice agreed.
    """
    from kimi_decode.runner import build
    from tests.kimi_decode.k3_reference import Reference

    cfg = k3_tp16(batch=8, layers=(6, 7), tp_sim=True, expert_impl=impl, compile_ops=compile_ops,
                  triton_off=triton_off)
    model, _ = build("stock", cfg, "cuda")
    ref = Reference(model, sim_world=cfg.sim_world, rank=cfg.rank)
    rel = lambda a, b: float((a.double() - b).norm() / b.norm())  # noqa: E731
    out: dict = {"config": f"k3_tp16 layers 6 (kda), 7 (mla), B=8, tp_sim rank 0/16, compile_ops={compile_ops}, "
                           f"triton_off={list(triton_off)}",
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


def captures(impl: str, tmp: Path, steps: int, compile_ops: bool, triton_off: tuple[str, ...] = ()) -> list[dict]:
    from tracer.capture import capture

    done = []
    for b, k in SHAPES:
        for graph in (False, True):
            name = f"k3_stock_b{b}_k{k}_{'graph' if graph else 'eager'}.json.gz"
            t0 = time.time()
            try:
                cfg = k3_tp16(batch=b, spec_tokens=k, tp_sim=True, expert_impl=impl, compile_ops=compile_ops,
                              triton_off=triton_off)
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
    ap.add_argument("--skip", nargs="*", default=[], choices=["kernels", "check", "capture", "bench"])
    ap.add_argument("--eager-ops", action="store_true", help="no torch.compile of the op groups")
    ap.add_argument("--kernels-only", action="store_true", help="only the Triton kernel checks (a child process)")
    args = ap.parse_args()
    if args.kernels_only:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernels.json").write_text(json.dumps(kernel_checks(probe_grouped_mm()), indent=1))
        return
    compile_ops = not args.eager_ops
    if compile_ops:  # a function inductor cannot compile runs eagerly instead of failing the job
        torch._dynamo.config.suppress_errors = True
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__} cuda {torch.version.cuda} on {torch.cuda.get_device_name()}", flush=True)
    impl = probe_grouped_mm()
    t0 = time.time()
    triton_off: tuple[str, ...] = ()
    if compile_ops and "kernels" not in args.skip:
        # in a child process: a kernel that faults leaves this process's CUDA context usable
        try:
            proc = subprocess.run([sys.executable, "-m", "kimi_decode.device_job", "--out", str(args.out),
                                   "--kernels-only"], capture_output=True, text=True, timeout=240)
            tail = f"exit {proc.returncode}: {proc.stderr[-4000:]}"
        except subprocess.TimeoutExpired:
            tail = "timed out after 240 s"
        try:
            kres = json.loads((args.out / "kernels.json").read_text())
            triton_off = tuple(kres["triton_off"])
        except (OSError, ValueError, KeyError):
            from kimi_decode.stock_ops import TRITON_OPS
            kres = {"error": f"kernel checks failed: {tail}"}
            triton_off = TRITON_OPS
        print("kernels:", json.dumps(kres, indent=1), f"({time.time() - t0:.0f} s)", flush=True)
        (args.out / "kernels.json").write_text(json.dumps(kres, indent=1))
    if "check" not in args.skip:
        try:
            res = check(impl, compile_ops, triton_off)
        except Exception:
            res = {"error": traceback.format_exc()}
        print("check:", json.dumps(res, indent=1), f"({time.time() - t0:.0f} s)", flush=True)
        (args.out / "check.json").write_text(json.dumps(res, indent=1))
    if "capture" not in args.skip:
        with tempfile.TemporaryDirectory() as tmp:
            info = captures(impl, Path(tmp), args.steps, compile_ops, triton_off)
            pack(Path(tmp), args.out)
        (args.out / "captures.json").write_text(json.dumps(info, indent=1))
        print(f"captures done ({time.time() - t0:.0f} s)", flush=True)
    if "bench" not in args.skip:
        from bench.decode import main as bench_main
        try:
            bench_main(["--variant", "stock", "--batch", "1", "8", "64", "--spec", "0", "7",
                        "--reps", str(args.reps), "--expert-impl", impl, "--json", str(args.out / "bench.json"),
                        "--triton-off", *triton_off] + ([] if compile_ops else ["--eager-ops"]))
        except Exception:
            traceback.print_exc()
        print(f"bench done ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
