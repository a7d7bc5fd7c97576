"""The placement decision: a table of workloads against one set of measured candidates.

The candidates are shaped like an embedding model's profiles: on CPU a call grows
with the batch and throughput tops out early; a GPU pays a fixed cost per call and
then scales far. Prices per device-hour: 8-core CPU machine 0.40, H200 4.00, its
1g MIG slice 0.60.
"""

from __future__ import annotations

from typing import Any

import pytest

from shardline.capacity.prices import ClassPrice, PriceTable
from shardline.errors import InvalidSetting
from shardline.placement import (
    BatchWorkload,
    Candidate,
    DeviceKind,
    NoPlacement,
    OnlineWorkload,
    PlacementPolicy,
    Workload,
    candidates_from_profiles,
    choose_placement,
)

CPU, GPU, MIG = "cpu-x86_64-8c", "cuda-nvidia-h200", "cuda-nvidia-h200-mig-1g.18gb"


def cand(machine: str, variant: str, batch: int, p99_ms: float, rows_per_s: float) -> Candidate:
    device: DeviceKind = "cpu" if machine == CPU else ("mig" if machine == MIG else "cuda")
    cost = {CPU: 0.40, GPU: 4.00, MIG: 0.60}[machine]
    return Candidate(machine=machine, device=device, variant=variant, batch_size=batch, p99_ms=p99_ms,
                     rows_per_s=rows_per_s, cost_per_hour=cost)


CANDIDATES = [
    cand(CPU, "fp32", 1, 6.0, 200),
    cand(CPU, "int8", 1, 3.0, 400),
    cand(CPU, "fp32", 32, 90.0, 450),
    cand(CPU, "int8", 32, 45.0, 900),
    cand(GPU, "fp16", 1, 1.5, 900),
    cand(GPU, "fp16", 64, 3.0, 30_000),
    cand(GPU, "fp16", 512, 12.0, 60_000),
    cand(MIG, "fp16", 1, 2.0, 600),
    cand(MIG, "fp16", 64, 8.0, 8_400),
]
WHOLE_GPUS_ONLY = [c for c in CANDIDATES if c.device != "mig"]

# workload, candidates, policy, expected (machine, variant, batch, replicas, gpu_share, mode)
CASES = [
    pytest.param(OnlineWorkload(p99_ms=50, rps=100), CANDIDATES, None, (CPU, "int8", 1, 1, None, "dedicated"),
                 id="online-low-rate-loose-target-cpu-int8"),
    pytest.param(OnlineWorkload(p99_ms=50, rps=1_000), CANDIDATES, None, (CPU, "int8", 1, 4, None, "dedicated"),
                 id="online-cpu-scales-out-while-it-is-cheapest"),
    pytest.param(OnlineWorkload(p99_ms=50, rps=300), CANDIDATES, None, (MIG, "fp16", 1, 1, None, "mig-slice"),
                 id="online-cpu-over-the-premium-loses-to-a-mig-slice"),
    pytest.param(OnlineWorkload(p99_ms=50, rps=300), CANDIDATES, PlacementPolicy(cpu_premium=1.5),
                 (CPU, "int8", 1, 2, None, "dedicated"), id="online-cpu-within-the-premium-wins"),
    pytest.param(OnlineWorkload(p99_ms=2.5, rps=100), CANDIDATES, None, (MIG, "fp16", 1, 1, None, "mig-slice"),
                 id="online-tight-target-fraction-of-a-gpu-takes-a-mig-slice"),
    pytest.param(OnlineWorkload(p99_ms=2.5, rps=100), WHOLE_GPUS_ONLY, None, (GPU, "fp16", 1, 1, 0.25, "shared-gpu"),
                 id="online-tight-target-no-mig-shares-a-gpu"),
    pytest.param(OnlineWorkload(p99_ms=2.0, rps=100), WHOLE_GPUS_ONLY, None, (GPU, "fp16", 1, 1, None, "dedicated"),
                 id="online-sharing-too-slow-for-the-target-dedicated-gpu"),
    pytest.param(OnlineWorkload(p99_ms=30, rps=4_000), WHOLE_GPUS_ONLY, None, (GPU, "fp16", 64, 1, 0.25, "shared-gpu"),
                 id="online-quarter-of-a-gpu-beats-15-cpu-machines"),
    pytest.param(OnlineWorkload(p99_ms=30, rps=4_000), CANDIDATES, None, (MIG, "fp16", 64, 1, None, "mig-slice"),
                 id="online-mig-slice-cheaper-than-a-share"),
    pytest.param(OnlineWorkload(p99_ms=10, rps=40_000), CANDIDATES, None, (GPU, "fp16", 64, 2, None, "dedicated"),
                 id="online-high-rate-tight-target-whole-gpus"),
    pytest.param(OnlineWorkload(p99_ms=20, rps=40_000), CANDIDATES, None, (MIG, "fp16", 64, 7, None, "mig-slice"),
                 id="online-high-rate-loose-target-seven-slices-cheaper-than-two-gpus"),
    pytest.param(BatchWorkload(rows=10_000_000, deadline_s=3_600), CANDIDATES, None,
                 (GPU, "fp16", 512, 1, 0.25, "shared-gpu"), id="batch-best-rows-per-cost-on-a-gpu-share"),
    pytest.param(BatchWorkload(rows_per_s=150_000), CANDIDATES, None, (GPU, "fp16", 512, 3, None, "dedicated"),
                 id="batch-high-rate-whole-gpus"),
    pytest.param(BatchWorkload(rows_per_s=10_000), CANDIDATES, PlacementPolicy(allow_gpu_sharing=False),
                 (GPU, "fp16", 512, 1, None, "dedicated"), id="batch-no-sharing-a-whole-gpu"),
    pytest.param(BatchWorkload(rows_per_s=500), [c for c in CANDIDATES if c.device == "cpu"], None,
                 (CPU, "int8", 32, 1, None, "dedicated"), id="batch-cpu-only-int8-best-per-cost"),
]


