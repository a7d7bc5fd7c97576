"""Budgets: what each tenant spent this month (the ledger, priced and allocated as the cost report does) and the
state it puts the tenant in (``shardline.budgets.budget_state``, the kernel's, which the online tier reads too).

A tenant's spend is the sum of its charges in ``allocation.allocate`` (the report's own allocation, so the
budget and the chargeback never disagree); idle capacity is the platform's, never a tenant's. ``publish``
writes every budgeted tenant's state to ``<home>/metering/budgets.json`` for the online tier, which may not
import this room; ``shardline serve`` and the router run it every ``SHARDLINE_METERING_BUDGET_REFRESH_S``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from datetime import datetime, timezone
from typing import Any, Iterable

from shardline.budgets import Budget, BudgetState, BudgetStates, budget_state
from shardline.cost.allocation import IDLE, allocate
from shardline.capacity.prices import PriceTable
from shardline.storage.ledger import LedgerStore, month_of

log = logging.getLogger("shardline.cost.budgets")


def spend_by_tenant(rows: Iterable[dict[str, Any]], prices: PriceTable) -> dict[str, float]:
    """Each tenant's charges in ``rows`` (ledger rows), both tiers, idle left out."""
    spent: dict[str, float] = defaultdict(float)
    for charge in allocate(rows, prices).charges:
        if charge.tenant != IDLE:
            spent[charge.tenant] += charge.spend.cost
    return dict(spent)


def budget_states(budgets: dict[str, Budget], rows: Iterable[dict[str, Any]], prices: PriceTable,
                  month: str) -> dict[str, BudgetState]:
    """Every budgeted tenant's state from a month's ledger rows (a tenant with no rows spent nothing)."""
    spent = spend_by_tenant(rows, prices)
    return {name: budget_state(name, budget, spent.get(name, 0.0), month, prices.currency)
            for name, budget in budgets.items()}


def current_states(store: LedgerStore, budgets: dict[str, Budget], prices: PriceTable,
                   now: datetime | None = None) -> dict[str, BudgetState]:
    """Every budgeted tenant's state now: its month-to-date spend in the ledger of ``store``.

    Raises:
        InvalidSetting: a hardware class the price table does not price.
    """
    month = month_of(now or datetime.now(timezone.utc))
    rows = store.read(month).to_pylist() if budgets else []
    return budget_states(budgets, rows, prices, month)


def tenant_budget_state(tenants_file: str | None, tenant: str, home: str,
                        storage_options: dict[str, Any] | None = None) -> BudgetState | None:
    """The tenant's budget state now, or None: no tenants file, or no budget for the tenant. Its spend is the
    month's ledger under ``home`` priced by the price table ``shardline cost report`` reads. What `batch run` asks
    before a job, and the batch flow before a deployment's job.

    Raises:
        ShardlineError: the tenants file or the price table is wrong.
    """
    if not tenants_file:
        return None
    from shardline.capacity.prices import load_prices, prices_path
    from shardline.tenants import load_tenants_file

    budget = load_tenants_file(tenants_file).budgets().get(tenant)
    if budget is None:
        return None
    store = LedgerStore(home, storage_options)
    return current_states(store, {tenant: budget}, load_prices(prices_path()))[tenant]


def publish(store: LedgerStore, budgets: dict[str, Budget], prices: PriceTable) -> BudgetStates:
    """Compute the states now and write them where the online tier reads them (``LedgerStore.budgets_path``)."""
    states = BudgetStates(current_states(store, budgets, prices), time.time())
    store.write_budget_states(states)
    return states


class BudgetPublisher:
    """``publish`` every ``refresh_s`` on a thread, the tenants file and the price table read each time (an
    edited budget takes effect at the next refresh): what ``shardline serve`` runs beside its server processes."""

    def __init__(self, tenants_file: str, store: LedgerStore, prices_file: str | None, refresh_s: float) -> None:
        self.tenants_file, self.store, self.prices_file, self.refresh_s = tenants_file, store, prices_file, refresh_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def publish_once(self) -> BudgetStates:
        """Compute and publish the states now.

        Raises:
            InvalidSetting: the tenants file or the price table is wrong, or a class it does not price.
        """
        from shardline.capacity.prices import load_prices
        from shardline.tenants import load_tenants_file

        budgets = load_tenants_file(self.tenants_file).budgets()
        return publish(self.store, budgets, load_prices(self.prices_file))

    def start(self) -> None:
        """Publish now (raising what is wrong), then every ``refresh_s`` on a thread (logging what is wrong)."""
        self.publish_once()
        self._thread = threading.Thread(target=self._run, name="shardline-budget-publisher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                self.publish_once()
            except Exception:  # noqa: BLE001 - the states published last hold until the next refresh works
                log.exception("could not compute the tenants' budget states; the last ones published still hold")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
