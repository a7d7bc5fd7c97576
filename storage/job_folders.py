"""Which kind of job an output folder holds, told by the files each kind writes first, on any fsspec file system.

A `batch run` job's folder holds its ledger (``_ledger/``, from its first settled shard) or its manifest
(``_manifest.json``: storage/output.py); a `batch openai` job's holds its record (``_job.json``, created before
its first part) or its parts (``_parts/``: storage/openai_batch.py). Two jobs never share a folder, and a job's
output is never inside another job's: the reader of one would read the other's files as its own. Each kind's
planning calls :func:`job_folder_kind` on its output and :func:`enclosing_job_folder` above it.
"""

from __future__ import annotations

import posixpath
from typing import Literal

from fsspec import AbstractFileSystem

from shardline.storage.fs import join

JobKind = Literal["batch run", "batch openai"]

JOB_FOLDER_FILES: dict[JobKind, tuple[str, ...]] = {
    "batch run": ("_manifest.json", "_ledger"),
    "batch openai": ("_job.json", "_parts"),
}
"""The names that mark a folder as a job's output, by the command that makes such jobs."""

WHAT_MARKS: dict[JobKind, str] = {
    "batch run": "its manifest or ledger",
    "batch openai": "its _job.json or _parts",
}
"""What a folder of each kind holds that says so, for a refusal's message."""


def job_folder_kind(fs: AbstractFileSystem, path: str) -> JobKind | None:
    """The kind of job whose output ``path`` is, or None when it is no job's output (or does not exist)."""
    for kind, names in JOB_FOLDER_FILES.items():
        if any(fs.exists(join(path, name)) for name in names):
            return kind
    return None


def enclosing_job_folder(fs: AbstractFileSystem, root: str, uri: str) -> tuple[str, JobKind] | None:
    """The nearest folder above ``root`` that is a job's output, with its kind, named as ``uri`` is (a URL, or a
    path); None when none is."""
    path = root.rstrip("/")
    while True:
        parent = posixpath.dirname(path)
        if parent == path or not parent:
            return None
        path = parent
        kind = job_folder_kind(fs, path)
        if kind is not None:
            return (str(fs.unstrip_protocol(path)) if "://" in uri else path), kind
