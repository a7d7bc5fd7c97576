"""How batch jobs of several tenants share one cluster: isolation, quotas, concurrency limits, metering.

- Isolation: a job's input and output must lie under its tenant's storage prefixes;
  checked before anything is read or written.
- Capacity type: a job may ask for spot (or on-demand) capacity (a tenant past its budget's soft limit runs on
  spot); its own Kubernetes cluster gives it (``job_capacity``), a local or shared one runs where it runs.
- GPU-hours: a job that would run on a GPU is refused when its tenant's batch GPU-hours
  of the UTC day (the metering ledger, ``storage/ledger.py``) reached ``gpu_hours_per_day``.
- Fair share: while its shards are on the cluster a job holds one slot of its
  priority class's Prefect global concurrency limit (``shardline-batch-priority-<class>``,
  jobs at once across tenants) and ``min(max_concurrent_shards, shards to do)`` slots
  of its tenant's (``shardline-batch-tenant-<name>``, shards at once), and submits
  at most that many shards at a time. Limits are created at run time when missing
  and resized to the configuration when they differ: the tenants file and
  ``TenancySettings.priority_job_slots`` are the source of truth. The slots are held on a lease of
  ``SLOT_LEASE_S`` that the holder renews: the slots of a job whose process was killed come back when it
  lapses (within about a minute and a half, the Prefect server's shortest lease and its check for lapsed
  ones), not after Prefect's default five minutes. A job waiting for slots stops when it is asked to stop.

In single-tenant mode (no tenants file) none of this applies.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib.util
import os
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Literal, Sequence
from uuid import UUID

from shardline.errors import InvalidSetting, QuotaExceeded
from shardline.settings import DaskSettings, MeteringSettings, RuntimeSettings, TenancySettings
from shardline.storage.ledger import LedgerStore, holding_of
from shardline.storage.output import OutputLayout, PartRecord
from shardline.storage.shards import ShardInfo
from shardline.tasks.logs import run_logger
from shardline.tenants import PRIORITIES, BatchTenant

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient

    from shardline.tasks.batch import JobPlan

DeviceKind = Literal["cpu", "gpu"]


def device_kind(runtime: RuntimeSettings) -> DeviceKind:
    """The device a job's shards will hold: 'gpu' for cuda (or auto with CUDA present), else 'cpu'."""
    if runtime.device == "cuda":
        return "gpu"
    if runtime.device == "cpu":
        return "cpu"
    loaded = sys.modules.get("onnxruntime")
    if loaded is not None:
        return "gpu" if "CUDAExecutionProvider" in loaded.get_available_providers() else "cpu"
    spec = importlib.util.find_spec("onnxruntime")
    return "gpu" if spec is not None and has_cuda_provider(spec.submodule_search_locations or []) else "cpu"


def has_cuda_provider(package_folders: Iterable[str]) -> bool:
    """Whether an onnxruntime package (its folders) carries the CUDA execution provider: its provider library
    (``capi/libonnxruntime_providers_cuda.so``, onnxruntime-gpu's), found without importing onnxruntime,
    which would cost the process that admits a job about 35 MB for the rest of its life (the warm runner)."""
    return any(any((Path(folder) / "capi").glob("*onnxruntime_providers_cuda*")) for folder in package_folders)


def check_gpu_quota(ledger: LedgerStore, tenant: BatchTenant, device: DeviceKind, now: datetime | None = None) -> None:
    """Refuse a GPU job of a tenant whose GPU-hours of the UTC day are used up.

    Raises:
        QuotaExceeded: with the hours used, the quota and when it resets.
    """
    quota = tenant.policy.gpu_hours_per_day
    if quota is None or device != "gpu":
        return
    today = (now or datetime.now(timezone.utc)).astimezone(timezone.utc).date()
    used = ledger.device_hours(tenant.name, today, "gpu")
    if used >= quota:
        raise QuotaExceeded(
            f"tenant {tenant.name!r} has used {used:.2f} of its {quota:g} GPU-hours for {today.isoformat()} (UTC); "
            "the job was not started. Run it after 00:00 UTC, on CPU (SHARDLINE_RUNTIME_DEVICE=cpu), or ask for a "
            "larger gpu_hours_per_day in the tenants file",
            tenant.name, used, quota,
        )


def priority_of(tenant: BatchTenant | None, priority: str | None) -> str:
    """The job's priority class: the one asked for, else the tenant's, else 'normal'.

    Raises:
        InvalidSetting: not one of high, normal, low.
    """
    chosen = priority or (tenant.policy.priority if tenant else "normal")
    if chosen not in PRIORITIES:
        raise InvalidSetting(f"priority {chosen!r} is not one of high, normal, low; backfills run as low")
    return chosen


def limit_names(tenant: str, priority: str) -> tuple[str, str]:
    """The Prefect global concurrency limits a job takes: (priority class, tenant)."""
    return f"shardline-batch-priority-{priority}", f"shardline-batch-tenant-{tenant}"


