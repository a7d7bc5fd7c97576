"""The deployment specs say what they mean: prefect.yaml, deploy/k8s/base/tenant/dask/cluster-cpu.yaml, deploy/README.md.

No cluster or server here: the files are read as `prefect deploy` and the
dask-kubernetes operator would read them, and checked against the flow and the
settings they name. (A real `prefect deploy` runs in tests/e2e/test_prefect_deploy.py.)
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.settings_names import unknown_settings

REPO = Path(__file__).resolve().parents[2]
SPOT_LABELS = {
    "karpenter.sh/capacity-type": "spot",
    "eks.amazonaws.com/capacityType": "SPOT",
    "cloud.google.com/gke-spot": "true",
    "kubernetes.azure.com/scalesetpriority": "spot",
}


def load(relative: str) -> Any:
    return yaml.safe_load((REPO / relative).read_text())


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    spec: dict[str, Any] = load("deploy/k8s/base/tenant/dask/cluster-cpu.yaml")
    return spec


@pytest.fixture(scope="module")
def nightly() -> dict[str, Any]:
    [deployment] = [d for d in load("prefect.yaml")["deployments"] if d["name"] == "nightly"]
    return deployment  # type: ignore[no-any-return]


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    [found] = [c for c in pod_spec["containers"] if c["name"] == name]
    return found  # type: ignore[no-any-return]


# deploy/k8s/base/tenant/dask/cluster-cpu.yaml


def test_cluster_is_a_dask_cluster_whose_service_selects_its_scheduler(cluster: dict[str, Any]) -> None:
    assert (cluster["apiVersion"], cluster["kind"]) == ("kubernetes.dask.org/v1", "DaskCluster")
    name = cluster["metadata"]["name"]
    service = cluster["spec"]["scheduler"]["service"]
    assert service["selector"] == {"dask.org/cluster-name": name, "dask.org/component": "scheduler"}
    assert {p["name"]: p["port"] for p in service["ports"]} == {"tcp-comm": 8786, "http-dashboard": 8787}
    scheduler = container(cluster["spec"]["scheduler"]["spec"], "scheduler")
    assert scheduler["args"][:2] == ["dask", "scheduler"]
    assert {p["name"] for p in scheduler["ports"]} == {"tcp-comm", "http-dashboard"}
    assert scheduler["readinessProbe"]["httpGet"]["path"] == "/health"
    # an idle cluster left behind by a dead flow process is deleted by the operator
    assert cluster["spec"]["idleTimeout"] > 0


def test_scheduler_never_lands_on_spot(cluster: dict[str, Any]) -> None:
    affinity = cluster["spec"]["scheduler"]["spec"]["affinity"]["nodeAffinity"]
    [term] = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    excluded = {e["key"]: e["values"] for e in term["matchExpressions"] if e["operator"] == "NotIn"}
    for label, spot in SPOT_LABELS.items():
        assert spot in excluded.get(label, []), f"the scheduler could be placed on {label}={spot}"
    assert not cluster["spec"]["scheduler"]["spec"].get("tolerations")


def test_workers_prefer_spot_tolerate_it_and_retire_gracefully(cluster: dict[str, Any]) -> None:
    worker_group = cluster["spec"]["worker"]
    pod = worker_group["spec"]
    assert worker_group["replicas"] >= 1
    preferred = {
        (e["key"], v)
        for p in pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        for e in p["preference"]["matchExpressions"] if e["operator"] == "In"
        for v in e["values"]
    }
    assert set(SPOT_LABELS.items()) <= preferred
    tolerated = {(t["key"], t.get("value"), t["effect"]) for t in pod["tolerations"]}
    assert ("kubernetes.azure.com/scalesetpriority", "spot", "NoSchedule") in tolerated
    assert ("cloud.google.com/gke-spot", "true", "NoSchedule") in tolerated
    assert pod["terminationGracePeriodSeconds"] >= 60

    worker = container(pod, "worker")
    args = worker["args"]
    assert args[:2] == ["dask", "worker"] and args[args.index("--nthreads") + 1] == "1"
    assert args[args.index("--name") + 1] == "$(DASK_WORKER_NAME)"
    # the preStop hook is real Python that retires this worker by name
    command = worker["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python", "-c"]
    compile(command[2], "preStop", "exec")
    assert "retire_workers(" in command[2] and "DASK_WORKER_NAME" in command[2]


def test_gpu_variant_is_noted_next_to_the_worker_command() -> None:
    text = (REPO / "deploy/k8s/base/tenant/dask/cluster-cpu.yaml").read_text()
    assert re.search(r"#\s*args: \[dask, worker, .*--nthreads, \"1\",", text)
    assert "--resources, GPU=1" in text and "nvidia.com/gpu: 1" in text


def test_scheduler_serves_the_http_api_the_operator_calls(cluster: dict[str, Any]) -> None:
    scheduler = container(cluster["spec"]["scheduler"]["spec"], "scheduler")
    env = {e["name"]: e["value"] for e in scheduler["env"]}
    routes = ast.literal_eval(env["DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES"])
    assert "distributed.http.scheduler.api" in routes and "distributed.http.health" in routes
    assert int(env["DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES"]) >= 3


# prefect.yaml


def entrypoint_flow(deployment: dict[str, Any]) -> Any:
    """The flow object `prefect deploy` loads for the deployment's entrypoint."""
    from prefect.flows import load_flow_from_entrypoint

    return load_flow_from_entrypoint(str(REPO / deployment["entrypoint"]))


