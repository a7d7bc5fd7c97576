"""Prefect tasks of the mlflow-watch flow: open the store, plan a model, import a version, record aliases, publish.

Thin wrappers over ``shardline.build.mlflow_import`` (MLflow's own client), ``shardline.build.mlflow_watch`` (the pure
decisions), ``shardline.tasks.mlflow_watch_state`` (what was seen) and the registry; an imported version is
announced as ``shardline.model.pushed``, which prefect.yaml's ``promote-on-push`` automation answers.
"""

from __future__ import annotations

import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from shardline.build.mlflow_import import list_registered_versions, mlflow_tracking_uri, shown_uri
from shardline.build.mlflow_watch import (
    GoldenRows,
    SeenVersion,
    WatchOutcome,
    WatchPlan,
    WatchSummary,
    WatchTarget,
    plan_outcomes,
    plan_watch,
    tracking_key,
    watch_targets,  # noqa: F401 - the flow reads the watch's parameters through this module (flows only wire)
)
from shardline.errors import InvalidInput, InvalidSetting, ModelNotFound, RuntimeUnavailable, ShardlineError
from shardline.events import MODEL_PUSHED, announce_push
from shardline.settings import StorageSettings
from shardline.storage.registry import ModelRegistry
from shardline.tasks.logs import run_logger
from shardline.tasks.mlflow_watch_state import WatchStates

MAX_DETAIL_IN_ARTIFACT = 300  # characters of a refusal's reason in the artifact's table; the state keeps it all


@task(name="open-mlflow", cache_policy=NO_CACHE)
def open_tracking_task(tracking_uri: str | None) -> str:
    """The tracking URI MLflow's client will use (the given one, else MLflow's own); refused when a local store
    is not there or mlflow is not installed."""
    tracking = mlflow_tracking_uri(tracking_uri)
    run_logger().info("watching the MLflow registry at %s", shown_uri(tracking))
    return tracking


@task(name="plan-mlflow-model", cache_policy=NO_CACHE)
def plan_model_task(target: WatchTarget, tracking_uri: str, storage: StorageSettings) -> tuple[WatchPlan | None,
                                                                                                 list[WatchOutcome]]:
    """List the target's versions and aliases in MLflow and decide what to import; with the summary's lines for
    what it leaves alone. (None, [a failed line]) when MLflow cannot list it: the run goes on with the others."""
    try:
        listed = list_registered_versions(target.mlflow_name, tracking_uri)
        state = WatchStates(storage.home, storage.storage_options).read(tracking_uri, target.mlflow_name)
    except RuntimeUnavailable:
        raise
    except ShardlineError as e:  # a model MLflow does not have, a store it cannot read, a state file that is not one
        run_logger().warning("%s: %s", target.label, e)
        return None, [WatchOutcome(target.label, "failed", detail=str(e), user_error=isinstance(e, ModelNotFound),
                                   versions=0)]
    plan = plan_watch(target, listed, state)
    run_logger().info("%s: %d versions in MLflow; to import: %s", target.label, len(listed.versions),
                      ", ".join(plan.to_import) or "none")
    return plan, plan_outcomes(plan)


