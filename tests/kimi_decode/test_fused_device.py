"""A CPU dry run of the fused GPU job (bench/fused_device.py) on the tiny config, with the
kernels emulated in torch (the emulations of test_fused.py) and switched on everywhere.

Why: the job gets one device call; its step-parity, reference, report and capture code must
not be the thing that fails there. Oracle: with faithful emulations every phase must report
"ok" (fused matches stock and the float64 reference), the markdown report must say pass for
every row, and the fused eager trace must carry the fused variant, kernels on, and the
prefetch op name with at least one kernel launched under it.
"""
from __future__ import annotations

import gzip
import json
import tarfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("cutlass")

import bench.fused_device as fd  # noqa: E402
import kimi_decode.fused as fused_mod  # noqa: E402
import kimi_decode.kernels as kernels_pkg  # noqa: E402
import kimi_decode.kernels.attn_res as k_ar  # noqa: E402
import kimi_decode.kernels.gemv as k_gemv  # noqa: E402
import kimi_decode.kernels.kda_decode as k_kda  # noqa: E402
import kimi_decode.kernels.l2_prefetch as k_pf  # noqa: E402
import kimi_decode.kernels.router as k_router  # noqa: E402
from kimi_decode.config import tiny  # noqa: E402
from tests.kimi_decode.test_fused import _emulate_attn_res, _emulate_kda, _emulate_route  # noqa: E402

ALL = frozenset({"attn_res", "kda", "router", "gemv", "prefetch"})


@pytest.fixture
def dry(monkeypatch, tmp_path):
    monkeypatch.setattr(fd, "DEVICE", "cpu")
    monkeypatch.setattr(fd, "make_cfg", lambda **kw: tiny(sim_world=1, **kw))   # tp_sim over 1 rank
    monkeypatch.setattr(fd, "STEP_SHAPES", [(1, 0), (3, 7)])
    monkeypatch.setattr(fd, "CAPTURE_SHAPES", [(2, 0)])
    monkeypatch.setattr(fd, "RESULTS", {})
    monkeypatch.setattr(fused_mod, "_kernels_usable", lambda dev: True)
    monkeypatch.setattr(kernels_pkg, "applicable", lambda name, cfg: True)
    monkeypatch.setattr(k_ar, "attn_res_rmsnorm", _emulate_attn_res)
    monkeypatch.setattr(k_kda, "kda_decode", _emulate_kda)
    monkeypatch.setattr(k_router, "route", _emulate_route)
    monkeypatch.setattr(k_gemv, "can_implement", lambda *a: True)
    monkeypatch.setattr(k_gemv, "gemv", lambda x, w: x @ w.t())
    # the prefetch 'kernel' must leave a kernel-like trace of itself: a tiny op under the range
    monkeypatch.setattr(k_pf, "prefetch_l2", lambda t, n=None: t.reshape(-1)[:16].sum())
    monkeypatch.setattr(fused_mod, "VERIFIED", ALL)
    monkeypatch.setattr(fused_mod, "DEFAULT_KERNELS", ALL)   # the job sets both; restored after
    return tmp_path


def test_dry_run_of_the_gpu_job(dry: Path) -> None:
    base = {"expert_impl": "gather_bmm", "compile_ops": False}
    steps = fd.step_parity(ALL, base) + fd.step_parity(ALL, base, forced=True)
    assert all(r["ok"] for r in steps), steps
    forced = [r for r in steps if r["routing"].startswith("forced")]
    assert forced and all(r["sequences_compared"].split("/")[0] == r["sequences_compared"].split("/")[1]
                          for r in forced)
    assert all(set(r["kernels"]) == ALL for r in steps)
    refs = fd.reference_check(ALL, base)
    assert all(r["ok"] for r in refs), refs
    md = fd.report([{"kernel": "gemv", "M": 1, "ok": True, "stock_us": 2.0, "kernel_us": 1.0}], steps, refs, ALL)
    assert "FAIL" not in md and md.count("| pass |") == 1 + len(steps) + sum(len(r["steps"]) for r in refs)
    info = fd.captures(dry, ALL, base, steps=1, budget_s=1e9)
    assert [i["file"] for i in info if "error" not in i] == ["k3_fused_b2_k0_eager.json.gz"], info
    with tarfile.open(next(dry.glob("traces*.tar"))) as tar:
        raw = tar.extractfile("k3_fused_b2_k0_eager.json.gz").read()
    meta = json.loads(gzip.decompress(raw))["decodescope"]
    assert meta["variant"] == "fused" and meta["prefetch_ops"] == "^prefetch$"
    assert sorted(meta["fused_kernels"]) == sorted(ALL)
    assert json.loads((dry / "results.json").read_text())["captures"][0]["file"].startswith("k3_fused")


