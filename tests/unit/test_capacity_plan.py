"""`shardline plan capacity`: a demand file in, the plan beside its bound and one model per GPU out, and a
kustomize Component the production overlays take (rendered with `kubectl kustomize`, validated strictly)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from shardline.capacity.demand import build_problem, parse_demand
from shardline.capacity.hardware import default_hardware
from shardline.capacity.packing import check_plan, pack
from shardline.capacity.prices import PriceTable
from shardline.cli import app
from shardline.errors import InvalidSetting
from shardline.storage.registry import ModelRegistry
from tests.support.k8s import K8S, find, render, validate

PRICES = PriceTable.model_validate({"classes": {  # a GPU at 4.00/h, an 8-core node at 0.20/h
    "cpu": {"unit": "core", "on-demand": 0.025}, "h100": {"unit": "gpu", "on-demand": 4.0},
    "h200": {"unit": "gpu", "on-demand": 4.0}}})


def prices_file(where: Path) -> str:
    """``PRICES`` as a price table file, for ``--prices``."""
    path = where / "prices.yaml"
    path.write_text(yaml.safe_dump(PRICES.model_dump(by_alias=True)))
    return str(path)

# An LLM on whole H200s (tokens/s measured by a load generator), an online model measured on a 1g slice, a batch
# model measured on a whole GPU only (its slices estimated) and on CPU.
DEMAND = """
models:
  - {name: llm, demand: 3000, unit: tokens/s, memory_gb: 60,
     profiles: {cuda-nvidia-h200: {throughput: 1600}}}
  - name: churn
    demand: 400
    p99_ms: 30
    memory_gb: 6
    min_replicas: 2
    profiles:
      cuda-nvidia-h200-mig-1g.18gb:
        machine: cuda-nvidia-h200-mig-1g.18gb
        device: cuda
        batches: [{batch_size: 8, p99_ms: 2.0, rows_per_s: 500}, {batch_size: 64, p99_ms: 9.0, rows_per_s: 2000}]
  - {name: fraud, demand: 100, memory_gb: 10,
     profiles: {cuda-nvidia-h200: {throughput: 500}, cpu-x86_64-4c: {throughput: 60}}}
