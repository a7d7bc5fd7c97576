"""The packer (shardline.capacity.packing) on cases with known optima: memory never exceeded, near the bound."""

from __future__ import annotations

import pytest

from shardline.capacity.hardware import H100_MIG, CpuNodeType, GpuKind, Hardware
from shardline.capacity.packing import check_plan, pack
from shardline.capacity.problem import ModelDemand, Offer, PackingProblem


def _h100() -> Hardware:
    return Hardware(gpus=[GpuKind(name="h100", machine="cuda-nvidia-h100-80gb-hbm3", product="NVIDIA-H100-80GB-HBM3",
                                  memory_gb=80, price_per_hour=4.0, gpus_per_node=8, mig=H100_MIG)])


def test_seven_small_models_share_one_gpu_in_1g_slices() -> None:
    """Seven models that each need one 1g.10gb slice: the optimum is one GPU in seven slices (vs seven GPUs)."""
    models = [ModelDemand(name=f"m{i}", demand=10.0, memory_gb=6.0) for i in range(7)]
    offers = [Offer(model=m.name, hardware_class="h100-mig-1g.10gb", capacity=20.0, memory_gb=6.0) for m in models]
    offers += [Offer(model=m.name, hardware_class="h100", capacity=100.0, memory_gb=6.0) for m in models]
    problem = PackingProblem(hardware=_h100(), models=models, offers=offers)
    plan = pack(problem)
    assert check_plan(problem, plan) == []
    assert plan.gpu_count == 1
    assert plan.cost_per_hour == pytest.approx(4.0)
    assert plan.baseline.gpus == 7
    assert plan.cost_per_hour <= plan.lower_bound * 1.05 + 1e-9


def test_memory_is_never_exceeded_and_demand_is_met() -> None:
    """A model too big for any slice gets whole GPUs; the small ones fill slices; every check passes."""
    models = [ModelDemand(name="big", demand=150.0, memory_gb=60.0),
              ModelDemand(name="small", demand=50.0, memory_gb=15.0)]
    offers = [Offer(model="big", hardware_class="h100", capacity=100.0, memory_gb=60.0),
              Offer(model="small", hardware_class="h100-mig-1g.20gb", capacity=30.0, memory_gb=15.0),
              Offer(model="small", hardware_class="h100", capacity=200.0, memory_gb=15.0)]
    problem = PackingProblem(hardware=_h100(), models=models, offers=offers)
    plan = pack(problem)
    assert check_plan(problem, plan) == []
    assert plan.gpus["h100"] == 3
    served = {s.model: s for s in plan.served}
    assert served["big"].replicas == 2 and served["big"].capacity >= 150.0
    assert served["small"].capacity >= 50.0


def test_cpu_nodes_hold_replicas_within_cores_and_memory() -> None:
    """Five 2-core replicas on 8-core nodes: two nodes (4 + 1), never three."""
    hardware = Hardware(cpu_nodes=[CpuNodeType(name="cpu-8c", cores=8, memory_gb=32, price_per_hour=0.4)])
    models = [ModelDemand(name="m", demand=50.0, memory_gb=2.0)]
    offers = [Offer(model="m", hardware_class="cpu-8c", capacity=10.0, memory_gb=2.0, cores=2.0)]
    problem = PackingProblem(hardware=hardware, models=models, offers=offers)
    plan = pack(problem)
    assert check_plan(problem, plan) == []
    assert plan.cpu_nodes == {"cpu-8c": 2}
    assert plan.cost_per_hour == pytest.approx(0.8)
