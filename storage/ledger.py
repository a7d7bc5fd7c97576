"""The metering ledger of both tiers: what each tenant used, per time bucket, as Parquet under the home.

``<home>/metering/ledger/month=YYYY-MM/<bucket start>-<writer>.parquet``: every file is written whole
(atomically) and never edited, so writers never contend. One row per (bucket, tenant, model, version, tier,
hardware class, capacity type) with what was used (``MEASURES``: requests, rows, prompt and completion tokens,
device- and CPU-seconds, bytes read and written), and one ``capacity`` row per writer and bucket with what the
writer held (``units`` of its hardware class for ``reserved_seconds`` of wall time): what a cost report prices.

A long-lived process (``shardline serve``) meters through a :class:`LedgerWriter`: ``add`` is a few dict
additions under an uncontended lock (the request path does no I/O); a background thread writes each bucket
once it has closed, and ``close`` (the server's graceful stop) writes the open one too. So a graceful stop
loses nothing and a crash (SIGKILL, power) loses the bucket still open at most. A batch job writes one file
for its run when its shards have settled (:meth:`LedgerStore.record_batch`).
"""

from __future__ import annotations

import io
import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import date, datetime, timezone
from typing import Any, Callable, Iterable, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shardline.arrays import records_table
from shardline.budgets import BudgetStates
from shardline.errors import InvalidSetting
from shardline.settings import MeteringSettings
from shardline.storage.fs import atomic_write_bytes, join, open_fs

log = logging.getLogger("shardline.metering")

Tier = Literal["online", "batch"]
MEASURES = ("requests", "rows", "prompt_tokens", "completion_tokens", "device_seconds", "cpu_seconds",
            "bytes_read", "bytes_written")
_INDEX = {name: i for i, name in enumerate(MEASURES)}
_ROWS, _BYTES_READ, _BYTES_WRITTEN = _INDEX["rows"], _INDEX["bytes_read"], _INDEX["bytes_written"]
_COUNTS = frozenset({"requests", "rows", "prompt_tokens", "completion_tokens", "bytes_read", "bytes_written"})
UNATTRIBUTED = "(unattributed)"  # device time a server measured that no tenant's rows of the bucket explain

SCHEMA = pa.schema([
    ("bucket_start", pa.timestamp("s", tz="UTC")),
    ("bucket_seconds", pa.float64()),
    ("writer", pa.string()),
    ("kind", pa.string()),  # usage | capacity
    ("tenant", pa.string()),
    ("model", pa.string()),
    ("version", pa.string()),
    ("tier", pa.string()),
    ("hardware_class", pa.string()),
    ("capacity_type", pa.string()),
    *[(m, pa.int64() if m in _COUNTS else pa.float64()) for m in MEASURES],
    ("units", pa.float64()),
    ("reserved_seconds", pa.float64()),
])


@dataclass(frozen=True)
class Holding:
    """What a writer holds while it runs: ``units`` of a hardware class, bought as a capacity type."""

    tier: Tier
    hardware_class: str
    capacity_type: str = "on-demand"
    units: float = 1.0


def holding_of(settings: MeteringSettings, tier: Tier, device: Literal["cpu", "gpu"], units: float) -> Holding:
    """What a process holds, as the metering settings say (``units`` when they do not: cores, or GPUs)."""
    hardware = settings.hardware_class or device
    return Holding(tier, hardware, settings.capacity_type, settings.units or units)


def is_gpu_class(hardware_class: str) -> bool:
    """Whether a hardware class is a GPU or a slice of one (every class but 'cpu' and 'cpu-...')."""
    return not (hardware_class == "cpu" or hardware_class.startswith("cpu-"))


def check_month(month: str) -> str:
    """``month`` when it is a ledger month ('2026-11').

    Raises:
        InvalidSetting: it is not YYYY-MM.
    """
    if not re.fullmatch(r"\d{4}-(0[1-9]|1[0-2])", month):
        raise InvalidSetting(f"{month!r} is not a month; give it as YYYY-MM, e.g. 2026-11")
    return month


def previous_month(now: datetime | None = None) -> str:
    """The month before ``now``'s (UTC; default now): what a report on the 1st covers."""
    moment = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
    return f"{moment.year - 1}-12" if moment.month == 1 else f"{moment.year}-{moment.month - 1:02d}"


