"""The models the server serves: references resolved to versions, and each version's batching.

``ModelDirectory`` resolves a reference against the registry and remembers the
answer: a version's manifest forever (versions never change), an alias's version for
``alias_refresh_s`` seconds, so an alias that moves is followed without a registry
read on every request. Past that, the next request still gets the version known and
starts a re-read in the background (stale-while-revalidate): once an alias is known,
no request waits for the registry (under load, a registry read on a thread waits for
the GIL, and every request of the model would wait with it). An alias the registry no
longer has is forgotten (the next request is told); a registry that cannot be read
leaves the known version in use (logged). A reference the registry lacks (no such model,
version or alias) is remembered as missing for ``alias_refresh_s`` too, so that callers
retrying it are told at once and cost no registry reads (two per request otherwise: the
reference and the versions the message names). ``alias_refresh_s`` 0 reads it every time. ``ServedModel`` is one version as the server holds it: its
batcher, when it was last used, and whether it is being unloaded.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Literal, TypeVar

from shardline.bundle import MANIFEST, ModelRef
from shardline.errors import ModelNotFound
from shardline.online.background import stop_tasks
from shardline.online.batcher import Batcher, BatchLimits
from shardline.settings import OnlineSettings
from shardline.signature import Signature
from shardline.storage.registry import ModelRegistry, ResolvedModel

log = logging.getLogger("shardline.online")
T = TypeVar("T")
RunBlocking = Callable[[Callable[[], T]], Awaitable[T]]


def batch_size_from_profile(profile: dict[str, Any] | None, budget_ms: float) -> int | None:
    """The largest measured batch size whose p99 latency fits the budget; None without a usable profile."""
    if not profile:
        return None
    fitting = [
        int(b["batch_size"]) for b in profile.get("batches", [])
        if isinstance(b, dict) and "batch_size" in b and float(b.get("p99_ms", float("inf"))) <= budget_ms
    ]
    return max(fitting) if fitting else None


def batch_limits(
    name: str, settings: OnlineSettings, profile: dict[str, Any] | None
) -> tuple[BatchLimits, float]:
    """A model's batch limits and idle time-out: its override, else its profile, else the defaults."""
    override = settings.models.get(name)
    size = override.max_batch_size if override and override.max_batch_size else None
    size = size or batch_size_from_profile(profile, settings.batch_latency_budget_ms) or settings.max_batch_size
    wait_ms = settings.max_batch_wait_ms
    capacity = settings.queue_capacity
    idle = settings.idle_timeout_s
    if override is not None:
        wait_ms = override.max_batch_wait_ms if override.max_batch_wait_ms is not None else wait_ms
        capacity = override.queue_capacity or capacity
        idle = override.idle_timeout_s if override.idle_timeout_s is not None else idle
    limits = BatchLimits(size, wait_ms / 1000.0, capacity, settings.resolved_concurrent_batches(), settings.queue_bytes)
    return limits, idle


@dataclass
class ServedModel:
    """One version as the server holds it (loaded or scaled to zero)."""

    resolved: ResolvedModel
    batcher: Batcher
    idle_timeout_s: float
    last_used: float
    unloading: asyncio.Future[None] | None = field(default=None, repr=False)
    seconds_per_row: float | None = field(default=None, repr=False)  # the runtime's measured time, smoothed
    clock: Callable[[], float] | None = field(default=None, repr=False)  # what times it (see DataPlane._timed)
    servable: bool = field(default=False, repr=False)  # its runtime and bundle were found (see missing_for_serving)

    @property
    def content_digest(self) -> str:
        """The bundle's content digest (the model cache's key), worked out once when the version was resolved."""
        return self.resolved.content_digest

    @property
    def name(self) -> str:
        """The model's name."""
        return self.resolved.name

    @property
    def version(self) -> int:
        """The registry version number."""
        return self.resolved.version

    @property
    def pinned(self) -> str:
        """``name:version``."""
        return self.resolved.pinned

    @functools.cached_property
    def version_label(self) -> str:
        """Its ``version`` metrics and metering label (``ResolvedModel.version_label``), made once."""
        return self.resolved.version_label

    @property
    def signature(self) -> Signature:
        """What the model reads and writes."""
        return self.resolved.manifest.signature


@dataclass(frozen=True)
class ModelStatus:
    """Whether a request for a version would be served now, and whether it is loaded (answered without loading it)."""

    served: ServedModel
    loaded: bool
    problem: str | None = None  # what keeps it from being served; None: a request would be served

    @property
    def ready(self) -> bool:
        """A request would be served (loading the version first when it is not loaded)."""
        return self.problem is None

    @property
    def state(self) -> Literal["loaded", "unloaded"]:
        """``loaded``, or ``unloaded`` (never requested yet, or scaled to zero: it loads on the next request)."""
        return "loaded" if self.loaded else "unloaded"


def missing_for_serving(resolved: ResolvedModel, registry: ModelRegistry, local_dir: Path) -> str | None:
    """What would keep an unloaded version from loading, found without loading it; None: nothing.

    Its runtime must be known and its packages importable here, and its bundle must be in
    the local model cache (``local_dir``) or every artifact in the registry. Blocking
    (imports, registry reads): call it off the event loop.
    """
    from shardline.runtimes import KNOWN_RUNTIMES

    runtime = resolved.manifest.runtime
    if runtime not in KNOWN_RUNTIMES:
        return f"{resolved.pinned} asks for runtime {runtime!r}, which this server does not know ({sorted(KNOWN_RUNTIMES)})"
    entry = KNOWN_RUNTIMES[runtime]
    try:
        importlib.import_module(entry.module)
    except ImportError as e:
        return f"runtime {runtime!r} of {resolved.pinned} needs a package that is not installed here ({e.name}); {entry.extra}"
    if (local_dir / MANIFEST).is_file():
        return None
    missing = [a.path for a in resolved.manifest.artifacts
               if not registry.fs.exists(registry.blob_path(resolved.name, a.sha256))]
    if missing:
        return f"the registry lacks artifacts of {resolved.pinned} ({missing}); push its bundle again"
    return None


