"""The SLA tracker of a batch job: projects its finish, keeps its record, emits Prefect events.

It is an ``infer_shards`` watcher (called as shards settle) and also ticks on its own
every ``sla_check_interval_s``, so a job that stalls (no shard settles) still goes
at-risk and breached on time. Each check runs the pure projection
(``shardline.sla_projection.project``), rewrites the job record and, when the SLA status
changes to at-risk or breached, emits one event:

    shardline.batch.started       after planning (the proactive "never finished" trigger keys on it)
    shardline.batch.sla-at-risk   the projected finish is past deadline - margin, or the job stalled
    shardline.batch.sla-breached  the deadline passed with shards left (or the job finished late)
    shardline.batch.completed     every shard settled (with planned vs actual)

Resource: ``shardline.batch-job.<job_id>`` with labels for tenant, model, deployment
and flow run; related resources ``shardline.tenant.<name>`` and ``shardline.model.<pinned>``.
"""

from __future__ import annotations

import contextvars
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from prefect.artifacts import create_table_artifact

from shardline.event_catalog import BATCH_COMPLETED, BATCH_SLA_AT_RISK, BATCH_SLA_BREACHED, BATCH_STARTED
from shardline.figures import moment, rate, span
from shardline.sla_projection import ProgressPoint, Projection, Sla, project
from shardline.storage.job_records import JobRecord, JobRecords, JobState
from shardline.tasks.events import emit
from shardline.tasks.logs import run_logger

SLA_EVENTS = {"at-risk": BATCH_SLA_AT_RISK, "breached": BATCH_SLA_BREACHED}  # status -> event sent when it begins


def utcnow() -> datetime:
    """Now, in UTC."""
    return datetime.now(timezone.utc)


@dataclass(frozen=True)
class TrackedJob:
    """What the events say about a job besides its progress."""

    job_id: str
    tenant: str
    model: str
    priority: str
    deployment: str | None = None
    flow_run_id: str | None = None

    def resource(self) -> dict[str, str]:
        """The event resource: the job, labelled with who and what it is for."""
        labels = {
            "prefect.resource.id": f"shardline.batch-job.{self.job_id}",
            "prefect.resource.name": self.job_id,
            "shardline.tenant": self.tenant,
            "shardline.model": self.model,
            "shardline.priority": self.priority,
        }
        if self.deployment:
            labels["shardline.deployment"] = self.deployment
        if self.flow_run_id:
            labels["shardline.flow-run-id"] = self.flow_run_id
        return labels

    def related(self) -> list[dict[str, str]]:
        """Related resources: the tenant and the model version."""
        return [
            {"prefect.resource.id": f"shardline.tenant.{self.tenant}", "prefect.resource.role": "tenant",
             "prefect.resource.name": self.tenant},
            {"prefect.resource.id": f"shardline.model.{self.model}", "prefect.resource.role": "model",
             "prefect.resource.name": self.model},
        ]


