"""The monthly cost report as a Prefect task: the month's chargeback from the metering ledger, as a markdown
artifact (one key a month, so the UI keeps the history) and an HTML page with plots under the home.

The same report as `shardline cost report` (``shardline.cost.report``); the ``cost-report`` deployment in
prefect.yaml runs it on the 1st of each month for the month before.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from shardline.capacity.prices import load_prices, prices_path
from shardline.cost.report import build_report, render_html, render_markdown, teachers_in
from shardline.settings import StorageSettings
from shardline.storage.fs import atomic_write_bytes, join, open_fs
from shardline.storage.ledger import LedgerStore, check_month, previous_month
from shardline.storage.registry import ModelRegistry


def report_month(month: str | None) -> str:
    """The month to report: ``month`` checked, else the month before this one (UTC)."""
    return check_month(month) if month else previous_month()


@task(name="cost-report", cache_policy=NO_CACHE)
def publish_cost_report_task(storage: StorageSettings, month: str, prices: str | None = None) -> dict[str, Any] | None:
    """Build the month's report and publish it; None when the ledger holds nothing for the month.

    Returns a summary: the month, currency, priced capacity, charged, idle, the charge per tenant, and where the
    HTML page was written (``<home>/reports/cost/<month>.html``).
    """
    store = LedgerStore(str(storage.home), storage.storage_options)
    table = store.read(month)
    if table.num_rows == 0:
        return None
    report = build_report(table.to_pylist(), load_prices(prices_path(prices)), month, None,
                          teachers_in(ModelRegistry.from_settings(storage)))
    fs, base = open_fs(join(str(storage.home), "reports", "cost"), storage.storage_options)
    page = join(base, f"{month}.html")
    atomic_write_bytes(fs, page, render_html(report).encode(), join(base, "_staging"))
    create_markdown_artifact(render_markdown(report) + f"\nThe page with plots: `{page}`.\n", key=f"cost-report-{month}",
                             description=f"chargeback for {month} from the metering ledger")
    per_tenant: dict[str, float] = {}
    for line in report.lines:
        per_tenant[line.tenant] = per_tenant.get(line.tenant, 0.0) + (line.spend.cost or 0.0)
    return {"month": month, "currency": report.currency, "priced_capacity": report.priced_capacity,
            "charged": report.charged, "idle": report.idle_cost, "tenants": per_tenant, "page": page}
