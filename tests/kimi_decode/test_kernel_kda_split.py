"""kda_split on the CPU: the kernel compiles to sm_90a PTX at the K3 TP16 shapes with the
instructions its design relies on, and its float64 `reference` equals the stock ops
(stock_ops.conv_update → f_b_proj in bf16 → kda_recurrence → gated_rms_norm), which makes it
the oracle the GPU check compares the kernel with.

Oracle for (b): the stock ops in fp32 with their bf16 output; the reference differs from them
only by fp32 vs float64 arithmetic and by where the bf16 f_b product rounds (fp32 vs float64
accumulation, a 1-ulp flip at most): out within bf16 rounding (rel ~ 2e-3; ≤ 5e-4 once the
reference is rounded to bf16 too), recurrent state ≤ 1e-5 (measured ~1e-7), conv state equal.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

from cutlass import Int32  # noqa: E402

from kimi_decode import stock_ops as ops  # noqa: E402
from kimi_decode.config import k3_tp16  # noqa: E402
from kimi_decode.kernels import _common  # noqa: E402
from kimi_decode.kernels.kda_decode import KDAConfig  # noqa: E402
from kimi_decode.kernels.kda_split import (KDASplit, KDASplitConfig, can_implement,  # noqa: E402
                                           kda_decode_split, make_scratch, reference, splits_for)

bf, f32 = torch.bfloat16, torch.float32
P_ = _common.dummy_ptr


def k3_kcfg(spec: int) -> KDAConfig:
    cfg = k3_tp16(batch=1, spec_tokens=spec)
    return KDAConfig(cfg.kda_local_heads, cfg.kda_head_dim, cfg.tokens_per_seq, cfg.in_proj_rows,
                     cfg.gate_lower_bound, 1e-6, cfg.rms_eps)


def ptx_of(tmp_path: Path, kcfg: KDAConfig, splits: int, cls: type = KDASplit) -> str:
    """The PTX of `cls` (KDASplit or a subclass with its signature, e.g. kda_fast.KDAFast)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    opts = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    cute.compile(cls(KDASplitConfig(kcfg, splits)), P_(bf), P_(bf), P_(f32), P_(bf), P_(f32),
                 P_(f32), P_(f32), P_(bf), P_(bf), P_(f32), P_(torch.int32), Int32(1),
                 _common.current_stream(), options=opts)
    files = list(tmp_path.glob("*.ptx"))
    assert len(files) == 1, files
    return files[0].read_text()


@pytest.mark.parametrize("spec,splits", [(0, 16), (7, 4), (0, 8)])
def test_compiles_to_sm90a(tmp_path: Path, spec: int, splits: int) -> None:
    kcfg = k3_kcfg(spec)
    assert can_implement(kcfg.heads, kcfg.head_dim, 4, kcfg.in_proj_rows, (bf,), splits)
    ptx = ptx_of(tmp_path, kcfg, splits)
    assert ".target sm_90a" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx          # S slice stayed in registers
    assert "atom.global.acq_rel.add" in ptx                         # the per-(b, h) arrival counter
    assert ptx.count("fence.acq_rel.gpu") >= 3                      # writers, bumper, last reader
    assert "ld.global.v4" in ptx                                    # 128-bit f_b rows
    assert "bar.sync" in ptx and "shfl.sync.bfly" in ptx


def test_can_implement_and_table() -> None:
    assert can_implement(6, 128, 4, 3216, (bf,), 16)
    assert not can_implement(6, 128, 4, 3216, (bf,), 2)             # C = 64 spans two warps
    assert not can_implement(4, 16, 4, 80, (f32,))                   # the tiny CPU config
    assert [splits_for(b) for b in (1, 8, 64)] == [16, 8, 4]
    assert 1 * 6 * splits_for(1) >= 96


def test_wrapper_rejects_wrong_shapes() -> None:
    kcfg = k3_kcfg(0)
    p = kcfg.heads * kcfg.head_dim
    sc = make_scratch(kcfg, 1, "cpu")
    assert sc.counter.shape == (6,) and int(sc.counter.abs().sum()) == 0 and sc.o.shape == (1, p)
    z = torch.zeros(2, kcfg.in_proj_rows, dtype=bf)                 # 2 rows for B = 1, T = 1
    with pytest.raises(ValueError):
        kda_decode_split(z, torch.zeros(p, 128, dtype=bf), torch.zeros(3 * p, 4),
                         torch.zeros(1, 3 * p, 3, dtype=bf), torch.zeros(p), torch.zeros(6),
                         torch.zeros(1, 6, 128, 128), torch.ones(128, dtype=bf), kcfg, sc)


