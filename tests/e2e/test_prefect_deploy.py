"""The README's Prefect section as a user follows it, and prefect.yaml as a worker runs it.

The two bash blocks of README.md's "Scheduling it in Prefect" are read from the README
(so the test cannot drift from the docs) and run as written, from a fresh Prefect home,
in a checkout of the flows and prefect.yaml that holds what `make demo` leaves there
(shardline-demo/home with breast-cancer@prod, shardline-demo/input). The only change:
a free port instead of 4200. The first block (the server's terminal) runs in the
background for the module; the second runs as one bash script (`bash -e`), its
backgrounded worker included. Then every other test uses the same server.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
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

from shardline.build.examples import write_shards
from shardline.local_ports import reserve_port
from shardline.storage.registry import ModelRegistry

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
PREFECT = [sys.executable, "-m", "prefect"]
POOL = "shardline-batch"
DEPLOYMENT = "batch-inference/nightly"
FLOW_RUN_ID = re.compile(r"UUID: ([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})")
README_PORT = "4200"
DECLARED = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]


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
    # children that outlived their parent (a backgrounded worker, a flow run, Dask workers)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def readme_blocks(port: int) -> tuple[str, str]:
    """The section's two bash blocks (the server's terminal, the user's), with ``port`` for 4200."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Scheduling it in Prefect"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) == 2, f"expected the server's block and the user's block, found {len(blocks)}"
    server, user = blocks
    for block in blocks:  # telemetry off in both terminals, by the README's own words
        assert "export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1" in block
    assert f"--port {README_PORT}" in server and f"127.0.0.1:{README_PORT}/api" in user
    return (server.replace(f"--port {README_PORT}", f"--port {port}"),
            user.replace(f"127.0.0.1:{README_PORT}/", f"127.0.0.1:{port}/"))


