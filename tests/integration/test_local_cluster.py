"""The LocalClusters ``shardline.tasks.cluster`` starts, run for real: what their worker processes load."""

from __future__ import annotations

from shardline.settings import DaskSettings
from shardline.tasks.cluster import dask_scheduler


def _heartbeat_failure_logged(dask_worker: object) -> tuple[bool, bool]:
    """In a worker: is the closing worker's heartbeat failure kept, and is a running one's?"""
    import logging
    import types

    from distributed.core import Status

    from shardline.tasks.worker_logs import HEARTBEAT_FAILED, ClosingHeartbeatFilter

    logger = logging.getLogger("distributed.worker")
    record = logger.makeRecord(logger.name, logging.ERROR, __file__, 1, HEARTBEAT_FAILED, (), None)
    running = logger.filter(record)
    [ours] = [f for f in logger.filters if isinstance(f, ClosingHeartbeatFilter)]
    watched = ours.worker
    assert watched is dask_worker
    ours.worker = types.SimpleNamespace(status=Status.closing)
    try:
        closing = logger.filter(record)
    finally:
        ours.worker = watched
    return bool(closing), bool(running)


def test_a_local_workers_heartbeat_failure_is_quiet_only_once_it_closes() -> None:
    """Worker processes of the clusters started here load ``worker_logs``: a heartbeat in flight when a worker
    closes fails on the closed connections and must not print a traceback after a completed job."""
    import dask
    from distributed import Client

    with dask.config.set({"distributed.worker.preload": ["a_users_preload_module_stays"]}):
        from shardline.tasks.cluster import worker_preload_config

        assert worker_preload_config()["distributed.worker.preload"] == [
            "a_users_preload_module_stays", "shardline.tasks.worker_logs"]
    with dask_scheduler(DaskSettings(n_workers=1, threads_per_worker=1)) as address, Client(address) as client:
        [(closing, running)] = client.run(_heartbeat_failure_logged).values()
    assert (closing, running) == (False, True)
