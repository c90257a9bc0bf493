"""Attribution on hand-made store rows: every expected answer is derived in the docstring from
the ranges and launch times written in the test (half-open ranges: a launch at a range's end is
outside it)."""
from __future__ import annotations

import duckdb
import pytest
from hypothesis import given
from hypothesis import strategies as st

from analyzers.attribution import attribute, load_sql
from tests.analyzers.attribution_rows import RunRows, attribution_rows
from tracer.errors import BadInput
from tracer.store import open_store


@pytest.fixture
def con() -> duckdb.DuckDBPyConnection:
    return open_store(None)


def _eager_run(run_id: int = 1) -> tuple[RunRows, dict[str, tuple]]:
    """Two steps on thread 1; thread 2 has its own layer; thread 3 has no range.

    thread 1:  step [0,1000) > L0.mla [100,500) > q_proj [150,250), attn [250,450) > inner [300,350)
                             > L1.kda [500,900) > o_proj+ar [600,800)
               step [1000,2000) > L0.mla [1100,1500)
    thread 2:  L5.dense [0,1000)
    Launch at t on thread -> (step_index, layer, kind, op, method):
      t=50 tid1   -> step 0 only: innermost is the step itself, so op NULL     (0, None, None, None, range)
      t=120 tid1  -> inside L0.mla, no op below it                            (0, L0.mla, mla, None)
      t=200 tid1  -> q_proj                                                   (0, L0.mla, mla, q_proj)
      t=320 tid1  -> inner (innermost of attn > inner)                        (0, L0.mla, mla, inner)
      t=400 tid1  -> attn                                                     (0, L0.mla, mla, attn)
      t=500 tid1  -> L0.mla has ended (half-open), L1.kda has begun           (0, L1.kda, kda, None)
      t=700 tid1  -> o_proj+ar                                                (0, L1.kda, kda, o_proj+ar)
      t=1000 tid1 -> step 0 ended, step 1 begins; no layer                    (1, None, None, None)
      t=1200 tid1 -> step 1, L0.mla                                           (1, L0.mla, mla, None)
      t=2500 tid1 -> no range at all                                          (None, ..., none)
      t=200 tid2  -> L5.dense on its own thread, no step there                (None, L5.dense, dense, None)
      t=200 tid3  -> nothing: tid1's open ranges do not count on tid3         (None, ..., none)
    The memop launched at t=200 tid1 gets q_proj like a kernel. Kernels use two streams.
    """
    r = RunRows(run_id, name=f"eager{run_id}")
    r.range("step", 0, 1000)
    r.range("L0.mla", 100, 500, depth=1)
    r.range("q_proj", 150, 250, depth=2)
    r.range("attn", 250, 450, depth=2)
    r.range("inner", 300, 350, depth=3)
    r.range("L1.kda", 500, 900, depth=1)
    r.range("o_proj+ar", 600, 800, depth=2)
    r.range("step", 1000, 2000)
    r.range("L0.mla", 1100, 1500, depth=1)
    r.range("L5.dense", 0, 1000, tid=2)
    expected: dict[str, tuple] = {}
    cases = [
        ("k50", 50, 1, (0, None, None, None, "range")),
        ("k120", 120, 1, (0, "L0.mla", "mla", None, "range")),
        ("k200", 200, 1, (0, "L0.mla", "mla", "q_proj", "range")),
        ("k320", 320, 1, (0, "L0.mla", "mla", "inner", "range")),
        ("k400", 400, 1, (0, "L0.mla", "mla", "attn", "range")),
        ("k500", 500, 1, (0, "L1.kda", "kda", None, "range")),
        ("k700", 700, 1, (0, "L1.kda", "kda", "o_proj+ar", "range")),
        ("k1000", 1000, 1, (1, None, None, None, "range")),
        ("k1200", 1200, 1, (1, "L0.mla", "mla", None, "range")),
        ("k2500", 2500, 1, (None, None, None, None, "none")),
        ("k200t2", 200, 2, (None, "L5.dense", "dense", None, "range")),
        ("k200t3", 200, 3, (None, None, None, None, "none")),
    ]
    for i, (name, t, tid, exp) in enumerate(cases):
        corr = r.launch(t, tid=tid)
        r.kernel(name, 10_000 + 100 * i, 10_050 + 100 * i, corr, stream=7 + i % 2)
        expected[name] = exp
    corr = r.launch(200)
    r.memop("Memcpy HtoD", 20_000, 20_010, corr)
    expected["Memcpy HtoD"] = (0, "L0.mla", "mla", "q_proj", "range")
    return r, expected


