"""The output lease on a real S3 server (moto), and what the batch flow does with an output it does not own."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from fsspec.implementations.local import LocalFileSystem

from shardline.errors import OutputInUse
from shardline.flows.batch_inference import batch_inference
from shardline.storage.lease import LeaseTerms, OutputLease, ThisProcess

from tests.concurrency import at_once
from tests.integration.conftest import S3Server

T0 = datetime(2026, 12, 1, 6, 0, tzinfo=timezone.utc)
TERMS = LeaseTerms(ttl_s=120, renew_s=30)


def acquire(s3: S3Server, root: str, job: str, *, at: datetime = T0, host: str = "host-a") -> OutputLease:
    fs = s3.filesystem()
    return OutputLease.acquire(fs, root, f"s3://{root}", job, "bc:1", TERMS, clock=lambda: at,
                               here=ThisProcess(host, 7, "ns"), alive=lambda _pid: True)


def test_on_s3_one_job_holds_the_output_and_a_lapsed_one_is_taken_over(s3_server: S3Server, s3_prefix: str) -> None:
    root = f"{s3_server.bucket}/{s3_prefix}/out"
    first = acquire(s3_server, root, "job-a")

    with pytest.raises(OutputInUse, match=rf"the output s3://{root} is in use by job job-a \(model bc:1, on host host-a"):
        acquire(s3_server, root, "job-b", at=T0 + timedelta(seconds=119), host="host-b")

    second = acquire(s3_server, root, "job-b", at=T0 + timedelta(seconds=121), host="host-b")

    assert second.record.generation == 2
    keys = sorted(p.rsplit("/", 1)[-1] for p in s3_server.filesystem().find(f"{root}/_lease"))
    assert keys == ["0000000002.json"]
    with pytest.raises(OutputInUse, match="job job-a lost its lease .* to job job-b"):
        first.check()
    second.release()
    assert acquire(s3_server, root, "job-c", at=T0 + timedelta(seconds=122), host="host-c").record.generation == 3


def test_on_s3_of_racing_jobs_exactly_one_takes_the_output(s3_server: S3Server, s3_prefix: str) -> None:
    root = f"{s3_server.bucket}/{s3_prefix}/out"
    outcomes = at_once(8, lambda i: acquire(s3_server, root, f"job-{i}", host=f"host-{i}").record.job_id,
                       catch=(OutputInUse,))
    won = [o for o in outcomes if isinstance(o, str)]
    refused = [str(o) for o in outcomes if isinstance(o, OutputInUse)]

    assert len(won) == 1 and len(refused) == 7, (won, refused)
    assert all(f"in use by job {won[0]} " in r for r in refused)


@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_a_job_stages_under_its_own_id_and_leaves_another_jobs_staging_alone(input_shards: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    theirs = out / "_staging" / "another-job" / "part-00000.parquet.tmp"
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(b"being written by someone else")

    state = batch_inference(model="breast-cancer@prod", input_uri=str(input_shards), output_uri=str(out),
                            return_state=True)

    assert state.is_completed(), state.message
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["job_key"] and len(manifest["parts"]) == 6
    assert theirs.read_bytes() == b"being written by someone else"
    assert [p.name for p in (out / "_staging").iterdir()] == ["another-job"]
    lease = json.loads((out / "_lease" / "0000000001.json").read_text())
    assert lease["job_id"] == manifest["job_id"] and lease["released"] is True


@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_an_output_with_a_live_lease_of_another_job_is_refused_before_anything_is_written(
    input_shards: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    holder = OutputLease.acquire(LocalFileSystem(), str(out), str(out), "other-job", "bc:9",
                                 TERMS, here=ThisProcess("elsewhere", 1, "ns"))
    try:
        state = batch_inference(model="breast-cancer@prod", input_uri=str(input_shards), output_uri=str(out),
                                return_state=True)
    finally:
        holder.release()

    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, OutputInUse) and error.holder == "other-job"
    assert "in use by job other-job (model bc:9, on host elsewhere pid 1" in str(error)
    assert sorted(p.name for p in out.iterdir()) == ["_lease"]
