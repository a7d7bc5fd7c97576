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
from prefect.states import Failed, State

from shardline.errors import ShardlineError
from shardline.settings import StorageSettings
from shardline.tasks.notifications import record_notification
from shardline.tasks.rollout import AliasMove, begin_rollout, check_candidate, end_rollout_now, refuse_if_running


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
    try:
        refuse_if_running(storage, candidate)
    except ShardlineError as e:
        return Failed(message=str(e), data=e)
    checked = check_candidate(storage, candidate, alias)
    if checked.refused is not None:
        return Failed(message=str(checked.refused), data=checked.refused)
    try:
        move = begin_rollout(storage, checked, alias, mode, tuple(steps or ()), shadow, interval_s, criteria, by, reason)
    except ShardlineError as e:  # another rollout started meanwhile, or the alias moved: a verdict, no traceback
        return Failed(message=str(e), data=e)
    return {
        "model": checked.plan.candidate.name, "alias": alias, "record": move.seq, "rollout": move.rollout,
        "gates": [{"gate": r.gate, "passed": r.passed, "detail": r.detail} for r in checked.results],
        "replay": checked.replay,
    }


@flow(name="end-rollout", log_prints=True)
def end_rollout(name: str, alias: str = "prod", action: Literal["promote", "abort"] = "promote",
                by: str | None = None, reason: str = "") -> AliasMove | State[Any]:
    """Promote the candidate of the rollout on ``name@alias`` now, or abort it (the alias stays on the baseline).

    Returns:
        The record that ended it; a Failed state holding RolloutConflict when none runs there.
    """
    try:
        return end_rollout_now(StorageSettings(), name, alias, action, by, reason)
    except ShardlineError as e:  # a verdict (none runs, or it moved meanwhile), not a crash: no traceback
        return Failed(message=str(e), data=e)


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
