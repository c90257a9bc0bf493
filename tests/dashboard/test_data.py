"""The store accessor: which runs are compared by default, and how a missing or refusing
analyzer reaches the page (one line, never a broken view)."""
from __future__ import annotations

import json
from typing import Any

import flask
import pytest

from dashboard import data


def _run(run_id: int, variant: str | None, graph: bool | None, batch: int | None, spec: int = 0) -> dict[str, Any]:
    cfg = None if batch is None else json.dumps({"variant": variant, "config": {"batch": batch, "spec_tokens": spec}})
    return {"run_id": run_id, "name": f"r{run_id}", "variant": variant, "graph_mode": graph, "config": cfg}


def test_default_pair_same_workload_stock_and_fused() -> None:
    runs = [_run(1, "stock", False, 1), _run(2, "stock", True, 8), _run(3, "stock", True, 1),
            _run(4, "fused", True, 8), _run(5, "fused", True, 1)]
    assert data.default_pair(runs) == (3, 5)  # graph, B=1 on both sides


def test_default_pair_without_fused_prefers_graph_replays_by_batch() -> None:
    runs = [_run(1, "stock", False, 1), _run(2, "stock", True, 64), _run(3, "stock", True, 1, spec=7),
            _run(4, "stock", True, 1), _run(5, "stock", True, 8)]
    assert data.default_pair(runs) == (4, 5)  # stock B=1 vs stock B=8, graph, no speculation


def test_default_pair_foreign_and_single_runs() -> None:
    assert data.default_pair([_run(7, None, None, None), _run(3, None, None, None)]) == (3, 7)
    assert data.default_pair([_run(7, None, None, None)]) == (7, None)
    assert data.default_pair([]) == (None, None)


@pytest.fixture
def app_context() -> Any:
    app = flask.Flask(__name__)
    pool = data.StorePool.open(None)
    app.config[data.CONFIG_KEY] = pool
    with app.app_context():
        yield pool
    pool.close()


def test_missing_analyzer_is_not_available(app_context: Any) -> None:
    with pytest.raises(data.NotAvailable, match="not available in this build"):
        data.call("no_such_analyzer", "run")


def test_refused_run_is_one_line(app_context: Any) -> None:
    with pytest.raises(data.AnalyzerFailed) as info:
        data.call("layers", "layer_breakdown", 999)
    text = str(info.value)
    assert text.startswith("error: ") and "999" in text and "\n" not in text


def test_cursors_are_reused_and_share_the_store(app_context: Any) -> None:
    pool = app_context
    with pool.cursor() as a:
        a.execute("INSERT INTO runs (run_id, name, source, path, file_hash, world_size) VALUES (1, 'x', 't', 'p', 'h', 1)")
    with pool.cursor() as b:
        assert b is a  # the same connection comes back (views already loaded)
        assert data.store_fingerprint() == (1, 1)


def test_concurrent_analyzer_calls_do_not_conflict(tmp_path: Any) -> None:
    """Analyzers (re)create macros and TEMP tables; DuckDB refuses concurrent catalog changes
    from two connections. Four threads rendering the layers of one run at once must all get
    the same answer, none a write-write conflict."""
    import threading

    from tests.dashboard.decode_traces import DecodeSpec, write_decode_trace
    from tracer.ingest import ingest_path

    app = flask.Flask(__name__)
    pool = data.StorePool.open(None)
    app.config[data.CONFIG_KEY] = pool
    with pool.cursor() as cur:
        run = ingest_path(cur, write_decode_trace(tmp_path / "t.json", DecodeSpec("stock", steps=2, layers=2)),
                          progress=False)[0].run_id
    results: list[Any] = []

    def render() -> None:
        with app.app_context():
            try:
                results.append(data.call("layers", "layer_breakdown", run))
            except data.PageDataError as exc:
                results.append(exc)

    threads = [threading.Thread(target=render) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pool.close()
    assert not [r for r in results if isinstance(r, Exception)], results
    assert len(results) == 4 and all(r == results[0] for r in results)
    assert [layer["layer"] for layer in results[0]["layers"]] == ["L0.kda", "L1.kda"]


def test_layers_page_notes_graph_kernels_without_capture_stream(app_context: Any, tmp_path: Any) -> None:
    """A graph trace whose map lacks capture streams gets one notice on the layers page, with
    the count layer_breakdown reports (15 = 3 replays x 5 kernels); one with them gets none."""
    from dashboard import components as c
    from tests.analyzers.decode_pair import write_graph

    app_context.ingest(write_graph(tmp_path / "with.json.gz"))
    app_context.ingest(write_graph(tmp_path / "without.json.gz", capture_streams=False))
    bds = [data.call("layers", "layer_breakdown", i) for i in (1, 2)]
    assert [bd["graph_kernels_without_capture_stream"] for bd in bds] == [0, 15]
    assert c.capture_stream_notice(bds[0]) == []
    (note,) = c.capture_stream_notice(bds[1])
    assert note.children.startswith("15 graph-replayed kernels have no capture stream")
    assert note.className == "missing"


def _captured(run_id: int, variant: str, graph: bool, cfg: dict[str, Any] | None) -> dict[str, Any]:
    meta = {"variant": variant, "graph_mode": graph, **({"config": cfg} if cfg is not None else {})}
    return {"run_id": run_id, "name": f"r{run_id}", "variant": variant, "graph_mode": graph,
            "config": json.dumps(meta)}


def test_eager_sibling_same_variant_and_config_only() -> None:
    b1, b8 = {"batch": 1, "spec_tokens": 0}, {"batch": 8, "spec_tokens": 0}
    runs = [_captured(1, "stock", False, b1), _captured(2, "fused", False, b1), _captured(3, "fused", False, b8),
            _captured(4, "fused", True, b1), _captured(5, "fused", True, b8), _captured(6, "stock", True, b8),
            _captured(7, "fused", False, b1), _captured(8, None, True, None), _captured(9, None, False, None)]
    assert [data.eager_sibling(runs, i) for i in (4, 5, 6, 8, 2, 99, None)] == [2, 3, None, None, None, None, None]


def test_eager_sibling_fills_the_capture_streams(app_context: Any, tmp_path: Any) -> None:
    """Our eager and graph traces of one config (a map without streams): the page's pairing
    finds the eager run, and the breakdown with it as reference has no stream-less kernel."""
    from tests.analyzers.decode_pair import write_eager, write_graph

    app_context.ingest(write_eager(tmp_path / "eager.json.gz"))
    app_context.ingest(write_graph(tmp_path / "graph.json.gz", capture_streams=False))
    with app_context.cursor() as cur:
        cur.execute("""UPDATE runs SET config = json_merge_patch(config, '{"config": {"batch": 1}}')""")
    ref = data.eager_sibling(data.runs(), 2)
    assert ref == 1
    with_ref = data.call("layers", "layer_breakdown", 2, graph_reference=ref)
    assert with_ref["graph_kernels_without_capture_stream"] == 0
    assert data.call("layers", "layer_breakdown", 2)["graph_kernels_without_capture_stream"] == 15
    assert with_ref["layers"] == data.call("layers", "layer_breakdown", 2)["layers"]
