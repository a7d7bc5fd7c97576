"""The Kubernetes manifests (deploy/k8s) checked without a cluster: no API server or container engine runs here.

Every overlay renders with `kubectl kustomize`; every rendered object of a built-in kind validates strictly
(unknown fields refused) against the Kubernetes schemas of 1.32 and 1.37 (`kubernetes-validate`'s bundled
schemas); every custom resource (KEDA, Gateway API, dask-kubernetes, Istio) validates against its CRD's own
openAPIV3Schema (tests/support/crds), unknown fields refused too; every `SHARDLINE_*` name is a real setting,
every metric an autoscaler queries is one the router exports (read from a real RouterMetrics built from the
overlay's own router.yaml), and the objects refer to each other consistently (Services, Secrets, groups).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from shardline.online.router.config import parse_router_config
from shardline.online.router.health import BreakerPolicy
from shardline.online.router.metrics import RouterMetrics
from shardline.online.router.replicas import ReplicaSet
from shardline.tenants import parse_tenants_file
from tests.support.k8s import K8S, REPO, containers, find, render, validate, validate_custom
from tests.support.settings_names import unknown_settings

OVERLAYS = ["dev", "production", "production-hpa"]
KUBERNETES_VERSIONS = ["1.32.0", "1.37.0"]  # kubectl here is 1.32; 1.37 is the newest kubernetes-validate bundles
DASK_TEMPLATES = sorted((K8S / "base/tenant/dask").glob("*.yaml"))
EXAMPLES = [p for p in sorted((K8S / "examples").iterdir()) if (p / "kustomization.yaml").is_file()]
MIG_RESOURCES = {"nvidia.com/mig-1g.18gb", "nvidia.com/mig-3g.71gb"}


def overlay(name: str) -> tuple[dict[str, Any], ...]:
    return render(K8S / "overlays" / name)


def one(objects: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    [found] = find(objects, kind, name)
    return found


# custom resources against their CRDs (tests/support/k8s.py: validate, validate_custom)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", OVERLAYS)
def test_every_rendered_object_validates_strictly(name: str, version: str) -> None:
    objects = overlay(name)
    assert len(objects) > 30
    for obj in objects:
        try:
            validate(obj, version)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{name}: {obj['kind']}/{obj['metadata']['name']}: {e}") from None


def test_the_checks_refuse_a_misspelled_field() -> None:
    # they can fail: a Deployment and a ScaledObject with one field misspelled are refused
    deployment = copy.deepcopy(one(overlay("dev"), "Deployment", "shardline-router"))
    containers(deployment)[0]["readinesProbe"] = containers(deployment)[0].pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.32.0", strict=True)
    scaled = copy.deepcopy(one(overlay("production"), "ScaledObject", "shardline-replicas-cpu"))
    scaled["spec"]["minReplicas"] = scaled["spec"].pop("minReplicaCount")
    with pytest.raises(jsonschema.ValidationError, match="minReplicas"):
        validate_custom(scaled)


def dask_templates(name: str) -> dict[str, dict[str, Any]]:
    """The DaskCluster templates an overlay ships to a tenant's namespace (ConfigMap shardline-dask-templates)."""
    config = one(overlay(name), "ConfigMap", "shardline-dask-templates")
    assert config["metadata"]["namespace"] == "shardline-tenant-acme"
    return {key: yaml.safe_load(text) for key, text in config["data"].items()}


@pytest.mark.parametrize("name", OVERLAYS)
def test_dask_templates_and_the_job_clusters_made_from_them_validate_against_the_crds(name: str) -> None:
    from shardline.tasks.kube_cluster import job_cluster_resources

    templates = dask_templates(name)
    assert set(templates) == {p.name for p in DASK_TEMPLATES}
    for key, template in templates.items():
        assert template == yaml.safe_load((K8S / "base/tenant/dask" / key).read_text())  # the image's copy
        cluster, autoscaler = job_cluster_resources(template, "0123456789abcdef", 2, 10)
        assert autoscaler is not None
        for obj in (template, cluster, autoscaler):
            validate_custom(obj)
        for spec in (cluster["spec"]["scheduler"]["spec"], cluster["spec"]["worker"]["spec"]):
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": spec},
                                         "1.32.0", strict=True)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_render_and_validate(example: Path) -> None:
    objects = render(example)
    assert objects
    for obj in objects:
        validate(obj, "1.32.0")


