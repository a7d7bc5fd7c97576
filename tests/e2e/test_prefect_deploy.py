"""The README from `make demo` through "Scheduling it in Prefect", as a user follows it, and prefect.yaml as a worker
runs it.

In a checkout of the flows and prefect.yaml: `shardline demo` runs (small: 2 shards of 1,500 rows) as `make demo`
does, and leaves its home, its local Prefect server and its warm batch runner; then the section's bash block,
read from the README (so the test cannot drift from the docs), runs as written in a fresh shell: nothing of
Prefect or Shardline set, and a user's own Prefect profile (``~/.prefect``, a fake HOME) that points elsewhere
and must be neither read nor changed. One server holds the demo's run and the nightly run. Last, `make clean`'s
recipe (run against the checkout) leaves no process of the README's running.
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
import psutil
import pyarrow.dataset as ds
import pytest
import yaml

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
PREFECT = [sys.executable, "-m", "prefect"]
SHARDLINE = [sys.executable, "-m", "shardline.cli"]
POOL = "shardline-batch"
DEPLOYMENT = "batch-inference/nightly"
FLOW_RUN_ID = re.compile(r"UUID: ([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})")
DECLARED = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
USER_PROFILE = 'active = "mine"\n\n[profiles.mine]\nPREFECT_API_URL = "http://127.0.0.1:9/api"\n'


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


def readme_block() -> str:
    """The section's bash block: the user's terminal after `make demo`."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Scheduling it in Prefect"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) == 1, f"expected the user's one block, found {len(blocks)}"
    assert 'eval "$(shardline prefect env)"' in blocks[0]
    return blocks[0]


@dataclass(frozen=True)
class PrefectServer:
    """The demo home's Prefect server after the README's block, the checkout it serves, and a shell for it."""

    api_url: str
    env: dict[str, str]  # a shell the README's two lines set up (the tests' own commands)
    checkout: Path
    home: Path
    user_profiles: Path
    output: str  # what the demo and the README's terminal printed
    returncode: int  # the README block's

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


