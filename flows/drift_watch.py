"""The drift-watch flow: captured data vs the reference profile -> report -> artifact -> events."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.states import Completed, State

from shardline.settings import DriftSettings, StorageSettings
from shardline.tasks.drift import (
    announce_task,
    check_contract_task,
    check_drift_task,
    publish_report_task,
    store_report_task,
)


@flow(name="drift-watch", log_prints=True, validate_parameters=True)
def drift_watch(
    model: str, window_hours: float | None = None, tier: str | None = None, check_contract: bool = True
) -> State[Any]:
    """Compare the last window of captured inputs and outputs of ``model``'s version with its reference profile.

    Stores the report (``<reports root>/<name>/<version>/<time>.json``), publishes it
    as a markdown artifact, and emits ``shardline.drift.detected`` when a column
    drifted and ``shardline.quality.failed`` when the data contract fails on the
    newest captured rows; automations in prefect.yaml answer them.

    Args:
        model: ``name@alias`` (the alias's current version is checked, and the events
            name the alias so a rollback knows what to move) or ``name:version``.
        window_hours: how far back to read capture (default SHARDLINE_DRIFT_WINDOW_HOURS, 24).
        tier: only one tier's capture ("online" or "batch"); both by default.
        check_contract: also run the great-expectations data contract on a sample.

    Returns:
        Completed named "Drifted" when a column drifted or the contract failed,
        "NoData" when nothing was captured in the window or too few rows to judge (fewer than
        the policy's min_rows: no verdict, not "no drift"), plain Completed otherwise;
        its data is a summary (verdict, drifted columns, report URL, events).
    """
    storage, drift = StorageSettings(), DriftSettings()
    hours = window_hours if window_hours is not None else drift.window_hours
    check = check_drift_task(storage, model, hours, tier)
    if check is None:
        return Completed(name="NoData", message=f"nothing of {model} was captured in the last {hours:g} h")
    if check_contract:
        check.contract_failures = check_contract_task(storage, drift, check)
    url = store_report_task(storage, drift, check)
    publish_report_task(check, url)
    events = announce_task(check, url)
    report = check.report
    summary = {
        "model": report.model, "reference": check.reference, "drifted": report.drifted, "judged": report.judged,
        "drifted_columns": report.drifted_columns, "score": report.score, "rows_current": report.rows_current,
        "rows_by_tier": check.rows_by_tier, "contract_failures": check.contract_failures, "report": url,
        "events": events,
    }
    if report.drifted or check.contract_failures:
        what = [f"drift in {', '.join(report.drifted_columns)}"] if report.drifted else []
        what += [f"{len(check.contract_failures or [])} contract failures"] if check.contract_failures else []
        return Completed(name="Drifted", message=f"{report.model}: {'; '.join(what)}", data=summary)
    if not report.judged:
        return Completed(name="NoData", message=f"{report.model}: {report.verdict}", data=summary)
    return Completed(message=f"{report.model}: no drift over {report.rows_current} rows", data=summary)