def test_step_verdict_says_not_compared_only_when_nothing_was_left() -> None:
    """An own-routing row whose every sequence diverged in step 0 (a routing near-tie) has no
    numbers: "not compared", never "pass"; a row with numbers over the tolerance, or a forced
    row without numbers, stays FAIL."""
    base = {"errors": {}, "ok": False, "routing": "own", "sequences_compared": "0/1"}
    assert fd.step_verdict(base).startswith("not compared")
    assert fd.step_verdict({**base, "routing": "forced (stock's)", "sequences_compared": "0/1"}) == "FAIL"
    assert fd.step_verdict({**base, "errors": {"m": 0.5}}) == "FAIL"
    assert fd.step_verdict({**base, "sequences_compared": "2/8"}) == "FAIL"
    assert fd.step_verdict({**base, "ok": True, "errors": {"m": 1e-3}, "sequences_compared": "1/1"}) == "pass"


def test_patch_sets_attributes_and_dict_items(monkeypatch) -> None:
    """--patch: an attribute and a dict item of a module set from literals; the job's A/B runs
    (gemv_mma.TUNED entries, fused.MAX_ROWS) use exactly these two forms."""
    import kimi_decode.kernels.gemv_mma as gm
    monkeypatch.setattr(gm, "TUNED", {})
    monkeypatch.setattr(gm, "UNROLL", gm.UNROLL)
    monkeypatch.setitem(fused_mod.MAX_ROWS, "kda", fused_mod.MAX_ROWS["kda"])
    assert fd.apply_patch("kimi_decode.kernels.gemv_mma:TUNED[(3584, 7168)]=(16, 4)")
    assert gm.TUNED == {(3584, 7168): (16, 4)}
    fd.apply_patch('kimi_decode.fused:MAX_ROWS["kda"] = 8')
    assert fused_mod.MAX_ROWS["kda"] == 8
    fd.apply_patch("kimi_decode.kernels.gemv_mma:UNROLL=8")
    assert gm.UNROLL == 8


def test_patched_stream_priorities_reach_the_streams(monkeypatch) -> None:
    """The session-13 A/B (bench/fused_runs.md): --patch sets runner.MAIN_STREAM_PRIORITY and
    comm.SIDE_STREAM_PRIORITY before anything is built, and the capture stream and the aux
    stream are created with them (torch.cuda.Stream replaced: no GPU here)."""
    import kimi_decode.comm as comm
    import kimi_decode.runner as runner
    made: list[tuple[object, int]] = []

    class FakeStream:
        def __init__(self, device: object = None, priority: int = 0) -> None:
            made.append((device, priority))

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(runner, "_capture_streams", {})
    monkeypatch.setattr(runner, "MAIN_STREAM_PRIORITY", runner.MAIN_STREAM_PRIORITY)
    monkeypatch.setattr(comm, "SIDE_STREAM_PRIORITY", comm.SIDE_STREAM_PRIORITY)
    default = runner.capture_stream()
    assert made == [(torch.device("cuda", 0), 0)] and runner.capture_stream("cuda:0") is default
    fd.apply_patch("kimi_decode.runner:MAIN_STREAM_PRIORITY=-1")
    high = runner.capture_stream("cuda")
    assert high is not default and made[-1] == (torch.device("cuda", 0), -1)
    fd.apply_patch("kimi_decode.comm:SIDE_STREAM_PRIORITY=-1")
    comm.SideStream(torch.device("cuda", 0))
    assert made[-1] == (torch.device("cuda", 0), -1) and len(made) == 3


