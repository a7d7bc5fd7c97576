"""Run the server in a thread of this process, on a free loopback port (tests, notebooks, benchmarks).

The server holds its connections to the same bounds as ``shardline serve`` (``limits``: those
of ``OnlineSettings()`` unless given), and can serve a second app (the metrics) on a port of its own.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from shardline.local_ports import listener
from shardline.online.limits import ConnectionLimits


@dataclass(frozen=True)
class Served:
    """The base URLs of a server started by ``serve_listeners_in_thread``."""

    url: str
    metrics_url: str | None = None


@contextmanager
def serve_listeners_in_thread(app: Any, host: str = "127.0.0.1", startup_timeout: float = 30.0, *,
                              metrics_app: Any = None, limits: ConnectionLimits | None = None) -> Iterator[Served]:
    """Serve ``app`` (and ``metrics_app`` on a second port) with uvicorn on ports the OS picks.

    The sockets are bound before uvicorn starts, so no other process can take the ports in between.
    """
    import uvicorn

    from shardline.online.connection import uvicorn_options
    from shardline.online.limits import open_files_limit, resolve_limits
    from shardline.settings import OnlineSettings

    limits = limits or resolve_limits(OnlineSettings(), open_files_limit())
    sockets = [listener(host)] + ([listener(host)] if metrics_app is not None else [])
    ports = [s.getsockname()[1] for s in sockets]
    apps = {ports[1]: metrics_app} if metrics_app is not None else None
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, timeout_graceful_shutdown=5,
                                           **uvicorn_options(limits, apps)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, name="shardline-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            for sock in sockets:
                sock.close()
            raise RuntimeError(f"the server did not start within {startup_timeout} s (see its log above)")
        time.sleep(0.02)
    try:
        yield Served(f"http://{host}:{ports[0]}", f"http://{host}:{ports[1]}" if metrics_app is not None else None)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        for sock in sockets:
            sock.close()


@contextmanager
def serve_in_thread(app: Any, host: str = "127.0.0.1", startup_timeout: float = 30.0) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on a port the OS picks; yields its base URL, stops it on exit."""
    with serve_listeners_in_thread(app, host, startup_timeout) as served:
        yield served.url
