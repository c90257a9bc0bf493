"""The GPU check harness (kimi_decode/kernels/checks.py) run on the CPU at K3 width, each
kernel replaced by a torch emulation of its contract: every check must run and pass.

Why: the GPU job gets one device call; a harness bug (a wrong stock call, a missing argument)
would waste it. Oracle: the emulations are the kernels' specifications (float64 statements
or the stock ops), so each check's comparison must come out inside its own tolerance; and a
deliberately wrong emulation must make the check fail (the harness can say no).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass")

import kimi_decode.kernels.attn_res as k_ar  # noqa: E402
import kimi_decode.kernels.gemv as k_gemv  # noqa: E402
import kimi_decode.kernels.kda_decode as k_kda  # noqa: E402
import kimi_decode.kernels.l2_prefetch as k_pf  # noqa: E402
import kimi_decode.kernels.router as k_router  # noqa: E402
from kimi_decode.kernels import checks  # noqa: E402
from tests.kimi_decode.test_fused import _emulate_attn_res, _emulate_kda, _emulate_route  # noqa: E402




@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(k_ar, "attn_res_rmsnorm", _emulate_attn_res)
    monkeypatch.setattr(k_kda, "kda_decode", _emulate_kda)
    monkeypatch.setattr(k_router, "route", _emulate_route)
    monkeypatch.setattr(k_pf, "prefetch_l2", lambda t, n=None: None)
    monkeypatch.setattr(k_gemv, "gemv", lambda x, w: (x.double() @ w.double().t()).to(x.dtype))
    return monkeypatch


def test_harness_passes_faithful_emulations(emulated) -> None:
    rows = (checks.check_attn_res(rows=(1, 4), nbs=(1, 8), timing=False)
            + checks.check_router(rows=(1, 8, 20), timing=False)
            + checks.check_kda(batches=(1,), spec=(0, 7), timing=False)
            + checks.check_gemv(rows=(1,), timing=False, shapes={"o_proj": (7168, 768), "q_b": (1152, 1536)}))
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
    assert {r["kernel"] for r in rows} == {"attn_res", "router", "kda", "gemv"}


def test_harness_rejects_a_wrong_kernel(emulated) -> None:
    """A KDA 'kernel' that forgets to advance the recurrent state fails its check."""
    def forgetful(z, f_b, conv_w, conv_state, dt_bias, a_log, rec_state, o_norm, cfg):
        saved = rec_state.clone()
        out = _emulate_kda(z, f_b, conv_w, conv_state, dt_bias, a_log, rec_state, o_norm, cfg)
        rec_state.copy_(saved)
        return out
    emulated.setattr(k_kda, "kda_decode", forgetful)
    rows = checks.check_kda(batches=(1,), spec=(0,), timing=False)
    assert not rows[0]["ok"]
