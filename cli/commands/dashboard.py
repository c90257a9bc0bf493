"""`decodescope dashboard`: serve the dashboard over a store, the bundled traces by default."""
from __future__ import annotations

import contextlib
import errno
import signal
import socket
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import click

from cli.common import bundled_trace_paths, is_database, open_input, verbose_option, with_boundary
from tracer.errors import BadInput


class _Deferred:
    """A WSGI app set after the socket is bound, so a taken port fails before any ingest."""

    def __init__(self) -> None:
        self.app: Callable[..., Iterable[bytes]] | None = None

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        assert self.app is not None, "served before the app was built"
        return self.app(environ, start_response)


def bind(host: str, port: int, app: Callable[..., Any]) -> Any:
    """A threaded werkzeug server on host:port; BadInput (one line, exit 2) if it cannot bind.

    The socket is bound here and handed to werkzeug by file descriptor: werkzeug's own bind
    prints several lines and exits 1 on a taken port.
    """
    from werkzeug.serving import make_server

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise BadInput(f"{host}:{port}", f"cannot listen there ({exc.strerror or exc})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise BadInput(f"{host}:{port}", "port already in use; pick another with --port") from None
        raise BadInput(f"{host}:{port}", f"cannot listen there ({exc.strerror or exc})") from None
    server = make_server(host, sock.getsockname()[1], app, threaded=True, fd=sock.fileno())
    server._decodescope_socket = sock  # keep the listening socket alive as long as the server
    return server


@click.command("dashboard")
@click.argument("traces", nargs=-1, type=click.Path())
@click.option("--db", type=click.Path(dir_okay=False), help="A DuckDB store to serve (created if missing).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind (localhost only by default).")
@click.option("--port", default=8050, show_default=True, type=click.IntRange(0, 65535))
@verbose_option
@with_boundary
def command(traces: tuple[str, ...], db: str | None, host: str, port: int, verbose: bool) -> None:
    """Serve the dashboard: per-layer breakdown, timeline, bubbles, overlap, diff, kernels.

    With no argument it serves the bundled traces in traces/ (ingested once into a cached store
    under ~/.cache/decodescope). TRACE... are ingested into memory; --db serves a store file.

    \b
    Example:
      decodescope dashboard --port 8051
    """
    from dashboard.app import create_app
    from dashboard.bundled import bundled_store, working_copy
    from dashboard.data import StorePool

    if db and traces:
        raise BadInput(db, "pass either --db or trace files, not both")
    if len(traces) == 1 and Path(traces[0]).is_file() and is_database(Path(traces[0])):
        db, traces = traces[0], ()  # a store given as the argument is served like --db
    deferred = _Deferred()
    server = bind(host, port, deferred)
    log = lambda m: click.echo(m, err=True)  # noqa: E731
    with contextlib.ExitStack() as stack:
        stack.callback(server.server_close)
        if db:
            pool = StorePool.open(db)
        elif traces:
            con, _ids = open_input(traces, progress=True)
            pool = StorePool(con, "in memory: " + ", ".join(traces), writable=True)
        else:
            cached = bundled_store(bundled_trace_paths(), log=log)
            pool = StorePool.open(stack.enter_context(working_copy(cached)))
            pool.label = f"bundled traces ({cached.name}; uploads last until this dashboard stops)"
        stack.callback(pool.close)
        deferred.app = create_app(pool).server
        with pool.cursor():  # warm one connection (timeline macros loaded) before the first request
            pass
        if not pool.writable:
            log(f"note: {pool.label} is held by another process; serving it read-only (uploads disabled)")
        log(f"decodescope dashboard on http://{host}:{server.port}/  (store: {pool.label}; Ctrl-C stops)")
        # SIGTERM (kill, timeout, systemd) unwinds like Ctrl-C, so the working copy is removed
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        with contextlib.suppress(KeyboardInterrupt):
            server.serve_forever()
