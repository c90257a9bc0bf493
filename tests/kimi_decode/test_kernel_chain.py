"""The PDL chain (kernels/chain.py) on the CPU: every chained kernel compiles to sm_90a PTX with
the chain on, follows the protocol there (pre-wait only weights / prefetches, the wait before
the release), and compiles to PTX without any of it when the chain is off (the verified
kernels unchanged). The B = 1 K3 TP16 configurations the fused step runs.

The device check (kernels/checks.py `check_chain`) runs the step with and without the chain
and demands bit-identical outputs and state.
"""
from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

from cutlass import Float32, Int32  # noqa: E402

import kimi_decode.kernels.gemv as k_gemv  # noqa: E402
import kimi_decode.kernels.moe_up as k_up  # noqa: E402
import kimi_decode.kernels.router_fast as rf  # noqa: E402
from kimi_decode.config import k3_tp16  # noqa: E402
from kimi_decode.kernels import _common, chain  # noqa: E402
from kimi_decode.kernels.attn_res_mc import AttnResMC, AttnResMCConfig, pick_ctas  # noqa: E402
from kimi_decode.kernels.gemv import Gemv, GemvConfig, GemvRMSNorm  # noqa: E402
from kimi_decode.kernels.gemv_multi import GemvMulti, MultiConfig  # noqa: E402
from kimi_decode.kernels.kda_fast import KDAFast  # noqa: E402
from kimi_decode.kernels.moe_experts import ExpertsConfig, ExpertsFC1, ExpertsFC2v2  # noqa: E402
from tests.kimi_decode.test_kernel_kda_split import k3_kcfg  # noqa: E402
from tests.kimi_decode.test_kernel_kda_split import ptx_of as kda_ptx  # noqa: E402
from tests.kimi_decode.test_kernel_mla_attend import k3_config as mla_config  # noqa: E402
from tests.kimi_decode.test_kernel_mla_attend import ptx_of as mla_ptx  # noqa: E402
from kimi_decode.kernels.mla_glue import config_uk_norm  # noqa: E402
from tests.kimi_decode.test_kernel_mla_glue import ptx_of as glue_ptx  # noqa: E402
from tests.kimi_decode.test_kernels_compile import ptx_of  # noqa: E402

bf, f32, i32, i64 = torch.bfloat16, torch.float32, torch.int32, torch.int64
P = _common.dummy_ptr
K3 = k3_tp16()
WAIT, RELEASE, PREFETCH = "griddepcontrol.wait", "griddepcontrol.launch_dependents", "cp.async.bulk.prefetch.L2"


@pytest.fixture
def chain_mode() -> Iterator[Callable[[bool], None]]:
    """Set the chain mode (and prefetch budget) for one test; off and the default budget
    afterwards (it is process-wide)."""
    yield lambda on, budget=None: chain.set_chain(on, budget)
    chain.set_chain(False, chain.DEFAULT_BUDGET)


def gemv_ptx(d: Path, cfg: GemvConfig) -> str:
    return ptx_of(d, Gemv(cfg), P(bf), P(bf), P(bf))


def norm_ptx(d: Path) -> str:
    cfg = GemvConfig(K3.mla_local_heads * (K3.qk_nope_dim + K3.qk_rope_dim), K3.q_lora_rank, 1,
                     eps=K3.rms_eps, x_stride=K3.qkv_a_rows)
    return ptx_of(d, GemvRMSNorm(cfg), P(bf), P(bf), P(bf), P(bf))


def multi_ptx(d: Path, router: bool) -> str:
    if router:
        rcfg = rf.RouterFastConfig(K3.hidden, K3.num_experts, K3.top_k, 1, K3.routed_scaling)
        cfg = MultiConfig(K3.hidden, 1, (K3.latent_dim, 2 * K3.shared_local_inter), rcfg, hint="evict_first")
    else:
        cfg = MultiConfig(K3.hidden, 1, (K3.qkv_a_rows, K3.mla_local_heads * K3.v_head_dim), None, unroll=7)
    return ptx_of(d, GemvMulti(cfg), P(bf), P(bf), P(bf), P(bf), P(bf), P(bf), P(bf), P(bf), P(f32), P(f32),
                  P(i32), P(i64), P(f32))


