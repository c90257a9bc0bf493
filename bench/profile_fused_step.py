"""One fused decode step under Nsight Compute, for per-kernel hardware counters (device only).

Builds the fused step (K3 TP16 rank 0, layers 4-7, tp_sim, B and k from the command line),
runs two warm-up steps (compiles every kernel), then one step between
cudaProfilerStart/Stop, so `ncu --profile-from-start off` measures exactly that step's kernels:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section LaunchStats --section Occupancy python3 -m bench.profile_fused_step --batch 1

The kernel set is this run's (the kernels listed with --kernels, default fused.DEFAULT_KERNELS).
"""
from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--spec", type=int, default=0)
    ap.add_argument("--kernels", nargs="*", help="fused kernels on (default: fused.DEFAULT_KERNELS)")
    args = ap.parse_args()
    import kimi_decode.fused as fused_mod
    from kimi_decode.config import k3_tp16
    from kimi_decode.fused import FusedDecoder
    from kimi_decode.runner import build
    if args.kernels is not None:
        fused_mod.VERIFIED = fused_mod.DEFAULT_KERNELS = frozenset(args.kernels)
    cfg = k3_tp16(batch=args.batch, spec_tokens=args.spec, layers=(4, 5, 6, 7), tp_sim=True,
                  compile_ops=False)
    stock, _ = build("stock", cfg, "cuda")
    model = FusedDecoder.from_stock(stock)
    print("kernels on:", sorted(model.kernels), flush=True)
    inputs = stock.make_inputs(seed=1)
    with torch.no_grad():
        for _ in range(2):
            model(*inputs)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        model(*inputs)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
