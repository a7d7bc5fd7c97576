"""Prefect tasks of the flows that answer drift: re-validate a version, roll an alias back, re-score a job.

Each task is a thin wrapper over a plain function here or in storage/quality, and
every answer is announced as a Prefect event on the model's resource, so that
automations in prefect.yaml can chain them (drift -> re-validate -> roll back).
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from prefect import task
from prefect.cache_policies import NO_CACHE

from shardline.bundle import ModelRef
from shardline.errors import InvalidInput
from shardline.event_catalog import MODEL_REVALIDATED, MODEL_REVALIDATION_FAILED, MODEL_ROLLED_BACK
from shardline.quality.evaluation import evaluate, evaluation_of
from shardline.runtimes import RuntimeOptions, create_runtime
from shardline.settings import DriftSettings, StorageSettings
from shardline.storage.fs import join, open_fs
from shardline.storage.output import JobManifest, OutputLayout
from shardline.storage.registry import AliasMove, ModelRegistry, ResolvedModel, fetch_bundle
from shardline.storage.shards import list_shards
from shardline.tasks.events import emit_model_event
from shardline.tasks.logs import run_logger


@dataclass(frozen=True)
class Revalidation:
    """A version scored on fresh labelled rows, against its own golden-set threshold."""

    model: str
    version: int
    alias: str | None
    labelled_uri: str
    rows: int
    metric: str
    score: float
    threshold: float
    higher_is_better: bool
    passed: bool

    @property
    def reason(self) -> str:
        """One sentence for people and audit logs."""
        verdict = "meets" if self.passed else "misses"
        bound = "at least" if self.higher_is_better else "at most"
        return (f"{self.model}:{self.version} scores {self.metric} {self.score:.4f} on {self.rows} fresh labelled rows "
                f"({self.labelled_uri}); it {verdict} its threshold ({bound} {self.threshold})")

    def as_dict(self) -> dict[str, Any]:
        """Plain data, with the reason."""
        return {**asdict(self), "reason": self.reason}


def labelled_location(model: str, labelled_uri: str | None, drift: DriftSettings) -> str:
    """Where a model's fresh labelled rows are: the given URL, else ``<labelled_url>/<model>``.

    Raises:
        InvalidInput: neither is set.
    """
    if labelled_uri:
        return labelled_uri
    if not drift.labelled_url:
        raise InvalidInput(
            f"no labelled data to re-validate {model!r} against: pass labelled_uri, or set "
            "SHARDLINE_DRIFT_LABELLED_URL to a folder holding <model>/*.parquet with fresh labels"
        )
    return join(drift.labelled_url.rstrip("/"), model)


def read_labelled(uri: str, columns: list[str], storage_options: dict[str, Any]) -> pa.Table:
    """Every Parquet file under ``uri``, only ``columns``.

    Raises:
        InvalidSetting / EmptyInput: nothing there.
        InvalidInput: a file lacks a needed column.
    """
    tables = []
    for shard in list_shards(uri, storage_options):
        fs, path = open_fs(shard.uri, storage_options)
        schema = pq.read_schema(path, filesystem=fs)
        missing = [c for c in columns if schema.get_field_index(c) < 0]
        if missing:
            raise InvalidInput(
                f"the labelled file {shard.uri} lacks columns {missing} (it has {schema.names}); labelled data "
                "needs the model's inputs and its evaluation's label column"
            )
        tables.append(pq.read_table(path, filesystem=fs, columns=columns))
    return pa.concat_tables(tables, promote_options="permissive")


def revalidate_version(model: ResolvedModel, alias: str | None, labelled_uri: str, storage: StorageSettings) -> Revalidation:
    """Score a pinned version on fresh labelled rows with its manifest's metric and threshold.

    Raises:
        InvalidBundle: the version declares no evaluation (nothing to compare with).
    """
    manifest = model.manifest
    evaluation = evaluation_of(manifest)
    needed = [*manifest.signature.input_names, evaluation.label_column]
    table = read_labelled(labelled_uri, list(dict.fromkeys(needed)), storage.storage_options)
    with tempfile.TemporaryDirectory() as folder:
        fetch_bundle(model, Path(folder), storage.storage_options)  # verified: what is scored is what was pushed
        runtime = create_runtime(Path(folder), manifest, RuntimeOptions(device="cpu"))
        runtime.load()
        try:
            score = evaluate(runtime, manifest, table)
        finally:
            runtime.close()
    higher = evaluation.metric != "rmse"
    return Revalidation(
        model=model.name, version=model.version, alias=alias, labelled_uri=labelled_uri, rows=table.num_rows,
        metric=evaluation.metric, score=score, threshold=evaluation.threshold, higher_is_better=higher,
        passed=evaluation.passes(score),
    )


@task(name="revalidate", cache_policy=NO_CACHE)
def revalidate_task(storage: StorageSettings, drift: DriftSettings, reference: str, alias: str | None,
                    labelled_uri: str | None) -> Revalidation:
    """Pin the reference, score it on fresh labels, announce the verdict as an event."""
    registry = ModelRegistry.from_settings(storage)
    model = registry.resolve(reference)
    if alias is None:
        alias = ModelRef.split(reference)[1]
    where = labelled_location(model.name, labelled_uri, drift)
    result = revalidate_version(model, alias, where, storage)
    (run_logger().info if result.passed else run_logger().warning)("%s", result.reason)
    emit_model_event(MODEL_REVALIDATED if result.passed else MODEL_REVALIDATION_FAILED, model.name, model.version, alias,
                     result.as_dict())
    return result


@task(name="rollback-alias", cache_policy=NO_CACHE)
def rollback_task(storage: StorageSettings, model: str, alias: str, expected_version: int | None, by: str,
                  reason: str) -> AliasMove | None:
    """Roll ``model@alias`` back through the registry; None (no move) when it no longer points at ``expected_version``.

    The guard makes the answer idempotent: two events about one bad version roll the
    alias back once, and a version someone already replaced is left alone.
    """
    registry = ModelRegistry.from_settings(storage)
    current = registry.current_move(model, alias)
    if expected_version is not None and (current is None or current.version != expected_version):
        run_logger().info(
            "%s@%s points at %s, not %s: nothing to roll back", model, alias,
            f"{model}:{current.version}" if current else "nothing", f"{model}:{expected_version}",
        )
        return None
    move = registry.rollback(model, alias, by=by, reason=reason)
    run_logger().warning("rolled %s@%s back from %s:%s to %s:%s (%s)", model, alias, model, move.previous, model,
                         move.version, reason)
    emit_model_event(MODEL_ROLLED_BACK, model, move.version, alias,
             {"previous": move.previous, "by": move.by, "reason": move.reason, "seq": move.seq})
    return move


@task(name="read-job-manifest", cache_policy=NO_CACHE)
def read_job_manifest(storage: StorageSettings, job_output_uri: str) -> JobManifest:
    """The committed manifest of a batch job's output (its input, model, tenant, passthrough).

    Raises:
        InvalidInput: the folder holds no committed job manifest.
    """
    layout = OutputLayout(job_output_uri, storage.storage_options)
    try:
        manifest = layout.read_manifest()
    except FileNotFoundError as e:
        raise InvalidInput(
            f"{job_output_uri!r} holds no committed batch job (no _manifest.json); point job_output_uri at the "
            "output folder of a finished batch job"
        ) from e
    return manifest


def rescored_location(job_output_uri: str, model: ResolvedModel) -> str:
    """Where a re-scored copy of a job's output goes by default: beside it, named for the version."""
    return f"{job_output_uri.rstrip('/')}-rescored-{model.name}-v{model.version}"


def pin(storage: StorageSettings, reference: str) -> ResolvedModel:
    """Resolve a reference in the registry the settings name."""
    return ModelRegistry.from_settings(storage).resolve(reference)

