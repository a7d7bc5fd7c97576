"""A Shardline home whose metering ledger already holds a tenant's spend this month, priced by a simple table."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from shardline.storage.ledger import Holding, LedgerStore

PRICES = "currency: USD\nclasses:\n  cpu: {unit: core, on-demand: 3600.0}\n"  # one core-second costs 1 USD


def write_prices(home: Path) -> Path:
    """``<home>/prices.yaml``, where the cost commands and the budget refresh find it: a CPU core-second is 1 USD."""
    home.mkdir(parents=True, exist_ok=True)
    path = home / "prices.yaml"
    path.write_text(PRICES)
    return path


def spend(home: Path, tenant: str, amount: float, tier: str = "batch", now: datetime | None = None) -> str:
    """Write a batch run's rows (``LedgerStore.record_batch``) that cost ``amount`` USD under ``write_prices``'s
    table: ``amount`` device-seconds on one CPU core, this month."""
    started = now or datetime.now(timezone.utc)
    store = LedgerStore(str(home))
    return store.record_batch(Holding(tier, "cpu", "on-demand", 1.0), tenant, "breast-cancer", "1",  # type: ignore[arg-type]
                              f"prefill-{tenant}", started, {"device_seconds": amount, "rows": 10}, amount, amount)
