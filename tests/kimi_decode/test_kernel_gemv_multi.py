"""gemv_multi on the CPU: the kernel compiles to sm_90a PTX for the two K3 TP16 uses (the MoE
front: router + latent_down + shared gate/up; the MLA front: qkv_a + g_proj), and its PTX is
made of the kernels it merges: the same 128-bit weight loads per lane as router_fast (7) plus
the plain GEMV's (unrolled 4 deep) per segment, the router's grid-completion atomic and warp
prefix sum exactly once, and no local-memory spills. The arithmetic is the merged kernels'
traced code, so on the GPU check() asserts bit-equality with them (bench/fused_correctness.md).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

from kimi_decode.config import k3_tp16  # noqa: E402
from kimi_decode.kernels import _common  # noqa: E402
from kimi_decode.kernels import router_fast as rf  # noqa: E402
from kimi_decode.kernels.gemv_multi import (GemvMulti, MultiConfig, can_implement, gemv_multi,  # noqa: E402
                                            route_and_project)

bf, f32 = torch.bfloat16, torch.float32
P = _common.dummy_ptr
K3 = k3_tp16()


def ptx_of(tmp_path: Path, cfg: MultiConfig) -> str:
    opts = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    cute.compile(GemvMulti(cfg), P(bf), P(bf), P(bf), P(bf), P(bf), P(bf), P(bf), P(bf), P(f32), P(f32),
                 P(torch.int32), P(torch.int64), P(f32), _common.current_stream(), options=opts)
    files = list(tmp_path.glob("*.ptx"))
    assert len(files) == 1, files
    return files[0].read_text()


def test_moe_front_compiles(tmp_path: Path) -> None:
    rcfg = rf.RouterFastConfig(K3.hidden, K3.num_experts, K3.top_k, 1, K3.routed_scaling)
    cfg = MultiConfig(K3.hidden, 1, (K3.latent_dim, 2 * K3.shared_local_inter), rcfg)
    ptx = ptx_of(tmp_path, cfg)
    assert ".target sm_90a" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert re.search(r"\.reqntid 256, 1, 1", ptx) and ".minnctapersm 4" in ptx
    # the router CTA: its 7 weight + 7 y loads; each GEMV segment: a 4-deep unrolled loop of
    # (weight + x) loads and no remainder (28 slices per lane)
    assert ptx.count("ld.global.v4") == 2 * 7 + 2 * 2 * 4
    assert ptx.count("atom.global.acq_rel.add") == 1 and ptx.count("shfl.sync.up") == 5
    # three kinds of result: fp32 logits, the top-k (int64 ids), bf16 projections
    assert "st.global.u64" in ptx or "st.global.s64" in ptx or "st.global.b64" in ptx
    assert ptx.count("st.global.b16") >= 2 or ptx.count("st.global.u16") >= 2


def test_moe_front_publishes_the_ids_after_the_top_k(tmp_path: Path) -> None:
    """publish_ready (moe_experts.FC1_EARLY_IDS): one more atomic, a release add to the ids-ready
    word (READY_WORD · 4 bytes past the counter) after the ids are stored and a fence; the
    default build has none (test_moe_front_compiles: one atomic)."""
    rcfg = rf.RouterFastConfig(K3.hidden, K3.num_experts, K3.top_k, 1, K3.routed_scaling, publish_ready=True)
    ptx = ptx_of(tmp_path, MultiConfig(K3.hidden, 1, (K3.latent_dim, 2 * K3.shared_local_inter), rcfg))
    lines = [x.strip() for x in ptx.splitlines()]
    rel = [i for i, x in enumerate(lines) if x.startswith("atom.") and ".release." in x]
    assert len(rel) == 1, rel
    addr = re.search(r"\[(%rd\d+)\]", lines[rel[0]]).group(1)       # counter + READY_WORD words
    assert any(re.fullmatch(rf"add\.s64\s+{addr}, %rd\d+, {rf.READY_WORD * 4};", x) for x in lines[:rel[0]])
    assert ptx.count("atom.global.acq_rel.add") == 1
    stores = [i for i, x in enumerate(lines) if x.startswith("st.global") and ("64" in x.split()[0])]
    assert stores and max(stores) < rel[0]                       # every id stored before the flag
    assert any(x.startswith("fence.acq_rel.gpu") for x in lines[max(stores):rel[0]])


def test_publish_needs_a_sync_buffer() -> None:
    y = torch.zeros(1, K3.hidden, dtype=bf)
    w = torch.zeros(K3.num_experts, K3.hidden, dtype=bf)
    with pytest.raises(ValueError, match="routing sync buffer"):
        route_and_project(y, w, torch.zeros(K3.num_experts), K3.top_k, 1.0, torch.zeros(1, dtype=torch.int32),
                          [torch.zeros(256, K3.hidden, dtype=bf)], publish_ready=True)


def test_moe_front_without_the_shared_expert_compiles(tmp_path: Path) -> None:
    """fused.FRONT_SHARED off: the router and latent_down alone (one GEMV segment)."""
    rcfg = rf.RouterFastConfig(K3.hidden, K3.num_experts, K3.top_k, 1, K3.routed_scaling)
    ptx = ptx_of(tmp_path, MultiConfig(K3.hidden, 1, (K3.latent_dim,), rcfg))
    assert ".target sm_90a" in ptx and "ld.local" not in ptx and "st.local" not in ptx
    assert ptx.count("ld.global.v4") == 2 * 7 + 2 * 4          # the router CTA's, one segment's loop
    assert ptx.count("atom.global.acq_rel.add") == 1


def test_mla_front_compiles(tmp_path: Path) -> None:
    cfg = MultiConfig(K3.hidden, 1, (K3.qkv_a_rows, K3.mla_local_heads * K3.v_head_dim))
    ptx = ptx_of(tmp_path, cfg)
    assert ".target sm_90a" in ptx and "ld.local" not in ptx and "st.local" not in ptx
    assert ptx.count("ld.global.v4") == 2 * 2 * 4            # two plain GEMV segments
    assert "atom." not in ptx and "minnctapersm" not in ptx  # no router, no register cap


def test_can_implement() -> None:
    assert can_implement(1, K3.hidden, [K3.latent_dim, 768], (bf, bf), router=(K3.num_experts, K3.top_k))
    assert can_implement(1, K3.hidden, [2112, 768], (bf,))
    assert not can_implement(1, K3.hidden, [], (bf,))
    assert not can_implement(1, K3.hidden, [1, 2, 3, 4], (bf,))
    assert not can_implement(9, K3.hidden, [16], (bf,))
    assert not can_implement(1, 384, [16], (bf,))                      # K % 256
    assert not can_implement(1, K3.hidden, [16], (f32,))
    assert not can_implement(1, 7168 + 256, [16], (bf,), router=(896, 16))   # router_fast: K % 1024


def test_bad_operands_one_line_error() -> None:
    x = torch.zeros(1, 512, dtype=bf)
    with pytest.raises(ValueError, match="gemv_multi cannot run"):
        gemv_multi(x, [torch.zeros(16, 256, dtype=bf)])


def _emulate_route(y, w_gate, bias, top_k, scaling, counter, logits=None, logits_bf16=False):
    from kimi_decode.kernels.router import reference
    ids, w, _ = reference(y, w_gate, bias, top_k, scaling)
    return ids, w.float()


@pytest.mark.parametrize("broken", [False, True])
def test_check_harness_on_cpu(on_cpu, broken: bool) -> None:
    """check() run on the CPU with the kernels replaced by emulations of their contracts: it
    passes every row when the merged launch equals the separate ones, and says no when one
    output is off (the shared gate/up rows computed from a shifted weight)."""
    import kimi_decode.kernels.gemv as k_gemv
    import kimi_decode.kernels.gemv_multi as k_multi
    on_cpu.setattr(rf, "route", _emulate_route)
    on_cpu.setattr(k_gemv, "gemv", lambda x, w, out=None: x @ w.t())

    def route_and_project(y, w_gate, bias, top_k, scaling, counter, ws):
        ids, w = _emulate_route(y, w_gate, bias, top_k, scaling, counter)
        outs = [y @ w_.t() for w_ in ws]
        if broken:
            outs[1] = y @ ws[1].roll(1, 0).t()
        return ids, w, outs
    on_cpu.setattr(k_multi, "route_and_project", route_and_project)
    on_cpu.setattr(k_multi, "gemv_multi", lambda x, ws: [x @ w.t() for w in ws])
    rows = k_multi.check(timing=False, rows=(1,))
    assert [r["case"] for r in rows] == ["moe_front", "mla_front"]
    assert rows[1]["ok"]
    assert rows[0]["ok"] is (not broken) and rows[0]["h_equal_gemv"] is (not broken)
