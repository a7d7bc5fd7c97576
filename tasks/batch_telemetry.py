"""A batch job's traces and Prometheus metrics, kept in the process that dispatches its shards.

Traces (off unless ``OTEL_TRACES_EXPORTER`` names an exporter, see ``shardline.observability.tracing``): a
job span (``shardline.batch.job``: job id, tenant, model, version, shards), a child span per shard
(``shardline.batch.shard``: rows, outcome committed / quarantined / resumed / failed) and, on the Dask
worker, the shard's work as a child of that (``shardline.batch.score``, service ``shardline-batch-worker``):
the shard span's W3C ``traceparent`` travels in the task's arguments (``tasks.dispatch.score_traced``). The
job span is a child of ``TRACEPARENT`` when the caller's environment sets one,
else of the current span. Off, no span is made and shards go to the cluster exactly as before.

Metrics (``SHARDLINE_BATCH_METRICS_PORT``, 0 = off, the default): served from the process that dispatches,
because that is the only one that sees every shard settle: the warm batch runner (cli/batch_runner.py) runs
every job of a home in threads of its own long-lived process, so one listener there covers every job it
runs, across jobs, at a stable address; a cold run serves them from its own process for the job's life.
The workers cannot (each sees only its shards), nor can the command that sent a job to the runner (it sees
only log lines). The values are read at scrape time (a custom collector): rows scored, shards by state,
rows per second, the SLA projection (``shardline.sla_projection.project``, the tracker's own figures) and
the deadline. A finished job's series stay (``running`` 0) until ``KEEP_FINISHED`` later jobs finished, its rate
and projection as they were at its end (``JobTelemetry.projection``).

One counter outlives the jobs: ``shardline_batch_job_deadlines_total{tenant, model, outcome}``, each run with a
deadline counted once when it ends (the batch deadline SLI, docs/slo.md): ``met`` when it completed by the
deadline (at the instant its output was complete, the manifest's ``finished``), ``missed`` when it ended, done
or failed, after it. A run that fails before its deadline decides nothing (a rerun resumes it and is counted).
Both outcomes of a tenant and model are exported at 0 from the first run that starts, so that Prometheus's
``rate`` sees the first decision as an increase.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shardline.observability import tracing
from shardline.sla_projection import Projection, project
from shardline.storage.output import PartRecord
from shardline.storage.shards import ShardInfo
from shardline.tasks.logs import run_logger

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from shardline.tasks.sla_tracking import SlaTracker

log = logging.getLogger(__name__)

# The job the current context dispatches (set by ``watching``), read once per ``dispatch_shards`` call.
CURRENT: ContextVar[JobTelemetry | None] = ContextVar("shardline_batch_telemetry", default=None)
KEEP_FINISHED = 20
SHARD_STATES = ("committed", "quarantined", "resumed", "failed", "pending")
DEADLINE_OUTCOMES = ("met", "missed")
_TRACEPARENT_VARIABLES = ("TRACEPARENT",)  # not SHARDLINE_*: that would fingerprint a warm runner per job


@dataclass
class JobTelemetry:
    """One run of a job: its counts for the metrics, its job span and its shards' spans in flight."""

    job_id: str
    tenant: str
    model: str
    version: int
    shards: int
    tracker: SlaTracker | None = None
    span: Span | None = None
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SHARD_STATES, 0))
    rows: int = 0
    running: bool = True
    ended_at: datetime | None = None  # when the run ended (its output complete, or it failed): its rates stop there
    _spans: dict[str, Span] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.counts["pending"] = self.shards

    def already_settled(self, records: Sequence[PartRecord], outcome: str) -> None:
        """Shards settled before dispatch: by an earlier run (``resumed``) or by the footer check (``quarantined``)."""
        for record in records:
            state = "resumed" if outcome == "resumed" else record.status
            self._count(state, record.rows_out if outcome != "resumed" else 0)
            if self.span is not None:
                shard_span = self._shard_span(record.relative)
                self._end_shard(shard_span, state, record.rows_out, record.reason)

    def submitting(self, group: Sequence[ShardInfo]) -> list[str] | None:
        """The shards' ``traceparent`` values (a shard span started for each), or None when tracing is off."""
        if self.span is None:
            return None
        parents = []
        for shard in group:
            if shard.relative not in self._spans:  # a resubmitted shard keeps its span
                self._spans[shard.relative] = self._shard_span(shard.relative)
            parents.append(tracing.traceparent_of(self._spans[shard.relative]))
        return parents

    def settled(self, shard: ShardInfo, record: PartRecord | None, error: BaseException | None) -> None:
        """Count a shard that settled on the cluster and end its span."""
        state = "failed" if record is None else record.status
        rows = 0 if record is None else record.rows_out
        self._count(state, rows)
        shard_span = self._spans.pop(shard.relative, None)
        if shard_span is not None:
            reason = f"{type(error).__name__}: {error}" if error is not None else (record.reason if record else None)
            self._end_shard(shard_span, state, rows, reason)

    def finish(self, outcome: str, error: BaseException | None = None) -> None:
        """The run ended: the metrics say so (the deadline decided, see the module docstring), the job span ends
        (with the shards' spans left open)."""
        self.ended_at = self._ended()
        self.running = False
        decided = self.deadline_outcome(outcome)
        if decided is not None:
            _JOBS.decided(self.tenant, self.model, decided)
        for shard_span in self._spans.values():
            self._end_shard(shard_span, "stopped", 0, None)
        self._spans.clear()
        if self.span is not None:
            self.span.set_attribute("shardline.batch.outcome", outcome)
            self.span.set_attribute("shardline.batch.rows", self.rows)
            tracing.end(self.span, error=error)
            tracing.flush()

    def deadline_outcome(self, outcome: str) -> str | None:
        """``met`` or ``missed`` for a run that ended with ``outcome`` (completed or failed), None when it decides
        nothing: no deadline (no tracker), or failed before its deadline."""
        if self.tracker is None:
            return None
        ended = self.ended_at or self._ended()
        if ended > self.tracker.sla.deadline:
            return "missed"
        return "met" if outcome == "completed" else None

    def _ended(self) -> datetime:
        """Now, or the instant the job's output was complete (the tracker's ``settled_at``), on its clock."""
        if self.tracker is None:
            return datetime.now(timezone.utc)
        return self.tracker.settled_at or self.tracker.clock()

    def projection(self, now: datetime) -> Projection | None:
        """The SLA projection the metrics show at ``now``: while it runs, at ``now``; once it ended, at its end,
        so an ended run's rate and projected finish stay what they were when it ended (a rate "since the run
        began" that kept falling after the end would say the job slowed down). None without a tracker."""
        tracker = self.tracker
        if tracker is None:
            return None
        at = self.ended_at if not self.running and self.ended_at is not None else now
        with tracker._lock:
            points = [p for p in tracker.trace if p.at <= at] or tracker.trace[:1]
        return project(points, tracker.total, tracker.sla, at, tracker.window)

    def _count(self, state: str, rows: int) -> None:
        with self._lock:
            self.counts[state] += 1
            self.counts["pending"] -= 1
            self.rows += rows

    def _shard_span(self, relative: str) -> Span:
        assert self.span is not None
        return tracing.start("shardline.batch.shard", parent=tracing.context_of(self.span),
                             attributes={"shardline.batch.job_id": self.job_id, "shardline.batch.shard": relative})

    @staticmethod
    def _end_shard(shard_span: Span, outcome: str, rows: int, reason: str | None) -> None:
        shard_span.set_attribute("shardline.batch.outcome", outcome)
        shard_span.set_attribute("shardline.batch.rows", rows)
        if reason:
            shard_span.set_attribute("shardline.batch.reason", reason[:500])
        tracing.end(shard_span, error=RuntimeError(reason) if outcome == "failed" else None)


