"""The Kubernetes objects one ShardlineModel owns, built from its checked spec (pure).

- a **Deployment** of `shardline serve` replicas for its hardware class: CPU and memory, a whole GPU
  (``nvidia.com/gpu``) or a MIG slice (``nvidia.com/mig-<profile>``, the GPU operator's mixed strategy)
  with the GPU taint tolerated; readiness and liveness on the health endpoints; a preStop wait so
  routers see a replica leave before it stops;
- a headless **Service**: the routers' DNS group for these replicas (``router.yaml``'s ``dns``);
- a KEDA **ScaledObject** on the routers' demand for the model (in flight plus held, Prometheus
  trigger, scale to zero), or an **HPA** on the same figure as an external metric;
- a **PodDisruptionBudget** by SLO class;
- a **NetworkPolicy**: only the routers reach the replicas, on their serving port.
"""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict

from shardline.controller.resource import API_VERSION, KIND, ShardlineModel, memory_bytes
from shardline.settings import ControllerSettings

Obj = dict[str, Any]

GPU_TAINT = "nvidia.com/gpu"
# Node labels of the NVIDIA GPU operator's feature discovery: a node with a GPU; MIG slices are only on such nodes.
GPU_NODE = {"nvidia.com/gpu.present": "true"}
MI = 2**20
TENANTS_DIR = "/etc/shardline/tenants"
# What the server process itself needs beside a model's own memory (the manifest's min_memory_mb).
SERVER_OVERHEAD_MB = 512


class SloPolicy(BaseModel):
    """What an SLO class sets: the demand per replica the autoscaler keeps, how long it waits before scaling
    down, and how many replicas a voluntary disruption (a node drain) may take at once."""

    model_config = ConfigDict(frozen=True)

    target_in_flight: int
    scale_down_s: int
    max_unavailable: int | str


SLO_CLASSES: dict[str, SloPolicy] = {
    # Latency first: scale out early, come down slowly, one replica out at a time.
    "interactive": SloPolicy(target_in_flight=2, scale_down_s=600, max_unavailable=1),
    "standard": SloPolicy(target_in_flight=4, scale_down_s=300, max_unavailable="25%"),
    # Cost first: replicas run fuller and are given back sooner.
    "throughput": SloPolicy(target_in_flight=8, scale_down_s=120, max_unavailable="50%"),
}


class Hardware(BaseModel):
    """A hardware class's replica: its default requests, the accelerator it claims, where it may land."""

    model_config = ConfigDict(frozen=True)

    cpu: str
    memory: str
    accelerator: str | None = None  # an extended resource: nvidia.com/gpu or nvidia.com/mig-1g.18gb

    @property
    def device(self) -> str:
        """The runtime's device (SHARDLINE_RUNTIME_DEVICE)."""
        return "cpu" if self.accelerator is None else "cuda"


def hardware(hardware_class: str) -> Hardware:
    """The replica of a hardware class (``cpu``, ``gpu``, ``mig-<profile>``; resource.py checked the name)."""
    if hardware_class == "cpu":
        return Hardware(cpu="2", memory="4Gi")
    if hardware_class == "gpu":
        return Hardware(cpu="4", memory="16Gi", accelerator="nvidia.com/gpu")
    return Hardware(cpu="2", memory="8Gi", accelerator=f"nvidia.com/{hardware_class}")


def labels(model: ShardlineModel) -> dict[str, str]:
    """The labels of every object the ShardlineModel owns and of its replica pods."""
    return {
        "app.kubernetes.io/name": "shardline-replica",
        "app.kubernetes.io/instance": model.name,
        "app.kubernetes.io/component": "replica",
        "app.kubernetes.io/part-of": "shardline",
        "app.kubernetes.io/managed-by": "shardline-operator",
        "shardline.dev/model": model.spec.reference.name,
        "shardline.dev/hardware-class": model.spec.hardware_class,
    }


def selector(model: ShardlineModel) -> dict[str, str]:
    """The replica pods' selector (a Deployment's selector cannot change: only what never does)."""
    return {"app.kubernetes.io/instance": model.name, "app.kubernetes.io/component": "replica"}


