"""Integration fixtures: Prefect's test harness, a real Dask LocalCluster and a real S3 server per session."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

import pytest

from shardline.local_ports import reserve_port as free_port


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    """A real Prefect API (SQLite, temporary) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def dask_address() -> Iterator[str]:
    """A real LocalCluster with two worker processes, shared by the session, on the Dask settings of the clusters
    Shardline starts (``QUIET_CLUSTER``: no profiler, slower ticks; idle, 8% of a core against 15% on Dask's)."""
    import dask
    from distributed import LocalCluster

    from shardline.tasks.cluster import QUIET_CLUSTER

    with dask.config.set(QUIET_CLUSTER):  # only while it starts (its nannies keep it): later tests see Dask's own
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
    with cluster:
        yield cluster.scheduler_address


@pytest.fixture
def on_cluster(dask_address: str, prefect_harness: None, monkeypatch: pytest.MonkeyPatch) -> str:
    """Point the batch flow at the session's cluster (SHARDLINE_DASK_CLUSTER=address)."""
    monkeypatch.setenv("SHARDLINE_DASK_CLUSTER", "address")
    monkeypatch.setenv("SHARDLINE_DASK_ADDRESS", dask_address)
    return dask_address


@dataclass(frozen=True)
class S3Server:
    """A real S3 API (moto's server mode) on loopback, with one bucket."""

    endpoint: str
    bucket: str
    storage_options: dict[str, Any]

    def url(self, *parts: str) -> str:
        """``s3://<bucket>/<parts...>``."""
        return "/".join([f"s3://{self.bucket}", *parts])

    def filesystem(self) -> Any:
        """A fresh s3fs file system on this server (no listing cache shared with Shardline)."""
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options, skip_instance_cache=True, use_listings_cache=False)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server on a free loopback port for the session; nothing can reach real AWS.

    The credentials are fake and the endpoint is loopback; they travel to Dask workers
    inside the storage options, so worker processes started earlier need nothing else.
    """
    import boto3
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", "testing")
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            env.delenv(name, raising=False)
        port = free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        try:
            endpoint = f"http://127.0.0.1:{port}"
            bucket = "shardline-test"
            boto3.client(
                "s3", endpoint_url=endpoint, region_name="us-east-1",
                aws_access_key_id="testing", aws_secret_access_key="testing",
            ).create_bucket(Bucket=bucket)
            options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
            yield S3Server(endpoint, bucket, options)
        finally:
            server.stop()


@pytest.fixture
def s3_prefix(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh prefix in the bucket for one test, with Shardline's storage options set to reach it."""
    monkeypatch.setenv("SHARDLINE_STORAGE_STORAGE_OPTIONS", json.dumps(s3_server.storage_options))
    return f"t-{uuid.uuid4().hex[:12]}"