def test_nightly_entrypoint_is_the_batch_flow(nightly: dict[str, Any]) -> None:
    path, function = nightly["entrypoint"].split(":")
    assert (REPO / path).is_file() and function == "batch_inference"
    assert entrypoint_flow(nightly).name == "batch-inference"


def test_nightly_parameters_fit_the_flow_signature(nightly: dict[str, Any]) -> None:
    flow = entrypoint_flow(nightly)
    signature = inspect.signature(flow.fn)
    parameters = nightly["parameters"]
    assert set(parameters) == {"model", "input_uri", "output_uri", "tenant"}
    assert set(parameters) <= set(signature.parameters)
    required = {n for n, p in signature.parameters.items() if p.default is inspect.Parameter.empty}
    assert required <= set(parameters), "a scheduled run would lack a required parameter"
    validated = flow.validate_parameters(parameters)
    assert {name: validated[name] for name in parameters} == parameters


def test_nightly_schedule_is_a_valid_cron_shipped_inactive(nightly: dict[str, Any]) -> None:
    from prefect.client.schemas.schedules import CronSchedule

    [schedule] = nightly["schedules"]
    CronSchedule(cron=schedule["cron"], timezone=schedule["timezone"])
    assert schedule["cron"] == "0 2 * * *"
    # its parameters point at the demo's data: a fresh server must not start failing runs
    assert schedule["active"] is False


def test_nightly_runs_on_a_process_pool_from_this_checkout_without_docker(nightly: dict[str, Any]) -> None:
    project = load("prefect.yaml")
    assert nightly["work_pool"]["name"] == "shardline-batch"
    assert nightly["concurrency_limit"]["limit"] == 1
    steps = [*(project.get("build") or []), *(project.get("push") or []), *(project.get("pull") or [])]
    assert all(next(iter(s)).startswith("prefect.deployments.steps.") for s in steps), steps
    # the pull step goes back to where `prefect deploy` ran, recorded by a build step
    [pull] = project["pull"]
    directory = pull["prefect.deployments.steps.set_working_directory"]["directory"]
    step_id = re.fullmatch(r"\{\{\s*([\w-]+)\.stdout\s*\}\}", directory)
    assert step_id, directory
    [recorder] = [s for s in project["build"] if next(iter(s.values())).get("id") == step_id.group(1)]
    assert recorder == {
        "prefect.deployments.steps.run_shell_script": {"id": step_id.group(1), "script": "pwd", "stream_output": False}
    }


# every SHARDLINE_* name the deploy files mention is a real setting


@pytest.mark.parametrize("relative", ["deploy/README.md", "deploy/k8s/base/tenant/dask/cluster-cpu.yaml", "deploy/ci/release-model.yml",
                                      "prefect.yaml"])
def test_settings_named_in_deploy_files_exist(relative: str) -> None:
    unknown = unknown_settings((REPO / relative).read_text())
    assert not unknown, f"{relative} names settings that do not exist: {sorted(unknown)}"


def test_promote_deployment_runs_the_promotion_flow_without_a_schedule() -> None:
    [promote] = [d for d in load("prefect.yaml")["deployments"] if d["name"] == "promote"]
    flow = entrypoint_flow(promote)
    assert flow.name == "promote-model"
    assert "schedules" not in promote  # promotions are asked for, never scheduled
    required = {n for n, p in inspect.signature(flow.fn).parameters.items() if p.default is inspect.Parameter.empty}
    assert required == {"reference", "to_alias"}  # a run names the candidate and the alias
    assert promote["work_pool"]["name"] == "shardline-batch"