def _by_name(con: duckdb.DuckDBPyConnection, run_id: int) -> dict[str, tuple]:
    rows = attribution_rows(con, run_id)
    names = dict(con.execute("SELECT 'kernel' || kernel_id, name FROM kernels WHERE run_id = ? UNION ALL "
                             "SELECT 'memop' || memop_id, name FROM memops WHERE run_id = ?",
                             [run_id, run_id]).fetchall())
    return {names[k + str(i)]: v for (k, i), v in rows.items()}


def test_nested_ranges_threads_streams(con: duckdb.DuckDBPyConnection) -> None:
    run, expected = _eager_run()
    run.insert(con)
    report = attribute(con)
    assert _by_name(con, 1) == expected
    r = report.runs[1]
    assert (r.items, r.kernels, r.unlaunched) == (13, 12, 0)
    assert r.by_method["range"] == 11 and r.by_method["none"] == 2
    # columns of the contract, in order
    cols = [c[0] for c in con.execute("SELECT * FROM kernel_attribution LIMIT 0").description]
    assert cols == ["run_id", "rank", "item_kind", "item_id", "step", "step_index", "layer",
                    "layer_index", "layer_kind", "op", "method", "capture_stream"]
    assert con.execute("SELECT DISTINCT layer_index FROM kernel_attribution WHERE layer = 'L5.dense'"
                       ).fetchall() == [(5,)]


def test_refresh_keeps_other_runs(con: duckdb.DuckDBPyConnection) -> None:
    """Attributing run 2 after run 1 keeps run 1's rows; re-attributing run 1 replaces them."""
    for rid in (1, 2):
        _eager_run(rid)[0].insert(con)
    attribute(con, [1])
    attribute(con, [2])
    attribute(con, [1])
    counts = dict(con.execute("SELECT run_id, count(*) FROM kernel_attribution GROUP BY ALL").fetchall())
    assert counts == {1: 13, 2: 13}


def test_profiler_step_fallback_and_user_step_pattern(con: duckdb.DuckDBPyConnection) -> None:
    """Run 1 has only ProfilerStep#7 and #8 -> those are the steps (index 0, 1).
    Run 2 has ProfilerStep#1 [0,1000) around `step` [100,900): our `step` wins, so a launch at
    50 is in no step and one at 500 is step 0. With --step-pattern '^iter' run 3's `iter_a`
    [0,10) and `iter_b` [10,20) are steps 0 and 1."""
    r1 = RunRows(1)
    r1.range("ProfilerStep#7", 0, 100)
    r1.range("ProfilerStep#8", 100, 200)
    r1.kernel("a", 1000, 1001, r1.launch(150))
    r1.insert(con)
    r2 = RunRows(2)
    r2.range("ProfilerStep#1", 0, 1000)
    r2.range("step", 100, 900, depth=1)
    r2.kernel("a", 1000, 1001, r2.launch(50))
    r2.kernel("b", 1002, 1003, r2.launch(500))
    r2.insert(con)
    attribute(con)
    assert _by_name(con, 1)["a"][0] == 1
    assert _by_name(con, 2)["a"][0] is None and _by_name(con, 2)["b"][0] == 0
    r3 = RunRows(3)
    r3.range("iter_a", 0, 10)
    r3.range("iter_b", 10, 20)
    r3.kernel("x", 100, 101, r3.launch(15))
    r3.insert(con)
    attribute(con, [3], step_pattern="^iter")
    assert con.execute("SELECT step, step_index FROM kernel_attribution WHERE run_id = 3").fetchall() \
        == [("iter_b", 1)]


