"""Parquet shards on fsspec: list them, read their footers, read them in bounded batches."""

from __future__ import annotations

import posixpath
import queue
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from shardline.errors import CorruptShard, EmptyInput, InvalidSetting
from shardline.storage.fs import fingerprint, open_fs
from shardline.storage.retry import is_transient


@dataclass(frozen=True)
class ShardInfo:
    """One input file: its URL, its path under the input root, and a fingerprint of its bytes."""

    uri: str
    relative: str
    size: int
    fingerprint: str


@dataclass(frozen=True)
class Footer:
    """What a Parquet footer tells without reading data."""

    schema: pa.Schema
    num_rows: int
    num_row_groups: int


def _hidden(relative: str) -> bool:
    return any(part.startswith(("_", ".")) for part in relative.split("/"))


def list_shards(
    input_uri: str,
    storage_options: dict[str, Any] | None = None,
    suffixes: Sequence[str] = (".parquet", ".pq"),
) -> list[ShardInfo]:
    """Every shard under a folder (recursively), or the single file named, sorted by path.

    Names starting with '_' or '.' are skipped, as Spark and pyarrow do.

    Raises:
        InvalidSetting: the location does not exist.
        EmptyInput: it holds no file with one of ``suffixes``.
    """
    fs, root = open_fs(input_uri, storage_options)
    fs.invalidate_cache(root)  # a long-lived process must see the input as it is now
    try:
        info = fs.info(root)
    except FileNotFoundError as e:
        raise InvalidSetting(
            f"the input {input_uri!r} does not exist; check the path (and the bucket's "
            "endpoint and credentials for s3://)"
        ) from e
    if info["type"] == "file":
        entries = {root: info}
        base = posixpath.dirname(root)
    else:
        entries = fs.find(root, detail=True)
        base = root
    shards = []
    for path, entry in sorted(entries.items()):
        relative = posixpath.relpath(path, base) if base else path
        if entry.get("type") == "file" and path.endswith(tuple(suffixes)) and not _hidden(relative):
            shards.append(ShardInfo(fs.unstrip_protocol(path), relative, int(entry["size"]), fingerprint(entry)))
    if not shards:
        raise EmptyInput(
            f"the input {input_uri!r} holds no shard (no file ending in {', '.join(suffixes)}); "
            "point --input at the folder of Parquet files"
        )
    return shards


def read_footer(uri: str, storage_options: dict[str, Any] | None = None) -> Footer:
    """Schema and row counts of a shard, from its footer alone.

    Raises:
        CorruptShard: the file is not readable Parquet.
    """
    fs, path = open_fs(uri, storage_options)
    try:
        with fs.open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
            return Footer(meta.schema.to_arrow_schema(), meta.num_rows, meta.num_row_groups)
    except (pa.ArrowException, OSError, ValueError) as e:
        if is_transient(e):
            raise
        raise CorruptShard(f"{uri} is not a readable Parquet file ({e}); re-export it") from e


def iter_batches(
    parquet: pq.ParquetFile,
    columns: list[str],
    batch_rows: int,
    prefetch: int = 1,
    row_groups: Sequence[int] | None = None,
) -> Iterator[pa.RecordBatch]:
    """Record batches of at most ``batch_rows`` rows, read ``prefetch`` ahead on a thread.

    Reading ahead lets decompression overlap the caller's work (both release the GIL)
    while memory stays bounded by ``(prefetch + 1) * batch_rows`` rows. ``row_groups``
    reads only those row groups (a checkpointed range); None reads them all.
    """
    source = parquet.iter_batches(
        batch_size=batch_rows, columns=columns, use_threads=False,
        row_groups=list(row_groups) if row_groups is not None else None,
    )
    if prefetch < 1:
        yield from source
        return
    box: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=prefetch)
    stop = threading.Event()

    def produce() -> None:
        try:
            for batch in source:
                if stop.is_set():
                    return
                box.put(("batch", batch))
            box.put(("end", None))
        except BaseException as e:  # handed to the consumer, re-raised there
            box.put(("error", e))

    reader = threading.Thread(target=produce, name="shard-reader", daemon=True)
    reader.start()
    try:
        while True:
            kind, item = box.get()
            if kind == "end":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        stop.set()
        while reader.is_alive():
            try:
                box.get(timeout=0.05)
            except queue.Empty:
                pass
