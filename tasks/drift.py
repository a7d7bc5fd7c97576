"""Prefect tasks of the drift-watch flow: check, check the contract, store, publish, announce.

Thin wrappers over ``shardline.quality.drift_checks``; the events they emit are what
the automations in prefect.yaml listen for.
"""

from __future__ import annotations

import re
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from shardline.errors import EmptyInput, RuntimeUnavailable
from shardline.event_catalog import DRIFT_DETECTED, QUALITY_FAILED
from shardline.quality.drift_checks import DriftCheck, check_drift, contract_failures, reports_root, save_report
from shardline.settings import DriftSettings, StorageSettings
from shardline.tasks.events import emit_model_event
from shardline.tasks.logs import run_logger

MAX_FAILURES_IN_EVENT = 20


@task(name="check-drift", cache_policy=NO_CACHE)
def check_drift_task(storage: StorageSettings, reference: str, window_hours: float,
                     tier: str | None) -> DriftCheck | None:
    """The drift check of ``reference`` over the last ``window_hours``; None when nothing was captured."""
    from datetime import timedelta

    try:
        check = check_drift(storage, reference, timedelta(hours=window_hours), tier=tier)
    except EmptyInput as e:
        run_logger().warning("no verdict: %s", e)
        return None
    report = check.report
    run_logger().info(
        "%s: %d current rows (%s) against %d reference rows; %s", report.model, report.rows_current,
        ", ".join(f"{t} {n}" for t, n in sorted(check.rows_by_tier.items())), report.rows_reference,
        f"drift in {report.drifted_columns}" if report.drifted else report.verdict,
    )
    return check


@task(name="check-contract", cache_policy=NO_CACHE)
def check_contract_task(storage: StorageSettings, drift: DriftSettings, check: DriftCheck) -> list[str] | None:
    """The data contract on the newest captured rows: failed expectations ([] = pass; None = not checked)."""
    try:
        failures = contract_failures(storage, check, drift.contract_sample_rows)
    except (ImportError, RuntimeUnavailable) as e:  # great-expectations missing: drift is still judged
        run_logger().warning("data contract not checked (%s); install great-expectations", e)
        return None
    for failure in failures:
        run_logger().warning("contract: %s", failure)
    return failures


@task(name="store-drift-report", cache_policy=NO_CACHE)
def store_report_task(storage: StorageSettings, drift: DriftSettings, check: DriftCheck) -> str:
    """Keep the report under the reports root (its history); returns its URL."""
    return save_report(reports_root(storage, drift), check.report, storage.storage_options)


def artifact_key(model: str) -> str:
    """A Prefect artifact key for a model's drift reports (lower-case letters, digits, dashes)."""
    return "drift-" + re.sub(r"[^a-z0-9-]+", "-", model.lower()).strip("-")


@task(name="publish-drift-report", cache_policy=NO_CACHE)
def publish_report_task(check: DriftCheck, report_url: str) -> None:
    """The report as a Prefect markdown artifact (one key per model, so the UI keeps its history)."""
    from shardline.quality.report import render_markdown

    markdown = render_markdown(check.report)
    markdown += f"\n\nWindow {check.since:%Y-%m-%d %H:%M} to {check.until:%Y-%m-%d %H:%M} UTC; rows by tier: "
    markdown += ", ".join(f"{t} {n:,}" for t, n in sorted(check.rows_by_tier.items()))
    if check.contract_failures:
        markdown += "\n\n**Data contract failed:**\n\n" + "\n".join(f"- {f}" for f in check.contract_failures)
    markdown += f"\n\nStored at `{report_url}`."
    create_markdown_artifact(markdown, key=artifact_key(check.target.model.name),
                             description=f"drift of {check.reference} ({check.report.model})")


@task(name="announce-drift", cache_policy=NO_CACHE)
def announce_task(check: DriftCheck, report_url: str) -> list[str]:
    """Emit ``shardline.drift.detected`` when a column drifted and ``shardline.quality.failed`` when the contract failed.

    Returns the events emitted.
    """
    model, alias = check.target.model, check.target.alias
    emitted = []
    if check.report.drifted:
        emit_model_event(DRIFT_DETECTED, model.name, model.version, alias, {**check.event_payload(), "report": report_url})
        emitted.append(DRIFT_DETECTED)
    if check.contract_failures:
        payload: dict[str, Any] = {
            "model": model.pinned, "check": "contract", "report": report_url,
            "failures": check.contract_failures[:MAX_FAILURES_IN_EVENT], "failed": len(check.contract_failures),
        }
        emit_model_event(QUALITY_FAILED, model.name, model.version, alias, payload)
        emitted.append(QUALITY_FAILED)
    for event in emitted:
        run_logger().warning("emitted %s for %s", event, check.reference)
    return emitted
