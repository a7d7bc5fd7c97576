"""The router's Prometheus metrics, on a listener of their own (they name tenants' models), for
dashboards and for an autoscaler (a KEDA Prometheus trigger or an HPA on external metrics).

Per request, counted as it is answered:

- ``shardline_router_requests_total{model, code}``: answers by model version (``name:version``; ``-``
  for requests that name none) and status code;
- ``shardline_router_request_seconds{model}``: the router's whole time for it, retries included;
- ``shardline_router_retries_total{model}``: tries on another replica;
- ``shardline_router_rollout_answers_total{model, arm, error}``: answers during a rollout, by the
  version answered, the arm (``baseline`` or ``candidate``) and whether it was a server error;
- ``shardline_router_shadow_rows_total{model, agree}``: rows of shadow answers compared with the
  primary's, by candidate version and whether they agreed (``online/router/compare.py``).

Read at each scrape from the router's state (nothing on the request path):

- ``shardline_router_in_flight{model}``: requests being answered now, by model: the demand an
  autoscaler scales replicas on;
- ``shardline_router_replica_in_flight{group, replica}``, ``shardline_router_replica_available{group,
  replica}`` (1 ready with its breaker letting requests through, else 0) and
  ``shardline_router_breaker_state{group, replica}`` (0 closed, 1 half-open, 2 open).
"""

from __future__ import annotations

from collections import Counter as Tally
from typing import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shardline.online.router.replicas import ReplicaSet

BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RouterMetrics:
    """The router's series in a registry of their own."""

    def __init__(self, replicas: ReplicaSet, clock: Callable[[], float]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("shardline_router_requests_total", "Requests answered by the router",
                                ["model", "code"], registry=self.registry)
        self.seconds = Histogram("shardline_router_request_seconds", "The router's time per request, retries included",
                                 ["model"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.retries = Counter("shardline_router_retries_total", "Tries on another replica", ["model"],
                               registry=self.registry)
        self.rollout_answers = Counter("shardline_router_rollout_answers_total", "Answers during a rollout",
                                       ["model", "arm", "error"], registry=self.registry)
        self.shadow = Counter("shardline_router_shadow_rows_total", "Shadow answer rows compared with the primary's",
                              ["model", "agree"], registry=self.registry)
        self.in_flight: Tally[str] = Tally()
        self.registry.register(_StateCollector(self, replicas, clock))

    def started(self, model: str) -> None:
        """A request for ``model`` is being answered."""
        self.in_flight[model] += 1

    def answered(self, model: str, status: int, seconds: float, retries: int) -> None:
        """A request for ``model`` was answered ``status`` after ``seconds`` and ``retries`` retries."""
        self.in_flight[model] -= 1
        self.requests.labels(model, str(status)).inc()
        self.seconds.labels(model).observe(seconds)
        if retries:
            self.retries.labels(model).inc(retries)

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
        now = self.clock()
        demand = GaugeMetricFamily("shardline_router_in_flight", "Requests being answered, by model", labels=["model"])
        for model, count in sorted(self.metrics.in_flight.items()):
            demand.add_metric([model], count)
        in_flight = GaugeMetricFamily("shardline_router_replica_in_flight", "Requests at a replica now",
                                      labels=["group", "replica"])
        available = GaugeMetricFamily("shardline_router_replica_available",
                                      "1 when the replica is ready and its breaker lets requests through",
                                      labels=["group", "replica"])
        breaker = GaugeMetricFamily("shardline_router_breaker_state", "0 closed, 1 half-open, 2 open",
                                    labels=["group", "replica"])
        for replica in list(self.replicas.replicas.values()):
            labels = [replica.group, replica.url]
            in_flight.add_metric(labels, replica.in_flight)
            available.add_metric(labels, 1 if self.replicas.available(replica, now) else 0)
            breaker.add_metric(labels, BREAKER_STATES[replica.breaker.state])
        yield from (demand, in_flight, available, breaker)
