"""Prefect task of the rollout flow: the offline stage, before any live traffic.

``replay`` scores rows with the baseline and the candidate side by side and compares the answers
with the router's own judgement (``online/router/compare.py``): the candidate's golden set, and
the baseline's captured online requests (the newest ``max_rows`` of its capture, when the
servers capture: ``SHARDLINE_ONLINE_CAPTURE_RATE``). ``replay_refusal`` refuses (``GateFailed``,
gate ``replay``) a candidate that fails on rows the baseline answers: live traffic would fail the
same way. Disagreement is reported, not refused: a new version is expected to differ somewhat;
the live criteria judge it.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from prefect import task
from prefect.cache_policies import NO_CACHE

from shardline.agreement import Comparison, compare
from shardline.bundle import ModelRef
from shardline.errors import GateFailed
from shardline.event_catalog import ROLLOUT_ABORTED, ROLLOUT_PROMOTED, ROLLOUT_STARTED
from shardline.runtimes import Runtime, RuntimeOptions, create_runtime
from shardline.settings import StorageSettings
from shardline.storage import rollouts
from shardline.storage.capture import capture_root, scan_capture
from shardline.storage.registry import AliasMove, ModelRegistry, ResolvedModel, fetch_bundle
from shardline.storage.rollouts import RollbackCriteria
from shardline.tasks.events import emit_model_event
from shardline.tasks.logs import run_logger
from shardline.tasks.promotion import PromotionPlan, gate_refusal, prepare_promotion, run_gates

REPLAY_BATCH_ROWS = 512
REPLAY = "replay"


def _numpy(batch: pa.RecordBatch) -> dict[str, np.ndarray]:
    found = {}
    for name, column in zip(batch.schema.names, batch.columns):
        if pa.types.is_fixed_size_list(column.type):
            found[name] = column.flatten().to_numpy(zero_copy_only=False).reshape(len(column), column.type.list_size)
        else:
            found[name] = column.to_numpy(zero_copy_only=False)
    return found


def _loaded(model: ResolvedModel, folder: Path, storage_options: dict[str, Any]) -> Runtime:
    fetch_bundle(model, folder, storage_options)
    runtime = create_runtime(folder, model.manifest, RuntimeOptions(device="cpu"))
    runtime.load()
    return runtime


def _score(baseline: Runtime, candidate: Runtime, batch: pa.RecordBatch, compared: list[Comparison],
           failures: list[str]) -> int:
    """Score one batch with both; the rows the candidate fails on (a failing batch is halved down to its rows,
    so the count is exact), with the first failure named in ``failures``."""
    try:
        expected = baseline.predict(batch)
    except Exception:  # noqa: BLE001 - rows the baseline cannot score say nothing of the candidate
        return 0
    try:
        got = candidate.predict(batch)
    except Exception as e:  # noqa: BLE001 - what live traffic would meet: counted, and named once
        if batch.num_rows == 1:
            if not failures:
                failures.append(f"{type(e).__name__}: {str(e)[:160]}")
            return 1
        half = batch.num_rows // 2
        return (_score(baseline, candidate, batch.slice(0, half), compared, failures)
                + _score(baseline, candidate, batch.slice(half), compared, failures))
    compared.append(compare(_numpy(expected), _numpy(got)))
    return 0


def _replay_rows(baseline: Runtime, candidate: Runtime, rows: pa.Table) -> dict[str, Any]:
    """Both versions on the same rows: rows, rows the candidate failed on, and how the answers compared."""
    compared: list[Comparison] = []
    failures: list[str] = []
    failed = sum(_score(baseline, candidate, batch, compared, failures)
                 for batch in rows.combine_chunks().to_batches(max_chunksize=REPLAY_BATCH_ROWS))
    rows_compared = sum(c.rows for c in compared)
    disagree = sum(c.disagree for c in compared)
    label_rows = sum(c.label_rows for c in compared)
    return {
        "rows": rows.num_rows, "compared": rows_compared, "failed": failed, "failure": failures[0] if failures else "",
        "disagreement": disagree / rows_compared if rows_compared else 0.0,
        "label_agreement": sum(c.label_agree for c in compared) / label_rows if label_rows else None,
        "max_delta": max((c.max_delta for c in compared), default=0.0),
    }


def replay_refusal(plan: PromotionPlan, report: dict[str, Any]) -> GateFailed | None:
    """The refusal of a candidate that failed on replayed rows the baseline answered, or None."""
    failing = [(source, found) for source, found in report.items() if isinstance(found, dict) and found.get("failed")]
    if not failing or plan.current is None:
        return None
    source, found = failing[0]
    return GateFailed(
        f"{plan.candidate.pinned} failed on {found['failed']} of {found['rows']} {source} rows that "
        f"{plan.current.pinned} answers ({found['failure']}); fix it before any live traffic reaches it", REPLAY,
    )


@task(name="replay", cache_policy=NO_CACHE)
def replay(plan: PromotionPlan, capture_root: str, max_rows: int = 10_000) -> dict[str, Any]:
    """Score the golden set and the baseline's captured requests with both versions (see the module
    docstring); ``replay_refusal`` reads the report."""
    if plan.current is None:
        return {"skipped": "no baseline to compare with"}
    logger = run_logger()
    candidate_manifest = plan.candidate.manifest
    names = list(plan.current.manifest.signature.input_names)
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        baseline = _loaded(plan.current, Path(folder) / "baseline", plan.storage_options)
        candidate = _loaded(plan.candidate, Path(folder) / "candidate", plan.storage_options)
        try:
            if candidate_manifest.evaluation is not None:
                golden = pq.read_table(Path(folder) / "candidate" / candidate_manifest.evaluation.golden)
                report["golden"] = _replay_rows(baseline, candidate, golden.select(names))
            captured = scan_capture(capture_root, plan.current.name, version=plan.current.version, tier="online",
                                    storage_options=plan.storage_options)
            present = [n for n in names if n in captured.collect_schema().names()]
            rows = captured.select(present).tail(max_rows).collect().to_arrow() if present == names else None
            if rows is not None and rows.num_rows:
                report["captured"] = _replay_rows(baseline, candidate, rows)
            else:
                report["captured"] = {"rows": 0, "note": f"nothing captured of {plan.current.pinned} online"}
        finally:
            baseline.close()
            candidate.close()
    for source, found in report.items():
        (logger.warning if found.get("failed") else logger.info)(
            "replay of %s rows against %s: %s", source, plan.current.pinned, found)
    return report


# -- what the rollout flows ask of the registry (flows/rollout.py only wires these) -------------------------------


def emit_rollout_event(event: str, move: AliasMove, name: str, alias: str, registry: str) -> None:
    """A ``shardline.rollout.*`` event on ``shardline.model.<name>``, with the record's rollout and reason (the
    version is the one the alias points at after the record)."""
    rollout = move.rollout
    emit_model_event(event, name, move.version, alias, {
        "model": name, "rollout": rollout.id if rollout else None, "candidate": rollout.candidate if rollout else None,
        "baseline": rollout.baseline if rollout else None, "mode": rollout.mode if rollout else None,
        "reason": move.reason, "record": move.seq, "by": move.by, "registry": registry,
    })


def refuse_if_running(storage: StorageSettings, candidate: str) -> None:
    """Before the gates (they take seconds, and their verdict would not matter): raises RolloutConflict when a rollout
    runs on the candidate's model (InvalidSetting: ``candidate`` is no model reference)."""
    rollouts.refuse_if_running(ModelRegistry.from_settings(storage), ModelRef.parse(candidate).name)