def test_default_step_names(con: duckdb.DuckDBPyConnection) -> None:
    """SGLang's `step[DECODE bs=32]` and `step 2` are steps; `stepper` is not (a launch in it
    is in no step, and `stepper` is its op)."""
    r = RunRows(1)
    r.range("step[DECODE bs=32]", 0, 10)
    r.range("step 2", 10, 20)
    r.range("stepper", 20, 30)
    for t in (5, 15, 25):
        r.kernel(f"k{t}", 100 + t, 101 + t, r.launch(t))
    r.insert(con)
    attribute(con)
    got = _by_name(con, 1)
    assert (got["k5"][0], got["k15"][0], got["k25"]) == (0, 1, (None, None, None, "stepper", "range"))


def test_foreign_module_names(con: duckdb.DuckDBPyConnection) -> None:
    """HF/vLLM names: `model.layers.3` > `model.layers.3.self_attn` > `...self_attn.q_proj`.
    Launch at 150 (inside q_proj) -> layer model.layers.3, op `self_attn.q_proj`, index 3,
    kind NULL (the default pattern has no kind for module names). Launch at 450 (inside
    `model.layers.3.mlp` with no `model.layers.3` range around it) -> layer model.layers.3,
    op `mlp`. Launch at 50 inside `model.layers.3` only -> op NULL. A custom pattern
    `blk(?P<layer>\\d+)` on `blk12/attn` -> layer `12`, index 12."""
    r = RunRows(1)
    r.range("model.layers.3", 0, 300)
    r.range("model.layers.3.self_attn", 100, 200, depth=1)
    r.range("model.layers.3.self_attn.q_proj", 140, 160, depth=2)
    r.range("model.layers.3.mlp", 400, 500)
    for i, t in enumerate((150, 450, 50)):
        r.kernel(f"k{t}", 1000 + 10 * i, 1005 + 10 * i, r.launch(t))
    r.insert(con)
    attribute(con)
    got = _by_name(con, 1)
    assert got["k150"] == (None, "model.layers.3", None, "self_attn.q_proj", "range")
    assert got["k450"] == (None, "model.layers.3", None, "mlp", "range")
    assert got["k50"] == (None, "model.layers.3", None, None, "range")
    r2 = RunRows(2)
    r2.range("blk12/attn", 0, 10)
    r2.kernel("x", 100, 101, r2.launch(5))
    r2.insert(con)
    attribute(con, [2], layer_pattern=r"blk(?P<layer>\d+)")
    assert con.execute("SELECT layer, layer_index FROM kernel_attribution WHERE run_id = 2").fetchall() \
        == [("12", 12)]


def test_bad_patterns(con: duckdb.DuckDBPyConnection) -> None:
    with pytest.raises(BadInput, match="named group"):
        attribute(con, layer_pattern=r"L\d+")
    with pytest.raises(BadInput, match="regular expression"):
        attribute(con, layer_pattern=r"(?P<layer>")


