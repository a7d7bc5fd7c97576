"""The tenants' budget states in a server process, refreshed off the request path (docs/cost.md, "Budgets").

The online tier may not price the ledger itself (``shardline.cost`` is not among its imports): the process that
started the server (``shardline serve``'s command) computes every budgeted tenant's state from the month's
ledger every ``SHARDLINE_METERING_BUDGET_REFRESH_S`` and publishes it to ``<home>/metering/budgets.json``
(``cost/budgets.py``); each server process here, and the router (``online/router/router.py``), re-reads that file
on a thread at the same interval. A request
then asks ``BudgetBoard.check`` (a dict look-up): ``hard`` raises ``BudgetExceeded`` (429, the figures,
``Retry-After`` until the month ends, at most an hour); ``warn`` and ``soft`` are returned, for the answer's
``X-Shardline-Budget`` header and the ``shardline_budget_requests`` metric. A state of another month (a file
left from last month) counts as none. Requests admitted before a state turns hard are never stopped.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timezone

from shardline.budgets import BudgetState, seconds_to_month_end
from shardline.errors import BudgetExceeded
from shardline.storage.ledger import LedgerStore, month_of

log = logging.getLogger("shardline.online.budgets")


class BudgetBoard:
    """The budget states last published (``cost/budgets.py``), re-read every ``refresh_s`` on a thread."""

    def __init__(self, store: LedgerStore | None, refresh_s: float) -> None:
        self.store, self.refresh_s = store, refresh_s
        self.states: dict[str, BudgetState] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> None:
        """Read the published states now (this month's only)."""
        if self.store is None:
            return
        published = self.store.read_budget_states()
        month = month_of(datetime.now(timezone.utc))
        self.states = {} if published is None else {
            name: state for name, state in published.states.items() if state.month == month}

    def start(self) -> None:
        """Read the states, then start the thread that re-reads them."""
        if self.store is None or self._thread is not None:
            return
        self._safe_refresh()
        self._thread = threading.Thread(target=self._run, name="shardline-budgets", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self._safe_refresh()

    def _safe_refresh(self) -> None:
        try:
            self.refresh()
        except Exception:  # noqa: BLE001 - the last states hold until the file can be read again
            log.exception("could not read the tenants' budget states; the last ones read still hold")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def check(self, tenant: str) -> BudgetState | None:
        """The tenant's state when it is not ok (warn or soft), None when ok or unbudgeted.

        Raises:
            BudgetExceeded: the tenant is at its hard limit (429 with the figures, Retry-After to the month's end).
        """
        state = self.states.get(tenant)
        if state is None or state.state == "ok":
            return None
        if state.state == "hard":
            raise BudgetExceeded(f"{state.line()}; this request was refused", tenant, seconds_to_month_end())
        return state
