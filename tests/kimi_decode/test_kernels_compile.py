"""The CuTe DSL kernels compile to sm_90a PTX without a GPU (CI has none).

Oracle: the PTX the DSL writes names `.target sm_90a` and contains the instruction each kernel
exists for (the bulk L2 prefetch, the grid-completion atomic, 128-bit vector loads), and no
local-memory spills (`ld.local`/`st.local`: the register arrays of S and h stayed registers).
Configurations are the K3 TP16 shapes, kept to the cheap ones (M = 1, T = 1) so this is fast.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

from cutlass import Float32, Int32  # noqa: E402

from kimi_decode.kernels import _common  # noqa: E402
from kimi_decode.kernels.attn_res import AttnResConfig, AttnResRMSNorm  # noqa: E402
from kimi_decode.kernels.attn_res import can_implement as ar_can  # noqa: E402
from kimi_decode.kernels.kda_decode import KDAConfig, KDADecode  # noqa: E402
from kimi_decode.kernels.kda_decode import can_implement as kda_can  # noqa: E402
from kimi_decode.kernels.gemv import Gemv, GemvConfig  # noqa: E402
from kimi_decode.kernels.gemv import can_implement as gemv_can  # noqa: E402
from kimi_decode.kernels.l2_prefetch import L2Prefetch  # noqa: E402
from kimi_decode.kernels.router import Router, config_for  # noqa: E402
from kimi_decode.kernels.router import can_implement as router_can  # noqa: E402

bf, f32 = torch.bfloat16, torch.float32
P = _common.dummy_ptr


def ptx_of(tmp_path: Path, kernel: object, *args: object) -> str:
    opts = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    cute.compile(kernel, *args, _common.current_stream(), options=opts)
    files = list(tmp_path.glob("*.ptx"))
    assert len(files) == 1, files
    return files[0].read_text()


def chained_ptx_at_wait(build: Callable[[], str]) -> tuple[list[str], int]:
    """PTX built with the PDL chain on (kernels/chain.py, no prefetch budget), as its
    instruction lines (comments and blanks dropped), and the index of its griddepcontrol.wait:
    what the chained kernels' tests split into before / after the wait."""
    from kimi_decode.kernels import chain
    chain.set_chain(True, 0)
    try:
        ptx = build()
    finally:
        chain.set_chain(False, chain.DEFAULT_BUDGET)
    lines = [s.strip() for s in ptx.splitlines() if s.strip() and not s.strip().startswith("//")]
    return lines, next(i for i, s in enumerate(lines) if s.startswith("griddepcontrol.wait"))


def ptx_events(ptx: str, rules: list[tuple[Callable[[str], bool], str]]) -> str:
    """One letter per PTX instruction that a rule matches (the first matching rule's letter),
    in PTX order: the order tests read their kernels' loads, waits and barriers from."""
    out = []
    for line in ptx.splitlines():
        s = line.strip()
        for match, letter in rules:
            if match(s):
                out.append(letter)
                break
    return "".join(out)


def load_convert_order(ptx: str) -> str:
    """The kernel's global loads (L), bf16 → fp32 conversions (C) and CTA barriers (B) in PTX
    order: what the loads-first tests read (a load issued after a conversion of an earlier
    load's value waits for that load in ptxas's in-order schedule)."""
    return ptx_events(ptx, [(lambda s: s.startswith("ld.global"), "L"),
                            (lambda s: s.startswith("cvt.f32.bf16"), "C"),
                            (lambda s: s.startswith("bar.sync"), "B")])


def common_checks(ptx: str) -> None:
    assert ".target sm_90a" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_attn_res_compiles(tmp_path: Path) -> None:
    k = AttnResRMSNorm(AttnResConfig(7168, 1, 8, has_delta=True, has_write=True))
    ptx = ptx_of(tmp_path, k, P(bf), P(bf), P(bf), P(bf), P(bf), P(f32), P(f32), Int32(1),
                 Int32(0), Float32(1e-5))
    common_checks(ptx)
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx
    # Its only branches are lane-0 stores; a full-warp shuffle inside one deadlocks the GPU
    # (warp_idx() is such a shuffle: the first device run hung exactly there).
    assert not shuffles_in_branches(ptx)


def shuffles_in_branches(ptx: str) -> list[str]:
    """shfl.sync instructions between a predicated forward branch and its target label."""
    found, target = [], None
    for line in ptx.splitlines():
        s = line.strip()
        if target is None and s.startswith("@%p") and " bra " in s:
            target = s.split()[-1].rstrip(";")
        elif target is not None and s == f"{target}:":
            target = None
        elif target is not None and s.startswith("shfl.sync"):
            found.append(s)
    return found


def test_router_compiles(tmp_path: Path) -> None:
    cfg = config_for(1, 7168, 896, 16, 1.0)
    assert cfg.gemv
    ptx = ptx_of(tmp_path, Router(cfg), P(bf), P(bf), P(f32), P(f32), P(torch.int32),
                 P(torch.int64), P(f32), Int32(1))
    common_checks(ptx)
    assert "atom." in ptx and "ld.global.v4" in ptx


def test_kda_compiles(tmp_path: Path) -> None:
    ptx = ptx_of(tmp_path, KDADecode(KDAConfig(6, 128, 1, 3216)), P(bf), P(bf), P(f32), P(bf),
                 P(f32), P(f32), P(f32), P(bf), P(bf), Int32(1))
    common_checks(ptx)
    assert "bar.sync" in ptx


def test_gemv_compiles(tmp_path: Path) -> None:
    ptx = ptx_of(tmp_path, Gemv(GemvConfig(3216, 7168, 8)), P(bf), P(bf), P(bf))
    common_checks(ptx)
    assert "ld.global.v4" in ptx


def test_prefetch_compiles(tmp_path: Path) -> None:
    ptx = ptx_of(tmp_path, L2Prefetch(), P(torch.uint8), Int32(16))
    common_checks(ptx)
    assert "cp.async.bulk.prefetch.L2.global" in ptx


def test_can_implement_matches_k3_and_rejects_tiny() -> None:
    """The K3 TP16 shapes are supported; the tiny CPU config (d = 16, E = 16) is not, so the
    fused path falls back to stock ops there."""
    assert ar_can(7168, 8, 8, (bf, f32)) and not ar_can(64, 1, 8, (f32,))
    assert kda_can(6, 128, 4, 3216, (bf,)) and not kda_can(4, 16, 4, 80, (f32,))
    assert router_can(7168, 896, 16, (bf,)) and not router_can(64, 16, 4, (f32,))
    assert not config_for(17, 7168, 896, 16, 1.0).gemv
    assert gemv_can(1, 3216, 7168, (bf, bf)) and not gemv_can(2, 3216, 7168, (bf, bf))  # per-M table
    assert not gemv_can(1, 7168, 384, (bf, bf))            # shared down: K = 384 stays cuBLAS
