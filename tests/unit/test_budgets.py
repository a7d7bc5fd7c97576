"""Budgets: the tenants file's budget section, the state a month's spend puts a tenant in, and its figures."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

from shardline.budgets import Budget, BudgetStates, budget_state, seconds_to_month_end
from shardline.cost.budgets import current_states, publish, spend_by_tenant
from shardline.capacity.prices import load_prices
from shardline.errors import InvalidSetting
from shardline.storage.ledger import LedgerStore
from shardline.storage.registry import ModelRegistry
from shardline.tenants import parse_tenants_file
from tests.support.budgets import spend, write_prices

BUDGET = Budget(monthly=100.0, warn_at=0.8, soft_at=0.9)


def entry(budget: str) -> dict:
    return {"tenants": [{"name": "acme", "batch": {"storage_prefixes": ["/data/acme"]}, "budget": budget}]}


def test_the_tenants_file_takes_a_budget_and_says_what_is_wrong_with_one() -> None:
    checked = parse_tenants_file(entry({"monthly": 500.0, "warn_at": 0.7}), "t.yaml")  # type: ignore[arg-type]
    assert checked.budgets() == {"acme": Budget(monthly=500.0, warn_at=0.7, soft_at=0.9)}
    with pytest.raises(InvalidSetting, match=r"tenants\[0\]\.budget\.monthly: Input should be greater than 0 "
                                             r"\(got -5\)"):
        parse_tenants_file(entry({"monthly": -5}), "t.yaml")  # type: ignore[arg-type]
    with pytest.raises(InvalidSetting, match=r"tenants\[0\]\.budget: Value error, warn_at \(0.95\) is above soft_at "
                                             r"\(0.9\); the warning comes first"):
        parse_tenants_file(entry({"monthly": 5, "warn_at": 0.95}), "t.yaml")  # type: ignore[arg-type]
    with pytest.raises(InvalidSetting, match=r"tenants\[0\]\.budget\.hard_at: Extra inputs are not permitted"):
        parse_tenants_file(entry({"monthly": 5, "hard_at": 1.0}), "t.yaml")  # type: ignore[arg-type]


@pytest.mark.parametrize(("spent", "state", "threshold"), [
    (0.0, "ok", 0.0), (79.99, "ok", 0.0), (80.0, "warn", 80.0), (89.0, "warn", 80.0), (90.0, "soft", 90.0),
    (99.99, "soft", 90.0), (100.0, "hard", 100.0), (250.0, "hard", 100.0),
])
def test_each_threshold_starts_its_state(spent: float, state: str, threshold: float) -> None:
    result = budget_state("acme", BUDGET, spent, "2026-12", "EUR")
    assert (result.state, result.threshold, result.spent, result.budget) == (state, pytest.approx(threshold), spent,
                                                                             100.0)


def test_the_line_gives_the_figures() -> None:
    assert budget_state("acme", BUDGET, 102.5, "2026-12").line() == (
        "tenant 'acme' is at its budget's hard limit: new work is refused until the month ends or the budget grows "
        "(spent 102.50 USD of 100.00 USD (102%) in 2026-12)")


def test_small_amounts_keep_their_figures() -> None:
    # cents hid them: "spent 0.00 USD of 0.00 USD (146%)" for a budget of 0.00005 (a test tenant, a pilot)
    small = Budget(monthly=0.00005, warn_at=0.8, soft_at=0.9)
    assert budget_state("acme", small, 7.287e-05, "2026-12").figures() == (
        "spent 7.287e-05 USD of 5e-05 USD (146%) in 2026-12")


def test_retry_after_runs_to_the_month_end_capped() -> None:
    assert seconds_to_month_end(datetime(2026, 12, 31, 23, 59, 30, tzinfo=timezone.utc)) == 30.0
    assert seconds_to_month_end(datetime(2026, 12, 2, tzinfo=timezone.utc)) == 3600.0
    assert seconds_to_month_end(datetime(2026, 11, 30, 23, 0, tzinfo=timezone.utc), cap=1e9) == 3600.0


def test_spend_is_the_tenants_charges_in_the_ledger_and_is_published(tmp_path: Path) -> None:
    prices = load_prices(write_prices(tmp_path))
    spend(tmp_path, "acme", 85.0)
    spend(tmp_path, "acme", 10.0, tier="online")
    spend(tmp_path, "other", 3.0)
    store = LedgerStore(str(tmp_path))
    month = datetime.now(timezone.utc).strftime("%Y-%m")
    assert spend_by_tenant(store.read(month).to_pylist(), prices) == pytest.approx({"acme": 95.0, "other": 3.0})
    states = current_states(store, {"acme": BUDGET, "quiet": BUDGET}, prices)
    assert (states["acme"].state, states["acme"].spent, states["acme"].month) == ("soft", pytest.approx(95.0), month)
    assert (states["quiet"].state, states["quiet"].spent) == ("ok", 0.0)
    assert store.read_budget_states() is None
    published = publish(store, {"acme": BUDGET}, prices)
    read = store.read_budget_states()
    assert read is not None and read.states == published.states
    assert BudgetStates.loads(published.dumps()).states["acme"].state == "soft"


def test_the_servers_board_reads_this_months_states_and_refuses_at_hard(tmp_path: Path) -> None:
    from shardline.errors import BudgetExceeded, RateLimited
    from shardline.online.budgets import BudgetBoard

    store = LedgerStore(str(tmp_path))
    board = BudgetBoard(store, 60.0)
    board.refresh()
    assert board.check("acme") is None  # nothing published: nobody is past a threshold
    month = datetime.now(timezone.utc).strftime("%Y-%m")
    states = {"acme": budget_state("acme", BUDGET, 85.0, month), "globex": budget_state("globex", BUDGET, 100.0, month),
              "old": budget_state("old", BUDGET, 500.0, "2001-01")}
    store.write_budget_states(BudgetStates(states, 0.0))
    board.refresh()
    warned = board.check("acme")
    assert warned is not None and warned.state == "warn"
    with pytest.raises(BudgetExceeded, match=r"tenant 'globex' is at its budget's hard limit.*\(spent 100.00 USD of "
                                             r"100.00 USD \(100%\)") as refused:
        board.check("globex")
    assert isinstance(refused.value, RateLimited) and 1 <= refused.value.retry_after <= 3600
    assert board.check("old") is None  # last month's state is no state


def test_the_data_plane_marks_and_counts_warn_and_refuses_hard(local_registry: ModelRegistry, tmp_path: Path) -> None:
    from shardline.errors import BudgetExceeded
    from shardline.online.budgets import BudgetBoard
    from shardline.online.dataplane import DataPlane
    from shardline.online.logs import CURRENT, RequestInfo
    from shardline.online.tenants import TenantDirectory, hash_api_key
    from shardline.runtimes import RuntimeOptions
    from shardline.settings import OnlineSettings
    from shardline.storage.model_cache import ModelCache

    store = LedgerStore(str(tmp_path))
    month = datetime.now(timezone.utc).strftime("%Y-%m")
    store.write_budget_states(BudgetStates({"acme": budget_state("acme", BUDGET, 85.0, month),
                                            "globex": budget_state("globex", BUDGET, 120.0, month)}, 0.0))
    board = BudgetBoard(store, 60.0)
    board.refresh()
    tenants = TenantDirectory.from_config({"tenants": [
        {"name": name, "api_keys_sha256": [hash_api_key(name)], "models": ["breast-cancer@prod"]}
        for name in ("acme", "globex")]})
    plane = DataPlane(OnlineSettings(), local_registry, ModelCache(tmp_path / "cache"), tenants,
                      RuntimeOptions("cpu", 1), budgets=board)
    info = RequestInfo("r1")
    token = CURRENT.set(info)
    try:
        with plane.admit(plane.authenticate("Bearer acme")):
            pass
        with pytest.raises(BudgetExceeded, match=r"spent 120.00 USD of 100.00 USD \(120%\)"):
            plane.admit(plane.authenticate("Bearer globex"))
    finally:
        CURRENT.reset(token)
    assert info.budget == "warn"
    text = plane.metrics.exposition()[0].decode()
    assert 'shardline_budget_requests_total{state="warn",tenant="acme"} 1.0' in text
    assert 'shardline_budget_requests_total{state="hard",tenant="globex"} 1.0' in text
    assert 'shardline_rate_limited_total{quota="budget",tenant="globex"} 1.0' in text
