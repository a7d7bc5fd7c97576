"""The model registry on any fsspec URL: immutable versions, audited aliases.

Layout under the registry root::

    <name>/blobs/<sha256>                    artifact bytes, stored once by content
    <name>/versions/<n>/manifest.json        created exclusively: its presence commits version n
    <name>/versions/<n>/variants/<v>.json    precision variants of version n (created once each)
    <name>/versions/<n>/profiles/<m>.json    measured latency/throughput on machine kind m
    <name>/aliases/<alias>/<seq>.json        the alias's moves, one record each, never rewritten
    <name>/rollouts/<id>/<router>.json       what each router saw of a rollout (rewritten as it goes)

Versions never change: artifacts are stored by content, so a racing push cannot
overwrite another's bytes, and a version's manifest is created with an exclusive
create (O_EXCL on disk, ``If-None-Match: *`` on S3). An alias is the newest record of
its log; moving it creates the next record exclusively, which is a compare-and-swap
on the log's length: of two racing moves exactly one wins, the other is told. A first
set of a protected alias is the same compare-and-swap against an empty log.

A record that is empty, cut short or unparseable (what a writer that died between
create and write leaves on storage that lets a create be seen before its write) is
treated as not written: readers skip it and the alias is its newest readable record;
the next move takes the number after it, superseding it. Its location goes to the
log (``shardline.registry``), never into an error message, which a tenant may read.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import json
import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, ValidationError

from shardline.bundle import (
    MANIFEST,
    Artifact,
    Manifest,
    ModelRef,
    check_model_name,
    read_manifest,
    sha256_file,
    sha256_of,
    verify_artifacts,
)
from shardline.errors import (
    AliasConflict,
    ImmutableVersion,
    IntegrityError,
    InvalidSetting,
    ModelNotFound,
    ProtectedAlias,
    RegistryUnreadable,
)
from shardline.storage.fs import atomic_write_bytes, create_exclusive, join, open_fs
from shardline.storage.rollouts import Rollout

if TYPE_CHECKING:
    from shardline.settings import StorageSettings

_ALIAS_CHARS = set("0123456789abcdefghijklmnopqrstuvwxyz-_.")
_PUSH_ATTEMPTS = 20

AliasAction = Literal["set", "promote", "rollback", "canary", "shadow"]

logger = logging.getLogger("shardline.registry")


class Variant(BaseModel):
    """A precision variant of a version: another model file computing the same thing."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$", description="e.g. 'int8' or 'fp16'.")
    precision: Literal["int8", "fp16", "fp32"]
    device: Literal["cpu", "cuda"] = Field(description="Where the variant is meant to run.")
    artifact: Artifact = Field(description="Its model file; replaces the version's model artifact.")
    metric: str | None = Field(default=None, description="Golden-set metric, as the evaluation names it.")
    score: float | None = Field(default=None, description="The variant's score on the golden set.")
    baseline: float | None = Field(default=None, description="The fp32 version's score on the same set.")
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))

    @property
    def delta(self) -> float | None:
        """How far the variant's score moved from the baseline's (signed)."""
        return None if self.score is None or self.baseline is None else self.score - self.baseline


