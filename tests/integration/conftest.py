"""Integration fixtures: Prefect's test harness and one real Dask LocalCluster per session."""

from __future__ import annotations

import socket
from typing import Iterator

import pytest


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    """A real Prefect API (SQLite, temporary) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def dask_address() -> Iterator[str]:
    """A real LocalCluster with two worker processes, shared by the session."""
    from distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        yield cluster.scheduler_address


@pytest.fixture
def on_cluster(dask_address: str, prefect_harness: None, monkeypatch: pytest.MonkeyPatch) -> str:
    """Point the batch flow at the session's cluster (SHARDLINE_DASK_CLUSTER=address)."""
    monkeypatch.setenv("SHARDLINE_DASK_CLUSTER", "address")
    monkeypatch.setenv("SHARDLINE_DASK_ADDRESS", dask_address)
    return dask_address