def test_gpu_fallback_unlaunched(con: duckdb.DuckDBPyConnection) -> None:
    """Kernels a [1000,1100) and b [1200,1300) launched in L0.mla/q_proj (step 0), c [1400,1500)
    launched in L1.kda/o_proj, d [1450, 1600) launched in L1.kda/attn. GPU spans:
    L0.mla [1000,1300), q_proj the same; L1.kda [1400,1600), o_proj [1400,1500),
    attn [1450,1600); step 0 [1000,1600).
    Unlaunched: u1 [1150,1180) -> only L0.mla holds it, op q_proj (gpu_range);
    u2 [1460,1490) -> L1.kda only, but o_proj and attn both hold it: layer yes, op NULL;
    u3 [1310,1390) -> between layers: no layer span, one step span -> step 0 only;
    u4 [5000,5001) -> nothing holds it -> method none."""
    r = RunRows(1)
    r.range("step", 0, 1000)
    r.range("L0.mla", 0, 400, depth=1)
    r.range("q_proj", 0, 400, depth=2)
    r.range("L1.kda", 400, 900, depth=1)
    r.range("o_proj", 400, 500, depth=2)
    r.range("attn", 500, 600, depth=2)
    r.kernel("a", 1000, 1100, r.launch(10))
    r.kernel("b", 1200, 1300, r.launch(20))
    r.kernel("c", 1400, 1500, r.launch(450))
    r.kernel("d", 1450, 1600, r.launch(550))
    r.kernel("u1", 1150, 1180, None)
    r.kernel("u2", 1460, 1490, 999_999)  # a correlation with no call
    r.kernel("u3", 1310, 1390, None)
    r.kernel("u4", 5000, 5001, None)
    r.insert(con)
    rep = attribute(con)
    got = _by_name(con, 1)
    assert got["u1"] == (0, "L0.mla", "mla", "q_proj", "gpu_range")
    assert got["u2"] == (0, "L1.kda", "kda", None, "gpu_range")
    assert got["u3"] == (0, None, None, None, "gpu_range")
    assert got["u4"] == (None, None, None, None, "none")
    assert rep.runs[1].unlaunched == 4 and rep.runs[1].by_method["gpu_range"] == 3
    assert rep.runs[1].fallback_ambiguous == 0  # u2's op was ambiguous, its layer was not


def test_gpu_fallback_ambiguous_layer(con: duckdb.DuckDBPyConnection) -> None:
    """Two streams: L0.mla's kernels span [1000,2000), L1.kda's [1500,2500) (launched in
    step 0). Unlaunched u [1600,1700) lies in both layer spans: no layer; the one step span
    [1000,2500) holds it, so it takes step 0 and is counted ambiguous (layer level)."""
    r = RunRows(1)
    r.range("step", 0, 1000)
    r.range("L0.mla", 0, 400, depth=1)
    r.range("L1.kda", 400, 800, depth=1)
    r.kernel("a", 1000, 2000, r.launch(10), stream=7)
    r.kernel("b", 1500, 2500, r.launch(410), stream=8)
    r.kernel("u", 1600, 1700, None)
    r.insert(con)
    rep = attribute(con)
    assert _by_name(con, 1)["u"] == (0, None, None, None, "gpu_range")
    assert rep.runs[1].fallback_ambiguous == 1


def _graph_run(run_id: int, replays: list[list[str]], with_map: bool) -> RunRows:
    """Step s in [1000 s, 1000 s + 1000) on thread 1, with a cudaGraphLaunch at 1000 s + 10
    replaying the kernels named in replays[s] (at 100 000 + 1000 s + 10 i, in order)."""
    r = RunRows(run_id, name=f"graph{run_id}")
    for s, names in enumerate(replays):
        r.range("step", 1000 * s, 1000 * s + 1000)
        corr = r.launch(1000 * s + 10, name="cudaGraphLaunch")
        for i, n in enumerate(names):
            r.kernel(n, 100_000 + 1000 * s + 10 * i, 100_000 + 1000 * s + 10 * i + 5, corr)
    if with_map:
        for i, (n, layer, op) in enumerate(GRAPH_NODES):
            r.map_node(i, n, layer, op)
    return r


GRAPH_NODES = [("a", "L0.mla", "q_proj"), ("b", "L0.mla", "attn"), ("c", "L1.kda", "o_proj")]


