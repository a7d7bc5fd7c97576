"""The Kubernetes operator (`python -m shardline.controller`): what it gives the objects a ShardlineModel owns."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ControllerSettings(BaseSettings):
    """What the operator puts in the objects it makes for every ShardlineModel (docs/kubernetes.md, "The operator")."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_CONTROLLER_", extra="ignore")

    image: str = Field(default="shardline:0.1.0", description="The replicas' image (`shardline serve`); the GPU "
                       "classes' replicas use gpu_image.")
    gpu_image: str = Field(default="shardline-gpu:0.1.0", description="The image of replicas on a GPU or a MIG "
                           "slice (onnxruntime-gpu).")
    autoscaler: Literal["auto", "keda", "hpa"] = Field(
        default="auto", description="What scales a model's replicas: a KEDA ScaledObject (scales to zero), an HPA "
        "on an external metric (a Prometheus adapter serves it), or auto: KEDA when the cluster serves its "
        "ScaledObject resource, else the HPA.",
    )
    prometheus_url: str = Field(
        default="http://prometheus-operated.monitoring.svc.cluster.local:9090",
        description="The Prometheus that scrapes the routers' /metrics: KEDA's trigger queries it.",
    )
    router_labels: dict[str, str] = Field(
        default_factory=lambda: {"app.kubernetes.io/name": "shardline-router"},
        description="Labels of the router pods (JSON): the only pods a replica's NetworkPolicy lets in.",
    )
    router_namespace: str | None = Field(
        default=None, description="The namespace the routers run in; unset: the ShardlineModel's own namespace.",
    )
    priority_class: str = Field(default="shardline-online", description="PriorityClass of the replica pods.")
    replica_config: str | None = Field(
        default="shardline-storage", description="A ConfigMap every replica reads its SHARDLINE_* settings from "
        "(envFrom: the registry's URL or home); empty: none. The manifests' base makes it in namespace shardline.",
    )
    replica_secret: str | None = Field(
        default="shardline-storage-credentials", description="A Secret every replica reads too if it exists "
        "(envFrom, optional: the registry's storage credentials); empty: none.",
    )
    router_key_secret: str | None = Field(
        default="shardline-router-key", description="The Secret whose `sha256` key is the routers' credential's "
        "digest (SHARDLINE_TENANCY_ROUTER_KEY_SHA256): replicas take requests from routers only; empty: none.",
    )
    tenants_config: str | None = Field(
        default="shardline-tenants", description="The ConfigMap holding tenants.yaml (mounted, "
        "SHARDLINE_TENANTS_FILE); empty: none.",
    )
    port: int = Field(default=8000, ge=1, le=65_535, description="The port the replicas serve on.")
    metrics_port: int = Field(default=8002, ge=1, le=65_535, description="The replicas' /metrics port.")
    drain_s: int = Field(
        default=10, ge=0, le=300, description="A replica's preStop wait: the time for routers to see it leave "
        "before it is sent SIGTERM (it then finishes what it answers).",
    )
    resync_s: float = Field(
        default=30.0, gt=0, description="How often each ShardlineModel is reconciled again (the registry's alias "
        "and rollout, the replicas' readiness) besides on every change of its spec.",
    )
