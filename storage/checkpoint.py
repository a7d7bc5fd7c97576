"""Row-group checkpoints of a large shard: a lost worker redoes one range, not the file.

A shard larger than the checkpoint size is scored in ranges of whole row groups. Each
finished range is a chunk file under the output's staging folder, recorded in the
shard's checkpoint (a small JSON file, rewritten atomically after each range). A run
that finds a checkpoint for the same shard bytes, job and range plan scores only the
ranges it does not list. When every range is there, the chunks are copied into the
part (no inference again), the part is committed atomically, and the chunks go::

    _staging/checkpoints/<relative>.json          the shard's checkpoint
    _staging/checkpoints/<relative>.chunks/...    one Parquet file per finished range

Nothing here is visible to a reader of the output: names under ``_staging`` are
skipped, and the part appears whole or not at all.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import pyarrow.parquet as pq

from shardline.storage.fs import atomic_write_bytes, commit_file, ensure_dir, join, open_file, parent, staging_path
from shardline.storage.output import OutputLayout
from shardline.storage.shards import ShardInfo

CHECKPOINTS = "checkpoints"

RowGroupRange = tuple[int, int]


def plan_ranges(row_group_bytes: list[int], target_bytes: int) -> list[RowGroupRange]:
    """Half-open ranges ``[start, end)`` of consecutive row groups of about ``target_bytes`` each.

    A range closes once it holds ``target_bytes`` or more; a row group larger than the
    target is a range alone. A shard at or under the target is one range.
    """
    if target_bytes < 1:
        raise ValueError(f"target_bytes must be at least 1, got {target_bytes}")
    ranges: list[RowGroupRange] = []
    start, size = 0, 0
    for index, nbytes in enumerate(row_group_bytes):
        size += nbytes
        if size >= target_bytes:
            ranges.append((start, index + 1))
            start, size = index + 1, 0
    if start < len(row_group_bytes):
        ranges.append((start, len(row_group_bytes)))
    return ranges or [(0, 0)]


def row_group_sizes(metadata: pq.FileMetaData) -> list[int]:
    """Compressed bytes of each row group, from the footer."""
    sizes = []
    for i in range(metadata.num_row_groups):
        group = metadata.row_group(i)
        compressed = sum(group.column(c).total_compressed_size for c in range(group.num_columns))
        sizes.append(int(compressed or group.total_byte_size))
    return sizes


@dataclass
class RangeDone:
    """One finished range: its row groups, its rows and the chunk file holding its scores."""

    start: int
    end: int
    rows_in: int
    rows_out: int
    chunk: str


@dataclass
class ShardCheckpoint:
    """What is finished of one shard under one job; saved after every range."""

    layout: OutputLayout
    shard: ShardInfo
    job_key: str
    ranges: list[RowGroupRange]
    done: dict[RowGroupRange, RangeDone] = field(default_factory=dict)
    resumed: int = 0

    @property
    def path(self) -> str:
        """Where this shard's checkpoint file lives."""
        return join(self.layout.staging_dir, CHECKPOINTS, f"{self.shard.relative}.json")

    @property
    def chunk_dir(self) -> str:
        """The folder of this shard's chunk files."""
        return join(self.layout.staging_dir, CHECKPOINTS, f"{self.shard.relative}.chunks")

    @classmethod
    def load(cls, layout: OutputLayout, shard: ShardInfo, job_key: str, ranges: list[RowGroupRange]) -> ShardCheckpoint:
        """The shard's checkpoint when it was made for the same bytes, job and ranges; else a fresh one.

        A stale checkpoint (the shard changed, another model, another range size) is
        dropped with its chunks.
        """
        checkpoint = cls(layout, shard, job_key, ranges)
        fs = layout.fs
        if not fs.exists(checkpoint.path):
            return checkpoint
        saved = json.loads(fs.cat_file(checkpoint.path))
        same = (
            saved.get("job_key") == job_key
            and saved.get("fingerprint") == shard.fingerprint
            and [tuple(r) for r in saved.get("ranges", [])] == ranges
        )
        if not same:
            checkpoint.discard()
            return cls(layout, shard, job_key, ranges)
        for item in saved.get("done", []):
            done = RangeDone(**item)
            if fs.exists(join(checkpoint.chunk_dir, done.chunk)):
                checkpoint.done[(done.start, done.end)] = done
        checkpoint.resumed = len(checkpoint.done)
        return checkpoint

    def new_chunk_path(self, start: int, end: int) -> str:
        """A fresh name for a range's chunk (unique, so two runs of one shard never collide)."""
        ensure_dir(self.layout.fs, self.chunk_dir)
        return join(self.chunk_dir, f"rg{start:06d}-{end:06d}.{uuid.uuid4().hex[:8]}.parquet")

    def finish(self, start: int, end: int, rows_in: int, rows_out: int, chunk_path: str) -> None:
        """Record a range whose chunk is fully written, and save the checkpoint."""
        name = chunk_path.rsplit("/", 1)[-1]
        self.done[(start, end)] = RangeDone(start, end, rows_in, rows_out, name)
        self.save()

    def save(self) -> None:
        """Write the checkpoint atomically (the last writer wins)."""
        blob: dict[str, Any] = {
            "job_key": self.job_key,
            "fingerprint": self.shard.fingerprint,
            "ranges": [list(r) for r in self.ranges],
            "done": [d.__dict__ for d in sorted(self.done.values(), key=lambda d: d.start)],
        }
        atomic_write_bytes(self.layout.fs, self.path, json.dumps(blob).encode(), self.layout.staging_dir)

    @property
    def complete(self) -> bool:
        """Every range has its chunk."""
        return all(r in self.done for r in self.ranges)

    def rows(self) -> tuple[int, int]:
        """(rows in, rows out) over the finished ranges."""
        return sum(d.rows_in for d in self.done.values()), sum(d.rows_out for d in self.done.values())

    def assemble(self, final: str, dictionary: list[str]) -> None:
        """Copy the chunks, in row-group order, into the part and commit it atomically, with the
        ``dictionary`` columns dictionary-encoded (as the chunks were).

        Reads one record batch at a time, so memory stays bounded by a batch, not by
        the shard. No inference runs here.
        """
        fs = self.layout.fs
        staged = staging_path(final, self.layout.staging_dir)
        chunks = [join(self.chunk_dir, self.done[r].chunk) for r in self.ranges]
        try:
            with open_file(fs, chunks[0], "rb") as first:
                schema = pq.ParquetFile(first).schema_arrow
            with open_file(fs, staged, "wb") as sink, pq.ParquetWriter(sink, schema, use_dictionary=dictionary) as writer:
                for chunk in chunks:
                    with open_file(fs, chunk, "rb") as source:
                        for batch in pq.ParquetFile(source, pre_buffer=False).iter_batches():
                            writer.write_batch(batch)
        except BaseException:
            if fs.exists(staged):
                fs.rm(staged)
            raise
        ensure_dir(fs, parent(final))
        commit_file(fs, staged, final)

    def discard(self) -> None:
        """Remove the checkpoint and its chunks (after the part is committed, or when stale)."""
        fs = self.layout.fs
        if fs.exists(self.chunk_dir):
            fs.rm(self.chunk_dir, recursive=True)
        if fs.exists(self.path):
            fs.rm(self.path)
