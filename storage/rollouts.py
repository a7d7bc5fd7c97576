"""Rollouts: a candidate version takes an alias's traffic in steps (canary) or sees a mirrored share
of it (shadow), then is promoted or rolled back. The state is the alias's own log.

While a rollout runs, the alias's newest record has action ``canary`` (or ``shadow``) and carries
the ``Rollout``; its ``version`` is still the baseline, so whatever resolves the alias (batch jobs,
a server on its own) keeps the baseline and only routers split traffic. Each step is one more
record; so is the end: action ``promote`` (the candidate) or ``rollback`` (the baseline, after a
breach or an abort). ``shardline model history NAME`` lists them all.

Every change is the registry's compare-and-swap on the log (``ModelRegistry.move_alias``): of two
routers deciding at once one moves it and the other is told (``AliasConflict``) and reads it
again, so several routers agree, and a router that restarts finds the rollout where it was.
One rollout per model at a time: a start is refused while any alias of the model has one.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable, Literal

from pydantic import BaseModel, Field

from shardline import durations
from shardline.errors import InvalidSetting, ModelNotFound, RolloutConflict

if TYPE_CHECKING:
    from shardline.storage.registry import AliasMove, ModelRegistry

Mode = Literal["canary", "shadow"]


class RollbackCriteria(BaseModel):
    """When a router rolls a rollout back by itself, over a sliding window of what it routed."""

    window_s: float = Field(default=60.0, gt=0, description="The window the rates and p99s are taken over.")
    min_requests: int = Field(
        default=50, ge=1, description="No verdict (no rollback, no step) before the candidate has this many "
        "answers (or shadow comparisons) in the window.",
    )
    max_error_increase: float = Field(
        default=0.01, ge=0, le=1, description="Roll back when the candidate's share of server errors (5xx, not "
        "a shed 503) passes the baseline's by more than this.",
    )
    max_p99_ratio: float = Field(
        default=1.5, ge=1, description="Roll back when the candidate's p99 passes the baseline's times this "
        "(plus p99_slack_ms); needs min_requests of each.",
    )
    p99_slack_ms: float = Field(default=5.0, ge=0, description="Added to the baseline's p99 before comparing.")
    max_disagreement: float = Field(
        default=0.01, ge=0, le=1, description="Shadow: roll back when more than this share of compared answers "
        "disagree with the baseline's.",
    )


class Rollout(BaseModel):
    """A rollout in progress, as the alias's records carry it."""

    id: str = Field(description="Unique per rollout; callers are split by a hash of it and their key.")
    candidate: int
    baseline: int
    mode: Mode
    steps: tuple[float, ...] = Field(default=(), description="Canary: the candidate's share of callers, in percent, step by step.")
    step: int = Field(default=0, ge=0, description="Index of the current step.")
    shadow: float = Field(default=0.0, ge=0, le=1, description="Shadow: the share of requests mirrored to the candidate.")
    interval_s: float | None = Field(
        default=None, gt=0, description="A step lasts this long before the next (then promotion); None: by hand only."
    )
    criteria: RollbackCriteria = Field(default_factory=RollbackCriteria)
    started_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    offline: dict[str, Any] = Field(default_factory=dict, description="The replay before any live traffic.")
    observed: dict[str, Any] = Field(default_factory=dict, description="What the router that last moved it saw.")

    @property
    def weight(self) -> float:
        """The candidate's share of callers now, in percent (0 in shadow: it answers nobody)."""
        return self.steps[self.step] if self.mode == "canary" else 0.0

    def describe(self) -> str:
        """One line: mode, candidate, where it is."""
        if self.mode == "shadow":
            return f"shadow of version {self.candidate}: {self.shadow:.0%} of requests mirrored"
        return (f"canary of version {self.candidate}: step {self.step + 1} of {len(self.steps)}, {self.weight:g}% of "
                f"callers")


