"""The router's side of rollouts (the state is the registry's: ``storage/rollouts.py``).

- **Which version a request gets.** ``RolloutBook.route(name, alias, caller)``: the alias's
  version, or during a canary the candidate for the callers whose hash bucket (of the rollout's
  id and the caller: the request key ``X-Shardline-Route-Key`` when sent, else the tenant) falls
  under the step's weight. A caller keeps its version within a step, and one on the candidate
  stays on it as the weight rises. During a shadow rollout every caller gets the baseline, and
  a random ``shadow`` share of requests is also sent to the candidate, whose answer is compared
  (``compare``) and never returned.
- **What each arm did.** Per rollout, a sliding window of the baseline's and the candidate's
  answers (server error or not, the router's latency) and of the shadow comparisons. A replica's
  first answer of a version counts for errors but not for the p99: it likely paid the model's load.
- **What to do** (``verdict``, pure): roll back when the candidate breaches a criterion over at
  least ``min_requests`` of its answers in the window (error share above the baseline's by more
  than ``max_error_increase``; p99 above the baseline's times ``max_p99_ratio`` plus
  ``p99_slack_ms``, once each arm has ``P99_MIN_ANSWERS`` timed answers, the baseline's from the
  step before when it gets none now; shadow disagreement above ``max_disagreement``); else, once a step has lasted
  its ``interval_s`` with ``min_requests`` candidate answers and no breach, step (or promote
  after the last step); else hold. A shadow rollout only rolls back by itself: its promotion is
  by hand.
- **Refresh.** ``refresh()`` (every ``rollout_refresh_s``) reads the newest record of every alias
  the tenants call, decides for each running rollout, makes the move in the registry (a
  compare-and-swap: a router that loses it reads again), emits ``shardline.rollout.stepped`` /
  ``promoted`` / ``rolled-back``, and stores what it saw (``rollout status`` reads it).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Awaitable, Callable, Deque, Literal

from shardline.agreement import Comparison
from shardline.errors import AliasConflict
from shardline.event_catalog import ROLLOUT_PROMOTED, ROLLOUT_ROLLED_BACK, ROLLOUT_STEPPED
from shardline.storage import rollouts
from shardline.storage.registry import AliasMove, ModelRegistry
from shardline.storage.rollouts import RollbackCriteria, Rollout

log = logging.getLogger(__name__)

Arm = Literal["baseline", "candidate"]
P99_MIN_ANSWERS = 100  # a p99 of fewer answers is their maximum: latency is judged from this many of each arm
Emit = Callable[[str, str, str, dict[str, Any]], None]  # event, model, alias, payload
RunBlocking = Callable[[Callable[[], Any]], Awaitable[Any]]


@dataclass(frozen=True)
class Route:
    """The version a request is sent to, and what the rollout (if one runs) makes of it."""

    version: int
    arm: Arm | None = None  # None: no rollout runs on the alias
    rollout: Rollout | None = None
    shadow: int | None = None  # a version to mirror the request to


def bucket(rollout_id: str, caller: str) -> float:
    """The caller's place in [0, 100) for one rollout: fixed for the rollout, independent between rollouts."""
    digest = hashlib.blake2b(f"{rollout_id}|{caller}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 * 100


def pick(move: AliasMove, caller: str, draw: float) -> Route:
    """The route for one request on an alias whose newest record is ``move`` (``draw`` uniform in [0, 1))."""
    rollout = rollouts.active(move)
    if rollout is None:
        return Route(move.version)
    if rollout.mode == "shadow":
        return Route(rollout.baseline, "baseline", rollout, rollout.candidate if draw < rollout.shadow else None)
    if bucket(rollout.id, caller) < rollout.weight:
        return Route(rollout.candidate, "candidate", rollout)
    return Route(rollout.baseline, "baseline", rollout)


@dataclass
class Window:
    """Answers of one arm: (time, server error, seconds or None when left out of the p99), oldest first."""

    answers: Deque[tuple[float, bool, float | None]] = field(default_factory=collections.deque)

    def add(self, now: float, error: bool, seconds: float | None) -> None:
        self.answers.append((now, error, seconds))

    def trim(self, since: float) -> None:
        while self.answers and self.answers[0][0] < since:
            self.answers.popleft()

    def summary(self) -> dict[str, Any]:
        """Count, errors, error share and p99 (ms) of the answers held."""
        n = len(self.answers)
        errors = sum(1 for _, e, _ in self.answers if e)
        timed = [s for _, _, s in self.answers if s is not None]
        return {"requests": n, "errors": errors, "error_rate": errors / n if n else 0.0, "timed": len(timed),
                "p99_ms": _p99(timed) * 1000 if timed else None}


@dataclass
class ShadowWindow:
    """Shadow comparisons: (time, Comparison), oldest first."""

    compared: Deque[tuple[float, Comparison]] = field(default_factory=collections.deque)
    skipped: int = 0  # mirrors not sent: too many in flight

    def add(self, now: float, comparison: Comparison) -> None:
        self.compared.append((now, comparison))

    def trim(self, since: float) -> None:
        while self.compared and self.compared[0][0] < since:
            self.compared.popleft()

    def summary(self) -> dict[str, Any]:
        """Rows compared, rows disagreeing and their share, label agreement, largest delta, lowest cosine."""
        found = [c for _, c in self.compared]
        rows = sum(c.rows for c in found)
        disagree = sum(c.disagree for c in found)
        label_rows = sum(c.label_rows for c in found)
        cosines = [c.min_cosine for c in found if c.min_cosine is not None]
        return {
            "answers": len(found), "rows": rows, "disagree": disagree,
            "disagreement": disagree / rows if rows else 0.0,
            "label_agreement": sum(c.label_agree for c in found) / label_rows if label_rows else None,
            "max_delta": max((c.max_delta for c in found), default=0.0),
            "min_cosine": min(cosines) if cosines else None, "skipped": self.skipped,
        }


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


@dataclass(frozen=True)
class Verdict:
    """What a router does about a rollout now, and why (written to the alias history)."""

    action: Literal["hold", "advance", "rollback"]
    reason: str


def verdict(rollout: Rollout, observed: dict[str, Any], step_age_s: float) -> Verdict:
    """Roll back, step (promote after the last step) or hold, from what the window holds (module docstring)."""
    criteria: RollbackCriteria = rollout.criteria
    base, cand, shadow = observed["baseline"], observed["candidate"], observed.get("shadow")
    need = criteria.min_requests
    if cand["requests"] >= need:
        increase = cand["error_rate"] - (base["error_rate"] if base["requests"] else 0.0)
        if increase > criteria.max_error_increase:
            return Verdict("rollback", f"candidate error rate {cand['error_rate']:.1%} ({cand['errors']} of "
                                       f"{cand['requests']}) against the baseline's {base['error_rate']:.1%}: more "
                                       f"than {criteria.max_error_increase:.1%} above it")
        timed = max(need, P99_MIN_ANSWERS)
        earlier = rollout.observed.get("baseline", {})
        baseline_p99 = (base["p99_ms"] if base.get("timed", 0) >= timed else
                        earlier.get("p99_ms") if earlier.get("timed", 0) >= timed else None)
        if baseline_p99 is not None and cand["p99_ms"] is not None and cand.get("timed", 0) >= timed:
            limit = baseline_p99 * criteria.max_p99_ratio + criteria.p99_slack_ms
            if cand["p99_ms"] > limit:
                return Verdict("rollback", f"candidate p99 {cand['p99_ms']:.1f} ms against the baseline's "
                                           f"{baseline_p99:.1f} ms: over {limit:.1f} ms")
    if shadow is not None and shadow["rows"] >= need and shadow["disagreement"] > criteria.max_disagreement:
        return Verdict("rollback", f"shadow answers disagree on {shadow['disagreement']:.1%} of {shadow['rows']} rows "
                                   f"(at most {criteria.max_disagreement:.1%} allowed)")
    if rollout.mode == "shadow":
        return Verdict("hold", "a shadow is promoted or aborted by hand")
    if rollout.interval_s is None:
        return Verdict("hold", "no interval: it holds this step until `shardline rollout promote` or abort")
    if step_age_s < rollout.interval_s:
        return Verdict("hold", f"step {rollout.step + 1} runs {rollout.interval_s - step_age_s:.0f} s more")
    if cand["requests"] < need:
        return Verdict("hold", f"waiting for {need - cand['requests']} more candidate answers in the window")
    last = rollout.step + 1 >= len(rollout.steps)
    return Verdict("advance", f"{'promoted' if last else 'stepped'} after {step_age_s:.0f} s: candidate "
                              f"{cand['requests']} answers, {cand['error_rate']:.1%} errors, p99 "
                              f"{cand['p99_ms']:.1f} ms")


class RolloutBook:
    """What one router knows of the aliases its tenants call, and what it routed during their rollouts."""

    def __init__(self, registry: ModelRegistry, aliases: set[tuple[str, str]], run_blocking: RunBlocking,
                 clock: Callable[[], float], emit: Emit, source: str,
                 wall: Callable[[], datetime] = lambda: datetime.now(timezone.utc)) -> None:
        self.registry = registry
        self.aliases = sorted(aliases)
        self._run = run_blocking
        self._clock = clock
        self._emit = emit
        self._wall = wall
        self.source = source
        self.moves: dict[tuple[str, str], AliasMove | None] = {}
        self.windows: dict[str, dict[Arm, Window]] = {}
        self.shadows: dict[str, ShadowWindow] = {}
        # Called once the aliases are read, before any decision is written: the data plane in front stops answering an
        # alias's requests itself before this router reports it has seen the alias's rollout (``nginx_front``, ``front``).
        self.after_read: Callable[[], Awaitable[None]] | None = None

    def route(self, name: str, alias: str, caller: str, draw: float) -> Route | None:
        """The route for a request, or None when the book has not read the alias (the caller resolves it)."""
        move = self.moves.get((name, alias))
        return pick(move, caller, draw) if move is not None else None

    def record(self, route: Route, status: int, seconds: float | None, shed: bool = False) -> None:
        """An answer of one arm of a rollout (``shed``: a 503 the replica gave on purpose, not an error;
        ``seconds`` None: left out of the p99, as a replica's first answer of a version, which loaded it)."""
        if route.rollout is None or route.arm is None:
            return
        self._arms(route.rollout.id)[route.arm].add(self._clock(), status >= 500 and not shed, seconds)

    def _arms(self, rollout_id: str) -> dict[Arm, Window]:
        arms = self.windows.get(rollout_id)
        if arms is None:
            arms = self.windows[rollout_id] = {"baseline": Window(), "candidate": Window()}
        return arms

    def record_shadow(self, rollout: Rollout, comparison: Comparison | None, status: int,
                      seconds: float | None) -> None:
        """A mirrored request's outcome: its answer's status and time, and how it compared (None: no 2xx)."""
        self.record(Route(rollout.candidate, "candidate", rollout), status, seconds)
        if comparison is not None:
            self.shadows.setdefault(rollout.id, ShadowWindow()).add(self._clock(), comparison)

    def skipped_shadow(self, rollout: Rollout) -> None:
        """A mirror not sent (too many in flight)."""
        self.shadows.setdefault(rollout.id, ShadowWindow()).skipped += 1

    def observed(self, rollout: Rollout) -> dict[str, Any]:
        """What the window holds for a rollout now (what ``verdict`` reads and ``rollout status`` shows)."""
        since = self._clock() - rollout.criteria.window_s
        found: dict[str, Any] = {}
        for arm, window in self._arms(rollout.id).items():
            window.trim(since)
            found[arm] = window.summary()
        if rollout.mode == "shadow":
            shadow = self.shadows.setdefault(rollout.id, ShadowWindow())
            shadow.trim(since)
            found["shadow"] = shadow.summary()
        found["window_s"] = rollout.criteria.window_s
        return found

    async def refresh(self) -> None:
        """Read every alias again, then decide for each rollout that runs (see the module docstring)."""
        for key in self.aliases:
            try:
                self.moves[key] = await self._run(functools.partial(self.registry.current_move, *key))
            except Exception as e:  # noqa: BLE001 - the known record stays in use; read again next round
                log.warning("could not read %s@%s: %s: %s", key[0], key[1], type(e).__name__, e)
        if self.after_read is not None:
            await self.after_read()
        live = set()
        for (name, alias), move in list(self.moves.items()):
            rollout = rollouts.active(move)
            if rollout is None or move is None:
                continue
            live.add(rollout.id)
            await self._decide(name, alias, move, rollout)
        for gone in set(self.windows) - live:
            self.windows.pop(gone, None)
            self.shadows.pop(gone, None)

    async def _decide(self, name: str, alias: str, move: AliasMove, rollout: Rollout) -> None:
        observed = self.observed(rollout)
        age = (self._wall() - move.at).total_seconds()
        decided = verdict(rollout, observed, age)
        report = {"router": self.source, "at": self._wall().isoformat(), "seq": move.seq, "step": rollout.step,
                  "verdict": decided.action, "reason": decided.reason, **observed}
        try:
            await self._run(lambda: self.registry.put_rollout_report(name, rollout.id, self.source, report))
        except Exception as e:  # noqa: BLE001 - a report is for reading; the rollout goes on without it
            log.warning("could not store the report of rollout %s: %s", rollout.id, e)
        if decided.action == "hold":
            return
        try:
            if decided.action == "rollback":
                moved = await self._run(lambda: rollouts.roll_back(
                    self.registry, name, alias, reason=f"rolled back by the router: {decided.reason}",
                    rollout_id=rollout.id, expected_seq=move.seq, observed=observed, by=self.source))
            else:
                moved = await self._run(lambda: rollouts.advance(
                    self.registry, name, alias, rollout_id=rollout.id, expected_seq=move.seq, observed=observed,
                    by=self.source))
        except AliasConflict as e:  # another router (or a person) moved it first: read again next round
            log.info("rollout %s of %s@%s moved elsewhere: %s", rollout.id, name, alias, e)
            return
        self.moves[(name, alias)] = moved
        event = {"rollback": ROLLOUT_ROLLED_BACK, "promote": ROLLOUT_PROMOTED, "canary": ROLLOUT_STEPPED}[moved.action]
        log.warning("rollout %s of %s@%s %s: %s", rollout.id, name, alias, event.rpartition(".")[2], moved.reason)
        self._emit(event, name, alias, {
            "model": name, "alias": alias, "rollout": rollout.id, "version": moved.version, "candidate": rollout.candidate,
            "baseline": rollout.baseline, "weight": moved.rollout.weight if moved.rollout else None,
            "reason": moved.reason, "record": moved.seq, "by": self.source, "observed": observed,
        })
