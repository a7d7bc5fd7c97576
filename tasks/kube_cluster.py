"""A batch job's own Dask cluster on Kubernetes: a DaskCluster (dask-kubernetes' operator) named for the job.

The flow creates it from a template (``SHARDLINE_DASK_KUBERNETES_SPEC``) when ``SHARDLINE_DASK_CLUSTER=kubernetes``,
names it from the job id (:func:`job_cluster_name`: anyone who knows the job, such as the SLA response, knows its
cluster), bounds it with a DaskAutoscaler (``SHARDLINE_DASK_KUBERNETES_WORKERS`` .. ``_MAX_WORKERS``) and deletes it
when the job ends. The job's bounds are also written on the DaskCluster (annotations), so a scaler that comes later
reads them from the cluster itself.

Everything goes through kr8s, the client dask-kubernetes itself uses, to the same resources its operator watches.
``KubeCluster`` is not used: outside the cluster it port-forwards, and its ``scale()`` deletes the DaskAutoscaler.

A job may ask for its capacity type (``capacity_type``: a tenant past its budget's soft limit runs on ``spot``):
:func:`on_capacity` makes its worker group *require* nodes of that type (the template's workers only prefer spot),
with the spot node pools' tolerations; the scheduler stays where the template puts it (never on spot).

Scaling (:func:`scale_job_cluster`, what the SLA response calls) patches the default worker group's replicas, and the
autoscaler's minimum with them, so the autoscaler does not take back what was added. It never goes below the job's
minimum nor above its maximum, and never scales down while a worker is busy: dask-kubernetes' own autoscaler (2026.3)
can remove busy workers (#633, #659) and drop below its minimum (#930), so this one asks the scheduler first.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import re
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from shardline.errors import InvalidInput, InvalidSetting, RuntimeUnavailable
from shardline.settings import DaskSettings

API_VERSION = "kubernetes.dask.org/v1"
NAME_PREFIX = "shardline-"
# What the job's cluster carries besides dask-kubernetes' own labels: the job, and the bounds scalers respect.
JOB_LABEL = "shardline.dev/job"
JOB_ANNOTATION = "shardline.dev/job-id"
MIN_ANNOTATION = "shardline.dev/min-workers"
MAX_ANNOTATION = "shardline.dev/max-workers"
CAPACITY_ANNOTATION = "shardline.dev/capacity-type"
# How the clouds mark a spot (or preemptible) node, as deploy/k8s/base/tenant/dask/cluster-*.yaml name them: the label
# and its value, and whether spot node pools carry it as a NoSchedule taint too (AKS always; GKE and Karpenter when
# configured). EKS managed node groups label only.
SPOT_NODE_LABELS: tuple[tuple[str, str, bool], ...] = (
    ("karpenter.sh/capacity-type", "spot", True),
    ("eks.amazonaws.com/capacityType", "SPOT", False),
    ("cloud.google.com/gke-spot", "true", True),
    ("cloud.google.com/gke-preemptible", "true", False),
    ("kubernetes.azure.com/scalesetpriority", "spot", True),
)
_SLUG_LEN = 24  # shardline- + 24 + -8 hex = 43 characters: room for "-scheduler" and "-default" within 63


def job_cluster_name(job_id: str) -> str:
    """The DaskCluster name of a job: ``shardline-<job id>``, a valid Kubernetes (RFC 1035) name.

    A job id that is not already a short lowercase name (hex digits, as batch jobs have) is slugged and made unique
    again with 8 hex digits of its SHA-256, so two ids never share a name.

    Raises:
        InvalidInput: the job id is empty.
    """
    if not job_id.strip():
        raise InvalidInput("a job's Dask cluster is named from its job id, and the job id is empty; pass the job id")
    slug = re.sub(r"[^a-z0-9]+", "-", job_id.lower()).strip("-")
    name = (NAME_PREFIX + slug[:_SLUG_LEN]).rstrip("-")
    if slug != job_id or len(slug) > _SLUG_LEN:
        name += "-" + hashlib.sha256(job_id.encode()).hexdigest()[:8]
    return name


def on_capacity(pod_spec: dict[str, Any], capacity_type: str) -> dict[str, Any]:
    """A copy of a worker pod spec that runs only on nodes of ``capacity_type``: ``spot`` requires a node a cloud
    marks as spot (any one of ``SPOT_NODE_LABELS``, each with the template's own required terms, such as its GPU
    nodes) and tolerates the spot pools' taints; ``on-demand`` requires a node none marks as spot."""
    spec = copy.deepcopy(pod_spec)
    required = spec.setdefault("affinity", {}).setdefault("nodeAffinity", {}).setdefault(
        "requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = [list(t.get("matchExpressions", [])) for t in required.get("nodeSelectorTerms", [])] or [[]]
    if capacity_type == "spot":  # terms are ORed, a term's expressions ANDed: one term per cloud's mark
        required["nodeSelectorTerms"] = [{"matchExpressions": [*term, {"key": key, "operator": "In", "values": [value]}]}
                                         for term in terms for key, value, _ in SPOT_NODE_LABELS]
        tolerations = spec.setdefault("tolerations", [])
        for key, value, tainted in SPOT_NODE_LABELS:
            toleration = {"key": key, "operator": "Equal", "value": value, "effect": "NoSchedule"}
            if tainted and toleration not in tolerations:
                tolerations.append(toleration)
    else:  # NotIn also matches a node without the label: "on no node that a cloud marks as spot"
        required["nodeSelectorTerms"] = [{"matchExpressions": [*term, *(
            {"key": key, "operator": "NotIn", "values": [value]} for key, value, _ in SPOT_NODE_LABELS)]}
            for term in terms]
    return spec


def image_name(reference: str) -> str:
    """An image reference without its tag or digest (``registry:5000/shardline:0.1.0`` -> ``registry:5000/shardline``),
    the name kustomize's ``images:`` matches."""
    name = reference.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]