def active(move: AliasMove | None) -> Rollout | None:
    """The rollout an alias's newest record says runs, or None."""
    return move.rollout if move is not None and move.action in ("canary", "shadow") else None


def parse_duration(text: str) -> float:
    """``90``, ``30s``, ``10m``, ``1h30m``, ``500ms`` -> seconds (``shardline.durations``: a bare number is seconds).

    Raises:
        InvalidSetting: not a positive duration.
    """
    return durations.parse_duration(text, bare_seconds=True).total_seconds()


def parse_share(text: str) -> float:
    """``10%`` or ``0.1`` -> 0.1.

    Raises:
        InvalidSetting: not a share in (0, 1].
    """
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise InvalidSetting(f"{text!r} is not a share of traffic; write e.g. 10% or 0.1")
    return value


def parse_steps(text: str) -> tuple[float, ...]:
    """``1,5,25,100`` -> (1.0, 5.0, 25.0, 100.0): percents, rising, in (0, 100].

    Raises:
        InvalidSetting: not such a list.
    """
    try:
        steps = tuple(float(part.strip().rstrip("%")) for part in text.split(",") if part.strip())
    except ValueError:
        steps = ()
    if not steps or any(not 0 < s <= 100 for s in steps) or list(steps) != sorted(set(steps)):
        raise InvalidSetting(f"steps {text!r} are not rising percents in (0, 100]; write e.g. 1,5,25,100")
    return steps


def running(registry: ModelRegistry, name: str) -> tuple[str, AliasMove, Rollout] | None:
    """The rollout that runs on any alias of the model: (alias, its newest record, the rollout), or None."""
    for alias, move in registry.current_moves(name).items():
        rollout = active(move)
        if rollout is not None:
            return alias, move, rollout
    return None


def refuse_if_running(registry: ModelRegistry, name: str) -> None:
    """Raise RolloutConflict, saying which and what to do, when a rollout runs on any alias of the model."""
    busy = running(registry, name)
    if busy is not None:
        other_alias, _, other = busy
        raise RolloutConflict(
            f"a rollout runs on {name} already ({name}@{other_alias}: {other.describe()}); one rollout per model at "
            f"a time: promote or abort it first (`shardline rollout abort {name} --alias {other_alias}`)"
        )


def check_start(registry: ModelRegistry, name: str, alias: str, candidate: int) -> AliasMove:
    """What a start needs, checked (the CLI checks it before the gates run): no rollout on the model, the
    candidate in the registry, the alias set to another version. Returns the alias's newest record.

    Raises:
        RolloutConflict, ModelNotFound, InvalidSetting: as ``start``.
    """
    refuse_if_running(registry, name)
    registry.get_manifest(name, candidate)
    current = registry.current_move(name, alias)
    if current is None:
        raise ModelNotFound(f"{name}@{alias} was never set, so there is no baseline to roll out against; set it "
                            f"first (`shardline model alias {name} {alias} VERSION`)", f"{name}@{alias}")
    if candidate == current.version:
        raise InvalidSetting(f"{name}:{candidate} is what {name}@{alias} points at already; roll out another version")
    return current


def start(
    registry: ModelRegistry, name: str, alias: str, candidate: int, *, mode: Mode, steps: tuple[float, ...] = (),
    shadow: float = 0.0, interval_s: float | None = None, criteria: RollbackCriteria | None = None,
    offline: dict[str, Any] | None = None, by: str | None = None, reason: str = "",
) -> AliasMove:
    """Start a rollout of ``name:candidate`` on ``name@alias`` (the alias's version is the baseline).

    Raises:
        RolloutConflict: a rollout runs on the model already.
        ModelNotFound: the alias was never set, or the candidate does not exist.
        InvalidSetting: the candidate is the baseline, or the mode's steps or share are missing.
    """
    current = check_start(registry, name, alias, candidate)
    if mode == "canary" and not steps:
        raise InvalidSetting("a canary needs its steps, e.g. --steps 1,5,25,100")
    if mode == "shadow" and not shadow:
        raise InvalidSetting("a shadow rollout needs the share to mirror, e.g. --shadow 10%")
    rollout = Rollout(
        id=uuid.uuid4().hex[:12], candidate=candidate, baseline=current.version, mode=mode, steps=steps,
        shadow=shadow, interval_s=interval_s, criteria=criteria or RollbackCriteria(), offline=offline or {},
    )
    return registry.move_alias(
        name, alias, current.version, action=mode, expected_seq=current.seq, by=by, rollout=rollout,
        reason=reason or f"rollout {rollout.id} started: {rollout.describe()}",
    )


