"""Prefect tasks of the promotion flow: copy across registries, run the gates, move the alias."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from prefect import task
from prefect.cache_policies import NO_CACHE

from shardline.errors import GateFailed, InvalidBundle, InvalidInput
from shardline.event_catalog import MODEL_PROMOTED
from shardline.quality.evaluation import evaluate
from shardline.quality.gates import (
    GateResult,
    checksum_gate,
    evaluation_gate,
    reference_profile_gate,
    refusal,
    signature_gate,
)
from shardline.runtimes import RuntimeOptions, create_runtime
from shardline.settings import StorageSettings
from shardline.storage.registry import AliasMove, ModelRegistry, ResolvedModel, fetch_bundle
from shardline.tasks.events import emit_model_event
from shardline.tasks.logs import run_logger


@dataclass
class PromotionPlan:
    """The candidate pinned in the registry it will be promoted in, and the alias as it was read."""

    candidate: ResolvedModel
    current: ResolvedModel | None
    expected_seq: int
    registry_url: str
    storage_options: dict[str, Any]

    def registry(self) -> ModelRegistry:
        """The registry the candidate is promoted in."""
        return ModelRegistry(self.registry_url, self.storage_options)


@task(name="prepare-promotion", cache_policy=NO_CACHE)
def prepare_promotion(
    reference: str, to_alias: str, storage: StorageSettings, target_registry_url: str | None
) -> PromotionPlan:
    """Pin the candidate in the settings' registry; when promoting into another registry, copy it there and verify
    it on arrival."""
    storage_options = storage.storage_options
    source = ModelRegistry.from_settings(storage)
    candidate = source.resolve(reference)
    target = source
    if target_registry_url and target_registry_url != source.url:
        target = ModelRegistry(target_registry_url, storage_options)
        with tempfile.TemporaryDirectory() as folder:
            fetch_bundle(candidate, Path(folder), storage_options)
            target.push(folder, keep_version=True)
        candidate = target.resolve(candidate.pinned)
        run_logger().info("copied %s to %s", candidate.pinned, target.url)
    current_move = target.current_move(candidate.name, to_alias)
    current = target.resolve(f"{candidate.name}:{current_move.version}") if current_move else None
    return PromotionPlan(candidate, current, current_move.seq if current_move else 0, target.url, storage_options)


@task(name="gates", cache_policy=NO_CACHE)
def run_gates(plan: PromotionPlan, allow_breaking: bool) -> list[GateResult]:
    """Run every gate on a fresh copy of the candidate, as stored in the target registry."""
    manifest = plan.candidate.manifest
    results = [signature_gate(manifest, plan.current.manifest if plan.current else None, allow_breaking)]
    with tempfile.TemporaryDirectory() as folder:
        bundle = Path(folder)
        fetch_bundle(plan.candidate, bundle, plan.storage_options, verify=False)  # the checksum gate checks it
        results.append(checksum_gate(bundle, manifest))
        score, problem = None, None
        if results[-1].passed and manifest.evaluation is not None:
            model = create_runtime(bundle, manifest, RuntimeOptions(device="cpu"))
            model.load()
            try:
                score = evaluate(model, manifest, pq.read_table(bundle / manifest.evaluation.golden))
            except (InvalidBundle, InvalidInput) as e:  # a golden set the model cannot score: the gate's verdict
                problem = str(e)
            finally:
                model.close()
        results.append(evaluation_gate(manifest, score, problem))
        results.append(reference_profile_gate(bundle, manifest))
    logger = run_logger()
    for result in results:
        (logger.info if result.passed else logger.warning)("gate %s: %s: %s", result.gate,
                                                          "pass" if result.passed else "REFUSED", result.detail)
    return results


def announce_promotion(plan: PromotionPlan, to_alias: str, move: AliasMove) -> None:
    """``shardline.model.promoted`` for the alias moved."""
    emit_model_event(MODEL_PROMOTED, plan.candidate.name, move.version, to_alias,
                     {"previous": move.previous, "by": move.by, "registry": plan.registry_url})


def gate_refusal(plan: PromotionPlan, to_alias: str, results: list[GateResult]) -> GateFailed | None:
    """The gates' verdict as the refusal a flow returns (None: every gate passed)."""
    return refusal(plan.candidate.pinned, to_alias, results)


@task(name="move-alias", cache_policy=NO_CACHE)
def move_alias(plan: PromotionPlan, to_alias: str, results: list[GateResult], by: str | None, reason: str) -> AliasMove:
    """Move the alias if every gate passed and nobody moved it since the plan read it.

    Raises:
        GateFailed: a gate refused (the flow checks first; this guards direct calls).
        AliasConflict: the alias moved while the gates ran.
    """
    error = refusal(plan.candidate.pinned, to_alias, results)
    if error is not None:
        raise error
    return plan.registry().move_alias(
        plan.candidate.name, to_alias, plan.candidate.version, action="promote",
        expected_seq=plan.expected_seq, by=by, reason=reason,
    )