class SlaTracker:
    """Watches one run of a job against its SLA (see the module docstring)."""

    def __init__(
        self, job: TrackedJob, sla: Sla, records: JobRecords, record: JobRecord,
        interval_s: float = 5.0, window_s: float = 300.0, clock: Callable[[], datetime] = utcnow,
        emit: Callable[..., Any] = emit,
    ) -> None:
        self.job, self.sla, self.records, self.record = job, sla, records, record
        self.interval, self.window, self.clock = interval_s, timedelta(seconds=window_s), clock
        self._send = emit
        self.total = record.shards_total
        self.trace: list[ProgressPoint] = [ProgressPoint(clock(), record.shards_done, 0)]
        self.status = "on-track"
        self.emitted: list[str] = []
        self._lock = threading.Lock()
        self._last_check = 0.0
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._settled_at: datetime | None = None

    # -- the watcher -------------------------------------------------------------------------------
    def __call__(self, settled: int, total: int, rows: int) -> None:
        """Record progress (the job's shards settled of ``total``, rows scored this run); check at most every
        interval, and when the last shard settles."""
        now = self.clock()
        with self._lock:
            self.trace.append(ProgressPoint(now, settled, rows))
            due = now.timestamp() - self._last_check >= self.interval or settled == total
        if due:
            self.check()

    def check(self) -> Projection:
        """Project now, update the record, emit an event when the status changed to at-risk/breached."""
        with self._lock:
            now = self.clock()
            self._last_check = now.timestamp()
            projection = project(self.trace, self.total, self.sla, now, self.window)
            self._apply(projection)
            changed = projection.status != self.status
            self.status = projection.status
        if changed and projection.status in SLA_EVENTS:
            self._emit(SLA_EVENTS[projection.status], projection)
        return projection

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Write the record, emit ``started`` and tick every interval until :meth:`stop`."""
        self.records.write(self.record)
        self._emit(BATCH_STARTED, project(self.trace, self.total, self.sla, self.clock(), self.window))
        context = contextvars.copy_context()
        self._ticker = threading.Thread(target=context.run, args=(self._tick,), name="sla-tracker", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception as e:  # a failed record write must not end the job
                run_logger().warning("SLA check failed: %s", e)

    def stop(self) -> None:
        """Stop ticking (idempotent)."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=10)

    def settled(self, at: datetime) -> None:
        """The instant the job's output was complete, the ``finished`` of its manifest (``planned_vs_actual``):
        checks stop, and the final one judges the SLA at it, not later, so the record, the events and the
        manifest agree."""
        self._settled_at = at
        self.stop()

    @property
    def settled_at(self) -> datetime | None:
        """The instant given to :meth:`settled` (the job's output complete), None before."""
        return self._settled_at

    def finish(self, state: JobState, message: str, rows_done: int | None = None) -> Projection:
        """The final check, at the instant the job settled (:meth:`settled`) or else now: record the outcome;
        emit ``completed`` when every shard settled."""
        self.stop()
        now = self._settled_at or self.clock()
        with self._lock:
            done = self.total if state in ("completed", "quarantined") else self.trace[-1].shards
            rows = self.trace[-1].rows if rows_done is None else rows_done
            self.trace.append(ProgressPoint(now, done, rows))
            projection = project(self.trace, self.total, self.sla, now, self.window)
            self._apply(projection)
            self.record.state = state
            self.record.message = message
            self.record.finished_at = now
            self.records.write(self.record)
            late = projection.status == "breached" and self.status != "breached"
            self.status = projection.status
        if late:  # it finished (or failed) past its deadline before a check saw it
            self._emit(BATCH_SLA_BREACHED, projection)
        if state in ("completed", "quarantined"):
            self._emit(BATCH_COMPLETED, projection, outcome=state)
        return projection

    # -- outputs -----------------------------------------------------------------------------------
    def _apply(self, projection: Projection) -> None:
        r = self.record
        r.sla_status, r.shards_done, r.rows_done = projection.status, projection.shards_done, projection.rows_done
        r.shards_per_second, r.rows_per_second = projection.shards_per_second, projection.rows_per_second
        r.projected_finish = projection.projected_finish
        self.records.write(r)

    def payload(self, projection: Projection) -> dict[str, Any]:
        """What every event carries: the job, its SLA and its figures."""
        return {
            "job_id": self.job.job_id, "tenant": self.job.tenant, "model": self.job.model,
            "priority": self.job.priority, "deadline": self.sla.deadline.isoformat(),
            "started": self.sla.started.isoformat(), **projection.as_dict(),
        }

    def _emit(self, event: str, projection: Projection, **extra: Any) -> None:
        self._send(event=event, resource=self.job.resource(), related=self.job.related(),
                   payload={**self.payload(projection), **extra})
        self.emitted.append(event)
        if event in SLA_EVENTS.values():
            run_logger().warning(
                "job %s SLA %s: deadline %s, projected finish %s", self.job.job_id, projection.status,
                self.sla.deadline.isoformat(timespec="seconds"),
                projection.projected_finish.isoformat(timespec="seconds") if projection.projected_finish else "unknown",
            )


def planned_vs_actual(sla: Sla, finished: datetime, shards: int, rows: int) -> dict[str, Any]:
    """The manifest's ``sla`` section: what was promised and what happened."""
    taken = (finished - sla.started).total_seconds()
    budget = sla.budget.total_seconds()
    return {
        "started": sla.started.isoformat(),
        "deadline": sla.deadline.isoformat(),
        "finished": finished.isoformat(),
        "budget_seconds": round(budget, 1),
        "actual_seconds": round(taken, 1),
        "status": "met" if finished <= sla.deadline else "breached",
        "shards": shards,
        "rows": rows,
        "planned_shards_per_second": float(f"{shards / budget:.4g}") if budget > 0 else None,
        "actual_shards_per_second": float(f"{shards / taken:.4g}") if taken > 0 else None,
    }


def sla_table(planned: dict[str, Any]) -> list[dict[str, str]]:
    """The SLA table's rows (measure, planned, actual) from the manifest's ``sla`` section, for a person: times,
    durations and rates in their units; the last row says whether the promise was kept, and by how much."""
    budget, taken = planned["budget_seconds"], planned["actual_seconds"]
    shards, rows = planned["shards"], planned["rows"]
    spare = budget - taken  # the deadline less the finish
    return [
        {"measure": "finish", "planned": f"by {moment(planned['deadline'])}", "actual": moment(planned["finished"])},
        {"measure": "time taken", "planned": f"at most {span(budget)}", "actual": span(taken)},
        {"measure": "throughput", "planned": f"at least {rate(shards, budget, 'shards')} ({shards:,} shards)",
         "actual": f"{rate(shards, taken, 'shards')}, {rate(rows, taken, 'rows')}"},
        {"measure": "SLA", "planned": "met: finished by the deadline",
         "actual": f"met, {span(spare)} to spare" if planned["status"] == "met" else f"breached, {span(-spare)} late"},
    ]


def publish_sla_table(job_id: str, planned: dict[str, Any], key: str) -> None:
    """A Prefect table artifact: planned vs actual (:func:`sla_table`), under ``key`` (the job's, not the run's)."""
    create_table_artifact(sla_table(planned), key=key, description=f"batch job {job_id}: SLA planned vs actual")