def _running_on(registry: ModelRegistry, name: str, alias: str, rollout_id: str | None) -> tuple[AliasMove, Rollout]:
    move = registry.current_move(name, alias)
    rollout = active(move)
    if move is None or rollout is None or (rollout_id is not None and rollout.id != rollout_id):
        raise RolloutConflict(f"no rollout{'' if rollout_id is None else ' ' + rollout_id} runs on {name}@{alias} "
                              f"(see `shardline rollout status {name} --alias {alias}`)")
    return move, rollout


def advance(
    registry: ModelRegistry, name: str, alias: str, *, rollout_id: str | None = None, expected_seq: int | None = None,
    observed: dict[str, Any] | None = None, by: str | None = None,
) -> AliasMove:
    """The next step of a canary, or its promotion after the last one.

    Raises:
        RolloutConflict: no such rollout runs (it ended, or another one runs).
        AliasConflict: the alias moved since ``expected_seq``.
    """
    move, rollout = _running_on(registry, name, alias, rollout_id)
    if rollout.mode == "shadow" or rollout.step + 1 >= len(rollout.steps):
        return promote(registry, name, alias, rollout_id=rollout.id, expected_seq=expected_seq, observed=observed,
                       by=by, reason=f"rollout {rollout.id}: {rollout.describe()} held; promoted")
    stepped = rollout.model_copy(update={"step": rollout.step + 1, "observed": observed or {}})
    return registry.move_alias(
        name, alias, move.version, action="canary", expected_seq=expected_seq if expected_seq is not None else move.seq,
        by=by, rollout=stepped, reason=f"rollout {rollout.id}: step {stepped.step + 1} of {len(stepped.steps)}, "
        f"{stepped.weight:g}% of callers",
    )


def promote(
    registry: ModelRegistry, name: str, alias: str, *, rollout_id: str | None = None, expected_seq: int | None = None,
    observed: dict[str, Any] | None = None, by: str | None = None, reason: str = "",
) -> AliasMove:
    """Point the alias at the candidate: the rollout ends.

    Raises:
        RolloutConflict: no such rollout runs.
        AliasConflict: the alias moved since ``expected_seq``.
    """
    return _end(registry, name, alias, "promote", lambda r: reason or f"rollout {r.id}: promoted by hand ({r.describe()})",
                rollout_id, expected_seq, observed, by)


def roll_back(
    registry: ModelRegistry, name: str, alias: str, *, reason: str, rollout_id: str | None = None,
    expected_seq: int | None = None, observed: dict[str, Any] | None = None, by: str | None = None,
) -> AliasMove:
    """End the rollout with the alias on the baseline (a breach, or an abort).

    Raises:
        RolloutConflict: no such rollout runs.
        AliasConflict: the alias moved since ``expected_seq``.
    """
    return _end(registry, name, alias, "rollback", lambda r: f"rollout {r.id}: {reason}", rollout_id, expected_seq,
                observed, by)


def _end(registry: ModelRegistry, name: str, alias: str, action: Literal["promote", "rollback"],
         reason: Callable[[Rollout], str], rollout_id: str | None, expected_seq: int | None,
         observed: dict[str, Any] | None, by: str | None) -> AliasMove:
    """The record that ends the running rollout: the candidate (promote) or the baseline (rollback)."""
    move, rollout = _running_on(registry, name, alias, rollout_id)
    ended = rollout.model_copy(update={"observed": observed or rollout.observed})
    return registry.move_alias(
        name, alias, rollout.candidate if action == "promote" else rollout.baseline, action=action,
        expected_seq=expected_seq if expected_seq is not None else move.seq, by=by, rollout=ended,
        reason=reason(rollout),
    )