# names the code knows


def rendered_text(name: str) -> str:
    return yaml.safe_dump_all(overlay(name))


@pytest.mark.parametrize("name", OVERLAYS)
def test_every_shardline_setting_named_is_real(name: str) -> None:
    text = rendered_text(name)
    assert "SHARDLINE_" in text
    assert not unknown_settings(text), f"{name} names settings that do not exist: {sorted(unknown_settings(text))}"


def test_every_shardline_setting_named_in_the_sources_is_real() -> None:
    for path in [*K8S.rglob("*.yaml"), *(REPO / "deploy/images").iterdir(), REPO / "docs/kubernetes.md"]:
        assert not unknown_settings(path.read_text()), path


def router_config(objects: tuple[dict[str, Any], ...]) -> Any:
    [config] = [c for c in find(objects, "ConfigMap") if c["metadata"]["name"].startswith("shardline-router-config")]
    return parse_router_config(yaml.safe_load(config["data"]["router.yaml"]), "router.yaml")


def exported_metrics(objects: tuple[dict[str, Any], ...]) -> set[str]:
    """The series a router with this overlay's router.yaml exports, as Prometheus reads them."""
    metrics = RouterMetrics(ReplicaSet(router_config(objects), BreakerPolicy(), 10.0, lambda: 0.0), lambda: 0.0)
    metrics.started("churn:1")
    metrics.answered("churn:1", 200, 0.01, 0)
    text = metrics.exposition()[0].decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def autoscaler_queries(objects: tuple[dict[str, Any], ...]) -> Iterator[tuple[str, str, set[str]]]:
    """(target Deployment, metric, the group labels it selects) for every metric a ScaledObject or HPA reads."""
    for scaled in find(objects, "ScaledObject"):
        for trigger in scaled["spec"]["triggers"]:
            assert trigger["type"] == "prometheus"
            query = trigger["metadata"]["query"]
            groups = set(re.findall(r'group="([^"]+)"', query))
            for metric in set(re.findall(r"\b(shardline_[a-z0-9_]+)", query)):
                yield scaled["spec"]["scaleTargetRef"]["name"], metric, groups
    for hpa in find(objects, "HorizontalPodAutoscaler"):
        for metric in hpa["spec"]["metrics"]:
            external = metric["external"]["metric"]
            groups = {external["selector"]["matchLabels"]["group"]}
            yield hpa["spec"]["scaleTargetRef"]["name"], external["name"], groups


@pytest.mark.parametrize("name", ["production", "production-hpa"])
def test_autoscalers_read_series_the_router_exports_for_groups_it_has(name: str) -> None:
    objects = overlay(name)
    exported = exported_metrics(objects)
    groups = {g.name for g in router_config(objects).groups}
    deployments = {d["metadata"]["name"] for d in find(objects, "Deployment")}
    seen = set()
    for target, metric, selected in autoscaler_queries(objects):
        assert metric in exported, f"{target}'s autoscaler reads {metric}, which the router does not export"
        assert selected <= groups, f"{target}'s autoscaler selects groups {selected - groups} the router lacks"
        assert all(target == f"shardline-replicas-{g}" for g in selected)
        assert target in deployments
        seen.add(target)
    assert seen == {d for d in deployments if d.startswith("shardline-replicas-")}


def test_scaled_objects_scale_to_zero_behind_a_floor_that_never_does() -> None:
    scaled = {s["metadata"]["name"]: s["spec"] for s in find(overlay("production"), "ScaledObject")}
    assert scaled["shardline-replicas-cpu"]["minReplicaCount"] >= 1
    first = scaled["shardline-replicas-mig-1g"]
    assert first["minReplicaCount"] == 0
    # woken by any traffic: with no replica of its own its own figure stays 0
    assert any("shardline_router_requests_total" in t["metadata"]["query"] for t in first["triggers"])
    for spec in scaled.values():
        assert all("activationThreshold" in t["metadata"] for t in spec["triggers"])


def test_the_checks_would_see_a_metric_the_router_does_not_export() -> None:
    objects = overlay("production")
    assert "shardline_router_replicas_wanted" in exported_metrics(objects)
    assert "shardline_router_wanted_replicas" not in exported_metrics(objects)


# objects refer to each other


