"""A Dask worker preload for the LocalClusters this package starts (``cluster.dask_scheduler``): keeps a worker's
shutdown race out of the user's console.

A worker stops its heartbeat when it closes, but a heartbeat already in flight then fails on the worker's own closed
connection pool (or on the scheduler that closed behind it), and ``distributed.worker`` logs that at ERROR with a
three-exception traceback: seen at the end of a job that had completed, about once in 15 cluster closes on a loaded
2-core machine (distributed 2026.8). Only that record, and only from a worker already closing, is dropped: a
heartbeat failing while the worker runs is still logged.
"""

from __future__ import annotations

import logging
from typing import Any

MODULE = __name__
HEARTBEAT_FAILED = "Failed to communicate with scheduler during heartbeat."


class ClosingHeartbeatFilter(logging.Filter):
    """Drops ``HEARTBEAT_FAILED`` while the worker it watches is closing or closed."""

    def __init__(self, worker: Any) -> None:
        super().__init__()
        self.worker = worker

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != HEARTBEAT_FAILED:
            return True
        from distributed.core import Status

        return self.worker.status not in (Status.closing, Status.closing_gracefully, Status.closed)


def dask_setup(worker: Any) -> None:
    """Dask's preload hook, called in each worker process once its worker exists."""
    logger = logging.getLogger("distributed.worker")
    if not any(isinstance(f, ClosingHeartbeatFilter) for f in logger.filters):
        logger.addFilter(ClosingHeartbeatFilter(worker))