def job_span(job_id: str, tenant: str, model: str, version: int, shards: int) -> Span | None:
    """The job's span when tracing is on (``configure`` reads the ``OTEL_*`` variables once), else None."""
    if not tracing.configure("shardline-batch"):
        return None
    given = next((os.environ[v] for v in _TRACEPARENT_VARIABLES if os.environ.get(v)), None)
    return tracing.start("shardline.batch.job", parent=tracing.parent_from(given), attributes={
        "shardline.batch.job_id": job_id, "shardline.tenant": tenant, "shardline.model": model,
        "shardline.model.version": version, "shardline.batch.shards": shards, "process.pid": os.getpid(),
    })


@contextlib.contextmanager
def watching(telemetry: JobTelemetry) -> Iterator[JobTelemetry]:
    """``telemetry`` is the current job's (``CURRENT``) and, when the metrics listener runs, scraped; its span
    ends with the body (an error ends it failed)."""
    token = CURRENT.set(telemetry)
    _JOBS.add(telemetry)
    try:
        yield telemetry
    except BaseException as e:
        telemetry.finish("failed", e)
        raise
    else:
        telemetry.finish("completed")
    finally:
        CURRENT.reset(token)
        _JOBS.retire()


class _Jobs(Collector):
    """The jobs this process runs and ran lately, read at each scrape."""

    def __init__(self) -> None:
        self.jobs: OrderedDict[str, JobTelemetry] = OrderedDict()
        self.deadlines: dict[tuple[str, str, str], int] = {}  # (tenant, model, outcome) -> runs decided
        self.lock = threading.Lock()

    def add(self, job: JobTelemetry) -> None:
        with self.lock:
            self.jobs.pop(job.job_id, None)
            self.jobs[job.job_id] = job
            if job.tracker is not None:
                for outcome in DEADLINE_OUTCOMES:
                    self.deadlines.setdefault((job.tenant, job.model, outcome), 0)

    def decided(self, tenant: str, model: str, outcome: str) -> None:
        """Count a run decided by its deadline (``met`` or ``missed``)."""
        with self.lock:
            for each in DEADLINE_OUTCOMES:
                self.deadlines.setdefault((tenant, model, each), 0)
            self.deadlines[(tenant, model, outcome)] += 1

    def retire(self) -> None:
        """Forget the oldest finished jobs beyond ``KEEP_FINISHED``."""
        with self.lock:
            finished = [key for key, job in self.jobs.items() if not job.running]
            for key in finished[: max(0, len(finished) - KEEP_FINISHED)]:
                del self.jobs[key]

    def collect(self) -> Iterator[Metric]:
        labels = ["job_id", "tenant", "model", "version"]
        rows = CounterMetricFamily("shardline_batch_job_rows", "Rows scored by the job's run so far.", labels=labels)
        shards = GaugeMetricFamily("shardline_batch_job_shards", "The job's shards by state (pending: not settled yet).",
                                   labels=[*labels, "state"])
        rate = GaugeMetricFamily("shardline_batch_job_rows_per_second", "Rows scored per second since the run began.",
                                 labels=labels)
        finish = GaugeMetricFamily("shardline_batch_job_projected_finish_timestamp_seconds",
                                   "When the job is projected to settle its last shard (absent: no progress yet).",
                                   labels=labels)
        deadline = GaugeMetricFamily("shardline_batch_job_deadline_timestamp_seconds", "The job's SLA deadline.",
                                     labels=labels)
        running = GaugeMetricFamily("shardline_batch_job_running", "1 while the job runs here, 0 once it ended.",
                                    labels=labels)
        deadlines = CounterMetricFamily("shardline_batch_job_deadlines",
                                        "Runs decided by their deadline: met (completed by it) or missed (ended "
                                        "after it).", labels=["tenant", "model", "outcome"])
        with self.lock:
            jobs = list(self.jobs.values())
            for key, count in self.deadlines.items():
                deadlines.add_metric(list(key), count)
        now = datetime.now(timezone.utc)
        for job in jobs:
            values = [job.job_id, job.tenant, job.model, str(job.version)]
            with job._lock:
                counts, done = dict(job.counts), job.rows
            rows.add_metric(values, done)
            for state, count in counts.items():
                shards.add_metric([*values, state], count)
            running.add_metric(values, 1 if job.running else 0)
            projection = job.projection(now)
            if projection is None or job.tracker is None:
                continue
            rate.add_metric(values, projection.rows_per_second)
            deadline.add_metric(values, job.tracker.sla.deadline.timestamp())
            if projection.projected_finish is not None:
                finish.add_metric(values, projection.projected_finish.timestamp())
        yield from (rows, shards, rate, finish, deadline, running, deadlines)


