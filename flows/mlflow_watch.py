"""The mlflow-watch flow: MLflow's registered versions vs what was seen -> import, push, announce -> artifact."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.settings import get_current_settings
from prefect.states import Completed, Failed, State

from shardline.settings import StorageSettings
from shardline.tasks.mlflow_watch import (
    GoldenRows,
    WatchOutcome,
    WatchSummary,
    import_version_task,
    open_tracking_task,
    plan_model_task,
    publish_watch_task,
    record_aliases_task,
    shown_uri,
    watch_targets,
)


@flow(name="mlflow-watch", log_prints=True, validate_parameters=True)
def mlflow_watch(models: list[str], tracking_uri: str | None = None, name_map: dict[str, str] | None = None,
                 samples: dict[str, str] | None = None, exclude: list[str] | None = None,
                 golden: dict[str, GoldenRows] | None = None) -> State[Any]:
    """Import the MLflow registered versions not seen before, push each to the registry and announce it as
    ``shardline.model.pushed`` (prefect.yaml's ``promote-on-push`` promotes it to staging through the gates).

    Args:
        models: MLflow registered model names: ``NAME`` (every version) or ``NAME@ALIAS`` (the version the
            alias points at; an alias moved to a version imported before imports nothing).
        tracking_uri: MLflow's tracking URI (default: MLflow's own, ``MLFLOW_TRACKING_URI`` or its default).
        name_map: MLflow name -> Shardline model name (default: the MLflow name, lower-cased, other characters '-').
        samples: MLflow name -> a Parquet file (any URL) of rows the model reads, e.g. its training data: each
            imported version is checked on them and gets their profile as its reference profile, which the
            promotion gates ask for (without one, a version imported from its logged input example alone is
            refused by the gate reference-profile).
        exclude: sample columns that are not features (a label, an id).
        golden: MLflow name -> its golden set: ``{rows: URL, label: target, metric: accuracy, prediction: label,
            threshold: 0.9}`` (the defaults shown), which each imported version carries and promotion's gate
            evaluation scores (without one, the gate refuses the version).

    Returns:
        Completed, its data the summary (imported, refused, unchanged, and each line), also published as the
        markdown artifact ``mlflow-watch-<tracking key>``; Failed with the same summary when a model could not
        be listed or a version could not be imported for another reason than a refusal (the next run retries
        it). A refused version (a pickle, a flavor that does not map) is recorded with its reason, not retried.
    """
    storage = StorageSettings()
    api_url = get_current_settings().api.url  # the API this run reports to: where the automations live
    targets = watch_targets(models, name_map, samples, golden)
    tracking = open_tracking_task(tracking_uri)
    outcomes: list[WatchOutcome] = []
    for target in targets:
        plan, lines = plan_model_task(target, tracking, storage)
        if plan is not None:
            outcomes += [import_version_task(target, version, tracking, storage, api_url, exclude or [])
                         for version in plan.to_import]
            if plan.alias_moves:
                record_aliases_task(plan, tracking, storage)
        outcomes += lines
    summary = WatchSummary(shown_uri(tracking), tuple(outcomes))
    publish_watch_task(summary)
    if summary.failed:
        return Failed(message=f"{summary.headline()}: {summary.failed[0].line()}", data=summary.as_dict())
    return Completed(message=summary.headline(), data=summary.as_dict())
