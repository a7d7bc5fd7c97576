"""Spot preemption: a worker told it will be reclaimed leaves gracefully.

A Dask worker plugin (:class:`PreemptionPlugin`, registered on the cluster by the
flow's ``infer-shards`` task with the flow's settings, so every worker present and
future has it) watches the notice sources of ``DaskSettings.preemption_notices``:

- ``sigterm``: the worker process receives SIGTERM (a nanny-managed worker process,
  or ``kill -TERM`` on it);
- ``file:/PATH``: the file exists (a Kubernetes preStop hook or a node agent writes it);
- ``http(s)://URL``: a metadata endpoint answers 200 with a body that is not
  ``FALSE`` (GCP ``instance/preempted``, sent with ``Metadata-Flavor: Google``; AWS
  ``/latest/meta-data/spot/instance-action`` where IMDSv1 is still allowed);
- ``aws`` (or ``aws:http://HOST:PORT``): EC2 spot through IMDSv2, a session token first
  (``PUT /latest/api/token``), then ``GET /latest/meta-data/spot/instance-action``;
- ``azure`` (or ``azure:http://HOST:PORT``): Azure Scheduled Events
  (``GET /metadata/scheduledevents``): an event of type ``Preempt`` for this VM.

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
import json
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

# The link-local metadata address both clouds serve their instance metadata on.
METADATA_HOST = "http://169.254.169.254"
# AWS IMDSv2 (docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html and
# .../spot-instance-termination-notices.html): PUT /latest/api/token with header
# X-aws-ec2-metadata-token-ttl-seconds (1-21600) answers a token; each GET carries it in
# X-aws-ec2-metadata-token. /latest/meta-data/spot/instance-action answers 404 until EC2 will
# stop or terminate the spot instance, then 200 {"action": "terminate"|"stop"|"hibernate", "time": ISO}.
AWS_TOKEN_PATH = "/latest/api/token"
AWS_TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
AWS_TOKEN_HEADER = "X-aws-ec2-metadata-token"
AWS_SPOT_ACTION_PATH = "/latest/meta-data/spot/instance-action"
# Azure Scheduled Events (learn.microsoft.com/azure/virtual-machines/linux/scheduled-events):
# GET /metadata/scheduledevents?api-version=2020-07-01 with header "Metadata: true" answers
# {"DocumentIncarnation": n, "Events": [{"EventId", "EventType", "ResourceType", "Resources",
# "EventStatus", "NotBefore", "Description", "EventSource", "DurationInSeconds"}]}; a Spot
# eviction is EventType "Preempt". Events reach every VM of an availability set or scale-set
# placement group, so only one whose Resources name this VM (instance/compute/name) counts.
AZURE_EVENTS_PATH = "/metadata/scheduledevents?api-version=2020-07-01"
AZURE_NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
AZURE_HEADERS = {"Metadata": "true"}


def notice_in_body(status: int, body: bytes) -> bool:
    """True when a metadata endpoint's answer means "you are being preempted".

    AWS answers 404 until a notice exists, then 200 with a JSON action; GCP answers
    200 with ``TRUE`` or ``FALSE``.
    """
    if status != 200:
        return False
    text = body.strip().upper()
    return bool(text) and text != b"FALSE"


def aws_spot_notice(status: int, body: bytes) -> str | None:
    """What an IMDS ``spot/instance-action`` answer says: None (404: no notice) or the action and its time."""
    if status != 200 or not body.strip():
        return None
    try:
        action = json.loads(body)
    except ValueError:
        action = None
    if isinstance(action, dict) and action.get("action"):
        return f"AWS spot {action['action']} at {action.get('time', '?')}"
    return "AWS spot instance-action"


def azure_preempt_notice(body: bytes, vm_name: str | None) -> str | None:
    """The first ``Preempt`` event of a Scheduled Events document that concerns ``vm_name`` (any VM when unknown)."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    events = document.get("Events") if isinstance(document, dict) else None
    for event in events if isinstance(events, list) else []:
        if not isinstance(event, dict) or event.get("EventType") != "Preempt":
            continue
        resources = event.get("Resources") or []
        if vm_name and isinstance(resources, list) and resources and vm_name not in resources:
            continue  # another VM of the same availability set or placement group
        return f"Azure Preempt event {event.get('EventId', '?')} (not before {event.get('NotBefore') or 'now'})"
    return None


def _http(method: str, url: str, headers: dict[str, str], timeout: float) -> tuple[int, bytes]:
    """Status and (the first 64 KiB of) the body; an HTTP error status is an answer, not an exception."""
    request = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:  # noqa: S310 (a configured URL)
            return answer.status, answer.read(65536)
    except urllib.error.HTTPError as e:
        return e.code, b""


