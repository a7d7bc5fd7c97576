"""A Kubernetes API on loopback for the real clients (kopf, kr8s, dask-kubernetes): kmock's KubernetesEmulator, a
stateful in-memory API server (objects created, patched as JSON merge patches, deleted, listed and watched), run
in a thread of its own, with a kubeconfig that points at it.

It serves the built-in resources kmock bundles and the custom resources of the CRDs the tests name (ShardlineModel,
KEDA's ScaledObject, dask-kubernetes' DaskCluster, DaskWorkerGroup and DaskAutoscaler). It is not an API server:
no controller runs (no Deployment makes pods, no dask operator makes a scheduler), no schema is enforced, no
resourceVersion is checked. What the tests assert is what the clients sent and read back.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import random
import string
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import attrs
import jsonpatch
import kmock
import yaml

REPO = Path(__file__).resolve().parents[2]
CRDS = [
    REPO / "deploy/k8s/crds/shardlinemodel.yaml",
    REPO / "tests/support/crds/keda.sh_scaledobjects.yaml",
    REPO / "tests/support/crds/daskcluster.yaml",
    REPO / "tests/support/crds/daskautoscaler.yaml",
]
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}
# DaskWorkerGroup: the dask operator's own CRD ships with dask-kubernetes (its kind and scale subresource).
EXTRA = {"kubernetes.dask.org/v1/daskworkergroups": kmock.ResourceInfo(
    kind="DaskWorkerGroup", singular="daskworkergroup", namespaced=True, verbs=VERBS, subresources={"scale", "status"})}


@attrs.frozen
class PatchTestFailed(kmock.KubernetesError):  # type: ignore[misc]
    """A JSON patch whose ``test`` operation failed: a real API server answers 422 (kopf then patches again on its
    next cycle); kmock itself would answer 500, which clients retry as a server fault."""

    status: int = 422
    reason: str = "Invalid"
    message: str = "the object changed since it was read (a JSON patch test failed)"


class StampingEmulator(kmock.KubernetesEmulator):  # type: ignore[misc]
    """The emulator plus what an API server stamps on objects and clients rely on: ``metadata.resourceVersion``
    (new on every write: kopf tests it in its JSON patches), ``uid``, ``creationTimestamp`` and ``generation``
    (raised when a write touches ``spec``), a ``name`` made from ``generateName`` (kopf's events have no name of
    their own), and 422 for a JSON patch whose test fails."""

    _versions = itertools.count(1)

    async def _handle(self, request: Any) -> Any:
        self._log()
        data = request.data
        if request.resource is not None and request.action == kmock.action.CREATE and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):  # as an API server does: kopf's events use it
                meta["name"] = meta["generateName"] + "".join(random.choices(string.ascii_lowercase + string.digits,
                                                                              k=5))
            meta.update(resourceVersion=str(next(self._versions)), uid=str(uuid.uuid4()), generation=1,
                        creationTimestamp=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
        elif request.resource is not None and request.action == kmock.action.UPDATE and request.name:
            version = str(next(self._versions))
            touches_spec = ("spec" in data if isinstance(data, dict) else
                            any(str(op.get("path", "")).startswith("/spec") for op in data or []))
            generation = None
            if touches_spec and request.subresource is None:
                live = self.get_live(request)
                generation = int((live or {}).get("metadata", {}).get("generation") or 0) + 1
            if isinstance(data, dict):
                meta = data.setdefault("metadata", {}) if isinstance(data.get("metadata", {}), dict) else {}
                meta["resourceVersion"] = version
                if generation is not None:
                    meta["generation"] = generation
            elif isinstance(data, list):
                data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})
                if generation is not None:
                    data.append({"op": "add", "path": "/metadata/generation", "value": generation})
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as e:
            raise PatchTestFailed() from e

    # The log of changes (resourceVersion, resource, event) a watch replays from the resourceVersion its client
    # listed at, as a real API server does: kmock's own watch replays every object as ADDED (a client then acts on
    # a stale copy) and joins its bus of changes a moment later (a change made in between is never streamed).
    _changes: list[tuple[int, Any, dict[str, Any]]]
    _changed: asyncio.Condition

    def _log(self) -> tuple[list[tuple[int, Any, dict[str, Any]]], asyncio.Condition]:
        if not hasattr(self, "_changed"):
            self._changes, self._changed = [], asyncio.Condition()
            emulator = self

            class RecordingBus(type(self._buses.default_factory())):  # type: ignore[misc]
                async def put(self, item: Any) -> None:
                    await super().put(item)
                    raw = item.get("object", {})
                    version = int(raw.get("metadata", {}).get("resourceVersion") or 0)
                    if item.get("type") == "DELETED":
                        version = next(StampingEmulator._versions)
                    resource = next((r for r, bus in emulator._buses.items() if bus is self), None)
                    emulator._changes.append((version, resource, item))
                    async with emulator._changed:
                        emulator._changed.notify_all()

            self._buses.default_factory = RecordingBus
        return self._changes, self._changed

    async def _serve_list(self, request: Any) -> Any:
        self._log()
        listed = await super()._serve_list(request)
        listed["metadata"] = {"resourceVersion": str(max((v for v, _, _ in self._changes), default=0))}
        return listed

    async def _serve_watch(self, request: Any) -> Any:
        yield b""
        changes, changed = self._log()
        check = self._KubernetesEmulator__check
        since = str(request.params.get("resourceVersion") or "")
        async with self._lock:
            if since.isdigit():
                position = next((i for i, (v, _, _) in enumerate(changes) if v > int(since)), len(changes))
                first: list[dict[str, Any]] = []
            else:
                position = len(changes)
                objs = [o for o in self._KubernetesEmulator__get_objs(request, strict=False) if not o.deleted]
                first = [{"type": "ADDED", "object": o.raw} for o in objs]
        for event in first:
            yield event
        while True:
            while position < len(changes):
                _, resource, event = changes[position]
                position += 1
                meta = event.get("object", {}).get("metadata", {})
                if resource == request.resource and check(request, resource, meta.get("namespace"), meta.get("name"),
                                                           strict=False):
                    yield event
            async with changed:
                await changed.wait_for(lambda: position < len(changes))

    def get_live(self, request: Any) -> dict[str, Any] | None:
        for (resource, namespace, name), obj in self.objects.items():
            if resource == request.resource and namespace == request.namespace and name == request.name:
                return None if obj.deleted else dict(obj.raw)
        return None


def _resources() -> dict[str, kmock.ResourceInfo]:
    found = dict(EXTRA)
    for path in CRDS:
        crd = yaml.safe_load(path.read_text())
        names = crd["spec"]["names"]
        for version in crd["spec"]["versions"]:
            key = f"{crd['spec']['group']}/{version['name']}/{names['plural']}"
            found[key] = kmock.ResourceInfo(
                kind=names["kind"], singular=names.get("singular"), namespaced=crd["spec"]["scope"] == "Namespaced",
                verbs=VERBS, shortnames=set(names.get("shortNames", [])), subresources=set(version.get("subresources", {})),
            )
    return found


@dataclass
class KubeApi:
    """The running emulator: its URL, a kubeconfig for it, and what it holds."""

    url: str
    kubeconfig: Path
    emulator: Any
    loop: asyncio.AbstractEventLoop
    _stop: threading.Event = field(default_factory=threading.Event)

    def objects(self, resource: str, namespace: str | None = None) -> dict[str, dict[str, Any]]:
        """The live objects of a resource (``apps/v1/deployments``, ``v1/services``), by name, as plain dicts."""
        async def read() -> dict[str, dict[str, Any]]:
            found = {}
            for (res, ns, name), obj in list(self.emulator.objects.items()):
                if res == kmock.resource(resource) and (namespace is None or ns == namespace) and not obj.deleted:
                    found[name] = copy.deepcopy(obj.raw)
            return found

        return asyncio.run_coroutine_threadsafe(read(), self.loop).result(10)

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects(resource, namespace).get(name)


@contextmanager
def kube_api() -> Iterator[KubeApi]:
    """Start the emulator on a free loopback port; stop it on exit."""
    started = threading.Event()
    box: dict[str, Any] = {}
    stop = threading.Event()

    async def serve() -> None:
        try:
            async with StampingEmulator() as emulator, kmock.Server(emulator) as server:
                emulator.resources.load_bundled()
                for key, info in _resources().items():
                    emulator.resources[key] = info
                # kr8s asks for /version/ (trailing slash), which a real API server answers as /version
                emulator["get /version/"] << {"major": "1", "minor": "32", "gitVersion": "v1.32.0"}
                # and kr8s's discovery (api_resources) asks for /api/ and /apis/ too
                emulator["get /api/"] << emulator._serve_api
                emulator["get /apis/"] << emulator._serve_apis
                box.update(emulator=emulator, url=str(server.url).rstrip("/"), loop=asyncio.get_running_loop())
                started.set()
                while not stop.is_set():
                    await asyncio.sleep(0.05)
        except BaseException as e:  # noqa: BLE001 - surfaced by the waiting thread
            box["error"] = e
            started.set()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), name="kube-api", daemon=True)
    thread.start()
    assert started.wait(30), "the Kubernetes API emulator did not start"
    if "error" in box:
        raise box["error"]
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": box["url"]}}],
        "users": [{"name": "tester", "user": {"token": "not-checked"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester", "namespace": "default"}}],
    }
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kubeconfig-") as folder:
        path = Path(folder) / "config"
        path.write_text(json.dumps(config))
        try:
            yield KubeApi(box["url"], path, box["emulator"], box["loop"], stop)
        finally:
            stop.set()
            thread.join(10)
