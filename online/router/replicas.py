"""The router's replicas: their groups, health, breakers and loads, and the order to try them in.

State only; no sockets. The active health checks and the DNS refreshes that feed it are the
router's (``online/router/proxy.py``); the decisions are pure functions (``placement``,
``health``) called with this state.

- A replica is *available* when its last health check passed and its breaker lets requests through.
- The *active group* is the group of lowest priority number with an available replica. Traffic
  leaves a group as soon as none of its replicas is available, and comes back to a higher-priority
  group only once that group has been available for ``failback_s`` (hysteresis: a group that
  flaps does not pull traffic back and forth).
- ``order(key)`` lists the available replicas to try: the active group's in the key's rendezvous
  order, then the other groups' in priority order (retries go there once the active group is
  spent).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from shardline.online.router.config import RouterConfig
from shardline.online.router.health import Breaker, BreakerPolicy, OutlierPolicy, latency_outliers
from shardline.online.router.placement import rank

RANK_CACHE = 4096  # keys whose replica order is remembered (per membership change)
EWMA_WEIGHT = 0.1  # of each answer in a replica's moving average of latency per model
MAX_MODELS_TIMED = 256  # models whose latency one replica keeps


@dataclass
class Replica:
    """One replica as the router sees it."""

    url: str
    group: str
    breaker: Breaker
    healthy: bool = False  # its last /v2/health/ready answered 200 (False until the first check)
    in_flight: int = 0
    latency: dict[str, tuple[float, int]] = field(default_factory=dict)  # model -> (EWMA ms, answers)
    ejected_until: float = 0.0  # ejected for latency until then
    ejections: int = 0
    waiting: dict[object, float] = field(default_factory=dict)  # tries sent, answer not yet begun -> when sent
    heard: float = 0.0  # when it last answered (or a stream's piece came)
    probed: float = 0.0  # when its health was last probed for a stalled try
    hung_at: float = -1.0  # when a probe found it hung (it is out until a health check passes)

    def answered(self, model: str, ms: float) -> None:
        """A good answer for ``model`` took ``ms``: into the model's moving average (weight ``EWMA_WEIGHT``)."""
        ewma, n = self.latency.get(model, (ms, 0))
        if len(self.latency) < MAX_MODELS_TIMED or model in self.latency:
            self.latency[model] = (ewma + EWMA_WEIGHT * (ms - ewma), n + 1)


@dataclass
class _Group:
    name: str
    priority: int
    members: list[str] = field(default_factory=list)
    available_since: float | None = None  # when it last became available; None while it is not


class ReplicaSet:
    """The replicas of every group, by URL."""

    def __init__(self, config: RouterConfig, breaker_policy: BreakerPolicy, failback_s: float,
                 clock: Callable[[], float]) -> None:
        self._policy = breaker_policy
        self._failback = failback_s
        self._clock = clock
        self._groups = sorted(
            (_Group(g.name, g.priority) for g in config.groups), key=lambda g: (g.priority, g.name)
        )
        self._by_name = {g.name: g for g in self._groups}
        self.replicas: dict[str, Replica] = {}
        self._active: str | None = None
        self._ranks: dict[tuple[str, str], list[str]] = {}
        for group in config.groups:
            self.set_members(group.name, list(group.replicas))

    def set_members(self, group: str, urls: Iterable[str]) -> None:
        """The replicas of ``group`` are now ``urls`` (a DNS refresh, a local replica restarted on a new
        port): new ones start unhealthy until checked, gone ones are dropped with their state."""
        wanted = list(dict.fromkeys(urls))
        entry = self._by_name[group]
        for url in entry.members:
            if url not in wanted:
                del self.replicas[url]
        for url in wanted:
            if url not in self.replicas:
                self.replicas[url] = Replica(url, group, Breaker(self._policy))
        if wanted != entry.members:
            entry.members = wanted
            self._ranks.clear()

    def groups(self) -> list[tuple[str, list[str]]]:
        """(group, replica URLs) in priority order."""
        return [(g.name, list(g.members)) for g in self._groups]

    def available(self, replica: Replica, now: float) -> bool:
        """Healthy, not ejected for latency, and its breaker would let a request through now."""
        return replica.healthy and now >= replica.ejected_until and not replica.breaker.closed_to(now)

    def eject_outliers(self, now: float, policy: OutlierPolicy) -> list[str]:
        """Eject, group by group, the replicas ``latency_outliers`` names (for ``eject_s``, doubled each time
        after the first); a replica back from ejection starts its figures afresh. Returns those ejected."""
        ejected = []
        for group in self._groups:
            members = [self.replicas[u] for u in group.members]
            for replica in members:
                if replica.ejected_until and now >= replica.ejected_until:
                    replica.ejected_until, replica.latency = 0.0, {}
            timed = {r.url: r.latency for r in members if now >= r.ejected_until and r.healthy}
            out = sum(now < r.ejected_until for r in members)
            for url in latency_outliers(timed, policy):
                if out + 1 > policy.max_fraction * len(members):
                    break
                replica = self.replicas[url]
                replica.ejections += 1
                replica.ejected_until = now + min(policy.max_eject_s, policy.eject_s * 2 ** (replica.ejections - 1))
                out += 1
                ejected.append(url)
        return ejected

    def _update_groups(self, now: float) -> str | None:
        for g in self._groups:
            up = any(self.available(self.replicas[u], now) for u in g.members)
            if not up:
                g.available_since = None
            elif g.available_since is None:
                g.available_since = now
        current = self._by_name.get(self._active) if self._active is not None else None
        if current is None or current.available_since is None:  # nothing active, or it is gone: the best up now
            best = next((g for g in self._groups if g.available_since is not None), None)
            self._active = best.name if best is not None else None
            return self._active
        for g in self._groups:  # a better group back for failback_s takes over
            if g is current:
                break
            if g.available_since is not None and now - g.available_since >= self._failback:
                self._active = g.name
                break
        return self._active

    def active_group(self) -> str | None:
        """The group taking traffic now (None: no replica is available)."""
        return self._update_groups(self._clock())

    def order(self, key: str, prefer: str | None = None) -> list[Replica]:
        """The available replicas to try for ``key``: the active group's in the key's order, then the
        other groups' (by priority, each in the key's order); with ``prefer``, that group's first (a model's
        cheaper group, for a tenant past its budget's soft limit)."""
        now = self._clock()
        active = self._update_groups(now)
        groups = sorted(self._groups, key=lambda g: (g.name != prefer, g.name != active))  # stable: the rest by priority
        found: list[Replica] = []
        for g in groups:
            for url in self._ranked(key, g):
                replica = self.replicas[url]
                if self.available(replica, now):
                    found.append(replica)
        return found

    def _ranked(self, key: str, group: _Group) -> list[str]:
        cached = self._ranks.get((group.name, key))
        if cached is None:
            if len(self._ranks) >= RANK_CACHE:
                self._ranks.clear()
            cached = self._ranks[(group.name, key)] = rank(key, group.members)
        return cached
