"""End-to-end fixtures: the `shardline` command run as a user runs it, in a subprocess.

The session's commands talk to one real `prefect server` (``PREFECT_API_URL``), as a user
who follows the README's Prefect section does. Without one, a user's `batch run` finds or
starts the local Prefect server of its Shardline home (cli/prefect_server.py): a test
that drops the URL sets ``SHARDLINE_PREFECT_SERVER=temporary`` too (Prefect's temporary server
per run, nothing left behind), and the tests of the local server (test_prefect_server.py) stop
what they start.

`batch run` hands its job to the home's warm batch runner (cli/batch_runner.py), as a
user's does: the first run of a test starts one for the test's home, and
``no_batch_runner_outlives_the_test`` (tests/conftest.py) kills it when the test ends. A test of the cold path
(a run in its own supervised process) sets ``SHARDLINE_BATCH_RUNNER_IDLE_S=0``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest

from shardline.local_ports import reserve_port
from tests.conftest import PREFECT_SERVICES_UNUSED_IN_TESTS

SHARDLINE = [sys.executable, "-m", "shardline.cli"]


@pytest.fixture(scope="session")
def prefect_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One Prefect home (and database) for every CLI run of the session."""
    return tmp_path_factory.mktemp("prefect-home")


@pytest.fixture(scope="session")
def prefect_api(prefect_home: Path) -> Iterator[str]:
    """`prefect server start` on a free loopback port for the session; its API URL."""
    port = reserve_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDLINE_", "PREFECT_"))}
    env.update(PREFECT_HOME=str(prefect_home), PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED="false",
               DO_NOT_TRACK="1", **PREFECT_SERVICES_UNUSED_IN_TESTS)
    url = f"http://127.0.0.1:{port}/api"
    log = prefect_home / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "server", "start", "--host",
                                   "127.0.0.1", "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, f"prefect server exited {server.returncode}: {log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{url}/health", timeout=2).json() is True:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert time.monotonic() < deadline, f"prefect server not healthy after 120 s: {log.read_text()[-3000:]}"
            time.sleep(0.25)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture
def cli_env(shardline_home: Path, prefect_home: Path, prefect_api: str) -> dict[str, str]:
    """The environment a user's shell would have: off the network, own homes, the session's Prefect server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDLINE_", "PREFECT_"))}
    env.update(
        SHARDLINE_STORAGE_HOME=str(shardline_home),
        PREFECT_HOME=str(prefect_home),
        PREFECT_API_URL=prefect_api,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        ORT_DISABLE_TELEMETRY="1",
        PYTHONUNBUFFERED="1",
    )
    return env


@pytest.fixture
def shardline(cli_env: dict[str, str], tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run `shardline ARGS...` to completion; returns the finished process."""

    def run(*args: str, timeout: float = 300, **env: str | None) -> subprocess.CompletedProcess[str]:
        merged = {k: v for k, v in {**cli_env, **env}.items() if v is not None}  # None: unset it
        return subprocess.run(
            [*SHARDLINE, *args], env=merged, cwd=tmp_path, capture_output=True, text=True, timeout=timeout
        )

    return run

