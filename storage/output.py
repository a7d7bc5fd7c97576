"""A batch job's output: parts committed atomically, a ledger, and the job manifest.

Layout under the output URL::

    <relative>.parquet            one part per input shard, named after it
    _ledger/<relative>.json       one record per settled shard (committed or quarantined)
    _staging/<job_id>/            one job's parts being written; never read, removed at its end
    _lease/<generation>.json      who owns the folder now (storage/lease.py): one job at a time
    _manifest.json                every part with its row counts, written last
    _SUCCESS                      present only while the manifest describes the output

Each job stages under its own job id, so a job never deletes the files another is
writing; the lease keeps a second job from writing the folder at all.

Readers (pyarrow, Spark, polars) skip names that start with '_', so a reader of the
folder sees committed parts only.
"""

from __future__ import annotations

import json
import os
import posixpath
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Literal

from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel, Field, field_validator

from shardline.errors import InvalidInput, InvalidSetting
from shardline.storage.fs import atomic_write_bytes, inside, join, links_out, open_fs
from shardline.storage.job_folders import refuse_job_folder_overlap
from shardline.storage.shards import ShardInfo

LEDGER = "_ledger"
STAGING = "_staging"
MANIFEST = "_manifest.json"
SUCCESS = "_SUCCESS"


class ManifestModel(BaseModel):
    """The manifest's ``model``: what was asked for, the version it was pinned to, the variant, its digest."""

    reference: str
    pinned: str
    variant: str
    digest: str


class ManifestPart(BaseModel):
    """A committed part in the manifest."""

    part: str | None
    shard: str
    rows: int


class ManifestQuarantine(BaseModel):
    """A quarantined shard in the manifest, with why; ``rows`` is null for a shard that could not be read at all
    (its row count is unknown: the totals count it in ``shards_unreadable`` and its rows nowhere)."""

    shard: str
    rows: int | None
    reason: str | None


class JobManifest(BaseModel):
    """``_manifest.json``: every part with its row counts, written last (input rows = output + quarantined, over
    the rows that could be read; an unreadable shard's unknown rows count in neither).

    ``sla`` (planned vs actual) and ``priority`` are written by the flow; they are left
    out of the file when not given.
    """

    job_id: str
    job_key: str
    tenant: str
    model: ManifestModel
    input: str
    output: str
    passthrough: list[str] | Literal["auto"]
    totals: dict[str, int]
    parts: list[ManifestPart]
    quarantined: list[ManifestQuarantine]
    sla: dict[str, Any] | None = None
    priority: str | None = None

    def to_json(self) -> bytes:
        """The file's bytes: indented JSON, without the optional sections that were not given."""
        absent = {name for name in ("sla", "priority") if getattr(self, name) is None}
        return self.model_dump_json(indent=2, exclude=absent).encode()


def part_name(relative: str) -> str:
    """The output part's path for an input shard's relative path."""
    stem, _ = posixpath.splitext(relative)
    return f"{stem}.parquet"


def check_part_names(shards: Iterable[ShardInfo]) -> None:
    """Refuse inputs whose shards would map to the same part (``a.pq`` and ``a.parquet``)."""
    seen: dict[str, str] = {}
    for shard in shards:
        name = part_name(shard.relative)
        if name in seen:
            raise InvalidInput(
                f"shards {seen[name]!r} and {shard.relative!r} would both write {name!r}; "
                "rename one of them"
            )
        seen[name] = shard.relative


class PartRecord(BaseModel):
    """What the ledger keeps about one settled shard.

    ``ranges`` is how many row-group ranges a large shard was scored in (1: one pass),
    ``ranges_resumed`` how many of them an earlier, interrupted attempt had finished.
    """

    shard: str
    relative: str
    fingerprint: str
    job_key: str
    status: Literal["committed", "quarantined"]
    part: str | None = None
    rows_in: int | None = None
    rows_out: int = 0
    rows_quarantined: int = 0
    reason: str | None = None
    seconds: float = 0.0
    settled_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    ranges: int = 1
    ranges_resumed: int = 0

    @field_validator("reason")
    @classmethod
    def _one_line(cls, reason: str | None) -> str | None:
        """A quarantine reason is one line wherever it is shown (summary, manifest, logs): the errors it quotes
        (pyarrow's, say) may span several."""
        return None if reason is None else " ".join(reason.split())


