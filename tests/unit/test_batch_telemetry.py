"""A batch job's counts as the batch /metrics listener exposes them: shards settled before the run (resumed, or
quarantined by the footer check) and on the cluster, rows this run, and how long finished jobs are kept."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Iterator

import pytest
from prometheus_client import generate_latest

from shardline.sla_projection import Sla
from shardline.storage.output import PartRecord
from shardline.storage.shards import ShardInfo
from shardline.tasks import batch_telemetry
from shardline.tasks.batch_telemetry import CURRENT, JobTelemetry, watching


T0 = datetime(2026, 12, 1, 2, 0, tzinfo=timezone.utc)


def _record(relative: str, status: str, rows: int) -> PartRecord:
    return PartRecord(shard=f"/in/{relative}", relative=relative, fingerprint="f", job_key="k",
                      status=status, rows_in=rows, rows_out=rows if status == "committed" else 0)  # type: ignore[arg-type]


def _shard(relative: str) -> ShardInfo:
    return ShardInfo(uri=f"/in/{relative}", relative=relative, size=1, fingerprint="f")


@pytest.fixture(autouse=True)
def no_jobs() -> Iterator[None]:
    batch_telemetry._JOBS.jobs.clear()
    yield
    batch_telemetry._JOBS.jobs.clear()


def _value(name: str, job: str, **labels: str) -> float | None:
    for family in batch_telemetry.REGISTRY.collect():
        for sample in family.samples:
            if sample.name == name and sample.labels["job_id"] == job and all(
                    sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def test_counts_follow_the_shards_of_a_resumed_job_and_the_job_is_current_while_it_runs() -> None:
    job = JobTelemetry("j1", "acme", "churn", 3, shards=6)
    job.already_settled([_record("a", "committed", 100)], "resumed")
    with watching(job):
        assert CURRENT.get() is job and job.submitting([_shard("b")]) is None  # tracing off: plain tasks
        job.already_settled([_record("bad", "quarantined", 0)], "validated")
        job.settled(_shard("b"), _record("b", "committed", 40), None)
        job.settled(_shard("c"), None, OSError("gone"))
        assert _value("shardline_batch_job_running", "j1") == 1
    assert CURRENT.get() is None
    states = {s: _value("shardline_batch_job_shards", "j1", state=s) for s in batch_telemetry.SHARD_STATES}
    assert states == {"committed": 1, "quarantined": 1, "resumed": 1, "failed": 1, "pending": 2}
    assert _value("shardline_batch_job_rows_total", "j1", tenant="acme", model="churn", version="3") == 40
    assert _value("shardline_batch_job_running", "j1") == 0
    assert b"shardline_batch_job_shards{" in generate_latest(batch_telemetry.REGISTRY)


def test_a_job_that_raises_ends_and_only_the_latest_finished_jobs_are_kept() -> None:
    with pytest.raises(RuntimeError), watching(JobTelemetry("first", "t", "m", 1, shards=1)):
        raise RuntimeError("boom")
    assert _value("shardline_batch_job_running", "first") == 0
    for n in range(batch_telemetry.KEEP_FINISHED):
        with watching(JobTelemetry(f"later-{n}", "t", "m", 1, shards=1)):
            pass
    assert _value("shardline_batch_job_running", "first") is None
    assert _value("shardline_batch_job_running", "later-0") == 0


def _tracked(job_id: str, now: list[datetime], deadline_s: float, shards: int = 1) -> JobTelemetry:
    """A job of tenant acme, model churn, with a real SLA tracker due ``deadline_s`` after T0 on the clock ``now``."""
    import uuid

    from shardline.storage.job_records import JobParameters, JobRecord, JobRecords
    from shardline.tasks.sla_tracking import SlaTracker, TrackedJob

    deadline = T0 + timedelta(seconds=deadline_s)
    records = JobRecords(f"memory://jobs-{uuid.uuid4().hex[:8]}")
    record = JobRecord(job_id=job_id, started_at=T0, deadline=deadline, shards_total=shards,
                       parameters=JobParameters(model="churn@prod", input_uri="/i", output_uri="/o", tenant="acme"))
    tracker = SlaTracker(TrackedJob(job_id, "acme", "churn:3", "normal"), Sla(deadline, T0, timedelta(0)), records,
                         record, interval_s=1000, clock=lambda: now[0], emit=lambda **event: None)
    return JobTelemetry(job_id, "acme", "churn", 3, shards=shards, tracker=tracker)


def _deadlines(outcome: str) -> float | None:
    for family in batch_telemetry.REGISTRY.collect():
        for sample in family.samples:
            if sample.name == "shardline_batch_job_deadlines_total" and sample.labels == {
                    "tenant": "acme", "model": "churn", "outcome": outcome}:
                return sample.value
    return None


def test_each_run_with_a_deadline_is_counted_once_met_or_missed_and_both_start_at_zero() -> None:
    batch_telemetry._JOBS.deadlines.clear()
    now = [T0]
    with watching(_tracked("early", now, deadline_s=100)):
        assert (_deadlines("met"), _deadlines("missed")) == (0, 0)  # there before the first decision
        now[0] = T0 + timedelta(seconds=50)
    with watching(late := _tracked("late", now, deadline_s=100)):
        late.tracker.settled(T0 + timedelta(seconds=150))  # type: ignore[union-attr]  # the manifest's finish
    with pytest.raises(RuntimeError), watching(_tracked("failed-in-time", now, deadline_s=100)):
        raise RuntimeError("a worker died")  # before its deadline: a rerun decides it
    now[0] = T0 + timedelta(seconds=200)
    with pytest.raises(RuntimeError), watching(_tracked("failed-late", now, deadline_s=100)):
        raise RuntimeError("a worker died")
    with watching(JobTelemetry("no-tracker", "acme", "churn", 3, shards=1)):
        pass  # no deadline, nothing decided
    assert (_deadlines("met"), _deadlines("missed")) == (1, 2)
    assert b'shardline_batch_job_deadlines_total{model="churn",outcome="missed",tenant="acme"} 2.0' in (
        generate_latest(batch_telemetry.REGISTRY))


def test_an_ended_runs_rate_and_projected_finish_stay_what_they_were_at_its_end() -> None:
    now = [T0]
    rate, finish = "shardline_batch_job_rows_per_second", "shardline_batch_job_projected_finish_timestamp_seconds"
    done = _tracked("done", now, deadline_s=3600, shards=2)
    with watching(done):
        now[0] = T0 + timedelta(seconds=10)
        done.tracker(2, 2, 1000)  # type: ignore[misc]  # both shards settled, 1,000 rows in 10 s
        done.tracker.settled(now[0])  # type: ignore[union-attr]  # the manifest's finish
    now[0] = T0
    failed = _tracked("failed", now, deadline_s=3600, shards=2)
    now[0] = T0 + timedelta(seconds=10)
    with pytest.raises(RuntimeError), watching(failed):
        failed.tracker(1, 2, 500)  # type: ignore[misc]  # one shard of two in 10 s, then a worker died
        raise RuntimeError("a worker died")
    for later in (20, 60, 600):  # scrapes after both ended: the figures of their end, not falling
        now[0] = T0 + timedelta(seconds=later)
        assert (_value(rate, "done"), _value(finish, "done")) == (100, (T0 + timedelta(seconds=10)).timestamp())
        assert _value(rate, "failed") == 50
        assert _value(finish, "failed") == (T0 + timedelta(seconds=20)).timestamp()  # 1 shard left at 0.1 a second
        assert _value("shardline_batch_job_running", "failed") == 0