def month_of(moment: datetime) -> str:
    """The ledger's month folder of a moment (UTC): '2026-11'."""
    return moment.astimezone(timezone.utc).strftime("%Y-%m")


def _row(bucket: float, bucket_s: float, writer: str, kind: str, holding: Holding, tenant: str = "",
         model: str = "", version: str = "", measures: Iterable[float] | None = None, reserved: float = 0.0,
         ) -> dict[str, Any]:
    values = list(measures) if measures is not None else [0.0] * len(MEASURES)
    row: dict[str, Any] = {
        "bucket_start": datetime.fromtimestamp(bucket, timezone.utc), "bucket_seconds": bucket_s, "writer": writer,
        "kind": kind, "tenant": tenant, "model": model, "version": version, "tier": holding.tier,
        "hardware_class": holding.hardware_class, "capacity_type": holding.capacity_type,
        "units": holding.units if kind == "capacity" else 0.0, "reserved_seconds": reserved,
    }
    for name, value in zip(MEASURES, values):
        row[name] = int(round(value)) if name in _COUNTS else float(value)
    return row


class LedgerStore:
    """The ledger's files under a Shardline home (any fsspec URL): written whole, read by month."""

    def __init__(self, home: str, storage_options: dict[str, Any] | None = None) -> None:
        self.fs, self.root = open_fs(join(home, "metering", "ledger"), storage_options)
        self.location = join(home, "metering", "ledger")

    def write(self, rows: list[dict[str, Any]], name: str) -> str:
        """Write ``rows`` as one Parquet file ``name`` in the month of their first bucket; returns its path."""
        table = records_table(rows, SCHEMA)
        sink = io.BytesIO()
        pq.write_table(table, sink)
        path = join(self.root, f"month={month_of(rows[0]['bucket_start'])}", f"{name}.parquet")
        atomic_write_bytes(self.fs, path, sink.getvalue(), join(self.root, "_staging"))
        return path

    def months(self) -> list[str]:
        """The months the ledger holds, oldest first ('2026-11')."""
        if not self.fs.exists(self.root):
            return []
        found = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        return sorted(name.removeprefix("month=") for name in found if name.startswith("month="))

    def read(self, month: str) -> pa.Table:
        """Every row of a month ('2026-11'); an empty table (``SCHEMA``) when it has none."""
        folder = join(self.root, f"month={month}")
        if not self.fs.exists(folder):
            return SCHEMA.empty_table()
        tables = []
        for path in sorted(self.fs.glob(join(folder, "*.parquet"))):
            with self.fs.open(path, "rb") as f:  # not pq.read_table(f): its scanner over a Python file leaves a
                tables.append(pq.ParquetFile(f).read().cast(SCHEMA))  # thread that aborts ~3% of exits (pyarrow 26)
        return pa.concat_tables(tables) if tables else SCHEMA.empty_table()

    @property
    def budgets_path(self) -> str:
        """``<home>/metering/budgets.json``: the tenants' budget states as last computed (``cost/budgets.py``)."""
        return join(self.root.rsplit("/", 1)[0], "budgets.json")

    def write_budget_states(self, states: BudgetStates) -> str:
        """Publish the tenants' budget states (written whole, atomically) for the online tier to read."""
        atomic_write_bytes(self.fs, self.budgets_path, states.dumps().encode(), join(self.root, "_staging"))
        return self.budgets_path

    def read_budget_states(self) -> BudgetStates | None:
        """The budget states last published; None when none were."""
        try:
            with self.fs.open(self.budgets_path, "rb") as f:
                return BudgetStates.loads(f.read().decode())
        except FileNotFoundError:
            return None

    def record_batch(self, holding: Holding, tenant: str, model: str, version: str, job_id: str,
                     started: datetime, measures: dict[str, float], reserved_seconds: float,
                     window_seconds: float) -> str:
        """One batch run's use (a usage row) and what it held (a capacity row), in one file whose bucket is the
        run's scoring window (from ``started``, ``window_seconds`` long); returns its path."""
        writer = f"batch-{job_id}-{uuid.uuid4().hex[:8]}"
        bucket = started.timestamp()
        values = [measures.get(m, 0.0) for m in MEASURES]
        rows = [_row(bucket, window_seconds, writer, "usage", holding, tenant, model, version, values),
                _row(bucket, window_seconds, writer, "capacity", holding, reserved=reserved_seconds)]
        return self.write(rows, f"{started.astimezone(timezone.utc):%Y%m%dT%H%M%S}-{writer}")

    def device_hours(self, tenant: str, day: date, device: Literal["cpu", "gpu"] = "gpu",
                     tier: Tier = "batch") -> float:
        """Hours of GPU (any GPU class, MIG slices included) or CPU the tenant's ``tier`` used on a UTC ``day``
        (by the start of each bucket)."""
        table = self.read(day.strftime("%Y-%m"))
        if table.num_rows == 0:
            return 0.0
        start = datetime(day.year, day.month, day.day, tzinfo=timezone.utc)
        mask = pc.and_(pc.and_(pc.equal(table["kind"], "usage"), pc.equal(table["tenant"], tenant)),
                       pc.equal(table["tier"], tier))
        days = pc.floor_temporal(table["bucket_start"], unit="day")
        mask = pc.and_(mask, pc.equal(days, pa.scalar(start, pa.timestamp("s", tz="UTC"))))
        chosen = table.filter(mask)
        seconds = sum(s for s, hw in zip(chosen["device_seconds"].to_pylist(), chosen["hardware_class"].to_pylist())
                      if is_gpu_class(hw) == (device == "gpu"))
        return float(seconds) / 3600.0


