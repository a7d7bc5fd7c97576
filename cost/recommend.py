"""Recommendations from a month's allocation: where the same work could have cost less (pure; no I/O).

Three kinds, each with the saving the month's own figures give (never a guess at speeds the ledger did not see):

- ``idle``: a tier's hardware class was idle for more than half of what it cost (over-provisioned replicas, a
  scale-to-zero floor kept up, whole GPUs where MIG slices would do): the idle cost is the most fewer or smaller
  replicas save. Only when that idle cost is at least ``min_share`` of the month's priced capacity.
- ``hardware``: a model ran on two hardware classes (CPU and a GPU, say) and 1,000 rows cost less on one: its rows
  on the dearer class priced at the cheaper class's cost per 1,000 rows.
- ``spot``: batch work bought on demand where the price table has a spot price: the same device-hours on spot
  (whether the deadlines would hold is `shardline cost simulate`'s question).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

from shardline.capacity.prices import PriceTable
from shardline.cost.allocation import IDLE, Allocation
from shardline.figures import amount, money

Kind = Literal["idle", "hardware", "spot"]


@dataclass(frozen=True)
class Recommendation:
    """One way the month's work could have cost less, and by how much (in the price table's currency)."""

    kind: Kind
    saving: float
    text: str


def recommend(allocation: Allocation, prices: PriceTable, min_share: float = 0.01,
              min_saving_fraction: float = 0.2) -> list[Recommendation]:
    """The recommendations for a month's ``allocation``, largest saving first (see the module docstring)."""
    c = allocation.currency
    found: list[Recommendation] = []
    held: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])  # -> [cost, idle]
    by_model: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
    batch_on_demand: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # class -> [cost, device-seconds]
    for charge in allocation.charges:
        key = (charge.tier, charge.hardware_class, charge.capacity_type)
        held[key][0] += charge.spend.cost
        if charge.tenant == IDLE:
            held[key][1] += charge.spend.cost
            continue
        if charge.spend.rows:
            figures = by_model[(charge.model, charge.tier)][charge.hardware_class]
            figures[0] += charge.spend.cost
            figures[1] += charge.spend.rows
        if charge.tier == "batch" and charge.capacity_type == "on-demand":
            batch_on_demand[charge.hardware_class][0] += charge.spend.cost
            batch_on_demand[charge.hardware_class][1] += charge.spend.device_seconds
    for (tier, hardware, capacity), (cost, idle) in held.items():
        if cost > 0 and idle > 0.5 * cost and idle >= min_share * allocation.priced_capacity:
            found.append(Recommendation("idle", idle, (
                f"{tier} {hardware} ({capacity}) was idle for {idle / cost:.0%} of its {money(cost, c)}: fewer "
                f"replicas, a lower floor, or MIG slices (`shardline plan capacity`) save up to {money(idle, c)}")))
    for (model, tier), classes in by_model.items():
        if len(classes) < 2:
            continue
        per_1k = {hw: cost / rows * 1_000 for hw, (cost, rows) in classes.items()}
        cheapest = min(per_1k, key=lambda hw: per_1k[hw])
        for hw, (cost, rows) in classes.items():
            saving = cost - per_1k[cheapest] * rows / 1_000
            if hw != cheapest and saving > min_saving_fraction * cost:
                found.append(Recommendation("hardware", saving, (
                    f"{model} ({tier}): 1,000 rows cost {money(per_1k[hw], c)} on {hw} and "
                    f"{money(per_1k[cheapest], c)} on {cheapest}: its {rows:,.0f} rows on {cheapest} would have "
                    f"saved {money(saving, c)}")))
    for hw, (cost, seconds) in batch_on_demand.items():
        spot = prices.per_unit_hour(hw, "spot")  # the on-demand price where the table has no spot price: no saving
        saving = cost - spot * seconds / 3600
        if saving > min_saving_fraction * cost:
            found.append(Recommendation("spot", saving, (
                f"batch on {hw} was bought on demand for {money(cost, c)}; its {amount(seconds / 3600)} device-hours "
                f"on spot would cost {money(cost - saving, c)} (`shardline cost simulate JOB_ID` says whether the "
                "deadlines hold under preemption)")))
    return sorted(found, key=lambda r: -r.saving)

