"""Prometheus metrics of the online tier, in a registry of their own (one per server).

Counters and histograms are updated as things happen; the gauges an autoscaler reads
(queue depth, requests in flight, loaded models, idle seconds) are read from the data
plane when Prometheus scrapes, so they are never stale. Model labels are set only for
models a tenant may call, so unknown names sent by clients cannot grow the series.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_MAX_CACHED = 4096  # label sets kept (a bound, should labels ever grow)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)


@dataclass(frozen=True)
class ModelState:
    """What the gauges show for one served version."""

    model: str
    version: str
    loaded: bool
    queued: dict[str, int]
    in_flight: int
    idle_seconds: float


@dataclass(frozen=True)
class Snapshot:
    """Everything the gauges show, read at scrape time."""

    models: list[ModelState]
    tenants_in_flight: dict[str, int] = field(default_factory=dict)


class _Gauges(Collector):
    def __init__(self, read: Callable[[], Snapshot]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        snapshot = self._read()
        queued = GaugeMetricFamily("shardline_queue_depth", "Requests queued per model version and priority class.",
                                   labels=["model", "version", "priority"])
        in_flight = GaugeMetricFamily("shardline_model_in_flight", "Requests in batches running now.",
                                      labels=["model", "version"])
        loaded = GaugeMetricFamily("shardline_model_loaded", "1 while the version is loaded, 0 when scaled to zero.",
                                   labels=["model", "version"])
        idle = GaugeMetricFamily("shardline_model_idle_seconds", "Seconds since the version was last used.",
                                 labels=["model", "version"])
        for m in snapshot.models:
            for priority, depth in m.queued.items():
                queued.add_metric([m.model, m.version, priority], depth)
            in_flight.add_metric([m.model, m.version], m.in_flight)
            loaded.add_metric([m.model, m.version], 1.0 if m.loaded else 0.0)
            idle.add_metric([m.model, m.version], m.idle_seconds)
        total = GaugeMetricFamily("shardline_loaded_models", "Model versions loaded now.")
        total.add_metric([], sum(1 for m in snapshot.models if m.loaded))
        tenants = GaugeMetricFamily("shardline_tenant_in_flight", "Requests in flight per tenant.", labels=["tenant"])
        for tenant, count in snapshot.tenants_in_flight.items():
            tenants.add_metric([tenant], count)
        yield from (queued, in_flight, loaded, idle, total, tenants)


class Metrics:
    """The server's metrics; ``exposition()`` is what ``/metrics`` answers."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("shardline_requests", "HTTP requests answered.",
                                ["protocol", "model", "version", "tenant", "code"], registry=r)
        self.latency = Histogram("shardline_request_seconds", "Time from request to response.",
                                 ["protocol", "model", "version", "tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_rows = Histogram("shardline_batch_rows", "Rows per batch sent to a model.",
                                    ["model", "version"], buckets=ROW_BUCKETS, registry=r)
        self.batch_requests = Histogram("shardline_batch_requests", "Requests per batch sent to a model.",
                                        ["model", "version"], buckets=ROW_BUCKETS, registry=r)
        self.batch_seconds = Histogram("shardline_batch_seconds", "Time to score one batch (with any load).",
                                       ["model", "version"], buckets=LATENCY_BUCKETS, registry=r)
        self.shed = Counter("shardline_shed", "Requests shed under overload (503).",
                            ["model", "version", "tenant", "priority"], registry=r)
        self.rate_limited = Counter("shardline_rate_limited", "Requests refused over a tenant's quota (429).",
                                    ["tenant", "quota"], registry=r)
        self.loads = Counter("shardline_model_loads", "Times a version was loaded.", ["model", "version"], registry=r)
        self.unloads = Counter("shardline_model_unloads", "Times an idle version was unloaded (scale to zero).",
                               ["model", "version"], registry=r)
        # Labelled children, looked up once per label set (the label sets are bounded: see the module docstring).
        self._request_children: dict[tuple[str, str, str, str, int], tuple[Any, Any]] = {}
        self._batch_children: dict[tuple[str, str], tuple[Any, Any, Any]] = {}

    def watch(self, read: Callable[[], Snapshot]) -> None:
        """Read the gauges from ``read`` at every scrape."""
        self.registry.register(_Gauges(read))

    def observe_request(self, protocol: str, model: str, version: str, tenant: str, code: int, seconds: float) -> None:
        """Count one answered request and its latency."""
        key = (protocol, model, version, tenant, code)
        children = self._request_children.get(key)
        if children is None:  # labels() validates and locks on every call: look each series up once
            if len(self._request_children) > _MAX_CACHED:
                self._request_children.clear()
            children = (self.requests.labels(protocol, model, version, tenant, str(code)),
                        self.latency.labels(protocol, model, version, tenant))
            self._request_children[key] = children
        children[0].inc()
        children[1].observe(seconds)

    def observe_batch(self, model: str, version: str, rows: int, requests: int, seconds: float) -> None:
        """Record one batch the model scored."""
        key = (model, version)
        children = self._batch_children.get(key)
        if children is None:
            if len(self._batch_children) > _MAX_CACHED:
                self._batch_children.clear()
            children = (self.batch_rows.labels(model, version), self.batch_requests.labels(model, version),
                        self.batch_seconds.labels(model, version))
            self._batch_children[key] = children
        children[0].observe(rows)
        children[1].observe(requests)
        children[2].observe(seconds)

    def exposition(self) -> tuple[bytes, str]:
        """The metrics in Prometheus' text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
