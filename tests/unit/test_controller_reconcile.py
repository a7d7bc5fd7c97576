"""The operator's reconcile (shardline.controller): a ShardlineModel and the registry's state in, the objects it
owns, its status conditions and the registry move out. Pure, so every case is asserted here; every object it makes
validates strictly against the Kubernetes schemas (1.32) and, for KEDA's ScaledObject, against KEDA's CRD, and
every metric and setting it names is a real one. tests/integration/test_controller_kopf.py runs the same through
kopf against an API on loopback.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from shardline.controller.apply import LAST_APPLIED, plan
from shardline.controller.reconcile import (
    Condition, RegistryView, RunningRollout, SetAlias, StartRollout, claim, conditions_at, contested, reconcile,
)
from shardline.controller.resource import ShardlineModel, parse_resource
from shardline.errors import InvalidSetting
from shardline.online.router import metrics
from shardline.settings import ControllerSettings
from tests.support.k8s import validate
from tests.support.settings_names import unknown_settings

SETTINGS = ControllerSettings()


def model(spec: dict[str, Any], name: str = "churn", namespace: str = "serving",
          created: str = "2026-01-01T00:00:00Z") -> ShardlineModel:
    return parse_resource({"apiVersion": "shardline.dev/v1alpha1", "kind": "ShardlineModel",
                           "metadata": {"name": name, "namespace": namespace, "uid": "u-1", "generation": 3,
                                        "creationTimestamp": created},
                           "spec": spec})


def owned(result: Any, kind: str) -> dict[str, Any]:
    [found] = [o for o in result.objects if o["kind"] == kind]
    return found  # type: ignore[no-any-return]


def pod_of(result: Any) -> dict[str, Any]:
    return owned(result, "Deployment")["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def condition(result: Any, kind: str) -> Condition:
    [found] = [c for c in result.conditions if c.type == kind]
    return found


SERVING_1 = RegistryView(versions=(1, 2), alias_version=1)


# the objects


def test_a_cpu_model_owns_a_deployment_service_scaled_object_pdb_and_network_policy() -> None:
    result = reconcile(model({"model": "churn:1", "minReplicas": 2, "maxReplicas": 6}), SERVING_1, SETTINGS)
    assert sorted(o["kind"] for o in result.objects) == [
        "Deployment", "NetworkPolicy", "PodDisruptionBudget", "ScaledObject", "Service"]
    for obj in result.objects:
        assert obj["metadata"]["namespace"] == "serving" and obj["metadata"]["name"] == "churn"
        [owner] = obj["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == ("ShardlineModel", "churn", "u-1",
                                                                                    True)
    deployment = owned(result, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    [container] = pod_of(result)["containers"]
    assert container["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "4Gi"}}
    assert container["image"] == SETTINGS.image
    assert {"name": "SHARDLINE_RUNTIME_DEVICE", "value": "cpu"} in container["env"]
    assert "tolerations" not in pod_of(result) and "nodeSelector" not in pod_of(result)
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["lifecycle"]["preStop"] == {"sleep": {"seconds": SETTINGS.drain_s}}
    service = owned(result, "Service")
    assert service["spec"]["clusterIP"] == "None"
    assert deployment["spec"]["template"]["metadata"]["labels"].items() >= service["spec"]["selector"].items()
    assert result.router_group == {"name": "serving-churn",
                                   "dns": {"name": "churn.serving.svc.cluster.local", "port": 8000}}


def test_a_whole_gpu_is_requested_with_the_gpu_image_taint_and_node_selector() -> None:
    result = reconcile(model({"model": "churn:1", "hardwareClass": "gpu"}), SERVING_1, SETTINGS)
    pod = pod_of(result)
    [container] = pod["containers"]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["image"] == SETTINGS.gpu_image
    assert {"name": "SHARDLINE_RUNTIME_DEVICE", "value": "cuda"} in container["env"]
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


@pytest.mark.parametrize("profile", ["mig-1g.18gb", "mig-3g.71gb"])
def test_a_mig_class_requests_its_slice_of_the_mixed_strategy_and_no_whole_gpu(profile: str) -> None:
    result = reconcile(model({"model": "churn:1", "hardwareClass": profile}), SERVING_1, SETTINGS)
    resources = pod_of(result)["containers"][0]["resources"]
    assert resources["requests"][f"nvidia.com/{profile}"] == 1 and resources["limits"][f"nvidia.com/{profile}"] == 1
    assert "nvidia.com/gpu" not in resources["requests"] and "nvidia.com/gpu" not in resources["limits"]
    assert owned(result, "Deployment")["metadata"]["labels"]["shardline.dev/hardware-class"] == profile


def test_spec_resources_replace_the_class_defaults_and_a_version_needing_more_memory_raises_them() -> None:
    spec = {"model": "churn:2", "resources": {"cpu": "500m", "memory": "1Gi"}}
    small = reconcile(model(spec), SERVING_1, SETTINGS)
    assert pod_of(small)["containers"][0]["resources"]["requests"] == {"cpu": "500m", "memory": "1Gi"}
    # version 2's manifest needs 3000 MB: the replica (which loads 1 and 2 during the rollout) gets it plus the
    # server's own 512 MB
    hungry = RegistryView(versions=(1, 2), alias_version=1, min_memory_mb={2: 3000})
    raised = reconcile(model(spec), hungry, SETTINGS)
    assert pod_of(raised)["containers"][0]["resources"]["limits"] == {"memory": "3512Mi"}


def test_keda_scales_on_the_routers_demand_for_the_model_down_to_zero() -> None:
    result = reconcile(model({"model": "churn:1", "minReplicas": 0, "maxReplicas": 8, "sloClass": "throughput"}),
                       SERVING_1, SETTINGS, autoscaler="keda")
    scaled = owned(result, "ScaledObject")["spec"]
    assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == (0, 8)
    assert scaled["scaleTargetRef"]["name"] == "churn"
    [trigger] = scaled["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["activationThreshold"] == "0"
    assert trigger["metadata"]["threshold"] == "8"  # throughput: 8 in flight per replica
    assert 'model=~"churn:[0-9]+"' in trigger["metadata"]["query"]
    assert trigger["metadata"]["serverAddress"] == SETTINGS.prometheus_url
    # the Deployment starts with one replica: KEDA takes it to zero when nobody calls
    assert owned(result, "Deployment")["spec"]["replicas"] == 1


def test_without_keda_an_hpa_reads_the_groups_replicas_wanted_and_never_goes_to_zero() -> None:
    result = reconcile(model({"model": "churn:1", "minReplicas": 0, "maxReplicas": 5}), SERVING_1, SETTINGS,
                       autoscaler="hpa")
    assert not [o for o in result.objects if o["kind"] == "ScaledObject"]
    hpa = owned(result, "HorizontalPodAutoscaler")["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1, 5)
    [metric] = hpa["metrics"]
    assert metric["external"]["metric"] == {"name": "shardline_router_replicas_wanted",
                                            "selector": {"matchLabels": {"group": "serving-churn"}}}


@pytest.mark.parametrize(("autoscaler", "other"), [("keda", "HorizontalPodAutoscaler"), ("hpa", "ScaledObject")])
def test_the_other_autoscaler_is_dropped_so_two_never_fight(autoscaler: str, other: str) -> None:
    result = reconcile(model({"model": "churn:1"}), SERVING_1, SETTINGS, autoscaler=autoscaler)  # type: ignore[arg-type]
    [dropped] = result.dropped
    assert dropped["kind"] == other and dropped["metadata"] == {"name": "churn", "namespace": "serving"}
    assert other not in {o["kind"] for o in result.objects}


@pytest.mark.parametrize(("slo", "unavailable", "in_flight", "down_s"),
                         [("interactive", 1, "2", 600), ("standard", "25%", "4", 300), ("throughput", "50%", "8", 120)])
def test_the_slo_class_sets_the_disruption_budget_and_the_scaling(slo: str, unavailable: Any, in_flight: str,
                                                                   down_s: int) -> None:
    result = reconcile(model({"model": "churn:1", "sloClass": slo}), SERVING_1, SETTINGS)
    pdb = owned(result, "PodDisruptionBudget")["spec"]
    assert pdb["maxUnavailable"] == unavailable
    assert pdb["selector"]["matchLabels"] == owned(result, "Service")["spec"]["selector"]
    scaled = owned(result, "ScaledObject")["spec"]
    assert scaled["triggers"][0]["metadata"]["threshold"] == in_flight and scaled["cooldownPeriod"] == down_s


def test_only_the_routers_reach_the_replicas_and_only_on_their_port() -> None:
    result = reconcile(model({"model": "churn:1"}), SERVING_1, SETTINGS)
    policy = owned(result, "NetworkPolicy")["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    assert policy["podSelector"]["matchLabels"] == owned(result, "Service")["spec"]["selector"]
    assert policy["ingress"] == [{"from": [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "shardline-router"}}}], "ports": [{"protocol": "TCP", "port": 8000}]}]
    # routers in another namespace: that namespace only
    elsewhere = ControllerSettings(router_namespace="shardline")
    peer = owned(reconcile(model({"model": "churn:1"}), SERVING_1, elsewhere), "NetworkPolicy")[
        "spec"]["ingress"][0]["from"][0]
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "shardline"}}


@pytest.mark.parametrize("hardware", ["cpu", "gpu", "mig-1g.18gb"])
@pytest.mark.parametrize("autoscaler", ["keda", "hpa"])
def test_every_object_validates_strictly_and_names_real_settings_and_metrics(hardware: str, autoscaler: str) -> None:
    result = reconcile(model({"model": "churn:1", "hardwareClass": hardware, "minReplicas": 0}), SERVING_1,
                       SETTINGS, autoscaler=autoscaler)  # type: ignore[arg-type]
    for obj in result.objects:
        validate(obj, "1.32.0")
        assert not unknown_settings(str(obj)), unknown_settings(str(obj))
    exported = set(re.findall(r'"(shardline_router_[a-z_]+)"', Path(metrics.__file__).read_text()))
    for obj in result.objects:
        if obj["kind"] == "ScaledObject":
            queried = set(re.findall(r"\b(shardline_[a-z0-9_]+)", obj["spec"]["triggers"][0]["metadata"]["query"]))
            assert queried == {"shardline_router_in_flight", "shardline_router_queued"} and queried <= exported
        if obj["kind"] == "HorizontalPodAutoscaler":
            assert obj["spec"]["metrics"][0]["external"]["metric"]["name"] in exported


# the registry move: a version change starts a rollout through the routers


def test_the_first_version_of_an_unset_alias_is_set_without_a_rollout() -> None:
    result = reconcile(model({"model": "churn:1"}), RegistryView(versions=(1,)), SETTINGS)
    assert result.move == SetAlias(name="churn", alias="prod", version=1)
    assert condition(result, "RolledOut").reason == "AliasSet" and result.serving == "churn:1"


def test_the_version_the_alias_serves_moves_nothing() -> None:
    result = reconcile(model({"model": "churn:1"}), SERVING_1, SETTINGS)
    assert result.move is None
    assert (condition(result, "RolledOut").status, condition(result, "RolledOut").reason) == ("True", "Serving")


def test_a_new_version_starts_a_canary_with_the_policys_steps_interval_and_criteria() -> None:
    spec = {"model": "churn:2", "alias": "live", "rolloutPolicy": {
        "steps": [5, 50, 100], "interval": "2m", "window": "30s", "minRequests": 50, "maxErrorIncrease": 0.02}}
    result = reconcile(model(spec), RegistryView(versions=(1, 2), alias_version=1), SETTINGS)
    move = result.move
    assert isinstance(move, StartRollout)
    assert (move.name, move.alias, move.candidate, move.baseline, move.mode) == ("churn", "live", 2, 1, "canary")
    assert move.steps == (5.0, 50.0, 100.0) and move.interval_s == 120 and move.shadow == 0.0
    assert move.criteria["window_s"] == 30 and move.criteria["min_requests"] == 50
    assert move.criteria["max_error_increase"] == 0.02
    assert "serving/churn" in move.reason
    rolled = condition(result, "RolledOut")
    assert (rolled.status, rolled.reason) == ("False", "RolloutStarted")
    assert result.serving == "churn:1"  # the routers move the alias, step by step


def test_a_shadow_policy_starts_a_shadow_and_a_null_interval_waits_for_promote() -> None:
    shadow = reconcile(model({"model": "churn:2", "rolloutPolicy": {"strategy": "shadow", "shadow": 0.25}}),
                       SERVING_1, SETTINGS).move
    assert isinstance(shadow, StartRollout) and (shadow.mode, shadow.shadow, shadow.steps) == ("shadow", 0.25, ())
    by_hand = reconcile(model({"model": "churn:2", "rolloutPolicy": {"interval": None}}), SERVING_1, SETTINGS).move
    assert isinstance(by_hand, StartRollout) and by_hand.interval_s is None


def test_a_running_rollout_is_not_started_again_and_another_version_waits_for_it() -> None:
    running = RunningRollout(id="r1", alias="prod", candidate=2, baseline=1, describe="canary 2 vs 1 at 5%")
    view = RegistryView(versions=(1, 2, 3), alias_version=1, rollout=running)
    same = reconcile(model({"model": "churn:2"}), view, SETTINGS)
    assert same.move is None and condition(same, "RolledOut").reason == "RollingOut"
    assert same.rollout == running
    other = reconcile(model({"model": "churn:3"}), view, SETTINGS)
    assert other.move is None and condition(other, "RolledOut").reason == "Waiting"
    assert "one rollout per model" in condition(other, "RolledOut").message


def test_the_alias_serving_the_specs_version_says_so_and_names_a_rollout_running_away_from_it() -> None:
    running = RunningRollout(id="r7", alias="prod", candidate=2, baseline=1, describe="canary 2 vs 1 at 10%")
    result = reconcile(model({"model": "churn:1"}), RegistryView(versions=(1, 2), alias_version=1, rollout=running),
                       SETTINGS)
    rolled = condition(result, "RolledOut")
    assert result.move is None and (rolled.status, rolled.reason) == ("True", "Serving")
    assert rolled.message == ("churn@prod points at churn:1; rollout r7 of churn:2 runs on it (canary 2 vs 1 at 10%); "
                              "if the routers promote it, churn:1 (spec.model) is rolled out again")
    assert result.rollout == running and result.serving == "churn:1"
    alone = condition(reconcile(model({"model": "churn:1"}), SERVING_1, SETTINGS), "RolledOut")
    assert alone.message == "churn@prod points at churn:1"


def test_a_second_shardline_model_naming_another_version_of_the_alias_is_refused_the_oldest_keeps_it() -> None:
    older = model({"model": "churn:2"}, name="churn", created="2026-01-01T00:00:00Z")
    younger = model({"model": "churn:1"}, name="churn-b", namespace="other", created="2026-01-02T00:00:00Z")
    claims = [c for c in (claim(older), claim(younger)) if c is not None]
    assert contested(older, claims) is None
    assert contested(younger, claims) == (
        "ShardlineModel other/churn-b is refused: churn@prod is claimed by the older ShardlineModel serving/churn, "
        "which names churn:2 (this one names churn:1; two would roll the alias back and forth); name churn:2 or "
        "churn@prod, route another alias (spec.alias), or change or delete serving/churn")
    # the same instant: namespace, then name decide, the same way for both
    tied = model({"model": "churn:1"}, name="a-churn", created="2026-01-01T00:00:00Z")
    tied_claims = claims + [claim(tied)]  # type: ignore[list-item]
    assert contested(tied, tied_claims) is None and contested(older, tied_claims) is not None
    # the same version (one model on two hardware classes), an alias reference, another alias: no conflict
    same = model({"model": "churn:2", "hardwareClass": "gpu"}, name="churn-gpu", created="2026-02-01T00:00:00Z")
    follows = model({"model": "churn@prod"}, name="churn-f", created="2026-02-01T00:00:00Z")
    staging = model({"model": "churn:1", "alias": "staging"}, name="churn-s", created="2026-02-01T00:00:00Z")
    assert [contested(m, claims) for m in (same, follows, staging)] == [None, None, None]
    # the older one gone: the younger one moves the alias
    assert contested(younger, [c for c in claims if c.name != "churn"]) is None


def test_a_version_the_routers_rolled_back_is_not_tried_again() -> None:
    view = RegistryView(versions=(1, 2), alias_version=1, rolled_back=(2,))
    result = reconcile(model({"model": "churn:2"}), view, SETTINGS)
    assert result.move is None
    rolled = condition(result, "RolledOut")
    assert (rolled.status, rolled.reason) == ("False", "RolledBack") and "another version" in rolled.message


def test_a_version_not_in_the_registry_moves_nothing_and_says_so() -> None:
    result = reconcile(model({"model": "churn:7"}), SERVING_1, SETTINGS)
    assert result.move is None
    found = condition(result, "ModelFound")
    assert found.status == "False" and "churn:7" in found.message and "versions: 1, 2" in found.message
    # the replicas keep serving what the alias points at
    assert result.serving == "churn:1" and owned(result, "Deployment")


def test_an_alias_reference_follows_the_alias_and_never_moves_it() -> None:
    result = reconcile(model({"model": "churn@canary"}), RegistryView(versions=(1, 2), alias_version=2), SETTINGS)
    assert result.move is None and condition(result, "RolledOut").reason == "FollowsAlias"
    assert result.serving == "churn:2"
    assert condition(result, "ModelFound").status == "True"
    unset = reconcile(model({"model": "churn@canary"}), RegistryView(versions=(1,)), SETTINGS)
    assert unset.move is None and condition(unset, "RolledOut").reason == "AliasUnset"
    # an alias that points nowhere is not "in the registry"
    found = condition(unset, "ModelFound")
    assert (found.status, found.reason) == ("False", "AliasUnset")
    assert found.message == ("churn@canary: the alias is not set (versions: 1); set it (`shardline model alias churn "
                             "canary VERSION`) or name a version in spec.model")
    nothing = condition(reconcile(model({"model": "churn@canary"}), RegistryView(), SETTINGS), "ModelFound")
    assert (nothing.status, nothing.reason) == ("False", "NotInRegistry")


# status conditions


@pytest.mark.parametrize(("ready", "minimum", "status", "reason"), [
    (None, 1, "Unknown", "Applied"), (0, 1, "False", "ReplicasStarting"), (2, 2, "True", "ReplicasReady"),
    (0, 0, "True", "ReplicasReady"),
])
def test_ready_compares_the_ready_replicas_with_the_minimum(ready: int | None, minimum: int, status: str,
                                                            reason: str) -> None:
    result = reconcile(model({"model": "churn:1", "minReplicas": minimum}), SERVING_1, SETTINGS, ready_replicas=ready)
    assert (condition(result, "Ready").status, condition(result, "Ready").reason) == (status, reason)
    assert condition(result, "Valid").status == "True"


def test_a_conditions_transition_time_is_kept_while_its_status_stays() -> None:
    first = datetime(2026, 12, 5, 10, 0, tzinfo=timezone.utc)
    before = conditions_at((Condition(type="Ready", status="False", reason="ReplicasStarting", message="0 of 1"),),
                           None, first, 1)
    assert before[0]["lastTransitionTime"] == "2026-12-05T10:00:00Z" and before[0]["observedGeneration"] == 1
    still = conditions_at((Condition(type="Ready", status="False", reason="ReplicasStarting", message="0 of 2"),),
                          before, first + timedelta(minutes=1), 2)
    assert still[0]["lastTransitionTime"] == "2026-12-05T10:00:00Z" and still[0]["message"] == "0 of 2"
    flipped = conditions_at((Condition(type="Ready", status="True", reason="ReplicasReady", message="2 ready"),),
                            still, first + timedelta(minutes=2), 2)
    assert flipped[0]["lastTransitionTime"] == "2026-12-05T10:02:00Z"


# the operator's own checks of a spec


@pytest.mark.parametrize(("spec", "field"), [
    ({"model": "churn:1", "minReplicas": 5, "maxReplicas": 2}, "spec.maxReplicas"),
    ({"model": "churn:1", "hardwareClass": "tpu"}, "spec.hardwareClass"),
    ({"model": "churn:1", "sloClass": "fast"}, "spec.sloClass"),
    ({"model": "churn:1", "replicas": 3}, "spec.replicas"),
    ({"model": "Churn!"}, "spec.model"),
    ({"model": "churn:1", "rolloutPolicy": {"steps": [50, 10]}}, "spec.rolloutPolicy.steps"),
    ({"model": "churn:1", "rolloutPolicy": {"interval": "soon"}}, "spec.rolloutPolicy.interval"),
    ({"model": "churn:1", "resources": {"memory": "lots"}}, "spec.resources.memory"),
    ({"model": "churn@prod", "alias": "live"}, "spec.alias"),
    ({}, "spec.model"),
])
def test_a_bad_spec_is_refused_in_one_line_naming_the_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSetting) as refused:
        model(spec, name="broken")
    message = str(refused.value)
    assert field in message and "serving/broken" in message and "\n" not in message


@pytest.mark.parametrize("name", ["9churn", "churn.v2", "churn-", "c" * 64])
def test_a_name_no_service_may_have_is_refused_before_anything_is_applied(name: str) -> None:
    """A ShardlineModel may be named as any custom resource (a DNS-1123 subdomain), but its Service may not: a real
    API server would refuse that Service at every reconcile."""
    with pytest.raises(InvalidSetting, match=rf"ShardlineModel serving/{name} is refused: metadata.name: '{name}' "
                                             r"cannot name the Service made for it \(a DNS-1035 label"):
        model({"model": "churn:1"}, name=name)
    assert model({"model": "churn:1"}, name="churn-v2").name == "churn-v2"


# applying: create, then patch only what the operator set


def test_apply_creates_then_patches_what_changed_and_removes_what_it_no_longer_sets() -> None:
    gpu = owned(reconcile(model({"model": "churn:1", "hardwareClass": "gpu"}), SERVING_1, SETTINGS), "Deployment")
    action, body = plan(gpu, None)
    assert action == "create" and body["spec"]["replicas"] == 1 and LAST_APPLIED in body["metadata"]["annotations"]
    live = {**body, "status": {"readyReplicas": 1}}
    live["spec"] = {**body["spec"], "replicas": 4, "progressDeadlineSeconds": 600}  # the autoscaler's, the server's
    assert plan(gpu, live) == ("none", {})
    cpu = owned(reconcile(model({"model": "churn:1"}), SERVING_1, SETTINGS), "Deployment")
    action, patch = plan(cpu, live)
    assert action == "patch"
    pod = patch["spec"]["template"]["spec"]
    assert pod["tolerations"] is None and pod["nodeSelector"] is None  # no longer set: removed
    assert "replicas" not in patch["spec"] and "progressDeadlineSeconds" not in patch["spec"]
    assert patch["spec"]["template"]["spec"]["containers"][0]["image"] == SETTINGS.image