def experts_cfg() -> ExpertsConfig:
    return ExpertsConfig(K3.latent_dim, K3.expert_local_inter_padded, K3.expert_local_inter, K3.top_k,
                         K3.num_experts, i64, pdl=True)


# name -> PTX of the kernel as the B = 1 step runs it
KERNELS: dict[str, Callable[[Path], str]] = {
    "o_proj": lambda d: gemv_ptx(d, GemvConfig(K3.hidden, 768, 1, hint="no_allocate")),
    "in_proj_splitk": lambda d: gemv_ptx(d, GemvConfig(K3.in_proj_rows, K3.hidden, 1, cols=4, kwarps=4)),
    "shared_down_situ": lambda d: gemv_ptx(d, GemvConfig(K3.hidden, K3.shared_local_inter, 1, vec=4, situ=True,
                                                         beta=K3.situ_beta, lin_beta=K3.situ_linear_beta)),
    "q_b_norm": norm_ptx,
    "moe_front": lambda d: multi_ptx(d, True),
    "mla_front": lambda d: multi_ptx(d, False),
    "attn_res_mc": lambda d: ptx_of(d, AttnResMC(AttnResMCConfig(K3.hidden, 1, 8, True, True, vec_per_thread=1,
                                                                 world=K3.tp, ctas=pick_ctas(K3.hidden))),
                                    P(bf), P(bf), P(bf), P(bf), P(bf), P(f32), P(f32), Int32(1), Int32(0),
                                    Float32(1e-5)),
    "kda_fast": lambda d: kda_ptx(d, k3_kcfg(0), 16, KDAFast),
    "moe_up": lambda d: ptx_of(d, k_up.MoeUp(k_up.MoeUpConfig(1, K3.latent_dim, K3.hidden // K3.tp, K3.tp, 8)),
                               P(bf), P(bf), P(bf), P(bf), P(bf), P(bf), Int32(0), Float32(1e-5)),
    "experts_fc1": lambda d: ptx_of(d, ExpertsFC1(experts_cfg()), P(bf), P(i64), P(bf), P(bf), P(torch.int32), Int32(1),
                                    Float32(4.0), Float32(25.0)),
    "experts_fc2_v2": lambda d: ptx_of(d, ExpertsFC2v2(experts_cfg()), P(bf), P(i64), P(f32), P(bf), P(bf), Int32(1)),
    "mla_attend_uv": lambda d: mla_ptx(d, mla_config(uv_rows=1)),
    "uk_insert_norm": lambda d: glue_ptx(d, config_uk_norm(
        1, 1, K3.mla_local_heads, K3.qk_nope_dim, K3.qk_rope_dim, K3.kv_lora_rank, K3.qkv_a_rows,
        K3.q_lora_rank + K3.kv_lora_rank, K3.q_lora_rank, K3.rms_eps)),
}
# FC1 / FC2 had PDL before the chain (FC2 launched with it after FC1): their unchained PTX
# keeps the hint and FC2's wait
UNCHAINED_PDL = {"experts_fc1": (0, 1), "experts_fc2_v2": (1, 0)}
# not chained although the chain is on: gemv_situ (the shared expert's down GEMV, side stream)
NEVER_CHAINED = {"shared_down_situ"}
# weights loaded into registers before the wait (128-bit loads of one lane): whole rows for
# o_proj (K = 768: 3, L1::no_allocate), q_b
# (K = 1536: 6), moe_up (L = 3584: 14); in_proj's split-K: its first round (gemv.CHAIN_PEEL = 1)
# of its C = 4 rows
REGISTER_ROWS = {"q_b_norm": ("ld.global.v4.b32", 6),
                 "moe_up": ("ld.global.v4", K3.latent_dim // 256),
                 "o_proj": ("ld.global.L1::no_allocate.v4", 3), "in_proj_splitk": ("ld.global.v4", 4)}
PREFETCHING = {"in_proj_splitk", "moe_front", "mla_front"}


def _lines(ptx: str) -> list[str]:
    return [s.strip() for s in ptx.splitlines()]


def _first(lines: list[str], prefix: str) -> int:
    return next(i for i, s in enumerate(lines) if s.startswith(prefix))


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_unchained_ptx_has_no_chain(tmp_path: Path, name: str, chain_mode) -> None:
    chain_mode(False)
    ptx = KERNELS[name](tmp_path)
    waits, releases = UNCHAINED_PDL.get(name, (0, 0))
    assert ptx.count(WAIT) == waits and ptx.count(RELEASE) == releases
    assert PREFETCH not in ptx


@pytest.mark.parametrize("budget", [chain.DEFAULT_BUDGET, 8 << 20])
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_chained_ptx_follows_the_protocol(tmp_path: Path, name: str, budget: int, chain_mode) -> None:
    chain_mode(True, budget)
    ptx = KERNELS[name](tmp_path)
    assert ".target sm_90a" in ptx and "ld.local" not in ptx and "st.local" not in ptx
    if name in NEVER_CHAINED:
        assert WAIT not in ptx and RELEASE not in ptx and PREFETCH not in ptx
        return
    lines = _lines(ptx)
    assert any(s.startswith(RELEASE) for s in lines)
    wait, release = _first(lines, WAIT), _first(lines, RELEASE)
    assert wait < release                  # never release before the wait (kernels/chain.py, 3.)
    head = lines[:wait]
    assert not any(s.startswith(("st.global", "atom.", "red.")) for s in head)   # nothing written pre-wait
    assert (PREFETCH in ptx) == (budget > 0 and name in PREFETCHING)
    if name == "in_proj_splitk":
        assert any(s.startswith(PREFETCH) for s in head) == (budget > 0)
    if name in REGISTER_ROWS:
        op, n = REGISTER_ROWS[name]
        assert sum(s.startswith(op) for s in head) == n             # the weights
        assert sum(s.startswith("ld.global") for s in head) == n    # and nothing else
    if name in ("experts_fc1", "mla_attend_uv"):   # ids / q and the cache: only after the wait
        assert not any(s.startswith("ld.global") for s in head)


def test_budget_shares_the_rows() -> None:
    try:
        chain.set_chain(True, budget=16 << 20)
        assert chain.row_prefetch_bytes(1536, 7168) == 1536           # o_proj: whole rows (11 MB)
        assert chain.row_prefetch_bytes(14336, 3216) == (16 << 20) // 3216 // 16 * 16
        assert chain.key() == (True, 16 << 20)
        chain.set_chain(False)
        assert chain.row_prefetch_bytes(1536, 7168) == 0 and chain.key() == (False, 0)
        with pytest.raises(ValueError, match="budget"):
            chain.set_chain(True, budget=-1)
    finally:
        chain.set_chain(False, budget=chain.DEFAULT_BUDGET)


def test_compile_cache_keys_the_mode(monkeypatch) -> None:
    """A kernel compiled with the chain is never handed out without it (and back)."""
    built: list[bool] = []
    monkeypatch.setattr(_common, "_CACHE", {})
    try:
        for on in (False, True, False, True):
            chain.set_chain(on)
            _common.compiled(("probe", 1), lambda: built.append(chain.chain_on()) or chain.chain_on())
    finally:
        chain.set_chain(False)
    assert built == [False, True]


@pytest.mark.parametrize("name,most", [("in_proj_splitk", 73), ("o_proj", 64)])
def test_chained_gemv_registers(tmp_path: Path, name: str, most: int, chain_mode) -> None:
    """The register loads before the wait must not cost occupancy: in_proj's 804 CTAs of 128
    threads stay one wave on 132 SMs (7 per SM: ≤ 73 registers), o_proj's 896 of 256 threads
    need ≤ 64 (ptxas -v, no spills)."""
    from tests.kimi_decode.ptxas_tool import require_ptxas
    ptxas = require_ptxas()
    chain_mode(True)
    KERNELS[name](tmp_path)
    src = next(tmp_path.glob("*.ptx"))
    res = subprocess.run([ptxas, "-v", "-arch=sm_90a", str(src), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True)
    regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
    assert regs <= most and "0 bytes spill stores" in res.stderr, res.stderr


# --- weights before the wait in the fronts, early release (off by default; A/B settings) ---

def _multi_cfg(router: bool, **kw) -> MultiConfig:
    if router:
        rcfg = rf.RouterFastConfig(K3.hidden, K3.num_experts, K3.top_k, 1, K3.routed_scaling)
        return MultiConfig(K3.hidden, 1, (K3.latent_dim, 2 * K3.shared_local_inter), rcfg, hint="evict_first", **kw)
    return MultiConfig(K3.hidden, 1, (K3.qkv_a_rows, K3.mla_local_heads * K3.v_head_dim), None, unroll=7, **kw)


def _multi_ptx_cfg(d: Path, cfg: MultiConfig) -> str:
    return ptx_of(d, GemvMulti(cfg), P(bf), P(bf), P(bf), P(bf), P(bf), P(bf), P(bf), P(bf), P(f32), P(f32),
                  P(i32), P(i64), P(f32))


def _loads_before_each_wait(lines: list[str]) -> list[int]:
    """For every griddepcontrol.wait: the global loads in the straight-line block before it
    (back to the previous label or branch)."""
    out = []
    for w in (i for i, s in enumerate(lines) if s.startswith(WAIT)):
        j, n = w - 1, 0
        while j >= 0 and not lines[j].startswith(("bra", "@", "$")):
            n += lines[j].startswith("ld.global")
            j -= 1
        out.append(n)
    return out


@pytest.mark.parametrize("router,peel,router_pre,expect", [
    (True, 0, False, [0, 0, 0]),       # the default: nothing before any wait
    (True, 0, True, [7, 0, 0]),        # router CTAs: their 7 W_gate slices per lane
    (True, 4, True, [7, 4, 4]),        # + each projection segment's first round (unroll 4)
    (False, 7, False, [7, 7]),         # MLA front: qkv_a's and g_proj's first round (unroll 7)
])
def test_fronts_load_weights_before_the_wait(tmp_path: Path, router: bool, peel: int, router_pre: bool,
                                             expect: list[int], chain_mode) -> None:
    """ROUTER_PRE_WAIT / PRE_WAIT_ROUNDS: the router CTAs' weight loads, and the projection
    warps' first `peel` slices, sit before griddepcontrol.wait in every branch of the grid,
    y / x only after it; nothing is written before it and the release still follows it."""
    chain_mode(True)
    ptx = _multi_ptx_cfg(tmp_path, _multi_cfg(router, peel=peel, router_pre=router_pre))
    lines = _lines(ptx)
    assert _loads_before_each_wait(lines) == expect
    waits = [i for i, s in enumerate(lines) if s.startswith(WAIT)]
    releases = [i for i, s in enumerate(lines) if s.startswith(RELEASE)]
    assert len(waits) == len(releases) and all(w < r for w, r in zip(waits, releases))
    assert not any(s.startswith(("st.global", "atom.", "red.")) for s in lines[:waits[0]])
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_front_pre_wait_settings_reach_the_config(monkeypatch, chain_mode) -> None:
    """_config turns the module settings into MultiConfig fields (so into the compile key):
    rounds x unroll slices, the router flag only where there is a router; all off without
    the chain."""
    import kimi_decode.kernels.gemv_multi as gm
    rcfg = rf.RouterFastConfig(K3.hidden, K3.num_experts, K3.top_k, 1, K3.routed_scaling)
    segs = (K3.latent_dim, 2 * K3.shared_local_inter)
    monkeypatch.setattr(gm, "ROUTER_PRE_WAIT", True)
    monkeypatch.setattr(gm, "PRE_WAIT_ROUNDS", 2)
    chain_mode(True)
    on = gm._config(K3.hidden, 1, segs, rcfg, 4, {})
    assert (on.peel, on.router_pre) == (8, True)
    mla = gm._config(K3.hidden, 1, (K3.qkv_a_rows, 768), None, 4, {"unroll": 7})
    assert (mla.peel, mla.router_pre) == (14, False)
    chain_mode(False)
    off = gm._config(K3.hidden, 1, segs, rcfg, 4, {})
    assert (off.peel, off.router_pre) == (0, False)


def test_early_release_rows(monkeypatch, chain_mode) -> None:
    monkeypatch.setattr(chain, "EARLY_RELEASE_MAX_ROWS", 1)
    chain_mode(True)
    assert chain.early_release(1) and not chain.early_release(2)
    chain_mode(False)
    assert not chain.early_release(1)
    monkeypatch.setattr(chain, "EARLY_RELEASE_MAX_ROWS", 0)
    chain_mode(True)
    assert not chain.early_release(1)


EARLY_KERNELS: dict[str, Callable[[Path], str]] = {
    "o_proj": lambda d: gemv_ptx(d, GemvConfig(K3.hidden, 768, 1, hint="no_allocate", early=True)),
    "attn_res_mc": lambda d: ptx_of(d, AttnResMC(AttnResMCConfig(K3.hidden, 1, 8, True, True, vec_per_thread=1,
                                                                 world=K3.tp, ctas=pick_ctas(K3.hidden),
                                                                 early=True)),
                                    P(bf), P(bf), P(bf), P(bf), P(bf), P(f32), P(f32), Int32(1), Int32(0),
                                    Float32(1e-5)),
    "moe_up": lambda d: ptx_of(d, k_up.MoeUp(k_up.MoeUpConfig(1, K3.latent_dim, K3.hidden // K3.tp, K3.tp, 8,
                                                              early=True)),
                               P(bf), P(bf), P(bf), P(bf), P(bf), P(bf), Int32(0), Float32(1e-5)),
}


@pytest.mark.parametrize("name", sorted(EARLY_KERNELS))
def test_early_release_ptx(tmp_path: Path, name: str, chain_mode) -> None:
    """Early release (chain.py): the release is the kernel's first chain instruction, before
    any load; the wait still precedes every load of another kernel's output and every store;
    the same weight loads before the wait as without early release."""
    chain_mode(True)
    lines = _lines(EARLY_KERNELS[name](tmp_path))
    assert sum(s.startswith(RELEASE) for s in lines) == 1 and sum(s.startswith(WAIT) for s in lines) == 1
    wait, release = _first(lines, WAIT), _first(lines, RELEASE)
    assert release < wait
    assert not any(s.startswith("ld.global") for s in lines[:release])
    assert not any(s.startswith(("st.global", "atom.", "red.")) for s in lines[:wait])
    pre = sum(s.startswith("ld.global") for s in lines[:wait])
    (tmp_path / "plain").mkdir()
    plain = _lines(KERNELS[name](tmp_path / "plain"))
    assert pre == sum(s.startswith("ld.global") for s in plain[:_first(plain, WAIT)]) > 0



def test_early_flag_is_ignored_outside_the_preloaded_row(tmp_path: Path, chain_mode) -> None:
    """gemv() passes early=True for every plain M = 1 config while the setting is on; only the
    preloaded short row acts on it, so in_proj's split-K kernel still releases after its wait."""
    chain_mode(True)
    lines = _lines(gemv_ptx(tmp_path, GemvConfig(K3.in_proj_rows, K3.hidden, 1, cols=4, kwarps=4, early=True)))
    assert _first(lines, WAIT) < _first(lines, RELEASE)