# -- whether a canary's steps can reach their minimum answers (``shardline rollout start`` warns) -------------


class ObservedTraffic(BaseModel):
    """An alias's request rate as the routers last reported it: during its newest rollout that has reports."""

    requests_per_s: float = Field(ge=0, description="Requests to the alias per second, all routers together.")
    rollout_id: str
    at: datetime | None = Field(default=None, description="When the newest report was written.")


def observed_traffic(registry: ModelRegistry, name: str, alias: str) -> ObservedTraffic | None:
    """The requests per second the routers saw on ``name@alias``, from the reports they wrote during its newest
    rollout that has any (``<name>/rollouts/<id>/<router>.json``: each router's answers over the window, both
    arms; a shadow's mirrored requests not counted twice). None when no router has reported on the alias.

    Nothing else a command can read without a running router records an alias's traffic: capture holds a
    sample of rows, not requests, and the routers' request counters live in their /metrics."""
    seen: set[str] = set()
    for move in reversed(registry.alias_history(name, alias)):
        rollout = move.rollout
        if rollout is None or rollout.id in seen:
            continue
        seen.add(rollout.id)
        reports = registry.rollout_reports(name, rollout.id).values()
        rates, times = [], []
        for report in reports:
            window = float(report.get("window_s") or rollout.criteria.window_s)
            counted = report.get("baseline", {}).get("requests", 0)
            if rollout.mode == "canary":
                counted += report.get("candidate", {}).get("requests", 0)
            rates.append(counted / window)
            with_time = report.get("at")
            if with_time:
                times.append(datetime.fromisoformat(str(with_time)))
        if rates:
            return ObservedTraffic(requests_per_s=sum(rates), rollout_id=rollout.id, at=max(times, default=None))
    return None


def needed_rate(step: float, criteria: RollbackCriteria) -> float:
    """Requests per second to an alias that give a step of ``step`` percent ``min_requests`` candidate answers
    in the window (on average: callers, not requests, are split)."""
    return criteria.min_requests / criteria.window_s * 100 / step


def _rate(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def reach_warning(reference: str, steps: tuple[float, ...], criteria: RollbackCriteria,
                  traffic: ObservedTraffic | None) -> str | None:
    """One line for a canary whose steps cannot reach ``min_requests`` candidate answers in the window at the
    alias's observed traffic (such a step holds: no step, no automatic rollback), or, with no traffic known,
    the rule for its first step; None when every step reaches it."""
    first = steps[0]
    if traffic is None:
        return (f"no traffic of {reference} is recorded (routers report it during rollouts); step {first:g}% needs "
                f"{criteria.min_requests} candidate answers in {criteria.window_s:g} s, i.e. about "
                f"{_rate(needed_rate(first, criteria))} requests/s to the alias; at lower traffic use larger steps or "
                "--min-requests")
    short = [s for s in steps if needed_rate(s, criteria) > traffic.requests_per_s]
    if not short:
        return None
    when = f", {traffic.at:%Y-%m-%d %H:%M} UTC" if traffic.at is not None else ""
    listed = ", ".join(f"{s:g}%" for s in short)
    return (f"the routers last saw about {_rate(traffic.requests_per_s)} requests/s on {reference} (rollout "
            f"{traffic.rollout_id}{when}); step{'s' if len(short) > 1 else ''} {listed} cannot reach "
            f"{criteria.min_requests} candidate answers in {criteria.window_s:g} s at that rate, so the rollout would "
            f"hold there (no step, no automatic rollback): step {first:g}% needs about "
            f"{_rate(needed_rate(first, criteria))} requests/s; use larger steps or a lower --min-requests")
