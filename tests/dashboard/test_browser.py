"""The dashboard in headless Chromium: every page loads without console errors, a shared
timeline link restores its window, zooming fetches a new window and rewrites the URL, the
kernels grid pages from the store, a bad upload is rejected without changing the store.
Expected values come from the hand-made traces (tests/dashboard/decode_traces.py) or from an
independent count in the store with plain SQL."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from playwright.sync_api import expect

from tests.dashboard.conftest import FUSED, STOCK
from tests.dashboard.decode_traces import OPS, DecodeSpec, write_decode_trace

pytestmark = pytest.mark.browser

PAGES = ["/", "/runs", "/layers", "/timeline", "/bubbles", "/overlap", "/diff", "/kernels"]


def _load(page: Any, url: str) -> None:
    page.goto(url)
    page.wait_for_selector("#_pages_content h1", timeout=20_000)
    page.wait_for_load_state("networkidle")


def _kernels_per_layer(spec: Any) -> int:
    return len(OPS) * spec.kernels_per_op + 1  # + the layer's all-reduce


def _count_in_window(live: dict[str, Any], run: int, t0: int, t1: int) -> int:
    """Independent count: kernels of rank 0 overlapping [t0, t1), straight from the table."""
    with live["pool"].cursor() as cur:
        return cur.execute("SELECT count(*) FROM kernels WHERE run_id = ? AND rank = 0 AND end_ns > ? AND start_ns < ?",
                           [run, t0, t1]).fetchall()[0][0]


def _window_text(page: Any) -> tuple[int, int, int]:
    text = page.locator("#timeline-info").inner_text()
    m = re.search(r"window \[(\d+), (\d+)\) ns .* ([\d,]+) kernels", text)
    assert m, text
    return int(m.group(1)), int(m.group(2)), int(m.group(3).replace(",", ""))


def _overlap_per_rank(spec: Any) -> tuple[int, int, int]:
    """(comm, hidden, exposed) ns of rank 0: each layer's all-reduce runs 500 ns from
    gap_ns - 100 ns before the layer's last slot ends; the last compute kernel ends launch_ns +
    kernel_ns into that kernel_ns + gap_ns slot, i.e. gap_ns - launch_ns before its end. The
    overlap is the difference (300 ns for the defaults), the rest of the 500 ns is exposed."""
    hidden = (spec.gap_ns - 100) - (spec.gap_ns - spec.launch_ns)
    n = spec.steps * spec.layers
    return 500 * n, hidden * n, (500 - hidden) * n


def test_every_page_loads_without_console_errors(page: Any, live_server: dict[str, Any]) -> None:
    """Every page renders without console errors or outside requests; the analyzer pages show
    the numbers the hand-made stock run implies."""
    for path in PAGES:
        _load(page, live_server["url"] + path)
        assert page.errors == [], (path, page.errors)
    _load(page, live_server["url"] + "/overlap?run=1")
    comm, hidden, exposed = _overlap_per_rank(STOCK)
    cells = [c.strip() for c in page.locator("#overlap-ranks tbody tr").first.locator("td").all_inner_texts()]
    assert cells == ["0", f"{comm:,}", f"{hidden:,}", f"{100 * hidden / comm:.1f}", f"{exposed:,}"]
    _load(page, live_server["url"] + "/diff?base=1&cand=2&metric=kernels")
    expect(page.locator("#diff-verdict")).to_contain_text("mode: layers")
    assert page.errors == []
    # navbar navigation (client-side routing) works too
    page.locator("#nav-runs").click()
    expect(page.locator("#runs-table")).to_be_visible()
    assert page.errors == []


def test_shared_timeline_link_restores_the_window(page: Any, live_server: dict[str, Any]) -> None:
    """Open a link with an explicit window: the page shows exactly that window and the number of
    kernels overlapping it (counted independently in the store)."""
    with live_server["pool"].cursor() as cur:
        first = cur.execute("SELECT min(start_ns) FROM kernels WHERE run_id = 1").fetchall()[0][0]
    t0, t1 = first + 4_000, first + 30_000
    _load(page, f"{live_server['url']}/timeline?run=1&rank=0&t0={t0}&t1={t1}")
    assert _window_text(page) == (t0, t1, _count_in_window(live_server, 1, t0, t1))
    assert page.errors == []


def test_zoom_fetches_the_new_window_and_rewrites_the_url(page: Any, live_server: dict[str, Any]) -> None:
    _load(page, f"{live_server['url']}/timeline?run=1")
    t0, t1, n = _window_text(page)
    # the default window is step 0's device window: every kernel of one step
    assert n == STOCK.layers * _kernels_per_layer(STOCK)
    box = page.locator("#timeline-graph .nsewdrag").first.bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] * 0.30, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.45, y, steps=5)
    page.mouse.up()
    expect(page.locator("#timeline-info")).not_to_have_text(re.compile(rf"window \[{t0}, {t1}\)"), timeout=10_000)
    z0, z1, zn = _window_text(page)
    assert t0 < z0 < z1 < t1
    assert zn == _count_in_window(live_server, 1, z0, z1)
    query = parse_qs(urlparse(page.url).query)
    assert (int(query["t0"][0]), int(query["t1"][0])) == (z0, z1)
    assert page.errors == []


def test_kernels_grid_pages_sorted_from_the_store(page: Any, live_server: dict[str, Any]) -> None:
    _load(page, f"{live_server['url']}/kernels?run=2")
    n = FUSED.steps * FUSED.layers * _kernels_per_layer(FUSED)
    expect(page.locator("#kernels-count")).to_have_text(f"{n:,} kernels match")
    page.locator(".ag-header-cell[col-id='dur_ns'] .ag-header-cell-label").click()  # ascending
    first = page.locator(".ag-row[row-index='0'] .ag-cell[col-id='dur_ns']")
    expect(first).to_have_text("500")  # the all-reduce (500 ns) is the shortest kernel
    assert page.errors == []


def test_bad_upload_shows_one_line_and_leaves_store_unchanged(page: Any, live_server: dict[str, Any],
                                                             tmp_path: Path) -> None:
    def snapshot() -> list[tuple[Any, ...]]:
        with live_server["pool"].cursor() as cur:
            return cur.execute("SELECT (SELECT count(*) FROM runs), (SELECT count(*) FROM kernels), "
                               "(SELECT count(*) FROM ranges)").fetchall()

    before = snapshot()
    bad = tmp_path / "broken.json"
    bad.write_text('{"traceEvents": [{"ph": "X", "name": ')
    _load(page, f"{live_server['url']}/runs")
    page.locator("#runs-upload input[type=file]").set_input_files(str(bad))
    err = page.locator("#runs-upload-result .error")
    expect(err).to_be_visible(timeout=20_000)
    text = err.inner_text()
    assert text.startswith("error: broken.json: ") and "\n" not in text
    assert snapshot() == before
    assert page.errors == []


def test_good_upload_adds_one_run_and_a_repeat_is_recognised(page: Any, live_server: dict[str, Any],
                                                            tmp_path: Path) -> None:
    """A valid upload becomes one new run with exactly its kernels; ingesting the same bytes
    again (here by server path) finds that run (content hash) and adds nothing."""
    spec = DecodeSpec("stock", steps=1, layers=2, kernels_per_op=1)
    trace = write_decode_trace(tmp_path / "small.json", spec)
    with live_server["pool"].cursor() as cur:
        runs_before = cur.execute("SELECT count(*), max(run_id) FROM runs").fetchall()[0]
    _load(page, f"{live_server['url']}/runs")
    page.locator("#runs-upload input[type=file]").set_input_files(str(trace))
    ok = page.locator("#runs-upload-ok")
    expect(ok).to_contain_text(f"small.json: ingested as run {runs_before[1] + 1} ", timeout=20_000)
    with live_server["pool"].cursor() as cur:
        n, kernels = cur.execute("SELECT (SELECT count(*) FROM runs), (SELECT count(*) FROM kernels WHERE run_id = ?)",
                                 [runs_before[1] + 1]).fetchall()[0]
    assert (n, kernels) == (runs_before[0] + 1, spec.steps * spec.layers * _kernels_per_layer(spec))
    page.locator("#runs-path").fill(str(trace))  # the same bytes again, by server path this time
    page.locator("#runs-path-go").click()
    expect(ok).to_contain_text(f"already in the store as run {runs_before[1] + 1}", timeout=20_000)
    with live_server["pool"].cursor() as cur:
        assert cur.execute("SELECT count(*) FROM runs").fetchall()[0][0] == runs_before[0] + 1
    assert page.errors == []


def _layer_span_ns(spec: Any) -> int:
    """Span of one layer of the hand-made trace: from its first kernel (launch_ns after the
    layer starts) to the end of its all-reduce (launched gap_ns before the layer ends, +100 ns
    to start, 500 ns long), with len(OPS) * kernels_per_op slots of kernel_ns + gap_ns."""
    slots = len(OPS) * spec.kernels_per_op
    return slots * (spec.kernel_ns + spec.gap_ns) - spec.gap_ns + 100 + 500 - spec.launch_ns


def test_layers_page_shows_both_runs_side_by_side(page: Any, live_server: dict[str, Any]) -> None:
    _load(page, f"{live_server['url']}/layers?base=1&cand=2")
    expect(page.locator("#layers-base-title")).to_have_text("#1 k3_stock (stock)")
    expect(page.locator("#layers-cand-title")).to_have_text("#2 k3_fused (fused)")
    for side in ("base", "cand"):
        expect(page.locator(f"#layers-{side}-time .main-svg").first).to_be_visible()
    rows = page.locator("#layers-seed-table tbody tr")
    expect(rows).to_have_count(2)  # kda and mla
    for i in range(2):
        cells = [c.strip() for c in rows.nth(i).locator("td").all_inner_texts()]
        assert cells[0] in ("kda", "mla")
        assert f"{_layer_span_ns(STOCK):,} ns" in cells[1] and cells[2] == str(_kernels_per_layer(STOCK))
        assert f"{_layer_span_ns(FUSED):,} ns" in cells[3] and cells[4] == str(_kernels_per_layer(FUSED))
        assert cells[5] == f"{_layer_span_ns(FUSED) / _layer_span_ns(STOCK):.2f}×"
    assert page.errors == []


def test_clicking_a_bubble_moves_the_timeline_to_it(page: Any, live_server: dict[str, Any]) -> None:
    """Every bubble of the stock trace is the gap_ns between consecutive kernels of an op, so the
    top-ranked one (longest, then earliest) is the first: from the end of kernel 0 (launch_ns +
    kernel_ns after the trace base) to the start of kernel 1 (one slot later). Its link opens the
    timeline on a window padded by 5 gaps on each side, with the bubble marked."""
    base = 1_700_000_000_000_000_000
    b0 = base + STOCK.launch_ns + STOCK.kernel_ns
    b1 = base + STOCK.kernel_ns + STOCK.gap_ns + STOCK.launch_ns
    assert b1 - b0 == STOCK.gap_ns
    pad = 5 * STOCK.gap_ns
    _load(page, f"{live_server['url']}/bubbles?run=1")
    page.locator("#bubbles-table a", has_text=re.compile(r"^#1$")).click()
    expect(page.locator("#timeline-info")).to_be_visible(timeout=20_000)
    t0, t1, n = _window_text(page)
    assert (t0, t1) == (b0 - pad, b1 + pad)
    assert n == _count_in_window(live_server, 1, t0, t1)
    query = parse_qs(urlparse(page.url).query)
    assert (int(query["m0"][0]), int(query["m1"][0])) == (b0, b1)
    origin = base + STOCK.launch_ns  # the first kernel's start
    shapes = page.evaluate("document.querySelector('#timeline-graph .js-plotly-plot').layout.shapes")
    marked = [(s["x0"], s["x1"]) for s in shapes if s.get("layer") == "above"]
    assert marked == [(b0 - origin, b1 - origin)]
    assert page.errors == []


def test_readme_screenshot_of_the_bundled_runs(page: Any, live_server: dict[str, Any], tmp_path: Path) -> None:
    """With DECODESCOPE_SCREENSHOTS=1: docs/img/layers.png, the layers page over the bundled real
    traces (the default pair), made by swapping the served app's store for the bundled one."""
    from cli.common import bundled_trace_paths
    from dashboard.bundled import bundled_store
    from dashboard.data import CONFIG_KEY, StorePool
    from tests.dashboard.conftest import screenshots_dir

    out = screenshots_dir()
    if out is None or not bundled_trace_paths():
        pytest.skip("set DECODESCOPE_SCREENSHOTS=1 (and have traces/) to refresh docs/img/layers.png")
    pool = StorePool.open(bundled_store(bundled_trace_paths(), tmp_path / "cache"))
    config = live_server["app"].server.config
    served = config[CONFIG_KEY]
    config[CONFIG_KEY] = pool
    try:
        _load(page, f"{live_server['url']}/layers")
        expect(page.locator("#layers-seed-table")).to_be_visible()
        page.wait_for_timeout(800)
        page.screenshot(path=str(out / "layers.png"), full_page=True)
        assert page.errors == []
    finally:
        config[CONFIG_KEY] = served
        pool.close()