MAX_MISSING = 1024  # references remembered as missing (past it, the memory starts afresh)


@dataclass
class _Alias:
    version: int
    read_at: float


class ModelDirectory:
    """References to pinned versions, remembered (see the module docstring)."""

    def __init__(
        self,
        registry: ModelRegistry,
        run_blocking: RunBlocking[Any],
        alias_refresh_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self._run = run_blocking
        self._refresh = alias_refresh_s
        self._clock = clock
        self._versions: dict[tuple[str, int], ResolvedModel] = {}
        self._aliases: dict[tuple[str, str], _Alias] = {}
        self._inflight: dict[tuple[str, str], asyncio.Future[ResolvedModel]] = {}
        self._refreshing: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._missing_since: dict[tuple[str, str], tuple[ModelNotFound, float]] = {}  # read key -> error, when

    async def resolve(self, ref: ModelRef) -> ResolvedModel:
        """The version a reference means now.

        Raises:
            ModelNotFound: no such model, version or alias (the message names what exists).
        """
        if ref.version is not None:
            return await self._version(ref.name, ref.version)
        alias = ref.alias or "prod"
        key = (ref.name, alias)
        known = self._aliases.get(key)
        if known is not None and self._refresh > 0:
            if self._clock() - known.read_at >= self._refresh and key not in self._refreshing:
                task = asyncio.get_running_loop().create_task(self._reread(ref, key))
                self._refreshing[key] = task
                task.add_done_callback(lambda _: self._refreshing.pop(key, None))
            return await self._version(ref.name, known.version)
        return await self._read_alias(ref, key)

    async def _read_alias(self, ref: ModelRef, key: tuple[str, str]) -> ResolvedModel:
        resolved = await self._once(("alias", f"{key[0]}@{key[1]}"), lambda: self.registry.resolve(str(ref)))
        self._aliases[key] = _Alias(resolved.version, self._clock())
        self._versions.setdefault((resolved.name, resolved.version), resolved)
        return self._versions[(resolved.name, resolved.version)]

    async def _reread(self, ref: ModelRef, key: tuple[str, str]) -> None:
        """Read a known alias again, in the background (see the module docstring)."""
        try:
            await self._read_alias(ref, key)
        except ModelNotFound:
            self._aliases.pop(key, None)  # the next request reads it and is told what exists
        except Exception as e:  # noqa: BLE001 - the known version stays in use; tried again after the interval
            known = self._aliases.get(key)
            if known is not None:
                self._aliases[key] = _Alias(known.version, self._clock())
            log.warning("could not read an alias again; its known version stays in use", extra={"fields": {
                "alias": f"{key[0]}@{key[1]}", "error": f"{type(e).__name__}: {e}"}})

    async def close(self) -> None:
        """Stop the background re-reads (the server is stopping)."""
        await stop_tasks(list(self._refreshing.values()), "the model directory")

    async def _version(self, name: str, version: int) -> ResolvedModel:
        found = self._versions.get((name, version))
        if found is None:
            found = await self._once(("version", f"{name}:{version}"), lambda: self.registry.resolve(f"{name}:{version}"))
            self._versions.setdefault((name, version), found)
        return self._versions[(name, version)]

    async def _once(self, key: tuple[str, str], read: Callable[[], ResolvedModel]) -> ResolvedModel:
        """One registry read per key at a time; concurrent callers share its answer. A key found missing
        is not read again for ``alias_refresh_s``.

        Raises:
            ModelNotFound: the registry lacks it (now, or when it was read less than ``alias_refresh_s`` ago).
        """
        missing = self._missing_since.get(key)
        if missing is not None:
            error, since = missing
            if self._clock() - since < self._refresh:
                raise ModelNotFound(str(error), error.reference)
            del self._missing_since[key]
        pending = self._inflight.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[ResolvedModel] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            resolved: ResolvedModel = await self._run(read)
        except ModelNotFound as e:
            error = ModelNotFound(await self._missing(key[1], e), e.reference)
            if self._refresh > 0:
                if len(self._missing_since) >= MAX_MISSING:
                    self._missing_since.clear()
                self._missing_since[key] = (error, self._clock())
            future.set_exception(error)
            future.exception()  # retrieved: no "never retrieved" warning when nobody else waited
            raise error from e
        except BaseException as e:
            future.set_exception(e)
            future.exception()
            raise
        else:
            future.set_result(resolved)
            return resolved
        finally:
            del self._inflight[key]

    async def _missing(self, reference: str, error: ModelNotFound) -> str:
        """What a client is told: what is missing and what exists, without the registry's location."""
        name = ModelRef.split(reference)[0]
        versions = await self.versions(name)
        if not versions:
            return f"model {name!r} has no versions in the registry yet; push and alias one, then retry"
        return f"{reference} does not exist; model {name!r} has versions {versions}"

    async def versions(self, name: str) -> list[int]:
        """The version numbers a model has in the registry, oldest first."""
        manifests = await self._run(lambda: self.registry.list_versions(name))
        return [m.version for m in manifests if m.version is not None]

    async def profile(self, resolved: ResolvedModel, machine: str) -> dict[str, Any] | None:
        """The version's measured profile on this kind of machine, if one was stored."""
        profiles: dict[str, dict[str, Any]] = await self._run(
            lambda: self.registry.profiles(resolved.name, resolved.version)
        )
        return profiles.get(machine)
