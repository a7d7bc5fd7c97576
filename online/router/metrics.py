"""The router's Prometheus metrics, on a listener of their own (they name tenants' models), for
dashboards and for an autoscaler (a KEDA Prometheus trigger or an HPA on external metrics).

Per request, counted as it is answered:

- ``shardline_router_requests_total{model, code}``: answers by model version (``name:version``; ``-``
  for requests that name none, those the router refused itself, and those naming a version not known to exist:
  a version a client names labels the series only once a replica answered it below 400, or the router pinned it
  itself, so names made up by clients cannot grow them) and status code;
- ``shardline_router_request_seconds{model}``: the router's whole time for it, retries included;
- ``shardline_router_retries_total{model}``: tries on another replica;
- ``shardline_router_fallbacks_total{model, variant}``: answers a model's fallback variant gave;
- ``shardline_router_budget_requests_total{tenant, state}``: requests of tenants past a threshold of their monthly
  budget (docs/cost.md, "Budgets"): warn and soft (sent on, marked; soft to the model's cheaper group), hard (429);
- ``shardline_router_hedges_total{winner}``: hedged requests (a second copy sent), by whose answer was used;
- ``shardline_router_ejections_total{group, replica}``: replicas ejected for latency;
- ``shardline_router_hung_total{group, replica}``: replicas taken out because a stalled try's health probe went
  unanswered (``RouterService``'s stall watch), each with its waiting tries moved to other replicas;
- ``shardline_router_rollout_answers_total{model, arm, error}``: answers during a rollout, by the
  version answered, the arm (``baseline`` or ``candidate``) and whether it was a server error;
- ``shardline_router_shadow_rows_total{model, agree}``: rows of shadow answers compared with the
  primary's, by candidate version and whether they agreed (``online/router/compare.py``).
- ``shardline_router_fast_lane_requests_total{model}``: requests the data plane in front took without
  the router (``nginx_front``), read from it; they are not in the series above;
  ``shardline_router_fast_lane_retries_total{group}``: its tries on another replica of the group.
- ``shardline_rate_limited_total{tenant, quota}``: requests refused over a tenant's quota (429) by the router or
  the data plane in front (read from it), by quota: rate, concurrency, streams, tokens, budget. It has a server's
  name, so the dashboards and runbooks that sum a server's refusals sum the routers' too: a request is refused in
  one place only (one a router refuses never reaches a replica).

Read at each scrape from the router's state (nothing on the request path):

- ``shardline_router_in_flight{model}``: requests being answered now, by model (the fast lane's
  included, as last read): the demand an autoscaler scales replicas on;
- ``shardline_router_replica_in_flight{group, replica}``, ``shardline_router_replica_available{group,
  replica}`` (1 ready with its breaker letting requests through, else 0) and
  ``shardline_router_breaker_state{group, replica}`` (0 closed, 1 half-open, 2 open);
- for an autoscaler: ``shardline_router_replicas_wanted{group}`` (what the group's demand wants at
  ``target_in_flight`` per replica; for the router's own scaled replicas, its scaler's figure),
  ``shardline_router_replicas{group}`` and ``shardline_router_queued{model}`` (requests held
  while a replica starts from zero); ``shardline_router_cold_start_seconds`` is a histogram of
  local replicas' starts.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter as Tally
from typing import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from shardline.online.router.replicas import ReplicaSet
from shardline.online.router.scaling import Activator

BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}
COLD_START_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RouterMetrics:
    """The router's series in a registry of their own."""

    def __init__(self, replicas: ReplicaSet, clock: Callable[[], float], target_in_flight: float = 4.0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # The two series every request adds to are plain tallies, exported at each scrape (_StateCollector):
        # prometheus_client's labels().inc() and observe() take a lock each, on every request (figures: bench/README.md, "Figures behind the code").
        self.requests: Tally[tuple[str, int]] = Tally()  # (model, status) -> answers
        self.latency: dict[str, list[float]] = {}  # model -> answers per bucket (the last: over every bound), sum
        self.retries = Counter("shardline_router_retries_total", "Tries on another replica", ["model"],
                               registry=self.registry)
        self.rollout_answers = Counter("shardline_router_rollout_answers_total", "Answers during a rollout",
                                       ["model", "arm", "error"], registry=self.registry)
        self.shadow = Counter("shardline_router_shadow_rows_total", "Shadow answer rows compared with the primary's",
                              ["model", "agree"], registry=self.registry)
        self.fallbacks = Counter("shardline_router_fallbacks_total", "Answers a model's fallback variant gave",
                                 ["model", "variant"], registry=self.registry)
        self.budget_requests = Counter("shardline_router_budget_requests_total", "Requests of tenants past a "
                                       "threshold of their monthly budget, by state: warn, soft (sent on, marked), "
                                       "hard (refused, 429)", ["tenant", "state"], registry=self.registry)
        self.hedges = Counter("shardline_router_hedges_total", "Second copies sent after the hedge delay, by which "
                              "copy's answer was used", ["winner"], registry=self.registry)
        self.ejections = Counter("shardline_router_ejections_total", "Replicas ejected for latency", ["group", "replica"],
                                 registry=self.registry)
        self.hung = Counter("shardline_router_hung_total", "Replicas taken out because a stalled try's health probe "
                            "went unanswered (their waiting tries moved to other replicas)", ["group", "replica"],
                            registry=self.registry)
        self.cold_starts = Histogram("shardline_router_cold_start_seconds", "From a local replica's start to its "
                                     "first ready answer", buckets=COLD_START_BUCKETS, registry=self.registry)
        self.in_flight: Tally[str] = Tally()
        # What the data plane's fast lane carries (``nginx_front``), as last read from it: in flight by model
        # and by replica url, and requests by model and retries by group since it started.
        self.front_in_flight: dict[str, int] = {}
        self.front_replicas: dict[str, int] = {}
        self.front_requests: dict[str, int] = {}
        self.front_retries: dict[str, int] = {}
        self.rate_limited: Tally[tuple[str, str]] = Tally()  # (tenant, quota) -> refused, the fast lane's included
        self.wanted: dict[str, int] = {}  # group -> replicas its scaler wants (local autoscaling)
        self.target_in_flight = target_in_flight
        self.activator: Activator | None = None
        self.registry.register(_StateCollector(self, replicas, clock))

    def started(self, model: str) -> None:
        """A request for ``model`` is being answered."""
        self.in_flight[model] += 1

    def answered(self, model: str, status: int, seconds: float, retries: int, started: str | None = None) -> None:
        """A request for ``model`` was answered ``status`` after ``seconds`` and ``retries`` retries; ``started``:
        the label it was ``started`` with when that was another (``-``: its version was not known to exist yet)."""
        self.in_flight[model if started is None else started] -= 1
        self.requests[(model, status)] += 1
        counts = self.latency.get(model)
        if counts is None:
            counts = self.latency[model] = [0.0] * (len(LATENCY_BUCKETS) + 2)
        counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        counts[-1] += seconds
        if retries:
            self.retries.labels(model).inc(retries)

    def refused(self, status: int) -> None:
        """A request the router answered itself with an error before any replica (a wrong key, an unknown model, a
        quota, a bad body), as ``-``: ``answered``'s requests name the version, which it was refused before pinning."""
        self.requests[("-", status)] += 1

    def fallback(self, model: str, variant: str) -> None:
        """A fallback group's replica answered with the model's variant."""
        self.fallbacks.labels(model, variant).inc()

    def hedged(self, second_won: bool) -> None:
        """A hedged request was answered, by its second copy or its first."""
        self.hedges.labels("second" if second_won else "first").inc()

    def cold_start(self, seconds: float) -> None:
        """A replica the router started answered ready after ``seconds``."""
        self.cold_starts.observe(seconds)

    def rollout_answer(self, model: str, arm: str, error: bool) -> None:
        """An answer of one arm of a rollout."""
        self.rollout_answers.labels(model, arm, "true" if error else "false").inc()

    def shadow_rows(self, model: str, rows: int, disagree: int) -> None:
        """A shadow answer compared: ``rows`` rows, ``disagree`` of them disagreeing."""
        if rows - disagree:
            self.shadow.labels(model, "true").inc(rows - disagree)
        if disagree:
            self.shadow.labels(model, "false").inc(disagree)

    def exposition(self) -> tuple[bytes, str]:
        """Every series in Prometheus' text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _StateCollector(Collector):
    def __init__(self, metrics: RouterMetrics, replicas: ReplicaSet, clock: Callable[[], float]) -> None:
        self.metrics, self.replicas, self.clock = metrics, replicas, clock

    def collect(self) -> Iterator[Metric]:
        yield from self._answers()
        now = self.clock()
        demand = GaugeMetricFamily("shardline_router_in_flight", "Requests being answered, by model", labels=["model"])
        models = Tally(self.metrics.in_flight)
        models.update(self.metrics.front_in_flight)
        for model, count in sorted(models.items()):
            demand.add_metric([model], count)
        in_flight = GaugeMetricFamily("shardline_router_replica_in_flight", "Requests at a replica now",
                                      labels=["group", "replica"])
        available = GaugeMetricFamily("shardline_router_replica_available",
                                      "1 when the replica is ready and its breaker lets requests through",
                                      labels=["group", "replica"])
        breaker = GaugeMetricFamily("shardline_router_breaker_state", "0 closed, 1 half-open, 2 open",
                                    labels=["group", "replica"])
        group_demand: Tally[str] = Tally()
        members: Tally[str] = Tally()
        front = self.metrics.front_replicas
        for replica in list(self.replicas.replicas.values()):
            labels = [replica.group, replica.url]
            busy = replica.in_flight + front.get(replica.url, 0)
            in_flight.add_metric(labels, busy)
            available.add_metric(labels, 1 if self.replicas.available(replica, now) else 0)
            breaker.add_metric(labels, BREAKER_STATES[replica.breaker.state])
            group_demand[replica.group] += busy
            members[replica.group] += 1
        queued = GaugeMetricFamily("shardline_router_queued", "Requests held while a replica starts, by model",
                                   labels=["model"])
        activator = self.metrics.activator
        for model, count in sorted((activator.waiting if activator is not None else {}).items()):
            queued.add_metric([model], count)
        held = activator.total if activator is not None else 0
        wanted = GaugeMetricFamily("shardline_router_replicas_wanted", "Replicas the group's demand wants at the "
                                   "target in flight per replica", labels=["group"])
        running = GaugeMetricFamily("shardline_router_replicas", "Replicas the group has now", labels=["group"])
        active = self.replicas.active_group()
        for name, _ in self.replicas.groups():
            figure = self.metrics.wanted.get(name)
            if figure is None:
                load = group_demand[name] + (held if name == active else 0)
                figure = math.ceil(load / self.metrics.target_in_flight)
            wanted.add_metric([name], figure)
            running.add_metric([name], members[name])
        yield from (demand, in_flight, available, breaker, queued, wanted, running)

    def _answers(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("shardline_router_requests", "Requests answered by the router",
                                       labels=["model", "code"])
        for (model, status), count in sorted(self.metrics.requests.items()):
            requests.add_metric([model, str(status)], count)
        seconds = HistogramMetricFamily("shardline_router_request_seconds",
                                        "The router's time per request, retries included", labels=["model"])
        bounds = [*(floatToGoString(b) for b in LATENCY_BUCKETS), "+Inf"]
        for model, counts in sorted(self.metrics.latency.items()):
            cumulative = list(itertools.accumulate(counts[:-1]))
            seconds.add_metric([model], list(zip(bounds, cumulative)), counts[-1])
        fast = CounterMetricFamily("shardline_router_fast_lane_requests", "Requests nginx in front took "
                                   "itself, by model version (read from it every half second)", labels=["model"])
        for model, count in sorted(self.metrics.front_requests.items()):
            fast.add_metric([model], count)
        fast_retries = CounterMetricFamily("shardline_router_fast_lane_retries", "Tries of nginx in front on "
                                           "another replica, by group (read from it every half second)",
                                           labels=["group"])
        for group, count in sorted(self.metrics.front_retries.items()):
            fast_retries.add_metric([group], count)
        refused = CounterMetricFamily("shardline_rate_limited", "Requests refused over a tenant's quota (429) by the "
                                      "router or the data plane in front", labels=["tenant", "quota"])
        for (tenant, quota), count in sorted(self.metrics.rate_limited.items()):
            refused.add_metric([tenant, quota], count)
        yield from (requests, seconds, fast, fast_retries, refused)
