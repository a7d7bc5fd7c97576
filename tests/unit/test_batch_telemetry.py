"""A batch job's counts as the batch /metrics listener exposes them: shards settled before the run (resumed, or
quarantined by the footer check) and on the cluster, rows this run, and how long finished jobs are kept."""

from __future__ import annotations

from typing import Iterator

import pytest
from prometheus_client import generate_latest

from shardline.storage.output import PartRecord
from shardline.storage.shards import ShardInfo
from shardline.tasks import batch_telemetry
from shardline.tasks.batch_telemetry import CURRENT, JobTelemetry, watching


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