def test_graph_capture_map_and_mismatch(con: duckdb.DuckDBPyConnection) -> None:
    """Map: node 0 a (L0.mla, q_proj), 1 b (L0.mla, attn), 2 c (L1.kda, o_proj).
    Replay in step 0: a b c -> verified, each kernel gets its node's layer/op, step 0.
    Replay in step 1: a x c -> names differ at node 1: the replay is reported (expected b,
    found x) and none of its kernels takes a layer; they keep the launch's step 1 (method range).
    Replay in step 2: a b (one short) -> reported too (2 kernels vs 3 nodes).
    Replay in step 3: a c b (concurrent streams started c first) -> the same multiset, so
    matched by (name, occurrence): c -> L1.kda/o_proj, b -> L0.mla/attn; counted as reordered."""
    _graph_run(1, [["a", "b", "c"], ["a", "x", "c"], ["a", "b"], ["a", "c", "b"]],
               with_map=True).insert(con, True)
    rep = attribute(con)
    rows = con.execute("SELECT k.name, a.step_index, a.layer, a.layer_index, a.layer_kind, a.op, a.method "
                       "FROM kernel_attribution a JOIN kernels k ON k.run_id = a.run_id "
                       "AND k.kernel_id = a.item_id ORDER BY k.start_ns").fetchall()
    assert rows[:3] == [("a", 0, "L0.mla", 0, "mla", "q_proj", "capture_map"),
                        ("b", 0, "L0.mla", 0, "mla", "attn", "capture_map"),
                        ("c", 0, "L1.kda", 1, "kda", "o_proj", "capture_map")]
    assert rows[3:8] == [(n, s, None, None, None, None, "range")
                         for n, s in (("a", 1), ("x", 1), ("c", 1), ("a", 2), ("b", 2))]
    assert rows[8:] == [("a", 3, "L0.mla", 0, "mla", "q_proj", "capture_map"),
                        ("c", 3, "L1.kda", 1, "kda", "o_proj", "capture_map"),
                        ("b", 3, "L0.mla", 0, "mla", "attn", "capture_map")]
    r = rep.runs[1]
    assert r.capture_map["replays"] == 4 and r.capture_map["replays_verified"] == 2
    assert r.capture_map["replays_reordered"] == 1
    assert r.capture_map["replays_mismatched"] == 2 and rep.mismatch_count == 2
    m = {x["correlation"]: x for x in r.mismatches}
    bad = [x for x in m.values() if x["kernels"] == 3][0]
    assert (bad["first_mismatch"], bad["expected"], bad["found"]) == (1, "b", "x")
    short = [x for x in m.values() if x["kernels"] == 2][0]
    assert short["map_nodes"] == 3


def test_capture_stream_is_carried_and_old_stores_read_null(tmp_path) -> None:
    """A verified replay's kernels carry their node's capture_stream (also when matched as
    reordered). A store written before the column existed, opened read-only (not migrated),
    still attributes, with capture_stream NULL."""
    path = tmp_path / "s.duckdb"
    con = open_store(path)
    r = _graph_run(1, [["a", "b", "c"], ["a", "c", "b"]], with_map=False)
    for i, ((n, layer, op), cs) in enumerate(zip(GRAPH_NODES, (7, 8, 7))):
        r.map_node(i, n, layer, op, capture_stream=cs)
    r.insert(con, True)
    attribute(con)
    got = con.execute("SELECT k.name, a.capture_stream FROM kernel_attribution a JOIN kernels k "
                      "ON k.run_id = a.run_id AND k.kernel_id = a.item_id ORDER BY k.start_ns").fetchall()
    assert got == [("a", 7), ("b", 8), ("c", 7), ("a", 7), ("c", 7), ("b", 8)]
    con.execute("ALTER TABLE graph_capture_map DROP COLUMN capture_stream")
    con.close()
    old = open_store(path, read_only=True)
    rep = attribute(old)
    assert rep.runs[1].capture_map["replays_verified"] == 2
    assert old.execute("SELECT count(*), count(capture_stream) FROM kernel_attribution "
                       "WHERE method = 'capture_map'").fetchall() == [(6, 0)]


