"""Classifier: defaults by name, metadata beats name, op regexes on the launching annotation,
user rules from JSON/TOML beat both; memops stay 'memory' unless a prefetch rule matches."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.kineto_builder import KinetoTraceBuilder
from tracer.classify import load_user_rules
from tracer.errors import BadInput
from tracer.ingest import ingest_path
from tracer.store import open_store


def _trace(tmp_path: Path, meta: dict | None = None) -> Path:
    b = KinetoTraceBuilder()
    b.annotation("L3.mla", 0, 10_000, tid=1)
    b.annotation("o_proj+ar", 1_000, 2_000, tid=1)          # innermost around the 1st launch
    b.launch("cross_device_reduce_1stage", 1_500, 100, 5_000, 300, stream=7, tid=1)
    b.launch("ncclDevKernel_AllReduce_Sum", 4_000, 100, 6_000, 300, stream=7, tid=1)
    b.launch("sm90_gemm", 4_500, 100, 7_000, 300, stream=7, tid=1)
    b.launch("sm90_gemm_prefetched_weights", 4_600, 100, 8_000, 300, stream=9, tid=1)
    b.launch("my_comm_kernel", 4_700, 100, 9_000, 300, stream=13, tid=1)
    b.memcpy(9_500, 100, stream=9)
    b.memcpy(9_700, 100, stream=7)
    return b.write(tmp_path / "t.json", decodescope_meta=meta)


def _cats(con) -> dict[str, str]:
    return dict(con.execute("SELECT name, category FROM kernels").fetchall())


def test_default_rules(tmp_path: Path) -> None:
    con = open_store(None)
    ingest_path(con, _trace(tmp_path), progress=False)
    assert _cats(con) == {"cross_device_reduce_1stage": "communication", "ncclDevKernel_AllReduce_Sum": "communication",
                          "sm90_gemm": "compute", "sm90_gemm_prefetched_weights": "prefetch", "my_comm_kernel": "compute"}
    assert con.execute("SELECT DISTINCT category FROM memops").fetchall() == [("memory",)]
    origins = con.execute("SELECT DISTINCT origin FROM category_rules").fetchall()
    assert origins == [("default",)]


def test_metadata_streams_and_ops_beat_names(tmp_path: Path) -> None:
    meta = {"comm_streams": [13], "prefetch_streams": [9], "comm_ops": [r"^o_proj\+ar$"]}
    con = open_store(None)
    ingest_path(con, _trace(tmp_path, meta), progress=False)
    cats = _cats(con)
    assert cats["my_comm_kernel"] == "communication"           # stream 13
    assert cats["sm90_gemm_prefetched_weights"] == "prefetch"  # stream 9
    assert cats["sm90_gemm"] == "compute"
    mem = dict(con.execute("SELECT stream, category FROM memops").fetchall())
    assert mem == {9: "prefetch", 7: "memory"}


def test_metadata_stream_overrides_a_communication_name(tmp_path: Path) -> None:
    # Name says all-reduce, but the capture metadata puts stream 7 under prefetch: metadata wins.
    con = open_store(None)
    ingest_path(con, _trace(tmp_path, {"prefetch_streams": [7]}), progress=False)
    assert _cats(con)["cross_device_reduce_1stage"] == "prefetch"


@pytest.mark.parametrize("fmt", ["json", "toml"])
def test_user_rules_files(tmp_path: Path, fmt: str) -> None:
    if fmt == "json":
        rules = tmp_path / "r.json"
        rules.write_text(json.dumps({"rules": [{"category": "communication", "name_regex": "my_comm"},
                                               {"category": "compute", "op_regex": "o_proj"}]}))
    else:
        rules = tmp_path / "r.toml"
        rules.write_text('[[rules]]\ncategory = "communication"\nname_regex = "my_comm"\n\n'
                         '[[rules]]\ncategory = "compute"\nop_regex = "o_proj"\n')
    con = open_store(None)
    ingest_path(con, _trace(tmp_path), progress=False, rules=rules)
    cats = _cats(con)
    assert cats["my_comm_kernel"] == "communication"
    assert cats["cross_device_reduce_1stage"] == "compute"   # user op rule beats the default name rule
    assert cats["ncclDevKernel_AllReduce_Sum"] == "communication"  # launched outside o_proj+ar
    n_user = con.execute("SELECT count(*) FROM category_rules WHERE origin = 'user'").fetchall()[0][0]
    assert n_user == 2


@pytest.mark.parametrize("text, problem", [
    ('{"rules": [{"category": "magic", "name_regex": "x"}]}', "category must be one of"),
    ('{"rules": [{"category": "compute", "name_regex": "("}]}', "not a valid RE2 regex"),
    ('{"rules": [{"category": "compute"}]}', "matches everything"),
    ('{"rules": [{"category": "compute", "stream": "7"}]}', "stream must be an integer"),
    ('{"rules": [{"category": "compute", "nme_regex": "x"}]}', "unknown keys"),
    ('{"rules": 3}', "expected a list"),
    ("{not json", "not valid JSON"),
])
def test_bad_rules_files(tmp_path: Path, text: str, problem: str) -> None:
    p = tmp_path / "rules.json"
    p.write_text(text)
    with pytest.raises(BadInput, match=problem):
        load_user_rules(p)
