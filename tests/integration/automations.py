"""Get prefect.yaml's deployments and their `triggers:` into a running Prefect API, and watch them fire.

Prefect 3.9's `prefect_test_harness()` runs the services automations need (event
persister, reactive triggers, the proactive-trigger evaluator, actions), so the
session's harness is enough: no separate `prefect server start`.

    deployments = deploy_with_triggers(api_url, ["sla-response"])
    emit_event(event="shardline.batch.sla-breached", resource={...})
    run = wait_for_flow_run(api_url, "batch-sla-response/sla-response")
    state = run_flow_run_here(run["id"])          # optional: execute it in this process

`prefect deploy` runs as a subprocess, as a user types it, from the repository (so
the real prefect.yaml is read); each trigger becomes an automation owned by its
deployment and named `<deployment>__automation_<i>` unless the trigger names itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx

REPO = Path(__file__).resolve().parents[2]
POOL = "shardline-batch"


def _env(api_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    env.update(PREFECT_API_URL=api_url, PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    return env


def ensure_work_pool(api_url: str, pool: str = POOL) -> None:
    """Create the `process` work pool prefect.yaml's deployments name, unless it exists."""
    if httpx.get(f"{api_url}/work_pools/{pool}", timeout=30).status_code == 200:
        return
    done = subprocess.run(
        [sys.executable, "-m", "prefect", "work-pool", "create", pool, "--type", "process"],
        env=_env(api_url), cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, f"work-pool create failed:\n{done.stdout}\n{done.stderr}"


def deploy_with_triggers(
    api_url: str, names: Sequence[str], prefect_file: Path | None = None, pool: str = POOL
) -> dict[str, dict[str, Any]]:
    """`prefect deploy --name N...` against ``api_url``; returns each deployment (API JSON) by name.

    Its automations (the deployment's `triggers:`) are created by the same command;
    read them with :func:`automations_of`. ``prefect_file`` defaults to the
    repository's prefect.yaml; a test may pass a copy with a shorter `within`.
    """
    ensure_work_pool(api_url, pool)
    args = [sys.executable, "-m", "prefect", "--no-prompt", "deploy"]
    if prefect_file is not None:
        args += ["--prefect-file", str(prefect_file)]
    for name in names:
        args += ["--name", name]
    done = subprocess.run(args, env=_env(api_url), cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"prefect deploy exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    found: dict[str, dict[str, Any]] = {}
    for deployment in httpx.post(f"{api_url}/deployments/filter", json={}, timeout=30).json():
        if deployment["name"] in names:
            found[deployment["name"]] = deployment
    missing = set(names) - set(found)
    assert not missing, f"deployed but not found on the server: {missing}\n{done.stdout}"
    return found


def automations_of(api_url: str, deployment_id: str) -> list[dict[str, Any]]:
    """The automations a deployment owns (created from its `triggers:`)."""
    response = httpx.get(f"{api_url}/automations/related-to/prefect.deployment.{deployment_id}", timeout=30)
    response.raise_for_status()
    result: list[dict[str, Any]] = response.json()
    return result


def wait_for_flow_run(
    api_url: str, deployment_id: str, timeout: float = 30, exclude: Sequence[str] = (),
    where: Callable[[dict[str, Any]], bool] | None = None,
) -> dict[str, Any]:
    """The first flow run of a deployment (not in ``exclude``, passing ``where``) to appear within ``timeout`` s.

    ``where`` sees the run's API JSON, e.g. ``lambda r: r["parameters"]["job_id"] == job``.

    Raises:
        AssertionError: none appeared (the trigger did not fire).
    """
    deadline = time.monotonic() + timeout
    body = {"deployments": {"id": {"any_": [deployment_id]}}, "sort": "EXPECTED_START_TIME_ASC"}
    while True:
        runs = httpx.post(f"{api_url}/flow_runs/filter", json=body, timeout=30).json()
        fresh = [r for r in runs if r["id"] not in exclude and (where is None or where(r))]
        if fresh:
            run: dict[str, Any] = fresh[0]
            return run
        if time.monotonic() > deadline:
            raise AssertionError(f"no flow run of deployment {deployment_id} appeared within {timeout} s")
        time.sleep(0.5)


def run_deployment_here(deployment_id: str, parameters: dict[str, Any]) -> Any:
    """Create a flow run of the deployment with ``parameters`` on the API (Prefect's client: a busy test server's
    503 is retried, as a worker's calls are) and execute it in this process (``run_flow_run_here``); its final state.
    """
    from uuid import UUID

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run_from_deployment(UUID(str(deployment_id)), parameters=parameters)
    return run_flow_run_here(str(flow_run.id))


def run_flow_run_here(flow_run_id: str) -> Any:
    """Execute a created flow run in this process (no worker): load its flow from the entrypoint, run it.

    Returns the final Prefect state; the server records the run as it goes.
    """
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow
    from prefect.flows import load_flow_from_entrypoint

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(UUID(flow_run_id))
        assert flow_run.deployment_id is not None, f"flow run {flow_run_id} has no deployment"
        deployment = client.read_deployment(flow_run.deployment_id)
    assert deployment.entrypoint, f"deployment {deployment.name} has no entrypoint"
    path, _, name = deployment.entrypoint.partition(":")
    flow: Any = load_flow_from_entrypoint(f"{REPO / path}:{name}")
    return run_flow(flow, flow_run=flow_run, parameters=flow_run.parameters, return_type="state")


def model_events(api_url: str, event: str, model: str, since: datetime, expect: int = 1,
                 timeout: float = 30) -> list[dict[str, Any]]:
    """The ``event`` events about ``shardline.model.<model>`` the API holds since ``since``, oldest first (they
    persist asynchronously: waits until ``expect`` are there, or ``timeout`` s)."""
    body = {"filter": {"event": {"name": [event]}, "resource": {"id": [f"shardline.model.{model}"]},
                       "occurred": {"since": since.isoformat()}}}
    deadline = time.monotonic() + timeout
    while True:
        found: list[dict[str, Any]] = httpx.post(f"{api_url}/events/filter", json=body, timeout=30).json()["events"]
        if len(found) >= expect or time.monotonic() > deadline:
            return sorted(found, key=lambda e: e["occurred"])
        time.sleep(0.5)