class OutputLayout:
    """Paths of one job's output, on whatever file system its URL names."""

    def __init__(self, output_uri: str, storage_options: dict[str, Any] | None = None, job_id: str = "") -> None:
        self.uri = output_uri
        self.storage_options = storage_options or {}
        self.job_id = job_id
        self.fs, self.root = open_fs(output_uri, self.storage_options)
        self._resolved_root: str | None = None  # the root as the OS resolves it (local disk), once

    def _inside(self, *parts: str) -> str:
        """A path below the output that no symbolic link leads out of it (``storage.fs.inside``)."""
        if self._resolved_root is None and isinstance(self.fs, LocalFileSystem):
            self._resolved_root = os.path.realpath(self.root)
        return inside(self.fs, self.root, join(self.root, *parts), self._resolved_root)

    def refuse_links_out(self) -> None:
        """Refuse an output folder holding a symbolic link that leads out of it (a job's writes would follow it).

        Raises:
            InvalidSetting: naming the link, where it leads and what to do.
        """
        found = links_out(self.fs, self.root)
        if found:
            link, target = found[0]
            raise InvalidSetting(
                f"the output folder {self.uri!r} holds a symbolic link {link!r} that leads outside it (to "
                f"{target!r}){f' and {len(found) - 1} more' if len(found) > 1 else ''}; remove it, or choose "
                "another --output: a job writes only inside the folder it was admitted to"
            )

    def part_path(self, relative: str) -> str:
        """Where the part for a shard is committed."""
        return self._inside(part_name(relative))

    def ledger_path(self, relative: str) -> str:
        """Where a shard's ledger record lives."""
        return self._inside(LEDGER, f"{relative}.json")

    @property
    def staging_dir(self) -> str:
        """Where this job's parts are written before they are committed (``_staging/<job_id>``)."""
        return self._inside(STAGING, self.job_id) if self.job_id else self._inside(STAGING)

    def record(self, record: PartRecord) -> None:
        """Write a shard's ledger record (atomically; the last write wins)."""
        atomic_write_bytes(
            self.fs, self.ledger_path(record.relative), record.model_dump_json().encode(), self.staging_dir
        )

    def read_ledger(self) -> dict[str, PartRecord]:
        """Every ledger record, by the shard's relative path."""
        ledger_dir = join(self.root, LEDGER)
        self.fs.invalidate_cache(self.root)
        if not self.fs.exists(ledger_dir):
            return {}
        paths = [p for p in self.fs.find(ledger_dir) if p.endswith(".json")]
        if not paths:
            return {}
        records = {}
        for blob in self.fs.cat(paths, on_error="omit").values():
            record = PartRecord.model_validate_json(blob)
            records[record.relative] = record
        return records

    def present_parts(self) -> set[str]:
        """Relative names of the parts visible in the output now."""
        self.fs.invalidate_cache(self.root)
        if not self.fs.exists(self.root):
            return set()
        return {
            posixpath.relpath(p, self.root)
            for p in self.fs.find(self.root)
            if p.endswith(".parquet") and not posixpath.relpath(p, self.root).startswith("_")
        }

    def refuse_job_folder_overlap(self) -> None:
        """Refuse this output when it is a `batch openai` job's folder, lies inside any job's output folder, or
        holds one (storage/job_folders.py): a reader of the outer folder would read the inner job's files as its own.

        Raises:
            OutputInUse: naming the other job's folder.
        """
        refuse_job_folder_overlap(self.fs, self.root, self.uri, "batch run")

    def clear_success(self) -> None:
        """Withdraw ``_SUCCESS`` while the output is being changed."""
        path = join(self.root, SUCCESS)
        if self.fs.exists(path):
            self.fs.rm(path)

    def commit_manifest(self, manifest: JobManifest, still_owner: Callable[[], None] = lambda: None) -> str:
        """Write the job manifest, then ``_SUCCESS``, and drop this job's staging files.

        ``still_owner`` is called before each of the two writes and raises when the
        folder is no longer this job's (its lease was taken over): no manifest or
        ``_SUCCESS`` is ever written over another job's parts.
        """
        still_owner()
        atomic_write_bytes(self.fs, self._inside(MANIFEST), manifest.to_json(), self.staging_dir)
        still_owner()
        atomic_write_bytes(self.fs, self._inside(SUCCESS), b"", self.staging_dir)
        self.drop_staging()
        return self.manifest_uri

    def drop_staging(self) -> None:
        """Remove this job's staging files (never another job's), and ``_staging`` itself once it is empty."""
        if self.fs.exists(self.staging_dir):
            self.fs.rm(self.staging_dir, recursive=True)
        shared = join(self.root, STAGING)
        self.fs.invalidate_cache(shared)
        try:
            if self.fs.exists(shared) and not self.fs.ls(shared, detail=False):
                self.fs.rmdir(shared)
        except OSError:  # another job staged something meanwhile: it is theirs
            pass

    @property
    def manifest_uri(self) -> str:
        """The manifest's URL."""
        return str(self.fs.unstrip_protocol(join(self.root, MANIFEST)))

    def read_manifest(self) -> JobManifest:
        """The committed job manifest, typed.

        Raises:
            FileNotFoundError: none is committed here.
            ValueError: the file is not a batch job's manifest (pydantic's ValidationError is one).
        """
        return JobManifest.model_validate_json(self.fs.cat_file(join(self.root, MANIFEST)))

    def _raw_manifest(self) -> Any:
        """Whatever JSON ``_manifest.json`` holds (another kind of job's, an older version's): for the checks that
        only ask whose output this is."""
        return json.loads(self.fs.cat_file(join(self.root, MANIFEST)))

    def finished_manifest(self) -> dict[str, Any] | None:
        """The manifest when ``_SUCCESS`` says it describes the output; None otherwise (or when unreadable)."""
        self.fs.invalidate_cache(self.root)
        try:
            if not self.fs.exists(join(self.root, SUCCESS)):
                return None
            manifest = self._raw_manifest()
        except (FileNotFoundError, NotADirectoryError, ValueError):
            return None
        return manifest if isinstance(manifest, dict) else None

    def any_manifest(self) -> dict[str, Any] | None:
        """The manifest a job left here, with or without ``_SUCCESS``; None when there is none."""
        try:
            manifest = self._raw_manifest()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, ValueError):
            return None
        return manifest if isinstance(manifest, dict) else None


def split_done(
    shards: Iterable[ShardInfo], ledger: dict[str, PartRecord], job_key: str, present_parts: set[str]
) -> tuple[list[ShardInfo], list[PartRecord]]:
    """Shards still to score, and records of those this job already settled.

    A shard counts as settled when the ledger holds a record for the same bytes
    (fingerprint) under the same job key (model digest and parameters) and, if it was
    committed, its part is still present; anything else (a changed shard, another
    model, a deleted part) is scored again.
    """
    todo, done = [], []
    for shard in shards:
        record = ledger.get(shard.relative)
        if (
            record
            and record.job_key == job_key
            and record.fingerprint == shard.fingerprint
            and (record.status == "quarantined" or part_name(shard.relative) in present_parts)
        ):
            done.append(record)
        else:
            todo.append(shard)
    return todo, done