def test_graph_reference_alignment(con: duckdb.DuckDBPyConnection) -> None:
    """Eager reference (run 1), two identical steps: a in L0.mla/q_proj, b in L0.mla/attn,
    c in L1.kda/o_proj, then `sample` in the step outside any layer.
    Graph run (run 2, no map): replay 0 = a b c -> a contiguous part of the reference step,
    all 3 matched; replay 1 = a z c -> a and c matched, z (not in the reference) counted as
    1 unmatched kernel and left without layer. Steps come from the graph launches (0, 1). A
    matched kernel's capture stream is its reference kernel's stream (b ran on 8, the rest on 7)."""
    ref = RunRows(1, name="eager")
    for s in range(2):
        base = 1000 * s
        ref.range("step", base, base + 1000)
        ref.range("L0.mla", base + 100, base + 300, depth=1)
        ref.range("q_proj", base + 100, base + 200, depth=2)
        ref.range("attn", base + 200, base + 300, depth=2)
        ref.range("L1.kda", base + 300, base + 500, depth=1)
        ref.range("o_proj", base + 300, base + 400, depth=2)
        for i, (n, t) in enumerate((("a", 150), ("b", 250), ("c", 350), ("sample", 700))):
            ref.kernel(n, 50_000 + base + 10 * i, 50_005 + base + 10 * i, ref.launch(base + t),
                       stream=8 if n == "b" else 7)
    ref.insert(con)
    _graph_run(2, [["a", "b", "c"], ["a", "z", "c"]], with_map=False).insert(con, True)
    rep = attribute(con, [2], graph_reference=1)
    rows = con.execute("SELECT k.name, a.step_index, a.layer, a.op, a.method, a.capture_stream "
                       "FROM kernel_attribution a "
                       "JOIN kernels k ON k.run_id = a.run_id AND k.kernel_id = a.item_id "
                       "WHERE a.run_id = 2 ORDER BY k.start_ns").fetchall()
    assert rows == [("a", 0, "L0.mla", "q_proj", "reference", 7), ("b", 0, "L0.mla", "attn", "reference", 8),
                    ("c", 0, "L1.kda", "o_proj", "reference", 7), ("a", 1, "L0.mla", "q_proj", "reference", 7),
                    ("z", 1, None, None, "range", None), ("c", 1, "L1.kda", "o_proj", "reference", 7)]
    r = rep.runs[2].reference
    assert (r["replays"], r["replays_exact"], r["kernels_matched"], r["kernels_unmatched"]) == (2, 1, 5, 1)
    assert rep.runs[2].mismatches[0]["found"] == "z"


def _brute_innermost(ranges: list[tuple[int, int, int]], t: int) -> int | None:
    """Innermost = latest start; same start -> shorter; identical -> the higher id (nested later)."""
    enc = [(s, -e, i) for i, s, e in ranges if s <= t < e]
    return max(enc)[2] if enc else None


@st.composite
def nested_ranges(draw: st.DrawFn) -> list[tuple[int, int, int]]:
    """Properly nested ranges on one thread (a random tree, children inside their parent)."""
    out: list[tuple[int, int, int]] = []

    def fill(lo: int, hi: int, depth: int) -> None:
        t = lo
        while t < hi and depth < 4 and draw(st.booleans()):
            s = draw(st.integers(t, hi))
            e = draw(st.integers(s, hi))
            out.append((len(out), s, e))
            if e > s:
                fill(s, e, depth + 1)
            t = e + draw(st.integers(0, 3))

    fill(0, 60, 0)
    return out


@given(nested_ranges())
def test_innermost_matches_brute_force(ranges: list[tuple[int, int, int]]) -> None:
    """The ASOF-join innermost lookup equals a brute-force scan at every instant in [-1, 62]."""
    con = open_store(None)
    load_sql(con, "attribution")
    con.execute("CREATE TABLE r (key INTEGER, range_id INTEGER, start_ns BIGINT, end_ns BIGINT)")
    if ranges:
        con.executemany("INSERT INTO r VALUES (1, ?, ?, ?)", ranges)
    con.execute("CREATE TABLE p AS SELECT 1 AS key, t AS point_id, t AS t_ns FROM range(-1, 63) x(t)")
    got = dict(con.execute("SELECT point_id, range_id FROM attribution_innermost('r', 'p')").fetchall())
    assert got == {t: _brute_innermost(ranges, t) for t in range(-1, 63)}


