"""Score one shard: the work a Dask worker does. It needs no Prefect.

Read the shard in bounded batches, check them, predict, write the part to staging,
commit it atomically and record it in the ledger. A shard whose data is bad is
quarantined (a ledger record with the reason, no part); any other failure raises,
leaves nothing visible, and is scored again by the next run.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Generator

import pyarrow as pa
import pyarrow.parquet as pq

from shardline.errors import CorruptShard, InvalidInput, NullValues, SchemaMismatch
from shardline.runtimes import RuntimeOptions
from shardline.signature import Signature, schema_problems
from shardline.storage.fs import commit_file, ensure_dir, open_fs, staging_path
from shardline.storage.model_cache import get_model_cache
from shardline.storage.output import OutputLayout, PartRecord
from shardline.storage.registry import ResolvedModel
from shardline.storage.shards import ShardInfo, iter_batches, read_footer

# Errors of the network or the store itself: not the shard's fault, so not quarantined.
TRANSIENT = (ConnectionError, TimeoutError)


@dataclass(frozen=True)
class ScoringJob:
    """What every shard of one job shares; small enough to ship to each worker.

    ``passthrough`` None keeps every input column the model does not read (ids and
    such), so each output part joins back to its shard.
    """

    job_key: str
    model: ResolvedModel
    output_uri: str
    passthrough: tuple[str, ...] | None
    batch_rows: int
    cache_dir: str
    cache_capacity: int = 4
    runtime: RuntimeOptions = RuntimeOptions()
    storage_options: dict[str, Any] = field(default_factory=dict)


def _reject_nulls(batch: pa.RecordBatch, signature: Signature, model: str) -> None:
    nulls = {
        c.name: batch.column(c.name).null_count
        for c in signature.inputs
        if not c.nullable and batch.column(c.name).null_count
    }
    if nulls:
        raise NullValues(
            f"columns {sorted(nulls)} hold nulls ({nulls} in one batch) where the model "
            f"{model!r} needs values; fill or drop those rows and re-run",
            nulls,
        )


def carried_columns(job: ScoringJob, schema: pa.Schema) -> list[str]:
    """The input columns copied to the output for this shard."""
    if job.passthrough is not None:
        return list(job.passthrough)
    inputs = set(job.model.manifest.signature.input_names)
    outputs = set(job.model.manifest.signature.output_names)
    return [n for n in schema.names if n not in inputs and n not in outputs]


def _check_schema(schema: pa.Schema, job: ScoringJob, carried: list[str]) -> None:
    problems = schema_problems(schema, job.model.manifest.signature.inputs, job.model.pinned)
    missing = [c for c in carried if schema.get_field_index(c) < 0]
    if missing:
        problems.append(f"passthrough columns {missing} are not in the shard")
    if problems:
        raise SchemaMismatch("; ".join(problems), problems)


def output_schema(job: ScoringJob, input_schema: pa.Schema, carried: list[str]) -> pa.Schema:
    """Passthrough columns (as they are in the input) followed by the model's outputs."""
    fields = [input_schema.field(c) for c in carried]
    outputs = list(job.model.manifest.signature.output_schema())
    clashing = {f.name for f in fields} & {f.name for f in outputs}
    if clashing:
        raise InvalidInput(
            f"passthrough columns {sorted(clashing)} have the names of model outputs; "
            "rename them or leave them out of --passthrough"
        )
    return pa.schema(fields + outputs)


class PartWriter:
    """Writes record batches to a Parquet file on a background thread, one batch in flight.

    Scoring the next batch overlaps writing this one. On exit the batch in flight is
    always finished before the writer closes (closing under a running write crashes
    pyarrow), and a write error is raised unless another error is already on its way.
    """

    def __init__(self, fs: Any, path: str, schema: pa.Schema) -> None:
        self._sink = fs.open(path, "wb")
        self._writer = pq.ParquetWriter(self._sink, schema)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="part-writer")
        self._pending: Future[None] | None = None

    def write(self, batch: pa.RecordBatch) -> None:
        """Queue a batch behind the one in flight."""
        if self._pending is not None:
            self._pending.result()
        self._pending = self._pool.submit(self._writer.write_batch, batch)

    def __enter__(self) -> "PartWriter":
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        try:
            if self._pending is not None:
                wait([self._pending])
                if kind is None:
                    self._pending.result()
        finally:
            self._pool.shutdown(wait=True)
            try:
                self._writer.close()
            finally:
                self._sink.close()