@dataclass(frozen=True)
class PrefectServer:
    """A running `prefect server`, the checkout it serves, and the shells a user would have for it."""

    api_url: str
    env: dict[str, str]  # a shell with PREFECT_API_URL set (the tests' own commands)
    shell_env: dict[str, str]  # a fresh shell: nothing of Prefect or Shardline set
    checkout: Path
    user_block: str
    log: Path

    def cli(self, *args: str, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """Run `prefect ARGS...` to completion; fail the test with its output if it fails."""
        done = subprocess.run(
            [*PREFECT, *args], env=self.env, cwd=cwd or self.checkout, capture_output=True, text=True, timeout=timeout
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


def _checkout(root: Path, bundle_dir: Path) -> Path:
    """The flows and prefect.yaml, an activatable environment, and what `make demo` leaves in shardline-demo/."""
    checkout = root / "checkout"
    checkout.mkdir()
    shutil.copy(REPO / "prefect.yaml", checkout / "prefect.yaml")
    shutil.copytree(REPO / "flows", checkout / "flows", ignore=shutil.ignore_patterns("__pycache__"))
    activate = Path(sys.prefix) / "bin" / "activate"
    if sys.prefix != sys.base_prefix and activate.exists():
        (checkout / ".venv").symlink_to(sys.prefix)
    else:  # not a virtual environment: `. .venv/bin/activate` puts this interpreter's scripts first
        (checkout / ".venv" / "bin").mkdir(parents=True)
        (checkout / ".venv" / "bin" / "activate").write_text(f'export PATH="{Path(sys.executable).parent}:$PATH"\n')
    registry = ModelRegistry(str(checkout / "shardline-demo" / "home" / "registry"))
    pushed = registry.push(bundle_dir)
    registry.set_alias(pushed.name, "prod", pushed.version or 1, reason="demo")
    write_shards(checkout / "shardline-demo" / "input", 2, 1_500)
    return checkout


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory, breast_cancer_model: Any) -> Iterator[PrefectServer]:
    """The README's first block: `prefect server start` on a free loopback port, a fresh Prefect home."""
    root = tmp_path_factory.mktemp("prefect-readme")
    checkout = _checkout(root, breast_cancer_model.bundle_dir)
    port = reserve_port()
    api_url = f"http://127.0.0.1:{port}/api"
    server_block, user_block = readme_blocks(port)
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != venv_bin)
    shell_env = {k: v for k, v in os.environ.items()
                 if not k.startswith(("PREFECT_", "SHARDLINE_")) and k not in ("DO_NOT_TRACK", "VIRTUAL_ENV")}
    shell_env.update(PATH=path, PREFECT_HOME=str(root / "prefect-home"), PYTHONUNBUFFERED="1", COLUMNS="200")
    log = root / "server.log"
    (root / "server.sh").write_text(server_block)
    with log.open("w") as out:
        server = subprocess.Popen(["bash", "-e", str(root / "server.sh")], env=shell_env, cwd=checkout,
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
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
        env = {**shell_env, "PATH": os.pathsep.join([venv_bin, path]), "PREFECT_API_URL": api_url,
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
        yield PrefectServer(api_url, env, shell_env, checkout, user_block, log)
    finally:
        _stop(server)


@dataclass(frozen=True)
class ReadmeRun:
    """The README's second block, run to its end."""

    returncode: int
    output: str


@pytest.fixture(scope="module")
def readme_run(prefect_server: PrefectServer, tmp_path_factory: pytest.TempPathFactory) -> ReadmeRun:
    """The user's terminal: config set, work pool, deploy --all, a worker in the background, the nightly run."""
    root = tmp_path_factory.mktemp("readme-terminal")
    script, log = root / "terminal.sh", root / "terminal.log"
    script.write_text(prefect_server.user_block)
    with log.open("w") as out:
        shell = subprocess.Popen(["bash", "-e", "-x", str(script)], env=prefect_server.shell_env,
                                 cwd=prefect_server.checkout, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    try:
        shell.wait(420)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the README's commands did not finish within 420 s:\n{_tail(log)}")
    finally:
        _stop(shell)  # the worker it left in the background, and anything that worker started
    return ReadmeRun(shell.returncode, log.read_text(errors="replace"))


def test_the_readme_commands_deploy_everything_and_run_nightly(
    readme_run: ReadmeRun, prefect_server: PrefectServer
) -> None:
    assert readme_run.returncode == 0, readme_run.output[-6000:]
    # every deployment prefect.yaml declares, on this server, with its flow's name
    deployments = prefect_server.post("/deployments/filter", {})
    flows = {f["id"]: f["name"] for f in prefect_server.post("/flows/filter", {})}
    found = {f"{flows[d['flow_id']]}/{d['name']}" for d in deployments}
    assert len(DECLARED) == 10 and {d["name"] for d in deployments} == {d["name"] for d in DECLARED}
    assert found == {"batch-inference/nightly", "promote-model/promote", "batch-sla-response/sla-response",
                     "drift-watch/drift-watch", "revalidate-model/revalidate", "rollback-alias/rollback",
                     "rescore-output/rescore", "rollout-notice/rollout-notice",
                     "release-model/release", "mlflow-watch/mlflow-watch"}
    # ... and every trigger as an automation (the Automations page is not empty)
    automations = {a["name"]: a for a in prefect_server.post("/automations/filter", {})}
    triggers = {t["name"] for d in DECLARED for t in d.get("triggers", [])}
    assert len(triggers) == 6 and set(automations) == triggers
    assert all(a["enabled"] for a in automations.values())
    # what the user saw: the listings name them too
    for name in triggers:
        assert name in readme_run.output, f"`prefect automation ls` did not list {name}"
    assert "nightly" in readme_run.output and "Completed" in readme_run.output

    # the nightly run went through the worker, on the demo's data, and completed
    [nightly] = [d for d in deployments if d["name"] == "nightly"]
    [run] = prefect_server.post("/flow_runs/filter", {"deployments": {"id": {"any_": [nightly["id"]]}}})
    assert run["state"]["type"] == "COMPLETED" and run["state"]["message"] == "3,000 rows scored", run["state"]
    assert run["work_pool_name"] == POOL
    output = prefect_server.checkout / "shardline-demo" / "nightly"
    assert ds.dataset(output, format="parquet").to_table().num_rows == 3_000 and (output / "_SUCCESS").exists()
    # the run's summary is in the UI under the deployment's key
    artifacts = prefect_server.post("/artifacts/filter", {"artifacts": {"key": {"any_": ["batch-nightly-summary"]}}})
    assert artifacts and "3,000 rows scored" in artifacts[0]["data"]


@pytest.fixture(scope="module")
def nightly_deployment(readme_run: ReadmeRun, prefect_server: PrefectServer) -> dict[str, Any]:
    """prefect.yaml's `nightly`, as the README's `prefect deploy --all` registered it."""
    assert readme_run.returncode == 0, readme_run.output[-6000:]
    deployment: dict[str, Any] = prefect_server.get(f"/deployments/name/{DEPLOYMENT}")
    return deployment


def test_deploy_registers_the_nightly_deployment(nightly_deployment: dict[str, Any], prefect_server: PrefectServer) -> None:
    [nightly] = [d for d in DECLARED if d["name"] == "nightly"]
    deployment = nightly_deployment

    assert deployment["entrypoint"] == "flows/batch_inference.py:batch_inference"
    assert deployment["work_pool_name"] == POOL
    assert deployment["parameters"] == nightly["parameters"]
    assert set(deployment["parameter_openapi_schema"]["required"]) == {"model", "input_uri", "output_uri"}
    assert deployment["enforce_parameter_schema"] is True
    # the pull step brings a worker's flow run back to the checkout `prefect deploy` ran in
    assert deployment["pull_steps"] == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(prefect_server.checkout)}}
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
    assert state["message"] == "12,000 rows scored"
    assert worker.returncode == 0, _tail(log)

    inputs = ds.dataset(input_shards, format="parquet").to_table()
    scored = ds.dataset(output, format="parquet").to_table()
    assert scored.num_rows == inputs.num_rows == 12_000
    assert sorted(scored.column("id").to_pylist()) == sorted(inputs.column("id").to_pylist())
    manifest = json.loads((output / "_manifest.json").read_text())
    assert manifest["tenant"] == "e2e" and manifest["model"]["pinned"] == "breast-cancer:1"
    assert (output / "_SUCCESS").exists()

    # Long after `prefect deploy`, the server's scheduler has seen the deployment; its schedule
    # ships inactive, so the only runs are the README's and ours: none was scheduled.
    runs = prefect_server.post("/flow_runs/filter", {"deployments": {"id": {"any_": [nightly_deployment["id"]]}}})
    assert len(runs) == 2 and flow_run_id in {r["id"] for r in runs}
    assert {r["auto_scheduled"] for r in runs} == {False}