def inputs(B: int, H: int, d: int, T: int, R: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    P = H * d

    def rn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)
    return dict(z=rn(B * T, R).to(bf), f_b=(rn(P, d) * d ** -0.5).to(bf), conv_w=rn(3 * P, 4) * 0.5,
                conv_state=rn(B, 3 * P, 3).to(bf), dt_bias=rn(P) * 0.5,
                a_log=torch.log(1 + 15 * torch.sigmoid(rn(H))), rec_state=rn(B, H, d, d) * 0.05,
                o_norm=(1 + 0.1 * rn(d)).to(bf))


def stock(a: dict, kcfg: KDAConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stock op sequence of stock.KDAAttention.forward between in_proj and o_proj."""
    H, d = kcfg.heads, kcfg.head_dim
    P, B, z = H * d, a["conv_state"].shape[0], a["z"]
    act, cs = ops.conv_update(a["conv_state"], z[:, :3 * P], a["conv_w"], B)
    f_b = z[:, 4 * P:4 * P + d] @ a["f_b"].t()                                     # bf16 out
    o, S = ops.kda_recurrence(act, f_b, z[:, 4 * P + d:4 * P + d + H], a["dt_bias"], a["a_log"],
                              a["rec_state"], kcfg.gate_lower_bound, H)
    out = ops.gated_rms_norm(o, a["o_norm"], z[:, 3 * P:4 * P], kcfg.norm_eps, z.dtype)
    return out, cs, S


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("B,H,d,T", [(2, 2, 16, 1), (2, 2, 16, 3), (3, 2, 32, 8), (1, 6, 128, 1),
                                     (1, 6, 128, 8), (2, 6, 128, 2)])
def test_reference_equals_stock(B: int, H: int, d: int, T: int) -> None:
    R = 4 * H * d + d + H + (-(4 * H * d + d + H)) % 8
    kcfg = KDAConfig(H, d, T, R)
    a = inputs(B, H, d, T, R, seed=B * 100 + T)
    before = {k: v.clone() for k, v in a.items()}
    out_r, cs_r, S_r = reference(**a, kcfg=kcfg)
    assert all(torch.equal(a[k], before[k]) for k in a)                            # inputs untouched
    out_s, cs_s, S_s = stock(a, kcfg)
    assert out_r.dtype == torch.float64 and out_r.shape == out_s.shape == (B * T, H * d)
    assert torch.equal(cs_r, cs_s)
    assert rel(S_s, S_r) <= 1e-5
    assert rel(out_s, out_r) <= 5e-3                                               # bf16 rounding
    assert rel(out_s, out_r.to(bf)) <= 5e-4                                        # a few 1-ulp flips
    # the history is the last 3 inputs: z's own rows once T ≥ 3
    if T >= 3:
        P = H * d
        assert torch.equal(cs_r[0, :, -1], a["z"][T - 1, :3 * P])


def test_reference_can_fail() -> None:
    """A wrong statement (no bf16 rounding of the gate product, a different lower bound, one
    token fewer of state) is caught by the same tolerances."""
    B, H, d, T = 2, 2, 16, 3
    R = 4 * H * d + d + H + (-(4 * H * d + d + H)) % 8
    kcfg = KDAConfig(H, d, T, R)
    a = inputs(B, H, d, T, R, seed=7)
    out_s, _, S_s = stock(a, kcfg)
    out_w, _, S_w = reference(**a, kcfg=KDAConfig(H, d, T, R, gate_lower_bound=-4.0))
    assert rel(S_s, S_w) > 1e-4 and rel(out_s, out_w) > 5e-3
    a1 = dict(a, z=a["z"].reshape(B, T, R)[:, :2].reshape(B * 2, R))
    _, _, S_1 = reference(**a1, kcfg=KDAConfig(H, d, 2, R))
    assert rel(S_s, S_1) > 1e-4


def test_column_split_is_exact() -> None:
    """The design's premise: the recurrence of a column group needs only its own v and S
    columns (plus the shared q, k, g, β) — the reference run on a zeroed-out complement
    gives the same columns of S."""
    B, H, d, T = 1, 2, 16, 3
    R = 4 * H * d + d + H + (-(4 * H * d + d + H)) % 8
    kcfg = KDAConfig(H, d, T, R)
    a = inputs(B, H, d, T, R, seed=11)
    _, _, S_full = reference(**a, kcfg=kcfg)
    cols = slice(4, 8)
    mask = torch.zeros(d, dtype=torch.bool)
    mask[cols] = True
    S0 = a["rec_state"].clone()
    S0[..., ~mask] = 0
    _, _, S_part = reference(**dict(a, rec_state=S0), kcfg=kcfg)
    assert torch.allclose(S_part[..., cols], S_full[..., cols], rtol=0, atol=1e-12)
    assert not math.isclose(float(S_part[..., ~mask].norm()), float(S_full[..., ~mask].norm()))


def emulate(a: dict, kcfg: KDAConfig, splits: int, order: list[tuple[int, int, int]],
            qk_writer: str = "last") -> tuple:
    """The kernel, thread for thread, in fp32 torch: the 128 threads of a CTA as vectors indexed
    by tid, the same index formulas (c, kr, keys, channels), the xor shuffles, the shared-memory
    partials, the per-(b, h) counter; CTAs run one after another in `order`, so any element one
    CTA writes and another reads afterwards (an ownership bug) changes the result.
    qk_writer="split0" is the naive ownership (split 0 writes the q, k history), for the
    negative test."""
    H, d, T = kcfg.heads, kcfg.head_dim, kcfg.tokens
    P, B, z = H * d, a["conv_state"].shape[0], a["z"]
    C = d // splits
    rows, lg = 128 // C, C.bit_length() - 1
    cs, rec = a["conv_state"].clone(), a["rec_state"].clone()
    o_buf = torch.full((B * T, P), float("nan"))
    out = torch.full((B * T, P), float("nan")).to(bf)
    counter = [0] * (B * H)
    tid = torch.arange(128)
    lane, warp, c, kr = tid % 32, tid // 32, tid % C, tid // C
    keys = kr[:, None] + torch.arange(C)[None, :] * rows                          # [128, C]
    own_v = tid < C

    def bfly(x: torch.Tensor) -> torch.Tensor:
        for sh in range(lg, 5):
            x = x + x[tid ^ (1 << sh)]
        return x

    def silu(y: torch.Tensor) -> torch.Tensor:
        return y * torch.sigmoid(y)

    for sp, h, b in order:
        c0 = sp * C
        S = rec[b, h][keys, c0 + c[:, None]].clone()
        gq, gk, gv = h * d + tid, P + h * d + tid, 2 * P + h * d + c0 + c
        hq, hk = cs[b, gq].float(), cs[b, gk].float()
        hv = torch.where(own_v[:, None], cs[b, gv].float(), 0.0)
        wq, wk, wv = a["conv_w"][gq], a["conv_w"][gk], a["conv_w"][gv]
        decay = a["a_log"][h].exp()
        for t in range(T):
            row = b * T + t

            def conv(hist: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> tuple:
                y = x * w[:, 3] + (hist * w[:, :3]).sum(1)
                return silu(y), torch.cat([hist[:, 1:], x[:, None]], 1)
            s_q, hq = conv(hq, wq, z[row, gq].float())
            s_k, hk = conv(hk, wk, z[row, gk].float())
            av, hv_new = conv(hv, wv, z[row, gv].float())
            hv = torch.where(own_v[:, None], hv_new, hv)
            s_v = av[:C]
            s_fa = z[row, 4 * P + tid].float()
            beta = torch.sigmoid(z[row, 4 * P + d + h].float())
            acc = (a["f_b"][h * d + tid].float() * s_fa[None, :]).sum(1)
            gr = acc.to(bf).float() + a["dt_bias"][h * d + tid]
            s_eg = torch.exp(kcfg.gate_lower_bound * torch.sigmoid(decay * gr))
            q_scale = d ** -0.5 / torch.clamp_min(s_q.pow(2).sum().sqrt(), kcfg.l2_eps)
            k_scale = 1.0 / torch.clamp_min(s_k.pow(2).sum().sqrt(), kcfg.l2_eps)
            S = S * s_eg[keys]
            part = bfly((s_k[keys] * S).sum(1))
            s_part0 = torch.zeros(4, C)
            s_part0[warp[lane < C], lane[lane < C]] = part[lane < C] * k_scale
            kS = s_part0[:, c].sum(0)
            u = beta * (s_v[c] - kS)
            S = S + s_k[keys] * k_scale * u[:, None]
            part = bfly((s_q[keys] * S).sum(1))
            s_part1 = torch.zeros(4, C)
            s_part1[warp[lane < C], lane[lane < C]] = part[lane < C] * q_scale
            o_buf[row, h * d + c0 + c[own_v]] = s_part1[:, c[own_v]].sum(0)
        rec[b, h][keys, c0 + c[:, None]] = S
        cs[b, gv[own_v]] = hv[own_v].to(bf)
        if qk_writer == "split0" and sp == 0:
            cs[b, gq], cs[b, gk] = hq.to(bf), hk.to(bf)
        old = counter[b * H + h]
        counter[b * H + h] += 1
        if old == splits - 1:
            if qk_writer == "last":
                cs[b, gq], cs[b, gk] = hq.to(bf), hk.to(bf)
            for t in range(T):
                row = b * T + t
                o_r = o_buf[row, h * d + tid]
                rs = torch.rsqrt(o_r.pow(2).sum() / d + kcfg.norm_eps)
                gate = torch.sigmoid(z[row, 3 * P + h * d + tid].float())
                out[row, h * d + tid] = (o_r * rs * a["o_norm"].float() * gate).to(bf)
            counter[b * H + h] = 0
    return out, cs, rec, counter


@pytest.mark.parametrize("splits", [4, 8, 16, 32])
def test_thread_level_emulation_matches_reference(splits: int) -> None:
    """The kernel's index design (slices, key coverage, shuffles, ownership of conv_state and
    rec_state, last-arrival norm) reproduces the reference whatever order the CTAs run in."""
    B, H, d, T = 2, 2, 128, 3
    R = 4 * H * d + d + H + (-(4 * H * d + d + H)) % 8
    kcfg = KDAConfig(H, d, T, R)
    a = inputs(B, H, d, T, R, seed=splits)
    ctas = [(sp, h, b) for b in range(B) for h in range(H) for sp in range(splits)]
    order = [ctas[i] for i in torch.randperm(len(ctas), generator=torch.Generator().manual_seed(splits))]
    out_e, cs_e, rec_e, counter = emulate(a, kcfg, splits, order)
    out_r, cs_r, rec_r = reference(**a, kcfg=kcfg)
    assert counter == [0] * (B * H)
    assert torch.equal(cs_e, cs_r)
    assert rel(rec_e, rec_r) <= 1e-5
    assert not out_e.float().isnan().any() and rel(out_e, out_r) <= 5e-3
    # the naive ownership (split 0 writes the q, k history while its siblings may still read
    # it) is caught: some sibling of a split 0 runs after it in this order
    out_n, cs_n, rec_n, _ = emulate(a, kcfg, splits, order, qk_writer="split0")
    assert torch.equal(cs_n, cs_r) and rel(rec_n, rec_r) > 1e-3 and rel(out_n, out_r) > 1e-2


def _fake_split(z, f_b, conv_w, conv_state, dt_bias, a_log, rec_state, o_norm, kcfg, scratch, splits=None):
    """kda_decode_split's contract, by the thread-level emulation (CTAs in reverse order)."""
    B = conv_state.shape[0]
    vs = splits or splits_for(B)
    a = dict(z=z, f_b=f_b, conv_w=conv_w, conv_state=conv_state, dt_bias=dt_bias, a_log=a_log,
             rec_state=rec_state, o_norm=o_norm)
    ctas = [(sp, h, b) for b in range(B) for h in range(kcfg.heads) for sp in range(vs)][::-1]
    out, cs, rec, counter = emulate(a, kcfg, vs, ctas)
    conv_state.copy_(cs)
    rec_state.copy_(rec)
    scratch.counter.copy_(torch.tensor(counter, dtype=torch.int32))
    return out


