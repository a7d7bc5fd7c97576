"""The model registry on any fsspec URL: versions are immutable, aliases point at them.

Layout under the registry root::

    <name>/versions/<n>/manifest.json     written last: its presence commits version n
    <name>/versions/<n>/<artifacts...>
    <name>/aliases/<alias>.json           {"version": n, "updated_at": ..., "by": ..., "reason": ...}
"""

from __future__ import annotations

import json
import getpass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from shardline.bundle import MANIFEST, Manifest, ModelRef, check_model_name, read_manifest, verify_artifacts
from shardline.errors import InvalidBundle, InvalidSetting, ModelNotFound
from shardline.storage.fs import atomic_write_bytes, join, open_fs

_ALIAS = "0123456789abcdefghijklmnopqrstuvwxyz-_."


class ResolvedModel(BaseModel):
    """A reference pinned to one version: what workers load, whatever aliases do later."""

    reference: str
    name: str
    version: int
    digest: str
    uri: str
    manifest: Manifest

    @property
    def pinned(self) -> str:
        """``name:version``."""
        return f"{self.name}:{self.version}"


class ModelRegistry:
    """Push bundles, list versions, move aliases, resolve references."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.storage_options = storage_options or {}
        self.fs, self.root = open_fs(url, self.storage_options)

    def _version_dir(self, name: str, version: int) -> str:
        return join(self.root, name, "versions", str(version))

    def _uri(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    def _forget_listing(self, path: str) -> None:
        """Drop this process's cached listing of ``path`` before listing it.

        Other processes push versions and move aliases; a listing cached by a
        long-lived file system (s3fs keeps one per process) would hide them.
        """
        self.fs.invalidate_cache(path)

    def list_models(self) -> list[str]:
        """Names of every model with at least one version."""
        self._forget_listing(self.root)
        if not self.fs.exists(self.root):
            return []
        names = []
        for entry in self.fs.ls(self.root, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if self.fs.exists(join(self.root, name, "versions")):
                names.append(name)
        return sorted(names)

    def _version_numbers(self, name: str) -> list[int]:
        versions_dir = join(self.root, name, "versions")
        self._forget_listing(versions_dir)
        if not self.fs.exists(versions_dir):
            return []
        numbers = []
        for entry in self.fs.ls(versions_dir, detail=False):
            tail = entry.rstrip("/").rsplit("/", 1)[-1]
            if tail.isdigit() and self.fs.exists(join(versions_dir, tail, MANIFEST)):
                numbers.append(int(tail))
        return sorted(numbers)

    def get_manifest(self, name: str, version: int) -> Manifest:
        """The manifest of one version."""
        path = join(self._version_dir(name, version), MANIFEST)
        try:
            return Manifest.from_json(self.fs.cat_file(path), self._uri(path))
        except FileNotFoundError as e:
            raise ModelNotFound(self._missing_message(name, f"version {version}"), f"{name}:{version}") from e

    def list_versions(self, name: str) -> list[Manifest]:
        """Every version of a model, oldest first."""
        return [self.get_manifest(name, v) for v in self._version_numbers(name)]

    def aliases(self, name: str) -> dict[str, int]:
        """Alias -> version for one model."""
        alias_dir = join(self.root, name, "aliases")
        self._forget_listing(alias_dir)
        if not self.fs.exists(alias_dir):
            return {}
        found = {}
        for path in self.fs.ls(alias_dir, detail=False):
            if path.endswith(".json"):
                record = json.loads(self.fs.cat_file(path))
                found[path.rsplit("/", 1)[-1][: -len(".json")]] = int(record["version"])
        return dict(sorted(found.items()))

    def push(self, bundle_dir: str | Path) -> Manifest:
        """Add a local bundle as the next version; the same bytes again return the existing one.

        Raises:
            InvalidBundle / IntegrityError: the bundle is malformed or its artifacts differ
                from its manifest.
        """
        manifest = read_manifest(bundle_dir)
        verify_artifacts(bundle_dir, manifest)
        existing = self.list_versions(manifest.name)
        for known in existing:
            if known.digest == manifest.digest:
                return known
        version = (existing[-1].version or 0) + 1 if existing else 1
        pushed = manifest.model_copy(update={"version": version})
        target = self._version_dir(manifest.name, version)
        for artifact in manifest.artifacts:
            self.fs.makedirs(join(target, *artifact.path.split("/")[:-1]) or target, exist_ok=True)
            self.fs.put_file(str(Path(bundle_dir) / artifact.path), join(target, artifact.path))
        atomic_write_bytes(
            self.fs, join(target, MANIFEST), pushed.to_json().encode(), join(self.root, "_staging")
        )
        return pushed

    def set_alias(self, name: str, alias: str, version: int, *, by: str | None = None, reason: str = "") -> None:
        """Point ``name@alias`` at an existing version."""
        check_model_name(name)
        if not alias or any(ch not in _ALIAS for ch in alias) or alias[0] in "-_.":
            raise InvalidSetting(
                f"alias {alias!r} is not allowed; use lower-case letters, digits, '-', '_' or '.'"
            )
        self.get_manifest(name, version)
        record = {
            "version": version,
            "updated_at": datetime.now(timezone.utc).isoformat(),
            "by": by or getpass.getuser(),
            "reason": reason,
        }
        atomic_write_bytes(
            self.fs,
            join(self.root, name, "aliases", f"{alias}.json"),
            json.dumps(record).encode(),
            join(self.root, "_staging"),
        )

    def resolve(self, reference: str | ModelRef) -> ResolvedModel:
        """Pin ``name@alias`` or ``name:version`` to one version.

        Raises:
            ModelNotFound: the name, version or alias is not registered.
        """
        ref = reference if isinstance(reference, ModelRef) else ModelRef.parse(reference)
        if ref.version is None:
            aliases = self.aliases(ref.name)
            if ref.alias not in aliases:
                if not self._version_numbers(ref.name):
                    raise ModelNotFound(self._missing_message(ref.name, None), str(ref))
                raise ModelNotFound(
                    f"model {ref.name!r} has no alias {ref.alias!r} (its aliases: "
                    f"{aliases or 'none'}); set one with `shardline model alias {ref.name} "
                    f"{ref.alias} VERSION`",
                    str(ref),
                )
            version = aliases[ref.alias]
        else:
            version = ref.version
        manifest = self.get_manifest(ref.name, version)
        return ResolvedModel(
            reference=str(ref),
            name=ref.name,
            version=version,
            digest=manifest.digest,
            uri=self._uri(self._version_dir(ref.name, version)),
            manifest=manifest,
        )

    def _missing_message(self, name: str, what: str | None) -> str:
        if what is None or not self._version_numbers(name):
            known = self.list_models()
            return (
                f"model {name!r} is not in the registry at {self.url} (it holds: "
                f"{known or 'nothing yet'}); push it with `shardline model push BUNDLE_DIR`"
            )
        return (
            f"model {name!r} has no {what} (it has versions {self._version_numbers(name)}); "
            "list them with `shardline model list`"
        )


def fetch_bundle(model: ResolvedModel, dest: Path, storage_options: dict[str, Any] | None = None) -> None:
    """Download a resolved version's files into the local folder ``dest`` and verify them."""
    fs, root = open_fs(model.uri, storage_options)
    dest.mkdir(parents=True, exist_ok=True)
    for artifact in model.manifest.artifacts:
        local = dest / artifact.path
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(join(root, artifact.path), str(local))
    (dest / MANIFEST).write_text(model.manifest.to_json())
    verify_artifacts(dest, model.manifest)


__all__ = ["ModelRegistry", "ResolvedModel", "fetch_bundle", "InvalidBundle"]