def _meta(model: ShardlineModel) -> Obj:
    meta: Obj = {"name": model.name, "namespace": model.namespace, "labels": labels(model)}
    if model.uid:
        meta["ownerReferences"] = [{"apiVersion": API_VERSION, "kind": KIND, "name": model.name, "uid": model.uid,
                                    "controller": True, "blockOwnerDeletion": True}]
    return meta


def memory_request(model: ShardlineModel, min_memory_mb: int | None) -> str:
    """The replica's memory: the spec's (else the class's default), raised to what the version declares it needs
    (its manifest's ``hardware.min_memory_mb``) plus the server's own."""
    chosen = model.spec.resources.memory or hardware(model.spec.hardware_class).memory
    if min_memory_mb is not None and memory_bytes(chosen) < (min_memory_mb + SERVER_OVERHEAD_MB) * MI:
        return f"{min_memory_mb + SERVER_OVERHEAD_MB}Mi"
    return chosen


def deployment(model: ShardlineModel, settings: ControllerSettings, replicas: int, memory: str) -> Obj:
    """The replicas' Deployment."""
    kit = hardware(model.spec.hardware_class)
    requests: Obj = {"cpu": model.spec.resources.cpu or kit.cpu, "memory": memory}
    limits: Obj = {"memory": memory}
    pod: Obj = {
        "priorityClassName": settings.priority_class,
        "terminationGracePeriodSeconds": settings.drain_s + 30,
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [_container(model, settings, kit, requests, limits)],
    }
    if settings.tenants_config:
        pod["volumes"] = [{"name": "tenants", "configMap": {"name": settings.tenants_config}}]
    if kit.accelerator is not None:
        requests[kit.accelerator] = 1
        limits[kit.accelerator] = 1
        pod["tolerations"] = [{"key": GPU_TAINT, "operator": "Exists", "effect": "NoSchedule"}]
        pod["nodeSelector"] = dict(GPU_NODE)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(model),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(model)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {"metadata": {"labels": labels(model)}, "spec": pod},
        },
    }


def _container(model: ShardlineModel, settings: ControllerSettings, kit: Hardware, requests: Obj, limits: Obj) -> Obj:
    env: list[Obj] = [
        {"name": "SHARDLINE_ONLINE_HOST", "value": "0.0.0.0"},
        {"name": "SHARDLINE_ONLINE_PORT", "value": str(settings.port)},
        {"name": "SHARDLINE_ONLINE_METRICS_HOST", "value": "0.0.0.0"},
        {"name": "SHARDLINE_ONLINE_METRICS_PORT", "value": str(settings.metrics_port)},
        {"name": "SHARDLINE_RUNTIME_DEVICE", "value": kit.device},
        {"name": "DO_NOT_TRACK", "value": "1"},
        {"name": "ORT_DISABLE_TELEMETRY", "value": "1"},
    ]
    if settings.router_key_secret:
        env.append({"name": "SHARDLINE_TENANCY_ROUTER_KEY_SHA256",
                    "valueFrom": {"secretKeyRef": {"name": settings.router_key_secret, "key": "sha256"}}})
    if settings.tenants_config:
        env.append({"name": "SHARDLINE_TENANTS_FILE", "value": f"{TENANTS_DIR}/tenants.yaml"})
    env_from: list[Obj] = []
    if settings.replica_config:
        env_from.append({"configMapRef": {"name": settings.replica_config}})
    if settings.replica_secret:
        env_from.append({"secretRef": {"name": settings.replica_secret, "optional": True}})
    container: Obj = {
        "name": "replica",
        "image": settings.gpu_image if kit.accelerator else settings.image,
        "args": ["shardline", "serve"],
        "env": env,
        "ports": [{"name": "http", "containerPort": settings.port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": settings.metrics_port, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"}, "periodSeconds": 10,
                          "failureThreshold": 6},
        "lifecycle": {"preStop": {"sleep": {"seconds": settings.drain_s}}},
        "resources": {"requests": requests, "limits": limits},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    if env_from:
        container["envFrom"] = env_from
    if settings.tenants_config:
        container["volumeMounts"] = [{"name": "tenants", "mountPath": TENANTS_DIR, "readOnly": True}]
    return container


def service(model: ShardlineModel, settings: ControllerSettings) -> Obj:
    """A headless Service: each ready replica's address is one DNS answer, a router group's ``dns`` name."""
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(model),
        "spec": {"clusterIP": "None", "selector": selector(model),
                 "ports": [{"name": "http", "port": settings.port, "targetPort": "http", "protocol": "TCP"}]},
    }


