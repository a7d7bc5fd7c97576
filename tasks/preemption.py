"""Spot preemption: a worker told it will be reclaimed leaves gracefully.

A Dask worker plugin (:class:`PreemptionPlugin`, registered on the cluster by the
flow's ``infer-shards`` task with the flow's settings, so every worker present and
future has it) watches the notice sources of ``DaskSettings.preemption_notices``:

- ``sigterm``: the worker process receives SIGTERM (a nanny-managed worker process,
  or ``kill -TERM`` on it);
- ``file:/PATH``: the file exists (a Kubernetes preStop hook or a node agent writes it);
- ``http(s)://URL``: a metadata endpoint answers 200 with a body that is not
  ``FALSE`` (AWS ``/latest/meta-data/spot/instance-action``, GCP ``instance/preempted``).

On a notice the worker (1) asks the scheduler to stop giving it work (it becomes
``closing_gracefully``; what it holds in memory is copied to other workers), (2) lets
the shards it is running finish for up to ``preemption_drain_s`` seconds, then (3) is
retired: whatever it still runs goes back to the scheduler as an *expected* loss (no
count towards ``allowed-failures``), and the worker and its nanny close. Shard work is
idempotent and commits its own part, so a shard finished by a worker that was then
retired, and run again elsewhere, still yields one identical part.

No Prefect here: this runs on the workers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

logger = logging.getLogger("shardline.preemption")

PLUGIN_NAME = "shardline-preemption"


def notice_in_body(status: int, body: bytes) -> bool:
    """True when a metadata endpoint's answer means "you are being preempted".

    AWS answers 404 until a notice exists, then 200 with a JSON action; GCP answers
    200 with ``TRUE`` or ``FALSE``.
    """
    if status != 200:
        return False
    text = body.strip().upper()
    return bool(text) and text != b"FALSE"


@dataclass
class NoticeSources:
    """Where to look for a preemption notice; parsed from ``DaskSettings.preemption_notices``."""

    sigterm: bool = False
    files: tuple[str, ...] = ()
    urls: tuple[str, ...] = ()
    headers: dict[str, str] = field(default_factory=lambda: {"Metadata-Flavor": "Google"})

    @classmethod
    def parse(cls, sources: tuple[str, ...] | list[str]) -> NoticeSources:
        """Read ``sigterm``, ``file:/PATH`` and ``http(s)://URL`` entries.

        Raises:
            ValueError: an entry of another form.
        """
        files, urls, sigterm = [], [], False
        for source in sources:
            if source == "sigterm":
                sigterm = True
            elif source.startswith("file:"):
                path = source[len("file:"):]
                files.append(path[2:] if path.startswith("///") else path)
            elif source.startswith(("http://", "https://")):
                urls.append(source)
            else:
                raise ValueError(
                    f"preemption notice source {source!r} is unknown; use 'sigterm', 'file:/PATH' or an http(s):// URL"
                )
        return cls(sigterm, tuple(files), tuple(urls))

    def polled_notice(self, timeout: float = 0.5) -> str | None:
        """The first file or URL source that holds a notice now, or None (blocking I/O)."""
        for path in self.files:
            if os.path.exists(path):
                return f"file {path}"
        for url in self.urls:
            request = urllib.request.Request(url, headers=self.headers)
            try:
                with urllib.request.urlopen(request, timeout=timeout) as answer:  # noqa: S310 (a configured URL)
                    if notice_in_body(answer.status, answer.read(4096)):
                        return f"endpoint {url}"
            except urllib.error.HTTPError as e:
                if notice_in_body(e.code, b""):
                    return f"endpoint {url}"
            except (OSError, ValueError):
                continue  # no metadata service here, or it is slow: no notice
        return None


class PreemptionPlugin(WorkerPlugin):
    """Worker plugin: watch the notice sources and retire the worker gracefully on a notice.

    Registered once per cluster (idempotent by name); ``setup`` runs on each worker,
    present and future.
    """

    idempotent = True
    name = PLUGIN_NAME

    def __init__(self, sources: tuple[str, ...] | list[str], poll_s: float = 1.0, drain_s: float = 20.0) -> None:
        self.sources = NoticeSources.parse(sources)
        self.poll_s = poll_s
        self.drain_s = drain_s
        self._worker: Any = None
        self._task: asyncio.Task[None] | None = None
        self._previous_handler: Any = None
        self._retiring = False

    def setup(self, worker: Any) -> None:
        """Start watching on this worker (called by Dask in the worker's event loop)."""
        self._worker = worker
        loop = asyncio.get_running_loop()
        if self.sources.sigterm and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(
                signal.SIGTERM, lambda *_: loop.call_soon_threadsafe(self.notice, "SIGTERM")
            )
        if self.sources.files or self.sources.urls:
            self._task = loop.create_task(self._poll())

    def teardown(self, worker: Any) -> None:
        """Stop watching (the plugin was replaced or the worker closes)."""
        if self._task is not None:
            self._task.cancel()
        if self._previous_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def __getstate__(self) -> dict[str, Any]:
        return {"sources": self.sources, "poll_s": self.poll_s, "drain_s": self.drain_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._worker, self._task, self._previous_handler, self._retiring = None, None, None, False

    async def _poll(self) -> None:
        while not self._retiring:
            reason = await asyncio.to_thread(self.sources.polled_notice)
            if reason:
                self.notice(reason)
                return
            await asyncio.sleep(self.poll_s)

    def notice(self, reason: str) -> None:
        """Begin the graceful exit (once), from the event loop's thread."""
        if self._retiring or self._worker is None:
            return
        self._retiring = True
        asyncio.get_running_loop().create_task(retire_gracefully(self._worker, reason, self.drain_s))


async def retire_gracefully(worker: Any, reason: str, drain_s: float) -> None:
    """Stop taking shards, let running ones finish for up to ``drain_s``, hand back the rest, close."""
    address = worker.address
    logger.warning("worker %s got a preemption notice (%s): draining for up to %.0f s", address, reason, drain_s)
    try:
        # No new work; copies of what this worker holds go to the others.
        await worker.scheduler.retire_workers(
            workers=[address], close_workers=False, remove=False, stimulus_id=f"preemption-drain-{time.time()}"
        )
        deadline = time.monotonic() + drain_s
        while worker.state.executing_count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        handed_back = worker.state.executing_count
        # Unfinished shards go back as an expected loss; finished results are copied.
        await worker.scheduler.retire_workers(
            workers=[address], close_workers=False, remove=True, stimulus_id=f"preemption-retire-{time.time()}"
        )
        logger.warning("worker %s retired after its preemption notice (%d shards handed back)", address, handed_back)
    except Exception:  # the scheduler is gone too: closing is all that is left
        logger.exception("worker %s could not retire gracefully; closing", address)
    await worker.close(nanny=True, reason=f"preemption notice ({reason})")

