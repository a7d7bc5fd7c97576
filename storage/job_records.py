"""Job records: what `shardline batch status` and `resume` read, one JSON file per job under the home.

``<home>/jobs/<job_id>.json`` holds the job's parameters (enough to run it again),
its SLA, its state and its last projection. The flow's SLA tracker rewrites it every
few seconds; each write replaces the whole file atomically (storage/fs.py), so a
reader never sees half a record, and a crash leaves the last good one.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, Field

from shardline.errors import InvalidSetting
from shardline.settings.metering import CapacityType

JobState = Literal["running", "completed", "quarantined", "failed", "interrupted"]
"""A record's state as the flow writes it (running, then completed, quarantined or failed); ``interrupted`` is never
written: it is how :meth:`JobRecords.as_it_stands` shows a running record whose run is gone."""


class JobParameters(BaseModel):
    """The flow parameters a job was started with; `resume` runs them again."""

    model: str
    input_uri: str
    output_uri: str
    tenant: str = "default"
    passthrough: list[str] | None = None
    batch_rows: int | None = None
    variant: str | None = None
    priority: str | None = None
    capacity_type: CapacityType | None = None  # spot: the workers on spot capacity (a budget's soft limit); None: as set up


class JobRecord(BaseModel):
    """One job as status and resume see it."""

    job_id: str
    parameters: JobParameters
    model_pinned: str | None = None
    state: JobState = "running"
    message: str = ""
    started_at: datetime
    deadline: datetime
    sla_status: str = "on-track"
    shards_total: int = 0
    shards_done: int = 0
    rows_done: int = 0
    shards_per_second: float = 0.0
    rows_per_second: float = 0.0
    projected_finish: datetime | None = None
    finished_at: datetime | None = None
    flow_run_id: str | None = None
    runs: int = 1
    updated_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))


class JobRecords:
    """The job records under a Shardline home (any fsspec URL)."""

    def __init__(self, home: str, storage_options: dict[str, Any] | None = None) -> None:
        from shardline.storage.fs import join, open_fs  # here, not at import: JobParameters is read without fsspec

        self.fs, self.root = open_fs(join(home, "jobs"), storage_options)
        self.storage_options = storage_options

    def _path(self, job_id: str) -> str:
        from shardline.storage.fs import join

        return join(self.root, f"{job_id}.json")

    def write(self, record: JobRecord) -> None:
        """Replace the job's record as a whole (atomic)."""
        record.updated_at = datetime.now(timezone.utc)
        from shardline.storage.fs import atomic_write_bytes, join

        atomic_write_bytes(self.fs, self._path(record.job_id), record.model_dump_json(indent=2).encode(),
                           join(self.root, "_staging"))

    def find(self, job_id: str) -> JobRecord | None:
        """The record of ``job_id``, or None."""
        path = self._path(job_id)
        if not self.fs.exists(path):
            return None
        with self.fs.open(path, "rb") as f:
            return JobRecord.model_validate(json.loads(f.read()))

    def read(self, job: str) -> JobRecord:
        """The record of a job id, or of the one job whose id starts with ``job``.

        Raises:
            InvalidSetting: no job, or several, match.
        """
        exact = self.find(job)
        if exact is not None:
            return exact
        ids = self.ids()
        matches = [i for i in ids if i.startswith(job)] if job else []
        if len(matches) == 1:
            found = self.find(matches[0])
            assert found is not None
            return found
        if matches:
            raise InvalidSetting(f"job {job!r} matches {len(matches)} jobs ({', '.join(matches[:5])}); give more of its id")
        hint = f"known jobs: {', '.join(ids[-5:])}" if ids else "no job has run with this home yet"
        raise InvalidSetting(
            f"no job {job!r} under {self.root}; {hint} (`shardline batch status` lists them; is SHARDLINE_STORAGE_HOME "
            "the one the job ran with?)"
        )

    def as_it_stands(self, record: JobRecord) -> JobRecord:
        """The record as its job stands now: a ``running`` record whose run is gone (no live lease of this job
        holds its output: the process was killed, or its lease lapsed) reads ``interrupted``, with the shards its
        output's ledger has settled (more than the record says when the run died between two of its writes);
        any other record as it is.

        A record that the job rewrote meanwhile (it finished between the two reads) is read again.
        """
        if record.state != "running" or self._still_running(record):
            return record
        again = self.find(record.job_id)
        if again is None or again.state != "running" or again.updated_at != record.updated_at:
            return again or record
        settled = min(max(record.shards_done, self._settled(record)), record.shards_total or record.shards_done)
        return record.model_copy(update={"state": "interrupted", "shards_done": settled})

    def _still_running(self, record: JobRecord) -> bool:
        """Whether a live lease of this job holds its output (storage/lease.py); True when that cannot be read."""
        from shardline import processes
        from shardline.storage.fs import join, open_fs
        from shardline.storage.lease import LEASE_DIR, OutputLease, ThisProcess, lease_is_live, utc_now

        try:
            fs, root = open_fs(record.parameters.output_uri, self.storage_options)
            _, holder = OutputLease.current(fs, join(root, LEASE_DIR))
        except (OSError, ValueError):  # unreadable now: say what the record says
            return True
        return holder is not None and holder.job_id == record.job_id and lease_is_live(
            holder, utc_now(), ThisProcess.here(), processes.alive)

    def _settled(self, record: JobRecord) -> int:
        """How many shards the job's output ledger records as settled (0 when it cannot be read)."""
        from shardline.storage.output import OutputLayout

        try:
            return len(OutputLayout(record.parameters.output_uri, self.storage_options, record.job_id).read_ledger())
        except (OSError, ValueError):
            return 0

    def ids(self) -> list[str]:
        """Every recorded job id, oldest record first."""
        if not self.fs.exists(self.root):
            return []
        entries = [e for e in self.fs.ls(self.root, detail=True) if e["name"].endswith(".json")]
        entries.sort(key=lambda e: str(e.get("mtime") or e.get("LastModified") or e.get("created") or ""))
        return [e["name"].rsplit("/", 1)[-1][: -len(".json")] for e in entries]