def demand_query(model_name: str) -> str:
    """PromQL: the routers' requests for any version of the model, answered now or held for a replica."""
    return (f'sum({{__name__=~"shardline_router_in_flight|shardline_router_queued",'
            f'model=~"{model_name}:[0-9]+"}}) or vector(0)')


def scaled_object(model: ShardlineModel, settings: ControllerSettings) -> Obj:
    """KEDA's ScaledObject: replicas for the routers' demand at the SLO class's target per replica."""
    slo = SLO_CLASSES[model.spec.slo_class]
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": _meta(model),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": model.name},
            "minReplicaCount": model.spec.min_replicas,
            "maxReplicaCount": model.spec.max_replicas,
            "pollingInterval": 15,
            "cooldownPeriod": slo.scale_down_s,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(slo)}},
            "triggers": [{
                "type": "prometheus",
                "metadata": {"serverAddress": settings.prometheus_url, "query": demand_query(model.spec.reference.name),
                             "threshold": str(slo.target_in_flight), "activationThreshold": "0"},
            }],
        },
    }


def _behavior(slo: SloPolicy) -> Obj:
    return {"scaleDown": {"stabilizationWindowSeconds": slo.scale_down_s},
            "scaleUp": {"stabilizationWindowSeconds": 0}}


def horizontal_autoscaler(model: ShardlineModel, settings: ControllerSettings) -> Obj:
    """An HPA for clusters without KEDA, on the routers' ``shardline_router_replicas_wanted`` for this model's group
    as an external metric (a Prometheus adapter serves it; a label selector cannot hold a ``name:version``, the
    group's name it can). The figure is the router's, at its ``SHARDLINE_ROUTER_TARGET_IN_FLIGHT`` per replica, so
    the SLO class sets only the scale-down window here; an HPA cannot scale to zero (minReplicas at least 1)."""
    slo = SLO_CLASSES[model.spec.slo_class]
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": _meta(model),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": model.name},
            "minReplicas": max(1, model.spec.min_replicas),
            "maxReplicas": model.spec.max_replicas,
            "behavior": _behavior(slo),
            "metrics": [{"type": "External", "external": {
                "metric": {"name": "shardline_router_replicas_wanted",
                           "selector": {"matchLabels": {"group": router_group(model, settings)["name"]}}},
                "target": {"type": "AverageValue", "averageValue": "1"},
            }}],
        },
    }


def disruption_budget(model: ShardlineModel) -> Obj:
    """How many replicas a node drain may take at once (by SLO class)."""
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(model),
        "spec": {"maxUnavailable": SLO_CLASSES[model.spec.slo_class].max_unavailable,
                 "selector": {"matchLabels": selector(model)}},
    }


def network_policy(model: ShardlineModel, settings: ControllerSettings) -> Obj:
    """Only the routers reach the replicas, and only on the serving port."""
    peer: Obj = {"podSelector": {"matchLabels": dict(settings.router_labels)}}
    if settings.router_namespace and settings.router_namespace != model.namespace:
        peer["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": settings.router_namespace}}
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(model),
        "spec": {"podSelector": {"matchLabels": selector(model)}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [peer], "ports": [{"protocol": "TCP", "port": settings.port}]}]},
    }


def router_group(model: ShardlineModel, settings: ControllerSettings) -> Mapping[str, Any]:
    """The ``router.yaml`` group that reaches these replicas (status.routerGroup)."""
    return {"name": f"{model.namespace}-{model.name}"[:63].rstrip("-._"),
            "dns": {"name": f"{model.name}.{model.namespace}.svc.cluster.local", "port": settings.port}}
