"""The packer (shardline.capacity.packing) on cases with known optima: memory never exceeded, near the bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_mixed_workload_uses_at_least_30_percent_fewer_gpus_than_one_model_per_gpu() -> None:
    """The stated mixed workload: two large models (whole GPUs), four mid-size (3g.40gb) and eight small
    (1g.10gb) ones. One model per GPU takes 2 * 2 + 4 + 8 = 16 GPUs; packed, packed, at most 70% of that
    (the optimum is 7)."""
    models, offers = [], []
    for i in range(2):
        models.append(ModelDemand(name=f"large{i}", demand=180.0, memory_gb=60.0))
        offers.append(Offer(model=f"large{i}", hardware_class="h100", capacity=100.0, memory_gb=60.0))
    for i in range(4):
        models.append(ModelDemand(name=f"mid{i}", demand=40.0, memory_gb=30.0))
        offers.append(Offer(model=f"mid{i}", hardware_class="h100-mig-3g.40gb", capacity=45.0, memory_gb=30.0))
        offers.append(Offer(model=f"mid{i}", hardware_class="h100", capacity=100.0, memory_gb=30.0))
    for i in range(8):
        models.append(ModelDemand(name=f"small{i}", demand=10.0, memory_gb=5.0))
        offers.append(Offer(model=f"small{i}", hardware_class="h100-mig-1g.10gb", capacity=12.0, memory_gb=5.0))
        offers.append(Offer(model=f"small{i}", hardware_class="h100", capacity=80.0, memory_gb=5.0))
    problem = PackingProblem(hardware=_h100(), models=models, offers=offers)
    plan = pack(problem)
    assert check_plan(problem, plan) == []
    assert plan.baseline.gpus == 16
    assert plan.gpu_count <= 0.7 * plan.baseline.gpus
    # the proven optimum is 7 GPUs (56% fewer); the LP bound (26.4/h, 6.6 GPUs) is under a whole GPU below it
    assert plan.status == "optimal" and plan.gpu_count == 7
    assert plan.lower_bound <= plan.cost_per_hour < plan.lower_bound + 4.0


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([5.0, 9.0, 15.0, 30.0, 60.0]), st.integers(1, 4)), min_size=1, max_size=6))
def test_generated_plans_fit_in_memory_and_sit_near_the_bound(specs: list[tuple[float, int]]) -> None:
    """Any mix of model sizes and demands: no slot, GPU or node over its memory; every demand met; the cost at or
    above the LP bound and within 5% of the bound HiGHS proved for the integer program. (Not within 5% of the LP
    bound, even rounded up to whole GPUs: MIG's geometry can cost a whole GPU more, see the next test.)"""
    hw = _h100()
    kind = hw.gpus[0]
    models, offers = [], []
    for i, (memory, demand) in enumerate(specs):
        models.append(ModelDemand(name=f"m{i}", demand=float(demand), memory_gb=memory))
        for slot in kind.slots:
            if kind.slot_memory_gb(slot) >= memory:
                offers.append(Offer(model=f"m{i}", hardware_class=kind.class_name(slot),
                                    capacity=float(kind.slot_compute(slot)), memory_gb=memory))
    problem = PackingProblem(hardware=hw, models=models, offers=offers)
    plan = pack(problem)
    assert check_plan(problem, plan) == []
    assert plan.cost_per_hour >= plan.lower_bound - 1e-6
    assert plan.status == "optimal"
    assert plan.lower_bound - 1e-6 <= plan.solver_bound <= plan.cost_per_hour <= plan.solver_bound * 1.05 + 1e-6


def test_mig_geometry_can_cost_a_gpu_over_the_lp_bound() -> None:
    """Three 15 GB models wanting 3, 3 and 1 compute slices: 7 of a GPU's 7 slices, so the LP bound is one GPU, but
    a 15 GB model needs a 20 GB slot (1g.20gb, at most 4 a GPU; 2g.20gb; 3g.40gb) and no GPU holds slots for all
    three: the proven optimum is two GPUs (hypothesis found the case; docs/cost.md states the gap)."""
    hw = _h100()
    kind = hw.gpus[0]
    models, offers = [], []
    for i, demand in enumerate((3, 3, 1)):
        models.append(ModelDemand(name=f"m{i}", demand=float(demand), memory_gb=15.0))
        offers += [Offer(model=f"m{i}", hardware_class=kind.class_name(slot), capacity=float(kind.slot_compute(slot)),
                         memory_gb=15.0) for slot in kind.slots if kind.slot_memory_gb(slot) >= 15.0]
    problem = PackingProblem(hardware=hw, models=models, offers=offers)
    plan = pack(problem)
    assert check_plan(problem, plan) == []
    assert plan.status == "optimal" and plan.gpu_count == 2
    assert plan.lower_bound == pytest.approx(kind.price_per_hour)  # one GPU
    assert plan.solver_bound == pytest.approx(plan.cost_per_hour)  # two, proven
