"""The model cache: resolve -> fetch -> verify -> load -> keep (LRU), one per process.

The batch workers and the online server both get their models here, so a model
behaves the same in both tiers. Bundles are fetched into a local folder named by
their digest; artifacts are verified against their sha256 before every load.
"""

from __future__ import annotations

import shutil
import threading
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any

from shardline.bundle import MANIFEST, verify_artifacts
from shardline.errors import IntegrityError
from shardline.runtimes import Runtime, RuntimeOptions, create_runtime
from shardline.storage.registry import ResolvedModel, fetch_bundle
from shardline.storage.registry_integrity import damaged_in_registry

_Key = tuple[str, RuntimeOptions]


class ModelCache:
    """Loaded models kept by (bundle content digest, runtime options), least recently used out first."""

    def __init__(self, cache_dir: str | Path, capacity: int = 4) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.cache_dir = Path(cache_dir)
        self.capacity = capacity
        self._loaded: OrderedDict[_Key, Runtime] = OrderedDict()
        self._lock = threading.Lock()
        self._key_locks: dict[_Key, threading.Lock] = {}
        self.loads = 0

    def local_dir(self, model: ResolvedModel) -> Path:
        """Where a bundle's verified files live on this machine."""
        return self.cache_dir / model.name / model.content_digest[:32]

    def _ensure_local(self, model: ResolvedModel, storage_options: dict[str, Any] | None) -> Path:
        """Fetch the bundle unless a verified copy is already here; re-fetch a damaged copy once."""
        target = self.local_dir(model)
        if (target / MANIFEST).is_file():
            try:
                verify_artifacts(target, model.manifest)
                return target
            except IntegrityError:
                shutil.rmtree(target, ignore_errors=True)
        staging = target.with_name(f".{target.name}.{uuid.uuid4().hex}")
        try:
            fetch_bundle(model, staging, storage_options, verify=False)
            _verify_fetched(model, staging)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                staging.rename(target)
            except OSError:
                if not (target / MANIFEST).is_file():
                    raise
                verify_artifacts(target, model.manifest)  # another process's copy: its rename won
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target

    def get(
        self,
        model: ResolvedModel,
        options: RuntimeOptions = RuntimeOptions(),
        storage_options: dict[str, Any] | None = None,
    ) -> Runtime:
        """The loaded model, loading it (once, even under concurrent callers) if needed.

        Raises:
            IntegrityError: the registry's artifacts do not match their manifest (``damaged_in_registry``'s message:
                push the bundle again).
            RuntimeUnavailable: the runtime or device is not available here.
        """
        return self.get_or_load(model, options, storage_options)[0]

    def get_or_load(
        self,
        model: ResolvedModel,
        options: RuntimeOptions = RuntimeOptions(),
        storage_options: dict[str, Any] | None = None,
    ) -> tuple[Runtime, bool]:
        """``get``, and whether this very call loaded the model (False for the callers that waited for
        another's load: a load is counted once however many callers wanted it)."""
        key = (model.content_digest, options)
        with self._lock:
            if key in self._loaded:
                self._loaded.move_to_end(key)
                return self._loaded[key], False
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                if key in self._loaded:
                    return self._loaded[key], False
            bundle_dir = self._ensure_local(model, storage_options)
            runtime = create_runtime(bundle_dir, model.manifest, options)
            runtime.load()
            with self._lock:
                self._loaded[key] = runtime
                self.loads += 1
                while len(self._loaded) > self.capacity:
                    # Dropped, not closed: a caller may still be predicting with it; it is
                    # released when the last reference goes.
                    self._loaded.popitem(last=False)
            return runtime, True

    def loaded(self) -> list[str]:
        """Content digests of the bundles held now, least recently used first."""
        with self._lock:
            return [digest for digest, _ in self._loaded]

    def held(self, content_digest: str, options: RuntimeOptions = RuntimeOptions()) -> Runtime | None:
        """The loaded model for a bundle's content digest, if it is held now (marked recently used); never loads.

        The online tier calls it on every batch to find a model without loading it.
        """
        key = (content_digest, options)
        with self._lock:
            runtime = self._loaded.get(key)
            if runtime is not None:
                self._loaded.move_to_end(key)
            return runtime

    def evict(self, content_digest: str) -> bool:
        """Unload every loaded copy of one bundle (whatever its runtime options); True if one was held.

        The online tier calls it to scale an idle model to zero; the next ``get`` loads it
        again. Like an LRU eviction it drops the model rather than closing it, so a
        caller still predicting with it finishes; memory goes with the last reference.
        """
        with self._lock:
            keys = [key for key in self._loaded if key[0] == content_digest]
            runtimes = [self._loaded.pop(key) for key in keys]
        return bool(runtimes)

    def clear(self) -> None:
        """Close and unload everything (at shutdown: nothing may be predicting then)."""
        with self._lock:
            for runtime in self._loaded.values():
                runtime.close()
            self._loaded.clear()


def _verify_fetched(model: ResolvedModel, folder: Path) -> None:
    """Check a copy just fetched from the registry: an artifact that does not verify is damaged in the registry
    (fetching again gets the same bytes).

    Raises:
        IntegrityError: ``damaged_in_registry``'s, naming the version and what to do.
    """
    try:
        verify_artifacts(folder, model.manifest)
    except IntegrityError as e:
        artifact = next(a for a in model.manifest.artifacts if a.path == e.path)
        raise damaged_in_registry(model, artifact, e.got) from e


_process_caches: dict[str, ModelCache] = {}
_process_lock = threading.Lock()


def get_model_cache(cache_dir: str | Path, capacity: int = 4) -> ModelCache:
    """The process-wide cache for a cache folder, shared by whatever calls it."""
    key = str(Path(cache_dir).expanduser().resolve())
    with _process_lock:
        cache = _process_caches.get(key)
        if cache is None:
            cache = _process_caches[key] = ModelCache(key, capacity)
        return cache