def test_check_harness_on_cpu_with_emulated_kernel(monkeypatch) -> None:
    """kda_split.check() itself (stock module, 3 steps with state carried, reference, counters)
    runs on the CPU with the thread-level emulation standing in for the launch, and passes."""
    from kimi_decode.kernels import checks
    from kimi_decode.kernels import kda_split as mod
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(mod, "kda_decode_split", _fake_split)
    rows = mod.check(timing=False, batches=(1,), spec=(0,), alt_splits=(8,))
    assert len(rows) == 1 and rows[0]["ok"] and rows[0]["alt_splits_ok"], rows
    assert rows[0]["rel_out"] <= 5e-3 and rows[0]["conv_state_equal"] and rows[0]["counter_zero"]


def _wrong_split(*args, **kw):
    """_fake_split with a wrong gate lower bound (-4): a kernel the checks must fail."""
    k = args[8]
    bad = KDAConfig(k.heads, k.head_dim, k.tokens, k.in_proj_rows, gate_lower_bound=-4.0)
    return _fake_split(*args[:8], bad, *args[9:], **kw)


def test_check_harness_can_fail(monkeypatch) -> None:
    """An emulated kernel with a wrong gate lower bound fails check()."""
    from kimi_decode.kernels import checks
    from kimi_decode.kernels import kda_split as mod
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(mod, "kda_decode_split", _wrong_split)
    assert not mod.check(timing=False, batches=(1,), spec=(0,), alt_splits=())[0]["ok"]