class ResolvedModel(BaseModel):
    """A reference pinned to one version: what workers load, whatever aliases do later."""

    reference: str
    name: str
    version: int
    outputs_digest: str = Field(description="The manifest's outputs digest (what batch jobs key on), worked out once at resolve time.")
    content_digest: str = Field(description="The manifest's content digest, worked out once at resolve time.")
    registry_url: str
    manifest: Manifest
    variants: dict[str, Variant] = Field(default_factory=dict)

    def variant(self, name: str) -> "ResolvedModel":
        """The same version with a precision variant's model file in place of its own.

        Raises:
            ModelNotFound: the version has no such variant.
        """
        if name not in self.variants:
            raise ModelNotFound(
                f"{self.pinned} has no variant {name!r} (it has: {sorted(self.variants) or 'none'}); make one "
                f"with `shardline model optimize {self.pinned} --quantize {name if name in ('int8', 'fp16') else 'int8'}`"
                ", where the model has ops it speeds up (a tree ensemble or a linear model has none: use the fp32 "
                "model, asking for no variant)",
                f"{self.pinned}#{name}",
            )
        chosen = self.variants[name]
        artifacts = [chosen.artifact if a.role == "model" else a for a in self.manifest.artifacts]
        manifest = self.manifest.model_copy(update={"artifacts": artifacts, "tags": {**self.manifest.tags, "variant": name}})
        return self.model_copy(update={
            "manifest": manifest, "outputs_digest": manifest.outputs_digest, "content_digest": manifest.content_digest,
            "reference": f"{self.reference}#{name}",
        })

    @property
    def pinned(self) -> str:
        """``name:version``."""
        return f"{self.name}:{self.version}"

    @property
    def variant_name(self) -> str:
        """The precision variant this is (``variant`` made it), "" for the version's own model file."""
        return self.reference.rsplit("#", 1)[1] if "#" in self.reference else ""

    @property
    def version_label(self) -> str:
        """The version as the metrics and the metering ledger label it: ``3``, or ``3#int8`` for a precision
        variant."""
        return f"{self.version}#{self.variant_name}" if self.variant_name else str(self.version)

    @property
    def uri(self) -> str:
        """Where the version's manifest lives."""
        return f"{self.registry_url.rstrip('/')}/{self.name}/versions/{self.version}"


class AliasMove(BaseModel):
    """One record of an alias's audit log."""

    seq: int = Field(ge=1)
    alias: str
    version: int
    previous: int | None = None
    action: AliasAction
    by: str
    at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    reason: str = ""
    rollout: Rollout | None = Field(
        default=None, description="With action canary or shadow: the rollout in progress (the alias still "
        "points at ``version``, the baseline; storage/rollouts.py)."
    )


@dataclass(frozen=True)
class AliasLog:
    """An alias's log as read: its readable moves (oldest first) and the highest record number present."""

    moves: list[AliasMove]
    head: int

    @property
    def current(self) -> AliasMove | None:
        """The newest readable move, or None when the alias was never (readably) set."""
        return self.moves[-1] if self.moves else None


def record_seq(filename: str) -> int | None:
    """The record number of an alias record's file name (``00000012.json`` -> 12), None for other names."""
    stem = filename[: -len(".json")] if filename.endswith(".json") else ""
    return int(stem) if stem.isascii() and stem.isdigit() else None


def parse_move(blob: bytes, seq: int, alias: str) -> AliasMove | None:
    """The move an alias record holds, or None when it is empty, cut short, unparseable or misnamed."""
    if not blob.strip():
        return None
    try:
        move = AliasMove.model_validate_json(blob)
    except ValidationError:
        return None
    return move if move.seq == seq and move.alias == alias else None


def check_alias(alias: str) -> str:
    """Return ``alias`` if valid, else raise InvalidSetting."""
    if not alias or not set(alias) <= _ALIAS_CHARS or alias[0] in "-_.":
        raise InvalidSetting(f"alias {alias!r} is not allowed; use lower-case letters, digits, '-', '_' or '.'")
    return alias


