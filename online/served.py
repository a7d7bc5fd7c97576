"""The versions a replica serves, and their life cycle: which version a tenant's request means, each served
version made once (its batch limits from an override, its measured profile or the defaults; its batcher; its
capture buffer), whether it is loaded, and unloading the ones idle past their time-out (scale to zero: the
next request loads it again through the model cache).

``ServedModels`` is the data plane's (``online/dataplane.py``) directory of models; scoring stays the plane's.
Protocol-free and framework-free, as the plane is.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, TypeVar

from shardline.bundle import ModelRef, version_number
from shardline.errors import InvalidInput, ShardlineError
from shardline.online.admission import should_unload
from shardline.online.batcher import Batcher
from shardline.online.capture import OnlineCapture
from shardline.online.errors import shown
from shardline.online.models import ModelDirectory, ModelStatus, ServedModel, batch_limits, missing_for_serving
from shardline.online.tenants import Tenant, not_available
from shardline.runtimes import RuntimeOptions
from shardline.settings import OnlineSettings
from shardline.storage.model_cache import ModelCache
from shardline.storage.registry import ResolvedModel, check_alias
from shardline.tenants import check_custom_code

log = logging.getLogger("shardline.online")
T = TypeVar("T")
Key = tuple[str, int, str]  # (name, version, variant or "")
BatcherFor = Callable[[ResolvedModel, Key, Any], Batcher]  # (version, its key, its limits) -> its batcher


class ServedModels:
    """See the module docstring. ``batcher_for`` makes a version's batcher (the plane's scoring behind it);
    ``blocking_io`` runs registry and cache work off the event loop."""

    def __init__(self, settings: OnlineSettings, directory: ModelDirectory, cache: ModelCache, runtime: RuntimeOptions,
                 capture: OnlineCapture, clock: Callable[[], float],
                 blocking_io: Callable[[Callable[[], Any]], Awaitable[Any]]) -> None:
        self.settings = settings
        self.directory = directory
        self.cache = cache
        self.runtime = runtime
        self.capture = capture
        self._clock = clock
        self._blocking_io = blocking_io
        self.batcher_for: BatcherFor | None = None  # set by the plane before the first request
        self.served: dict[Key, ServedModel] = {}

    def __getitem__(self, key: Key) -> ServedModel:
        return self.served[key]

    def values(self) -> list[ServedModel]:
        """Every version served so far."""
        return list(self.served.values())

    async def model(
        self, tenant: Tenant, name: str, version: str | int | None = None, alias: str | None = None,
        variant: str | None = None, cheaper: bool = False,
    ) -> ServedModel:
        """The version of a model that a request means: ``version``, ``alias``, or the tenant's reference;
        with ``variant``, that version's precision variant (a router's fallback asks for one); with ``cheaper``
        and no ``variant``, its cheapest precision variant when it has one (``cheaper_variant``: a tenant past its
        budget's soft limit).

        Raises:
            ModelNotFound: the tenant may not call the model, or the version, alias or variant does not exist.
            InvalidInput: the version is not a number or the alias is malformed.
            AccessDenied: the version carries its own Python code and the tenant may not run it.
        """
        listed = tenant.reference_for(name)
        if listed is None:
            raise not_available(tenant, name)
        if version is not None:
            text = str(version).strip()
            number = version_number(text)
            if number is None:
                raise InvalidInput(f"version {shown(text)} of model {name!r} is not a version number; send 1, 2, ... "
                                   "(1-9 ASCII digits) or leave the version out")
            ref = ModelRef(name=name, version=number)
        elif alias is not None:
            try:
                ref = ModelRef(name=name, alias=check_alias(alias))
            except ShardlineError as e:
                raise InvalidInput(str(e)) from e
        else:
            ref = listed
        resolved = await self.directory.resolve(ref)
        check_custom_code(resolved.manifest.runtime, resolved.pinned, tenant.name, tenant.custom_code)
        if variant is None and cheaper:
            variant = cheaper_variant(resolved)
        return await self._served_for(resolved.variant(variant) if variant else resolved)

    async def versions(self, tenant: Tenant, name: str) -> list[int]:
        """The registry versions of a model the tenant may call."""
        if tenant.reference_for(name) is None:
            raise not_available(tenant, name)
        return await self.directory.versions(name)

    async def _served_for(self, resolved: ResolvedModel) -> ServedModel:
        key = (resolved.name, resolved.version, resolved.variant_name)
        served = self.served.get(key)
        if served is not None:
            return served
        profile = None
        override = self.settings.models.get(resolved.name)
        if override is None or override.max_batch_size is None:
            try:
                profile = await self.directory.profile(resolved, self.machine())
            except Exception as e:  # noqa: BLE001 - a profile only tunes defaults
                log.warning("could not read the model's profile", extra={"fields": {
                    "model": resolved.pinned, "error": f"{type(e).__name__}: {e}"}})
        await self.capture.open(resolved.name, resolved.version, self._blocking_io)
        served = self.served.get(key)
        if served is not None:
            return served
        limits, idle = batch_limits(resolved.name, self.settings, profile)
        if self.batcher_for is None:
            raise RuntimeError("ServedModels.batcher_for was not set")
        served = ServedModel(resolved, self.batcher_for(resolved, key, limits), idle, self._clock())
        self.served[key] = served
        log.info("serving a model version", extra={"fields": {
            "model": resolved.pinned, "max_batch_size": limits.max_batch_size,
            "max_wait_ms": limits.max_wait_s * 1000, "queue_capacity": limits.queue_capacity,
            "idle_timeout_s": idle, "batch_size_from": "profile" if profile else "settings"}})
        return served

    def machine(self) -> str:
        """This machine's kind, as the stored profiles are keyed."""
        from shardline.machines import machine_kind, profile_key

        return profile_key(machine_kind("cuda" if self.runtime.device == "cuda" else "cpu"))

    def is_loaded(self, served: ServedModel) -> bool:
        """Whether the version is loaded now (not scaled to zero)."""
        return served.content_digest in self.cache.loaded()

    async def status(self, served: ServedModel, ready: bool) -> ModelStatus:
        """Whether a request for ``served`` would be served now (``ready``: the server takes requests), and
        whether it is loaded; loads nothing (see ``DataPlane.model_status``)."""
        if self.is_loaded(served):
            return ModelStatus(served, True, None if ready else "the server is shutting down")
        if not ready:
            return ModelStatus(served, False, "the server is shutting down")
        if not served.servable:
            problem = await self._blocking_io(lambda: missing_for_serving(
                served.resolved, self.directory.registry, self.cache.local_dir(served.resolved)))
            if problem is not None:
                return ModelStatus(served, False, problem)
            served.servable = True
        return ModelStatus(served, False)

    # -- scale to zero ------------------------------------------------------------------
    async def reap_idle(self, unloaded: Callable[[ServedModel], None]) -> list[str]:
        """Unload every version idle past its time-out (``unloaded`` told of each); returns them (``name:version``)."""
        loaded = set(self.cache.loaded())
        now = self._clock()
        gone = []
        for served in self.values():
            idle = now - served.last_used
            if served.unloading is None and should_unload(idle, served.idle_timeout_s, served.batcher.busy,
                                                          served.content_digest in loaded):
                await self._unload(served)
                unloaded(served)
                log.info("model unloaded after idling", extra={"fields": {"model": served.pinned,
                                                                          "idle_s": round(idle, 1)}})
                gone.append(served.pinned)
        return gone

    async def _unload(self, served: ServedModel) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        served.unloading = done
        try:
            await self._blocking_io(lambda: self.cache.evict(served.content_digest))
        finally:
            served.unloading = None
            done.set_result(None)


CHEAPER_PRECISIONS = ("int8", "fp16")  # cheapest first: what a tenant past its budget's soft limit is served


def cheaper_variant(resolved: ResolvedModel) -> str | None:
    """The version's cheapest precision variant (int8, else fp16), None when it has neither."""
    for precision in CHEAPER_PRECISIONS:
        names = sorted(name for name, v in resolved.variants.items() if v.precision == precision)
        if names:
            return names[0]
    return None