def ensure_limit(name: str, limit: int) -> None:
    """Create the global concurrency limit ``name`` with ``limit`` slots, or resize it to ``limit``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            existing = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit))
                run_logger().info("created concurrency limit %s with %d slots", name, limit)
                return
            except ObjectAlreadyExists:  # another job created it just now
                existing = client.read_global_concurrency_limit_by_name(name)
        if existing.limit != limit or not existing.active:
            client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=limit, active=True))
            run_logger().info("resized concurrency limit %s to %d slots", name, limit)


@contextlib.contextmanager
def fair_share(
    tenant: BatchTenant | None, priority: str, shards: int, settings: TenancySettings
) -> Iterator[int | None]:
    """Hold the job's priority-class slot and its tenant's shard slots; yield max shards in flight.

    Yields None (no limit) in single-tenant mode.
    """
    if tenant is None or shards == 0:
        yield None
        return
    from shardline.tasks.dispatch import STOP_REQUEST

    class_name, tenant_name = limit_names(tenant.name, priority)
    class_slots = settings.priority_job_slots.get(priority)
    if class_slots is None or class_slots < 1:
        raise InvalidSetting(
            f"SHARDLINE_TENANCY_PRIORITY_JOB_SLOTS gives priority {priority!r} no slots ({class_slots}); give each of "
            "high, normal, low at least 1"
        )
    ensure_limit(class_name, class_slots)
    limit = tenant.policy.max_concurrent_shards
    log = run_logger()
    stop = STOP_REQUEST.get()
    until = None if settings.wait_timeout_s is None else time.monotonic() + settings.wait_timeout_s
    with contextlib.ExitStack() as held:
        _hold(held, class_name, 1, until, stop)
        if limit is None:
            yield None
            return
        in_flight = min(limit, shards)
        ensure_limit(tenant_name, limit)
        log.info("tenant %s: waiting for %d of its %d shard slots", tenant.name, in_flight, limit)
        _hold(held, tenant_name, in_flight, until, stop)
        yield in_flight


SLOT_LEASE_S = 60.0  # the lease on a job's slots (the server's shortest: 60 s)
SLOT_RENEW_S = SLOT_LEASE_S * 0.75  # how often the holder renews it
SLOT_RETRY_S = 3.0  # how soon a failed renewal is tried again (five tries before the lease lapses)
SLOT_POLL_S = 2.0  # the longest wait between two tries for slots (the server's Retry-After is usually shorter)


def _hold(held: contextlib.ExitStack, name: str, slots: int, until: float | None, stop: threading.Event | None) -> None:
    """Take ``slots`` of the limit ``name`` on a lease into ``held`` (renewed while held, released when it closes),
    trying again as the server's Retry-After says until ``until`` (monotonic; None: as long as it takes); a stop
    request ends the wait at once.

    Each try is one request of the job's own Prefect client, bounded by its request time-out; nothing goes through
    Prefect's process-wide acquisition services, whose future a request that never settles could leave waiting for
    ever (seen once, a job waiting over 20 minutes on a free limit).

    Raises:
        JobStopped: the job was asked to stop while it waited (nothing scored: a re-run resumes).
        TimeoutError: ``until`` passed (``SHARDLINE_TENANCY_WAIT_TIMEOUT_S``).
    """
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.responses import ConcurrencyLimitWithLeaseResponse

    from shardline.errors import JobStopped

    client = held.enter_context(get_client(sync_client=True))
    while True:
        try:
            response = client.increment_concurrency_slots_with_lease(
                names=[name], slots=slots, mode="concurrency", lease_duration=SLOT_LEASE_S)
            break
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code != 423:  # 423 Locked: the slots are held by others
                raise
            retry_after = float(exc.response.headers.get("Retry-After") or SLOT_POLL_S)
        wait = min(retry_after, SLOT_POLL_S)
        if until is not None:
            left = until - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"waited SHARDLINE_TENANCY_WAIT_TIMEOUT_S for {slots} slot(s) of {name}; "
                                   "they are held by other jobs")
            wait = min(wait, left)
        if stop is None:
            time.sleep(wait)
        elif stop.wait(wait):
            raise JobStopped(f"stopped on request while waiting for {slots} slot(s) of {name} (nothing was "
                             "scored): run the same command again to resume")
    lease = ConcurrencyLimitWithLeaseResponse.model_validate(response.json())
    if not lease.limits:  # ensure_limit made it a moment ago: somebody deleted it since
        raise InvalidSetting(f"the Prefect concurrency limit {name} was deleted while the job started: run the same "
                             "command again (it makes the limit anew)")
    held.callback(_release_lease, client, lease.lease_id, name)
    renewed = threading.Event()
    in_run = contextvars.copy_context()  # the renewal's warnings go to the run's log
    renewal = threading.Thread(target=in_run.run, args=(_renew_lease, lease.lease_id, name, renewed), daemon=True,
                               name=f"shardline-slots-{name}")
    renewal.start()
    held.callback(renewal.join, 30.0)
    held.callback(renewed.set)


def _renew_lease(lease_id: UUID, name: str, stop: threading.Event) -> None:
    """Renew the lease ``lease_id`` every ``SLOT_RENEW_S`` until ``stop``. A renewal that fails (a busy API) is tried
    again every ``SLOT_RETRY_S`` while the lease lasts; once it has lapsed the job goes on without it (its slots
    may be taken by others), said once in the run's log."""
    from prefect.client.orchestration import get_client

    renewed_at, wait = time.monotonic(), SLOT_RENEW_S
    with get_client(sync_client=True) as client:
        while not stop.wait(wait):
            try:
                client.renew_concurrency_lease(lease_id=lease_id, lease_duration=SLOT_LEASE_S)
                renewed_at, wait = time.monotonic(), SLOT_RENEW_S
            except Exception as exc:  # noqa: BLE001 - a failed renewal must not end the job
                if time.monotonic() - renewed_at >= SLOT_LEASE_S:
                    run_logger().warning("the lease on the slots of %s lapsed (%s): the job goes on, and other jobs "
                                         "may take its slots meanwhile", name, exc)
                    return
                wait = SLOT_RETRY_S
                run_logger().warning("could not renew the lease on the slots of %s (%s); trying again in %.0f s",
                                     name, exc, wait)


