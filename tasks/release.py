"""Prefect tasks of the release flow (``flows/release.py``): where the alias stands, and the routers' verdict.

The routers step, promote and roll back a canary by themselves, each move a record of the alias's log
(``online/router/rollouts.py``); the release flow follows that log here until its rollout ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from prefect import task
from prefect.cache_policies import NO_CACHE

from shardline.bundle import ModelRef
from shardline.errors import InvalidInput, ShardlineError
from shardline.settings import StorageSettings
from shardline.storage import rollouts
from shardline.storage.registry import AliasMove, ModelRegistry

Outcome = Literal["promoted", "rolled back", "moved", "running"]


@dataclass(frozen=True)
class RolloutVerdict:
    """How a rollout ended as the alias's log tells it: promoted, rolled back (or aborted), the alias moved by
    someone else meanwhile, or still running when the wait ran out; with a sentence and the rollout's records."""

    outcome: Outcome
    message: str
    records: list[dict[str, Any]] = field(default_factory=list)


def pinned_candidate(candidate: str) -> tuple[str, int]:
    """The (name, version) of a release's candidate, which must be pinned (``name:version``).

    Raises:
        InvalidInput: it is not ``name:version`` (an alias, a bare name, or not a reference at all).
    """
    try:
        ref: ModelRef | None = ModelRef.parse(candidate)
    except ShardlineError:
        ref = None
    if ref is None or ref.version is None:
        raise InvalidInput(f"the candidate {candidate!r} is not name:version; push the bundle first and give the "
                           "version `shardline model push` printed, e.g. churn:4")
    return ref.name, ref.version


@task(name="read-alias", cache_policy=NO_CACHE)
def read_alias(storage: StorageSettings, name: str, alias: str) -> AliasMove | None:
    """The alias's newest record (None: it was never set)."""
    return ModelRegistry.from_settings(storage).current_move(name, alias)


def settled_on(move: AliasMove | None, version: int) -> bool:
    """Whether the alias points at ``version`` with no rollout running on it (a release already done)."""
    return move is not None and move.version == version and rollouts.active(move) is None


def rollout_records(registry: ModelRegistry, name: str, alias: str, rollout_id: str) -> list[dict[str, Any]]:
    """The records of one rollout in the alias's log, oldest first, as plain data."""
    return [{"seq": m.seq, "action": m.action, "version": m.version, "weight": m.rollout.weight if m.rollout else None,
             "by": m.by, "reason": m.reason}
            for m in registry.alias_history(name, alias) if m.rollout is not None and m.rollout.id == rollout_id]


def wait_for_verdict(registry: ModelRegistry, name: str, alias: str, rollout_id: str, candidate: str, wait_s: float,
                     poll_s: float, clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], None] = time.sleep) -> RolloutVerdict:
    """Read the alias's newest record every ``poll_s`` until the rollout ``rollout_id`` of ``candidate`` ends, the
    alias moves outside it, or ``wait_s`` passes."""
    deadline = clock() + wait_s
    while True:
        move = registry.current_move(name, alias)
        ours = move is not None and move.rollout is not None and move.rollout.id == rollout_id
        if move is not None and ours and move.action not in ("canary", "shadow"):
            records = rollout_records(registry, name, alias, rollout_id)
            if move.action == "promote":
                return RolloutVerdict("promoted", f"{name}@{alias} -> {move.version}: the canary passed every step",
                                      records)
            return RolloutVerdict("rolled back", f"{name}@{alias} stays on {move.version}: the canary of {candidate} "
                                                 f"was rolled back ({move.reason})", records)
        if move is not None and not ours:
            return RolloutVerdict("moved", f"{name}@{alias} moved to {move.version} by {move.by} "
                                           f"({move.reason or move.action}) while the canary of {candidate} ran")
        if clock() >= deadline:
            return RolloutVerdict("running", f"the canary of {candidate} still runs after {wait_s:g} s; the routers go "
                                             f"on with it: follow it with `shardline rollout status {name}`")
        sleep(poll_s)


@task(name="await-rollout-verdict", cache_policy=NO_CACHE)
def await_rollout_verdict(storage: StorageSettings, name: str, alias: str, rollout_id: str, candidate: str,
                          wait_s: float, poll_s: float) -> RolloutVerdict:
    """The routers' verdict on a rollout, followed in the alias's log (:func:`wait_for_verdict`)."""
    return wait_for_verdict(ModelRegistry.from_settings(storage), name, alias, rollout_id, candidate, wait_s, poll_s)
