"""The rollout flows: start one (gates -> offline replay -> first record), end one by hand, and tell
people about one that was rolled back (``rollout-notice``, run by the automation in prefect.yaml).

Routers do the rest (``online/router/rollouts.py``): they split traffic, step, promote and roll
back by themselves, each move a record in the alias's log. Every start and end emits a Prefect
event on ``shardline.model.<name>`` (``shardline.rollout.started`` / ``promoted`` / ``aborted``;
routers emit ``stepped`` / ``promoted`` / ``rolled-back``) that automations can answer.
"""

from __future__ import annotations

from typing import Any, Literal

from prefect import flow
from prefect.events import emit_event
from prefect.states import Failed, State

from shardline.errors import ShardlineError
from shardline.quality.gates import refusal
from shardline.settings import StorageSettings
from shardline.storage import rollouts
from shardline.storage.capture import capture_root
from shardline.storage.registry import AliasMove, ModelRegistry
from shardline.storage.rollouts import RollbackCriteria
from shardline.tasks.promotion import prepare_promotion, run_gates
from shardline.tasks.notifications import record_notification
from shardline.tasks.rollout import replay, replay_refusal


def emit_rollout_event(event: str, move: AliasMove, name: str, alias: str, registry: str) -> None:
    """``shardline.rollout.<event>`` on ``shardline.model.<name>``, with the record's rollout and reason."""
    rollout = move.rollout
    emit_event(
        event=f"shardline.rollout.{event}",
        resource={"prefect.resource.id": f"shardline.model.{name}", "shardline.alias": alias},
        payload={"model": name, "alias": alias, "rollout": rollout.id if rollout else None, "version": move.version,
                 "candidate": rollout.candidate if rollout else None, "baseline": rollout.baseline if rollout else None,
                 "mode": rollout.mode if rollout else None, "reason": move.reason, "record": move.seq, "by": move.by,
                 "registry": registry},
    )


@flow(name="start-rollout", log_prints=True)
def start_rollout(
    candidate: str,
    alias: str = "prod",
    mode: Literal["canary", "shadow"] = "canary",
    steps: list[float] | None = None,
    shadow: float = 0.0,
    interval_s: float | None = None,
    criteria: dict[str, Any] | None = None,
    by: str | None = None,
    reason: str = "",
) -> dict[str, Any] | State[Any]:
    """Start a rollout of ``candidate`` (``name:version``) on ``name@alias`` once the promotion gates and the
    offline replay pass.

    Returns:
        The first record and every gate's verdict, with the replay's report; a Failed state holding
        GateFailed when a gate or the replay refused, or RolloutConflict when a rollout runs on the model.
    """
    storage = StorageSettings()
    try:  # before the gates: they take seconds, and their verdict would not matter
        rollouts.refuse_if_running(ModelRegistry(storage.registry, storage.storage_options), candidate.split(":")[0])
    except ShardlineError as e:
        return Failed(message=str(e), data=e)
    plan = prepare_promotion(candidate, alias, storage.registry, None, storage.storage_options)
    results = run_gates(plan, False)
    refused = refusal(plan.candidate.pinned, alias, results)
    if refused is not None:
        return Failed(message=str(refused), data=refused)
    offline = replay(plan, capture_root(storage))
    refused = replay_refusal(plan, offline)
    if refused is not None:
        return Failed(message=str(refused), data=refused)
    registry = ModelRegistry(plan.registry_url, storage.storage_options)
    try:
        move = rollouts.start(
            registry, plan.candidate.name, alias, plan.candidate.version, mode=mode, steps=tuple(steps or ()),
            shadow=shadow, interval_s=interval_s, criteria=RollbackCriteria(**(criteria or {})), offline=offline,
            by=by, reason=reason,
        )
    except ShardlineError as e:  # another rollout started meanwhile, or the alias moved: a verdict, no traceback
        return Failed(message=str(e), data=e)
    emit_rollout_event("started", move, plan.candidate.name, alias, plan.registry_url)
    return {
        "model": plan.candidate.name, "alias": alias, "record": move.seq, "rollout": move.rollout,
        "gates": [{"gate": r.gate, "passed": r.passed, "detail": r.detail} for r in results], "replay": offline,
    }


@flow(name="end-rollout", log_prints=True)
def end_rollout(name: str, alias: str = "prod", action: Literal["promote", "abort"] = "promote",
                by: str | None = None, reason: str = "") -> AliasMove | State[Any]:
    """Promote the candidate of the rollout on ``name@alias`` now, or abort it (the alias stays on the baseline).

    Returns:
        The record that ended it; a Failed state holding RolloutConflict when none runs there.
    """
    storage = StorageSettings()
    registry = ModelRegistry(storage.registry, storage.storage_options)
    try:
        if action == "promote":
            move = rollouts.promote(registry, name, alias, by=by, reason=reason)
        else:
            move = rollouts.roll_back(registry, name, alias, reason=f"aborted by hand{': ' + reason if reason else ''}",
                                      by=by)
    except ShardlineError as e:  # a verdict (none runs, or it moved meanwhile), not a crash: no traceback
        return Failed(message=str(e), data=e)
    emit_rollout_event("promoted" if action == "promote" else "aborted", move, name, alias, registry.url)
    return move


@flow(name="rollout-notice", log_prints=True)
def rollout_notice(event: str, model: str, alias: str, rollout: str = "", candidate: int | None = None,
                   baseline: int | None = None, reason: str = "", by: str = "") -> str:
    """Tell people what a rollout event says (an automation runs it on ``shardline.rollout.rolled-back``):
    a notification under ``<home>/notifications/rollouts/`` and a markdown artifact; returns its URL."""
    notice = {"event": event, "model": model, "alias": alias, "rollout": rollout, "candidate": candidate,
              "baseline": baseline, "reason": reason, "by": by,
              "action": f"{model}@{alias} is on version {baseline}; see `shardline rollout status {model} --alias "
                        f"{alias}`"}
    return record_notification(StorageSettings(), notice, topic="rollouts", subject="model", title="Rollout")
