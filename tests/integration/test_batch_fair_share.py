"""A batch job's fair share of the cluster (``tasks/fairness.fair_share``) on a real Prefect API: a job waiting for
its tenant's shard slots, which other jobs hold, stops when it is asked to (its command interrupted: the warm
runner's stop request), instead of waiting on until the slots come back; it takes them once they do. (Before, a
slot held by a killed job's lease kept the next job waiting, unstoppable, for Prefect's default five minutes.) A job
given a time-out for the wait (``SHARDLINE_TENANCY_WAIT_TIMEOUT_S``) gives up when it passes, holding nothing."""

from __future__ import annotations

import threading
import time

import pytest

from shardline.errors import JobStopped
from shardline.settings import TenancySettings
from shardline.tasks.dispatch import STOP_REQUEST
from shardline.tasks.fairness import SLOT_LEASE_S, ensure_limit, fair_share, limit_names
from shardline.tenants import BatchPolicy, BatchTenant


@pytest.mark.usefixtures("prefect_harness")
def test_a_job_waiting_for_its_tenants_slots_stops_when_asked_and_takes_them_once_free() -> None:
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency

    tenant = BatchTenant("waiter", BatchPolicy(storage_prefixes=["/data"], max_concurrent_shards=2))
    class_name, slots_name = limit_names(tenant.name, "normal")
    ensure_limit(slots_name, 2)
    held, release = threading.Event(), threading.Event()

    def other_job() -> None:  # holds both of the tenant's slots until released
        with concurrency(slots_name, occupy=2, lease_duration=SLOT_LEASE_S, strict=True):
            held.set()
            release.wait(60)

    holder = threading.Thread(target=other_job)
    holder.start()
    assert held.wait(30)
    stop = threading.Event()
    token = STOP_REQUEST.set(stop)
    try:
        with pytest.raises(TimeoutError, match=r"waited SHARDLINE_TENANCY_WAIT_TIMEOUT_S for 2 slot\(s\) of "
                                               r"shardline-batch-tenant-waiter; they are held by other jobs"):
            with fair_share(tenant, "normal", 5, TenancySettings(wait_timeout_s=1.0)):
                pytest.fail("the slots were taken while another job held them")
        threading.Timer(1.0, stop.set).start()  # the command interrupted while its job waits
        with pytest.raises(JobStopped, match=r"stopped on request while waiting for 2 slot\(s\) of "
                                             r"shardline-batch-tenant-waiter \(nothing was scored\)"):
            with fair_share(tenant, "normal", 5, TenancySettings()):
                pytest.fail("the slots were taken while another job held them")
    finally:
        STOP_REQUEST.reset(token)
        release.set()
        holder.join()
    with get_client(sync_client=True) as client:  # nothing of the stopped job's is held
        assert client.read_global_concurrency_limit_by_name(slots_name).active_slots == 0
        assert client.read_global_concurrency_limit_by_name(class_name).active_slots == 0
    with fair_share(tenant, "normal", 5, TenancySettings()) as in_flight:
        assert in_flight == 2
        with get_client(sync_client=True) as client:
            assert client.read_global_concurrency_limit_by_name(slots_name).active_slots == 2


@pytest.mark.usefixtures("prefect_harness")
def test_a_job_renews_the_lease_on_its_slots_while_it_holds_them_and_lets_them_go_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The job's slots are held on a lease that lapses unless renewed: the holder renews it (here every 2 s, at
    3/4 of the lease in a job), each renewal accepted by the server, and stops once the slots are released. A
    renewal that fails (the API busy for a moment) is tried again soon, not a whole period later, by when the
    lease would have lapsed."""
    import httpx
    from prefect.client.orchestration import SyncPrefectClient, get_client

    from shardline.tasks import fairness

    renewed: list[tuple[object, int, float]] = []  # (lease, status, when)
    failed: list[tuple[object, float]] = []
    renew = SyncPrefectClient.renew_concurrency_lease

    def counted(client: SyncPrefectClient, lease_id, lease_duration):  # type: ignore[no-untyped-def]
        if not failed:  # the first renewal meets a busy API
            failed.append((lease_id, time.monotonic()))
            raise httpx.ReadTimeout("the API took too long")
        answer = renew(client, lease_id=lease_id, lease_duration=lease_duration)
        renewed.append((lease_id, answer.status_code, time.monotonic()))
        return answer

    monkeypatch.setattr(SyncPrefectClient, "renew_concurrency_lease", counted)
    monkeypatch.setattr(fairness, "SLOT_RENEW_S", 2.0)
    monkeypatch.setattr(fairness, "SLOT_RETRY_S", 0.1)
    tenant = BatchTenant("renewer", BatchPolicy(storage_prefixes=["/data"], max_concurrent_shards=3))
    class_name, slots_name = limit_names(tenant.name, "normal")
    with fair_share(tenant, "normal", 2, TenancySettings()) as in_flight:
        assert in_flight == 2
        deadline = time.monotonic() + 30
        while len({lease for lease, _, _ in renewed}) < 2 or len(renewed) < 4:  # both leases, twice or more
            assert time.monotonic() < deadline, f"renewals: {renewed}"
            time.sleep(0.05)
    [(lease, failed_at)] = failed
    again = min(when for renewed_lease, _, when in renewed if renewed_lease == lease)
    assert again - failed_at < 1.0  # tried again after SLOT_RETRY_S, not a whole SLOT_RENEW_S later
    assert {status for _, status, _ in renewed} == {204}, renewed
    # the renewal threads ended with the slots (joined when they were released)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("shardline-slots-")]
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name(slots_name).active_slots == 0
        assert client.read_global_concurrency_limit_by_name(class_name).active_slots == 0
