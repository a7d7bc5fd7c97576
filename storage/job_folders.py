"""Whether an output folder is, lies inside, or holds another job's output folder, on any fsspec file system.

A `batch run` job's folder holds its ledger (``_ledger/``, from its first settled shard) or its manifest
(``_manifest.json``: storage/output.py); a `batch openai` job's holds its record (``_job.json``, created before
its first part) or its parts (``_parts/``: storage/openai_batch.py). Two jobs never share a folder, and one job's
output is never inside another's: the readers of the outer folder would read the inner job's files as its own.
Each kind's planning calls :func:`refuse_job_folder_overlap` on its output, the one place these relations are
checked.

The check lists folders rather than probing names: one listing per folder from the top down to the output (a
listing names every marker a folder holds; it stops at the first folder that does not exist, below which nothing
does), and one listing of everything below the output when it exists and is no job's folder yet. On an object
store each listing is one round trip (or one per thousand keys).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Iterable, Literal

from fsspec import AbstractFileSystem

from shardline.errors import OutputInUse

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

_MARKERS = frozenset(name for names in JOB_FOLDER_FILES.values() for name in names)


@dataclass(frozen=True)
class JobFolderOverlap:
    """Another job's output folder that an output ``is`` (a job of the other kind's), lies ``inside``, or
    ``holds``; ``folder`` is named as the output is (a URL, or a path)."""

    relation: Literal["is", "inside", "holds"]
    folder: str
    kind: JobKind


def _kind_marked(names: Iterable[str]) -> JobKind | None:
    """The kind of job a folder holding ``names`` (its entries' names) is the output of; None when no job's."""
    present = set(names)
    for kind, marks in JOB_FOLDER_FILES.items():
        if present.intersection(marks):
            return kind
    return None


def _names_in(fs: AbstractFileSystem, folder: str, below: str | None = None) -> set[str]:
    """The names of the entries of ``folder`` (one listing); none when it is not a folder or does not exist.

    Where listing it is refused (a folder one may pass through but not list; an object store's policy that lets
    one list only one's own prefix), the names that matter are probed one by one instead: the markers, seen only
    where they may be read, and ``below`` (the next folder down to the output), taken as there unless it is seen
    not to be.
    """
    try:
        entries = fs.ls(folder, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return set()
    except PermissionError:
        names = {name for name in _MARKERS if _probe(fs, posixpath.join(folder, name)) is True}
        return names | ({below} if below is not None and _probe(fs, posixpath.join(folder, below)) is not False
                        else set())
    here = folder.rstrip("/")
    return {posixpath.basename(e.rstrip("/")) for e in entries if e.rstrip("/") != here}  # a file lists itself


def _probe(fs: AbstractFileSystem, path: str) -> bool | None:
    """Whether ``path`` exists; None when that may not be known (reading it is refused)."""
    try:
        return bool(fs.exists(path))
    except PermissionError:
        return None


def _folders_above(root: str) -> list[str]:
    """Every folder above ``root``, the topmost (``/``, a bucket) first."""
    chain: list[str] = []
    path = root.rstrip("/")
    while True:
        up = posixpath.dirname(path)
        if up == path or not up:
            return chain[::-1]
        chain.append(up)
        path = up


def _job_folders_below(fs: AbstractFileSystem, root: str) -> dict[str, set[str]]:
    """The job folders below ``root`` (one listing of everything under it), with the markers each holds.

    A folder whose name begins with ``_`` is a job's own (its ledger, staging, lease) and is never looked into:
    readers skip such folders, and a job's staging may hold a file named like a marker.
    """
    found: dict[str, set[str]] = {}
    base = root.rstrip("/")
    for path in fs.find(root, withdirs=True):
        parts = posixpath.relpath(path.rstrip("/"), base).split("/")
        for depth, name in enumerate(parts):
            if name.startswith("_"):
                if depth > 0 and name in _MARKERS:
                    found.setdefault(posixpath.join(base, *parts[:depth]), set()).add(name)
                break
    return found


def job_folder_overlap(fs: AbstractFileSystem, root: str, uri: str, kind: JobKind) -> JobFolderOverlap | None:
    """Another job's output folder that the output ``root`` (of a job of ``kind``, named ``uri``) is, lies inside
    or holds; None when there is none. A folder of this same kind of job is this job's own (a re-run, a resume):
    what it holds below was refused when it was made (its output would have lain inside this one).

    Storage calls: one listing per folder from the top down to ``root`` (none below a folder that does not exist),
    and when ``root`` exists and is no job's folder, one listing of everything below it.
    """
    named = (lambda path: str(fs.unstrip_protocol(path))) if "://" in uri else (lambda path: path)
    fs.invalidate_cache(root)  # a cached listing misses a job begun since (s3fs drops the folders above too)
    chain = _folders_above(root)
    for folder, below in zip(chain, [*chain[1:], root.rstrip("/")]):
        names = _names_in(fs, folder, posixpath.basename(below))
        outer = _kind_marked(names)
        if outer is not None:
            return JobFolderOverlap("inside", named(folder), outer)
        if posixpath.basename(below) not in names:
            return None  # nothing below a folder that does not exist
    names = _names_in(fs, root)
    if not names:
        return None
    own = _kind_marked(names)
    if own is not None:
        return JobFolderOverlap("is", uri, own) if own != kind else None
    inner = _job_folders_below(fs, root)
    if not inner:
        return None
    nearest = min(inner, key=lambda folder: (folder.count("/"), folder))
    return JobFolderOverlap("holds", named(nearest), _kind_marked(inner[nearest]) or kind)


def refuse_job_folder_overlap(fs: AbstractFileSystem, root: str, uri: str, kind: JobKind) -> None:
    """Refuse an output (``root``, named ``uri``, for a job of ``kind``) that is the other kind of job's output
    folder, lies inside any job's, or holds one: the two jobs' files would mix, and the outer folder's readers
    would read the inner job's files as its own.

    Raises:
        OutputInUse: naming the other job's folder, what marks it, and what to do.
    """
    overlap = job_folder_overlap(fs, root, uri, kind)
    if overlap is None:
        return
    other, marks = overlap.kind, WHAT_MARKS[overlap.kind]
    if overlap.relation == "is":
        message = (f"the output {uri} is a `{other}` job's output folder ({marks}); two jobs' files in one folder "
                   "would mix them: choose another --output")
    elif overlap.relation == "inside":
        message = (f"the output {uri} is inside {overlap.folder}, another job's output folder (a `{other}` job's: "
                   f"it holds {marks}), whose readers would read this job's files as its own: choose an --output "
                   "outside it")
    else:
        message = (f"the output {uri} holds {overlap.folder}, another job's output folder (a `{other}` job's: it "
                   f"holds {marks}); this job's readers would read that job's files as its own: choose an --output "
                   "that holds no other job's folder, or move that folder out of it")
    raise OutputInUse(message, uri, None)