@pytest.mark.parametrize("name", OVERLAYS)
def test_router_groups_are_headless_services_of_replica_deployments(name: str) -> None:
    objects = overlay(name)
    services = {s["metadata"]["name"]: s for s in find(objects, "Service")}
    for group in router_config(objects).groups:
        assert group.dns is not None
        service_name, namespace = group.dns.name.split(".")[:2]
        service = services[service_name]
        assert namespace == service["metadata"]["namespace"] and service["spec"]["clusterIP"] == "None"
        assert group.dns.port in {p["port"] for p in service["spec"]["ports"]}
        deployment = one(objects, "Deployment", service_name)
        assert deployment["spec"]["template"]["metadata"]["labels"].items() >= service["spec"]["selector"].items()


@pytest.mark.parametrize("name", OVERLAYS)
def test_tenants_file_is_one_the_platform_reads_with_a_batch_namespace_per_tenant(name: str) -> None:
    objects = overlay(name)
    [config] = [c for c in find(objects, "ConfigMap") if c["metadata"]["name"].startswith("shardline-tenants")]
    tenants = parse_tenants_file(yaml.safe_load(config["data"]["tenants.yaml"]), "tenants.yaml")
    for tenant in tenants.tenants:
        namespace = one(objects, "Namespace", f"shardline-tenant-{tenant.name}")
        assert namespace["metadata"]["labels"]["shardline.dev/tenant"] == tenant.name


def secrets_referenced(objects: tuple[dict[str, Any], ...]) -> set[tuple[str, str]]:
    found = set()
    for obj in objects:
        if obj["kind"] not in {"Deployment", "StatefulSet"}:
            continue
        namespace = obj["metadata"]["namespace"]
        for c in containers(obj):
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    found.add((namespace, ref["name"]))
            for source in c.get("envFrom", []):
                if "secretRef" in source and not source["secretRef"].get("optional"):
                    found.add((namespace, source["secretRef"]["name"]))
    return found


def test_dev_generates_every_secret_it_uses_and_production_none() -> None:
    dev = overlay("dev")
    generated = {(s["metadata"]["namespace"], s["metadata"]["name"]) for s in find(dev, "Secret")}
    assert secrets_referenced(dev) <= generated
    assert ("shardline-tenant-acme", next(n for ns, n in generated if ns == "shardline-tenant-acme")) in generated
    assert not find(overlay("production"), "Secret"), "production's Secrets are created in the cluster, not here"


def test_dev_router_key_digest_matches_the_key() -> None:
    import base64
    import hashlib

    [secret] = [s for s in find(overlay("dev"), "Secret") if s["metadata"]["name"].startswith("shardline-router-key")]
    key, digest = (base64.b64decode(secret["data"][k]).decode() for k in ("key", "sha256"))
    assert hashlib.sha256(key.encode()).hexdigest() == digest


# the online tier


