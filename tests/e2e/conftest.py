"""End-to-end fixtures: the `shardline` command run as a user runs it, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

SHARDLINE = [sys.executable, "-m", "shardline.cli"]


@pytest.fixture(scope="session")
def prefect_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One Prefect home (and database) for every CLI run of the session."""
    return tmp_path_factory.mktemp("prefect-home")


@pytest.fixture
def cli_env(shardline_home: Path, prefect_home: Path) -> dict[str, str]:
    """The environment a user's shell would have: off the network, own homes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDLINE_", "PREFECT_"))}
    env.update(
        SHARDLINE_STORAGE_HOME=str(shardline_home),
        PREFECT_HOME=str(prefect_home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        ORT_DISABLE_TELEMETRY="1",
        PYTHONUNBUFFERED="1",
    )
    return env


@pytest.fixture
def shardline(cli_env: dict[str, str], tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run `shardline ARGS...` to completion; returns the finished process."""

    def run(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*SHARDLINE, *args], env={**cli_env, **env}, cwd=tmp_path, capture_output=True, text=True, timeout=timeout
        )

    return run