def writer_id(tier: Tier) -> str:
    """A name no other writer of the ledger has: tier, host, process and a random part."""
    return f"{tier}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class LedgerWriter:
    """A long-lived process's meter: adds per bucket in memory, a thread writes each closed bucket.

    ``add`` records a tenant's use of a model; ``add_shared`` records device time several tenants' rows shared
    (a batch of the online batcher): when its bucket is written it is split across the tenants by the rows
    each had of that model in the bucket (time carried to the next bucket when there were none, and written
    as ``UNATTRIBUTED`` at the close if never explained). The process's CPU time of a bucket is split
    across the bucket's usage by device-seconds (the capacity row keeps it when nothing was used).
    """

    def __init__(self, store: LedgerStore, holding: Holding, bucket_s: float, *,
                 clock: Callable[[], float] = time.time, cpu_clock: Callable[[], float] = time.process_time,
                 writer: str | None = None) -> None:
        self.store, self.holding, self.bucket_s = store, holding, bucket_s
        self.writer = writer or writer_id(holding.tier)
        self._clock, self._cpu_clock = clock, cpu_clock
        self._lock = threading.Lock()
        self._usage: dict[int, dict[tuple[str, str, str], list[float]]] = {}
        self._shared: dict[int, dict[tuple[str, str], float]] = {}
        self._carry: dict[tuple[str, str], float] = {}
        self.started = clock()
        self._next = int(self.started // bucket_s)  # the first bucket not yet written
        self._cpu_mark = cpu_clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._unwritten: list[tuple[str, list[dict[str, Any]]]] = []  # buckets made into rows, not yet stored
        self.files: list[str] = []

    def add(self, tenant: str, model: str, version: str, **measures: float) -> None:
        """Add a tenant's use of a model version to the current bucket (``measures`` named as ``MEASURES``)."""
        bucket = int(self._clock() // self.bucket_s)
        with self._lock:
            values = self._values(bucket, (tenant, model, version))
            for name, amount in measures.items():
                values[_INDEX[name]] += amount

    def add_rows(self, tenant: str, model: str, version: str, rows: int, bytes_read: int, bytes_written: int) -> None:
        """Add rows a tenant had scored and their bytes: ``add(..., rows=, bytes_read=, bytes_written=)`` without
        the keywords (it runs once per online request)."""
        bucket = int(self._clock() // self.bucket_s)
        with self._lock:
            values = self._values(bucket, (tenant, model, version))
            values[_ROWS] += rows
            values[_BYTES_READ] += bytes_read
            values[_BYTES_WRITTEN] += bytes_written

    def add_request(self, tenant: str, model: str, version: str) -> None:
        """Count one request: ``add(..., requests=1)`` without the keywords (it runs once per request)."""
        bucket = int(self._clock() // self.bucket_s)
        with self._lock:
            self._values(bucket, (tenant, model, version))[0] += 1

    def _values(self, bucket: int, key: tuple[str, str, str]) -> list[float]:
        """The measures of ``key`` in ``bucket``, made when missing (the caller holds the lock)."""
        by_key = self._usage.get(bucket)
        if by_key is None:
            by_key = self._usage[bucket] = {}
        values = by_key.get(key)
        if values is None:
            values = by_key[key] = [0.0] * len(MEASURES)
        return values

    def add_shared(self, model: str, version: str, seconds: float) -> None:
        """Add device time that the rows of the current bucket's tenants shared (split at write time)."""
        bucket = int(self._clock() // self.bucket_s)
        with self._lock:
            shared = self._shared.setdefault(bucket, {})
            shared[(model, version)] = shared.get((model, version), 0.0) + seconds

    def start(self) -> None:
        """Start the thread that writes each bucket once it has closed."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shardline-ledger", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        tick = min(1.0, self.bucket_s / 4)
        while not self._stop.wait(tick):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - a store that fails now may work at the next bucket
                log.exception("could not write the metering ledger; the buckets are kept and tried again")

    def close(self) -> list[str]:
        """Stop the thread and write every bucket, the open one too (a graceful stop loses nothing)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if not self._closed:
            self._closed = True
            try:
                self.flush(final=True)
            except Exception:  # noqa: BLE001 - the stop goes on; what was not stored is said, not raised
                log.exception("could not write the metering ledger at the stop; %d bucket(s) of %s are lost",
                              len(self._unwritten), self.writer)
        return self.files

    def flush(self, final: bool = False) -> list[str]:
        """Write every closed bucket (and, ``final``, the open one); returns the files written."""
        now = self._clock()
        current = int(now // self.bucket_s)
        last = current if final else current - 1
        with self._lock:
            if self._next > last:
                return []
            first = self._next
            usage = {b: self._usage.pop(b) for b in list(self._usage) if b <= last}
            shared = {b: self._shared.pop(b) for b in list(self._shared) if b <= last}
            self._next = last + 1
        cpu_now = self._cpu_clock()
        cpu, self._cpu_mark = cpu_now - self._cpu_mark, cpu_now
        for bucket in range(first, last + 1):
            rows = self._rows(bucket, usage.get(bucket, {}), shared.get(bucket, {}),
                              cpu if bucket == last else 0.0, now, final and bucket == last)
            start = bucket * self.bucket_s
            self._unwritten.append((f"{datetime.fromtimestamp(start, timezone.utc):%Y%m%dT%H%M%S}-{self.writer}", rows))
        written = []
        while self._unwritten:  # oldest first; one the store refuses stays, with those after it, for the next try
            name, rows = self._unwritten[0]
            written.append(self.store.write(rows, name))
            self._unwritten.pop(0)
            self.files.append(written[-1])
        return written

    def _rows(self, bucket: int, usage: dict[tuple[str, str, str], list[float]],
              shared: dict[tuple[str, str], float], cpu: float, now: float, last: bool) -> list[dict[str, Any]]:
        """The rows of one bucket: its usage with the shared device time split, then the writer's capacity."""
        rows_index, device_index = MEASURES.index("rows"), MEASURES.index("device_seconds")
        for key, seconds in self._carry.items():
            shared[key] = shared.get(key, 0.0) + seconds
        self._carry = {}
        for (model, version), seconds in shared.items():
            users = {k: v[rows_index] for k, v in usage.items() if k[1:] == (model, version) and v[rows_index] > 0}
            total = sum(users.values())
            if total == 0:
                if last:
                    usage.setdefault((UNATTRIBUTED, model, version), [0.0] * len(MEASURES))[device_index] += seconds
                else:
                    self._carry[(model, version)] = seconds
                continue
            for user, share in users.items():
                usage[user][device_index] += seconds * share / total
        used = sum(v[device_index] for v in usage.values())
        cpu_index = MEASURES.index("cpu_seconds")
        if used > 0:
            for values in usage.values():
                values[cpu_index] += cpu * values[device_index] / used
        start = bucket * self.bucket_s
        begin, end = max(start, self.started), min(start + self.bucket_s, now) if last else start + self.bucket_s
        written = [_row(start, self.bucket_s, self.writer, "usage", self.holding, t, m, v, values)
                   for (t, m, v), values in sorted(usage.items())]
        capacity = _row(start, self.bucket_s, self.writer, "capacity", self.holding,
                        reserved=max(0.0, end - begin))
        if used == 0:
            capacity["cpu_seconds"] = cpu
        return [*written, capacity]
