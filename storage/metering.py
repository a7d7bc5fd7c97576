"""The metering ledger: device-seconds each tenant's batch jobs used, per UTC day.

``<home>/metering/batch/<tenant>/<YYYY-MM-DD>/<job_id>-<unique>.json``: one small
file per run of a job, written whole (atomically), never edited, so concurrent jobs
never contend for one file. A day's use is the sum of its files. The seconds are the
shards' own scoring seconds (one shard holds one device while it is scored), so
the planning, queueing and idle time of a job is not billed.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass
from datetime import date, datetime, timezone
from typing import Any, Literal

from shardline.storage.fs import atomic_write_bytes, join, open_fs

DeviceKind = Literal["cpu", "gpu"]


@dataclass(frozen=True)
class MeterRecord:
    """Device-seconds one run of a job used."""

    tenant: str
    job_id: str
    device: DeviceKind
    device_seconds: float
    shards: int
    day: str
    recorded_at: str


class MeteringLedger:
    """Batch metering records under a Shardline home (any fsspec URL)."""

    def __init__(self, home: str, storage_options: dict[str, Any] | None = None) -> None:
        self.fs, self.root = open_fs(join(home, "metering", "batch"), storage_options)

    def record(self, tenant: str, job_id: str, device: DeviceKind, device_seconds: float, shards: int,
               when: datetime | None = None) -> MeterRecord:
        """Add a run's use to the tenant's day (the UTC day of ``when``, default now)."""
        when = when or datetime.now(timezone.utc)
        day = when.astimezone(timezone.utc).date().isoformat()
        entry = MeterRecord(tenant, job_id, device, round(device_seconds, 3), shards, day, when.isoformat())
        folder = join(self.root, tenant, day)
        atomic_write_bytes(self.fs, join(folder, f"{job_id}-{uuid.uuid4().hex[:8]}.json"),
                           json.dumps(asdict(entry)).encode(), join(self.root, "_staging"))
        return entry

    def records(self, tenant: str, day: date) -> list[MeterRecord]:
        """Every record of a tenant's UTC day."""
        folder = join(self.root, tenant, day.isoformat())
        if not self.fs.exists(folder):
            return []
        found = []
        for path in sorted(self.fs.glob(join(folder, "*.json"))):
            with self.fs.open(path, "rb") as f:
                found.append(MeterRecord(**json.loads(f.read())))
        return found

    def device_hours(self, tenant: str, day: date, device: DeviceKind = "gpu") -> float:
        """Hours of ``device`` the tenant's batch jobs used on ``day``."""
        return sum(r.device_seconds for r in self.records(tenant, day) if r.device == device) / 3600.0
