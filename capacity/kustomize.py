"""A packing plan as a kustomize Component: replica counts and resources for the overlay's replica groups.

deploy/k8s runs one Deployment per replica group (``shardline-replicas-<group>``), each on one hardware class
(docs/kubernetes.md). ``component_files(plan, hardware, groups)`` writes, for every group the mapping names, a
strategic-merge patch of its Deployment: ``spec.replicas`` (the plan's replicas of that class; 0, and nothing
else changed, where the plan uses none), the ``serve`` container's resources replaced whole (the GPU resource:
``nvidia.com/gpu`` or ``nvidia.com/mig-<profile>``, one per replica; CPU and memory the plan assumed) and the node
selector of the GPU kind. An overlay takes it with ``components: [path/to/dir]``. Pure: file name -> text.
"""

from __future__ import annotations

import math
from typing import Any

import yaml

from shardline.capacity.hardware import WHOLE, CpuNodeType, GpuKind, Hardware
from shardline.capacity.packing import PackingPlan
from shardline.capacity.problem import hardware_classes
from shardline.errors import InvalidSetting

NAMESPACE = "shardline"
_MIN_MEMORY_GI = 4


def deployment_name(group: str) -> str:
    """The Deployment of a replica group (deploy/k8s): ``shardline-replicas-<group>``."""
    return f"shardline-replicas-{group}"


def _resources(kind: GpuKind | CpuNodeType, slot: str, cores: float, memory_gb: float) -> dict[str, Any]:
    memory = f"{max(_MIN_MEMORY_GI, math.ceil(memory_gb))}Gi"
    requests: dict[str, Any] = {"cpu": f"{cores:g}", "memory": memory}
    limits: dict[str, Any] = {"memory": memory}
    if isinstance(kind, GpuKind):
        device = "nvidia.com/gpu" if slot == WHOLE else f"nvidia.com/mig-{slot}"
        requests[device] = limits[device] = 1  # extended resources: the request is the limit
    return {"$patch": "replace", "requests": requests, "limits": limits}


def _node_selector(kind: GpuKind | CpuNodeType, slot: str) -> dict[str, str] | None:
    if isinstance(kind, CpuNodeType):
        return None
    selector = {"nvidia.com/gpu.product": kind.product}
    if slot != WHOLE:
        selector["nvidia.com/mig.strategy"] = "mixed"
    return {"$patch": "replace", **selector}


def group_patches(plan: PackingPlan, hardware: Hardware, groups: dict[str, str]) -> list[dict[str, Any]]:
    """One Deployment patch per replica group the mapping names (sorted by group).

    Raises:
        InvalidSetting: the plan uses a hardware class no group runs, or two classes map to one group.
    """
    classes = hardware_classes(hardware)
    used = sorted({g.hardware_class for g in plan.groups})
    missing = [c for c in used if c not in groups]
    if missing:
        raise InvalidSetting(
            f"the plan uses hardware classes with no replica group: {missing}; map each to a group of the overlay "
            "in the demand file's 'groups' (e.g. groups: {" + f"{missing[0]}: my-group" + "})"
        )
    by_group: dict[str, list[str]] = {}
    for hardware_class, group in groups.items():
        if hardware_class in classes:
            by_group.setdefault(group, []).append(hardware_class)
    shared = {g: c for g, c in by_group.items() if len([x for x in c if x in used]) > 1}
    if shared:
        raise InvalidSetting(
            f"replica groups {sorted(shared)} would each run more than one hardware class of the plan ({shared}); "
            "a group runs one class: map each class to its own group"
        )
    patches = []
    for group, members in sorted(by_group.items()):
        chosen = next((c for c in members if c in used), None)
        if chosen is None:  # a group the plan does not use: none of its replicas, its resources as they are
            patches.append({"apiVersion": "apps/v1", "kind": "Deployment",
                            "metadata": {"name": deployment_name(group), "namespace": NAMESPACE},
                            "spec": {"replicas": 0}})
            continue
        kind, slot = classes[chosen]
        mine = [g for g in plan.groups if g.hardware_class == chosen]
        cores = max(g.offer.cores for g in mine)
        memory = max(g.offer.memory_gb for g in mine)
        spec: dict[str, Any] = {"containers": [{"name": "serve", "resources": _resources(kind, slot, cores, memory)}]}
        selector = _node_selector(kind, slot)
        if selector:
            spec["nodeSelector"] = selector
        patches.append({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": deployment_name(group), "namespace": NAMESPACE,
                         "annotations": {"shardline.dev/hardware-class": chosen}},
            "spec": {"replicas": sum(g.replicas for g in mine), "template": {"spec": spec}},
        })
    return patches


def component_files(plan: PackingPlan, hardware: Hardware, groups: dict[str, str]) -> dict[str, str]:
    """The Component's files: ``kustomization.yaml`` and ``replicas.yaml`` (the patches), as text.

    Raises:
        InvalidSetting: as ``group_patches``.
    """
    patches = group_patches(plan, hardware, groups)
    header = (f"# Written by `shardline plan capacity`: {plan.cost_per_hour:.2f}/h, {plan.gpu_count} GPUs "
              f"(lower bound {plan.lower_bound:.2f}/h; one model per GPU {plan.baseline.cost_per_hour:.2f}/h).\n"
              "# Replica counts are the plan's at its demand; where KEDA or an HPA owns a group's count, keep its\n"
              "# maxReplicaCount at least this.\n")
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1alpha1", "kind": "Component",
                     "patches": [{"path": "replicas.yaml"}]}
    return {
        "kustomization.yaml": header + yaml.safe_dump(kustomization, sort_keys=False),
        "replicas.yaml": header + yaml.safe_dump_all(patches, sort_keys=False),
    }
