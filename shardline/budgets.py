"""A tenant's budget in money, and the state its month-to-date spend puts it in (pure; both tiers read it).

A tenant's entry in the tenants file may carry ``budget: {monthly: 500.0, warn_at: 0.8, soft_at: 0.9}``, in the
currency of the price table. What the tenant spent in the month so far (its charges in the metering ledger,
priced and allocated by ``shardline.cost``) puts it in one of four states:

- ``ok``: under ``warn_at`` of the budget;
- ``warn``: at ``warn_at`` or more: work runs, the answer says so (a Prefect event from batch, a header and a
  metric online);
- ``soft``: at ``soft_at`` or more: work degrades (a batch job runs at low priority, an online request goes to
  the cheaper variant where one exists), marked in the answer;
- ``hard``: at the budget or over it: new work is refused with the figures (exit code 2 in batch, 429 online,
  ``Retry-After`` until the month ends, capped). Work accepted before is never stopped.

The function is here, in the kernel, so that the online tier (which may not import ``shardline.cost``) and the
cost room share it: ``cost/budgets.py`` computes the spend and calls ``budget_state``; the online tier reads the
states it published (``BudgetStates``, JSON) off the request path.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shardline.errors import BudgetExceeded
from shardline.figures import money

State = Literal["ok", "warn", "soft", "hard"]
STATES: tuple[State, ...] = ("ok", "warn", "soft", "hard")  # in order of severity
RETRY_AFTER_CAP_S = 3600.0  # a refused client is told to come back within the hour at most (the budget may grow)


class Budget(BaseModel):
    """A tenant's ``budget:`` section: money per calendar month (UTC), and the fractions that warn and degrade."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    monthly: float = Field(gt=0, description="Money per calendar month (UTC), in the price table's currency.")
    warn_at: float = Field(default=0.8, gt=0, le=1, description="Fraction of the budget that warns.")
    soft_at: float = Field(default=0.9, gt=0, le=1, description="Fraction of the budget that degrades work.")

    @model_validator(mode="after")
    def _ordered(self) -> "Budget":
        if self.warn_at > self.soft_at:
            raise ValueError(f"warn_at ({self.warn_at}) is above soft_at ({self.soft_at}); the warning comes first: "
                             "give warn_at <= soft_at <= 1")
        return self


@dataclass(frozen=True)
class BudgetState:
    """Where a tenant stands against its budget this month, with the figures."""

    tenant: str
    state: State
    spent: float
    budget: float
    month: str  # YYYY-MM (UTC)
    currency: str = "USD"
    threshold: float = 0.0  # the spend at which this state began (0 for ok)

    @property
    def fraction(self) -> float:
        """Spent over budget."""
        return self.spent / self.budget

    def figures(self) -> str:
        """'spent 512.30 USD of 500.00 USD (102%) in 2026-12'."""
        return (f"spent {money(self.spent, self.currency)} of {money(self.budget, self.currency)} "
                f"({100 * self.fraction:.0f}%) in {self.month}")

    def line(self) -> str:
        """One line for a person: what the state means for new work, with the figures."""
        what = {
            "ok": "within its budget",
            "warn": "past its budget's warning threshold",
            "soft": "past its budget's soft limit: work is degraded",
            "hard": "at its budget's hard limit: new work is refused until the month ends or the budget grows",
        }[self.state]
        return f"tenant {self.tenant!r} is {what} ({self.figures()})"

    def refusal(self) -> str:
        """The one line that refuses a new batch job at the hard limit (`batch run`, `batch openai`, a deployment's
        run alike)."""
        return (f"{self.line()}; the job was not started (raise the tenant's budget in the tenants file, or wait "
                "for the next month)")

    def begun(self) -> str:
        """The line for a job an earlier run began, which runs to the end whatever the state."""
        return f"{self.line()}; this job was begun before, so it runs to the end"

    def job_line(self, begun: bool, degraded: str) -> str | None:
        """The one line a batch job starting at this state runs with (None: nothing to say), the same ladder for
        `batch run`, `batch openai` and a deployment's run; ``degraded`` says what the soft limit makes of this
        job ('this job runs at low priority'). A job an earlier run ``begun`` is never refused.

        Raises:
            BudgetExceeded: at the hard limit, for a job no earlier run began (new work), with the figures.
        """
        if self.state == "ok":
            return None
        if self.state == "hard" and not begun:
            raise BudgetExceeded(self.refusal(), self.tenant, seconds_to_month_end())
        if self.state == "hard":
            return self.begun()
        return f"{self.line()}; {degraded if self.state == 'soft' else 'the job runs'}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "BudgetState":
        return cls(str(data["tenant"]), data["state"], float(data["spent"]), float(data["budget"]),
                   str(data["month"]), str(data.get("currency", "USD")), float(data.get("threshold", 0.0)))


def budget_state(tenant: str, budget: Budget, spent: float, month: str, currency: str = "USD") -> BudgetState:
    """The state ``spent`` (month to date) puts a tenant with ``budget`` in (see the module docstring)."""
    limits: tuple[tuple[State, float], ...] = (
        ("hard", budget.monthly), ("soft", budget.soft_at * budget.monthly), ("warn", budget.warn_at * budget.monthly))
    for state, threshold in limits:
        if spent >= threshold:
            return BudgetState(tenant, state, spent, budget.monthly, month, currency, threshold)
    return BudgetState(tenant, "ok", spent, budget.monthly, month, currency)


def seconds_to_month_end(now: datetime | None = None, cap: float = RETRY_AFTER_CAP_S) -> float:
    """Seconds from ``now`` (UTC) to the start of the next month, at most ``cap``: a hard limit's Retry-After."""
    moment = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
    following = datetime(moment.year + (moment.month == 12), moment.month % 12 + 1, 1, tzinfo=timezone.utc)
    return max(1.0, min(cap, (following - moment).total_seconds()))


@dataclass(frozen=True)
class BudgetStates:
    """Every budgeted tenant's state at one moment: what ``cost/budgets.py`` publishes and the online tier reads."""

    states: dict[str, BudgetState]
    computed_at: float  # epoch seconds

    def dumps(self) -> str:
        return json.dumps({"computed_at": self.computed_at,
                           "states": [s.to_json() for s in self.states.values()]})

    @classmethod
    def loads(cls, text: str) -> "BudgetStates":
        data = json.loads(text)
        states = [BudgetState.from_json(s) for s in data["states"]]
        return cls({s.tenant: s for s in states}, float(data["computed_at"]))
