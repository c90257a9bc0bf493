"""Kernel "gemv_tuned" on the CPU (kernels/gemv.py TUNE_CONFIGS, TUNED, TUNED_MULTI):
- every configuration compiles to sm_90a at every K3 TP16 shape that runs the plain layout at
  M = 1 (gemv: in_proj, o_proj, q_b; gemv_multi: the MoE front with the router, the MLA front)
  with the loads it exists for: per unrolled slice P weight loads (128-bit) + 1 x load per lane,
  the L1 hint on exactly the weight loads, no local memory, and ptxas (where installed) under
  the register cap (255; 64 with the router's 4 CTAs per SM);
- a TUNED / TUNED_MULTI entry changes the compiled config gemv() / gemv_multi use at M = 1
  only while set_tuned(True), and fused.enable() sets that flag exactly when "gemv" and
  "gemv_tuned" are both enabled (compile_for emulated: no GPU here).
Bit-equality of every config with the default is asserted on the GPU by check_sweep.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

from tests.kimi_decode.ptxas_tool import ptxas_path
from kimi_decode.config import k3_tp16, tiny  # noqa: E402
from kimi_decode.kernels import _common  # noqa: E402
from kimi_decode.kernels import gemv as kg  # noqa: E402
from kimi_decode.kernels import gemv_multi as gm  # noqa: E402
from kimi_decode.kernels import router_fast as rf  # noqa: E402

bf, f32 = torch.bfloat16, torch.float32
P = _common.dummy_ptr
K3 = k3_tp16()
PLAIN = {"in_proj": (K3.in_proj_rows, K3.hidden), "o_proj": (K3.hidden, K3.mla_local_heads * K3.v_head_dim),
         "q_b": (1152, K3.q_lora_rank)}


def _ptx(tmp_path: Path, kernel: object, *args: object, max_spill: int = 0) -> tuple[str, int | None]:
    cute.compile(kernel, *args, _common.current_stream(),
                 options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}")
    files = list(tmp_path.glob("*.ptx"))
    assert len(files) == 1, files
    regs = None
    ptxas = ptxas_path()
    if ptxas:
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(files[0]), "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
        regs = max(int(v) for v in re.findall(r"Used (\d+) registers", info))
        spill = max(int(v) for v in re.findall(r"(\d+) bytes spill stores", info))
        # the MoE front's existing kernel (router + 2 segments, ≤ 64 registers) already spills
        # 16 bytes (ptxas 13.0, default config): no tuned config may spill more
        assert spill <= max_spill, info
    return files[0].read_text(), regs


def _loads(ptx: str, hint: str) -> tuple[int, int]:
    """(unhinted 128-bit loads, weight loads carrying the L1 hint)."""
    tag = {"no_allocate": "L1::no_allocate", "evict_first": "L1::evict_first"}.get(hint)
    hinted = len(re.findall(rf"ld\.global\.{re.escape(tag)}\S*\.v4", ptx)) if tag else 0
    return ptx.count("ld.global.v4"), hinted


def test_k3_shapes_are_the_configs() -> None:
    assert PLAIN["in_proj"] == (3216, 7168) and PLAIN["o_proj"] == (7168, 768)
    assert K3.q_lora_rank == 1536 and K3.latent_dim == 3584 and K3.qkv_a_rows == 2112


# only the (shape, config) pairs the sweep times (sweep_configs drops configs that compile to
# an earlier one at that K, or that do not fit it)
PLAIN_CASES = [(s, c) for s in sorted(PLAIN) for c in sorted(kg.TUNE_CONFIGS) if c in kg.sweep_configs(PLAIN[s][1])]
MULTI_CASES = [(case, c) for case in ("moe_front", "mla_front") for c in sorted(kg.TUNE_CONFIGS)
               if c in kg.sweep_configs(K3.hidden, case == "moe_front", multi=True)]


@pytest.mark.parametrize("shape,name", PLAIN_CASES)
def test_plain_configs_compile(tmp_path: Path, shape: str, name: str) -> None:
    n, k = PLAIN[shape]
    f = kg.tune_fields(kg.TUNE_CONFIGS[name], k)
    cfg = kg.GemvConfig(n, k, 1, **f)
    ptx, regs = _ptx(tmp_path, kg.Gemv(cfg), P(bf), P(bf), P(bf))
    assert ".target sm_90a" in ptx and "ld.local" not in ptx and "st.local" not in ptx
    if cfg.cols:                                      # split-K at M = 1: gemv_variants' kernel
        assert ptx.count("bar.sync") == 1 and "ld.global.v4" in ptx and "kernel_splitk" in ptx
        assert kg.Gemv(cfg).ctas == -(-n // cfg.cols) and (regs is None or regs <= 255)
        return
    assert "bar.sync" not in ptx                      # warps independent, as the plain kernel
    assert re.search(rf"\.reqntid {cfg.warps * 32}, 1, 1", ptx) or f".maxntid {cfg.warps * 32}" in ptx \
        or "reqntid" not in ptx
    S, U, Pw = k // 256, cfg.unroll, cfg.per_warp
    plain, hinted = _loads(ptx, cfg.hint)
    body = min(U, S)                                  # slices per unrolled loop body
    w_loads, x_loads = Pw * body, body
    if S % U == 0 or U >= S:                          # no remainder loop
        assert (plain, hinted) == ((x_loads, w_loads) if cfg.hint else (x_loads + w_loads, 0)), (plain, hinted)
    else:                                             # unrolled body with an exit inside, or + remainder
        assert plain + hinted >= x_loads + w_loads and (hinted == 0) == (not cfg.hint)
    assert kg.Gemv(cfg).ctas == -(-n // (cfg.warps * Pw))
    if regs is not None:
        assert regs <= 255


@pytest.mark.parametrize("case,name", MULTI_CASES)
def test_multi_configs_compile(tmp_path: Path, case: str, name: str) -> None:
    router = case == "moe_front"
    k = K3.hidden
    f = kg.tune_fields(kg.TUNE_CONFIGS[name], k)
    if router:
        rcfg = rf.RouterFastConfig(k, K3.num_experts, K3.top_k, 1, K3.routed_scaling)
        cfg = gm.MultiConfig(k, 1, (K3.latent_dim, 2 * K3.shared_local_inter), rcfg, **f)
    else:
        cfg = gm.MultiConfig(k, 1, (K3.qkv_a_rows, K3.mla_local_heads * K3.v_head_dim), **f)
    ptx, regs = _ptx(tmp_path, gm.GemvMulti(cfg), P(bf), P(bf), P(bf), P(bf), P(bf), P(bf), P(bf), P(bf),
                     P(f32), P(f32), P(torch.int32), P(torch.int64), P(f32), max_spill=16 if router else 0)
    assert "ld.local" not in ptx and "st.local" not in ptx
    plain, hinted = _loads(ptx, cfg.hint)
    U, Pw = cfg.unroll, cfg.per_warp                  # 28 slices per lane
    segs = 2
    x_loads, w_loads = segs * U, segs * Pw * U
    want = (x_loads, w_loads) if cfg.hint else (x_loads + w_loads, 0)
    router_loads = 2 * 7 if router else 0             # router_fast's 7 weight + 7 y loads (no hint)
    if 28 % U == 0:
        assert (plain - router_loads, hinted) == want, (plain, hinted)
    else:
        assert plain - router_loads + hinted >= sum(want) and (hinted == 0) == (not cfg.hint)
    if router:
        assert ".minnctapersm 4" in ptx
    if regs is not None:
        assert regs <= (64 if router else 255), regs


# ---- table lookup and fused.enable() wiring (compile_for emulated) -------------------------

def _record(monkeypatch, module) -> list:
    seen: list = []

    def compile_for(cfg):
        seen.append(cfg)
        return lambda *a: None
    monkeypatch.setattr(module, "compile_for", compile_for)
    return seen


def test_table_entry_changes_the_gemv_config(monkeypatch) -> None:
    seen = _record(monkeypatch, kg)
    monkeypatch.setattr(kg, "_tuned_on", False)
    monkeypatch.setitem(kg.TUNED, (3216, 7168), {"per_warp": 2, "unroll": 8})
    monkeypatch.setitem(kg.TUNED, (7168, 768), {"unroll": 0})
    x, w, wo = torch.zeros(1, 7168, dtype=bf), torch.zeros(3216, 7168, dtype=bf), torch.zeros(7168, 768, dtype=bf)
    kg.gemv(x, w)
    assert seen[-1] == kg.GemvConfig(3216, 7168, 1)                     # flag off: default
    kg.set_tuned(True)
    kg.gemv(x, w)
    assert seen[-1] == kg.GemvConfig(3216, 7168, 1, per_warp=2, unroll=8)
    kg.gemv(torch.zeros(1, 768, dtype=bf), wo)
    assert seen[-1] == kg.GemvConfig(7168, 768, 1, unroll=3)           # "full": all 3 slices
    kg.gemv(torch.zeros(1, 1536, dtype=bf), torch.zeros(1152, 1536, dtype=bf))
    assert seen[-1] == kg.GemvConfig(1152, 1536, 1)                    # no entry: default
    kg.gemv(x, w, tune={})
    assert seen[-1] == kg.GemvConfig(3216, 7168, 1)                    # explicit tune wins
    kg.gemv(torch.zeros(2, 7168, dtype=bf), w)
    assert seen[-1].cols == kg.SPLITK_COLS and seen[-1].per_warp == 1  # M = 2: split-K, untouched
    monkeypatch.setitem(kg.TUNED, (3216, 7168), {"cols": 4, "kwarps": 4})
    kg.gemv(x, w)
    assert seen[-1] == kg.GemvConfig(3216, 7168, 1, cols=4, kwarps=4)  # split-K at M = 1


def test_table_entry_changes_the_multi_config(monkeypatch) -> None:
    seen = _record(monkeypatch, gm)
    monkeypatch.setattr(kg, "_tuned_on", False)
    D = K3.hidden
    monkeypatch.setitem(kg.TUNED_MULTI, (D, (2112, 768), False), {"per_warp": 2, "hint": "no_allocate"})
    monkeypatch.setitem(kg.TUNED_MULTI, (D, (3584, 768), True), {"unroll": 8})
    y = torch.zeros(1, D, dtype=bf)
    ws = [torch.zeros(2112, D, dtype=bf), torch.zeros(768, D, dtype=bf)]
    gm.gemv_multi(y, ws)
    assert seen[-1] == gm.MultiConfig(D, 1, (2112, 768))
    kg.set_tuned(True)
    gm.gemv_multi(y, ws)
    assert seen[-1] == gm.MultiConfig(D, 1, (2112, 768), per_warp=2, hint="no_allocate")
    e = K3.num_experts
    gm.route_and_project(y, torch.zeros(e, D, dtype=bf), torch.zeros(e, dtype=f32), K3.top_k, 2.5,
                         torch.zeros(1, dtype=torch.int32),
                         [torch.zeros(3584, D, dtype=bf), torch.zeros(768, D, dtype=bf)])
    assert seen[-1].router is not None and seen[-1].unroll == 8 and seen[-1].per_warp == 1
    gm.gemv_multi(torch.zeros(2, D, dtype=bf), ws)
    assert seen[-1] == gm.MultiConfig(D, 2, (2112, 768))                # M = 2: never tuned
    with pytest.raises(ValueError):
        gm.gemv_multi(y, ws, tune={"cols": 4})                         # plain layout only


def test_sweep_configs() -> None:
    # o_proj (3 slices per lane): unroll 4 already issues all 3 loads, so every deeper unroll
    # is the default kernel again and is not swept twice; q_b (6 slices): u7 = all 6
    assert not {"u7", "u8", "u14", "full"} & set(kg.sweep_configs(768))
    assert "u7" in kg.sweep_configs(1536) and "full" not in kg.sweep_configs(1536)
    assert "full" not in kg.sweep_configs(7168) and {"u7", "u8", "u14", "p2u7"} <= set(kg.sweep_configs(7168))
    assert "p4" not in kg.sweep_configs(1536) and "p4" in kg.sweep_configs(7168)
    # split-K (not bit-identical: another summation order) only for gemv(), not gemv_multi
    assert {"sk4", "sk4w4", "sk2"} <= set(kg.sweep_configs(768))
    assert not any(f.get("cols") for f in kg.sweep_configs(7168, multi=True).values())
    assert not any(f.get("cols") for f in kg.sweep_configs(7168, router=True, multi=True).values())
    assert [c for c, f in kg.TUNE_CONFIGS.items() if not kg.exact(f)] == ["sk4", "sk4w4", "sk2"]
    assert not any(f.get("warps", 8) != 8 for f in kg.sweep_configs(7168, router=True).values())
    assert "w4" in kg.sweep_configs(7168) and kg.TUNE_CONFIGS["default"] == {}
    for f in kg.TUNE_CONFIGS.values():
        kg.Gemv(kg.GemvConfig(3216, 7168, 1, **kg.tune_fields(f, 7168)))      # valid fields


def test_gemv_tuned_is_registered() -> None:
    from kimi_decode.kernels import CHECK_MODULES, KERNELS, checks
    assert "gemv_tuned" in KERNELS and CHECK_MODULES["gemv_tuned"] == "gemv"
    assert "gemv_tuned" in checks.CHECKS


def test_enable_sets_the_tuned_flag(monkeypatch) -> None:
    import kimi_decode.fused as fused_mod
    import kimi_decode.kernels as kernels_pkg
    from kimi_decode.fused import FusedDecoder
    from kimi_decode.stock import StockDecoder
    monkeypatch.setattr(kg, "_tuned_on", False)
    monkeypatch.setattr(fused_mod, "_kernels_usable", lambda dev: True)
    monkeypatch.setattr(fused_mod, "VERIFIED", fused_mod.VERIFIED | {"gemv_tuned"})
    monkeypatch.setattr(kernels_pkg, "applicable", lambda name, cfg: True)
    fused = FusedDecoder.from_stock(StockDecoder(tiny(layers=(3, 4), batch=1)))
    for on, want in (({"gemv", "gemv_tuned"}, True), ({"gemv"}, False), ({"gemv_tuned"}, False),
                     ({"gemv", "gemv_tuned"}, True), (set(), False)):
        fused.enable(frozenset(on))
        assert kg.tuned_on() is want, on
    monkeypatch.setattr(fused_mod, "VERIFIED", fused_mod.VERIFIED - {"gemv_tuned"})
    fused.enable(frozenset({"gemv", "gemv_tuned"}))                    # not verified: off
    assert kg.tuned_on() is False


def test_check_sweep_runs_emulated(monkeypatch) -> None:
    """check_sweep's own logic on the CPU (kernels and timer emulated: the products in fp32,
    the router as its torch contract, time_us = 1 µs per config): one row per shape, every
    swept config present, ok, a "best" config."""
    from kimi_decode import stock_ops
    from kimi_decode.kernels import checks

    def mm(x, w):
        return (x.float() @ w.float().t()).to(torch.bfloat16)

    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(checks, "_sync", lambda: None)
    monkeypatch.setattr(checks, "time_us", lambda fn: (fn(), 1.0)[1])
    monkeypatch.setattr(kg, "gemv", lambda x, w, out=None, *, tune=None, **k: mm(x, w))
    monkeypatch.setattr(gm, "gemv_multi", lambda x, ws, *, tune=None, **k: [mm(x, w) for w in ws])

    def rap(y, w_gate, bias, top_k, scaling, counter, ws, *, tune=None, **k):
        ids, wt = stock_ops.route(y.float() @ w_gate.float().t(), bias, top_k, scaling)
        return ids, wt, [mm(y, w) for w in ws]
    monkeypatch.setattr(gm, "route_and_project", rap)
    rows = kg.check_sweep(timing=True)
    assert [r["case"] for r in rows] == ["in_proj", "o_proj", "q_b", "moe_front", "mla_front"]
    for r in rows:
        assert r["ok"], r
        k = r["K"]
        confs = kg.sweep_configs(k, r.get("router", False), multi=r["case"].endswith("front"))
        assert all(f"{c}_us" in r for c in confs) and r["best"] in confs and r["default_us"] == 1.0
