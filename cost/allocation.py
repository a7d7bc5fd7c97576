"""Allocation as OpenCost allocates a pod: what a replica or worker held, priced, then split by what was used.

For each writer of the ledger (a server process, a batch run) and each of its buckets (pure; no I/O):

- its cost is ``max(reserved, used)`` seconds times ``units`` times the class's price per unit-second, where
  ``reserved`` is the wall time it held its hardware (its capacity row) and ``used`` the device-seconds its usage
  rows measured, counted at most up to ``reserved`` when it held something (device-seconds beyond the wall time
  are concurrent work on one device: LLM streams, batches on several threads); a writer that held nothing of its
  own (a batch job on a shared cluster at an address) pays what it used;
- the used part is split across the tenants (their models, versions) by their device-seconds;
- the rest, ``reserved - used``, is an **idle** line of its own (tenant ``IDLE``), by tier, hardware class and
  capacity type. Policy: idle is carried by the platform, not spread onto the tenants; the report shows it beside
  the charges so that whoever runs the platform sees what over-provisioning costs (and can spread it, pro rata to
  the charges, by hand).

So the charges and idle lines add up to the priced capacity exactly (``Allocation.priced_capacity``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import Any, Iterable

from shardline.capacity.prices import PriceTable

IDLE = "(idle)"
COUNTS = ("requests", "rows", "prompt_tokens", "completion_tokens")


@dataclass
class Spend:
    """What some use cost, and the use: device-seconds, requests, rows, tokens."""

    cost: float = 0.0
    device_seconds: float = 0.0
    requests: int = 0
    rows: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def tokens(self) -> int:
        """Prompt and completion tokens."""
        return self.prompt_tokens + self.completion_tokens

    def add(self, other: "Spend") -> None:
        """Add another's cost and use to this one."""
        self.cost += other.cost
        self.device_seconds += other.device_seconds
        for name in COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class Charge:
    """One line of the chargeback: what a tenant's use of a model on a class of hardware cost on a day."""

    tenant: str
    model: str
    version: str
    tier: str
    hardware_class: str
    capacity_type: str
    day: date
    spend: Spend = field(default_factory=Spend)


@dataclass
class Allocation:
    """The charges (idle lines among them) of a set of ledger rows, and the capacity they priced."""

    charges: list[Charge] = field(default_factory=list)
    priced_capacity: float = 0.0
    currency: str = "USD"

    @property
    def idle(self) -> float:
        """The idle lines' cost."""
        return sum(c.spend.cost for c in self.charges if c.tenant == IDLE)


def _day(moment: Any) -> date:
    return moment.date() if isinstance(moment, datetime) else moment


def allocate(rows: Iterable[dict[str, Any]], prices: PriceTable) -> Allocation:
    """Price every writer's buckets and split them (see the module docstring); ``rows`` as the ledger holds them.

    Raises:
        InvalidSetting: a hardware class the price table does not price.
    """
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[(row["writer"], row["bucket_start"])].append(row)
    lines: dict[tuple[Any, ...], Charge] = {}
    priced = 0.0
    for (_, bucket), members in groups.items():
        capacity = [r for r in members if r["kind"] == "capacity"]
        usage = [r for r in members if r["kind"] == "usage"]
        held = capacity[0] if capacity else usage[0]
        units = float(held["units"]) if capacity else 1.0
        per_second = prices.per_unit_hour(held["hardware_class"], held["capacity_type"]) * units / 3600.0
        reserved = sum(float(r["reserved_seconds"]) for r in capacity)
        measured = sum(float(r["device_seconds"]) for r in usage)
        used = measured if reserved == 0 else min(measured, reserved)
        total = max(reserved, used) * per_second
        priced += total
        day = _day(bucket)
        for r in usage:
            share = used * per_second * float(r["device_seconds"]) / measured if measured > 0 else 0.0
            _line(lines, r["tenant"], r["model"], r["version"], held, day).spend.add(
                Spend(share, float(r["device_seconds"]), *(int(r[name]) for name in COUNTS)))
        if total - used * per_second > 0:
            _line(lines, IDLE, "", "", held, day).spend.cost += total - used * per_second
    return Allocation(sorted(lines.values(), key=lambda c: (c.day, c.tenant, c.model, c.version, c.tier)), priced,
                      prices.currency)


def _line(lines: dict[tuple[Any, ...], Charge], tenant: str, model: str, version: str, held: dict[str, Any],
          day: date) -> Charge:
    key = (tenant, model, version, held["tier"], held["hardware_class"], held["capacity_type"], day)
    line = lines.get(key)
    if line is None:
        line = lines[key] = Charge(tenant, model, version, held["tier"], held["hardware_class"],
                                   held["capacity_type"], day)
    return line
