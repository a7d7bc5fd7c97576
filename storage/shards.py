"""Parquet shards on fsspec: list them, read their footers, read them in bounded batches."""

from __future__ import annotations

import contextlib
import os
import posixpath
import queue
import threading
from concurrent.futures import wait
from dataclasses import dataclass
from typing import Any, Generator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem

from shardline.errors import CorruptShard, EmptyInput, InvalidSetting
from shardline.locations import is_within
from shardline.storage.fs import fingerprint, io_threads, open_fs
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
    link_roots: Sequence[str] | None = None,
) -> list[ShardInfo]:
    """Every shard under a folder (recursively), or the single file named, sorted by path.

    Names starting with '_' or '.' are skipped, as Spark and pyarrow do. Symbolic links
    (local storage: data versioning tools such as DVC make folders of them) are followed
    to files and folders: a shard is read from the link's real target, which gives its
    fingerprint (a changed target is scored again), under the link's own name (which
    names its part and must end with a suffix). With ``link_roots`` (resolved locations:
    a tenant's storage prefixes) every link must lead under one of them; None lets links
    lead anywhere (single-tenant mode).

    Raises:
        InvalidSetting: the location does not exist; a link leads outside ``link_roots``,
            nowhere (broken, or a loop of links) or back into a folder that holds it.
        EmptyInput: it holds no file with one of ``suffixes``.
    """
    fs, root = open_fs(input_uri, storage_options)
    fs.invalidate_cache(root)  # a long-lived process must see the input as it is now
    listing = _Listing(fs, tuple(suffixes), link_roots)
    try:
        info = fs.info(root)
        if info.get("islink"):  # the input itself is a link (a batch job's input comes resolved already)
            listing.vet(root, os.path.realpath(root))
            root = os.path.realpath(root)
            info = fs.info(root)
    except FileNotFoundError as e:
        raise InvalidSetting(
            f"the input {input_uri!r} does not exist; check the path (and the bucket's "
            "endpoint and credentials for s3://)"
        ) from e
    if info["type"] == "file":
        name = posixpath.basename(root)
        shards = [ShardInfo(fs.unstrip_protocol(root), name, int(info["size"]), fingerprint(info))]
        shards = shards if name.endswith(listing.suffixes) and not _hidden(name) else []
    else:
        shards = listing.folder(root)
    if not shards:
        raise EmptyInput(
            f"the input {input_uri!r} holds no shard (no file ending in {', '.join(suffixes)}); "
            "point --input at the folder of Parquet files"
        )
    return shards


class _Listing:
    """The shards under a folder, links followed (see ``list_shards``)."""

    def __init__(self, fs: AbstractFileSystem, suffixes: tuple[str, ...], link_roots: Sequence[str] | None) -> None:
        self.fs, self.suffixes, self.link_roots = fs, suffixes, link_roots

    def folder(self, root: str) -> list[ShardInfo]:
        shards: list[ShardInfo] = []
        pending: list[tuple[str, str, tuple[str, ...]]] = [(root, "", (os.path.realpath(root),))]
        while pending:  # (folder, its name under the input, the real folders on the way): no recursion
            folder, prefix, chain = pending.pop()
            for path, entry in self.fs.find(folder, detail=True).items():
                relative = posixpath.join(prefix, posixpath.relpath(path, folder))
                if _hidden(relative):
                    continue
                if entry.get("islink"):  # only local storage has links
                    entry = self._link(path, relative, chain, pending)
                    if entry is None:
                        continue
                    path = entry["name"]
                if entry.get("type") == "file" and relative.endswith(self.suffixes):
                    shards.append(ShardInfo(self.fs.unstrip_protocol(path), relative, int(entry["size"]),
                                            fingerprint(entry)))
        return sorted(shards, key=lambda s: s.relative)

    def _link(
        self, path: str, relative: str, chain: tuple[str, ...], pending: list[tuple[str, str, tuple[str, ...]]]
    ) -> dict[str, Any] | None:
        """The target file's entry (named by its real path); a target folder is queued, None returned."""
        target = os.path.realpath(path)
        if os.path.isdir(target):
            self.vet(path, target)
            # A loop: the target holds the link, or a folder this walk came through (the check is exact:
            # every step into a folder through a link is checked, and fs.find itself follows none).
            if any(is_within(folder, target) for folder in (*chain, os.path.realpath(posixpath.dirname(path)))):
                raise InvalidSetting(
                    f"the link {path!r} in the input leads back to {target!r}, a folder that holds it (a loop); "
                    "remove the link or point it at the data itself"
                )
            pending.append((target, relative, (*chain, target)))
            return None
        if not relative.endswith(self.suffixes):
            return None  # not a shard, whatever it is
        if not os.path.isfile(target):
            raise InvalidSetting(
                f"the link {path!r} in the input leads to {target!r}, which is not a file (a broken link, or "
                "a loop of links); restore its target (e.g. `dvc checkout`) or remove the link"
            )
        self.vet(path, target)
        entry: dict[str, Any] = self.fs.info(target)
        return entry

    def vet(self, path: str, target: str) -> None:
        """Refuse a link whose real target is outside ``link_roots``."""
        if self.link_roots is None or any(is_within(target, root) for root in self.link_roots):
            return
        raise InvalidSetting(
            f"the link {path!r} in the input leads to {target!r}, outside the tenant's storage prefixes "
            f"({', '.join(repr(r) for r in self.link_roots)}); a job reads only there: copy the data under a "
            "prefix, or point the link at a copy there"
        )


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


def dictionary_columns(schema: pa.Schema, carried: Sequence[str] = ()) -> list[str]:
    """The columns to write with Parquet dictionary encoding: those where it usually pays (a batch part's,
    a capture file's).

    Flat columns that are not floats (labels, names, times: few distinct values, or runs), but of the
    ``carried`` columns (a part's input columns passed through) only text and binary ones (categories).
    Not floats (probabilities, scores, embeddings: nearly every value distinct) nor carried integers (ids:
    every value distinct): pyarrow's default, a dictionary for every column, builds one per row group
    for those and falls back to plain values only past its 1 MiB page, which made writing a classifier's part
    2.4x slower and its file 1.3x larger (figures: bench/README.md, "Figures behind the code").
    """
    chosen = []
    for field in schema:
        kind = field.type
        if pa.types.is_floating(kind) or pa.types.is_nested(kind):  # (a nested column's path is not its name)
            continue
        if field.name in carried and not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                                          or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
                                          or pa.types.is_dictionary(kind)):
            continue
        chosen.append(field.name)
    return chosen


def iter_batches(
    parquet: pq.ParquetFile,
    columns: list[str],
    batch_rows: int,
    prefetch: int = 1,
    row_groups: Sequence[int] | None = None,
) -> Generator[pa.RecordBatch, None, None]:
    """Record batches of at most ``batch_rows`` rows, read ``prefetch`` ahead on a thread (the process's kept
    readers, ``io_threads("read")``).

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

    reader = io_threads("read").submit(produce)
    try:
        while True:
            kind, item = box.get()
            if kind == "end":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        stop.set()  # (stopped early: a reader blocked on the full queue is let go by the gets below)
        while not wait([reader], timeout=0.01).done:
            with contextlib.suppress(queue.Empty):
                box.get_nowait()