def _write_part(job: ScoringJob, shard: ShardInfo, staged: str) -> tuple[int, int]:
    """Score a shard into the staged file; returns (rows in, rows out)."""
    model = get_model_cache(job.cache_dir, job.cache_capacity).get(job.model, job.runtime, job.storage_options)
    signature = job.model.manifest.signature
    in_fs, in_path = open_fs(shard.uri, job.storage_options)
    out = OutputLayout(job.output_uri, job.storage_options)
    rows_in = rows_out = 0
    try:
        source = in_fs.open(in_path, "rb")
        # pre_buffer (pyarrow's default) would read every row group's column chunks up
        # front, so a worker's memory would grow with the shard's size.
        parquet = pq.ParquetFile(source, pre_buffer=False)
    except (pa.ArrowException, OSError, ValueError) as e:
        if isinstance(e, TRANSIENT):
            raise
        raise CorruptShard(f"{shard.uri} is not a readable Parquet file ({e}); re-export it") from e
    with source:
        schema = parquet.schema_arrow
        carried = carried_columns(job, schema)
        _check_schema(schema, job, carried)
        columns = list(dict.fromkeys([*carried, *signature.input_names]))
        target = output_schema(job, schema, carried)
        batches = _read(parquet, columns, job.batch_rows, shard)
        # closing(): the read-ahead thread stops before the source file closes, even
        # when a check below raises while the generator is suspended.
        with contextlib.closing(batches), PartWriter(out.fs, staged, target) as part:
            for batch in batches:
                _reject_nulls(batch, signature, job.model.pinned)
                predicted = model.predict(batch)
                scored = pa.RecordBatch.from_arrays([batch.column(c) for c in carried] + predicted.columns, schema=target)
                part.write(scored)
                rows_in += batch.num_rows
                rows_out += scored.num_rows
    return rows_in, rows_out


def _read(parquet: pq.ParquetFile, columns: list[str], batch_rows: int, shard: ShardInfo) -> Generator[pa.RecordBatch, None, None]:
    try:
        yield from iter_batches(parquet, columns, batch_rows)
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, TRANSIENT):
            raise
        raise CorruptShard(f"{shard.uri} has data that cannot be read ({e}); re-export it") from e


def score_shard(job: ScoringJob, shard: ShardInfo) -> PartRecord:
    """Score one shard into its part, or quarantine it; returns its ledger record.

    Raises:
        Exception: anything that is not the shard's fault (storage down, model
            missing). Nothing is committed then, and a re-run scores the shard again.
    """
    started = time.perf_counter()
    out = OutputLayout(job.output_uri, job.storage_options)
    final = out.part_path(shard.relative)
    ensure_dir(out.fs, out.staging_dir)
    staged = staging_path(final, out.staging_dir)
    try:
        rows_in, rows_out = _write_part(job, shard, staged)
    except InvalidInput as e:
        if out.fs.exists(staged):
            out.fs.rm(staged)
        record = PartRecord(
            shard=shard.uri,
            relative=shard.relative,
            fingerprint=shard.fingerprint,
            job_key=job.job_key,
            status="quarantined",
            rows_in=_row_count(shard, job),
            rows_quarantined=_row_count(shard, job) or 0,
            reason=f"{type(e).__name__}: {e}",
            seconds=time.perf_counter() - started,
        )
        out.record(record)
        return record
    except BaseException:
        if out.fs.exists(staged):
            out.fs.rm(staged)
        raise
    commit_file(out.fs, staged, final)
    record = PartRecord(
        shard=shard.uri,
        relative=shard.relative,
        fingerprint=shard.fingerprint,
        job_key=job.job_key,
        status="committed",
        part=out.fs.unstrip_protocol(final),
        rows_in=rows_in,
        rows_out=rows_out,
        seconds=time.perf_counter() - started,
    )
    out.record(record)
    return record


def _row_count(shard: ShardInfo, job: ScoringJob) -> int | None:
    """Rows the footer declares, or None when even the footer is unreadable."""
    try:
        return read_footer(shard.uri, job.storage_options).num_rows
    except (CorruptShard, OSError):
        return None
