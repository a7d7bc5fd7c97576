"""A packing plan as a kustomize Component: replica counts and resources for the overlay's replica groups.

deploy/k8s runs one Deployment per replica group (``shardline-replicas-<group>``), each on one hardware class
(docs/kubernetes.md). ``component_files(plan, hardware, groups)`` writes, for every group the plan uses, a
strategic-merge patch of its Deployment: ``spec.replicas`` (the plan's replicas of that class), the ``serve``
container's resources and the node selector of the GPU kind. An overlay takes it with ``components:
[path/to/dir]``. Pure: file name -> text.

- A GPU group's resources get its device (``nvidia.com/gpu`` or ``nvidia.com/mig-<profile>``, one per replica)
  and lose any other device; its host CPU and memory stay the overlay's: the plan's ``memory_gb`` on a GPU is
  device memory (docs/cost.md), which says nothing of the host memory the server takes beside it.
- A CPU group's resources are replaced whole by the cores and memory the plan assumed.
- A group the plan does not use is left as the overlay has it, not set to 0 replicas: an HPA does not scale a
  Deployment at 0 (and ``cpu``, the routers' last resort, never goes below 1); KEDA takes an idle group to zero
  by itself.
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


def _device(slot: str) -> str:
    return "nvidia.com/gpu" if slot == WHOLE else f"nvidia.com/mig-{slot}"


def _resources(kind: GpuKind | CpuNodeType, slot: str, cores: float, memory_gb: float,
               hardware: Hardware) -> dict[str, Any]:
    if isinstance(kind, GpuKind):
        # the device only (extended resources: the request is the limit); any other device the overlay's group
        # asked for removed (null); host CPU and memory as the overlay has them
        others = sorted({_device(s) for k in hardware.gpus for s in k.slots} - {_device(slot)})
        devices: dict[str, Any] = {**{d: None for d in others}, _device(slot): 1}
        return {"requests": dict(devices), "limits": dict(devices)}
    memory = f"{max(_MIN_MEMORY_GI, math.ceil(memory_gb))}Gi"
    return {"$patch": "replace", "requests": {"cpu": f"{cores:g}", "memory": memory}, "limits": {"memory": memory}}


def _node_selector(kind: GpuKind | CpuNodeType, slot: str) -> dict[str, str] | None:
    if isinstance(kind, CpuNodeType):
        return None
    selector = {"nvidia.com/gpu.product": kind.product}
    if slot != WHOLE:
        selector["nvidia.com/mig.strategy"] = "mixed"
    return {"$patch": "replace", **selector}


def group_patches(plan: PackingPlan, hardware: Hardware, groups: dict[str, str]) -> list[dict[str, Any]]:
    """One Deployment patch per replica group the mapping names and the plan uses (sorted by group).

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
        if chosen is None:  # a group the plan does not use: as the overlay has it (never 0: see the docstring)
            continue
        kind, slot = classes[chosen]
        mine = [g for g in plan.groups if g.hardware_class == chosen]
        cores = max(g.offer.cores for g in mine)
        memory = max(g.offer.memory_gb for g in mine)
        resources = _resources(kind, slot, cores, memory, hardware)
        spec: dict[str, Any] = {"containers": [{"name": "serve", "resources": resources}]}
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
              "# maxReplicaCount at least this. Groups the plan does not use keep the overlay's count.\n")
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1alpha1", "kind": "Component",
                     "patches": [{"path": "replicas.yaml"}]}
    return {
        "kustomization.yaml": header + yaml.safe_dump(kustomization, sort_keys=False),
        "replicas.yaml": header + yaml.safe_dump_all(patches, sort_keys=False),
    }
