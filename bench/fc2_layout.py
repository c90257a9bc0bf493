"""Why FC2 of the routed experts streams below the copy rate at M = 8, measured (device only).

In the H200 B = 1, k = 7 graph trace (cd24720) FC2 (moe_fc2_rows.ExpertsFC2Rows) ends up to
56 us after FC1 for ~164 MB of distinct experts' w2 slices (~3.0 TB/s), while FC1 streams its
~327 MB at ~4.0 TB/s and a read-only stream reaches 4.2-4.5 TB/s (bench/stream_bw.md). (Answer,
bench/fc2_layout.md and bench/fused_runs.md session 29: none of the causes below; FC2 alone
streams at ~90 % of the read-only rate, and in the step it is slower where the shared expert's
down GEMV runs beside it: 39-41 us after FC1 in each step's first layer, 46.5-56.4 in the
later ones.) One
difference between the two kernels is the shape of what they read: FC1 reads whole 7 KB rows
of w13, FC2 the first 192 of every 256-element (512-byte) row of w2 (the zero padding
I..Ip-1 skipped), i.e. 384 bytes out of every 512. This script separates the candidate
causes, each on cold weights (4 routings cycled, N calls in one CUDA graph, per-call median):

1. the access pattern alone: a Triton read-only stream over the same number of bytes,
   contiguous vs 3/4 of every 512-byte row (the same bytes requested);
2. FC2 as the step runs it (padded w2 [E, L, 256], I = 192) against the same kernel on a
   compact copy of w2 [E, L, 192] and `a` [P, 192] (same values, rows 384 bytes apart, no
   padding): the output must be bit-identical (same lanes, same arithmetic, other strides);
3. the grid: ExpertsFC2Rows' per_row (CTAs per row) at the default and at a count that gives
   every CTA the same number of column blocks;
4. FC2 v2 (one CTA per (row, 4-column block)) in both layouts, and at M = 1.
With --per-row C..: only ExpertsFC2Rows at M = 8 with those CTAs per row (and the formula's).

    python3 -m bench.fc2_layout --out $OUT      (writes fc2_layout.json, prints each row)
    python3 -m bench.fc2_layout --out $OUT --per-row 96 112 113 114   (fc2_per_row.json)
    python -m bench.fc2_layout --render bench/fc2_layout_h100.json > bench/fc2_layout.md   (here)
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from bench.stream_bw import _graph_us, _read_kernel   # the graph timing and the contiguous reader

MB = 1 << 20


def _row_reader():
    """A Triton read-only stream over the first `used` of every `row` fp32 of a [R, row] buffer
    (the padded w2's pattern with row = 128 fp32 = 512 B, used = 96 = 384 B); the contiguous
    reader is bench/stream_bw.py's."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_rows(x_ptr, out_ptr, rows, ROW: tl.constexpr, USED: tl.constexpr, RB: tl.constexpr):
        pid = tl.program_id(0)
        r0 = tl.arange(0, RB)[:, None]
        c = tl.arange(0, ROW)[None, :]
        acc = tl.zeros([RB, ROW], dtype=tl.float32)
        for start in range(pid * RB, rows, tl.num_programs(0) * RB):
            r = start + r0
            acc += tl.load(x_ptr + r * ROW + c, mask=(r < rows) & (c < USED), other=0.0)
        tl.store(out_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))

    return read_rows


