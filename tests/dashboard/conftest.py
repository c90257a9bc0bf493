"""Browser-test harness: one store with a stock and a fused hand-made run, one app served on a
free port in a thread (werkzeug make_server, port 0), one headless Debian Chromium per session
(Playwright with executable_path, never `playwright install`)."""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from tests.conftest import CHROMIUM
from tests.dashboard.decode_traces import DecodeSpec, write_decode_trace

CHROME_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage"]
STOCK = DecodeSpec("stock", kernels_per_op=3, kernel_ns=4_000)
FUSED = DecodeSpec("fused", kernels_per_op=1, kernel_ns=5_000)


@pytest.fixture(scope="session")
def dashboard_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store file holding run 1 (stock) and run 2 (fused), built from hand-made traces."""
    from tracer.ingest import ingest_path
    from tracer.store import open_store

    d = tmp_path_factory.mktemp("dashboard")
    db = d / "store.duckdb"
    con = open_store(db)
    for spec in (STOCK, FUSED):
        ingest_path(con, write_decode_trace(d / f"k3_{spec.variant}.json", spec), progress=False)
    con.close()
    return db


@pytest.fixture(scope="session")
def live_server(dashboard_store: Path) -> Iterator[dict[str, Any]]:
    """The dashboard app over dashboard_store, served on 127.0.0.1 at a free port."""
    from werkzeug.serving import make_server

    from dashboard.app import create_app
    from dashboard.data import StorePool

    pool = StorePool.open(dashboard_store)
    app = create_app(pool)
    srv = make_server("127.0.0.1", 0, app.server, threaded=True)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield {"url": f"http://127.0.0.1:{srv.server_port}", "pool": pool, "app": app}
    srv.shutdown()
    pool.close()


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROME_FLAGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh page that records console errors, failed requests and any request leaving the
    machine in `page.errors`."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    pg.errors = []  # type: ignore[attr-defined]
    pg.on("console", lambda m: pg.errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    pg.on("pageerror", lambda e: pg.errors.append(f"pageerror: {e}"))
    # A request the browser aborts because the test navigates on (net::ERR_ABORTED, e.g. a late
    # callback of the previous page on 2 busy cores) is not an app error; any other network
    # failure is, and so is any HTTP error status (a callback that raised answers 500).
    pg.on("requestfailed", lambda r: None if "ERR_ABORTED" in (r.failure or "")
          else pg.errors.append(f"requestfailed: {r.url} ({r.failure})"))
    pg.on("response", lambda r: pg.errors.append(f"http {r.status}: {r.url}") if r.status >= 400 else None)
    # offline: every request goes to the app itself (no CDN, no external URL)
    pg.on("request", lambda r: None if urlparse(r.url).hostname in ("127.0.0.1", None) or r.url.startswith("data:")
          else pg.errors.append(f"external request: {r.url}"))
    yield pg
    context.close()


def screenshots_dir() -> Path | None:
    """docs/img when DECODESCOPE_SCREENSHOTS=1 (the README's images are made by the tests)."""
    if os.environ.get("DECODESCOPE_SCREENSHOTS") != "1":
        return None
    out = Path(__file__).resolve().parents[2] / "docs" / "img"
    out.mkdir(parents=True, exist_ok=True)
    return out


