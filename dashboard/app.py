"""Build the Dash app: the navbar from the page registry, and the page container.

Everything else lives in the page modules (dashboard/pages/), the store accessor
(dashboard/data.py) and the figure builders (dashboard/figures/). Assets (CSS) are served from
dashboard/assets/, so the app works offline: no CDN, no external URL.
"""
from __future__ import annotations

from pathlib import Path

import dash
from dash import Dash, dcc, html

from dashboard.data import CONFIG_KEY, StorePool

HERE = Path(__file__).resolve().parent


def create_app(store: StorePool) -> Dash:
    """A Dash app serving `store`; call once per process (Dash pages register globally)."""
    app = Dash(
        __name__,
        use_pages=True,
        pages_folder=str(HERE / "pages"),
        assets_folder=str(HERE / "assets"),
        serve_locally=True,
        suppress_callback_exceptions=True,
        title="decodescope",
        update_title=None,
    )
    app.server.config[CONFIG_KEY] = store
    pages = sorted(dash.page_registry.values(), key=lambda p: p.get("order", 99))
    app.layout = html.Div([
        html.Nav([
            html.Span("decodescope", className="brand"),
            *[dcc.Link(p["name"], href=p["relative_path"], id=f"nav-{p['module'].split('.')[-1]}")
              for p in pages],
        ], className="navbar"),
        html.Main(dash.page_container, className="page"),
    ])
    return app