def test_ranks_do_not_mix(con: duckdb.DuckDBPyConnection) -> None:
    """Two ranks with the same pid/tid numbers. Rank 0: step [0,100) > L0.mla [0,100);
    rank 1: step [50,150), step [150,250) > L1.kda [150,250). A launch at 60 on rank 1 is in
    rank 1's step 0 and no layer (rank 0's L0.mla, open at 60, is another process);
    a launch at 160 on rank 1 is step 1, L1.kda; a launch at 60 on rank 0 is step 0, L0.mla.
    Correlation ids repeat across ranks (each rank numbers its own) and must not cross."""
    r = RunRows(1)
    r.range("step", 0, 100, rank=0)
    r.range("L0.mla", 0, 100, rank=0, depth=1)
    r.range("step", 50, 150, rank=1)
    r.range("step", 150, 250, rank=1)
    r.range("L1.kda", 150, 250, rank=1, depth=1)
    c0 = r.launch(60, rank=0)
    r.kernel("r0", 1000, 1010, c0, rank=0)
    r._corr = c0 - 1  # rank 1 reuses the same correlation numbers
    r.kernel("r1a", 1000, 1010, r.launch(60, rank=1), rank=1)
    r.kernel("r1b", 1020, 1030, r.launch(160, rank=1), rank=1)
    r.insert(con)
    attribute(con)
    got = _by_name(con, 1)
    assert got["r0"] == (0, "L0.mla", "mla", None, "range")
    assert got["r1a"] == (0, None, None, None, "range")
    assert got["r1b"] == (1, "L1.kda", "kda", None, "range")


def test_scale_synthetic_known_answer(con: duckdb.DuckDBPyConnection) -> None:
    """S steps x 61 layers x 10 ops x K kernels, written with SQL. Step s is [s*1e6, s*1e6+1e6),
    layer l inside it [+16000 l, +16000 (l+1)), op o inside that [+1600 o, +1600 (o+1)); the
    launch of kernel k of (s, l, o) is at +100 k + 5 inside the op. So every kernel's
    expected (step_index, layer, op) = (s, 'L{l}.mla', 'op{o}'), recomputed from its
    correlation id (corr - 1 = ((s * 61 + l) * 10 + o) * K + k)."""
    s_n, l_n, o_n, k_n = 8, 61, 10, 4
    con.execute("INSERT INTO runs (run_id, name, source, path, file_hash, world_size) "
                "VALUES (1, 'big', 't', 'p', 'h', 1)")
    con.execute("""
        INSERT INTO ranges
        SELECT 1, row_number() OVER () - 1, 0, 1, 1, 'user_annotation', name, s, e, d, NULL, NULL
        FROM (
          SELECT 'step' AS name, st * 1000000 AS s, st * 1000000 + 1000000 AS e, 0 AS d
          FROM range(?) a(st)
          UNION ALL
          SELECT 'L' || l || '.mla', st * 1000000 + l * 16000, st * 1000000 + l * 16000 + 16000, 1
          FROM range(?) a(st), range(?) b(l)
          UNION ALL
          SELECT 'op' || o, st * 1000000 + l * 16000 + o * 1600,
                 st * 1000000 + l * 16000 + o * 1600 + 1600, 2
          FROM range(?) a(st), range(?) b(l), range(?) c(o))""",
                [s_n, s_n, l_n, s_n, l_n, o_n])
    con.execute("""
        CREATE TEMP TABLE _launch AS
        SELECT ((st * ? + l) * ? + o) * ? + k + 1 AS corr,
               st * 1000000 + l * 16000 + o * 1600 + k * 100 + 5 AS t
        FROM range(?) a(st), range(?) b(l), range(?) c(o), range(?) d(k)""",
                [l_n, o_n, k_n, s_n, l_n, o_n, k_n])
    con.execute("INSERT INTO api_calls SELECT 1, corr, 0, 1, 1, 'runtime', 'cudaLaunchKernel', "
                "t, t + 3, corr FROM _launch")
    con.execute("INSERT INTO kernels (run_id, kernel_id, rank, stream, correlation, name, start_ns, "
                "end_ns, category) SELECT 1, corr, 0, 7, corr, 'k', t + 10000000000, "
                "t + 10000000050, 'compute' FROM _launch")
    attribute(con)
    rows = con.execute("SELECT k.correlation - 1, a.step_index, a.layer, a.op FROM kernel_attribution a "
                       "JOIN kernels k ON k.kernel_id = a.item_id").fetchall()
    assert len(rows) == s_n * l_n * o_n * k_n
    for c, step, layer, op in rows:
        rest, _ = divmod(c, k_n)
        rest, o = divmod(rest, o_n)
        st, l = divmod(rest, l_n)
        assert (step, layer, op) == (st, f"L{l}.mla", f"op{o}")


