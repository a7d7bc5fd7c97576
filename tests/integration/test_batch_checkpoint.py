"""A large shard is checkpointed by row-group ranges: a worker killed halfway costs one range."""

from __future__ import annotations

import pickle
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import fsspec
import pyarrow.parquet as pq
import pytest

from shardline.build.examples import write_shards
from shardline.runtimes import RuntimeOptions
from shardline.storage import scoring
from shardline.storage.checkpoint import CHECKPOINTS
from shardline.storage.job_identity import job_key
from shardline.storage.output import OutputLayout
from shardline.storage.registry import ModelRegistry
from shardline.storage.retry import RetryPolicy
from shardline.storage.scoring import ScoringJob, score_shard
from shardline.storage.shards import list_shards

from tests.conftest import BuiltModel
from tests.fakes.flaky_store import FlakyMemoryFileSystem

KILL_AFTER = 7
CHILD = textwrap.dedent(
    """
    import os, pickle, signal, sys
    from shardline.storage import checkpoint
    from shardline.storage.scoring import score_shard

    job, shard, kill_after = pickle.loads(open(sys.argv[1], "rb").read())
    finish = checkpoint.ShardCheckpoint.finish

    def finish_then_die(self, *args):
        finish(self, *args)  # the range is saved in the checkpoint...
        if len(self.done) == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # ...and the worker is gone, no notice

    checkpoint.ShardCheckpoint.finish = finish_then_die
    score_shard(job, shard)
    """
)


@pytest.fixture
def big_shard(tmp_path: Path) -> Path:
    """One shard of 40,000 rows in 20 row groups."""
    return write_shards(tmp_path / "input", 1, 40_000, row_group_rows=2_000)[0]


@pytest.fixture
def job(breast_cancer_model: BuiltModel, tmp_path: Path) -> ScoringJob:
    registry = ModelRegistry(str(tmp_path / "registry"))
    registry.push(breast_cancer_model.bundle_dir)
    model = registry.resolve("breast-cancer:1")
    return ScoringJob(
        job_key=job_key(model.outputs_digest, None), model=model, output_uri=str(tmp_path / "out"), passthrough=None,
        batch_rows=1_000, cache_dir=str(tmp_path / "cache"), runtime=RuntimeOptions("cpu", 1),
        checkpoint_bytes=1,  # every row group is a range of its own
    )


