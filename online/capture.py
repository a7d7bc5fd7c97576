"""Online capture: a sample of requests and their answers, per model version, into Parquet (issue 6).

``OnlineCapture`` decides which requests are sampled (``capture_rate``, per request) and
hands each sample (the rows as the model read them, its answer, the tenant and the
request id) to the version's ``CaptureBuffer`` from ``shardline.storage.capture``: an
append under a lock, so the request path pays microseconds and no I/O. The buffer's own
thread writes the files (``<root>/<model>/v<version>/online/date=.../*.parquet``); when the
store falls behind, samples are dropped and counted, never queued without bound. The
buffers are made when a version is first served and closed (flushed) when the server stops.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Awaitable, Callable, TypeVar

import numpy as np
import pyarrow as pa

from shardline.online.logs import current
from shardline.online.metrics import Metrics
from shardline.rows import Rows
from shardline.storage.capture import CaptureBuffer

log = logging.getLogger("shardline.online")
T = TypeVar("T")
TIER = "online"


class OnlineCapture:
    """The capture buffers of the versions a server serves; off when ``rate`` is 0 or there is no ``root``."""

    def __init__(self, root: str | None, rate: float, metrics: Metrics,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.root = root
        self.rate = rate if root else 0.0
        self.metrics = metrics
        self.storage_options = storage_options
        self._buffers: dict[tuple[str, int], CaptureBuffer] = {}

    async def open(self, name: str, version: int, run_blocking: Callable[[Callable[[], T]], Awaitable[T]]) -> None:
        """Make the version's buffer (off the loop: it opens the file system) unless capture is off or it exists."""
        key = (name, version)
        if not self.rate or key in self._buffers:
            return
        root, options = str(self.root), self.storage_options
        buffer: CaptureBuffer = await run_blocking(lambda: CaptureBuffer(root, name, version, TIER, options))
        if key in self._buffers:  # another request made one meanwhile
            await run_blocking(buffer.close)
        else:
            self._buffers[key] = buffer

    def draw(self) -> bool:
        """Whether this request is captured: true with probability ``rate``; drawn once per request."""
        rate = self.rate
        return bool(rate) and (rate >= 1.0 or random.random() < rate)

    def sample(self, name: str, version: int, tenant: str, rows: Rows,
               answer: pa.Table | pa.RecordBatch | dict[str, np.ndarray], drawn: bool | None = None) -> None:
        """Capture this request when ``drawn`` (None: draw now) (never fails the request): float rows and a numpy
        answer as they are (made into Arrow on the buffer's thread, many requests at once), else as tables."""
        if not (self.draw() if drawn is None else drawn):
            return
        buffer = self._buffers.get((name, version))
        if buffer is None:
            return
        info = current()
        source = info.request_id if info is not None else ""
        try:
            if rows.arrays is not None and isinstance(answer, dict):
                kept = buffer.add_arrays(rows.plan, rows.arrays, answer, tenant=tenant, source=source)
            else:
                table = rows.table()
                kept = buffer.add(table if isinstance(table, pa.Table) else pa.Table.from_batches([table]),
                                  rows.plan.answer_table(answer), tenant=tenant, source=source)
        except Exception:  # noqa: BLE001 - capture must never fail a request
            log.exception("a sample could not be captured")
            kept = False
        self.metrics.observe_capture(name, str(version), rows.num_rows, kept)

    async def close(self, run_blocking: Callable[[Callable[[], T]], Awaitable[T]]) -> None:
        """Write what every buffer holds and stop their threads."""
        for buffer in list(self._buffers.values()):
            try:
                await run_blocking(buffer.close)
            except Exception:  # noqa: BLE001 - the other buffers still get their turn
                log.exception("a capture buffer failed to close")