@pytest.mark.parametrize("name", OVERLAYS)
def test_routers_and_replicas_probe_health_drain_and_take_the_key_from_a_secret(name: str) -> None:
    objects = overlay(name)
    deployments = [d for d in find(objects, "Deployment") if d["metadata"]["name"].startswith(
        ("shardline-router", "shardline-replicas-"))]
    assert len(deployments) >= 2
    for d in deployments:
        pod = d["spec"]["template"]["spec"]
        [c] = pod["containers"]
        assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
        assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
        assert c["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
        assert pod["terminationGracePeriodSeconds"] > int(c["lifecycle"]["preStop"]["exec"]["command"][1])
        env = {e["name"]: e for e in c["env"]}
        router = d["metadata"]["name"] == "shardline-router"
        key = "SHARDLINE_ROUTER_KEY" if router else "SHARDLINE_TENANCY_ROUTER_KEY_SHA256"
        assert "secretKeyRef" in env[key]["valueFrom"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["priorityClassName"] == "shardline-online"


def test_production_runs_several_routers_spread_over_zones_with_a_budget() -> None:
    objects = overlay("production")
    router = one(objects, "Deployment", "shardline-router")
    assert router["spec"]["replicas"] >= 3
    zones = [t for t in router["spec"]["template"]["spec"]["topologySpreadConstraints"]
             if t["topologyKey"] == "topology.kubernetes.io/zone"]
    assert zones and zones[0]["whenUnsatisfiable"] == "DoNotSchedule"
    assert one(objects, "PodDisruptionBudget", "shardline-router")["spec"]["minAvailable"] >= 1
    assert find(objects, "HTTPRoute", "shardline-router") and find(objects, "Ingress", "shardline-router")
    assert find(objects, "StatefulSet", "shardline-redis")


def test_dev_is_cpu_only_and_fits_one_node() -> None:
    objects = overlay("dev")
    pods = [o for o in objects if o["kind"] in {"Deployment", "StatefulSet"}]
    for pod in pods:
        spec = pod["spec"]["template"]["spec"]
        assert not spec.get("nodeSelector") and not spec.get("tolerations")
        assert "nvidia.com/" not in json.dumps([c.get("resources") for c in spec["containers"]])
    router = one(objects, "Deployment", "shardline-router")
    assert router["spec"]["replicas"] == 1
    assert all(t["whenUnsatisfiable"] == "ScheduleAnyway"
               for t in router["spec"]["template"]["spec"]["topologySpreadConstraints"])
    # the registry (the home) on the one volume every pod mounts, not a per-pod emptyDir
    for name in ("shardline-router", "shardline-replicas-cpu"):
        [home] = [v for v in one(objects, "Deployment", name)["spec"]["template"]["spec"]["volumes"] if v["name"] == "home"]
        assert home == {"name": "home", "persistentVolumeClaim": {"claimName": "shardline-home"}}
    assert one(objects, "PersistentVolumeClaim", "shardline-home")
    # a one-replica router must not block a node drain
    assert "minAvailable" not in one(objects, "PodDisruptionBudget", "shardline-router")["spec"]


def test_production_gpu_groups_request_whole_gpus_and_mig_slices_on_mixed_strategy_nodes() -> None:
    objects = overlay("production")
    requested = {}
    for name in ("shardline-replicas-gpu", "shardline-replicas-mig-1g", "shardline-replicas-mig-3g"):
        d = one(objects, "Deployment", name)
        pod = d["spec"]["template"]["spec"]
        [c] = pod["containers"]
        gpu = {k: v for k, v in c["resources"]["limits"].items() if k.startswith("nvidia.com/")}
        assert len(gpu) == 1 and c["resources"]["requests"].items() >= gpu.items()
        requested.update(gpu)
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        if any(k in MIG_RESOURCES for k in gpu):
            assert pod["nodeSelector"]["nvidia.com/mig.strategy"] == "mixed"
        assert {e["name"]: e.get("value") for e in c["env"]}["SHARDLINE_RUNTIME_DEVICE"] == "cuda"
        assert "onnxruntime" not in c["image"]
    assert set(requested) == {"nvidia.com/gpu", *MIG_RESOURCES}
    vllm = one(objects, "Deployment", "shardline-replicas-mig-3g")
    assert containers(vllm)[0]["image"].endswith("shardline-vllm:0.1.0")


# batch: tenants' namespaces, quotas, network


@pytest.mark.parametrize("name", OVERLAYS)
def test_tenant_batch_namespace_counts_gpus_and_mig_slices(name: str) -> None:
    objects = overlay(name)
    [quota] = [q for q in find(objects, "ResourceQuota") if q["metadata"]["namespace"] == "shardline-tenant-acme"]
    hard = quota["spec"]["hard"]
    assert {"requests.nvidia.com/gpu", *(f"requests.{m}" for m in MIG_RESOURCES)} <= set(hard)
    assert "requests.cpu" in hard and "limits.memory" in hard
    [limits] = [r for r in find(objects, "LimitRange") if r["metadata"]["namespace"] == "shardline-tenant-acme"]
    assert limits["spec"]["limits"][0]["defaultRequest"]


def policies(objects: tuple[dict[str, Any], ...], namespace: str) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p["spec"] for p in find(objects, "NetworkPolicy")
            if p["metadata"]["namespace"] == namespace}


@pytest.mark.parametrize("name", OVERLAYS)
def test_network_default_deny_replicas_take_only_routers_workers_reach_storage_and_scheduler(name: str) -> None:
    objects = overlay(name)
    for namespace in ("shardline", "shardline-tenant-acme"):
        deny = policies(objects, namespace)["default-deny"]
        assert deny == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    replica = policies(objects, "shardline")["replica"]
    serving = [r for r in replica["ingress"] if {"protocol": "TCP", "port": 8000} in r["ports"]]
    assert serving == [{"from": [{"podSelector": {"matchLabels": {"shardline.dev/role": "router"}}}],
                        "ports": [{"protocol": "TCP", "port": 8000}]}]
    worker = policies(objects, "shardline-tenant-acme")["dask-worker"]
    for rule in worker["egress"]:
        peers = rule["to"]
        assert all("podSelector" in p for p in peers) or rule["ports"] == [{"protocol": "TCP", "port": 443}], rule
    # the router role label the policies name is the one the router's pods carry
    router = one(objects, "Deployment", "shardline-router")
    assert router["spec"]["template"]["metadata"]["labels"]["shardline.dev/role"] == "router"


def test_every_pod_label_a_policy_selects_exists() -> None:
    objects = overlay("production")
    labels = [o["spec"]["template"]["metadata"]["labels"] for o in objects if o["kind"] in {"Deployment", "StatefulSet"}]
    roles = {label.get("shardline.dev/role") for label in labels}
    for spec in (p["spec"] for p in find(objects, "NetworkPolicy")):
        selector = spec["podSelector"].get("matchLabels", {})
        if "shardline.dev/role" in selector:
            assert selector["shardline.dev/role"] in roles, selector


# Dask templates


def test_gpu_dask_template_puts_workers_on_spot_gpus_and_the_scheduler_on_demand() -> None:
    cluster = dask_templates("production")["cluster-gpu.yaml"]
    scheduler = cluster["spec"]["scheduler"]["spec"]
    excluded = {e["key"]: e["values"] for t in
                scheduler["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
                for e in t["matchExpressions"] if e["operator"] == "NotIn"}
    assert excluded["karpenter.sh/capacity-type"] == ["spot"] and not scheduler.get("tolerations")
    worker = cluster["spec"]["worker"]["spec"]
    [c] = worker["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"  # the CRD types quantities as strings
    assert c["args"][c["args"].index("--resources") + 1] == "GPU=1"  # a resource Dask schedules on
    assert "retire_workers(" in c["lifecycle"]["preStop"]["exec"]["command"][2]
    tolerated = {t["key"] for t in worker["tolerations"]}
    assert {"nvidia.com/gpu", "cloud.google.com/gke-spot", "karpenter.sh/capacity-type"} <= tolerated
    assert worker["priorityClassName"] == "shardline-batch"
    assert cluster["spec"]["scheduler"]["service"]["selector"]["dask.org/cluster-name"] == cluster["metadata"]["name"]


def test_batch_priority_class_is_below_online_and_never_preempts() -> None:
    classes = {p["metadata"]["name"]: p for p in find(overlay("dev"), "PriorityClass")}
    assert classes["shardline-batch"]["value"] < classes["shardline-online"]["value"]
    assert classes["shardline-batch"]["preemptionPolicy"] == "Never"


def test_the_image_carries_the_dask_templates_the_flow_reads() -> None:
    text = (REPO / "deploy/images/cpu.Dockerfile").read_text()
    assert "deploy/k8s/base/tenant/dask/" in text


def kustomization_images(name: str) -> dict[str, str]:
    """The image references an overlay's `images:` entries make, by image name (base, components, then overlay)."""
    made: dict[str, str] = {}
    overlay_file = yaml.safe_load((K8S / "overlays" / name / "kustomization.yaml").read_text())
    files = [K8S / "base/kustomization.yaml",
             *(K8S / "overlays" / name / c / "kustomization.yaml" for c in overlay_file.get("components", [])),
             K8S / "overlays" / name / "kustomization.yaml"]
    for path in files:
        for entry in yaml.safe_load(path.read_text()).get("images", []):
            made[entry["name"]] = f"{entry.get('newName', entry['name'])}:{entry['newTag']}"
    return made


@pytest.mark.parametrize("name", OVERLAYS)
def test_one_images_entry_names_the_images_the_operator_and_the_dask_clusters_start(name: str) -> None:
    from shardline.settings import ControllerSettings, DaskSettings
    from shardline.tasks.kube_cluster import job_cluster_resources

    objects = overlay(name)
    images = kustomization_images(name)
    running = {c["image"] for d in find(objects, "Deployment") for c in containers(d)}
    controller = one(objects, "Deployment", "shardline-controller")
    [container] = containers(controller)
    assert container["image"] == images["shardline"]
    assert {"configMapRef": {"name": "shardline-controller-images"}} in container["envFrom"]
    assert not [e for e in container.get("env", []) if e["name"].endswith("IMAGE")]
    given = one(objects, "ConfigMap", "shardline-controller-images")["data"]
    operator = ControllerSettings(**{k.removeprefix("SHARDLINE_CONTROLLER_").lower(): v for k, v in given.items()})
    assert operator.image == images["shardline"] == container["image"]
    assert operator.gpu_image == images.get("shardline-gpu", "shardline-gpu:0.1.0")
    if name != "dev":  # production runs the GPU image itself: the same reference
        assert operator.gpu_image in running
    # a job's Dask cluster, made from the shipped templates with the tenant's settings, runs the same images
    dask = one(objects, "ConfigMap", "shardline-dask-images")
    assert dask["metadata"]["namespace"] == "shardline-tenant-acme"
    settings = DaskSettings(**{k.removeprefix("SHARDLINE_DASK_").lower(): v for k, v in dask["data"].items()})
    assert (settings.kubernetes_image, settings.kubernetes_gpu_image) == (operator.image, operator.gpu_image)
    for key, template in dask_templates(name).items():
        cluster, _ = job_cluster_resources(template, "0123456789abcdef", 2, 10, images={
            "shardline": settings.kubernetes_image or "", "shardline-gpu": settings.kubernetes_gpu_image or ""})
        used = {c["image"] for role in ("scheduler", "worker") for c in cluster["spec"][role]["spec"]["containers"]}
        assert used and used <= {operator.image, operator.gpu_image}, (key, used)
        assert operator.image in used  # the scheduler
    if name == "dev":  # dev builds and loads shardline:dev only: that is what the CPU pods pull
        assert images["shardline"] == "shardline:dev" and settings.kubernetes_image == "shardline:dev"


def pod_specs(obj: dict[str, Any]) -> Iterator[dict[str, Any]]:
    if obj["kind"] in {"Deployment", "StatefulSet"}:
        yield obj["spec"]["template"]["spec"]
    elif obj["kind"] == "DaskCluster":
        yield obj["spec"]["scheduler"]["spec"]
        yield obj["spec"]["worker"]["spec"]


@pytest.mark.parametrize("name", OVERLAYS)
def test_pods_meet_the_restricted_pod_security_standard(name: str) -> None:
    # the platform namespace enforces `restricted`; the Dask templates meet it too (tenant namespaces warn on it)
    objects = [*overlay(name), *dask_templates(name).values()]
    checked = 0
    for obj in objects:
        for pod in pod_specs(obj):
            where = f"{obj['kind']}/{obj['metadata']['name']}"
            assert pod["securityContext"]["runAsNonRoot"] is True, where
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
            for c in pod["containers"]:
                assert c["securityContext"]["allowPrivilegeEscalation"] is False, where
                assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], where
            checked += 1
    assert checked >= 8
    platform = one(overlay(name), "Namespace", "shardline")
    assert platform["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


# the operator: its CRD refuses bad ShardlineModels, and every overlay runs it with the rights it needs


def shardline_model(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "shardline.dev/v1alpha1", "kind": "ShardlineModel",
            "metadata": {"name": "churn", "namespace": "shardline"}, "spec": {"model": "churn:3", **spec}}


@pytest.mark.parametrize(("spec", "field"), [
    ({"hardwareClass": "tpu"}, "$.spec.hardwareClass"),
    ({"hardwareClass": "mig-9g.18gb"}, "$.spec.hardwareClass"),
    ({"minReplicas": -1}, "$.spec.minReplicas"),
    ({"maxReplicas": 0}, "$.spec.maxReplicas"),
    ({"maxReplicas": "4"}, "$.spec.maxReplicas"),
    ({"sloClass": "fast"}, "$.spec.sloClass"),
    ({"replicas": 3}, "$.spec"),  # unknown field: the message names it
    ({"model": "Churn!"}, "$.spec.model"),
    ({"rolloutPolicy": {"strategy": "bluegreen"}}, "$.spec.rolloutPolicy.strategy"),
    ({"rolloutPolicy": {"steps": [0, 100]}}, "$.spec.rolloutPolicy.steps[0]"),
    ({"rolloutPolicy": {"steps": [5, 150]}}, "$.spec.rolloutPolicy.steps[1]"),
    ({"rolloutPolicy": {"interval": "soon"}}, "$.spec.rolloutPolicy.interval"),
    ({"rolloutPolicy": {"shadow": 0}}, "$.spec.rolloutPolicy.shadow"),
    ({"resources": {"memory": "lots"}}, "$.spec.resources.memory"),
])
def test_the_crd_refuses_a_bad_shardline_model_naming_the_field(spec: dict[str, Any], field: str) -> None:
    bad = shardline_model(**spec)
    with pytest.raises(jsonschema.ValidationError) as refused:
        validate_custom(bad)
    assert refused.value.json_path == field, refused.value.message
    if spec.get("replicas"):
        assert "'replicas'" in refused.value.message
    # the operator refuses it too, naming the same field (it checks again what a cluster without the CRD's
    # schema, or an older CRD, lets in)
    from shardline.controller.resource import parse_resource
    from shardline.errors import InvalidSetting

    with pytest.raises(InvalidSetting, match=re.escape(field.removeprefix("$.").split("[")[0])):
        parse_resource(bad)


def test_the_crd_takes_a_good_shardline_model_and_its_defaults_are_the_operators() -> None:
    validate_custom(shardline_model(hardwareClass="mig-3g.71gb", minReplicas=0, maxReplicas=2, sloClass="throughput",
                                    rolloutPolicy={"steps": [1, 50, 100], "interval": None, "maxP99Ratio": 1.5},
                                    resources={"cpu": "500m", "memory": "6Gi"}))
    from shardline.controller.resource import RolloutPolicy, ShardlineModelSpec

    crd = yaml.safe_load((K8S / "crds/shardlinemodel.yaml").read_text())
    props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    spec = ShardlineModelSpec(model="churn:1")
    assert (props["hardwareClass"]["default"], props["minReplicas"]["default"], props["maxReplicas"]["default"],
            props["sloClass"]["default"]) == (spec.hardware_class, spec.min_replicas, spec.max_replicas, spec.slo_class)
    assert props["rolloutPolicy"]["properties"]["strategy"]["default"] == RolloutPolicy().strategy
    # the one rule a JSON schema cannot say: a CEL rule, checked by the API server (and by the operator)
    [rule] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"]
    assert rule["rule"] == "self.maxReplicas >= self.minReplicas"


def rules_allow(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)


@pytest.mark.parametrize("name", OVERLAYS)
def test_every_overlay_runs_the_operator_with_its_crd_and_the_rights_for_what_it_owns(name: str) -> None:
    from shardline.controller.reconcile import RegistryView, reconcile
    from shardline.controller.resource import parse_resource
    from shardline.settings import ControllerSettings

    objects = overlay(name)
    assert one(objects, "CustomResourceDefinition", "shardlinemodels.shardline.dev")
    controller = one(objects, "Deployment", "shardline-controller")
    pod = controller["spec"]["template"]["spec"]
    assert controller["spec"]["replicas"] == 1 and controller["spec"]["strategy"]["type"] == "Recreate"
    assert pod["containers"][0]["args"][0] == "shardline-controller"
    binding = one(objects, "ClusterRoleBinding", "shardline-controller")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                    "namespace": "shardline"}]
    rules = one(objects, "ClusterRole", binding["roleRef"]["name"])["rules"]
    for verb in ("list", "watch", "patch"):
        assert rules_allow(rules, "shardline.dev", "shardlinemodels", verb)
    assert rules_allow(rules, "shardline.dev", "shardlinemodels/status", "patch")
    model = parse_resource({**shardline_model(minReplicas=0), "metadata": {"name": "m", "namespace": "ns", "uid": "u"}})
    for autoscaler in ("keda", "hpa"):
        for obj in reconcile(model, RegistryView(versions=(3,)), ControllerSettings(),
                             autoscaler=autoscaler).objects:  # type: ignore[arg-type]
            group = obj["apiVersion"].rpartition("/")[0]
            plural = {"NetworkPolicy": "networkpolicies"}.get(obj["kind"], obj["kind"].lower() + "s")
            for verb in ("get", "create", "patch"):
                assert rules_allow(rules, group, plural, verb), f"the operator may not {verb} {group}/{plural}"
        for obj in reconcile(model, RegistryView(versions=(3,)), ControllerSettings(),
                             autoscaler=autoscaler).dropped:  # type: ignore[arg-type]
            group, plural = obj["apiVersion"].rpartition("/")[0], obj["kind"].lower() + "s"
            assert rules_allow(rules, group, plural, "delete"), f"the operator may not delete {group}/{plural}"
