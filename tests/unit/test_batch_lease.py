"""The output lease on local disk: one owner at a time, takeover only of a dead or lapsed owner."""

from __future__ import annotations

import subprocess
import time
from types import SimpleNamespace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from fsspec.implementations.local import LocalFileSystem
from pydantic import ValidationError

from shardline.errors import OutputInUse, OutputNotWritable
from shardline.settings import BatchSettings
from shardline.storage.job_identity import foreign_parts, up_to_date
from shardline.storage.lease import LEASE_DIR, LeaseTerms, OutputLease, ThisProcess, holding_output
from shardline.storage.output import PartRecord

from tests.concurrency import at_once

T0 = datetime(2026, 12, 1, 6, 0, tzinfo=timezone.utc)
TERMS = LeaseTerms(ttl_s=120, renew_s=30)


def acquire(root: Path, job: str, *, at: datetime = T0, host: str = "host-a", pid: int = 4242,
            model: str = "bc:1") -> OutputLease:
    return OutputLease.acquire(
        LocalFileSystem(), str(root), str(root), job, model, TERMS, clock=lambda: at,
        here=ThisProcess(host, pid, "ns"), alive=lambda _pid: True,
    )


def test_a_second_job_is_refused_with_a_message_naming_the_running_one(tmp_path: Path) -> None:
    acquire(tmp_path, "job-a", model="bc:1")

    with pytest.raises(OutputInUse) as refused:
        acquire(tmp_path, "job-b", at=T0 + timedelta(seconds=60), host="host-b", model="bc:2")

    message = str(refused.value)
    assert "in use by job job-a (model bc:1, on host host-a pid 4242, since 2026-12-01T06:00:00+00:00)" in message
    assert "`shardline batch status job-a`" in message and "choose another --output" in message
    assert refused.value.holder == "job-a"
    assert sorted(p.name for p in (tmp_path / LEASE_DIR).glob("*.json")) == ["0000000001.json"]


def test_the_same_job_run_twice_is_told_it_is_already_running(tmp_path: Path) -> None:
    acquire(tmp_path, "job-a", host="host-a")

    with pytest.raises(OutputInUse, match=r"job job-a is already running on the output .* \(on host host-a pid 4242"):
        acquire(tmp_path, "job-a", at=T0 + timedelta(seconds=5), host="host-b")


def test_a_lapsed_lease_is_taken_over_and_its_old_owner_learns_it_lost(tmp_path: Path) -> None:
    old = acquire(tmp_path, "job-a", host="host-a")

    new = acquire(tmp_path, "job-b", at=T0 + timedelta(seconds=121), host="host-b", model="bc:2")

    assert new.record.generation == 2
    assert sorted(p.name for p in (tmp_path / LEASE_DIR).glob("*.json")) == ["0000000002.json"]
    with pytest.raises(OutputInUse, match="job job-a lost its lease on the output .* to job job-b"):
        old.check()
    with pytest.raises(OutputInUse):
        old.renew()
    new.check()  # the new owner holds it
    old.release()  # a lost lease's release leaves the new owner's alone
    new.check()


def test_a_job_holds_its_lease_from_its_setup_to_its_end_and_a_failed_setup_gives_it_back(tmp_path: Path) -> None:
    """Both job kinds hold the output one way: taken for the setup (given back when it fails), held and renewed
    through the body, given back however the body ends."""
    fs, root = LocalFileSystem(), str(tmp_path)
    with pytest.raises(ValueError, match="the ledger does not parse"):
        with OutputLease.taking(fs, root, root, "job-a", "bc:1", TERMS):
            raise ValueError("the ledger does not parse")
    assert OutputLease.current(fs, str(tmp_path / LEASE_DIR))[1].released  # type: ignore[union-attr]

    with OutputLease.taking(fs, root, root, "job-a", "bc:1", LeaseTerms(ttl_s=120, renew_s=0.05)) as lease:
        pass
    plan = SimpleNamespace(lease=lease)
    with pytest.raises(RuntimeError, match="a shard failed"):
        with holding_output(plan):
            first = lease.record.renewed_at
            deadline = time.monotonic() + 10
            while lease.record.renewed_at == first and time.monotonic() < deadline:
                time.sleep(0.02)
            assert lease.record.renewed_at > first  # renewed while the body runs
            with pytest.raises(OutputInUse, match="in use by job job-a"):
                OutputLease.acquire(fs, root, root, "job-b", "bc:2", TERMS)
            raise RuntimeError("a shard failed")
    taken = OutputLease.acquire(fs, root, root, "job-b", "bc:2", TERMS)  # given back: the next job takes it at once
    assert taken.record.generation == lease.record.generation + 1
    with holding_output(SimpleNamespace(lease=None)):  # a finished output: no lease, nothing to give back
        pass