class ModelRegistry:
    """Push bundles, list and search versions, move aliases with an audit log, resolve references."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.storage_options = storage_options or {}
        self.fs, self.root = open_fs(url, self.storage_options)

    @classmethod
    def from_settings(cls, storage: StorageSettings) -> ModelRegistry:
        """The registry the storage settings name (``SHARDLINE_STORAGE_REGISTRY_URL``, else ``<home>/registry``)."""
        return cls(storage.registry, storage.storage_options)

    # -- layout -----------------------------------------------------------------
    def _version_dir(self, name: str, version: int) -> str:
        return join(self.root, name, "versions", str(version))

    def blob_path(self, name: str, sha256: str) -> str:
        """Where an artifact's bytes live."""
        return join(self.root, name, "blobs", sha256)

    def _alias_dir(self, name: str, alias: str) -> str:
        return join(self.root, name, "aliases", alias)

    def _listing(self, path: str) -> list[str]:
        """Names directly under ``path``, fresh (a long-lived s3fs caches listings)."""
        self.fs.invalidate_cache(path)
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(path, detail=False))
        except FileNotFoundError:
            return []

    # -- versions ---------------------------------------------------------------
    def list_models(self) -> list[str]:
        """Names of every model with at least one version."""
        return [n for n in self._listing(self.root) if self._version_numbers(n)]

    def _version_numbers(self, name: str) -> list[int]:
        versions_dir = join(self.root, name, "versions")
        numbers = [int(v) for v in self._listing(versions_dir) if v.isdigit()]
        return sorted(n for n in numbers if self.fs.exists(join(versions_dir, str(n), MANIFEST)))

    def require_model(self, name: str) -> list[int]:
        """The model's version numbers, oldest first.

        Raises:
            ModelNotFound: no version of ``name`` was pushed (the message lists the models there are).
            InvalidSetting: ``name`` is not a model name.
        """
        check_model_name(name)
        numbers = self._version_numbers(name)
        if not numbers:
            raise ModelNotFound(self._missing_message(name, None), name)
        return numbers

    def get_manifest(self, name: str, version: int) -> Manifest:
        """The manifest of one version."""
        path = join(self._version_dir(name, version), MANIFEST)
        try:
            blob = self.fs.cat_file(path)
        except FileNotFoundError as e:
            raise ModelNotFound(self._missing_message(name, f"version {version}"), f"{name}:{version}") from e
        return Manifest.from_json(blob, self.fs.unstrip_protocol(path))

    def list_versions(self, name: str) -> list[Manifest]:
        """Every version of a model, oldest first."""
        return [self.get_manifest(name, v) for v in self._version_numbers(name)]

    def push(self, bundle_dir: str | Path, *, keep_version: bool = False) -> Manifest:
        """Add a local bundle as a new version; the same bytes again return the existing one.

        An artifact the registry holds already is read and checked; one damaged since its push (its bytes changed)
        is written again from the bundle, so pushing a bundle again repairs its version.

        Args:
            bundle_dir: folder with ``manifest.json`` and its artifacts.
            keep_version: keep the manifest's version number (copying a version
                between registries) instead of taking the next free one.

        Raises:
            IntegrityError: an artifact does not match its manifest.
            ImmutableVersion: ``keep_version`` and that version exists with other bytes.
        """
        manifest = read_manifest(bundle_dir)
        verify_artifacts(bundle_dir, manifest)
        for artifact in manifest.artifacts:
            blob = self.blob_path(manifest.name, artifact.sha256)
            # same content, same key: a racing push writes the same bytes; a blob changed since its push (damaged:
            # its bytes no longer hash to its name) is written again, which repairs every version that holds it
            if not self._blob_intact(blob, artifact):
                self.fs.makedirs(join(self.root, manifest.name, "blobs"), exist_ok=True)
                self.fs.put_file(str(Path(bundle_dir) / artifact.path), blob)
        for _ in range(_PUSH_ATTEMPTS):
            existing = self.list_versions(manifest.name)
            same = next((m for m in existing if m.content_digest == manifest.content_digest), None)
            if same is not None and not (keep_version and same.version != manifest.version):
                return same
            if keep_version and manifest.version is not None:
                version = manifest.version
            else:
                version = max((m.version or 0 for m in existing), default=0) + 1
            pushed = manifest.model_copy(update={"version": version})
            if create_exclusive(self.fs, join(self._version_dir(manifest.name, version), MANIFEST), pushed.to_json().encode()):
                return pushed
            if keep_version:
                theirs = self.get_manifest(manifest.name, version)
                if theirs.content_digest == manifest.content_digest:
                    return theirs
                raise ImmutableVersion(
                    f"{manifest.name}:{version} already exists in {self.url} with other bytes (content digest "
                    f"{theirs.content_digest[:12]}..., yours {manifest.content_digest[:12]}...); versions never change: "
                    "push without keeping the version to get a new number"
                )
        raise AliasConflict(f"could not find a free version number for {manifest.name!r} after {_PUSH_ATTEMPTS} tries")

    def _blob_intact(self, blob: str, artifact: Artifact) -> bool:
        """Whether the registry holds ``blob`` with the bytes of ``artifact`` (False: missing, or damaged, logged)."""
        if not self.fs.exists(blob):
            return False
        with self.fs.open(blob, "rb") as f:
            intact = self.fs.size(blob) == artifact.size and sha256_of(f) == artifact.sha256
        if not intact:
            logger.warning("the registry's blob %s of %r was damaged (its bytes changed after its push): writing "
                           "it again", artifact.sha256[:12], artifact.path)
        return intact

    def search(self, name: str | None = None, alias: str | None = None, tags: dict[str, str] | None = None) -> list[Manifest]:
        """Versions whose name contains ``name``, that ``alias`` points at, and that carry ``tags``."""
        found = []
        for model in self.list_models():
            if name and name not in model:
                continue
            aliases = self.aliases(model)
            for manifest in self.list_versions(model):
                if alias is not None and aliases.get(alias) != manifest.version:
                    continue
                if tags and any(manifest.tags.get(k) != v for k, v in tags.items()):
                    continue
                found.append(manifest)
        return found

    # -- variants and profiles -------------------------------------------------------
    def add_variant(self, name: str, version: int, variant: Variant, model_file: str | Path) -> Variant:
        """Store a precision variant of a version, once; its file is checked against its sha256.

        Raises:
            IntegrityError: the file does not match ``variant.artifact``.
            ImmutableVersion: the version already has a variant of that name with other bytes.
        """
        self.get_manifest(name, version)
        got = sha256_file(model_file)
        if got != variant.artifact.sha256:
            raise IntegrityError(
                f"variant file {model_file} has sha256 {got[:12]}..., its record says "
                f"{variant.artifact.sha256[:12]}...", variant.artifact.path, variant.artifact.sha256, got,
            )
        blob = self.blob_path(name, got)
        if not self.fs.exists(blob):
            self.fs.makedirs(join(self.root, name, "blobs"), exist_ok=True)
            self.fs.put_file(str(model_file), blob)
        record = join(self._version_dir(name, version), "variants", f"{variant.name}.json")
        if not create_exclusive(self.fs, record, variant.model_dump_json().encode()):
            existing = Variant.model_validate_json(self.fs.cat_file(record))
            if existing.artifact.sha256 != variant.artifact.sha256:
                raise ImmutableVersion(
                    f"{name}:{version} already has a variant {variant.name!r} with other bytes; variants never "
                    "change: give the new one another name"
                )
            return existing
        return variant

    def list_variants(self, name: str, version: int) -> dict[str, Variant]:
        """The precision variants of a version, by name."""
        directory = join(self._version_dir(name, version), "variants")
        return {
            f[: -len(".json")]: Variant.model_validate_json(self.fs.cat_file(join(directory, f)))
            for f in self._listing(directory)
            if f.endswith(".json")
        }

    def put_profile(self, name: str, version: int, machine: str, profile: dict[str, Any]) -> None:
        """Store (or replace) what a version measured on one kind of machine."""
        self.get_manifest(name, version)
        atomic_write_bytes(
            self.fs, join(self._version_dir(name, version), "profiles", f"{machine}.json"),
            json.dumps(profile, indent=2, default=str).encode(), join(self.root, "_staging"),
        )

    def profiles(self, name: str, version: int) -> dict[str, dict[str, Any]]:
        """Measured profiles of a version, by machine kind."""
        directory = join(self._version_dir(name, version), "profiles")
        return {
            f[: -len(".json")]: json.loads(self.fs.cat_file(join(directory, f)))
            for f in self._listing(directory)
            if f.endswith(".json")
        }

    # -- aliases ----------------------------------------------------------------
    def alias_history(self, name: str, alias: str) -> list[AliasMove]:
        """Every readable move of ``name@alias``, oldest first (unreadable records are skipped)."""
        return self.alias_log(name, alias).moves

    def alias_log(self, name: str, alias: str) -> AliasLog:
        """The readable moves of ``name@alias`` and the highest record number present, readable or not.

        Raises:
            RegistryUnreadable: the storage refused to read a record (the log names it).
        """
        directory = self._alias_dir(name, check_alias(alias))
        numbered = [(seq, f) for f in self._listing(directory) if (seq := record_seq(f)) is not None]
        moves = []
        for seq, filename in sorted(numbered):
            move = self._read_move(join(directory, filename), seq, name, alias)
            if move is not None:
                moves.append(move)
        return AliasLog(moves, max((seq for seq, _ in numbered), default=0))

    def _read_move(self, path: str, seq: int, name: str, alias: str) -> AliasMove | None:
        try:
            blob = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.error("cannot read alias record %s: %s", self.fs.unstrip_protocol(path), e)
            raise RegistryUnreadable(
                f"the registry could not read record {seq} of {name}@{alias} ({type(e).__name__}); the server "
                "log names its location: check the registry storage's permissions and health"
            ) from e
        move = parse_move(blob, seq, alias)
        if move is None:
            logger.warning(
                "alias record %s of %s@%s is %s; it is treated as not written (the next move supersedes it)",
                self.fs.unstrip_protocol(path), name, alias, "empty" if not blob.strip() else "unreadable",
            )
        return move

    def put_rollout_report(self, name: str, rollout_id: str, source: str, report: dict[str, Any]) -> None:
        """Store (or replace) what one router saw of a rollout (``rollout status`` reads them all)."""
        atomic_write_bytes(self.fs, join(self.root, name, "rollouts", rollout_id, f"{source}.json"),
                           json.dumps(report, default=str).encode(), join(self.root, "_staging"))

    def rollout_reports(self, name: str, rollout_id: str) -> dict[str, dict[str, Any]]:
        """What each router saw of a rollout, by router."""
        directory = join(self.root, name, "rollouts", rollout_id)
        found = {}
        for f in self._listing(directory):
            if f.endswith(".json"):
                with contextlib.suppress(FileNotFoundError, ValueError):
                    found[f[: -len(".json")]] = json.loads(self.fs.cat_file(join(directory, f)))
        return found

    def current_move(self, name: str, alias: str) -> AliasMove | None:
        """The newest readable move of ``name@alias``, or None if it was never set.

        Reads the records newest first and stops at the first readable one: one listing and
        (usually) one read, however long the history (routers read it every few seconds)."""
        directory = self._alias_dir(name, check_alias(alias))
        numbered = [(seq, f) for f in self._listing(directory) if (seq := record_seq(f)) is not None]
        for seq, filename in sorted(numbered, reverse=True):
            move = self._read_move(join(directory, filename), seq, name, alias)
            if move is not None:
                return move
        return None

    def aliases(self, name: str) -> dict[str, int]:
        """Alias -> version for one model."""
        return {alias: move.version for alias, move in self.current_moves(name).items()}

    def current_moves(self, name: str) -> dict[str, AliasMove]:
        """Alias -> its newest readable record, for one model (aliases never set readably left out)."""
        found = {}
        for alias in self._listing(join(self.root, name, "aliases")):
            move = self.current_move(name, alias)
            if move is not None:
                found[alias] = move
        return found

    def move_alias(
        self,
        name: str,
        alias: str,
        version: int,
        *,
        action: AliasAction,
        expected_seq: int,
        by: str | None = None,
        reason: str = "",
        rollout: Rollout | None = None,
    ) -> AliasMove:
        """Move ``name@alias`` to ``version`` if its newest readable record is still number ``expected_seq``.

        The move is the exclusive create of the record after the highest one present, so
        its success proves the log it was decided on (``expected_seq``, 0 for never set)
        was still the whole log; unreadable records after ``expected_seq`` are superseded.

        Raises:
            ModelNotFound: the version does not exist.
            AliasConflict: another move came first; read the alias again and decide again.
        """
        check_alias(alias)
        self.get_manifest(name, version)
        log = self.alias_log(name, alias)
        current = log.current
        move = AliasMove(
            seq=log.head + 1, alias=alias, version=version, previous=current.version if current else None,
            action=action, by=by or getpass.getuser(), reason=reason, rollout=rollout,
        )
        path = join(self._alias_dir(name, alias), f"{move.seq:08d}.json")
        if (current.seq if current else 0) != expected_seq or not create_exclusive(self.fs, path, move.model_dump_json().encode()):
            latest = self.current_move(name, alias)
            raise AliasConflict(
                f"{name}@{alias} moved while you were deciding (now {name}:{latest.version if latest else '?'}, "
                f"by {latest.by if latest else '?'}, record {latest.seq if latest else 0}); check it and try again"
            )
        if log.head != (current.seq if current else 0):
            logger.warning("%s@%s: record %d supersedes unreadable records %d-%d", name, alias, move.seq,
                           (current.seq if current else 0) + 1, log.head)
        return move

    def set_alias(
        self, name: str, alias: str, version: int, *, by: str | None = None, reason: str = "", protected: bool = False
    ) -> AliasMove:
        """Point ``name@alias`` at a version now (recorded as 'set').

        Args:
            protected: the alias may only be set the first time (later it moves through
                gated promotion or rollback): one compare-and-swap against a never-set
                alias, so of racing first sets exactly one wins.

        Raises:
            ProtectedAlias: ``protected`` and the alias is set already (or was set first by a racing writer).
            AliasConflict: the alias kept moving under an unprotected set.
        """
        if protected:
            try:
                return self.move_alias(name, alias, version, action="set", expected_seq=0, by=by, reason=reason)
            except AliasConflict as e:
                raise self._protected(name, alias, version) from e
        for _ in range(_PUSH_ATTEMPTS):
            current = self.current_move(name, alias)
            try:
                return self.move_alias(
                    name, alias, version, action="set", expected_seq=current.seq if current else 0, by=by, reason=reason
                )
            except AliasConflict:
                continue
        raise AliasConflict(f"{name}@{alias} kept moving; try again")

    def _protected(self, name: str, alias: str, version: int) -> ProtectedAlias:
        now = self.current_move(name, alias)
        where = f" (it points at {name}:{now.version}, set by {now.by}, record {now.seq})" if now else ""
        return ProtectedAlias(
            f"{name}@{alias} is protected and already set{where}: it moves only through `shardline model promote "
            f"{name}:{version} --to {alias}` (gated) or `shardline model rollback {name} --alias {alias}`",
            f"{name}@{alias}",
        )

    def rollback(self, name: str, alias: str, *, by: str | None = None, reason: str = "") -> AliasMove:
        """Move ``name@alias`` back to the version it pointed at before its current one.

        Raises:
            ModelNotFound: the alias has no earlier version to go back to.
        """
        history = self.alias_history(name, alias)
        if not history:
            raise ModelNotFound(f"{name}@{alias} was never set, so there is nothing to roll back", f"{name}@{alias}")
        current = history[-1]
        earlier = [m.version for m in history if m.version != current.version]
        if not earlier:
            raise ModelNotFound(
                f"{name}@{alias} has only ever pointed at {name}:{current.version}; there is no earlier version "
                "to roll back to", f"{name}@{alias}",
            )
        before = earlier[-1]
        return self.move_alias(
            name, alias, before, action="rollback", expected_seq=current.seq, by=by,
            reason=reason or f"roll back from {name}:{current.version}",
        )

    # -- resolving ----------------------------------------------------------------
    def resolve(self, reference: str | ModelRef) -> ResolvedModel:
        """Pin ``name@alias`` or ``name:version`` to one version.

        Raises:
            ModelNotFound: the name, version or alias is not registered.
        """
        ref = reference if isinstance(reference, ModelRef) else ModelRef.parse(reference)
        if ref.version is None:
            assert ref.alias is not None
            move = self.current_move(ref.name, ref.alias)
            if move is None:
                if not self._version_numbers(ref.name):
                    raise ModelNotFound(self._missing_message(ref.name, None), str(ref))
                raise ModelNotFound(
                    f"model {ref.name!r} has no alias {ref.alias!r} (its aliases: {self.aliases(ref.name) or 'none'}); "
                    f"set one with `shardline model alias {ref.name} {ref.alias} VERSION`",
                    str(ref),
                )
            version = move.version
        else:
            version = ref.version
        manifest = self.get_manifest(ref.name, version)
        return ResolvedModel(
            reference=str(ref), name=ref.name, version=version, outputs_digest=manifest.outputs_digest,
            content_digest=manifest.content_digest, registry_url=self.fs.unstrip_protocol(self.root), manifest=manifest,
            variants=self.list_variants(ref.name, version),
        )

    def reference_profile(self, model: ResolvedModel) -> dict[str, Any] | None:
        """The version's reference data profile (sha256-checked), or None when it was packaged without one.

        Raises:
            IntegrityError: the stored profile does not match its manifest.
        """
        manifest = model.manifest
        artifact = next((a for a in manifest.artifacts if a.path == manifest.reference_profile), None)
        if manifest.reference_profile is None or artifact is None:
            return None
        blob = self.fs.cat_file(self.blob_path(model.name, artifact.sha256))
        got = hashlib.sha256(blob).hexdigest()
        if got != artifact.sha256:
            raise IntegrityError(
                f"the reference profile of {model.pinned} in the registry has sha256 {got[:12]}..., its manifest "
                f"says {artifact.sha256[:12]}...; push the bundle again", artifact.path, artifact.sha256, got,
            )
        profile: dict[str, Any] = json.loads(blob)
        return profile

    def _missing_message(self, name: str, what: str | None) -> str:
        check_model_name(name)
        numbers = self._version_numbers(name)
        if what is None or not numbers:
            known = self.list_models()
            return (
                f"model {name!r} is not in the registry at {self.url} (it holds: "
                f"{known or 'nothing yet'}); push it with `shardline model push BUNDLE_DIR`"
            )
        return f"model {name!r} has no {what} (it has versions {numbers}); list them with `shardline model list`"


def fetch_bundle(
    model: ResolvedModel, dest: Path, storage_options: dict[str, Any] | None = None, verify: bool = True
) -> None:
    """Download a resolved version's artifacts and manifest into the local folder ``dest``.

    Args:
        verify: check every artifact's sha256 (off only where the caller reports the
            check itself, as the promotion's checksum gate does).

    Raises:
        IntegrityError: a stored artifact differs from its manifest (with ``verify``).
    """
    registry = ModelRegistry(model.registry_url, storage_options)
    dest.mkdir(parents=True, exist_ok=True)
    for artifact in model.manifest.artifacts:
        local = dest / artifact.path
        local.parent.mkdir(parents=True, exist_ok=True)
        registry.fs.get_file(registry.blob_path(model.name, artifact.sha256), str(local))
    (dest / MANIFEST).write_text(model.manifest.to_json())
    if verify:
        verify_artifacts(dest, model.manifest)
