"""The cost-report flow: a month's chargeback from the metering ledger as an artifact (docs/cost.md)."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.states import Completed, State

from shardline.settings import StorageSettings
from shardline.tasks.cost_report import publish_cost_report_task, report_month


@flow(name="cost-report", log_prints=True, validate_parameters=True)
def cost_report(month: str | None = None, prices: str | None = None) -> State[Any]:
    """Publish the chargeback of ``month`` (YYYY-MM; default the month before this one, UTC) per tenant, model and
    tier as a markdown artifact keyed ``cost-report-<month>``, and as an HTML page with plots under the home.

    Args:
        month: the month to report.
        prices: the price table (YAML); default SHARDLINE_METERING_PRICES_FILE, else <home>/prices.yaml, else the
            example's list prices.

    Returns:
        Completed named "NoData" when the ledger holds nothing for the month, plain Completed otherwise, its
        data the summary (priced capacity, charged, idle, per tenant, the page).
    """
    chosen = report_month(month)
    summary = publish_cost_report_task(StorageSettings(), chosen, prices)
    if summary is None:
        return Completed(name="NoData", message=f"the metering ledger holds nothing for {chosen}")
    return Completed(message=f"{chosen}: charged {summary['charged']:.2f} {summary['currency']} of "
                             f"{summary['priced_capacity']:.2f} priced", data=summary)