def test_killed_midway_resumes_from_the_last_finished_range(
    job: ScoringJob, big_shard: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shard = list_shards(str(big_shard))[0]
    blob = tmp_path / "job.pkl"
    blob.write_bytes(pickle.dumps((job, shard, KILL_AFTER)))
    script = tmp_path / "child.py"
    script.write_text(CHILD)

    child = subprocess.run([sys.executable, str(script), str(blob)], capture_output=True, timeout=120)

    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    layout = OutputLayout(job.output_uri)
    assert layout.present_parts() == set() and layout.read_ledger() == {}  # nothing half-written is visible
    assert (Path(layout.staging_dir) / CHECKPOINTS / f"{shard.relative}.json").exists()

    scored_groups: list[int] = []
    score_into = scoring._score_into

    def spy(job, shard, opened, out, path, row_groups, *rest):  # type: ignore[no-untyped-def]
        scored_groups.extend(row_groups or range(opened.parquet.metadata.num_row_groups))
        return score_into(job, shard, opened, out, path, row_groups, *rest)

    monkeypatch.setattr(scoring, "_score_into", spy)
    record = score_shard(job, shard)

    assert record.status == "committed" and (record.ranges, record.ranges_resumed) == (20, KILL_AFTER)
    assert scored_groups == list(range(KILL_AFTER, 20))  # only the unfinished ranges ran the model
    assert record.rows_in == record.rows_out == 40_000
    monkeypatch.undo()

    # the part is exactly what one uninterrupted pass writes
    whole = score_shard(replace(job, output_uri=str(tmp_path / "whole"), checkpoint_bytes=1 << 40), shard)
    assert whole.ranges == 1
    resumed_part = pq.read_table(record.part.removeprefix("file://"))
    assert resumed_part.equals(pq.read_table(whole.part.removeprefix("file://")))
    assert resumed_part.column("id").to_pylist() == pq.read_table(big_shard).column("id").to_pylist()
    # ... and encoded as it: the label as a dictionary; the probabilities and the carried ids as plain values
    assembled, single = (_dictionary_encoded(r.part.removeprefix("file://")) for r in (record, whole))
    assert assembled == single == {"label"}
    assert not (Path(layout.staging_dir) / CHECKPOINTS / f"{shard.relative}.json").exists()
    assert not list((Path(layout.staging_dir) / CHECKPOINTS).rglob("*.parquet"))


def _dictionary_encoded(path: str) -> set[str]:
    """The columns of a Parquet file whose first row group is dictionary-encoded."""
    group = pq.ParquetFile(path).metadata.row_group(0)
    return {group.column(i).path_in_schema.split(".")[0] for i in range(group.num_columns)
            if {"PLAIN_DICTIONARY", "RLE_DICTIONARY"} & set(group.column(i).encodings)}


def test_a_stale_checkpoint_is_not_trusted(job: ScoringJob, big_shard: Path) -> None:
    """A checkpoint of another model (job key) is dropped with its chunks, and every range runs."""
    shard = list_shards(str(big_shard))[0]
    other = replace(job, job_key="another-model")
    from shardline.storage.checkpoint import ShardCheckpoint, plan_ranges, row_group_sizes

    ranges = plan_ranges(row_group_sizes(pq.ParquetFile(big_shard).metadata), 1)
    stale = ShardCheckpoint(OutputLayout(job.output_uri), shard, other.job_key, ranges)
    chunk = stale.new_chunk_path(0, 1)
    pq.write_table(pq.read_table(big_shard).slice(0, 10), chunk)
    stale.finish(0, 1, 10, 10, chunk)

    record = score_shard(job, shard)

    assert record.ranges_resumed == 0 and record.rows_out == 40_000
    assert not Path(chunk).exists()


@pytest.fixture
def flaky_memory() -> Iterator[type[FlakyMemoryFileSystem]]:
    """``memory://`` served by the flaky store for one test."""
    from fsspec.implementations.memory import MemoryFileSystem

    fsspec.register_implementation("memory", FlakyMemoryFileSystem, clobber=True)
    FlakyMemoryFileSystem.clear_instance_cache()
    try:
        yield FlakyMemoryFileSystem
    finally:
        FlakyMemoryFileSystem.failures.clear()
        FlakyMemoryFileSystem.injected.clear()
        FlakyMemoryFileSystem.store.clear()
        FlakyMemoryFileSystem.pseudo_dirs[:] = [""]
        fsspec.register_implementation("memory", MemoryFileSystem, clobber=True)
        MemoryFileSystem.clear_instance_cache()


def test_a_transient_store_error_midway_is_retried_from_the_checkpoint(
    job: ScoringJob, big_shard: Path, flaky_memory: type[FlakyMemoryFileSystem]
) -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe("/in/big.parquet", big_shard.read_bytes())
    shard = list_shards("memory://in")[0]
    flaky_memory.failures.append(".chunks/rg000003-000004")  # the 4th range's chunk: after 3 are checkpointed
    flaky = replace(job, output_uri="memory://out", retry=RetryPolicy(attempts=2, base_s=0.01, cap_s=0.02))

    record = score_shard(flaky, shard)

    assert len(flaky_memory.injected) == 1  # the store did fail once, midway
    assert record.status == "committed" and (record.ranges, record.ranges_resumed) == (20, 3)
    with fs.open("/out/big.parquet", "rb") as part:
        scored = pq.read_table(part)
    assert scored.num_rows == 40_000 and scored.column("id").to_pylist() == pq.read_table(big_shard).column("id").to_pylist()
    assert not [p for p in fs.find("/out") if "/_staging/" in p]  # chunks and checkpoint are gone
