"""What the release flow (``flows/release.py``) asks of the registry: where prod stands, and the routers'
verdict on a canary, followed until the rollout ends (the flow only wires these together)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from shardline.bundle import ModelRef
from shardline.errors import InvalidInput, InvalidSetting
from shardline.settings import StorageSettings
from shardline.storage import rollouts
from shardline.storage.registry import AliasMove, ModelRegistry


@dataclass(frozen=True)
class Candidate:
    """The version a release takes to prod, and where prod stands now."""

    name: str
    version: int
    prod: AliasMove | None  # prod's newest record; None: the model has no prod yet

    @property
    def on_prod_already(self) -> bool:
        """Prod is on this version and no rollout runs there (a re-run of a finished release)."""
        return self.prod is not None and self.prod.version == self.version and rollouts.active(self.prod) is None


def release_candidate(storage: StorageSettings, candidate: str) -> Candidate:
    """``candidate`` (``name:version``) and prod's newest record.

    Raises:
        InvalidInput: the candidate is not ``name:version``.
    """
    try:
        ref = ModelRef.parse(candidate)
    except InvalidSetting as e:
        raise InvalidInput(f"{e}; push the bundle first and give the version `shardline model push` printed, "
                           "e.g. churn:4") from e
    if ref.version is None:
        raise InvalidInput(f"the candidate {candidate!r} is not name:version; push the bundle first and give the "
                           "version `shardline model push` printed, e.g. churn:4")
    return Candidate(ref.name, ref.version, ModelRegistry.from_settings(storage).current_move(ref.name, "prod"))


@dataclass(frozen=True)
class Verdict:
    """How a canary ended: ``promoted``, ``rolled back``, ``moved`` (prod moved by someone else meanwhile) or
    ``still running`` (past the wait); the message says it as the run's outcome."""

    outcome: str
    message: str
    records: list[dict[str, Any]]


def await_verdict(storage: StorageSettings, candidate: Candidate, rollout_id: str, wait_s: float,
                  poll_s: float) -> Verdict:
    """Follow prod's newest record every ``poll_s`` until the canary ``rollout_id`` ends, or ``wait_s`` passes."""
    registry = ModelRegistry.from_settings(storage)
    name, pinned = candidate.name, f"{candidate.name}:{candidate.version}"
    deadline = time.monotonic() + wait_s
    while True:
        move = registry.current_move(name, "prod")
        if move is not None and move.rollout is not None and move.rollout.id == rollout_id and move.action not in (
                "canary", "shadow"):
            records = [{"seq": m.seq, "action": m.action, "version": m.version,
                        "weight": m.rollout.weight if m.rollout else None, "by": m.by, "reason": m.reason}
                       for m in registry.alias_history(name, "prod") if m.rollout is not None and m.rollout.id == rollout_id]
            if move.action == "promote":
                return Verdict("promoted", f"{name}@prod -> {candidate.version}: the canary passed every step", records)
            return Verdict("rolled back", f"{name}@prod stays on {move.version}: the canary of {pinned} was rolled "
                                          f"back ({move.reason})", records)
        if move is not None and (move.rollout is None or move.rollout.id != rollout_id):
            return Verdict("moved", f"{name}@prod moved to {move.version} by {move.by} ({move.reason or move.action}) "
                                    f"while the canary of {pinned} ran", [])
        if time.monotonic() >= deadline:
            return Verdict("still running", f"the canary of {pinned} still runs after {wait_s:g} s; the routers go on "
                                            f"with it: follow it with `shardline rollout status {name}`", [])
        time.sleep(poll_s)