def pattern_rows(nbytes: int, sms: int) -> list[dict]:
    """Cold read-only streams of `nbytes` requested bytes: contiguous, and 3/4 of each 512 B row."""
    read_sum, read_rows = _read_kernel(), _row_reader()
    out = torch.empty(sms * 64, dtype=torch.float32, device="cuda")
    copies = max(4, -(-(600 * MB) // nbytes))
    res = []
    xs = [torch.rand(nbytes // 4, device="cuda") for _ in range(copies)]
    us = _graph_us([lambda x=x: read_sum[(sms * 16,)](x, out, x.numel(), BLOCK=1024, num_warps=4) for x in xs])
    res.append({"what": "read-only, contiguous", "bytes": nbytes, "us": us, "tbs": nbytes / us / 1e6})
    del xs
    rows = nbytes // 384                                        # 384 bytes used of each 512
    xs = [torch.rand(rows, 128, device="cuda") for _ in range(copies)]
    for rb, warps, per_sm in ((8, 4, 16), (16, 4, 16), (32, 8, 8)):
        us = _graph_us([lambda x=x: read_rows[(sms * per_sm,)](x, out, rows, ROW=128, USED=96, RB=rb,
                                                                 num_warps=warps) for x in xs])
        res.append({"what": f"read-only, 384 of every 512 B (rows of {rb}, {warps} warps, {per_sm}/SM)",
                    "bytes": rows * 384, "us": us, "tbs": rows * 384 / us / 1e6})
    ref = xs[0][:, :96].double().sum()
    read_rows[(sms * 16,)](xs[0], out, rows, ROW=128, USED=96, RB=8, num_warps=4)
    res.append({"what": "strided reader's sum rel err vs float64",
                "rel_err": float(abs(out[: sms * 16].double().sum() - ref) / ref.abs().clamp_min(1.0))})
    del xs
    torch.cuda.empty_cache()
    return res


def _fc2_inputs(m: int) -> tuple[torch.Tensor, list, torch.Tensor, int, int]:
    """FC2's inputs at M = m on the real K3 TP16 expert weights (moe_experts.check_weights):
    (w2 [E, L, Ip], 4 routings as (int32 ids, fp32 weights), a [M·K, Ip] bf16 with zero
    padding columns, I, K). Shared by fc2_rows and per_row_sweep."""
    from kimi_decode.kernels import moe_experts as me
    dev = torch.device("cuda")
    cfg0, w13, w2 = me.check_weights(dev)
    del w13
    inter, K = cfg0.expert_local_inter, cfg0.top_k
    _, routings = me.check_inputs(cfg0, m, 7000 + m, dev)
    routings = [(i.to(torch.int32).contiguous(), w.float().contiguous()) for i, w in routings]
    act = torch.randn(m * K, w2.shape[-1], generator=torch.Generator(device=dev).manual_seed(11 + m),
                      device=dev).bfloat16()
    act[:, inter:] = 0
    return w2, routings, act, inter, K


def per_row_sweep(m: int, sms: int, counts: list[int]) -> list[dict]:
    """ExpertsFC2Rows (padded w2, one buffer) at M = m with each CTAs-per-row count in
    `counts` and the formula's, cold, outputs compared bit for bit with the formula's."""
    from cutlass import Int32
    from kimi_decode.kernels import moe_experts as me
    from kimi_decode.kernels import moe_fc2_rows as mr
    from kimi_decode.kernels._common import current_stream, ptr
    dev = torch.device("cuda")
    w2, routings, act, inter, K = _fc2_inputs(m)
    E, L, ip = w2.shape
    kern = mr.compile_rows(mr.RowsConfig(me.ExpertsConfig(L, ip, inter, K, E, torch.int32, False), 1))
    pr0 = mr.per_row(m, L, 1, sms)
    nbytes = sum(len(set(i.flatten().tolist())) for i, _ in routings) / 4 * L * inter * 2
    res, first = [], None
    # the formula's count twice: first as the warm-up (in session 29's first runs whichever
    # configuration was timed first read ~13 % slow), then timed again at the end
    for pr in [pr0] + [c for c in counts if c != pr0] + [pr0]:
        dst = torch.empty(m, L, dtype=torch.bfloat16, device=dev)

        def call(r: int, pr=pr, dst=dst) -> None:
            idx, wt = routings[r]
            kern(ptr(act), ptr(idx), ptr(wt), ptr(w2), ptr(dst), Int32(m), Int32(pr), current_stream())
        call(0)
        torch.cuda.synchronize()
        got = dst.clone()                  # routing 0's output, before the timing overwrites dst
        first = got if first is None else first
        us = _graph_us([lambda r=r: call(r % 4) for r in range(8)])
        res.append({"M": m, "per_row": pr, "formula": pr == pr0, "ctas": m * pr,
                    "max_blocks_per_cta": -(-(L // 4) // pr), "us": us, "tbs": nbytes / us / 1e6,
                    "equal_to_formula": bool(torch.equal(got, first))})
    del w2
    torch.cuda.empty_cache()
    return res


def fc2_rows(m: int, sms: int) -> list[dict]:
    """FC2 alone at M = m on the real K3 TP16 expert weights: padded vs compact w2, per_row
    variants, FC2 v2; outputs compared bit for bit against the padded step kernel."""
    import cutlass.cute as cute
    from cutlass import Int32
    from kimi_decode.kernels import moe_experts as me
    from kimi_decode.kernels import moe_fc2_rows as mr
    from kimi_decode.kernels._common import compile_options, current_stream, dummy_ptr, ptr
    dev = torch.device("cuda")
    w2, routings, act, inter, K = _fc2_inputs(m)
    E, L, ip = w2.shape
    w2c = w2[:, :, :inter].contiguous()
    actc = act[:, :inter].contiguous()
    distinct = [len(set(i.flatten().tolist())) for i, _ in routings]
    res: list[dict] = []

    def cfg(ipad: int, i: int) -> me.ExpertsConfig:
        return me.ExpertsConfig(L, ipad, i, K, E, torch.int32, False)

    def rows_kernel(c: me.ExpertsConfig):
        return mr.compile_rows(mr.RowsConfig(c, 1))

    def v2_kernel(c: me.ExpertsConfig):
        bf = dummy_ptr(torch.bfloat16)
        return cute.compile(me.ExpertsFC2v2(c), bf, dummy_ptr(torch.int32), dummy_ptr(torch.float32), bf, bf,
                            Int32(1), current_stream(), options=compile_options())

    pr0 = mr.per_row(m, L, 1, sms)
    nblk = L // 4
    waves = -(-nblk // pr0)
    pr_bal = -(-nblk // waves)          # the fewest CTAs per row with the same blocks per CTA
    variants = []
    if m >= mr.MIN_ROWS:
        kp, kc, kf = rows_kernel(cfg(ip, inter)), rows_kernel(cfg(inter, inter)), rows_kernel(cfg(ip, ip))
        for pr in sorted({pr0, pr_bal}):
            variants.append((f"rows padded I={inter} per_row={pr}", kp, act, w2, pr, inter))
            variants.append((f"rows compact I={inter} per_row={pr}", kc, actc, w2c, pr, inter))
        variants.append((f"rows padded I={ip} (all read) per_row={pr0}", kf, act, w2, pr0, ip))
    vp, vc = v2_kernel(cfg(ip, inter)), v2_kernel(cfg(inter, inter))
    variants.append((f"v2 padded I={inter}", vp, act, w2, None, inter))
    variants.append((f"v2 compact I={inter}", vc, actc, w2c, None, inter))
    outs = {}
    # the first configuration again at the end: in session 29's first run the configuration
    # timed first read ~13 % slower than the same one timed later (a warm-up effect)
    variants.append((variants[0][0] + " (again, last)",) + variants[0][1:])
    for name, kern, a, ww, pr, i in variants:
        dst = torch.empty(m, L, dtype=torch.bfloat16, device=dev)

        def call(r: int, kern=kern, a=a, ww=ww, pr=pr, dst=dst) -> None:
            idx, wt = routings[r]
            if pr is None:
                kern(ptr(a), ptr(idx), ptr(wt), ptr(ww), ptr(dst), Int32(m), current_stream())
            else:
                kern(ptr(a), ptr(idx), ptr(wt), ptr(ww), ptr(dst), Int32(m), Int32(pr), current_stream())
        call(0)
        torch.cuda.synchronize()
        outs[name] = dst.clone()
        us = _graph_us([lambda r=r: call(r % 4) for r in range(8)])
        nbytes = sum(distinct) / 4 * L * i * 2
        res.append({"M": m, "what": name, "us": us, "mb": nbytes / 1e6, "tbs": nbytes / us / 1e6,
                    "pairs": m * K, "distinct_experts": distinct})
    base = outs[variants[0][0]]
    for r in res:
        r["equal_to_first"] = bool(torch.equal(outs[r["what"]], base))
    del w2, w2c
    torch.cuda.empty_cache()
    return res


def render(runs: list[dict]) -> str:
    """bench/fc2_layout.md from one or more result files (fc2_layout.json, fc2_per_row.json)."""
    lines = ["# FC2 of the routed experts: access pattern, w2 layout, CTAs per row (GPU)", "",
             "Written by `bench/fc2_layout.py --render` from its device results (the script's docstring says",
             "what each row measures). Cold weights, 4 routings cycled, 8 calls in one CUDA graph,",
             "per-call median of 20 replays; MB = the distinct experts' w2 bytes read (I = 192 columns,",
             "or 256 where all are read); TB/s = MB / µs.", ""]
    for res in runs:
        lines += [f"## {res['date']}, commit {res['commit'][:12]}, {res['gpu']} ({res['sms']} SMs)", "",
                  f"- copy, 2 GiB, read + write counted: {res['copy_2gib_tbs']:.2f} TB/s", ""]
        if res.get("pattern"):
            lines += ["| read-only stream | MB | µs | TB/s |", "|---|---|---|---|"]
            for r in res["pattern"]:
                if "us" in r:
                    lines.append(f"| {r['what']} | {r['bytes'] / 1e6:.1f} | {r['us']:.1f} | {r['tbs']:.2f} |")
                else:
                    lines.append(f"| {r['what']}: {r['rel_err']:.1e} | | | |")
            lines.append("")
        if res.get("fc2"):
            lines += ["| M | FC2 | MB | µs | TB/s | output equal to the first row's |", "|---|---|---|---|---|---|"]
            for r in res["fc2"]:
                lines.append(f"| {r['M']} | {r['what']} | {r['mb']:.1f} | {r['us']:.1f} | {r['tbs']:.2f} | "
                             f"{'yes' if r['equal_to_first'] else 'NO'} |")
            lines.append("")
        if res.get("per_row"):
            lines += ["| M | CTAs per row | CTAs | most blocks per CTA | µs | TB/s | formula's count | output equal to the formula's |",
                      "|---|---|---|---|---|---|---|---|"]
            for r in res["per_row"]:
                lines.append(f"| {r['M']} | {r['per_row']} | {r['ctas']} | {r['max_blocks_per_cta']} | {r['us']:.1f} | "
                             f"{r['tbs']:.2f} | {'yes' if r['formula'] else ''} | "
                             f"{'yes' if r['equal_to_formula'] else 'no'} |")
            lines.append("")
        for note in res.get("notes", []):
            lines.append(f"- {note}")
        if res.get("notes"):
            lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--render", type=Path, nargs="*",
                    help="print the markdown of these result files, each one run or a list of runs (no GPU)")
    ap.add_argument("--rows", type=int, nargs="*", default=[8, 2, 1])
    ap.add_argument("--per-row", type=int, nargs="*", default=[],
                    help="only sweep ExpertsFC2Rows' CTAs per row at M = 8 over these counts")
    args = ap.parse_args()
    if args.render:
        runs = [json.loads(p.read_text()) for p in args.render]
        print(render([r for x in runs for r in (x if isinstance(x, list) else [x])]))
        return
    if args.out is None:
        raise SystemExit("fc2_layout: --out is needed (or --render FILE ..)")
    args.out.mkdir(parents=True, exist_ok=True)
    from bench.decode import copy_bandwidth
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "commit": os.environ.get("DECODESCOPE_COMMIT", "unknown"), "gpu": torch.cuda.get_device_name(),
                 "torch": torch.__version__, "sms": sms, "copy_2gib_tbs": copy_bandwidth() / 1e12}
    if args.per_row:
        res["per_row"] = per_row_sweep(8, sms, args.per_row)
        for r in res["per_row"]:
            print(r, flush=True)
        (args.out / "fc2_per_row.json").write_text(json.dumps(res, indent=1))
        return
    res["pattern"] = pattern_rows(164 * 10**6 // 384 * 384, sms)
    for r in res["pattern"]:
        print(r, flush=True)
    res["fc2"] = []
    for m in args.rows:
        rows = fc2_rows(m, sms)
        res["fc2"] += rows
        for r in rows:
            print({k: v for k, v in r.items() if k != "distinct_experts"}, flush=True)
    (args.out / "fc2_layout.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