@dataclass
class AwsSpotNotice:
    """EC2 spot interruption through IMDSv2: a session token (kept until near its expiry), then the notice."""

    base: str = METADATA_HOST
    token_ttl_s: int = 21600
    clock: Any = time.monotonic
    _token: str | None = None
    _token_until: float = 0.0

    def poll(self, timeout: float) -> str | None:
        """The notice, or None; OSError when the endpoint cannot be reached."""
        token = self._session_token(timeout)
        headers = {AWS_TOKEN_HEADER: token} if token else {}  # no token: IMDSv1, where it is still allowed
        status, body = _http("GET", self.base + AWS_SPOT_ACTION_PATH, headers, timeout)
        if status == 401:
            self._token = None  # expired or revoked: a new one next time
        return aws_spot_notice(status, body)

    def _session_token(self, timeout: float) -> str | None:
        if self._token is None or self.clock() >= self._token_until:
            status, body = _http("PUT", self.base + AWS_TOKEN_PATH, {AWS_TOKEN_TTL_HEADER: str(self.token_ttl_s)}, timeout)
            self._token = body.decode("ascii", "replace").strip() if status == 200 and body.strip() else None
            self._token_until = self.clock() + max(1, self.token_ttl_s - 60)
        return self._token


@dataclass
class AzurePreemptNotice:
    """Azure Spot eviction through Scheduled Events: a ``Preempt`` event naming this VM."""

    base: str = METADATA_HOST
    _vm_name: str | None = None

    def poll(self, timeout: float) -> str | None:
        """The notice, or None; OSError when the endpoint cannot be reached."""
        if self._vm_name is None:
            status, body = _http("GET", self.base + AZURE_NAME_PATH, AZURE_HEADERS, timeout)
            if status == 200 and body.strip():
                self._vm_name = body.decode("utf-8", "replace").strip()
        status, body = _http("GET", self.base + AZURE_EVENTS_PATH, AZURE_HEADERS, timeout)
        return azure_preempt_notice(body, self._vm_name) if status == 200 else None


def _cloud_source(source: str) -> AwsSpotNotice | AzurePreemptNotice | None:
    """``aws``/``azure``, optionally ``:http(s)://HOST:PORT`` (the metadata service's address), else None."""
    kind, _, base = source.partition(":")
    if kind not in ("aws", "azure"):
        return None
    if base and not base.startswith(("http://", "https://")):
        raise ValueError(f"preemption notice source {source!r}: after '{kind}:' comes the metadata service's "
                         "http(s):// address, e.g. 'aws:http://169.254.169.254'")
    base = base.rstrip("/") or METADATA_HOST
    return AwsSpotNotice(base) if kind == "aws" else AzurePreemptNotice(base)


@dataclass
class NoticeSources:
    """Where to look for a preemption notice; parsed from ``DaskSettings.preemption_notices``."""

    sigterm: bool = False
    files: tuple[str, ...] = ()
    urls: tuple[str, ...] = ()
    headers: dict[str, str] = field(default_factory=lambda: {"Metadata-Flavor": "Google"})
    clouds: tuple[AwsSpotNotice | AzurePreemptNotice, ...] = ()

    @property
    def polled(self) -> bool:
        """Whether any source has to be polled (a file, a URL or a cloud's metadata service)."""
        return bool(self.files or self.urls or self.clouds)

    @classmethod
    def parse(cls, sources: tuple[str, ...] | list[str]) -> NoticeSources:
        """Read ``sigterm``, ``file:/PATH``, ``http(s)://URL``, ``aws[:URL]`` and ``azure[:URL]`` entries.

        Raises:
            ValueError: an entry of another form.
        """
        files, urls, sigterm = [], [], False
        clouds: list[AwsSpotNotice | AzurePreemptNotice] = []
        for source in sources:
            cloud = _cloud_source(source)
            if cloud is not None:
                clouds.append(cloud)
            elif source == "sigterm":
                sigterm = True
            elif source.startswith("file:"):
                path = source[len("file:"):]
                files.append(path[2:] if path.startswith("///") else path)
            elif source.startswith(("http://", "https://")):
                urls.append(source)
            else:
                raise ValueError(
                    f"preemption notice source {source!r} is unknown; use 'sigterm', 'file:/PATH', an http(s):// "
                    "URL, 'aws' or 'azure'"
                )
        return cls(sigterm, tuple(files), tuple(urls), clouds=tuple(clouds))

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
        for cloud in self.clouds:
            try:
                notice = cloud.poll(timeout)
            except (OSError, ValueError):
                continue  # no metadata service here, or it is slow: no notice
            if notice:
                return notice
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
        if self.sources.polled:
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

