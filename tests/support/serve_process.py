"""`shardline serve` as a process: a tenants file, started, ready, stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import httpx

from shardline.local_ports import reserve_port as free_port
from shardline.online.tenants import hash_api_key
from tests.e2e.conftest import SHARDLINE

KEY = "sk-e2e-key"


def write_tenants(path: Path, priority: str = "normal") -> Path:
    path.write_text(
        "tenants:\n"
        "  - name: acme\n"
        f"    api_keys_sha256: [\"{hash_api_key(KEY)}\"]\n"
        "    models: [\"breast-cancer@prod\"]\n"
        f"    priority: {priority}\n"
        "    rate: {requests_per_second: 100, burst: 200}\n"
        "    max_concurrent: 8\n"
    )
    return path


def wait_ready(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    """Return once ``url``'s /v2/health/ready answers 200; fail the test (with the log) if the server exits first
    or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, log.read_text()
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/v2/health/ready").status_code == 200:
                return
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


@contextlib.contextmanager
def serving(home: Path, tenants: Path, log: Path, **settings: str) -> Iterator[str]:
    """`shardline serve --tenants TENANTS` on a free loopback port over the registry of ``home``, as a user
    starts it (telemetry off, no Prefect, ``settings`` added to its environment); its URL once ready. Stopped
    with SIGTERM at the end."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDLINE_", "PREFECT_"))}
    env.update(SHARDLINE_STORAGE_HOME=str(home), DO_NOT_TRACK="1", ORT_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1")
    env.update(settings)
    port = free_port()
    with open(log, "wb") as sink:
        server = subprocess.Popen([*SHARDLINE, "serve", "--port", str(port), "--metrics-port", "off", "--tenants",
                                   str(tenants)], cwd=log.parent, stdout=sink, stderr=sink, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, server, log)
        yield url
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