def test_a_dead_process_of_this_host_loses_its_lease_at_once(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    here = ThisProcess.here()
    OutputLease.acquire(LocalFileSystem(), str(tmp_path), str(tmp_path), "job-a", "bc:1", TERMS,
                        here=ThisProcess(here.host, gone.pid, here.pid_namespace))

    taken = OutputLease.acquire(LocalFileSystem(), str(tmp_path), str(tmp_path), "job-a", "bc:1", TERMS)

    assert taken.record.generation == 2


def test_a_live_process_of_this_host_keeps_its_lease(tmp_path: Path) -> None:
    here = ThisProcess.here()
    with subprocess.Popen(["sleep", "30"]) as alive:
        try:
            OutputLease.acquire(LocalFileSystem(), str(tmp_path), str(tmp_path), "job-a", "bc:1", TERMS,
                                here=ThisProcess(here.host, alive.pid, here.pid_namespace))
            with pytest.raises(OutputInUse, match=f"already running .* pid {alive.pid}"):
                OutputLease.acquire(LocalFileSystem(), str(tmp_path), str(tmp_path), "job-a", "bc:1", TERMS)
        finally:
            alive.kill()


def test_a_released_lease_is_free_at_once(tmp_path: Path) -> None:
    acquire(tmp_path, "job-a").release()

    assert acquire(tmp_path, "job-b", at=T0 + timedelta(seconds=1), host="host-b").record.generation == 2


def test_of_racing_jobs_exactly_one_takes_the_output(tmp_path: Path) -> None:
    outcomes = at_once(12, lambda i: acquire(tmp_path, f"job-{i}", host=f"host-{i}").record.job_id,
                       catch=(OutputInUse,))
    won = [o for o in outcomes if isinstance(o, str)]
    refused = [str(o) for o in outcomes if isinstance(o, OutputInUse)]

    assert len(won) == 1 and len(refused) == 11
    assert all(f"in use by job {won[0]} " in r for r in refused)


def test_the_heartbeat_renews_the_expiry(tmp_path: Path) -> None:
    lease = OutputLease.acquire(LocalFileSystem(), str(tmp_path), str(tmp_path), "job-a", "bc:1",
                                LeaseTerms(ttl_s=5, renew_s=0.05))
    first = lease.record.expires_at
    lease.start_heartbeat()
    deadline = time.monotonic() + 10
    path = tmp_path / LEASE_DIR / "0000000001.json"
    while '"released":false' in path.read_text() and first.isoformat()[:19] in path.read_text():
        assert time.monotonic() < deadline, "the lease was never renewed"
        time.sleep(0.02)
    lease.release()
    assert '"released":true' in path.read_text()


def test_an_output_that_is_a_file_is_refused_as_not_writable(tmp_path: Path) -> None:
    target = tmp_path / "out.parquet"
    target.write_bytes(b"x")

    with pytest.raises(OutputNotWritable, match=r"is a file, not a folder; running again will not help"):
        acquire(target, "job-a")


def test_renewing_no_faster_than_the_lease_lapses_is_refused() -> None:
    with pytest.raises(ValidationError, match="LEASE_RENEW_S .* must be under SHARDLINE_BATCH_LEASE_TTL_S"):
        BatchSettings(lease_ttl_s=10, lease_renew_s=10)


def record(relative: str, key: str, status: str = "committed") -> PartRecord:
    return PartRecord(shard=f"in/{relative}", relative=relative, fingerprint="1:2", job_key=key, status=status,  # type: ignore[arg-type]
                      part=f"out/{relative}" if status == "committed" else None)


def test_an_output_of_another_model_is_foreign_and_of_the_same_is_not() -> None:
    manifest = {"job_id": "j1", "job_key": "k1", "model": {"pinned": "bc:1"}}

    assert foreign_parts(manifest, {"a": record("a", "k1")}, "k1") is None
    assert foreign_parts(manifest, {}, "k2") == "the parts of job j1 (model bc:1; its manifest is there)"
    assert foreign_parts(None, {"a": record("a", "k1")}, "k2") == (
        "1 parts settled by another model or passthrough (first: a)"
    )


def test_a_finished_manifest_is_up_to_date_only_for_the_same_job_and_parts() -> None:
    settled = [record("a", "k"), record("b", "k", "quarantined")]
    manifest = {"job_id": "j1", "parts": [{"part": "out/a"}], "quarantined": [{"shard": "in/b"}]}

    assert up_to_date(manifest, "j1", settled)
    assert not up_to_date(manifest, "j2", settled)
    assert not up_to_date(manifest, "j1", [record("a", "k")])
