"""kda_split on the CPU: the kernel compiles to sm_90a PTX at the K3 TP16 shapes with the
instructions its design relies on, and its float64 `reference` equals the stock ops
(stock_ops.conv_update → f_b_proj in bf16 → kda_recurrence → gated_rms_norm), which makes it
the oracle the GPU check compares the kernel with.

Oracle for (b): the stock ops in fp32 with their bf16 output; the reference differs from them
only by fp32 vs float64 arithmetic and by where the bf16 f_b product rounds (fp32 vs float64
accumulation, a 1-ulp flip at most): out within bf16 rounding (rel ~ 2e-3), states ≤ 1e-4.
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


def ptx_of(tmp_path: Path, kcfg: KDAConfig, splits: int) -> str:
    opts = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    cute.compile(KDASplit(KDASplitConfig(kcfg, splits)), P_(bf), P_(bf), P_(f32), P_(bf), P_(f32),
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
    assert rel(S_s, S_r) <= 1e-4
    assert rel(out_s, out_r) <= 5e-3                                               # bf16 rounding
    assert rel(out_s, out_r.to(bf)) <= 2e-3
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
