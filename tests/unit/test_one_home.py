"""One home from `make demo` to the README's scheduling section: its name in messages, its Prefect profile, and
the Prefect workers that `shardline prefect stop` (and `make clean`) stop with its server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib
from typer.testing import CliRunner

from shardline.cli.commands import app
from shardline.cli import prefect_clients
from shardline.cli.prefect_server import PROFILE, PROFILES, _write_profile, home_environment, profile_api_url
from shardline.local_prefect import server_dir


def test_batch_status_names_a_relative_home_by_its_full_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SHARDLINE_STORAGE_HOME", "relative-home")  # named by its full path

    result = CliRunner().invoke(app, ["batch", "status"])

    assert result.exit_code == 0, result.output
    assert f"no batch jobs recorded under {tmp_path / 'relative-home'} yet" in result.output


def test_the_homes_environment_points_prefect_at_its_own_profile(tmp_path: Path) -> None:
    env = home_environment(tmp_path / "home")

    assert env["SHARDLINE_STORAGE_HOME"] == str(tmp_path / "home")
    assert env["PREFECT_HOME"] == str(server_dir(tmp_path / "home"))
    # each of these would win over the home's profile: unset
    assert env["PREFECT_API_URL"] is None and env["PREFECT_PROFILE"] is None and env["PREFECT_PROFILES_PATH"] is None
    assert env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false" and env["DO_NOT_TRACK"] == "1"


def test_the_profile_holds_the_servers_address_and_keeps_the_users_other_settings(tmp_path: Path) -> None:
    folder = server_dir(tmp_path / "home")
    folder.mkdir(parents=True)
    (folder / PROFILES).write_text('active = "mine"\n[profiles.mine]\nPREFECT_LOGGING_LEVEL = "DEBUG"\n')

    assert profile_api_url(tmp_path / "home") is None
    _write_profile(folder, "http://127.0.0.1:41234/api")

    profiles = tomllib.loads((folder / PROFILES).read_text())
    assert profile_api_url(tmp_path / "home") == "http://127.0.0.1:41234/api"
    assert profiles["profiles"][PROFILE]["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    assert profiles["active"] == "mine" and profiles["profiles"]["mine"] == {"PREFECT_LOGGING_LEVEL": "DEBUG"}


def _fake_worker(tmp_path: Path, prefect_home: Path) -> subprocess.Popen[bytes]:
    """A real process whose command line is `prefect worker start --pool p` (a script named prefect that sleeps)."""
    script = tmp_path / "bin" / "prefect"
    script.parent.mkdir(exist_ok=True)
    script.write_text("import time\ntime.sleep(120)\n")
    env = {**os.environ, "PREFECT_HOME": str(prefect_home)}
    env.pop("PREFECT_API_URL", None)
    return subprocess.Popen([sys.executable, str(script), "worker", "start", "--pool", "p"], env=env)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="found through /proc")
def test_stop_stops_the_workers_of_the_home_and_no_other(tmp_path: Path) -> None:
    home, other = tmp_path / "home", tmp_path / "other"
    mine, theirs = _fake_worker(tmp_path, server_dir(home)), _fake_worker(tmp_path, server_dir(other))
    try:
        deadline = time.monotonic() + 10
        while not prefect_clients.find(home, set()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [c.pid for c in prefect_clients.find(home, set())] == [mine.pid]

        stopped = prefect_clients.stop(home, set())

        assert [(c.pid, c.kind) for c in stopped] == [(mine.pid, "Prefect worker")]
        assert mine.wait(5) is not None and theirs.poll() is None
    finally:
        for process in (mine, theirs):
            process.kill()
            process.wait()
