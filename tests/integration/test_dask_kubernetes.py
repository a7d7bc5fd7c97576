"""The batch job's Dask cluster on Kubernetes, against a Kubernetes API on loopback (kmock's KubernetesEmulator).

The flow's own code runs through the real client (kr8s, as dask-kubernetes uses it): ``dask_scheduler`` creates the
job's DaskCluster and DaskAutoscaler, the SLA response's ``scale_up`` scales them. No dask operator runs against the
emulator, so a thread plays its part: it marks the cluster Running and makes the default worker group with the
operator's own ``build_default_worker_group_spec``. The busy check asks a real LocalCluster's scheduler.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Iterator

import kr8s
import kr8s.objects
import pytest
import yaml
from dask_kubernetes.operator.controller.controller import build_default_worker_group_spec
from distributed import Client, Event, LocalCluster

from shardline.settings import DaskSettings
from shardline.tasks.cluster import dask_scheduler
from shardline.tasks.kube_cluster import job_cluster_resources, scale_job_cluster
from shardline.tasks.sla_response import scale_up
from tests.support.kube_api import KubeApi, kube_api

NAMESPACE = "shardline-tenant-acme"
TEMPLATE = Path(__file__).resolve().parents[2] / "deploy/k8s/base/tenant/dask/cluster-gpu.yaml"
CLUSTERS, GROUPS, SCALERS = (f"kubernetes.dask.org/v1/{p}" for p in ("daskclusters", "daskworkergroups",
                                                                       "daskautoscalers"))
Cluster = kr8s.objects.new_class("DaskCluster", "kubernetes.dask.org/v1")
Group = kr8s.objects.new_class("DaskWorkerGroup", "kubernetes.dask.org/v1")


def forget_kr8s_clients() -> None:
    """kr8s keeps one client per thread and arguments, not per KUBECONFIG: drop those made for another API."""
    from kr8s._api import Api

    Api._instances.clear()


@pytest.fixture(scope="module")
def api() -> Iterator[KubeApi]:
    with kube_api() as running, pytest.MonkeyPatch.context() as patch:
        patch.setenv("KUBECONFIG", str(running.kubeconfig))
        forget_kr8s_clients()
        yield running
    forget_kr8s_clients()


def settings(**changes: Any) -> DaskSettings:
    return DaskSettings(cluster="kubernetes", kubernetes_spec=str(TEMPLATE), kubernetes_namespace=NAMESPACE,
                        kubernetes_workers=2, kubernetes_max_workers=10, kubernetes_ready_timeout_s=20, **changes)


def play_operator(name: str) -> threading.Thread:
    """What the dask operator does first for a new DaskCluster: its default worker group, then phase Running."""
    def run() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                cluster = Cluster.get(name, namespace=NAMESPACE)
                break
            except kr8s.NotFoundError:
                time.sleep(0.1)
        spec = cluster.raw["spec"]["worker"]
        Group(build_default_worker_group_spec(name, spec, {}, {}), namespace=NAMESPACE).create()
        cluster.patch({"status": {"phase": "Running"}})

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_job_creates_its_own_named_cluster_gpu_workers_on_spot_and_an_autoscaler(api: KubeApi) -> None:
    job = "0123456789abcdef"
    name = f"shardline-{job}"
    operator = play_operator(name)
    with dask_scheduler(settings(), job) as address:
        assert address == f"tcp://{name}-scheduler.{NAMESPACE}:8786"
        cluster = api.get(CLUSTERS, NAMESPACE, name)
        assert cluster is not None and cluster["metadata"]["annotations"]["shardline.dev/job-id"] == job
        assert cluster["spec"]["scheduler"]["service"]["selector"]["dask.org/cluster-name"] == name
        scheduler = cluster["spec"]["scheduler"]["spec"]
        on_demand = scheduler["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert {"key": "karpenter.sh/capacity-type", "operator": "NotIn", "values": ["spot"]} in \
            on_demand["nodeSelectorTerms"][0]["matchExpressions"]
        worker = cluster["spec"]["worker"]
        assert worker["replicas"] == 2
        [container] = worker["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert container["args"][container["args"].index("--resources") + 1] == "GPU=1"
        assert "/tmp/shardline-preempt" in container["lifecycle"]["preStop"]["exec"]["command"][2]
        assert {"key": "karpenter.sh/capacity-type", "operator": "Equal", "value": "spot", "effect": "NoSchedule"} \
            in worker["spec"]["tolerations"]
        assert api.get(SCALERS, NAMESPACE, name)["spec"] == {"cluster": name, "minimum": 2, "maximum": 10}
        operator.join(5)
        assert api.get(GROUPS, NAMESPACE, f"{name}-default")["spec"]["worker"]["replicas"] == 2
    # the job ended: its cluster and autoscaler are deleted (the operator's cascade takes the worker group)
    assert api.get(CLUSTERS, NAMESPACE, name) is None and api.get(SCALERS, NAMESPACE, name) is None


def test_a_spot_jobs_cluster_puts_its_workers_on_spot_gpu_nodes_only(api: KubeApi) -> None:
    """What `batch run` asks for a tenant past its budget's soft limit (``capacity_type`` spot): the DaskCluster's
    workers, and the worker group the operator makes from it, require a spot node (any cloud's mark) that is a GPU
    node; the scheduler stays off spot."""
    job = "feedfacecafe0004"
    name = f"shardline-{job}"
    operator = play_operator(name)
    with dask_scheduler(settings(), job, "spot"):
        cluster = api.get(CLUSTERS, NAMESPACE, name)
        assert cluster["metadata"]["annotations"]["shardline.dev/capacity-type"] == "spot"
        operator.join(5)
        group = api.get(GROUPS, NAMESPACE, f"{name}-default")
        for worker in (cluster["spec"]["worker"]["spec"], group["spec"]["worker"]["spec"]):
            terms = worker["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
                "nodeSelectorTerms"]
            assert {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]} in terms[0]["matchExpressions"]
            marks = {(e["key"], e["values"][0]) for t in terms for e in t["matchExpressions"] if e["operator"] == "In"}
            assert ("karpenter.sh/capacity-type", "spot") in marks and ("cloud.google.com/gke-spot", "true") in marks
            assert all(len(t["matchExpressions"]) == 2 for t in terms)  # each: a GPU node and one cloud's spot mark
        scheduler = cluster["spec"]["scheduler"]["spec"]["affinity"]["nodeAffinity"]
        assert {"key": "karpenter.sh/capacity-type", "operator": "NotIn", "values": ["spot"]} in \
            scheduler["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"]
    assert api.get(CLUSTERS, NAMESPACE, name) is None


def replicas(api: KubeApi, name: str) -> tuple[int, int, int]:
    group = api.get(GROUPS, NAMESPACE, f"{name}-default")
    scaler = api.get(SCALERS, NAMESPACE, name)
    assert group is not None and scaler is not None
    return group["spec"]["worker"]["replicas"], scaler["spec"]["minimum"], scaler["spec"]["maximum"]


def test_the_sla_response_scales_the_jobs_own_cluster_up_to_its_maximum(api: KubeApi) -> None:
    job = "feedfacecafe0001"
    name = f"shardline-{job}"
    play_operator(name)
    with dask_scheduler(settings(), job):
        said = scale_up.fn(settings(), job, 3)
        assert "from 2 to 5 workers" in said and name in said
        assert replicas(api, name) == (5, 5, 10)  # the autoscaler's minimum follows: it cannot take them back
        said = scale_up.fn(settings(), job, 20)
        assert "capped at its maximum of 10" in said
        assert replicas(api, name) == (10, 10, 10)
        assert "already at its maximum" in scale_up.fn(settings(), job, 1)
    assert "does not exist; nothing scaled" in scale_up.fn(settings(), job, 1)


def test_scaling_down_waits_for_idle_workers_and_stops_at_the_jobs_minimum(api: KubeApi) -> None:
    job = "feedfacecafe0002"
    name = f"shardline-{job}"
    play_operator(name)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as local, \
            Client(local) as client, dask_scheduler(settings(), job):
        scale_up.fn(settings(), job, 4)
        assert replicas(api, name) == (6, 6, 10)
        release = Event("release", client=client)
        busy = client.submit(lambda: release.wait(30), pure=False)
        deadline = time.monotonic() + 10
        while not any(client.processing().values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        said = scale_job_cluster(settings(), job, -3, scheduler_address=local.scheduler_address)
        assert "not scaled down: 1 workers are busy" in said
        assert replicas(api, name) == (6, 6, 10)
        release.set()
        busy.result(10)
        said = scale_job_cluster(settings(), job, -3, scheduler_address=local.scheduler_address)
        assert "from 6 to 3 workers" in said
        assert replicas(api, name) == (3, 3, 10)
        said = scale_job_cluster(settings(), job, -5, scheduler_address=local.scheduler_address)
        assert "held at its minimum of 2" in said
        assert replicas(api, name) == (2, 2, 10)
        # no scheduler to ask: not known to be idle, so not scaled down
        scale_up.fn(settings(), job, 2)
        assert "could not say" in scale_job_cluster(settings(), job, -2, scheduler_address="tcp://127.0.0.1:9")
        assert replicas(api, name) == (4, 4, 10)


def test_a_resumed_job_uses_the_cluster_its_earlier_run_left_behind(api: KubeApi) -> None:
    job = "feedfacecafe0003"
    name = f"shardline-{job}"
    left, _ = job_cluster_resources(yaml.safe_load(TEMPLATE.read_text()), job, 2, 10)
    left["spec"]["worker"]["replicas"] = 7  # what the earlier run had scaled it to
    Cluster(left, namespace=NAMESPACE).create()
    play_operator(name)
    with dask_scheduler(settings(), job) as address:
        assert address.startswith(f"tcp://{name}-scheduler.")
        assert api.get(CLUSTERS, NAMESPACE, name)["spec"]["worker"]["replicas"] == 7  # adopted, not replaced
        assert api.get(SCALERS, NAMESPACE, name)["spec"]["maximum"] == 10
    assert api.get(CLUSTERS, NAMESPACE, name) is None
