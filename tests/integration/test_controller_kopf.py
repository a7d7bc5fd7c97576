"""The operator's kopf handlers against a Kubernetes API on loopback (kmock's KubernetesEmulator), through the real
clients: kopf watches ShardlineModels and patches their status, kr8s creates and patches what they own, and the
model registry is a real one on disk. Nothing of ours is replaced.

Not shown here (no API server, no controllers run): that the objects schedule, that KEDA scales them, that
routers reach the replicas. tests/unit/test_controller_reconcile.py validates the same objects against the
Kubernetes schemas and the KEDA CRD.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shardline.build.examples import package_breast_cancer
from shardline.storage.registry import ModelRegistry
from tests.support.kube_api import KubeApi, kube_api

kopf_testing = pytest.importorskip("kopf.testing", reason="the operator needs kopf: pip install 'shardline[kubernetes]'")

MODEL = "breast-cancer"
NS = "serving"
RESOURCE = "shardline.dev/v1alpha1/shardlinemodels"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("operator-bundles")
    for version, kind in enumerate(["gbt", "logreg", "logreg"], start=1):
        package_breast_cancer(root / f"v{version}", kind=kind)
    return root / "v1", root / "v2", root / "v3"


@pytest.fixture
def registry(shardline_home: Path, bundles: tuple[Path, Path, Path]) -> ModelRegistry:
    registry = ModelRegistry(str(shardline_home / "registry"))
    for bundle in bundles:
        registry.push(bundle)
    return registry


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Iterator[KubeApi]:
    with kube_api() as running:
        monkeypatch.setenv("KUBECONFIG", str(running.kubeconfig))
        monkeypatch.setenv("SHARDLINE_CONTROLLER_AUTOSCALER", "auto")
        yield running


@pytest.fixture
def operator(api: KubeApi, registry: ModelRegistry) -> Iterator[Any]:
    """The operator (kopf) running in a thread of this process, against the emulator."""
    with kopf_testing.KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "shardline.controller.handlers"],
                                 timeout=60) as runner:
        yield runner
    assert runner.exit_code == 0, runner.output
    assert runner.exception is None


def eventually(check: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = check()
        except (AssertionError, KeyError, TypeError):
            found = None
            if time.monotonic() > deadline:
                raise
        if found:
            return found
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.2)


def apply_model(api: KubeApi, name: str, spec: dict[str, Any]) -> None:
    """What `kubectl apply` sends: the ShardlineModel created, or its spec patched."""
    import kr8s
    from kr8s.objects import object_from_spec

    client = kr8s.api(kubeconfig=str(api.kubeconfig))
    body = {"apiVersion": "shardline.dev/v1alpha1", "kind": "ShardlineModel",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}
    obj = object_from_spec(body, api=client, allow_unknown_type=True)
    if obj.exists():
        obj.patch({"spec": spec})
    else:
        obj.create()


def condition(api: KubeApi, name: str, kind: str) -> dict[str, Any] | None:
    model = api.get(RESOURCE, NS, name) or {}
    return next((c for c in (model.get("status") or {}).get("conditions", []) if c["type"] == kind), None)


def test_applying_a_shardline_model_gives_its_objects_its_first_alias_and_status(
    api: KubeApi, registry: ModelRegistry, operator: Any,
) -> None:
    apply_model(api, "churn", {"model": f"{MODEL}:1", "hardwareClass": "mig-1g.18gb", "minReplicas": 2,
                               "maxReplicas": 6, "sloClass": "interactive"})
    # the status is written last, once every owned object is applied
    eventually(lambda: (condition(api, "churn", "RolledOut") or {}).get("reason") == "AliasSet")
    deployment = api.get("apps/v1/deployments", NS, "churn")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert deployment["spec"]["replicas"] == 2
    assert container["resources"]["limits"]["nvidia.com/mig-1g.18gb"] == 1
    assert deployment["metadata"]["ownerReferences"][0]["kind"] == "ShardlineModel"
    assert api.get("v1/services", NS, "churn")["spec"]["clusterIP"] == "None"
    scaled = api.get("keda.sh/v1alpha1/scaledobjects", NS, "churn")  # the emulator serves KEDA's resource: auto
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (2, 6)
    assert api.get("policy/v1/poddisruptionbudgets", NS, "churn")["spec"]["maxUnavailable"] == 1
    assert api.get("networking.k8s.io/v1/networkpolicies", NS, "churn")["spec"]["policyTypes"] == ["Ingress"]
    # the first version of a never-set alias: set, no rollout (nothing to compare with)
    assert registry.resolve(f"{MODEL}@prod").version == 1
    status = api.get(RESOURCE, NS, "churn")["status"]
    assert status["serving"] == f"{MODEL}:1" and status["routerGroup"]["name"] == f"{NS}-churn"
    assert condition(api, "churn", "Valid")["status"] == "True"


def test_changing_the_version_starts_a_rollout_the_routers_run(
    api: KubeApi, registry: ModelRegistry, operator: Any,
) -> None:
    registry.set_alias(MODEL, "prod", 1)
    apply_model(api, "churn", {"model": f"{MODEL}:1", "rolloutPolicy": {"steps": [10, 50, 100], "interval": "5m"}})
    eventually(lambda: (condition(api, "churn", "RolledOut") or {}).get("reason") == "Serving")
    apply_model(api, "churn", {"model": f"{MODEL}:2", "rolloutPolicy": {"steps": [10, 50, 100], "interval": "5m"}})
    eventually(lambda: (api.get(RESOURCE, NS, "churn")["status"].get("rollout") or {}).get("candidate") == 2)
    move = registry.current_move(MODEL, "prod")
    assert move is not None and move.action == "canary" and move.rollout is not None
    assert (move.rollout.candidate, move.rollout.baseline, move.rollout.steps) == (2, 1, (10.0, 50.0, 100.0))
    assert move.rollout.interval_s == 300 and move.by == "shardline-operator"
    assert registry.resolve(f"{MODEL}@prod").version == 1  # the routers move it, step by step


def test_a_bad_shardline_model_is_refused_naming_the_field_and_owns_nothing(api: KubeApi, operator: Any) -> None:
    apply_model(api, "broken", {"model": f"{MODEL}:1", "minReplicas": 5, "maxReplicas": 2})
    valid = eventually(lambda: condition(api, "broken", "Valid"))
    assert valid["status"] == "False" and "spec.maxReplicas" in valid["message"]
    assert api.get("apps/v1/deployments", NS, "broken") is None


def test_a_changed_hardware_class_drops_what_it_no_longer_sets(api: KubeApi, operator: Any) -> None:
    apply_model(api, "embed", {"model": f"{MODEL}:1", "hardwareClass": "gpu"})
    eventually(lambda: api.get("apps/v1/deployments", NS, "embed"))
    apply_model(api, "embed", {"model": f"{MODEL}:1", "hardwareClass": "cpu", "resources": {"cpu": "3"}})

    def on_cpu() -> bool:
        pod = api.get("apps/v1/deployments", NS, "embed")["spec"]["template"]["spec"]
        limits = pod["containers"][0]["resources"]["limits"]
        return "nvidia.com/gpu" not in limits and "tolerations" not in pod and "nodeSelector" not in pod
    eventually(on_cpu)
    assert api.get("apps/v1/deployments", NS, "embed")["spec"]["template"]["spec"]["containers"][0]["resources"][
        "requests"]["cpu"] == "3"


def test_an_hpa_it_made_before_the_cluster_had_keda_is_deleted(api: KubeApi, operator: Any) -> None:
    import kr8s
    from kr8s.objects import object_from_spec

    apply_model(api, "churn", {"model": f"{MODEL}:1"})
    eventually(lambda: api.get("keda.sh/v1alpha1/scaledobjects", NS, "churn"))
    uid = api.get(RESOURCE, NS, "churn")["metadata"]["uid"]
    client = kr8s.api(kubeconfig=str(api.kubeconfig))
    owner = {"apiVersion": "shardline.dev/v1alpha1", "kind": "ShardlineModel", "name": "churn", "uid": uid}
    for name, owners in (("churn", [owner]), ("theirs", [])):  # ours (left from before KEDA), and someone else's
        object_from_spec({
            "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": name, "namespace": NS, "ownerReferences": owners},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                     "maxReplicas": 2}}, api=client).create()
    apply_model(api, "churn", {"model": f"{MODEL}:1", "maxReplicas": 5})
    eventually(lambda: api.get("apps/v1/deployments", NS, "churn") is not None
               and api.get("keda.sh/v1alpha1/scaledobjects", NS, "churn")["spec"]["maxReplicaCount"] == 5)
    eventually(lambda: api.get("autoscaling/v2/horizontalpodautoscalers", NS, "churn") is None)
    assert api.get("autoscaling/v2/horizontalpodautoscalers", NS, "theirs") is not None


def test_a_refused_shardline_model_is_posted_as_an_event_on_it(api: KubeApi, operator: Any) -> None:
    apply_model(api, "slow", {"model": f"{MODEL}:1", "sloClass": "fast"})
    uid = eventually(lambda: api.get(RESOURCE, NS, "slow")["metadata"]["uid"])

    def posted() -> list[dict[str, Any]]:
        return [e for e in api.objects("v1/events", NS).values()
                if e["involvedObject"].get("uid") == uid and e["type"] == "Error"]
    event = eventually(posted)[0]
    assert event["involvedObject"]["name"] == "slow" and event["metadata"]["name"].startswith("kopf-event-")
    assert "ShardlineModel serving/slow is refused: spec.sloClass" in event["message"]


def test_the_operator_process_logs_a_refusal_on_its_output(
    api: KubeApi, registry: ModelRegistry, tmp_path: Path,
) -> None:
    """`shardline-controller` as its Deployment runs it: `kubectl logs` shows what it refused, and why."""
    import os
    import subprocess
    import sys

    from shardline.local_ports import reserve_port as free_port

    apply_model(api, "b-slo", {"model": f"{MODEL}:1", "sloClass": "fast"})
    log = tmp_path / "controller.log"
    liveness = f"http://127.0.0.1:{free_port()}/healthz"
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "shardline.controller", "--standalone", "--liveness",
                                    liveness], stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
        try:
            eventually(lambda: "is refused" in log.read_text(), timeout=60)
        finally:
            process.terminate()
            process.wait(20)
    text = log.read_text()
    assert "Handler 'reconcile' failed permanently: ShardlineModel serving/b-slo is refused: spec.sloClass" in text
    assert "Traceback" not in text


def test_a_second_shardline_model_naming_another_version_of_the_alias_is_refused_not_fought_over(
    api: KubeApi, registry: ModelRegistry, operator: Any,
) -> None:
    registry.set_alias(MODEL, "prod", 1)
    apply_model(api, "churn", {"model": f"{MODEL}:1"})
    eventually(lambda: (condition(api, "churn", "RolledOut") or {}).get("reason") == "Serving")
    time.sleep(1.1)  # creationTimestamp has whole seconds: the second one is younger, not tied
    apply_model(api, "churn-b", {"model": f"{MODEL}:2"})
    valid = eventually(lambda: (c := condition(api, "churn-b", "Valid")) and c["status"] == "False" and c)
    assert valid["reason"] == "AliasClaimed"
    assert valid["message"].startswith(f"ShardlineModel {NS}/churn-b is refused: {MODEL}@prod is claimed by the "
                                       f"older ShardlineModel {NS}/churn, which names {MODEL}:1")
    uid = api.get(RESOURCE, NS, "churn-b")["metadata"]["uid"]
    event = eventually(lambda: [e for e in api.objects("v1/events", NS).values()
                                if e["involvedObject"].get("uid") == uid and e["type"] == "Warning"])[0]
    assert "is claimed by the older ShardlineModel" in event["message"]
    # nothing moved: no rollout of 2, no objects for the refused one; the older one still serves
    assert registry.current_move(MODEL, "prod").action == "set"
    assert registry.resolve(f"{MODEL}@prod").version == 1
    assert api.get("apps/v1/deployments", NS, "churn-b") is None
    assert condition(api, "churn", "Valid")["status"] == "True"
    # the same version on another hardware class is no rival
    apply_model(api, "churn-gpu", {"model": f"{MODEL}:1", "hardwareClass": "gpu"})
    eventually(lambda: (condition(api, "churn-gpu", "RolledOut") or {}).get("reason") == "Serving")
