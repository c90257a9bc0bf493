"""CPU tests of the MLA glue kernels (kimi_decode/kernels/mla_glue.py: uk_insert, uv_gate).

Oracles:
- both kernels compile to sm_90a PTX at the K3 TP16 shapes (H = 6, nope = 128, rope = 64,
  c = 512, vd = 128; M = 1 and M = 8 with T = 1 and T = 8) with the instructions they rely
  on (128-bit global loads and stores, butterfly shuffles, bf16 rounding; uv: the sigmoid's
  ex2 and rcp), no local-memory arrays, no shuffle inside a forward branch (a full-warp shuffle
  in a divergent branch deadlocked the GPU once) and warp_idx()'s index shuffles before the
  first branch;
- `reference_uk` / `reference_uv` (float64 statements) equal the stock op pairs (torch.bmm +
  OpSet.kv_insert; torch.bmm + sigmoid_gate) on random CPU inputs, small and K3 shapes, and
  the cache rows they write equal stock's exactly (so the device check's references are right);
- a float64 emulation of the kernels' thread mapping (lane → vector and row offset, passes,
  warp partial sums, the epilogue's rounding points) equals the stock op pairs: every weight
  element is used exactly once and lands in the right output column, checked without the DSL.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

from cutlass import Int32  # noqa: E402

from kimi_decode import stock_ops  # noqa: E402
from kimi_decode.config import k3_tp16  # noqa: E402
from kimi_decode.kernels import _common  # noqa: E402
from kimi_decode.kernels.mla_glue import (THREADS, UK_COLS, UV_COLS, VEC, WARPS, GlueConfig,  # noqa: E402
                                          MLAGlue, can_implement, can_implement_uk, can_implement_uv,
                                          config_uk, config_uv, reference_uk, reference_uv, stock_uk,
                                          stock_uv)

bf = torch.bfloat16
P = _common.dummy_ptr


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def ptx_of(tmp_path: Path, cfg: GlueConfig) -> str:
    opts = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    cute.compile(MLAGlue(cfg), P(bf), P(bf), P(bf), P(bf), P(bf), P(bf), P(bf), P(torch.int64), Int32(1),
                 _common.current_stream(), options=opts)
    files = list(tmp_path.glob("*.ptx"))
    assert len(files) == 1, files
    return files[0].read_text()


def shuffles_in_branches(ptx: str) -> list[str]:
    """shfl.sync instructions between a predicated FORWARD branch and its target label (as
    tests/kimi_decode/test_kernels_compile.py, but a loop's backward branch is not an `if`:
    its target label comes before it)."""
    lines = [line.strip() for line in ptx.splitlines()]
    where = {s[:-1]: i for i, s in enumerate(lines) if s.startswith("$L") and s.endswith(":")}
    found, target = [], None
    for i, s in enumerate(lines):
        if target is None and s.startswith("@%p") and " bra " in s:
            t = s.split()[-1].rstrip(";")
            if where.get(t, -1) > i:
                target = t
        elif target is not None and s == f"{target}:":
            target = None
        elif target is not None and s.startswith("shfl.sync"):
            found.append(s)
    return found


def idx_shuffles_after_first_branch(ptx: str) -> list[str]:
    lines = [line.strip() for line in ptx.splitlines()]
    first = next(i for i, s in enumerate(lines) if " bra " in s)
    return [s for s in lines[first:] if s.startswith("shfl.sync.idx")]


def k3_dims(bsz: int = 1, k: int = 0) -> dict:
    cfg = k3_tp16(batch=bsz, spec_tokens=k)
    return dict(cfg=cfg, H=cfg.mla_local_heads, T=cfg.tokens_per_seq, nope=cfg.qk_nope_dim,
                rope=cfg.qk_rope_dim, c=cfg.kv_lora_rank, vd=cfg.v_head_dim, A=cfg.qkv_a_rows,
                rope_off=cfg.q_lora_rank + cfg.kv_lora_rank)


def common_checks(ptx: str) -> None:
    assert ".target sm_90a" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert "ld.global.v4" in ptx                  # 128-bit weight / activation loads
    assert "st.shared.v4" in ptx                  # activations staged as fp32 vectors
    assert "shfl.sync.bfly" in ptx
    assert "bar.sync" in ptx
    assert "cvt.rn.bf16.f32" in ptx               # the bmm's bf16 rounding
    assert not shuffles_in_branches(ptx)
    assert not idx_shuffles_after_first_branch(ptx)


@pytest.mark.parametrize("bsz,k", [(1, 0), (8, 0), (1, 7)])
def test_uk_compiles(tmp_path: Path, bsz: int, k: int) -> None:
    d = k3_dims(bsz, k)
    M = bsz * d["T"]
    ptx = ptx_of(tmp_path, config_uk(M, d["T"], d["H"], d["nope"], d["rope"], d["c"], d["A"], d["rope_off"]))
    common_checks(ptx)
    assert ptx.count("st.global.v4") >= 3        # ckv, q rope, a rope: 128-bit copies
    assert "ld.global.b32" in ptx or "ld.global.u32" in ptx or "ld.global.b64" in ptx  # pos on the device
    assert ptx.count("shfl.sync.bfly") == M * VEC * 2   # G = 4: two butterfly steps per (m, column)


@pytest.mark.parametrize("m", [1, 8])
def test_uv_compiles(tmp_path: Path, m: int) -> None:
    d = k3_dims()
    ptx = ptx_of(tmp_path, config_uv(m, d["H"], d["c"], d["vd"]))
    common_checks(ptx)
    assert "ex2" in ptx and "rcp.rn.f32" in ptx  # σ(g) = 1 / (1 + exp(-g))
    # y and σ round with cvt.rn.bf16.f32; the product bf16(fp32(y)·fp32(σ)) is exact in fp32
    # before its rounding, so the compiler may emit it as mul.bf16 (round-to-nearest): same bits
    assert ptx.count("cvt.rn.bf16.f32") + ptx.count("mul.bf16") + ptx.count("mul.rn.bf16") >= 3
    assert ptx.count("shfl.sync.bfly") == m * VEC * 4   # G = 16: four butterfly steps


def test_can_implement() -> None:
    d = k3_dims()
    args = (d["H"], d["nope"], d["rope"], d["c"], d["vd"], d["A"], d["rope_off"], (bf, bf))
    assert can_implement(1, 1, *args) and can_implement(8, 1, *args) and can_implement(8, 8, *args)
    assert not can_implement(9, 1, *args)                     # M ≤ 8
    assert not can_implement(6, 4, *args)                     # T | M
    assert not can_implement(1, 1, *args[:-1], (bf, torch.float32))
    assert not can_implement_uk(1, 1, 6, 128, 64, 512, 2112, 2052, (bf,))   # misaligned rope slice
    assert not can_implement_uk(1, 1, 6, 128, 64, 512, 2112, 2056, (bf,))   # past a's row
    assert not can_implement_uk(1, 1, 6, 100, 64, 512, 2112, 2048, (bf,))   # passes must cover nope
    assert not can_implement_uk(1, 1, 6, 128, 64, 520, 2112, 2048, (bf,))   # c % 64
    assert not can_implement_uv(1, 6, 512, 120, (bf,))                      # vd % 16
    for cfg in (config_uk(8, 8, 6, 128, 64, 512, 2112, 2048), config_uv(8, 6, 512, 128)):
        assert cfg.passes * WARPS * cfg.group == cfg.k and cfg.vpr * cfg.group == 32
        assert cfg.n % cfg.cols == 0


def inputs(bsz: int, T: int, H: int, nope: int, rope: int, c: int, vd: int, A: int, C: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    M = bsz * T
    rnd = lambda *s, sc=1.0: (torch.randn(*s, generator=gen) * sc).to(bf)  # noqa: E731
    return dict(q=rnd(M, H, nope + rope), a=rnd(M, A), ckv=rnd(M, c), w_uk_t=rnd(H, nope, c, sc=c ** -0.5),
                w_uv=rnd(H, c, vd, sc=c ** -0.5), cache=rnd(bsz, C, c + rope), o_lat=rnd(bsz, T * H, c),
                g=rnd(M, H * vd, sc=2.0))


SMALL = dict(H=2, nope=16, rope=8, c=32, vd=16, A=64, rope_off=56)   # a = [q_a 24 | ckv 32 | rope 8]


@pytest.mark.parametrize("shape,bsz,k", [("small", 2, 1), ("k3", 1, 0), ("k3", 1, 7), ("k3", 8, 0)])
def test_reference_uk_matches_stock(shape: str, bsz: int, k: int) -> None:
    if shape == "small":
        d = dict(SMALL, T=k + 1, cfg=k3_tp16(batch=bsz, spec_tokens=k))
    else:
        d = k3_dims(bsz, k)
    T = d["T"]
    pos_i = 37
    C = pos_i + T + 5
    x = inputs(bsz, T, d["H"], d["nope"], d["rope"], d["c"], d["vd"], d["A"], C, seed=10 * bsz + k)
    opset = stock_ops.OpSet(d["cfg"])
    cache_s = x["cache"].clone()
    pos = torch.tensor([pos_i], dtype=torch.int64)
    with torch.no_grad():
        qf_s = stock_uk(x["q"], x["a"], x["ckv"], x["w_uk_t"], cache_s, pos, T, d["rope_off"], opset)
    qf_r, cache_r = reference_uk(x["q"], x["a"], x["ckv"], x["w_uk_t"], x["cache"], pos_i, T, d["rope_off"])
    c = d["c"]
    assert qf_s.shape == qf_r.shape == (bsz, T * d["H"], c + d["rope"])
    e = rel(qf_s[..., :c], qf_r[..., :c])
    assert e <= 4e-3, e                                     # bf16 rounding of q_lat only
    assert torch.equal(qf_s[..., c:].double(), qf_r[..., c:])
    assert torch.equal(cache_s.double(), cache_r)           # the insert is a copy: exact
    assert not torch.equal(cache_r, x["cache"].double())    # and it did write
    _, cache_r2 = reference_uk(x["q"], x["a"], x["ckv"], x["w_uk_t"], x["cache"], pos_i + 1, T, d["rope_off"])
    assert not torch.equal(cache_r2, cache_r)               # pos matters


@pytest.mark.parametrize("shape,bsz,k", [("small", 2, 1), ("k3", 1, 0), ("k3", 1, 7), ("k3", 8, 0)])
def test_reference_uv_matches_stock(shape: str, bsz: int, k: int) -> None:
    d = dict(SMALL, T=k + 1) if shape == "small" else k3_dims(bsz, k)
    T = d["T"]
    x = inputs(bsz, T, d["H"], d["nope"], d["rope"], d["c"], d["vd"], d["A"], 4, seed=20 * bsz + k)
    with torch.no_grad():
        o_s = stock_uv(x["o_lat"], x["w_uv"], x["g"], stock_ops.sigmoid_gate)
    o_r = reference_uv(x["o_lat"], x["w_uv"], x["g"])
    assert o_s.shape == o_r.shape == (bsz * T, d["H"] * d["vd"])
    e = rel(o_s, o_r)
    assert e <= 8e-3, e                                     # three bf16 roundings
    wrong = reference_uv(x["o_lat"], x["w_uv"], -x["g"])    # the gate matters
    assert rel(o_s, wrong) > 0.1


def emulate_tile_gemm(xm: torch.Tensor, w: torch.Tensor, cols: int) -> torch.Tensor:
    """float64 emulation of MLAGlue.load_w + gemm_tile + the epilogue's warp sum for one head:
    xm [M, K], w [K, N] -> the fp32-order-free dot products [M, N], built only from the
    kernel's index formulas; also asserts every weight element is read exactly once."""
    K, N = w.shape
    M = xm.shape[0]
    vpr = cols // VEC
    G = 32 // vpr
    span = WARPS * G
    passes = K // span
    used = torch.zeros(K, N, dtype=torch.int64)
    out = torch.zeros(M, N, dtype=torch.float64)
    for ct in range(N // cols):
        red = torch.zeros(WARPS, M, cols, dtype=torch.float64)
        for tid in range(THREADS):
            warp, lane = tid // 32, tid % 32
            v, rl = lane // G, lane % G
            for i in range(passes):
                r = i * span + warp * G + rl
                col0 = (ct * vpr + v) * VEC
                used[r, col0:col0 + VEC] += 1
                # butterfly over the G lanes of the vector group then lane rl = 0 stores:
                # the same as summing every lane's contribution into red[warp, m, v·8 + e]
                red[warp, :, v * VEC:(v + 1) * VEC] += xm[:, r, None] * w[r, col0:col0 + VEC][None, :]
        for i in range(M * cols):                       # epilogue: thread i of `range(tid, M·COLS, 256)`
            m, col = i // cols, i % cols
            out[m, ct * cols + col] = red[:, m, col].sum()
    assert torch.equal(used, torch.ones_like(used))
    return out


def test_emulated_mapping_matches_stock() -> None:
    """The kernels' thread mapping, emulated in float64 with their rounding points, against
    the stock op pairs at K3 head shapes (2 heads, M = 2: the mapping is per head)."""
    d = k3_dims()
    H, M, T = 2, 2, 1
    x = inputs(M, T, H, d["nope"], d["rope"], d["c"], d["vd"], d["A"], 8, seed=5)
    # uk: q_lat columns
    q_lat = torch.stack([emulate_tile_gemm(x["q"][:, h, :d["nope"]].double(), x["w_uk_t"][h].double(), UK_COLS)
                         for h in range(H)], 1).to(bf)
    ref = torch.bmm(x["q"][..., :d["nope"]].transpose(0, 1), x["w_uk_t"]).transpose(0, 1)
    assert rel(q_lat, ref) <= 4e-3
    assert float((q_lat == ref).float().mean()) > 0.9
    # uv: o = bf16(bf16(y) · bf16(σ(g)))
    ol = x["o_lat"].reshape(M, H, d["c"])
    y = torch.stack([emulate_tile_gemm(ol[:, h].double(), x["w_uv"][h].double(), UV_COLS) for h in range(H)], 1)
    y = y.reshape(M, H * d["vd"]).to(bf).float()
    s = torch.sigmoid(x["g"].float()).to(bf).float()
    o = (y * s).to(bf)
    o_s = stock_uv(x["o_lat"], x["w_uv"], x["g"], stock_ops.sigmoid_gate)
    assert rel(o, o_s) <= 4e-3
    assert float((o == o_s).float().mean()) > 0.9


def test_shuffle_scanner_can_fail() -> None:
    """The PTX scan flags a shuffle inside an `if` and ignores a loop's backward branch."""
    bad = "@%p1 bra $L__BB0_2;\nshfl.sync.bfly.b32 %r1, %r2, 1, 31, -1;\n$L__BB0_2:\nret;"
    loop = "$L__BB0_1:\nadd.s32 %r1, %r1, 1;\n@%p1 bra $L__BB0_1;\nshfl.sync.bfly.b32 %r1, %r2, 1, 31, -1;"
    assert shuffles_in_branches(bad) and not shuffles_in_branches(loop)


def _emulate_uk(q, a, ckv, w_uk_t, cache, pos, T, rope_off):
    """The uk_insert contract in torch (bf16 q_lat from a float64 product; copies)."""
    nope, c = w_uk_t.shape[1:]
    rope = cache.shape[-1] - c
    B = cache.shape[0]
    q_lat = torch.einsum("mhk,hkj->mhj", q[..., :nope].double(), w_uk_t.double()).to(bf)
    q_full = torch.cat([q_lat, q[..., nope:]], -1)
    p = int(pos.item())
    rows = torch.cat([ckv, a[:, rope_off:rope_off + rope]], -1).reshape(B, T, c + rope)
    cache[:, p:p + T] = rows
    return q_full.reshape(B, -1, c + rope).to(torch.bfloat16)


def _emulate_uv(o_lat, w_uv, g):
    """uv_gate's contract: bf16(bf16(o_lat @ w_uv) · bf16(σ(g))) (test_kernel_mla_attend uses it too)."""
    H, c, vd = w_uv.shape
    M = g.shape[0]
    y = torch.einsum("mhk,hkj->mhj", o_lat.reshape(M, H, c).double(), w_uv.double()).reshape(M, -1)
    return (y.to(bf).float() * torch.sigmoid(g.float()).to(bf).float()).to(bf)


@pytest.fixture
def emulated(monkeypatch):
    import kimi_decode.kernels.mla_glue as mg
    from kimi_decode.kernels import checks
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(stock_ops, "maybe_compiled", lambda fn, enabled: fn)   # no inductor on CPU here
    monkeypatch.setattr(mg, "uk_insert", _emulate_uk)
    monkeypatch.setattr(mg, "uv_gate", _emulate_uv)
    return monkeypatch


def test_check_harness_passes_emulation(emulated) -> None:
    """mla_glue.check (the GPU check) on the CPU with the kernels replaced by their contract:
    every row passes, both ops and all three (B, k) cases are there."""
    from kimi_decode.kernels.mla_glue import check
    rows = check(timing=False)
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
    assert {(r["op"], r["B"], r["k"]) for r in rows} == {(op, b, k) for op in ("uk_insert", "uv_gate")
                                                         for b, k in ((1, 0), (1, 7), (8, 0))}
    assert all(r["kernel"] == "mla_glue" for r in rows)


def test_check_harness_rejects_wrong_kernels(emulated) -> None:
    """A uk_insert that writes the cache one position late, and a uv_gate that drops σ's bf16
    rounding of the product's inputs by gating with σ(-g), both fail the check."""
    import kimi_decode.kernels.mla_glue as mg

    def late(q, a, ckv, w_uk_t, cache, pos, T, rope_off):
        return _emulate_uk(q, a, ckv, w_uk_t, cache, pos + 1, T, rope_off)

    emulated.setattr(mg, "uk_insert", late)
    emulated.setattr(mg, "uv_gate", lambda o_lat, w_uv, g: _emulate_uv(o_lat, w_uv, -g))
    rows = mg.check(timing=False, cases=((1, 0),))
    assert len(rows) == 2 and not rows[0]["ok"] and not rows[1]["ok"]
    assert not rows[0]["cache_equal_stock"]
