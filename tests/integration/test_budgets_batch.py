"""Budgets in batch: `shardline batch run`, and a deployment's run, warn, degrade (low priority, on spot capacity where
there is some: said in one line, the job's ledger rows priced as what it ran on) and refuse at a tenant's budget,
with the figures, over a ledger that real jobs and earlier runs wrote; a job begun before still runs. The spot
worker group a soft job gets on Kubernetes is tested against an API server in test_dask_kubernetes.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pyarrow.dataset as pads
import pytest
import yaml

from shardline.cost.budgets import spend_by_tenant
from shardline.capacity.prices import load_prices
from shardline.storage.job_records import JobRecords
from shardline.storage.ledger import LedgerStore
from tests.support.budgets import spend, write_prices


def _warnings(api_url: str, tenant: str, want: int, timeout: float = 20) -> list[dict]:
    body = {"filter": {"event": {"name": ["shardline.budget.warning"]},
                       "resource": {"id": [f"shardline.tenant.{tenant}"]}}, "limit": 50}
    deadline = time.monotonic() + timeout
    while True:
        events = httpx.post(f"{api_url}/events/filter", json=body, timeout=30).json()["events"]
        if len(events) >= want or time.monotonic() > deadline:
            return events
        time.sleep(0.5)


def last_json(output: str) -> dict:
    return json.loads(next(line for line in reversed(output.splitlines()) if line.startswith("{")))


def _spent(home: Path, tenant: str) -> float:
    month = datetime.now(timezone.utc).strftime("%Y-%m")
    rows = LedgerStore(str(home)).read(month).to_pylist()
    return spend_by_tenant(rows, load_prices(home / "prices.yaml")).get(tenant, 0.0)


@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_a_batch_job_warns_degrades_and_is_refused_at_its_tenants_budget(
    input_shards: Path, tmp_path: Path, shardline_home: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prefect.settings import PREFECT_API_URL

    api_url = str(PREFECT_API_URL.value())
    monkeypatch.setenv("PREFECT_API_URL", api_url)  # where the CLI posts its events
    monkeypatch.setenv("SHARDLINE_BATCH_RUNNER_IDLE_S", "0")
    write_prices(shardline_home)  # a CPU core-second costs 1 USD
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"tenants": [{
        "name": "acme", "batch": {"storage_prefixes": [str(tmp_path)]},
        "budget": {"monthly": 1000.0, "warn_at": 0.8, "soft_at": 0.9}}]}))
    monkeypatch.setenv("SHARDLINE_TENANTS_FILE", str(tenants))

    def run(*args: str, **env: str) -> tuple[int, str]:  # the command as a user runs it, in its own process
        ran = subprocess.run([sys.executable, "-m", "shardline.cli", *args], capture_output=True, text=True,
                             timeout=240, env={**os.environ, "DO_NOT_TRACK": "1", **env})
        return ran.returncode, ran.stdout + ran.stderr

    def batch(out: str, **env: str) -> tuple[int, str]:
        return run("batch", "run", "--model", "breast-cancer@prod", "--input", str(input_shards), "--output",
                   str(tmp_path / out), "--tenant", "acme", "--json", **env)

    def capacity_of(job_id: str) -> set[str]:  # the capacity types of the job's ledger rows
        rows = LedgerStore(str(shardline_home)).read(month).to_pylist()
        return {r["capacity_type"] for r in rows if r["writer"].startswith(f"batch-{job_id}-")}

    # warn: 850 of 1,000 spent this month (an earlier run's rows in the ledger): the job runs, says so, and a
    # Prefect event says it too
    spend(shardline_home, "acme", 850.0)
    code, output = batch("warned")
    assert code == 0, output
    month = datetime.now(timezone.utc).strftime("%Y-%m")
    assert f"tenant 'acme' is past its budget's warning threshold (spent 850.00 USD of 1,000.00 USD (85%) in " \
           f"{month}); the job runs" in output
    first = last_json(output)
    assert first["rows_out"] == 12_000
    assert capacity_of(first["job_id"]) == {"on-demand"}
    events = _warnings(api_url, "acme", 1)
    assert [(e["payload"]["state"], e["payload"]["tier"], e["payload"]["spent"]) for e in events] == [
        ("warn", "batch", 850.0)]
    after_job = _spent(shardline_home, "acme")
    assert after_job > 850.0  # the job's own use was metered and priced: the budget sees it
    # a wrong request past the warning threshold gets its own error alone: it is not told that the job runs
    code, output = run("batch", "run", "--model", "breast-cancer@prod", "--input", str(input_shards), "--output",
                       str(tmp_path / "wrong"), "--tenant", "acme", "--priority", "urgent")
    assert code == 2, output
    assert output.startswith("error: priority 'urgent' is not one of") and len(output.strip().splitlines()) == 1

    # soft: past 90%: the job runs at low priority on spot capacity; a local cluster on on-demand capacity has
    # none, so it runs there, said in one line, and its ledger rows are priced as on-demand
    spend(shardline_home, "acme", 950.0 - after_job)
    code, output = batch("degraded")
    assert code == 0, output
    assert "tenant 'acme' is past its budget's soft limit: work is degraded (spent 950.00 USD" in output
    assert "; this job runs at low priority on on-demand capacity, because none is spot here " \
           "(SHARDLINE_DASK_CLUSTER=address cannot move it; on kubernetes its workers would run on spot nodes)" in output
    assert json.loads((tmp_path / "degraded" / "_manifest.json").read_text())["priority"] == "low"
    degraded = last_json(output)["job_id"]
    assert JobRecords(str(shardline_home)).find(degraded).parameters.capacity_type == "spot"  # asked again on resume
    assert capacity_of(degraded) == {"on-demand"}
    # where the capacity is spot (SHARDLINE_METERING_CAPACITY_TYPE), the soft job runs and is metered there
    code, output = batch("degraded-on-spot", SHARDLINE_METERING_CAPACITY_TYPE="spot")
    assert code == 0, output
    assert "; this job runs at low priority on spot capacity" in output
    assert capacity_of(last_json(output)["job_id"]) == {"spot"}

    # hard: at the budget: refused before any flow run, with the figures, exit code 2
    spend(shardline_home, "acme", 1000.0 - _spent(shardline_home, "acme") + 25.0)
    code, output = batch("refused")
    assert code == 2, output
    assert f"error: tenant 'acme' is at its budget's hard limit: new work is refused until the month ends or the " \
           f"budget grows (spent 1,025.00 USD of 1,000.00 USD (102%) in {month}); the job was not started" in output
    assert not (tmp_path / "refused").exists()
    assert len(output.strip().splitlines()) == 1

    # nothing accepted before is lost: the first job, resumed, still runs (its parts kept)
    code, output = run("batch", "resume", first["job_id"], "--json")
    assert code == 0, output
    assert "this job was begun before, so it runs to the end" in output
    assert last_json(output)["shards_skipped"] == 6


@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_a_deployments_run_meets_its_tenants_budget_as_the_command_does(
    input_shards: Path, tmp_path: Path, shardline_home: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """prefect.yaml's nightly deployment, run as a worker runs it (the flow run's own process, its parameters from
    the API): a tenant at its hard limit has the job refused before anything is written, one past its soft limit
    has it run at low priority; each says so and sends the event. (The command applies the budget to its own
    runs, so the flow leaves a run from no deployment as it is: the test above.)"""
    from prefect.settings import PREFECT_API_URL

    from shardline.flows.batch_inference import batch_inference
    from tests.integration.automations import deploy_with_triggers, run_deployment_here

    api_url = str(PREFECT_API_URL.value())
    write_prices(shardline_home)
    tenants = tmp_path / "tenants.yaml"
    budget = {"monthly": 1000.0, "warn_at": 0.8, "soft_at": 0.9}
    tenants.write_text(yaml.safe_dump({"tenants": [
        {"name": name, "batch": {"storage_prefixes": [str(tmp_path)]}, "budget": budget} for name in ("zeta", "eta")]}))
    monkeypatch.setenv("SHARDLINE_TENANTS_FILE", str(tenants))
    spend(shardline_home, "zeta", 1025.0)
    spend(shardline_home, "eta", 950.0)
    nightly = deploy_with_triggers(api_url, ["nightly"])["nightly"]

    def run(tenant: str, output: str = "") -> tuple[object, Path]:
        out = tmp_path / (output or f"out-{tenant}")
        parameters = {"model": "breast-cancer@prod", "input_uri": str(input_shards), "output_uri": str(out),
                      "tenant": tenant}
        return run_deployment_here(nightly["id"], parameters), out

    refused, out = run("zeta")
    assert refused.is_failed(), refused  # type: ignore[attr-defined]
    assert "tenant 'zeta' is at its budget's hard limit: new work is refused until the month ends or the budget " \
           "grows (spent 1,025.00 USD of 1,000.00 USD (102%)" in str(refused.message)  # type: ignore[attr-defined]
    assert "the job was not started" in str(refused.message) and not out.exists()  # type: ignore[attr-defined]

    degraded, out = run("eta")
    assert degraded.is_completed(), degraded  # type: ignore[attr-defined]
    assert json.loads((out / "_manifest.json").read_text())["priority"] == "low"
    assert pads.dataset(out).count_rows() == 12_000
    events = _warnings(api_url, "zeta", 1) + _warnings(api_url, "eta", 1)
    assert sorted((e["payload"]["tenant"], e["payload"]["state"]) for e in events) == [("eta", "soft"),
                                                                                       ("zeta", "hard")]

    # a run from no deployment (what `batch run` starts, having applied the budget itself) is not refused again
    state = batch_inference(model="breast-cancer@prod", input_uri=str(input_shards),
                            output_uri=str(tmp_path / "out-command"), tenant="zeta", return_state=True)
    assert state.is_completed(), state
    # and a job begun before is no new work: the deployment's run of it goes on at the hard limit
    again, _ = run("zeta", "out-command")
    assert again.is_completed(), again  # type: ignore[attr-defined]