@dataclass(frozen=True)
class Checked:
    """A candidate through the promotion gates and the offline replay: the plan, each gate's verdict, the replay's
    report, and the refusal (None: it may start)."""

    plan: PromotionPlan
    results: list[Any]
    replay: dict[str, Any] | None
    refused: GateFailed | None


def check_candidate(storage: StorageSettings, candidate: str, alias: str) -> Checked:
    """The promotion gates, then (when they pass) the offline replay on the captured traffic."""
    plan = prepare_promotion(candidate, alias, storage, None)
    results = run_gates(plan, False)
    refused = gate_refusal(plan, alias, results)
    if refused is not None:
        return Checked(plan, results, None, refused)
    offline = replay(plan, capture_root(storage))
    return Checked(plan, results, offline, replay_refusal(plan, offline))


def begin_rollout(storage: StorageSettings, checked: Checked, alias: str, mode: str, steps: tuple[float, ...],
                  shadow: float, interval_s: float | None, criteria: dict[str, Any] | None, by: str | None,
                  reason: str) -> AliasMove:
    """The rollout's first record (the routers do the rest), and its event.

    Raises:
        RolloutConflict, AliasConflict: another rollout started meanwhile, or the alias moved.
    """
    plan = checked.plan
    move = rollouts.start(
        plan.registry(), plan.candidate.name, alias, plan.candidate.version,
        mode=mode, steps=steps, shadow=shadow, interval_s=interval_s, criteria=RollbackCriteria(**(criteria or {})),
        offline=checked.replay, by=by, reason=reason,
    )
    emit_rollout_event(ROLLOUT_STARTED, move, plan.candidate.name, alias, plan.registry_url)
    return move


def end_rollout_now(storage: StorageSettings, name: str, alias: str, action: str, by: str | None,
                    reason: str) -> AliasMove:
    """Promote the candidate of the rollout on ``name@alias`` now, or abort it; and its event.

    Raises:
        RolloutConflict: none runs there (or it moved meanwhile).
    """
    registry = ModelRegistry.from_settings(storage)
    if action == "promote":
        move = rollouts.promote(registry, name, alias, by=by, reason=reason)
    else:
        move = rollouts.roll_back(registry, name, alias, reason=f"aborted by hand{': ' + reason if reason else ''}",
                                  by=by)
    emit_rollout_event(ROLLOUT_PROMOTED if action == "promote" else ROLLOUT_ABORTED, move, name, alias, registry.url)
    return move