def test_reference_alignment_of_a_reordered_replay() -> None:
    """A replay with the reference step's names in another order (concurrent streams) is
    matched by (name, occurrence), flagged reordered; anything else goes through difflib and
    leaves the extra kernels unmatched. Oracle: positions worked out by hand."""
    from analyzers.attribution import _align

    ref = ["a", "b", "c", "b"]
    occ = {("a", 1): 0, ("b", 1): 1, ("c", 1): 2, ("b", 2): 3}
    assert _align(ref, ("b", "a", "b", "c"), occ) == ([1, 0, 3, 2], True)
    assert _align(ref, ("a", "b", "c", "b"), occ) == ([0, 1, 2, 3], False)
    pos, reordered = _align(ref, ("a", "x", "b", "c", "b"), occ)
    assert (pos, reordered) == ([0, None, 1, 2, 3], False)


def test_reference_fills_capture_streams_a_map_lacks(con: duckdb.DuckDBPyConnection) -> None:
    """A graph run with a capture map but no capture streams (an older trace) and an eager
    reference: the map still gives layer and op (method capture_map), the reference the
    streams by (name, occurrence): a and c ran on 7, b on 8. Replay 1 was captured as a c b
    (reordered): each kernel still takes its own name's stream. Without the reference the
    streams stay NULL and the report counts the kernels."""
    ref = RunRows(1, name="eager")
    ref.range("step", 0, 1000)
    for i, (n, t) in enumerate((("a", 150), ("b", 250), ("c", 350))):
        ref.kernel(n, 50_000 + 10 * i, 50_005 + 10 * i, ref.launch(t), stream=8 if n == "b" else 7)
    ref.insert(con)
    _graph_run(2, [["a", "b", "c"], ["a", "c", "b"]], with_map=True).insert(con, True)
    rep = attribute(con, [2])
    assert rep.runs[2].graph_kernels_without_capture_stream == 6
    rep = attribute(con, [2], graph_reference=1)
    rows = con.execute("SELECT k.name, a.method, a.capture_stream FROM kernel_attribution a "
                       "JOIN kernels k ON k.run_id = a.run_id AND k.kernel_id = a.item_id "
                       "WHERE a.run_id = 2 ORDER BY k.start_ns").fetchall()
    assert rows == [("a", "capture_map", 7), ("b", "capture_map", 8), ("c", "capture_map", 7),
                    ("a", "capture_map", 7), ("c", "capture_map", 7), ("b", "capture_map", 8)]
    assert rep.runs[2].graph_kernels_without_capture_stream == 0
    assert rep.runs[2].reference["capture_streams_filled"] == 6
