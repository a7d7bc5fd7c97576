"""The flows that answer drift: re-validate a version, roll an alias back, re-score a job's output.

Automations in prefect.yaml start them from events (see docs/drift.md, Automations):
``shardline.drift.detected`` -> ``revalidate-model``; its
``shardline.model.revalidation-failed`` -> ``rollback-alias``. ``rescore-output`` runs
on demand (or from an automation a user adds).
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.states import Completed, Failed, State

from shardline.flows.batch_inference import batch_inference
from shardline.settings import DriftSettings, StorageSettings
from shardline.tasks.remediation import (
    pin,
    read_job_manifest,
    rescored_location,
    revalidate_task,
    rollback_task,
)


@flow(name="revalidate-model", log_prints=True)
def revalidate_model(
    model: str, alias: str | None = None, labelled_uri: str | None = None, cause: str = ""
) -> State[Any]:
    """Score a version on fresh labelled rows with its own metric and threshold (the golden gate's).

    Emits ``shardline.model.revalidated`` or ``shardline.model.revalidation-failed``
    (name, version, alias, score, threshold, reason), which the rollback automation
    listens for.

    Args:
        model: ``name:version`` (what drifted) or ``name@alias``.
        alias: the alias the version serves under, carried into the verdict's event
            so a rollback knows what to move; taken from ``model`` when it names one.
        labelled_uri: folder of Parquet with the model's inputs and its label column;
            default ``<SHARDLINE_DRIFT_LABELLED_URL>/<name>``.
        cause: what started this (an event id), for the logs.

    Returns:
        Completed with the verdict when the version still meets its threshold; Failed
        (holding the verdict as data) when it misses it.
    """
    result = revalidate_task(StorageSettings(), DriftSettings(), model, alias, labelled_uri)
    if cause:
        print(f"started by {cause}")
    if result.passed:
        return Completed(message=result.reason, data=result.as_dict())
    return Failed(message=result.reason, data=result.as_dict())


@flow(name="rollback-alias", log_prints=True)
def rollback_alias(
    model: str, alias: str, expected_version: int | None = None, by: str = "automation", reason: str = ""
) -> State[Any]:
    """Move ``model@alias`` back to the version it pointed at before, through the registry's rollback.

    The move is recorded in the alias's audit log with ``by`` and ``reason`` (an
    automation passes its name and the triggering event), and announced as
    ``shardline.model.rolled-back``.

    Args:
        model: the model's name.
        alias: the alias to move back, e.g. prod.
        expected_version: roll back only while the alias still points at this version
            (the one found bad); otherwise do nothing. None rolls back whatever it is.
        by: who decided, for the audit log.
        reason: why, for the audit log.

    Returns:
        Completed with the move; Completed named "Skipped" when the alias had already moved on.
    """
    move = rollback_task(StorageSettings(), model, alias, expected_version, by, reason)
    if move is None:
        return Completed(name="Skipped", message=f"{model}@{alias} no longer points at {model}:{expected_version}")
    return Completed(
        message=f"{model}@{alias}: {model}:{move.previous} -> {model}:{move.version}",
        data={"model": model, "alias": alias, "version": move.version, "previous": move.previous,
              "by": move.by, "reason": move.reason, "seq": move.seq},
    )


@flow(name="rescore-output", log_prints=True)
def rescore_output(job_output_uri: str, model: str, output_uri: str | None = None) -> State[Any]:
    """Score a finished batch job's input again with another version, into a new output folder.

    The job's committed manifest says what it read, for which tenant and with which
    passthrough columns; the batch flow runs as a subflow with ``model`` in its place.
    The original output is left as it is.

    Args:
        job_output_uri: the output folder of a finished batch job.
        model: the version to score with, ``name:version`` or ``name@alias``.
        output_uri: where the new parts go; default ``<job_output_uri>-rescored-<name>-v<version>``.

    Returns:
        Completed (or "Quarantined") with the new job's summary; the batch flow's
        state when it did not complete.
    """
    storage = StorageSettings()
    manifest = read_job_manifest(storage, job_output_uri)
    pinned = pin(storage, model)
    target = output_uri or rescored_location(job_output_uri, pinned)
    passthrough = manifest.passthrough
    print(f"re-scoring {manifest.input} (job {manifest.job_id}, {manifest.model.pinned}) "
          f"with {pinned.pinned} into {target}")
    state: State[Any] = batch_inference(
        model=pinned.pinned, input_uri=manifest.input, output_uri=target, tenant=manifest.tenant,
        passthrough=passthrough if isinstance(passthrough, list) else None, return_state=True,
    )
    if not state.is_completed():
        return state
    summary = state.result()
    return Completed(
        name=state.name, message=f"re-scored job {manifest.job_id} with {pinned.pinned} into {target}: {state.message}",
        data={**summary, "rescored_job": manifest.job_id, "previous_model": manifest.model.pinned},
    )
