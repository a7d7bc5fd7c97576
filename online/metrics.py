"""Prometheus metrics of the online tier, in a registry of their own (one per server).

Counters and histograms are updated as things happen; the gauges an autoscaler reads
(queue depth, requests in flight, loaded models, idle seconds) are read from the data
plane when Prometheus scrapes, so they are never stale. The per-request series (requests,
latency, batch sizes and times) are tallied in plain numbers on the event loop and added
to their Prometheus series in one step at every scrape (``_Tally``): a histogram's
``observe`` takes a lock and walks its buckets, four times a request. Model labels are set only for
models a tenant may call, so unknown names sent by clients cannot grow the series.

With several server processes (``workers`` > 1) the metrics are Prometheus' multiprocess
mode: ``shardline serve`` points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh folder before the
workers start, counters and histograms are summed over the workers, and the supervisor's
metrics listener reads them all (``multiprocess_exposition``). The gauges are then written by each worker from its
data plane (every ``reap_interval_s``) and combined: queue
depth, in flight and tenant in-flight summed over the live workers, loaded the max (1 when
any worker holds the version), idle seconds the min.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterator

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shardline.online import gpu_metrics
from shardline.online.bodies import CLIENT_GONE
from shardline.storage.ledger import LedgerWriter

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_MAX_CACHED = 4096  # label sets kept (a bound, should labels ever grow)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
# The OpenTelemetry GenAI conventions' buckets for gen_ai.server.time_to_first_token and time_per_output_token.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)


class _Tally:
    """The observations of one histogram series (or the increments of one counter series) since
    the last ``flush``, which adds them to the series: a bucket index and two additions each.

    Only for the event loop's thread (observations and flushes must not interleave). A
    histogram's tally adds to its buckets and sum directly (prometheus_client has no public
    call to add many observations at once); ``tally()`` checks that they are there and
    hands back the series itself (observed one at a time) if not, and a unit test
    compares a flushed tally's exposition with that of the same values observed one by one.
    """

    __slots__ = ("series", "bounds", "counts", "total", "pending")

    def __init__(self, series: Any, bounds: list[float] | None) -> None:
        self.series = series
        self.bounds = bounds  # a histogram's upper bounds (the last is +Inf); None: a counter
        self.counts = [0] * len(bounds) if bounds is not None else []
        self.total = 0.0
        self.pending = False

    def observe(self, value: float) -> None:
        """A histogram observation: Prometheus buckets are ``le``, the first bound >= ``value``."""
        self.counts[bisect_left(self.bounds, value)] += 1  # type: ignore[arg-type]
        self.total += value
        self.pending = True

    def inc(self, amount: float = 1) -> None:
        """A counter increment."""
        self.total += amount
        self.pending = True

    def flush(self) -> None:
        """Add what was tallied to the Prometheus series, and start again from nothing."""
        if not self.pending:
            return
        series, total = self.series, self.total
        if self.bounds is None:
            series.inc(total)
        else:
            series._sum.inc(total)
            for bucket, count in zip(series._buckets, self.counts):
                if count:
                    bucket.inc(count)
            self.counts = [0] * len(self.counts)
        self.total = 0.0
        self.pending = False


def _tally(series: Any, tallies: list[_Tally] | None) -> Any:
    """A tally of ``series`` (a labelled child) listed in ``tallies``; the series itself when
    ``tallies`` is None (multiprocess mode: every worker's updates are visible at once) or a
    histogram series lacks the parts ``_Tally.flush`` adds to."""
    if tallies is None:
        return series
    bounds = getattr(series, "_upper_bounds", None)
    if bounds is not None and (not isinstance(getattr(series, "_buckets", None), list)
                               or len(series._buckets) != len(bounds) or not hasattr(series, "_sum")):
        return series
    tally = _Tally(series, list(bounds) if bounds is not None else None)
    tallies.append(tally)
    return tally


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
    engines: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)  # LLM engines' stats by (model, version)


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
        yield from (queued, in_flight, loaded, idle, total, tenants, *_engine_families(snapshot))


_ENGINE_SERIES = (  # (stat, name, help) of an LLM engine's gauges
    ("waiting", "shardline_llm_queued", "Generations waiting for a slot of the model's engine."),
    ("slots_busy", "shardline_llm_slots_busy", "Sequences the model's engine is generating now."),
    ("decode_steps", "shardline_llm_decode_steps", "Decode steps the model's engine has run since it loaded (one "
     "forward pass for every sequence running)."),
)


def _engine_families(snapshot: Snapshot) -> Iterator[Metric]:
    for stat, name, text in _ENGINE_SERIES:
        family = GaugeMetricFamily(name, text, labels=["model", "version"])
        for (model, version), stats in snapshot.engines.items():
            if stat in stats:
                family.add_metric([model, version], stats[stat])
        yield family


def multiprocess_dir() -> str | None:
    """The folder of Prometheus' multiprocess mode when it is on (set by ``shardline serve`` for its workers)."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class _SharedGauges:
    """The gauges in multiprocess mode: written by each worker, combined across live workers."""

    def __init__(self, read: Callable[[], Snapshot], registry: CollectorRegistry) -> None:
        self._read = read
        r = registry
        self.queued = Gauge("shardline_queue_depth", "Requests queued per model version and priority class.",
                            ["model", "version", "priority"], registry=r, multiprocess_mode="livesum")
        self.in_flight = Gauge("shardline_model_in_flight", "Requests in batches running now.",
                               ["model", "version"], registry=r, multiprocess_mode="livesum")
        self.loaded = Gauge("shardline_model_loaded", "1 while the version is loaded, 0 when scaled to zero.",
                            ["model", "version"], registry=r, multiprocess_mode="livemax")
        self.idle = Gauge("shardline_model_idle_seconds", "Seconds since the version was last used.",
                          ["model", "version"], registry=r, multiprocess_mode="livemin")
        self.total = Gauge("shardline_loaded_models", "Model versions loaded now (the most any worker holds).",
                           registry=r, multiprocess_mode="livemax")
        self.tenants = Gauge("shardline_tenant_in_flight", "Requests in flight per tenant.", ["tenant"],
                             registry=r, multiprocess_mode="livesum")

    def refresh(self) -> None:
        snapshot = self._read()
        for m in snapshot.models:
            for priority, depth in m.queued.items():
                self.queued.labels(m.model, m.version, priority).set(depth)
            self.in_flight.labels(m.model, m.version).set(m.in_flight)
            self.loaded.labels(m.model, m.version).set(1.0 if m.loaded else 0.0)
            self.idle.labels(m.model, m.version).set(m.idle_seconds)
        self.total.set(sum(1 for m in snapshot.models if m.loaded))
        for tenant, count in snapshot.tenants_in_flight.items():
            self.tenants.labels(tenant).set(count)


class Metrics:
    """The server's metrics; ``exposition()`` is what the metrics listener's ``/metrics`` answers.

    They name tenants, the models each calls, its traffic and errors: ``shardline serve`` serves
    them on their own listener (loopback by default), never on the tenants' port.

    With a ``ledger`` (``shardline serve``: the metering ledger, ``storage/ledger.py``) the same observations
    are metered per tenant: requests, rows and bytes, tokens, and device time (a batch's time split across
    the tenants by their rows of the bucket; a generation's from its start to its last token)."""

    def __init__(self, ledger: LedgerWriter | None = None) -> None:
        self.ledger = ledger
        self.shared_dir = multiprocess_dir()
        self._shared_gauges: _SharedGauges | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        if self.shared_dir is None and (gpus := gpu_metrics.collector()) is not None:
            r.register(gpus)  # multiprocess mode: the supervisor's exposition reads them (multiprocess_exposition)
        self.requests = Counter("shardline_requests", "HTTP requests by the status of their answer (499: the client "
                                "went away before it was answered).",
                                ["protocol", "model", "version", "tenant", "code"], registry=r)
        self.latency = Histogram("shardline_request_seconds", "Time from request to response (answered requests; "
                                 "not 499s).",
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
        self.budget_requests = Counter("shardline_budget_requests", "Requests of tenants past a threshold of their "
                                       "monthly budget, by state: warn, soft (served, marked), hard (refused, 429).",
                                       ["tenant", "state"], registry=r)
        self.loads = Counter("shardline_model_loads", "Times a version was loaded.", ["model", "version"], registry=r)
        self.device_fallbacks = Counter("shardline_device_fallbacks", "Loads that chose the GPU and ran on the CPU "
                                        "(onnxruntime fell back without a word: the log says why).",
                                        ["model", "version"], registry=r)
        self.oom_splits = Counter("shardline_oom_splits", "Batches split in two after the device ran out of memory.",
                                  ["model", "version"], registry=r)
        self.unloads = Counter("shardline_model_unloads", "Times an idle version was unloaded (scale to zero).",
                               ["model", "version"], registry=r)
        self.captured = Counter("shardline_capture_rows", "Rows sampled for capture: kept, or dropped because "
                                "the capture store fell behind.", ["model", "version", "outcome"], registry=r)
        # LLM generation: time to first token, time between tokens, tokens per tenant, streams in flight.
        self.llm_ttft = Histogram("shardline_llm_time_to_first_token_seconds", "From a generation's start to its "
                                  "first token.", ["model", "version", "tenant"], buckets=TTFT_BUCKETS, registry=r)
        self.llm_tpot = Histogram("shardline_llm_time_per_output_token_seconds", "A generation's time per output "
                                  "token after its first (its decode time over its tokens less one).",
                                  ["model", "version", "tenant"], buckets=TPOT_BUCKETS, registry=r)
        self.llm_itl = Histogram("shardline_llm_inter_token_seconds", "Between two tokens of one stream.",
                                 ["model", "version"], buckets=TOKEN_BUCKETS, registry=r)
        self.llm_token_count = Counter("shardline_llm_tokens", "Tokens metered: kind prompt or completion (their "
                                       "rate is tokens/s).", ["model", "version", "tenant", "kind"], registry=r)
        self.llm_streams = Gauge("shardline_llm_streams", "Generations in flight.", ["model"], registry=r,
                                 multiprocess_mode="livesum")
        # Tallies of the per-request series, added to them at every scrape (not in multiprocess
        # mode: a worker's series must be current whichever worker answers the scrape).
        self._tallies: list[_Tally] | None = [] if self.shared_dir is None else None
        # Labelled children, looked up once per label set (the label sets are bounded: see the module docstring).
        self._request_children: dict[tuple[str, str, str, str, int], tuple[Any, Any]] = {}
        self._batch_children: dict[tuple[str, str], tuple[Any, Any, Any]] = {}
        self._capture_children: dict[tuple[str, str, bool], Any] = {}

    def watch(self, read: Callable[[], Snapshot]) -> None:
        """Read the gauges from ``read`` at every scrape (in multiprocess mode also at every ``refresh``)."""
        if self.shared_dir is None:
            self.registry.register(_Gauges(read))
        else:
            self._shared_gauges = _SharedGauges(read, self.registry)

    def refresh(self) -> None:
        """Write this worker's gauges for the others to read (multiprocess mode; otherwise nothing to do)."""
        if self._shared_gauges is not None:
            self._shared_gauges.refresh()

    def start(self) -> None:
        """Start writing the metering ledger's closed buckets (when there is a ledger)."""
        if self.ledger is not None:
            self.ledger.start()

    def close(self) -> None:
        """This worker is stopping: the ledger writes what it holds (the open bucket too), and its live gauges leave
        the sums (multiprocess mode)."""
        if self.ledger is not None:
            self.ledger.close()
        if self.shared_dir is not None:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(os.getpid(), self.shared_dir)

    def observe_request(self, protocol: str, model: str, version: str, tenant: str, code: int, seconds: float) -> None:
        """Count one request by its status, and its latency when it was answered.

        A request whose client went away before its answer (``CLIENT_GONE``, nginx's 499) is counted under code 499
        and nowhere else: it has no time to a response (a router's given-up copy, read by a replica that was stopped,
        takes microseconds and would read as a fast answer in the latency SLI), and it is not metered."""
        key = (protocol, model, version, tenant, code)
        children = self._request_children.get(key)
        if children is None:  # labels() validates and locks on every call: look each series up once
            if len(self._request_children) > _MAX_CACHED:
                self._forget(self._request_children)
            children = (_tally(self.requests.labels(protocol, model, version, tenant, str(code)), self._tallies),
                        _tally(self.latency.labels(protocol, model, version, tenant), self._tallies))
            self._request_children[key] = children
        children[0].inc()
        if code != CLIENT_GONE:  # answered: timed and metered (a client gone was neither)
            children[1].observe(seconds)
            if self.ledger is not None and model:
                self.ledger.add_request(tenant, model, version)

    def observe_batch(self, model: str, version: str, rows: int, requests: int, seconds: float) -> None:
        """Record one batch the model scored."""
        key = (model, version)
        children = self._batch_children.get(key)
        if children is None:
            if len(self._batch_children) > _MAX_CACHED:
                self._forget(self._batch_children)
            t = self._tallies
            children = (_tally(self.batch_rows.labels(model, version), t),
                        _tally(self.batch_requests.labels(model, version), t),
                        _tally(self.batch_seconds.labels(model, version), t))
            self._batch_children[key] = children
        children[0].observe(rows)
        children[1].observe(requests)
        children[2].observe(seconds)
        if self.ledger is not None:
            self.ledger.add_shared(model, version, seconds)

    def observe_rows(self, model: str, version: str, tenant: str, rows: int, bytes_in: int, bytes_out: int) -> None:
        """Meter rows a tenant had scored (and their bytes in and out of the model); the ledger only."""
        if self.ledger is not None:
            self.ledger.add_rows(tenant, model, version, rows, bytes_in, bytes_out)

    def observe_capture(self, model: str, version: str, rows: int, kept: bool) -> None:
        """Count rows handed to capture (``kept``) or dropped by a full buffer."""
        key = (model, version, kept)
        child = self._capture_children.get(key)
        if child is None:
            if len(self._capture_children) > _MAX_CACHED:
                self._capture_children.clear()
            child = self._capture_children[key] = self.captured.labels(model, version, "kept" if kept else "dropped")
        child.inc(rows)

    def llm_first_token(self, model: str, version: str, tenant: str, seconds: float) -> None:
        """A generation's time to its first token."""
        self.llm_ttft.labels(model, version, tenant).observe(seconds)

    def llm_between_tokens(self, model: str, version: str, seconds: float) -> None:
        """The time between two tokens of a stream."""
        self.llm_itl.labels(model, version).observe(seconds)

    def llm_per_output_token(self, model: str, version: str, tenant: str, seconds: float) -> None:
        """A finished generation's time per output token after the first."""
        self.llm_tpot.labels(model, version, tenant).observe(seconds)

    def llm_tokens(self, model: str, version: str, tenant: str, prompt: int, completion: int,
                   seconds: float = 0.0) -> None:
        """Meter one generation's tokens for its tenant, and (the ledger) its ``seconds`` on the engine: prefill
        and decode, from its start to its last token."""
        self.llm_token_count.labels(model, version, tenant, "prompt").inc(prompt)
        self.llm_token_count.labels(model, version, tenant, "completion").inc(completion)
        if self.ledger is not None:
            self.ledger.add(tenant, model, version, prompt_tokens=prompt, completion_tokens=completion,
                            device_seconds=seconds)

    def flush(self) -> None:
        """Add the tallied observations to their series (done before every exposition)."""
        for tally in self._tallies or ():
            tally.flush()

    def _forget(self, children: dict[Any, Any]) -> None:
        """Drop cached series (a bound on label sets), their tallies flushed first."""
        self.flush()
        dropped = {id(c) for group in children.values() for c in group}
        if self._tallies is not None:
            self._tallies[:] = [t for t in self._tallies if id(t) not in dropped]
        children.clear()

    def exposition(self) -> tuple[bytes, str]:
        """The metrics in Prometheus' text format, and its content type (every worker's, in multiprocess mode)."""
        if self.shared_dir is None:
            self.flush()
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        self.refresh()
        return multiprocess_exposition(self.shared_dir)


def multiprocess_exposition(shared_dir: str) -> tuple[bytes, str]:
    """Every worker's metrics in ``shared_dir``, combined, in Prometheus' text format (and its content
    type): what the metrics listener of ``shardline serve --workers N`` answers, from the supervisor."""
    from prometheus_client import multiprocess

    combined = CollectorRegistry()
    multiprocess.MultiProcessCollector(combined, shared_dir)
    if (gpus := gpu_metrics.collector()) is not None:
        combined.register(gpus)
    return generate_latest(combined), CONTENT_TYPE_LATEST


def metrics_app(exposition: Callable[[], tuple[bytes, str]]) -> Callable[[dict[str, Any], Any, Any], Awaitable[None]]:
    """The app of the metrics listener: ``GET /metrics`` answers ``exposition()`` (Prometheus' text
    format), anything else 404. No lifespan, no access log."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
            status, (body, content_type) = 200, exposition()
        else:
            status, content_type = 404, "application/json"
            body = orjson.dumps({"error": f"no endpoint {scope['method']} {scope['path']}; this listener serves "
                                          "GET /metrics"})
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", content_type.encode("latin-1")), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})

    return app
