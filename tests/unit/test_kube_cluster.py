"""A job's Dask cluster on Kubernetes, the pure parts: its name, the resources made from a template, the scale plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from dask_kubernetes.operator.validation import validate_cluster_name
from pydantic import ValidationError

from shardline.errors import InvalidInput, InvalidSetting
from shardline.settings import DaskSettings
from shardline.settings import MeteringSettings
from shardline.tasks.fairness import cluster_capacity, job_capacity
from shardline.tasks.kube_cluster import SPOT_NODE_LABELS, job_cluster_name, job_cluster_resources, plan_scale

TEMPLATES = Path(__file__).resolve().parents[2] / "deploy/k8s/base/tenant/dask"


@pytest.mark.parametrize("job_id", ["0123456789abcdef", "Nightly_2026-12-05", "x" * 80, "-a-", "ÜBER job"])
def test_a_job_cluster_name_is_a_valid_kubernetes_name_derived_from_the_job(job_id: str) -> None:
    name = job_cluster_name(job_id)
    validate_cluster_name(name)  # dask-kubernetes' own rule: RFC 1123, room for "-scheduler" within 63
    assert name.startswith("shardline-") and len(name + "-default") <= 63
    assert job_cluster_name(job_id) == name  # the SLA response derives the same name from the same id


def test_batch_job_ids_keep_their_digits_and_other_ids_never_collide() -> None:
    assert job_cluster_name("0123456789abcdef") == "shardline-0123456789abcdef"
    assert job_cluster_name("Nightly") != job_cluster_name("nightly")
    assert job_cluster_name("a" * 30) != job_cluster_name("a" * 31)
    with pytest.raises(InvalidInput, match="job id is empty"):
        job_cluster_name(" ")


def test_the_job_cluster_is_the_template_renamed_with_its_bounds_and_an_autoscaler() -> None:
    template = yaml.safe_load((TEMPLATES / "cluster-gpu.yaml").read_text())
    cluster, autoscaler = job_cluster_resources(template, "0123456789abcdef", 2, 12)
    name = "shardline-0123456789abcdef"
    assert cluster["metadata"]["name"] == name
    assert cluster["spec"]["scheduler"]["service"]["selector"]["dask.org/cluster-name"] == name
    assert cluster["spec"]["worker"]["replicas"] == 2
    assert cluster["spec"]["worker"]["spec"] == template["spec"]["worker"]["spec"]
    annotations = cluster["metadata"]["annotations"]
    assert (annotations["shardline.dev/min-workers"], annotations["shardline.dev/max-workers"]) == ("2", "12")
    assert autoscaler is not None and autoscaler["spec"] == {"cluster": name, "minimum": 2, "maximum": 12}
    assert template["metadata"]["name"] == "shardline-batch-gpu"  # the template itself is untouched
    fixed, none = job_cluster_resources(template, "0123456789abcdef", 3, 0)
    assert none is None and fixed["metadata"]["annotations"]["shardline.dev/max-workers"] == "3"


def _required(cluster: dict) -> list[list[dict]]:
    affinity = cluster["spec"]["worker"]["spec"]["affinity"]["nodeAffinity"]
    return [t["matchExpressions"] for t in affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]]


def test_a_spot_job_requires_spot_nodes_with_the_templates_own_requirements() -> None:
    """A tenant past its budget's soft limit: its workers only on nodes some cloud marks as spot (the template's
    workers merely prefer them), GPU nodes still required, the spot pools' taints tolerated; the scheduler stays
    off spot."""
    gpu = yaml.safe_load((TEMPLATES / "cluster-gpu.yaml").read_text())
    cluster, _ = job_cluster_resources(gpu, "0123456789abcdef", 2, 12, "spot")
    gpu_node = {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}
    terms = _required(cluster)
    assert len(terms) == len(SPOT_NODE_LABELS)  # ORed: a spot node of any cloud, each one a GPU node
    assert all(term[0] == gpu_node and term[1]["operator"] == "In" for term in terms)
    assert {(t[1]["key"], t[1]["values"][0]) for t in terms} == {(k, v) for k, v, _ in SPOT_NODE_LABELS}
    tolerations = cluster["spec"]["worker"]["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    assert {"key": "kubernetes.azure.com/scalesetpriority", "operator": "Equal", "value": "spot",
            "effect": "NoSchedule"} in tolerations
    assert cluster["metadata"]["annotations"]["shardline.dev/capacity-type"] == "spot"
    assert cluster["spec"]["scheduler"]["spec"] == gpu["spec"]["scheduler"]["spec"]
    assert gpu == yaml.safe_load((TEMPLATES / "cluster-gpu.yaml").read_text())  # the template itself is untouched

    cpu = yaml.safe_load((TEMPLATES / "cluster-cpu.yaml").read_text())
    spot, _ = job_cluster_resources(cpu, "j1", 2, 0, "spot")
    assert [len(term) for term in _required(spot)] == [1] * len(SPOT_NODE_LABELS)
    on_demand, _ = job_cluster_resources(cpu, "j1", 2, 0, "on-demand")
    [term] = _required(on_demand)
    assert {(e["key"], e["operator"], e["values"][0]) for e in term} == {(k, "NotIn", v) for k, v, _ in SPOT_NODE_LABELS}
    plain, _ = job_cluster_resources(cpu, "j1", 2, 0)
    assert plain["spec"]["worker"]["spec"] == cpu["spec"]["worker"]["spec"]  # asked for none: as the template says
    assert "shardline.dev/capacity-type" not in plain["metadata"]["annotations"]


def test_the_spot_marks_are_the_ones_the_templates_keep_the_scheduler_off() -> None:
    """One list of how clouds mark spot nodes: the code's and the templates' (their scheduler's NotIn terms and the
    workers' tolerations) agree."""
    for name in ("cluster-cpu.yaml", "cluster-gpu.yaml"):
        template = yaml.safe_load((TEMPLATES / name).read_text())
        required = template["spec"]["scheduler"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert {(e["key"], e["values"][0]) for t in required for e in t["matchExpressions"]} == \
            {(k, v) for k, v, _ in SPOT_NODE_LABELS}, name
        tolerated = {(t["key"], t.get("value")) for t in template["spec"]["worker"]["spec"]["tolerations"]}
        assert {(k, v) for k, v, tainted in SPOT_NODE_LABELS if tainted} <= tolerated, name


def test_a_job_runs_on_spot_where_its_own_cluster_can_be_put_there() -> None:
    on_demand, spot = MeteringSettings(capacity_type="on-demand"), MeteringSettings(capacity_type="spot")
    kube, local = DaskSettings(cluster="kubernetes"), DaskSettings(cluster="local")
    assert job_capacity("spot", kube, on_demand) == "spot"
    assert job_capacity("on-demand", kube, spot) == "on-demand"
    assert job_capacity(None, kube, on_demand) == "on-demand"  # the template's preference: metered as configured
    assert job_capacity("spot", local, on_demand) == "on-demand"  # a local cluster cannot move
    assert job_capacity("spot", local, spot) == "spot"  # it runs on spot already
    assert job_capacity("spot", DaskSettings(cluster="address", address="tcp://x:8786"), on_demand) == "on-demand"
    no_spot = DaskSettings(cluster="kubernetes", kubernetes_spot=False)  # a cluster with no spot node pool
    assert job_capacity("spot", no_spot, on_demand) == "on-demand" and cluster_capacity("spot", no_spot) is None
    assert cluster_capacity("on-demand", no_spot) == "on-demand"
    assert cluster_capacity("spot", kube) == "spot" and cluster_capacity(None, kube) is None
    assert cluster_capacity("spot", local) is None


def test_a_template_that_is_not_a_dask_cluster_is_refused() -> None:
    with pytest.raises(InvalidSetting, match="not a DaskCluster"):
        job_cluster_resources({"apiVersion": "v1", "kind": "Pod"}, "j", 1, 2)


def test_bounds_are_checked_when_the_settings_load() -> None:
    with pytest.raises(ValidationError, match="MAX_WORKERS \\(2\\) is below"):
        DaskSettings(kubernetes_workers=4, kubernetes_max_workers=2)
    assert DaskSettings(kubernetes_workers=4, kubernetes_max_workers=0).kubernetes_max_workers == 0


def test_scaling_up_raises_the_autoscaler_minimum_and_stops_at_the_maximum() -> None:
    up = plan_scale(current=2, step=3, floor=2, maximum=10, busy=None)
    assert (up.replicas, up.minimum) == (5, 5)
    capped = plan_scale(current=9, step=3, floor=2, maximum=10, busy=None)
    assert (capped.replicas, capped.minimum) == (10, 10) and "capped" in capped.reason
    full = plan_scale(current=10, step=2, floor=2, maximum=10, busy=None)
    assert (full.replicas, full.minimum) == (10, None) and "maximum" in full.reason


def test_scaling_down_never_while_busy_and_never_below_the_minimum() -> None:
    busy = plan_scale(current=6, step=-2, floor=2, maximum=10, busy=1)
    assert (busy.replicas, busy.minimum) == (6, None) and "1 workers are busy" in busy.reason
    unknown = plan_scale(current=6, step=-2, floor=2, maximum=10, busy=None)
    assert unknown.replicas == 6 and "could not say" in unknown.reason
    idle = plan_scale(current=6, step=-2, floor=2, maximum=10, busy=0)
    assert (idle.replicas, idle.minimum) == (4, 4)
    floor = plan_scale(current=3, step=-5, floor=2, maximum=10, busy=0)
    assert (floor.replicas, floor.minimum) == (2, 2) and "minimum of 2" in floor.reason
    at_floor = plan_scale(current=2, step=-1, floor=2, maximum=10, busy=0)
    assert (at_floor.replicas, at_floor.minimum) == (2, None)


def test_the_settings_images_replace_the_templates_by_image_name() -> None:
    from shardline.tasks.kube_cluster import image_name

    assert [image_name(r) for r in ("shardline:0.1.0", "registry:5000/x/shardline-gpu:1@sha256:ab", "shardline")] == [
        "shardline", "registry:5000/x/shardline-gpu", "shardline"]
    template = yaml.safe_load((TEMPLATES / "cluster-gpu.yaml").read_text())
    cluster, _ = job_cluster_resources(template, "0123456789abcdef", 1, 0,
                                       images={"shardline": "reg/shardline:7", "shardline-gpu": "reg/shardline-gpu:7"})
    assert [c["image"] for c in cluster["spec"]["scheduler"]["spec"]["containers"]] == ["reg/shardline:7"]
    assert [c["image"] for c in cluster["spec"]["worker"]["spec"]["containers"]] == ["reg/shardline-gpu:7"]
    unchanged, _ = job_cluster_resources(template, "0123456789abcdef", 1, 0)
    assert unchanged["spec"]["worker"]["spec"]["containers"][0]["image"] == "shardline-gpu:0.1.0"