"""


def test_a_demand_file_packs_within_memory_meeting_every_demand() -> None:
    demand = parse_demand(DEMAND)
    hardware = default_hardware(PRICES)
    problem = build_problem(demand, hardware, {})
    plan = pack(problem)
    assert check_plan(problem, plan) == []
    served = {s.model: s for s in plan.served}
    assert served["llm"].capacity >= 3000 and served["churn"].replicas >= 2 and served["fraud"].capacity >= 100
    # churn within 30 ms on its 1g slice: batch 64 at 70% of 2,000 rows/s fills in 45 ms, batch 8 at 70% of 500
    # in 20 ms (+2 ms the call's p99)
    churn = next(g for g in plan.groups if g.model == "churn")
    assert churn.offer.batch_size == 8 and churn.offer.capacity == pytest.approx(350.0)
    assert plan.lower_bound <= plan.cost_per_hour <= plan.baseline.cost_per_hour


def test_plan_capacity_prints_the_plan_beside_bound_and_baseline_and_writes_it(tmp_path: Path) -> None:
    (tmp_path / "demand.yaml").write_text(DEMAND)
    result = CliRunner().invoke(app, ["plan", "capacity", "--demand", str(tmp_path / "demand.yaml"),
                                      "-o", str(tmp_path / "plan.yaml"), "--prices", prices_file(tmp_path)])
    assert result.exit_code == 0, result.output
    plan = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    ratio = plan["cost_per_hour"] / plan["lower_bound"]
    assert f"the plan costs {ratio:.3f}x the bound" in result.output
    assert f"one model per GPU: {plan['baseline']['cost_per_hour']:.2f}/h" in result.output
    assert {g["model"] for g in plan["groups"]} == {"llm", "churn", "fraud"}
    assert plan["gpus"]["h200"] <= plan["baseline"]["gpus"]


@pytest.mark.parametrize(("text", "message"), [
    ("models: []", "models: List should have at least 1 item"),
    ("models:\n  - {name: a, demand: 5}", "models.0.memory_gb: Field required"),
    ("models:\n  - {name: a, demand: 5, memory_gb: 1, replicas: 3}", "models.0.replicas: Extra inputs"),
    ("models: [", "is not YAML"),
    ("models:\n  - {name: a, demand: 5, memory_gb: 500, profiles: {cuda-nvidia-h200: {throughput: 9}}}",
     "no hardware class can serve a (needs 500 GB a replica, batch)"),
    ("models:\n  - {name: a, demand: 5, memory_gb: 1, profiles: {cuda-nvidia-h200: {throughput: 9}}}\n"
     "  - {name: a, demand: 6, memory_gb: 1, profiles: {cuda-nvidia-h200: {throughput: 9}}}",
     "models: models.1.name 'a' is models.0's name too; give each model its own name"),
    # a mistyped kind beside a right one would be ignored, the slice estimated from the whole GPU
    ("models:\n  - {name: s, demand: 400, p99_ms: 30, memory_gb: 6, profiles: {"
     "cuda-nvidia-h200: {batches: [{batch_size: 8, p99_ms: 2.0, rows_per_s: 5000}]}, "
     "cuda-nvidia-h200-mig-1g.18g: {batches: [{batch_size: 8, p99_ms: 2.0, rows_per_s: 500}]}}}",
     "models.0.profiles: 'cuda-nvidia-h200-mig-1g.18g' (s) is not a machine kind of the hardware catalogue; "
     "did you mean 'cuda-nvidia-h200-mig-1g.18gb'? machine kinds: "),
    ("models:\n  - {name: t, demand: 5, memory_gb: 1, profiles: {tpu-v5: {throughput: 100}}}",
     "'tpu-v5' (t) is not a machine kind of the hardware catalogue; machine kinds: "),
])
def test_a_wrong_demand_file_is_one_line_and_exit_2(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "demand.yaml").write_text(text)
    result = CliRunner().invoke(app, ["plan", "capacity", "--demand", str(tmp_path / "demand.yaml")])
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_yaml_errors_are_one_line_whichever_parser_read_them(tmp_path: Path) -> None:
    # PyYAML's and ruamel's own texts span several lines (the source and a caret): a price table's error was 7 lines
    from ruamel.yaml import YAML

    from shardline.capacity.prices import load_prices
    from shardline.errors import InvalidSetting, yaml_problem

    (tmp_path / "prices.yaml").write_text("prices: [1,2\n")
    with pytest.raises(InvalidSetting) as refused:
        load_prices(tmp_path / "prices.yaml")
    assert "is not YAML (expected ',' or ']', but got '<stream end>' at line 2, column 1); see " in str(refused.value)
    assert "\n" not in str(refused.value)
    with pytest.raises(Exception) as ruamel:
        YAML().load("tenants: [a,\n")
    assert "\n" not in yaml_problem(ruamel.value) and " at line " in yaml_problem(ruamel.value)


def test_a_missing_demand_file_says_so() -> None:
    result = CliRunner().invoke(app, ["plan", "capacity", "--demand", "/nonexistent/demand.yaml"])
    assert result.exit_code == 2 and "cannot read the demand file '/nonexistent/demand.yaml'" in result.output


def _overlay_with(component: Path, where: Path, autoscaler: str = "keda") -> Path:
    """A production overlay that also takes the written component (paths relative, as kustomize wants)."""
    where.mkdir()
    relative = lambda p: os.path.relpath(p, where)  # noqa: E731
    (where / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [relative(K8S / "base")],
        "components": [relative(K8S / "components/production"), relative(K8S / f"components/{autoscaler}"),
                       relative(component)],
    }))
    return where


def _serve(objects: tuple[dict[str, Any], ...], group: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A replica group's Deployment and its serve container's resources."""
    [deployment] = find(objects, "Deployment", f"shardline-replicas-{group}")
    [serve] = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "serve"]
    return deployment, serve["resources"]


def test_the_kustomize_component_renders_in_the_production_overlay_and_validates(tmp_path: Path) -> None:
    (tmp_path / "demand.yaml").write_text(DEMAND)
    result = CliRunner().invoke(app, ["plan", "capacity", "--demand", str(tmp_path / "demand.yaml"),
                                      "-o", str(tmp_path / "plan.yaml"), "--kustomize", str(tmp_path / "plan"),
                                      "--prices", prices_file(tmp_path)])
    assert result.exit_code == 0, result.output
    plan = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    objects = render(_overlay_with(tmp_path / "plan", tmp_path / "overlay"))
    replicas = {c: sum(g["replicas"] for g in plan["groups"] if g["hardware_class"] == c)
                for c in ("h200", "h200-mig-1g.18gb", "h200-mig-3g.71gb", "cpu-8c")}
    production = render(K8S / "overlays/production")
    for group, hardware_class, device in [("gpu", "h200", "nvidia.com/gpu"),
                                          ("mig-1g", "h200-mig-1g.18gb", "nvidia.com/mig-1g.18gb"),
                                          ("mig-3g", "h200-mig-3g.71gb", "nvidia.com/mig-3g.71gb"),
                                          ("cpu", "cpu-8c", None)]:
        deployment, resources = _serve(objects, group)
        before, base_resources = _serve(production, group)
        # a group the plan does not use keeps the overlay's count (never 0: an HPA would stop scaling it)
        assert deployment["spec"]["replicas"] == (replicas[hardware_class] or before["spec"]["replicas"]) >= 1
        gpu_keys = {k for k in resources["requests"] if k.startswith("nvidia.com/")}
        assert gpu_keys == ({device} if device else set()), resources
        if device:  # host CPU and memory beside a GPU are the overlay's, not the model's device memory
            for side in ("requests", "limits"):
                assert {k: v for k, v in resources[side].items() if not k.startswith("nvidia.com/")} == {
                    k: v for k, v in base_resources[side].items() if not k.startswith("nvidia.com/")}
    [mig] = find(objects, "Deployment", "shardline-replicas-mig-1g")
    assert mig["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200",
                                                               "nvidia.com/mig.strategy": "mixed"}
    for obj in objects:
        try:
            validate(obj, "1.32.0")
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{obj['kind']}/{obj['metadata']['name']}: {e}") from None


