"""SLAs, automations, fairness, quotas and isolation of batch jobs, on the session's real Prefect API and LocalCluster.

The Prefect test harness runs the event persister, the reactive triggers and the
actions services, so the automations prefect.yaml declares are deployed with the
real `prefect deploy` and fire here (tests/integration/automations.py).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pyarrow.dataset as ds
import pytest
import yaml
from typer.testing import CliRunner

from shardline.errors import AccessDenied, QuotaExceeded
from shardline.flows.batch_inference import batch_inference
from shardline.storage.job_records import JobRecords
from shardline.storage.ledger import Holding, LedgerStore
from shardline.tasks.artifacts import batch_artifact_key

from tests.integration.automations import deploy_with_triggers, run_deployment_here, run_flow_run_here, wait_for_flow_run


def _api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    assert url, "the Prefect harness is not running"
    return str(url)


def _events(api_url: str, job_id: str, timeout: float = 20, want: str = "shardline.batch.completed") -> list[str]:
    """Names of the events the server stored for a job, once ``want`` is among them."""
    body = {"filter": {"event": {"prefix": ["shardline.batch."]},
                       "resource": {"id": [f"shardline.batch-job.{job_id}"]}}, "limit": 50}
    deadline = time.monotonic() + timeout
    while True:
        names = [e["event"] for e in httpx.post(f"{api_url}/events/filter", json=body, timeout=30).json()["events"]]
        if want in names or time.monotonic() > deadline:
            return names
        time.sleep(0.5)


@pytest.fixture(scope="module")
def sla_response_deployment(prefect_harness: None) -> dict[str, Any]:
    """prefect.yaml's sla-response deployment, with its triggers, on the session's Prefect API."""
    return deploy_with_triggers(_api_url(), ["sla-response"])["sla-response"]


@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_a_late_job_emits_sla_events_and_the_automation_answers(
    input_shards: Path, tmp_path: Path, shardline_home: Path, sla_response_deployment: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SHARDLINE_BATCH_SLA_CHECK_INTERVAL_S", "0.2")
    out = tmp_path / "out"
    # each settled shard takes 0.1 s more (a watcher, as the CLI's progress bar is): the job is late on any machine
    state = batch_inference(model="breast-cancer@prod", input_uri=str(input_shards), output_uri=str(out),
                            tenant="acme", sla="0.3s", watchers=[lambda settled, todo, rows: time.sleep(0.1)],
                            return_state=True)
    assert state.is_completed()
    job_id = state.result()["job_id"]

    # the events reached the server, each once, with the job's figures
    api_url = _api_url()
    names = _events(api_url, job_id)
    assert names.count("shardline.batch.sla-breached") == 1 and names.count("shardline.batch.completed") == 1
    assert "shardline.batch.started" in names
    body = {"filter": {"event": {"name": ["shardline.batch.sla-breached"]},
                       "resource": {"id": [f"shardline.batch-job.{job_id}"]}}}
    [breached] = httpx.post(f"{api_url}/events/filter", json=body, timeout=30).json()["events"]
    assert breached["payload"]["tenant"] == "acme" and breached["payload"]["model"] == "breast-cancer:1"
    assert breached["payload"]["shards_total"] == 6 and "deadline" in breached["payload"]
    assert {r["prefect.resource.role"] for r in breached["related"]} >= {"tenant", "model"}

    # the automation from prefect.yaml started the response deployment for this job; run it here
    # (a slower job also turns at-risk first, which starts its own response run: wait for the breach's)
    run = wait_for_flow_run(api_url, sla_response_deployment["id"], timeout=30,
                            where=lambda r: r["parameters"].get("job_id") == job_id
                            and r["parameters"].get("event") == "shardline.batch.sla-breached")
    assert run["parameters"]["tenant"] == "acme"
    final = run_flow_run_here(run["id"])
    assert final.is_completed(), final
    notices = list((shardline_home / "notifications" / "batch").glob(f"{job_id}-sla-breached-*.json"))
    assert len(notices) == 1
    # the session's cluster is a scheduler at an address: reached, but it cannot start workers itself
    assert "a scheduler at an address cannot start workers" in json.loads(notices[0].read_text())["action"]
    assert httpx.get(f"{api_url}/flow_runs/{run['id']}", timeout=30).json()["state"]["type"] == "COMPLETED"

    # planned vs actual: in the manifest, the job record and a table artifact
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["sla"]["status"] == "breached" and manifest["sla"]["shards"] == 6
    record = JobRecords(str(shardline_home)).read(job_id[:8])
    assert (record.state, record.sla_status, record.shards_done) == ("completed", "breached", 6)
    sla_key = batch_artifact_key("sla", "breast-cancer:1", state.result()["output"], None)  # the job's key, not the run's
    artifacts = httpx.post(f"{api_url}/artifacts/filter", json={"artifacts": {"key": {"any_": [sla_key]}}},
                           timeout=30).json()
    assert artifacts and {row["measure"] for row in json.loads(artifacts[0]["data"])} >= {"finish", "SLA"}


@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_status_and_resume_from_the_cli(
    input_shards: Path, tmp_path: Path, shardline_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardline.cli.commands import app

    monkeypatch.setenv("SHARDLINE_BATCH_RUNNER_IDLE_S", "0")  # in this process, on the harness (the runner: e2e)

    out = tmp_path / "out"
    runner = CliRunner()
    ran = runner.invoke(app, ["batch", "run", "--model", "breast-cancer@prod", "--input", str(input_shards),
                              "--output", str(out), "--sla", "2h", "--json"])
    assert ran.exit_code == 0, ran.output
    job_id = json.loads(ran.output.strip().splitlines()[-1])["job_id"]
    status = runner.invoke(app, ["batch", "status", job_id[:6]])
    assert status.exit_code == 0, status.output
    assert "completed" in status.output and "6/6 shards (100%)" in status.output and "met" in status.output

    # what a crash leaves: two parts never written, a record still "running"
    for part in sorted(out.glob("*.parquet"))[:2]:
        part.unlink()
    records = JobRecords(str(shardline_home))
    record = records.read(job_id)
    failed = record.model_copy(update={"state": "failed", "shards_done": 4})  # a run that failed: no finish to show
    records.write(failed)
    shown = runner.invoke(app, ["batch", "status", job_id])
    assert "ETA  none: the job is not running (2 of 6 shards left)" in shown.output, shown.output
    assert "finished" not in shown.output and "SLA  met when it stopped (it is not running)" in shown.output
    record.state, record.finished_at = "running", None
    records.write(record)
    resumed = runner.invoke(app, ["batch", "resume", job_id, "--json"])
    assert resumed.exit_code == 0, resumed.output
    summary = json.loads(resumed.output.strip().splitlines()[-1])
    assert (summary["job_id"], summary["shards_committed"], summary["rows_scored"]) == (job_id, 6, 4_000)
    assert ds.dataset(out, format="parquet").to_table().num_rows == 12_000
    again = records.read(job_id)
    assert (again.state, again.runs, again.deadline) == ("completed", 2, record.deadline)

    missing = runner.invoke(app, ["batch", "status", "ffffffffff"])
    assert missing.exit_code != 0 and "no job 'ffffffffff'" in str(missing.exception or missing.output)


@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_a_deployments_run_refuses_a_past_deadline_or_batch_rows_out_of_range_as_the_command_does(
    input_shards: Path, tmp_path: Path, shardline_home: Path,
) -> None:
    """The nightly deployment's run (its parameters from the API, run as a worker runs it) with ``batch_rows`` 0 or
    a deadline already past: a new job is refused before anything is written, in one line naming what is wrong; a
    job an earlier run began goes on with the past deadline (as `batch resume` keeps an original deadline),
    breached from its start."""
    api_url = _api_url()
    nightly = deploy_with_triggers(api_url, ["nightly"])["nightly"]

    def run(out: Path, **given: Any) -> Any:
        parameters = {"model": "breast-cancer@prod", "input_uri": str(input_shards), "output_uri": str(out),
                      "deadline": "2020-01-01T00:00Z", **given}
        return run_deployment_here(nightly["id"], parameters)

    out = tmp_path / "new"
    no_rows = run(out, batch_rows=0, deadline=None)
    assert no_rows.is_failed(), no_rows
    assert str(no_rows.message) == (
        "Flow run encountered an exception: InvalidSetting: a setting is not valid: the flow parameter batch_rows: "
        "Input should be greater than or equal to 1 (got 0); give the flow parameter batch_rows a value in its range")
    assert not out.exists()
    refused = run(out)
    assert refused.is_failed(), refused
    assert "deadline '2020-01-01T00:00Z' is already past (now " in str(refused.message)
    assert "give a later one" in str(refused.message)
    assert not out.exists() and JobRecords(str(shardline_home)).ids() == []

    begun = tmp_path / "begun"
    state = batch_inference(model="breast-cancer@prod", input_uri=str(input_shards), output_uri=str(begun),
                            sla="2h", return_state=True)
    assert state.is_completed(), state
    for part in sorted(begun.glob("*.parquet"))[:2]:  # what a crash leaves: two parts to score again
        part.unlink()
    again = run(begun)
    assert again.is_completed(), again
    record = JobRecords(str(shardline_home)).read(state.result()["job_id"])
    assert (record.runs, record.sla_status, record.shards_done) == (2, "breached", 6)
    assert record.deadline == datetime(2020, 1, 1, tzinfo=timezone.utc)


def _tenants_file(tmp_path: Path) -> Path:
    config = {"tenants": [
        {"name": "acme", "batch": {"storage_prefixes": [str(tmp_path / "acme")], "max_concurrent_shards": 2}},
        {"name": "globex", "batch": {"storage_prefixes": [str(tmp_path / "globex")], "max_concurrent_shards": 3,
                                     "priority": "low", "gpu_hours_per_day": 1}},
    ]}
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_two_tenants_at_once_both_finish_within_their_limits(
    input_shards: Path, tmp_path: Path, shardline_home: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prefect.client.orchestration import get_client

    monkeypatch.setenv("SHARDLINE_TENANTS_FILE", str(_tenants_file(tmp_path)))
    states: dict[str, Any] = {}
    # each tenant's input lies under its own prefix (a copy of the same shards: a link out of the
    # prefix would be refused, since the job checks where the link leads)
    for tenant in ("acme", "globex"):
        shutil.copytree(input_shards, tmp_path / tenant / "in")
    # Both must progress at once: each job's first settled shard waits until the other's has settled
    # too. Were one tenant's job held back until the other's ended, the barrier would break.
    barrier, met = threading.Barrier(2, timeout=120), set()

    def meet(settled: int, total: int, rows: int) -> None:
        if threading.current_thread().name not in met:
            met.add(threading.current_thread().name)
            barrier.wait()

    threads = [threading.Thread(name=t, target=lambda t=t: states.__setitem__(t, batch_inference(
        model="breast-cancer@prod", input_uri=str(tmp_path / t / "in"), output_uri=str(tmp_path / t / "out"),
        tenant=t, watchers=[meet], return_state=True))) for t in ("acme", "globex")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert met == {"acme", "globex"} and not barrier.broken
    for tenant in ("acme", "globex"):
        assert states[tenant].is_completed(), (tenant, states[tenant])
        assert ds.dataset(tmp_path / tenant / "out", format="parquet").to_table().num_rows == 12_000
        assert json.loads((tmp_path / tenant / "out" / "_manifest.json").read_text())["priority"] == (
            "normal" if tenant == "acme" else "low")
    with get_client(sync_client=True) as client:
        limits = {name: client.read_global_concurrency_limit_by_name(name) for name in (
            "shardline-batch-tenant-acme", "shardline-batch-tenant-globex",
            "shardline-batch-priority-normal", "shardline-batch-priority-low")}
    assert [limits[n].limit for n in sorted(limits)] == [1, 4, 2, 3]
    assert all(limit.active_slots == 0 for limit in limits.values())  # every slot handed back
    # both runs were metered on this (CPU) machine
    today = datetime.now(timezone.utc).date()
    ledger = LedgerStore(str(shardline_home))
    assert all(ledger.device_hours(t, today, "cpu") > 0 for t in ("acme", "globex"))
    metered = ledger.read(today.strftime("%Y-%m")).to_pylist()
    for tenant in ("acme", "globex"):  # what ran, exactly: rows, input bytes, the shards' own scoring seconds
        use = [r for r in metered if r["kind"] == "usage" and r["tenant"] == tenant]
        assert [(r["tier"], r["model"], r["rows"]) for r in use] == [("batch", "breast-cancer", 12_000)]
        assert use[0]["bytes_read"] == sum(p.stat().st_size for p in (tmp_path / tenant / "in").rglob("*.parquet"))
        shard_seconds = sum(json.loads(p.read_text())["seconds"]
                            for p in (tmp_path / tenant / "out" / "_ledger").rglob("*.json"))
        assert use[0]["device_seconds"] == pytest.approx(shard_seconds, rel=1e-6)
        assert use[0]["bytes_written"] > 0
    from shardline.capacity.prices import load_prices
    from shardline.cost.report import build_report

    report = build_report(metered, load_prices(), today.strftime("%Y-%m"))  # the jobs' chargeback, example prices
    assert {(line.tenant, line.tier, line.spend.rows) for line in report.lines} == {
        ("acme", "batch", 12_000), ("globex", "batch", 12_000)}
    assert report.charged + report.idle_cost == pytest.approx(report.priced_capacity, rel=1e-3)
    assert all(line.per_1k_rows for line in report.lines)

    # globex has spent its GPU-hours today: a GPU job is refused before it starts
    ledger.record_batch(Holding("batch", "gpu"), "globex", "breast-cancer", "1", "earlier-job",
                        datetime.now(timezone.utc), {"device_seconds": 3_700}, reserved_seconds=3_700,
                        window_seconds=3_700)
    monkeypatch.setenv("SHARDLINE_RUNTIME_DEVICE", "cuda")
    refused = batch_inference(model="breast-cancer@prod", input_uri=str(tmp_path / "globex" / "in"),
                              output_uri=str(tmp_path / "globex" / "gpu-out"), tenant="globex", return_state=True)
    error = refused.result(raise_on_failure=False)
    assert isinstance(error, QuotaExceeded)
    assert "tenant 'globex' has used 1.03 of its 1 GPU-hours" in str(error)
    assert not (tmp_path / "globex" / "gpu-out").exists()


@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_a_job_outside_its_tenants_prefixes_is_refused_before_anything_is_written(
    input_shards: Path, tmp_path: Path, shardline_home: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SHARDLINE_TENANTS_FILE", str(_tenants_file(tmp_path)))
    shutil.copytree(input_shards, tmp_path / "acme" / "in")
    (tmp_path / "acme" / "linked").symlink_to(input_shards, target_is_directory=True)
    cases = [
        ("acme", str(tmp_path / "acme" / "linked"), str(tmp_path / "acme" / "out"), "as its input"),
        ("acme", str(tmp_path / "acme" / "in"), str(tmp_path / "globex" / "out"), "as its output"),
        ("acme", str(input_shards), str(tmp_path / "acme" / "out"), "as its input"),
        ("acme", str(tmp_path / "acme" / "in"), str(tmp_path / "acme-old" / "out"), "as its output"),
        ("initech", str(input_shards), str(tmp_path / "initech"), "not in the tenants file"),
    ]
    errors = []
    for tenant, source, target, message in cases:
        state = batch_inference(model="breast-cancer@prod", input_uri=source, output_uri=target, tenant=tenant,
                                return_state=True)
        error = state.result(raise_on_failure=False)
        assert isinstance(error, AccessDenied) and message in str(error), error
        assert not Path(target).exists()
        errors.append(str(error))
    assert f"is not under its storage prefixes ({str(tmp_path / 'acme')!r})" in errors[0]
    assert JobRecords(str(shardline_home)).ids() == []


def test_the_proactive_trigger_fires_when_a_nightly_job_never_completes(
    prefect_harness: None, sla_response_deployment: dict[str, Any], tmp_path: Path
) -> None:
    """prefect.yaml's `nightly-batch-not-completed` trigger as declared, with `within` cut from 4 h to 10 s.

    Runs last in the module: re-deploying sla-response replaces its automations.
    """
    from prefect.events import emit_event

    declared = yaml.safe_load((Path(__file__).resolve().parents[2] / "prefect.yaml").read_text())
    [response] = [d for d in declared["deployments"] if d["name"] == "sla-response"]
    [proactive] = [t for t in response["triggers"] if t["posture"] == "Proactive"]
    assert proactive["within"] == 4 * 3600
    proactive["within"] = 10
    patched = tmp_path / "prefect.yaml"
    patched.write_text(yaml.safe_dump(declared))
    api_url = _api_url()
    deployment = deploy_with_triggers(api_url, ["sla-response"], prefect_file=patched)["sla-response"]
    seen = [r["id"] for r in httpx.post(f"{api_url}/flow_runs/filter", json={}, timeout=30).json()]

    job = {"prefect.resource.id": "shardline.batch-job.never-done", "shardline.deployment": "nightly"}
    other = {"prefect.resource.id": "shardline.batch-job.done-in-time", "shardline.deployment": "nightly"}
    emit_event(event="shardline.batch.started", resource=job)
    emit_event(event="shardline.batch.started", resource=other)
    emit_event(event="shardline.batch.completed", resource=other)

    run = wait_for_flow_run(api_url, deployment["id"], timeout=40, exclude=seen)
    assert run["parameters"]["event"] == "shardline.batch.not-completed"
    time.sleep(1)  # both buckets expired in the same evaluation: the job that completed did not fire
    fired = httpx.post(f"{api_url}/flow_runs/filter", json={"deployments": {"id": {"any_": [deployment["id"]]}}},
                       timeout=30).json()
    assert len([r for r in fired if r["id"] not in seen]) == 1