def with_images(cluster: dict[str, Any], images: Mapping[str, str]) -> dict[str, Any]:
    """``cluster`` with each container whose image is named as a key of ``images`` running that value instead (as
    kustomize's ``images:`` would, had the template been an object and not data)."""
    for role in ("scheduler", "worker"):
        pod = cluster.get("spec", {}).get(role, {}).get("spec", {})
        for container in [*pod.get("containers", []), *pod.get("initContainers", [])]:
            wanted = images.get(image_name(str(container.get("image", ""))))
            if wanted:
                container["image"] = wanted
    return cluster


def job_cluster_resources(
    template: dict[str, Any], job_id: str, workers: int, max_workers: int, capacity_type: str | None = None,
    images: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The job's DaskCluster (a copy of ``template`` named for the job) and its DaskAutoscaler (None: fixed size).

    ``images`` maps an image name the template uses (``shardline``, ``shardline-gpu``) to the reference its
    containers run instead (``SHARDLINE_DASK_KUBERNETES_IMAGE``, ``_GPU_IMAGE``).

    The scheduler service's selector is rewritten to the new name (it selects the scheduler pod by cluster name),
    the default worker group starts at ``workers``, and the bounds are written as annotations (``max_workers`` 0:
    fixed at ``workers``; ``DaskSettings`` has checked that ``max_workers`` is not below ``workers``). With a
    ``capacity_type``, the workers run only on nodes of that type (:func:`on_capacity`), said in an annotation.

    Raises:
        InvalidSetting: the template is not a DaskCluster.
    """
    if (template.get("apiVersion"), template.get("kind")) != (API_VERSION, "DaskCluster"):
        raise InvalidSetting(
            f"SHARDLINE_DASK_KUBERNETES_SPEC is a {template.get('kind')!r} of {template.get('apiVersion')!r}, not a "
            f"DaskCluster of {API_VERSION}; point it at a DaskCluster template (docs/kubernetes.md, 'Dask')"
        )
    name = job_cluster_name(job_id)
    cluster = with_images(copy.deepcopy(template), images or {})
    meta = cluster.setdefault("metadata", {})
    meta.update(name=name)
    meta.pop("namespace", None)
    meta["labels"] = {**meta.get("labels", {}), JOB_LABEL: name}
    meta["annotations"] = {**meta.get("annotations", {}), JOB_ANNOTATION: job_id, MIN_ANNOTATION: str(workers),
                           MAX_ANNOTATION: str(max_workers or workers)}
    spec = cluster.setdefault("spec", {})
    spec.setdefault("worker", {})["replicas"] = workers
    if capacity_type is not None:
        spec["worker"]["spec"] = on_capacity(spec["worker"].get("spec", {}), capacity_type)
        meta["annotations"][CAPACITY_ANNOTATION] = capacity_type
    selector = spec.get("scheduler", {}).get("service", {}).get("selector", {})
    if "dask.org/cluster-name" in selector:
        selector["dask.org/cluster-name"] = name
    if not max_workers:
        return cluster, None
    autoscaler = {
        "apiVersion": API_VERSION, "kind": "DaskAutoscaler",
        "metadata": {"name": name, "labels": {**meta["labels"], "dask.org/cluster-name": name}},
        "spec": {"cluster": name, "minimum": workers, "maximum": max_workers},
    }
    return cluster, autoscaler


def scheduler_port(cluster: dict[str, Any]) -> int:
    """The scheduler service's comm port (``tcp-comm``) in a DaskCluster; 8786, Dask's, when it names none."""
    ports = cluster.get("spec", {}).get("scheduler", {}).get("service", {}).get("ports", [])
    return next((int(p["port"]) for p in ports if p.get("name") == "tcp-comm"), 8786)


@dataclass(frozen=True)
class ScalePlan:
    """What a scaler does to a job's cluster: the worker group's replicas, the autoscaler's minimum, and why."""

    replicas: int
    minimum: int | None  # None: the autoscaler's minimum is left as it is
    reason: str


def plan_scale(current: int, step: int, floor: int, maximum: int, busy: int | None) -> ScalePlan:
    """Where a job's cluster of ``current`` workers goes when asked for ``step`` more (or fewer, when negative).

    Never above ``maximum`` nor below ``floor`` (the job's bounds); never down while ``busy`` workers run tasks
    (None: not known, which counts as busy). The autoscaler's minimum follows the replicas (never under the floor),
    so the autoscaler keeps what was added and may again remove what was given back.
    """
    wanted = current + step
    if step > 0:
        replicas = min(wanted, maximum)
        if replicas <= current:
            return ScalePlan(current, None, f"already at its maximum of {maximum} workers")
        capped = f" (capped at its maximum of {maximum})" if replicas < wanted else ""
        return ScalePlan(replicas, replicas, f"from {current} to {replicas} workers{capped}")
    if step < 0:
        if busy is None or busy > 0:
            held = "the scheduler could not say which are busy" if busy is None else f"{busy} workers are busy"
            return ScalePlan(current, None, f"not scaled down: {held}")
        replicas = max(wanted, floor)
        if replicas >= current:
            return ScalePlan(current, None, f"already at its minimum of {floor} workers")
        held = f" (held at its minimum of {floor})" if replicas > wanted else ""
        return ScalePlan(replicas, replicas, f"from {current} to {replicas} workers{held}")
    return ScalePlan(current, None, "nothing asked")


def busy_workers(scheduler_address: str, timeout_s: float = 10.0) -> int:
    """How many of a scheduler's workers are running or holding tasks to run now (``Client.processing``)."""
    from distributed import Client

    with Client(scheduler_address, timeout=timeout_s, set_as_default=False) as client:
        return sum(1 for keys in client.processing().values() if keys)


def _kinds() -> Any:
    """kr8s classes (synchronous) for dask-kubernetes' resources, as its own ``_objects`` declares them."""
    try:
        from kr8s.objects import new_class
    except ImportError as e:
        raise RuntimeUnavailable(
            "SHARDLINE_DASK_CLUSTER=kubernetes needs dask-kubernetes (and kr8s); pip install 'shardline[kubernetes]'"
        ) from e
    cluster = new_class("DaskCluster", API_VERSION, scalable=True, scalable_spec="worker.replicas")
    group = new_class("DaskWorkerGroup", API_VERSION, scalable=True, scalable_spec="worker.replicas")
    autoscaler = new_class("DaskAutoscaler", API_VERSION)
    return cluster, group, autoscaler


def _namespace(settings: DaskSettings) -> str:
    import kr8s

    return settings.kubernetes_namespace or kr8s.api().namespace


@contextlib.contextmanager
def job_cluster(settings: DaskSettings, job_id: str, template: dict[str, Any],
                capacity_type: str | None = None) -> Iterator[str]:
    """Create the job's DaskCluster (and DaskAutoscaler), its workers on ``capacity_type`` nodes when given (None:
    as the template places them), wait until the operator says it runs, yield the scheduler's in-cluster address,
    and delete both when the block ends (however it ends).

    Raises:
        InvalidSetting: the template or the bounds are wrong.
        RuntimeUnavailable: the operator did not report the cluster running within the timeout.
    """
    cluster_kind, _, autoscaler_kind = _kinds()
    images = {name: image for name, image in (("shardline", settings.kubernetes_image),
                                              ("shardline-gpu", settings.kubernetes_gpu_image)) if image}
    body, scaler_body = job_cluster_resources(template, job_id, settings.kubernetes_workers,
                                              settings.kubernetes_max_workers, capacity_type, images)
    namespace = _namespace(settings)
    name = body["metadata"]["name"]
    cluster = _create_or_adopt(cluster_kind, body, namespace)
    try:
        if scaler_body is not None:
            _create_or_adopt(autoscaler_kind, scaler_body, namespace)
        _wait_running(cluster, settings.kubernetes_ready_timeout_s)
        yield f"tcp://{name}-scheduler.{namespace}:{scheduler_port(body)}"
    finally:
        with contextlib.suppress(Exception):  # adopted by the cluster once the operator saw it; not always yet
            autoscaler_kind.get(name, namespace=namespace).delete()
        cluster.delete()


def _create_or_adopt(kind: Any, body: dict[str, Any], namespace: str) -> Any:
    """Create the object; if it exists (an earlier run of the same job died before deleting it: its name is the
    job's), use that one, as it stands: the job resumes on its own cluster."""
    import kr8s

    obj = kind(body, namespace=namespace)
    try:
        obj.create()
    except kr8s.ServerError as e:
        if e.response is None or e.response.status_code != 409:
            raise
        return kind.get(body["metadata"]["name"], namespace=namespace)
    return obj


def _wait_running(cluster: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        cluster.refresh()
        phase = cluster.raw.get("status", {}).get("phase")
        if phase == "Running":
            return
        if time.monotonic() > deadline:
            raise RuntimeUnavailable(
                f"DaskCluster {cluster.namespace}/{cluster.name} was not Running after {timeout_s:.0f} s (phase "
                f"{phase!r}); is the dask-kubernetes operator installed and watching this namespace? "
                "(SHARDLINE_DASK_KUBERNETES_READY_TIMEOUT_S sets the wait)"
            )
        time.sleep(0.25)


def scale_job_cluster(settings: DaskSettings, job_id: str, step: int, scheduler_address: str | None = None) -> str:
    """Scale a job's cluster by ``step`` workers within its bounds (see :func:`plan_scale`); say what was done.

    ``scheduler_address`` is asked which workers are busy before a scale-down; None: the cluster's scheduler
    service, as the flow reached it.
    """
    import kr8s

    cluster_kind, group_kind, autoscaler_kind = _kinds()
    namespace = _namespace(settings)
    name = job_cluster_name(job_id)
    try:
        cluster = cluster_kind.get(name, namespace=namespace)
        group = group_kind.get(f"{name}-default", namespace=namespace)
    except kr8s.NotFoundError:
        return f"job {job_id}'s Dask cluster {namespace}/{name} (or its default worker group) does not exist; nothing scaled"
    annotations = cluster.raw["metadata"].get("annotations", {})
    floor = int(annotations.get(MIN_ANNOTATION, settings.kubernetes_workers))
    maximum = int(annotations.get(MAX_ANNOTATION, settings.kubernetes_max_workers or floor))
    current = int(group.raw["spec"]["worker"].get("replicas", 0))
    busy = None
    if step < 0:
        address = scheduler_address or f"tcp://{name}-scheduler.{namespace}:{scheduler_port(cluster.raw)}"
        with contextlib.suppress(OSError, TimeoutError):
            busy = busy_workers(address)
    plan = plan_scale(current, step, floor, maximum, busy)
    autoscaler = None
    with contextlib.suppress(kr8s.NotFoundError):
        autoscaler = autoscaler_kind.get(name, namespace=namespace)
    # the minimum first on the way up (the autoscaler cannot take the new workers back), last on the way down
    if autoscaler is not None and plan.minimum is not None and plan.minimum > int(autoscaler.raw["spec"]["minimum"]):
        autoscaler.patch({"spec": {"minimum": plan.minimum}})
    if plan.replicas != current:
        group.scale(plan.replicas)
    if autoscaler is not None and plan.minimum is not None and plan.minimum < int(autoscaler.raw["spec"]["minimum"]):
        autoscaler.patch({"spec": {"minimum": plan.minimum}})
    return f"job {job_id}'s Dask cluster {namespace}/{name}: {plan.reason}"
