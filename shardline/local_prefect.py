"""Where a Shardline home's local Prefect server is, as its record says, and whether it answers.

The CLI's keeper (``shardline.cli.prefect_server``) starts and stops the server and writes its record,
``<home>/prefect/server.json`` (pid, API URL); anything that needs the server's address without starting it
(events posted by the router or a CLI command: ``shardline.events``) reads it here. A record whose process is
gone, is not a Prefect server, or does not answer ``GET /api/health`` counts as no server.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from shardline.processes import alive

RECORD = "server.json"
HEALTH_TIMEOUT_S = 2.0
PREFECT_MARKER = b"prefect"  # in the command line of the server's keeper (``shardline.processes.alive``)


@dataclass(frozen=True)
class LocalServer:
    """A running local Prefect server: its process and where it answers."""

    pid: int
    api_url: str  # http://127.0.0.1:PORT/api

    @property
    def ui_url(self) -> str:
        """Where the Prefect UI is (the API URL without its /api)."""
        return self.api_url.removesuffix("/api")


def server_dir(home: str | os.PathLike[str]) -> Path:
    """The folder of a Shardline home's local Prefect server: its Prefect home, record, log and lock."""
    return Path(home) / "prefect"


def healthy(api_url: str, timeout: float = HEALTH_TIMEOUT_S) -> bool:
    """Whether a Prefect API answers ``GET /health`` with ``true`` at ``api_url``."""
    import httpx

    try:
        return httpx.get(f"{api_url}/health", timeout=timeout).json() is True
    except (httpx.HTTPError, ValueError):
        return False


def is_prefect_process(pid: int) -> bool:
    """Whether ``pid`` is a live process of this user and, where /proc tells, a Prefect server (not a reused pid)."""
    return alive(pid, PREFECT_MARKER)


def read_record(folder: Path) -> LocalServer | None:
    try:
        data = json.loads((folder / RECORD).read_text())
        return LocalServer(pid=int(data["pid"]), api_url=str(data["api_url"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find(home: str | os.PathLike[str], timeout: float = HEALTH_TIMEOUT_S) -> LocalServer | None:
    """The home's local server when its record names a live Prefect process that answers health checks."""
    recorded = read_record(server_dir(home))
    if recorded is None or not is_prefect_process(recorded.pid) or not healthy(recorded.api_url, timeout):
        return None
    return recorded