@pytest.mark.parametrize("spec,msg", [
    ("kimi_decode.fused:MAX_ROWS", "expected module:NAME=LITERAL"),          # no value
    ("kimi_decode.fused:MAX_ROWS=os.getcwd()", "expected module:NAME=LITERAL"),   # not a literal
    ("kimi_decode.fused:NO_SUCH=1", "has no attribute 'NO_SUCH'"),
    ("kimi_decode.fused:OPT_IN[1]=2", "is not a dict"),
])
def test_patch_refuses_what_it_cannot_set(spec: str, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        fd.apply_patch(spec)


def test_bad_patch_is_a_one_line_error(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.argv", ["fused_device", "--out", str(tmp_path / "o"), "--patch", "kimi_decode.fused:X=1"])
    with pytest.raises(SystemExit) as e:
        fd.main()
    assert "fused_device: --patch" in str(e.value) and "has no attribute 'X'" in str(e.value)


def test_opt_in_kernels_are_timed_only_when_named() -> None:
    """--opt-in: an opt-in kernel (fused.OPT_IN) that passed is left out of the bench and the
    captures unless named (the session-14 router_mma A/Bs, when it was opt-in); kernels outside
    OPT_IN always run, a failed kernel never does."""
    assert "experts_one" in fused_mod.OPT_IN and "router_mma" not in fused_mod.OPT_IN
    passed = frozenset({"gemv", "router_mma", "gemv_mma_pair", "experts_one"})
    assert fd.timed_set(passed) == {"gemv", "router_mma", "gemv_mma_pair"}
    assert fd.timed_set(passed, ["experts_one"]) == {"gemv", "router_mma", "gemv_mma_pair", "experts_one"}
    assert fd.timed_set(passed - {"experts_one"}, ["experts_one"]) == {"gemv", "router_mma", "gemv_mma_pair"}


def test_unknown_opt_in_is_refused(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.argv", ["fused_device", "--out", str(tmp_path / "o"), "--opt-in", "gemv"])
    with pytest.raises(SystemExit) as e:
        fd.main()
    assert e.value.code == 2 and "invalid choice: 'gemv'" in capsys.readouterr().err


def test_patches_reach_the_isolated_checks(tmp_path, monkeypatch) -> None:
    """--patch with --check: each kernel's isolated child gets the same --patch arguments, so an
    A/B setting (moe_up_grid:PHASE1_SPREAD=True) is checked as the bench will run it; without
    them the child checked the module default and the verdict said nothing about the setting."""
    calls: list[list[str]] = []

    class FakeProc:
        returncode = 0

        def __init__(self, argv, **kw) -> None:
            calls.append(list(argv))

        def communicate(self, timeout=None):
            return (b"ISOLATED-OK\n", b"")

    monkeypatch.setattr("subprocess.Popen", FakeProc)
    spec = "kimi_decode.kernels.moe_up_grid:PHASE1_SPREAD=True"
    ok = fd.isolated_checks(tmp_path, ("moe_up_grid", "router"), [spec])
    assert ok == {"moe_up_grid", "router"} and len(calls) == 2
    for argv in calls:
        assert argv[argv.index("--patch") + 1:] == [spec]
    calls.clear()
    fd.isolated_checks(tmp_path, ("router",))
    assert "--patch" not in calls[0]


@pytest.mark.parametrize("layers", [None, "88-91"])
def test_bench_layers_reach_the_bench(tmp_path, monkeypatch, layers: str | None) -> None:
    """--bench-layers: the bench times the layers named (bench/decode.py --layers), the
    committed tables' 4-7 by default; session 34's deeper-layer A/B of attn_res_mc's block
    rule ran layers 40-43 and 88-91 this way."""
    import bench.decode
    seen: list[list[str]] = []
    monkeypatch.setattr(bench.decode, "main", lambda argv, copy_bw=None: seen.append(list(argv)))
    monkeypatch.setattr(fd.torch.cuda, "get_device_name", lambda *a: "cpu")   # the log line only
    monkeypatch.setattr(bench.decode, "copy_bandwidth", lambda: 1e12)           # no GPU to copy on
    monkeypatch.setattr(fd, "RESULTS", {})
    import kimi_decode.fused as fused_mod          # the job sets both; restored after
    monkeypatch.setattr(fused_mod, "VERIFIED", fused_mod.VERIFIED)
    monkeypatch.setattr(fused_mod, "DEFAULT_KERNELS", fused_mod.DEFAULT_KERNELS)
    args = ["--bench-layers", layers] if layers else []
    monkeypatch.setattr("sys.argv", ["fused_device", "--out", str(tmp_path / "o"), "--kernels", "gemv",
                                     "--skip", "step", "ref", "capture", *args])
    fd.main()
    assert len(seen) == 1
    argv = seen[0]
    assert argv[argv.index("--layers") + 1] == (layers or "4-7")


def test_missing_cute_dsl_stops_the_job_in_one_line(tmp_path, monkeypatch) -> None:
    """Without CUTLASS DSL (a device call whose install call got no machine, session 37) the job
    exits at once with one line and writes nothing, instead of a traceback per check and step."""
    import kimi_decode.kernels.moe_up_cluster as kc
    monkeypatch.setattr(kc, "ALL_PASSES_LOADS_FIRST", False)   # restored even if the patch below ran
    real = fd.importlib.util.find_spec
    monkeypatch.setattr(fd.importlib.util, "find_spec", lambda name, *a: None if name == "cutlass" else real(name, *a))
    out = tmp_path / "o"
    monkeypatch.setattr("sys.argv", ["fused_device", "--out", str(out), "--skip", "ref", "bench", "capture",
                                     "--patch", "kimi_decode.kernels.moe_up_cluster:ALL_PASSES_LOADS_FIRST=True"])
    with pytest.raises(SystemExit) as e:
        fd.main()
    msg = str(e.value)
    assert msg.startswith("fused_device: CUTLASS DSL is not installed") and "\n" not in msg
    assert not out.exists()


def test_stock_only_bench_runs_without_cute_dsl() -> None:
    assert not fd.needs_cute_dsl(["kernels", "step", "ref", "capture"], ["stock"])
    assert fd.needs_cute_dsl(["kernels", "step", "ref", "capture"], ["stock", "fused"])
    assert fd.needs_cute_dsl(["kernels", "step", "ref"], ["stock"])      # the captures run fused
    assert fd.needs_cute_dsl([], ["stock"])
