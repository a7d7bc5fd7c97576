"""The local Prefect server batch runs share: started by the first run, reused, replaced when stale, stopped.

These tests drop the session's PREFECT_API_URL (conftest.py) and any SHARDLINE_PREFECT_SERVER, as a
user's shell without either has them; each starts at most one server, in its own Shardline home,
and stops it however the test ends.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from shardline.cli.batch_runner import find as find_runner
from shardline.cli.batch_runner import stop as stop_runner
from shardline.cli.prefect_server import home_environment, stop
from shardline.local_ports import reserve_port
from shardline.local_prefect import healthy, server_dir
from tests.e2e.conftest import SHARDLINE

Shardline = Callable[..., subprocess.CompletedProcess[str]]
EMBEDDED_DEFAULT = {"PREFECT_API_URL": None, "SHARDLINE_PREFECT_SERVER": None}  # unset both


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/cmdline").read_bytes() != b"" if Path("/proc").exists() else True


def test_the_demo_starts_a_local_prefect_server_that_later_runs_reuse_and_stop_stops(
    shardline: Shardline, tmp_path: Path
) -> None:
    from prefect.client.orchestration import SyncPrefectClient

    home = tmp_path / "demo" / "home"  # the demo's own home: `make demo` as it runs on a fresh machine
    try:
        demo = shardline("demo", "--workdir", str(tmp_path / "demo"), "--shards", "3", "--rows", "4000",
                         **EMBEDDED_DEFAULT)
        assert demo.returncode == 0, demo.stderr[-3000:]
        assert "demo OK: 12,000 rows scored, every id once" in demo.stdout
        assert "started the local Prefect server: its UI is http://127.0.0.1:" in demo.stderr
        # the first run in a new home says what it waits for while it waits
        assert "waiting for the local Prefect server to start" in demo.stderr
        assert "waiting for the Dask cluster to start" in demo.stderr
        record = json.loads((server_dir(home) / "server.json").read_text())
        assert f"The run is in the Prefect UI at {record['ui_url']}" in demo.stdout
        assert alive(record["pid"]) and healthy(record["api_url"])

        # a later shell as the demo's last lines set it up (`export SHARDLINE_STORAGE_HOME=...`, `eval "$(shardline
        # prefect env)"`): the same settings as the demo's run, so its runner is reused
        shell = home_environment(home)  # (None: unset)
        again = shardline("batch", "run", "--model", "breast-cancer@prod", "--input", str(tmp_path / "demo" / "input"),
                          "--output", str(tmp_path / "rescored"), "--json", **{**EMBEDDED_DEFAULT, **shell})
        assert again.returncode == 0, again.stderr[-3000:]
        assert json.loads(again.stdout.strip().splitlines()[-1])["rows_out"] == 12_000
        assert "started the local Prefect server" not in again.stderr and "temporary server" not in again.stderr
        assert json.loads((server_dir(home) / "server.json").read_text())["pid"] == record["pid"]  # reused
        runner = find_runner(home)  # the demo's run started the home's warm batch runner; this run used it
        assert runner is not None and f"started the batch runner of this home (pid {runner.pid})" in demo.stderr
        assert "started the batch runner" not in again.stderr and "waiting for" not in again.stderr
        with SyncPrefectClient(record["api_url"]) as client:
            runs = client.read_flow_runs()
            assert len(runs) == 2 and all(run.state is not None and run.state.is_completed() for run in runs)
            assert {client.read_flow(run.flow_id).name for run in runs} == {"batch-inference"}

        status = shardline("prefect", "status", "--json", SHARDLINE_STORAGE_HOME=str(home), **EMBEDDED_DEFAULT)
        assert status.returncode == 0 and json.loads(status.stdout)["pid"] == record["pid"]
        stopped = shardline("prefect", "stop", SHARDLINE_STORAGE_HOME=str(home), **EMBEDDED_DEFAULT)
        assert stopped.returncode == 0 and f"stopped the local Prefect server (pid {record['pid']}" in stopped.stdout
        assert f"stopped the batch runner (pid {runner.pid})" in stopped.stdout
        assert not alive(record["pid"]) and not (server_dir(home) / "server.json").exists()
        assert not alive(runner.pid) and find_runner(home) is None
        after = shardline("prefect", "status", SHARDLINE_STORAGE_HOME=str(home), **EMBEDDED_DEFAULT)
        assert after.returncode == 1 and "no local Prefect server runs" in after.stdout
    finally:
        stop_runner(home)
        stop(home)


def test_a_stale_record_is_replaced_two_first_commands_start_one_server_and_it_stops_with_its_home(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    home = tmp_path / "home"
    folder = server_dir(home)
    folder.mkdir(parents=True)
    dead_port = reserve_port()  # a port nothing listens on
    bystander = subprocess.Popen(["sleep", "300"])  # the recorded pid is alive, but no Prefect server
    (folder / "server.json").write_text(json.dumps({"pid": bystander.pid, "api_url": f"http://127.0.0.1:{dead_port}/api"}))
    env = {k: v for k, v in cli_env.items() if k not in EMBEDDED_DEFAULT}
    env["SHARDLINE_STORAGE_HOME"] = str(home)
    record: dict[str, Any] = {}
    try:
        starts = [subprocess.Popen([*SHARDLINE, "prefect", "start"], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for _ in range(2)]
        outputs = [p.communicate(timeout=300) for p in starts]
        assert [p.returncode for p in starts] == [0, 0], outputs
        said = sorted(out.split(":")[0] for out, _ in outputs)
        assert said == ["already running", "started"], outputs
        record = json.loads((folder / "server.json").read_text())
        assert all(f"pid {record['pid']}," in out for out, _ in outputs)
        assert record["pid"] != bystander.pid and healthy(record["api_url"])
        assert bystander.poll() is None  # a stale record's pid that is not a Prefect server is left alone

        shutil.rmtree(home)  # no record left to find it by: the server stops by itself
        deadline = time.monotonic() + 60
        while alive(record["pid"]) or healthy(record["api_url"], timeout=0.5):
            assert time.monotonic() < deadline, "the server outlived its deleted home"
            time.sleep(0.2)
    finally:
        bystander.kill()
        bystander.wait()
        stop(home)
        if record and alive(record["pid"]):  # the test failed: nothing may outlive it
            os.killpg(record["pid"], signal.SIGKILL)


@pytest.mark.usefixtures("local_registry")
def test_a_prefect_api_url_the_user_set_wins_over_the_local_server(
    shardline: Shardline, input_shards: Path, tmp_path: Path, shardline_home: Path, prefect_api: str
) -> None:
    run = shardline("batch", "run", "--model", "breast-cancer@prod", "--input", str(input_shards), "--output",
                    str(tmp_path / "out"), SHARDLINE_PREFECT_SERVER=None)  # the default, local; the URL is set

    assert run.returncode == 0, run.stderr[-2000:]
    assert f"View at {prefect_api.removesuffix('/api')}/runs/flow-run/" in run.stderr
    assert "started the local Prefect server" not in run.stderr and not server_dir(shardline_home).exists()