def test_with_hpas_no_group_is_left_at_zero_and_gpu_groups_keep_their_host_memory(tmp_path: Path) -> None:
    """An LLM on whole H200s (60 GB of device memory) and a model on 1g slices, over production-hpa: the groups
    the plan does not use (cpu, mig-3g) keep a replica for their HPA; the GPU groups keep the host side."""
    (tmp_path / "demand.yaml").write_text("""
models:
  - {name: small, demand: 400, p99_ms: 30, min_replicas: 1, memory_gb: 6,
     profiles: {cuda-nvidia-h200-mig-1g.18gb: {batches: [{batch_size: 8, p99_ms: 2.0, rows_per_s: 500}]}}}
  - {name: llm, demand: 3000, unit: tokens/s, memory_gb: 60, profiles: {cuda-nvidia-h200: {throughput: 1600}}}
""")
    result = CliRunner().invoke(app, ["plan", "capacity", "--demand", str(tmp_path / "demand.yaml"),
                                      "--kustomize", str(tmp_path / "plan"), "--prices", prices_file(tmp_path)])
    assert result.exit_code == 0, result.output
    objects = render(_overlay_with(tmp_path / "plan", tmp_path / "overlay", autoscaler="hpa"))
    for group in ("cpu", "mig-3g"):
        deployment, _ = _serve(objects, group)
        [hpa] = find(objects, "HorizontalPodAutoscaler", f"shardline-replicas-{group}")
        assert deployment["spec"]["replicas"] >= hpa["spec"]["minReplicas"] >= 1
    gpu, gpu_resources = _serve(objects, "gpu")
    assert gpu["spec"]["replicas"] == 2
    assert gpu_resources == {"requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": 1},
                             "limits": {"memory": "64Gi", "nvidia.com/gpu": 1}}
    _, mig_resources = _serve(objects, "mig-1g")
    assert mig_resources == {"requests": {"cpu": "2", "memory": "12Gi", "nvidia.com/mig-1g.18gb": 1},
                             "limits": {"memory": "12Gi", "nvidia.com/mig-1g.18gb": 1}}


def test_a_class_without_a_replica_group_is_refused_with_what_to_do() -> None:
    from shardline.capacity.kustomize import component_files

    demand = parse_demand(DEMAND)
    hardware = default_hardware(PRICES)
    plan = pack(build_problem(demand, hardware, {}))
    with pytest.raises(InvalidSetting, match="no replica group"):
        component_files(plan, hardware, {})


def test_a_model_named_by_reference_is_planned_from_the_profiles_its_version_stored(
    local_registry: ModelRegistry, tmp_path: Path,
) -> None:
    """`model: breast-cancer@prod` reads what `shardline model profile` stored for that version."""
    local_registry.put_profile("breast-cancer", 1, "cuda-nvidia-h200-mig-1g.18gb", {
        "machine": "cuda-nvidia-h200-mig-1g.18gb", "device": "cuda",
        "batches": [{"batch_size": 1, "p99_ms": 1.0, "rows_per_s": 1000.0}]})
    (tmp_path / "demand.yaml").write_text(
        "models:\n  - {name: bc, model: breast-cancer@prod, demand: 1400, p99_ms: 10, memory_gb: 2}\n")
    result = CliRunner().invoke(app, ["plan", "capacity", "--demand", str(tmp_path / "demand.yaml"),
                                      "-o", str(tmp_path / "plan.yaml")])
    assert result.exit_code == 0, result.output
    [group] = yaml.safe_load((tmp_path / "plan.yaml").read_text())["groups"]
    # 70% of the measured 1,000 rows/s a slice: two slices for 1,400 rows/s, measured on that slice
    assert group["hardware_class"] == "h200-mig-1g.18gb" and group["replicas"] == 2
    assert group["offer"]["measured_on"] == "cuda-nvidia-h200-mig-1g.18gb" and not group["offer"]["estimated"]


def test_a_wrong_hardware_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "demand.yaml").write_text(DEMAND)
    (tmp_path / "hardware.yaml").write_text("gpus:\n  - {name: h100, memory_gb: 80, price_per_hour: 4}\n")
    result = CliRunner().invoke(app, ["plan", "capacity", "--demand", str(tmp_path / "demand.yaml"),
                                      "--hardware", str(tmp_path / "hardware.yaml")])
    assert result.exit_code == 2 and "hardware.yaml: gpus.0.machine: Field required" in result.output
    assert len(result.output.strip().splitlines()) == 1