@pytest.mark.parametrize("workload, candidates, policy, expected", CASES)
def test_placement_choices(
    workload: Workload, candidates: list[Candidate], policy: PlacementPolicy | None,
    expected: tuple[str, str, int, int, float | None, str],
) -> None:
    placement = choose_placement(workload, candidates, policy)

    c = placement.candidate
    assert (c.machine, c.variant, c.batch_size, placement.replicas, placement.gpu_share, placement.mode) == expected
    assert placement.reason.startswith(c.label)
    if isinstance(workload, OnlineWorkload):
        assert placement.expected_p99_ms is not None and placement.expected_p99_ms <= workload.p99_ms
        assert placement.capacity_rows_per_s >= workload.rows_per_s
    else:
        assert placement.capacity_rows_per_s >= workload.required_rows_per_s


def test_online_fill_time_counts_against_large_batches() -> None:
    gpu = [c for c in CANDIDATES if c.machine == GPU]
    # at 1,000 requests/s a batch of 64 takes 63 ms to fill: out for 20 ms, so two GPUs at batch 1
    tight = choose_placement(OnlineWorkload(p99_ms=20, rps=1_000), gpu)
    assert (tight.candidate.batch_size, tight.replicas, tight.expected_p99_ms) == (1, 2, 1.5)
    # with 100 ms to spare, batch 64 on a quarter of a GPU: 63 ms to fill + 3 ms x 1.5 for sharing
    loose = choose_placement(OnlineWorkload(p99_ms=100, rps=1_000), gpu)
    assert (loose.candidate.batch_size, loose.gpu_share) == (64, 0.25)
    assert loose.expected_p99_ms == pytest.approx(63 + 4.5)


def test_nothing_meets_the_target_says_the_best_found() -> None:
    with pytest.raises(NoPlacement) as caught:
        choose_placement(OnlineWorkload(p99_ms=1, rps=100), CANDIDATES)

    message = str(caught.value)
    assert message.startswith("no candidate meets p99 <= 1 ms at 100 requests/s: the best found is "
                              "cuda-nvidia-h200 fp16 batch 1 with 1 replica(s), estimated p99 1.50 ms")
    assert "relax the target" in message
    assert caught.value.best is not None and caught.value.best.candidate.machine == GPU


def test_too_many_replicas_is_refused_with_the_closest() -> None:
    with pytest.raises(NoPlacement, match="no candidate sustains 1,000,000 rows/s within 4 replicas: the best, "
                                          "cuda-nvidia-h200 fp16 batch 512 .* needs 17"):
        choose_placement(BatchWorkload(rows_per_s=1_000_000), CANDIDATES, PlacementPolicy(max_replicas=4))
    small_cpu_batches = [c for c in CANDIDATES if c.device == "cpu" and c.batch_size == 1]
    with pytest.raises(NoPlacement, match="within 2 replicas: the best, cpu-x86_64-8c int8 batch 1, needs 4"):
        choose_placement(OnlineWorkload(p99_ms=50, rps=1_000), small_cpu_batches, PlacementPolicy(max_replicas=2))


def test_no_candidates_says_how_to_get_some() -> None:
    with pytest.raises(NoPlacement, match="no measured candidates .*shardline model profile"):
        choose_placement(OnlineWorkload(p99_ms=10, rps=1), [])


def test_batch_workload_needs_rows_and_deadline_together() -> None:
    with pytest.raises(ValueError, match="give rows and deadline_s together"):
        BatchWorkload(rows=1_000)
    assert BatchWorkload(rows=7_200, deadline_s=3_600, rows_per_s=1).required_rows_per_s == 2


def test_candidates_from_stored_profiles_are_priced_by_machine_kind() -> None:
    profiles: dict[str, dict[str, Any]] = {
        "cpu-x86_64-8c": {"machine": CPU, "device": "cpu", "variant": None,
                          "batches": [{"batch_size": 1, "p99_ms": 6.0, "rows_per_s": 200.0}]},
        "cuda-nvidia-h200-mig-1g.18gb.fp16": {"machine": MIG, "device": "cuda", "variant": "fp16",
                                               "batches": [{"batch_size": 64, "p99_ms": 8.0, "rows_per_s": 8.4e3}]},
    }
    prices = PriceTable(classes={"cpu": ClassPrice(unit="core", on_demand=0.05, spot=0.02),
                                 "h100": ClassPrice(unit="gpu", on_demand=7.0),
                                 "h200": ClassPrice(unit="gpu", on_demand=4.2, spot=2.1)})

    found = candidates_from_profiles(profiles, prices.per_machine_hour)

    # the one price table: 8 cores at the core-hour; a 1g slice at 1/7 of its H200's GPU-hour
    assert [(c.machine, c.device, c.variant, c.batch_size, c.cost_per_hour) for c in found] == [
        (CPU, "cpu", "fp32", 1, pytest.approx(0.4)), (MIG, "mig", "fp16", 64, pytest.approx(0.6)),
    ]
    assert prices.per_machine_hour(GPU) == 4.2 and prices.per_machine_hour(GPU, "spot") == 2.1
    assert prices.per_machine_hour("cuda-nvidia-h100-80gb-hbm3") == 7.0  # the GPU's name holds its class
    assert prices.per_machine_hour(CPU, "spot") == pytest.approx(0.16)
    with pytest.raises(InvalidSetting, match="no price for machine kind 'cuda-nvidia-a100'.*add that class"):
        prices.per_machine_hour("cuda-nvidia-a100")
