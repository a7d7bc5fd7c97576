"""A finished batch job read back for the spot simulation: its shards, their measured seconds and ranges.

Where the platform records them: the job record under the home (``<home>/jobs/<job_id>.json``: its output, start,
finish and deadline), the output's ledger (``_ledger/<shard>.json``, one ``PartRecord`` per settled shard: its
scoring seconds, rows and the checkpointed ranges it was scored in) and the metering ledger (the device it ran
on). ``job_work`` turns them into the simulation's ``JobWork``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from shardline.capacity.spot import JobWork, ShardWork
from shardline.errors import InvalidSetting
from shardline.storage.job_records import JobRecord, JobRecords
from shardline.storage.ledger import LedgerStore, is_gpu_class, month_of
from shardline.storage.output import OutputLayout, PartRecord

# The hardware class a job's workers are priced as, by the device the metering ledger says it used.
DEVICE_CLASSES = {"gpu": "h100", "cpu": "cpu-8c"}


@dataclass(frozen=True)
class FinishedJob:
    """A finished job's record, its settled shards and the device it used (None: not metered)."""

    record: JobRecord
    parts: list[PartRecord]
    device: str | None

    @property
    def wall_seconds(self) -> float:
        """From its start to its finish."""
        assert self.record.finished_at is not None
        return (self.record.finished_at - self.record.started_at).total_seconds()

    @property
    def estimated_workers(self) -> int:
        """Workers it kept busy on average: its scoring seconds over its wall time (at least 1)."""
        busy = sum(p.seconds for p in self.parts)
        return max(1, round(busy / self.wall_seconds)) if self.wall_seconds > 0 else 1


def load_finished_job(home: str, job_id: str, storage_options: dict[str, Any] | None = None) -> FinishedJob:
    """A finished job's record and shards, by its id.

    Raises:
        InvalidSetting: no such job, or it has not finished, or its output holds no shard records.
    """
    record = JobRecords(home, storage_options).find(job_id)
    if record is None:
        raise InvalidSetting(f"no job {job_id!r} under the home {home!r}; `shardline batch status` lists the jobs")
    if record.state not in ("completed", "quarantined") or record.finished_at is None:
        raise InvalidSetting(
            f"job {job_id!r} is {record.state}, not finished; simulate a job that completed (its shards' timings "
            "are what is replayed)"
        )
    layout = OutputLayout(record.parameters.output_uri, storage_options, job_id)
    parts = sorted(layout.read_ledger().values(), key=lambda p: p.relative)
    if not parts:
        raise InvalidSetting(
            f"job {job_id!r}'s output {record.parameters.output_uri!r} holds no shard records (_ledger/); it was "
            "moved or cleaned: the simulation replays the seconds recorded there"
        )
    device = None
    ledger = LedgerStore(home, storage_options)
    for month in sorted({month_of(record.started_at), month_of(record.finished_at)}):
        for row in ledger.read(month).to_pylist():  # a batch run's rows are written by "batch-<job id>-<suffix>"
            if row["kind"] == "usage" and row["writer"].startswith(f"batch-{job_id}-"):
                device = "gpu" if is_gpu_class(row["hardware_class"]) else "cpu"
    return FinishedJob(record, parts, device)


def job_work(job: FinishedJob, workers: int | None = None, deadline_s: float | None = None,
             hardware_class: str | None = None) -> JobWork:
    """The simulation's view of a finished job: every settled shard with its seconds (at least a millisecond)
    and ranges, on ``workers`` (default: as many as it kept busy), by ``deadline_s`` (default: its SLA's)."""
    shards = [ShardWork(name=p.relative, seconds=max(p.seconds, 1e-3), rows=p.rows_in or 0, ranges=max(1, p.ranges))
              for p in job.parts]
    budget = (job.record.deadline - job.record.started_at) / timedelta(seconds=1)
    return JobWork(
        job_id=job.record.job_id, shards=shards, workers=workers or job.estimated_workers,
        deadline_s=deadline_s if deadline_s is not None else max(budget, 1e-3),
        hardware_class=hardware_class or DEVICE_CLASSES.get(job.device or "cpu", "cpu-8c"),
    )