@task(name="import-mlflow-version", cache_policy=NO_CACHE)
def import_version_task(target: WatchTarget, version: str, tracking_uri: str, storage: StorageSettings,
                        api_url: str | None, exclude: list[str] | None = None) -> WatchOutcome:
    """Import ``models:/NAME/VERSION`` (checked on the target's sample rows, whose profile becomes its reference
    profile, when it has them; with the target's golden set, when it has one), push it to the registry and
    announce it when it is a new version there; record it as seen. A refused import (a pickle, a flavor that
    does not map, no rows to check it on) is recorded with its reason and not retried; any other error (a golden
    set that does not fit included) is reported and left for the next run."""
    from shardline.build.mlflow_import import import_mlflow_model
    from shardline.quality.profile import attach_reference_profile

    uri, logger = target.uri(version), run_logger()
    states = WatchStates(storage.home, storage.storage_options)
    with tempfile.TemporaryDirectory(prefix="shardline-mlflow-watch-") as scratch:
        try:
            sample = read_sample(target.sample, storage) if target.sample else None
            golden = _golden_set(target.golden, storage) if target.golden else None
            imported = import_mlflow_model(uri, Path(scratch) / "bundle", name=target.shardline_name,
                                           tracking_uri=tracking_uri, sample=sample, exclude=exclude or [],
                                           golden=golden)
            manifest = imported.manifest
            if sample is not None:  # its profile: the baseline drift checks and the promotion gate need
                manifest = attach_reference_profile(imported.folder, sample)  # rewrites the manifest: the bytes pushed
            registry = ModelRegistry.from_settings(storage)
            known = {m.content_digest for m in registry.list_versions(manifest.name)}
            pushed = registry.push(imported.folder)
        except InvalidInput as e:  # import_mlflow_model's refusal: these bytes will never map
            logger.warning("%s refused: %s", uri, e)
            seen = SeenVersion(status="refused", at=datetime.now(timezone.utc), reason=str(e))
            states.write(tracking_uri, states.read(tracking_uri, target.mlflow_name).with_version(version, seen))
            return WatchOutcome(target.label, "refused", version, detail=str(e))
        except ShardlineError as e:  # MLflow unreachable, a framework not installed, the registry: maybe next time
            logger.warning("%s not imported (the next run tries again): %s", uri, e)
            return WatchOutcome(target.label, "failed", version, detail=str(e))
    new = manifest.content_digest not in known
    announced = None
    if new:
        announced = announce_push(storage.home, pushed.name, pushed.version or 0, pushed.outputs_digest,
                                  f"mlflow-watch {uri}", api_url=api_url)
    seen = SeenVersion(status="imported", at=datetime.now(timezone.utc), reference=pushed.reference,
                       digest=pushed.outputs_digest)
    states.write(tracking_uri, states.read(tracking_uri, target.mlflow_name).with_version(version, seen))
    detail = f"flavor {imported.flavor}; " + (
        f"announced as {MODEL_PUSHED}" if announced else
        "not announced: no Prefect API took the event" if new else
        "the registry already held these bytes: no new version, no event")
    if pushed.reference_profile is None:
        detail += "; no reference profile, so promotion's gate reference-profile refuses it"
    if pushed.evaluation is None:
        detail += "; no golden set, so promotion's gate evaluation refuses it"
    logger.info("%s imported as %s (%s)", uri, pushed.reference, detail)
    return WatchOutcome(target.label, "imported", version, reference=pushed.reference, detail=detail)


def read_sample(url: str, storage: StorageSettings, what: str = "sample rows",
                should: str = "a Parquet file of the model's inputs in samples") -> Any:
    """A target's sample rows (or other rows: ``what``, and what to give instead: ``should``): a Parquet file at
    any URL (InvalidSetting when it cannot be read)."""
    import pyarrow.parquet as pq

    from shardline.storage.fs import open_fs

    fs, path = open_fs(url, storage.storage_options)
    try:
        return pq.read_table(path, filesystem=fs)
    except (OSError, ValueError) as e:
        raise InvalidSetting(f"the {what} {url!r} cannot be read as Parquet ({e}); give {should}") from e


def _golden_set(spec: GoldenRows, storage: StorageSettings) -> Any:
    """A target's golden set, its rows read (InvalidSetting when they cannot be)."""
    from shardline.build.packaging import GoldenSet

    table = read_sample(spec.rows, storage, "golden rows",
                        "a Parquet file of the model's inputs and the expected answers in golden")
    return GoldenSet(table, spec.label, spec.metric, spec.prediction, spec.threshold)


@task(name="record-mlflow-aliases", cache_policy=NO_CACHE)
def record_aliases_task(plan: WatchPlan, tracking_uri: str, storage: StorageSettings) -> None:
    """Remember where the watched alias points, once its version is imported or refused (else the next run
    sees the move again)."""
    states = WatchStates(storage.home, storage.storage_options)
    state = states.read(tracking_uri, plan.target.mlflow_name)
    settled = {m.alias: m.after for m in plan.alias_moves if m.after in state.versions}
    if settled:
        states.write(tracking_uri, state.with_aliases(settled))


def _cell(text: str | None) -> str:
    text = (text or "").replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= MAX_DETAIL_IN_ARTIFACT else text[:MAX_DETAIL_IN_ARTIFACT] + "..."


def render_watch_markdown(summary: WatchSummary) -> str:
    """The run's summary as markdown: the counts, then one table row per line."""
    rows = "\n".join(f"| {_cell(o.target)} | {o.version or ''} | {o.action} | {o.reference or ''} | {_cell(o.detail)} |"
                     for o in summary.outcomes)
    return (f"### MLflow watch: {summary.headline()}\n\nRegistry at `{summary.tracking_uri}`.\n\n"
            "| MLflow model | Version | Outcome | Shardline | Detail |\n|---|---|---|---|---|\n" + rows)


@task(name="publish-mlflow-watch", cache_policy=NO_CACHE)
def publish_watch_task(summary: WatchSummary) -> None:
    """The summary as a markdown artifact, one key per tracking store (``mlflow-watch-<key>``: its history)."""
    create_markdown_artifact(render_watch_markdown(summary), key=f"mlflow-watch-{tracking_key(summary.tracking_uri)}",
                             description=f"mlflow-watch of {summary.tracking_uri}: {summary.headline()}")
    run_logger().info("mlflow-watch: %s", summary.headline())
