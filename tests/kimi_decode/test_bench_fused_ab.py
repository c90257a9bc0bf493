"""bench/fused_ab.py on the CPU: the table from hand-made bench.json files with known cells,
the run loop with a fake process runner (what each variant's command holds, a failed and a
timed-out variant still get their rows, captures keep one tar per variant), and one-line
errors for bad arguments."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

import bench.fused_ab as ab

DEFAULT = frozenset({"gemv", "router_topk"})


def layers(kda: list[float], mla: float, kk: int | list[int], km: int) -> list[dict]:
    ks = kk if isinstance(kk, list) else [kk] * len(kda)
    rows = [{"layer": f"L{4 + i}.kda", "kind": "kda", "median_us": t, "kernels": k} for i, (t, k) in enumerate(zip(kda, ks))]
    return rows + [{"layer": "L7.mla", "kind": "mla", "median_us": mla, "kernels": km}]


def bench(cells: dict[tuple[int, int], list[dict]]) -> dict:
    return {"results": [{"variant": "fused", "batch": b, "spec_tokens": k, "rows": b * (1 + k), "layers": ls}
                        for (b, k), ls in cells.items()],
            "meta": {"fused": {"gpu": "NVIDIA H200", "commit": "abc1234", "date": "2026-12-04", "copy_bw_tbs": 4.2259}}}


def test_cells_are_the_kda_range_and_the_mla_layer() -> None:
    b = bench({(8, 0): layers([198.3, 202.3, 200.0], 224.4, 13, 17),
               (1, 7): layers([203.0, 201.5, 205.1], 220.4, [12, 12, 13], 20),
               (1, 0): layers([84.5], 97.7, 10, 13)})
    result = {"reps": 50, "variants": [{"name": "w16d", "args": ["--patch", "m:X=1"], "clock_utc": "15:40", "rc": 0,
                                         "bench": b}]}
    assert ab.shapes(result) == [(1, 0), (1, 7), (8, 0)]           # M = 1, then M = 8 at B = 1 before B = 8
    assert ab.cell(b, (1, 7)) == "201.5-205.1 / 220.4 (12-13/20)"
    assert ab.cell(b, (8, 0)) == "198.3-202.3 / 224.4 (13/17)"
    assert ab.cell(b, (1, 0)) == "84.5 / 97.7 (10/13)"
    assert ab.cell(b, (64, 0)) == "-"
    md = ab.render(result)
    assert "| 15:40 | w16d | `--patch m:X=1` | 84.5 / 97.7 (10/13) | 201.5-205.1 / 220.4 (12-13/20) |" in md
    assert "| B = 1, k = 0 | B = 1, k = 7 | B = 8, k = 0 |" in md
    assert "commit abc1234" in md and "4.23 TB/s" in md


def test_run_keeps_going_past_a_failed_and_a_timed_out_variant(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    cmds: dict[str, list[str]] = {}

    def runner(cmd: list[str], timeout: float) -> SimpleNamespace:
        name = Path(cmd[cmd.index("--out") + 1]).name
        cmds[name] = cmd
        if name == "slow":
            raise subprocess.TimeoutExpired(cmd, timeout)
        if name == "bad":
            return SimpleNamespace(returncode=1)
        (work / name).mkdir(parents=True)
        (work / name / "bench.json").write_text(json.dumps(bench({(1, 7): layers([200.0, 202.0], 219.0, 12, 20)})))
        return SimpleNamespace(returncode=0)

    assert ab.kernels_for(["--opt-in=gemv_mma_pair", "--patch", "m:X=1"], DEFAULT) == ["gemv", "gemv_mma_pair", "router_topk"]
    variants = [ab.parse_variant("base:"), ab.parse_variant("bad: --patch m:X=1"),
                ab.parse_variant("mma: --opt-in gemv_mma_pair experts_one --patch 'm:Y=(1, 2)'"),
                ab.parse_variant("slow: --patch m:Z=0")]
    res = ab.run(variants, out, work, DEFAULT, [1], [7], 50, 10.0, False, runner=runner)
    assert [v["rc"] for v in res["variants"]] == [0, 1, 0, "timeout"]
    kern = cmds["mma"][cmds["mma"].index("--kernels") + 1:cmds["mma"].index("--skip")]
    assert kern == ["experts_one", "gemv", "gemv_mma_pair", "router_topk"]
    assert cmds["mma"][-5:] == ["--opt-in", "gemv_mma_pair", "experts_one", "--patch", "m:Y=(1, 2)"]
    base = cmds["base"]
    assert base[base.index("--skip") + 1:base.index("--skip") + 4] == ["step", "ref", "capture"]
    assert base[base.index("--bench-spec") + 1] == "7" and base[base.index("--reps") + 1] == "50"
    md = (out / "ab.md").read_text()
    assert md == ab.render(json.loads((out / "ab.json").read_text()))
    assert "| bad | `--patch m:X=1` | no bench.json (rc 1) |" in md
    assert "(rc timeout)" in md and md.count("200.0-202.0 / 219.0 (12/20)") == 2


def test_captures_keep_one_tar_per_variant(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"

    def runner(cmd: list[str], timeout: float) -> SimpleNamespace:
        assert cmd[cmd.index("--skip") + 1:cmd.index("--skip") + 4] == ["step", "ref", "bench"]
        d = Path(cmd[cmd.index("--out") + 1])
        d.mkdir(parents=True)
        (d / "traces1.tar").write_bytes(d.name.encode())
        return SimpleNamespace(returncode=0)

    res = ab.run([ab.parse_variant("a:"), ab.parse_variant("b:")], out, work, DEFAULT, [1], [0], 5, 10.0, True,
                 runner=runner)
    assert [v["traces"] for v in res["variants"]] == [["a.traces1.tar"], ["b.traces1.tar"]]
    assert (out / "b.traces1.tar").read_bytes() == b"b"
    assert "| a | `(default)` | a.traces1.tar (rc 0) |" in (out / "ab.md").read_text()


@pytest.mark.parametrize("spec", ["no colon", ": --patch x", "a b: --patch x"])
def test_bad_variant_is_a_one_line_error(spec: str) -> None:
    with pytest.raises(SystemExit) as e:
        ab.main(["--out", "/tmp/unused", "--variant", spec])
    assert str(e.value).startswith("fused_ab: --variant")


def test_repeated_names_and_bad_render_input_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="variant names repeat"):
        ab.main(["--out", str(tmp_path), "--variant", "base:", "--variant", "base:"])
    seven = [f"--variant=v{i}:" for i in range(7)]
    with pytest.raises(SystemExit, match="at most 6 variants, got 7"):
        ab.main(["--out", str(tmp_path), "--captures", *seven])
    bad = tmp_path / "ab.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match=r"fused_ab: .*ab.json: not an ab.json"):
        ab.main(["--render", str(bad)])


def test_batches_without_k0_are_refused_not_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/decode.py times B at k = 0 only when 0 is among the k values, so `--batch 8 --spec 7`
    would have run B = 1, k = 7 alone (session 15's first try): refused in one line, before any
    variant runs; `--spec 7` alone (the default batches unused) and `--batch 8 --spec 0 7` run."""
    calls: list[tuple] = []
    monkeypatch.setattr(ab, "run", lambda variants, out, work, default, batches, specs, *rest:
                        calls.append((batches, specs)) or (out / "ab.md").write_text(""))
    with pytest.raises(SystemExit, match=r"^fused_ab: --batch 8 runs at k = 0, but --spec 7 has no 0"):
        ab.main(["--out", str(tmp_path), "--batch", "8", "--spec", "7", "--variant", "base:"])
    assert calls == []
    ab.main(["--out", str(tmp_path), "--spec", "7", "--variant", "base:"])
    ab.main(["--out", str(tmp_path), "--batch", "8", "--spec", "0", "7", "--variant", "base:"])
    assert calls == [([1, 8], [7]), ([8], [0, 7])]
