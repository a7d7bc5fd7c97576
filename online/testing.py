"""Run the server in a thread of this process, on a free loopback port (tests, notebooks, benchmarks)."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def serve_in_thread(app: Any, host: str = "127.0.0.1", startup_timeout: float = 30.0) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on a port the OS picks; yields its base URL, stops it on exit.

    The socket is bound before uvicorn starts, so no other process can take the port in between.
    """
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="shardline-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError(f"the server did not start within {startup_timeout} s (see its log above)")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
