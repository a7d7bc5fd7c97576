"""Whether an output is, lies inside, or holds another job's output folder (storage/job_folders.py), on an
in-memory file system and on local disk, and how many storage calls telling it takes.

The commands' side (one line, exit 2, no flow run) is tests/e2e/test_cli_user_errors.py; on S3,
tests/integration/test_s3.py.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from shardline.errors import OutputInUse
from shardline.storage.job_folders import JobFolderOverlap, JobKind, job_folder_overlap, refuse_job_folder_overlap

MARKERS = {"batch run": ("_manifest.json", "_ledger/part-0.parquet.json"),
           "batch openai": ("_job.json", "_parts/00000.jsonl")}


class CountingMemory(MemoryFileSystem):
    """An in-memory file system that records the storage calls made on it (each a round trip, or one paginated
    listing, on an object store); not the calls its own methods make inside one."""

    calls: list[str]
    unlistable: set[str]  # folders whose listing is refused, as a bucket policy scoped to one prefix refuses
    depth = 0

    def _count(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        if self.depth == 0:
            self.calls.append(f"{method} {path}")
            if method == "ls" and path in self.unlistable:
                raise PermissionError(f"listing {path} is not allowed")
        self.depth += 1
        try:
            return getattr(super(), method)(path, *args, **kwargs)
        finally:
            self.depth -= 1

    def ls(self, path: str, *args: Any, **kwargs: Any) -> Any:
        return self._count("ls", path, *args, **kwargs)

    def find(self, path: str, *args: Any, **kwargs: Any) -> Any:
        return self._count("find", path, *args, **kwargs)

    def info(self, path: str, *args: Any, **kwargs: Any) -> Any:
        return self._count("info", path, *args, **kwargs)

    def exists(self, path: str, *args: Any, **kwargs: Any) -> Any:
        return self._count("exists", path, *args, **kwargs)


@pytest.fixture
def memory() -> tuple[CountingMemory, str]:
    fs = CountingMemory(skip_instance_cache=True)
    fs.calls, fs.unlistable = [], set()
    return fs, f"/jobs-{uuid.uuid4().hex[:8]}"


def job(fs: Any, folder: str, kind: str) -> None:
    for name in MARKERS[kind]:
        fs.makedirs(f"{folder}/{name}".rsplit("/", 1)[0], exist_ok=True)
        fs.pipe(f"{folder}/{name}", b"{}")


@pytest.mark.parametrize("kind", ["batch run", "batch openai"])
def test_an_output_inside_or_holding_a_job_folder_of_either_kind_is_told_naming_that_folder(
    memory: tuple[CountingMemory, str], kind: JobKind
) -> None:
    fs, base = memory
    job(fs, f"{base}/a/scored", kind)
    told = [(f"{base}/a/scored/more/out", JobFolderOverlap("inside", f"{base}/a/scored", kind)),
            (f"{base}/a", JobFolderOverlap("holds", f"{base}/a/scored", kind)),
            (base, JobFolderOverlap("holds", f"{base}/a/scored", kind))]
    for output, overlap in told:
        assert job_folder_overlap(fs, output, output, "batch run") == overlap
        assert job_folder_overlap(fs, output, output, "batch openai") == overlap
    assert job_folder_overlap(fs, f"{base}/b/out", f"{base}/b/out", "batch run") is None


def test_the_other_kinds_folder_is_refused_and_a_folder_of_the_same_kind_is_the_jobs_own(
    memory: tuple[CountingMemory, str],
) -> None:
    fs, base = memory
    job(fs, f"{base}/scored", "batch run")
    job(fs, f"{base}/answers", "batch openai")
    assert job_folder_overlap(fs, f"{base}/scored", f"{base}/scored", "batch run") is None
    assert job_folder_overlap(fs, f"{base}/answers", f"{base}/answers", "batch openai") is None
    assert job_folder_overlap(fs, f"{base}/scored", f"{base}/scored", "batch openai") == JobFolderOverlap(
        "is", f"{base}/scored", "batch run")
    assert job_folder_overlap(fs, f"{base}/answers", f"{base}/answers", "batch run") == JobFolderOverlap(
        "is", f"{base}/answers", "batch openai")


def test_a_jobs_own_underscore_folders_are_not_other_jobs(memory: tuple[CountingMemory, str]) -> None:
    # a job's staging may hold a file named like a marker (its manifest, staged); readers skip '_' folders
    fs, base = memory
    out = f"{base}/out"
    fs.pipe(f"{out}/_staging/0123abcd/_manifest.json", b"{}")
    fs.pipe(f"{out}/_lease/0000000001.json", b"{}")
    fs.pipe(f"{out}/part-00000.parquet", b"PAR1")
    assert job_folder_overlap(fs, out, out, "batch run") is None
    assert job_folder_overlap(fs, base, base, "batch run") is None


def test_the_nearest_held_folder_is_named_with_the_outputs_url(memory: tuple[CountingMemory, str]) -> None:
    fs, base = memory
    job(fs, f"{base}/x/y/deep", "batch run")
    job(fs, f"{base}/z/answers", "batch openai")
    with pytest.raises(OutputInUse) as refused:
        refuse_job_folder_overlap(fs, base, f"memory://{base}", "batch run")
    assert str(refused.value) == (
        f"the output memory://{base} holds memory://{base}/z/answers, another job's output folder (a `batch openai` "
        "job's: it holds its _job.json or _parts); this job's readers would read that job's files as its own: "
        "choose an --output that holds no other job's folder, or move that folder out of it")


def test_a_new_output_takes_one_listing_per_folder_that_exists_above_it(memory: tuple[CountingMemory, str]) -> None:
    # each listing is one round trip on an object store; probing each marker by name took 8 per folder on S3
    fs, base = memory
    job(fs, f"{base}/a/scored", "batch run")
    fs.calls.clear()
    assert job_folder_overlap(fs, f"{base}/new/deeper/out", f"{base}/new/deeper/out", "batch run") is None
    assert fs.calls == ["ls /", f"ls {base}"]  # no 'new' in the listing of base: nothing below it exists

    fs.calls.clear()
    assert job_folder_overlap(fs, f"{base}/a/scored/x", f"{base}/a/scored/x", "batch run") is not None
    assert fs.calls == ["ls /", f"ls {base}", f"ls {base}/a", f"ls {base}/a/scored"]

    fs.calls.clear()  # an existing folder that is no job's: one listing of everything below it too
    assert job_folder_overlap(fs, f"{base}/a", f"{base}/a", "batch run") is not None
    assert fs.calls == ["ls /", f"ls {base}", f"ls {base}/a", f"find {base}/a"]

    fs.calls.clear()  # the job's own folder (a re-run): nothing below it is listed
    assert job_folder_overlap(fs, f"{base}/a/scored", f"{base}/a/scored", "batch run") is None
    assert fs.calls == ["ls /", f"ls {base}", f"ls {base}/a", f"ls {base}/a/scored"]


def test_a_folder_whose_listing_is_refused_is_probed_by_name(memory: tuple[CountingMemory, str]) -> None:
    # a folder one may pass through but not list (mode 711; a policy letting a tenant list only its own prefix)
    fs, base = memory
    job(fs, f"{base}/a/scored", "batch openai")
    fs.unlistable = {"/", base, f"{base}/a/scored"}
    assert job_folder_overlap(fs, f"{base}/a/scored/more", f"{base}/a/scored/more", "batch run") == \
        JobFolderOverlap("inside", f"{base}/a/scored", "batch openai")
    assert job_folder_overlap(fs, f"{base}/a", f"{base}/a", "batch run") == \
        JobFolderOverlap("holds", f"{base}/a/scored", "batch openai")
    assert job_folder_overlap(fs, f"{base}/b/out", f"{base}/b/out", "batch run") is None


def test_on_local_disk_a_file_above_the_output_or_a_missing_folder_is_no_job(tmp_path: Path) -> None:
    local = fsspec.filesystem("file")
    (tmp_path / "a-file").write_bytes(b"x")
    job(local, str(tmp_path / "scored"), "batch run")
    assert job_folder_overlap(local, str(tmp_path / "a-file" / "out"), str(tmp_path / "a-file" / "out"),
                              "batch run") is None
    assert job_folder_overlap(local, str(tmp_path / "nowhere" / "out"), str(tmp_path / "nowhere" / "out"),
                              "batch run") is None
    assert job_folder_overlap(local, str(tmp_path), str(tmp_path), "batch openai") == JobFolderOverlap(
        "holds", str(tmp_path / "scored"), "batch run")
