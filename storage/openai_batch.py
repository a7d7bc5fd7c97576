"""The bytes of an OpenAI Batch job: its input file, and its output folder on any fsspec file system.

The output folder of a job::

    _job.json             what the job is (shardline.openai_batch.BatchJobRecord), created once, exclusively
    _lease/               one job at a time (storage/lease.py)
    _parts/part-NNNNNN.jsonl  each part's records (OpenAI's output and error lines, in input order)
    _staging/             files being written, before they are moved into place
    output.jsonl          the answered lines (status 200), in input order
    errors.jsonl          the failed lines, in input order
    batch.json            OpenAI's batch object, written last: the job is finished once it is there

Every file appears whole or not at all: it is written under ``_staging/`` and then moved to its name
(``commit_file``: a rename on local disk, a whole-object copy on object stores). A part that is
present is therefore complete, which is what lets a re-run skip it.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Iterator

import orjson
from pydantic import ValidationError

from shardline.errors import InvalidSetting
from shardline.openai_batch import BatchCounts, BatchJobRecord, is_answered
from shardline.storage.fs import (
    atomic_write_bytes,
    commit_file,
    create_exclusive,
    ensure_dir,
    inside,
    join,
    open_fs,
    staging_path,
)

JOB_FILE, PARTS_DIR, STAGING_DIR = "_job.json", "_parts", "_staging"
OUTPUT_FILE, ERRORS_FILE, BATCH_FILE = "output.jsonl", "errors.jsonl", "batch.json"


def read_batch_input(uri: str, storage_options: dict[str, Any] | None = None) -> tuple[bytes, str]:
    """A batch file's bytes and their sha256.

    Raises:
        InvalidSetting: the file does not exist or is a folder.
    """
    fs, path = open_fs(uri, storage_options)
    try:
        if fs.isdir(path):
            raise InvalidSetting(f"the input {uri} is a folder; pass the OpenAI Batch file (JSONL) itself")
        data = fs.cat_file(path)
    except FileNotFoundError as e:
        raise InvalidSetting(f"the input {uri} does not exist; pass the path or URL of an OpenAI Batch file "
                             "(JSONL)") from e
    return data, hashlib.sha256(data).hexdigest()


def _dumps(record: dict[str, Any]) -> bytes:
    return orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY)


class BatchOutputFolder:
    """A job's output folder (see the module docstring)."""

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None) -> None:
        self.uri = uri
        self.fs, self.root = open_fs(uri, storage_options)

    def path(self, *parts: str) -> str:
        """A path under the folder, once it is sure no symbolic link below the folder leads it out."""
        return inside(self.fs, self.root, join(self.root, *parts))

    def url(self, name: str) -> str:
        """The URL of a file of the folder, as the user named the folder."""
        return f"{self.uri.rstrip('/')}/{name}"

    def _read(self, name: str) -> bytes | None:
        try:
            return bytes(self.fs.cat_file(self.path(name)))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def read_job(self) -> BatchJobRecord | None:
        """The job recorded in the folder, if any.

        Raises:
            InvalidSetting: ``_job.json`` is there but is not a job record.
        """
        data = self._read(JOB_FILE)
        if data is None:
            return None
        try:
            return BatchJobRecord.model_validate_json(data)
        except ValidationError as e:
            raise InvalidSetting(f"{self.url(JOB_FILE)} is not an OpenAI batch job's record ({e.error_count()} "
                                 "problems); choose another --output, or delete the folder to answer the file "
                                 "anew") from e

    def create_job(self, record: BatchJobRecord) -> BatchJobRecord:
        """Record the job, unless a job was recorded first (by a run racing this one): the record that won."""
        if create_exclusive(self.fs, self.path(JOB_FILE), record.model_dump_json(indent=2).encode()):
            return record
        recorded = self.read_job()
        assert recorded is not None
        return recorded

    def committed_parts(self) -> set[str]:
        """The names of the parts committed so far."""
        folder = self.path(PARTS_DIR)
        self.fs.invalidate_cache(folder)
        try:
            listed = self.fs.ls(folder, detail=False)
        except FileNotFoundError:
            return set()
        names = (str(p).rstrip("/").rsplit("/", 1)[-1] for p in listed)
        return {n for n in names if n.startswith("part-") and n.endswith(".jsonl")}

    def commit_part(self, name: str, records: Iterable[dict[str, Any]]) -> None:
        """Write a part's records (one JSON object a line) so that the part appears whole or not at all."""
        data = b"".join(_dumps(r) + b"\n" for r in records)
        atomic_write_bytes(self.fs, self.path(PARTS_DIR, name), data, self.path(STAGING_DIR))

    def part_records(self, name: str) -> Iterator[bytes]:
        """A committed part's lines (each one record's JSON)."""
        with self.fs.open(self.path(PARTS_DIR, name), "rb") as f:
            for line in f:
                if line.strip():
                    yield line.rstrip(b"\n")

    def assemble(self, parts: Iterable[str]) -> BatchCounts:
        """Write ``output.jsonl`` (answered lines) and ``errors.jsonl`` (failed lines) from the parts, in order,
        each committed whole; returns the counts."""
        staging = self.path(STAGING_DIR)
        ensure_dir(self.fs, staging)
        staged = {name: staging_path(self.path(name), staging) for name in (OUTPUT_FILE, ERRORS_FILE)}
        completed = failed = 0
        with self.fs.open(staged[OUTPUT_FILE], "wb") as out, self.fs.open(staged[ERRORS_FILE], "wb") as errors:
            for part in parts:
                for line in self.part_records(part):
                    if is_answered(orjson.loads(line)):
                        out.write(line + b"\n")
                        completed += 1
                    else:
                        errors.write(line + b"\n")
                        failed += 1
        for name, path in staged.items():
            commit_file(self.fs, path, self.path(name))
        return BatchCounts(completed + failed, completed, failed)

    def read_batch(self) -> dict[str, Any] | None:
        """The batch object of a finished job, if the folder holds one."""
        data = self._read(BATCH_FILE)
        try:
            return None if data is None else dict(orjson.loads(data))
        except (orjson.JSONDecodeError, TypeError, ValueError):
            return None

    def commit_batch(self, batch: dict[str, Any]) -> None:
        """Write ``batch.json``, whole or not at all (the job's last write)."""
        atomic_write_bytes(self.fs, self.path(BATCH_FILE), orjson.dumps(batch, option=orjson.OPT_INDENT_2),
                           self.path(STAGING_DIR))

    def drop_staging(self) -> None:
        """Remove what failed runs left half-written under ``_staging/``."""
        try:
            self.fs.rm(self.path(STAGING_DIR), recursive=True)
        except (FileNotFoundError, OSError):
            pass


__all__ = ["BATCH_FILE", "ERRORS_FILE", "JOB_FILE", "OUTPUT_FILE", "PARTS_DIR", "BatchOutputFolder",
           "read_batch_input"]