_JOBS = _Jobs()
REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(_JOBS)
_served: Any = None  # the listener (a WSGI server), once started
_serve_lock = threading.Lock()


def serve_metrics(host: str, port: int) -> bool:
    """Start this process's batch /metrics listener once (later calls, the warm runner's next jobs, keep it);
    0: none. Whether it serves.

    An address this process cannot listen on (the port is taken: by the home's warm runner, when a job runs cold
    beside a runner busy with jobs of other settings, or by any other program) does not fail the job: the run
    says so in one warning line and goes on without its metrics (a job's metrics watch it; they are not its
    work, and its SLA does not wait for a port). The next job of the process tries again.
    """
    global _served
    if not port:
        return False
    with _serve_lock:
        if _served is not None:
            return True
        try:
            _served, _ = start_http_server(port, addr=host, registry=REGISTRY)
        except OSError as e:
            run_logger().warning(
                "this job's metrics are not served: cannot listen on %s:%d (%s; another process, such as this "
                "home's busy batch runner, may hold the port); the job runs without them. Give "
                "SHARDLINE_BATCH_METRICS_PORT a free port to serve them", host, port, e.strerror or e)
            return False
    log.info("batch metrics on http://%s:%d/metrics", host, port)
    return True


def stop_metrics() -> None:
    """Close the listener (a test's end; a process that exits closes it anyway)."""
    global _served
    with _serve_lock:
        if _served is not None:
            _served.shutdown()
            _served.server_close()
            _served = None