def _checkout(root: Path) -> Path:
    """The flows and prefect.yaml and an activatable environment, as a clone after `make setup`."""
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
    return checkout


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """`make demo` (small), then the README's block in a fresh shell; the home's server it leaves."""
    root = tmp_path_factory.mktemp("prefect-readme")
    checkout = _checkout(root)
    user = root / "user"
    (user / ".prefect").mkdir(parents=True)
    user_profiles = user / ".prefect" / "profiles.toml"
    user_profiles.write_text(USER_PROFILE)  # the user's own profile: another server, which nothing here may use
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != venv_bin)
    shell_env = {k: v for k, v in os.environ.items()
                 if not k.startswith(("PREFECT_", "SHARDLINE_")) and k not in ("DO_NOT_TRACK", "VIRTUAL_ENV")}
    shell_env.update(PATH=path, HOME=str(user), PYTHONUNBUFFERED="1", COLUMNS="200")
    home = checkout / "shardline-demo" / "home"
    demo = subprocess.run([*SHARDLINE, "demo", "--shards", "2", "--rows", "1500"],  # `make demo`, small
                          env={**shell_env, "PATH": os.pathsep.join([venv_bin, path])}, cwd=checkout,
                          capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stdout[-4000:] + demo.stderr[-4000:]
    assert f"export SHARDLINE_STORAGE_HOME={home}" in demo.stdout and 'eval "$(shardline prefect env)"' in demo.stdout
    script, log = root / "terminal.sh", root / "terminal.log"
    script.write_text(readme_block())
    with log.open("w") as out:
        shell = subprocess.Popen(["bash", "-e", "-x", str(script)], env=shell_env, cwd=checkout, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            shell.wait(420)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the README's commands did not finish within 420 s:\n{_tail(log)}")
        env = {**shell_env, "PATH": os.pathsep.join([venv_bin, path]), "SHARDLINE_STORAGE_HOME": str(home)}
        status = subprocess.run([*SHARDLINE, "prefect", "status", "--json"], env=env, capture_output=True, text=True,
                                timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        api_url = json.loads(status.stdout)["api_url"]
        env.update(PREFECT_API_URL=api_url, PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
        yield PrefectServer(api_url, env, checkout, home, user_profiles, demo.stdout + _tail(log, 200_000),
                            shell.returncode)
    finally:
        subprocess.run([*SHARDLINE, "prefect", "stop"], env={**shell_env, "SHARDLINE_STORAGE_HOME": str(home)},
                       capture_output=True, timeout=120)  # (the last test does it as `make clean`: this is the net)
        _stop(shell)


def test_the_readme_commands_deploy_everything_and_run_nightly(prefect_server: PrefectServer) -> None:
    readme_run = prefect_server
    assert readme_run.returncode == 0, readme_run.output[-6000:]
    # every deployment prefect.yaml declares, on this server, with its flow's name
    deployments = prefect_server.post("/deployments/filter", {})
    flows = {f["id"]: f["name"] for f in prefect_server.post("/flows/filter", {})}
    found = {f"{flows[d['flow_id']]}/{d['name']}" for d in deployments}
    assert len(DECLARED) == 11 and {d["name"] for d in deployments} == {d["name"] for d in DECLARED}
    assert found == {"batch-inference/nightly", "promote-model/promote", "batch-sla-response/sla-response",
                     "drift-watch/drift-watch", "revalidate-model/revalidate", "rollback-alias/rollback",
                     "rescore-output/rescore", "rollout-notice/rollout-notice",
                     "release-model/release", "mlflow-watch/mlflow-watch", "cost-report/cost-report"}
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
def nightly_deployment(prefect_server: PrefectServer) -> dict[str, Any]:
    """prefect.yaml's `nightly`, as the README's `prefect deploy --all` registered it."""
    assert prefect_server.returncode == 0, prefect_server.output[-6000:]
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
    # The README's worker (left in the background of its shell) polls the same pool: stopped, as `kill -9 %1`
    # would, before the run exists, so that the run is the test's worker's to pick up (else either may take it,
    # and the test's worker may exit having run nothing while the other, killed, left it submitting: PENDING).
    readme_workers = [p for p in _readme_processes(prefect_server.home) if "worker start" in " ".join(p.cmdline())]
    for process in readme_workers:
        process.kill()  # (a Prefect worker may take over 30 s to end on SIGTERM)
    _, alive = psutil.wait_procs(readme_workers, timeout=30)
    assert readme_workers and not alive, [p.cmdline() for p in alive]

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


def test_one_server_holds_the_demos_run_and_the_nightly_run_and_the_users_profile_is_untouched(
    prefect_server: PrefectServer, nightly_deployment: dict[str, Any]
) -> None:
    runs = prefect_server.post("/flow_runs/filter", {})
    demo_runs = [r for r in runs if r["deployment_id"] is None and r["state"]["type"] == "COMPLETED"]
    nightly = [r for r in runs if r["deployment_id"] == nightly_deployment["id"]]
    assert demo_runs and nightly, [(r["name"], r["deployment_id"], r["state"]["type"]) for r in runs]
    assert any(r["state"]["message"] == "3,000 rows scored" for r in demo_runs)  # `make demo`'s own run
    assert prefect_server.user_profiles.read_text() == USER_PROFILE  # neither read (it points at :9) nor changed
    assert not (prefect_server.user_profiles.parent / "prefect.db").exists()
    assert "no local Prefect server" not in prefect_server.output


def _readme_processes(home: Path) -> list[psutil.Process]:
    """This user's processes of the home: its server, keeper and runner, Prefect workers and flow runs started by the
    README's shell (the home or its Prefect home in their command line or environment)."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if process.pid == os.getpid() or process.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            command = " ".join(process.info["cmdline"] or [])
            if "prefect" not in command and "shardline" not in command:
                continue
            env = process.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if str(home) in command or str(home) in env.get("PREFECT_HOME", "") or \
                env.get("SHARDLINE_STORAGE_HOME") == str(home):
            found.append(process)
    return found


def test_make_clean_leaves_no_process_of_the_readme_running(prefect_server: PrefectServer) -> None:
    """Last in the module: `make clean`'s recipe against the checkout (its VENV the checkout's link to this
    environment: `rm -rf` removes the link)."""
    worker = subprocess.Popen([*PREFECT, "worker", "start", "--pool", POOL],  # a worker as the README leaves one
                              env={k: v for k, v in prefect_server.env.items() if k != "PREFECT_API_URL"} | {
                                  "PREFECT_HOME": str(prefect_server.home / "prefect")},
                              cwd=prefect_server.checkout, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not any(p.pid == worker.pid for p in _readme_processes(prefect_server.home)):
            assert worker.poll() is None and time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.5)
        before = _readme_processes(prefect_server.home)
        kinds = " ".join(" ".join(p.cmdline()) for p in before)
        assert "server start" in kinds and "worker start" in kinds, kinds  # the server and the worker run
        clean = subprocess.run(["make", "-f", str(REPO / "Makefile"), "clean", f"VENV={prefect_server.checkout / '.venv'}"],
                               env=prefect_server.env, cwd=prefect_server.checkout, capture_output=True, text=True,
                               timeout=180)
        assert clean.returncode == 0, clean.stdout + clean.stderr
        assert "stopped the Prefect worker" in clean.stdout and "stopped the local Prefect server" in clean.stdout
        psutil.wait_procs(before, timeout=30)
        left = [" ".join(p.cmdline()) for p in _readme_processes(prefect_server.home) if p.is_running()]
        assert left == [], left
        assert not (prefect_server.checkout / "shardline-demo").exists()
        assert Path(sys.prefix).exists()  # the link went, not this environment
    finally:
        _stop(worker)