def _release_lease(client: "SyncPrefectClient", lease_id: UUID, name: str) -> None:
    try:
        client.release_concurrency_slots_with_lease(lease_id)
    except Exception as exc:  # noqa: BLE001 - the lease lapses on its own
        run_logger().warning("could not release the slots of %s (%s); they come back when their lease lapses, "
                             "within %.0f s", name, exc, SLOT_LEASE_S * 1.5)


def cluster_capacity(asked: str | None, dask: DaskSettings) -> str | None:
    """The capacity type the job's own cluster puts its workers on (``kube_cluster.on_capacity``): the one it asks
    for, on Kubernetes (spot only where the cluster has spot nodes, ``SHARDLINE_DASK_KUBERNETES_SPOT``); None: where
    the cluster places them (a local or shared cluster cannot move)."""
    if asked is None or dask.cluster != "kubernetes" or (asked == "spot" and not dask.kubernetes_spot):
        return None
    return asked


def job_capacity(asked: str | None, dask: DaskSettings, metering: MeteringSettings) -> str:
    """The capacity type a job's workers run on (what its ledger rows say): the one its own cluster is put on
    (``cluster_capacity``), else what the metering settings say this capacity is (``SHARDLINE_METERING_CAPACITY_TYPE``)."""
    return cluster_capacity(asked, dask) or metering.capacity_type


def batch_slots(dask: DaskSettings, max_in_flight: int | None, shards: int) -> int:
    """Device slots a job holds while its shards are scored (what the ledger's capacity row prices): the cluster's
    worker threads that this process starts (a local or a Kubernetes cluster), no more than the job's shards in
    flight; 0 for a cluster at an address, which the job shares and does not hold (then it pays what it used)."""
    if dask.cluster == "address":
        return 0
    workers = dask.kubernetes_workers if dask.cluster == "kubernetes" else dask.n_workers or (os.cpu_count() or 1)
    threads = workers * dask.threads_per_worker
    return max(0, min(threads, max_in_flight or threads, shards))


def meter_run(ledger: LedgerStore, plan: "JobPlan", metering: MeteringSettings, device: DeviceKind,
              records: list[PartRecord], shards: Sequence[ShardInfo], window: tuple[datetime, datetime],
              slots: int, capacity_type: str | None = None) -> float:
    """Write this run's use to the metering ledger: its settled shards' rows, device-seconds (the committed shards'
    own scoring time: a quarantined shard is not billed, nor counted toward the GPU-hours of the day or a budget)
    and bytes, and what it held (``slots`` for the scoring ``window``), on ``capacity_type`` (``job_capacity``;
    None: the metering settings'); returns the device-seconds."""
    seconds = sum(r.seconds for r in records if r.status == "committed")
    if not records:
        return seconds
    sizes = {s.relative: s.size for s in shards}
    layout = OutputLayout(plan.job.output_uri, plan.job.storage_options, plan.job_id)
    written = 0
    for record in records:
        if record.status == "committed":
            with contextlib.suppress(OSError):
                written += int(layout.fs.size(layout.part_path(record.relative)))
    holding = holding_of(metering, "batch", device, 1.0)
    if capacity_type is not None:
        holding = dataclasses.replace(holding, capacity_type=capacity_type)
    rows = sum(r.rows_out for r in records)
    measures = {"rows": rows, "device_seconds": seconds, "cpu_seconds": 0.0 if device == "gpu" else seconds,
                "bytes_read": sum(sizes.get(r.relative, 0) for r in records), "bytes_written": written}
    began, ended = window
    span = max(0.0, (ended - began).total_seconds())
    model = plan.job.model
    ledger.record_batch(holding, plan.tenant, model.name, model.version_label, plan.job_id, began, measures,
                        reserved_seconds=span * slots, window_seconds=span)
    return seconds
