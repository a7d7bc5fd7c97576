"""prefect.yaml as a user drives it: `prefect deploy` to a real server, then a worker runs it.

One `prefect server` (SQLite, its own PREFECT_HOME, a free port) serves the module.
Every Prefect command runs as a subprocess, the way a user types it; the worker
starts outside the repository, so only the deployment's pull step can bring the
flow run back to the code.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pyarrow.dataset as ds
import pytest
import yaml

pytestmark = [pytest.mark.server, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
PREFECT = [sys.executable, "-m", "prefect"]
POOL = "shardline-batch"
DEPLOYMENT = "batch-inference/nightly"
FLOW_RUN_ID = re.compile(r"UUID: ([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(process: subprocess.Popen[Any], grace: float = 15) -> None:
    """End a process started in its own session, and everything it started."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(grace)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(grace)
    # children that outlived their parent (a flow run, Dask workers)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


@dataclass(frozen=True)
class PrefectServer:
    """A running `prefect server` and the environment a user's shell would have for it."""

    api_url: str
    env: dict[str, str]
    log: Path

    def cli(self, *args: str, timeout: float = 120, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
        """Run `prefect ARGS...` to completion; fail the test with its output if it fails."""
        done = subprocess.run(
            [*PREFECT, *args], env=self.env, cwd=cwd, capture_output=True, text=True, timeout=timeout
        )
        assert done.returncode == 0, f"prefect {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        return done

    def get(self, path: str) -> Any:
        response = httpx.get(f"{self.api_url}{path}", timeout=30)
        response.raise_for_status()
        return response.json()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        response = httpx.post(f"{self.api_url}{path}", json=body, timeout=30)
        response.raise_for_status()
        return response.json()


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """`prefect server start` on a free loopback port with a fresh PREFECT_HOME."""
    home = tmp_path_factory.mktemp("prefect-server-home")
    port = _free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "SHARDLINE_"))}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_API_URL=api_url,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_UI_ENABLED="false",
        DO_NOT_TRACK="1",
        ORT_DISABLE_TELEMETRY="1",
        GX_ANALYTICS_ENABLED="false",
        PYTHONUNBUFFERED="1",
    )
    log = home / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env, cwd=home, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            if server.poll() is not None:
                pytest.fail(f"prefect server exited {server.returncode} before it was healthy:\n{_tail(log)}")
            try:
                if httpx.get(f"{api_url}/health", timeout=2).json() is True:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"prefect server not healthy after 120 s:\n{_tail(log)}")
            time.sleep(0.25)
        yield PrefectServer(api_url, env, log)
    finally:
        _stop(server)


@pytest.fixture(scope="module")
def nightly_deployment(prefect_server: PrefectServer) -> dict[str, Any]:
    """The work pool created and prefect.yaml's `nightly` deployed, as a user does it."""
    prefect_server.cli("work-pool", "create", POOL, "--type", "process")
    deployed = prefect_server.cli("--no-prompt", "deploy", "--name", "nightly")
    assert "batch-inference/nightly" in deployed.stdout, deployed.stdout
    deployment: dict[str, Any] = prefect_server.get(f"/deployments/name/{DEPLOYMENT}")
    return deployment


def test_deploy_registers_the_nightly_deployment(nightly_deployment: dict[str, Any]) -> None:
    declared = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    [nightly] = [d for d in declared if d["name"] == "nightly"]
    deployment = nightly_deployment

    assert deployment["entrypoint"] == "flows/batch_inference.py:batch_inference"
    assert deployment["work_pool_name"] == POOL
    assert deployment["parameters"] == nightly["parameters"]
    assert set(deployment["parameter_openapi_schema"]["required"]) == {"model", "input_uri", "output_uri"}
    assert deployment["enforce_parameter_schema"] is True
    # the pull step brings a worker's flow run back to this checkout
    assert deployment["pull_steps"] == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}
    ]
    # one run at a time: two runs never write one output folder together
    assert deployment["global_concurrency_limit"]["limit"] == 1

    [schedule] = deployment["schedules"]
    assert schedule["schedule"]["cron"] == "0 2 * * *" and schedule["schedule"]["timezone"] == "UTC"
    assert schedule["active"] is False and schedule["slug"] == "nightly-0200-utc"


def test_worker_runs_the_deployment_and_scores_every_row(
    prefect_server: PrefectServer,
    nightly_deployment: dict[str, Any],
    local_registry: Any,
    shardline_home: Path,
    input_shards: Path,
    tmp_path: Path,
) -> None:
    output = tmp_path / "scored"
    params = {
        "model": "breast-cancer@prod",
        "input_uri": str(input_shards),
        "output_uri": str(output),
        "tenant": "e2e",
    }
    started = prefect_server.cli(
        "deployment", "run", DEPLOYMENT, *[a for k, v in params.items() for a in ("--param", f"{k}={v}")]
    )
    match = FLOW_RUN_ID.search(started.stdout)
    assert match, started.stdout
    flow_run_id = match.group(1)
    assert prefect_server.get(f"/flow_runs/{flow_run_id}")["parameters"] == params

    # The worker starts outside the repository; the pull step takes the run back there.
    # Settings travel in the worker's environment, as in production.
    worker_env = {
        **prefect_server.env,
        "SHARDLINE_STORAGE_HOME": str(shardline_home),
        "SHARDLINE_DASK_CLUSTER": "local",
    }
    workdir = tmp_path / "worker"
    workdir.mkdir()
    log = workdir / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen(
            [*PREFECT, "worker", "start", "--pool", POOL, "--run-once", "--name", "e2e-worker"],
            env=worker_env, cwd=workdir, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        # --run-once polls once, runs what it picked up, and exits when that run ends
        worker.wait(300)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker did not finish the flow run within 300 s:\n{_tail(log)}")
    finally:
        _stop(worker)

    state = prefect_server.get(f"/flow_runs/{flow_run_id}")["state"]
    assert state["type"] == "COMPLETED" and state["name"] == "Completed", f"{state}\n{_tail(log)}"
    assert state["message"] == "12000 rows scored"
    assert worker.returncode == 0, _tail(log)

    inputs = ds.dataset(input_shards, format="parquet").to_table()
    scored = ds.dataset(output, format="parquet").to_table()
    assert scored.num_rows == inputs.num_rows == 12_000
    assert sorted(scored.column("id").to_pylist()) == sorted(inputs.column("id").to_pylist())
    manifest = json.loads((output / "_manifest.json").read_text())
    assert manifest["tenant"] == "e2e" and manifest["model"]["pinned"] == "breast-cancer:1"
    assert (output / "_SUCCESS").exists()

    # Seconds after `prefect deploy`, the server's scheduler has seen the deployment; its
    # schedule ships inactive, so the only run is ours: nothing ran against the example paths.
    runs = prefect_server.post("/flow_runs/filter", {"deployments": {"id": {"any_": [nightly_deployment["id"]]}}})
    assert [r["id"] for r in runs] == [flow_run_id]
