"""Score one shard: the work a Dask worker does. It needs no Prefect.

Read the shard in bounded batches, check them, predict, write the part to staging,
commit it atomically and record it in the ledger. A shard whose data is bad is
quarantined (a ledger record with the reason, no part); a transient storage error is
retried with backoff; any other failure raises, leaves nothing visible, and is scored
again by the next run. A shard larger than ``checkpoint_bytes`` is scored in ranges of
row groups, each checkpointed (see ``checkpoint.py``), so a retry or a re-run resumes
from the last finished range.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Generator, Iterator, Sequence, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardline.arrays import MatrixScratch, arrow_array, decoded, decoded_type
from shardline.errors import (
    CorruptShard,
    DataContractFailed,
    InvalidInput,
    SchemaMismatch,
)
from shardline.rows import Rows, check_rows, schema_mismatch
from shardline.runtimes import RuntimeOptions
from shardline.runtimes.base import Answer, concat_answers, split_out_of_memory
from shardline.signature import Signature, casts_to_float, named_columns
from shardline.storage.capture import CaptureSample, write_captures
from shardline.storage.checkpoint import ShardCheckpoint, plan_ranges, row_group_sizes
from shardline.storage.fs import commit_file, ensure_dir, io_threads, open_file, open_fs, staging_path
from shardline.storage.model_cache import get_model_cache
from shardline.storage.output import OutputLayout, PartRecord
from shardline.storage.registry import ResolvedModel
from shardline.storage.retry import RetryPolicy, call_with_retries, is_transient
from shardline.storage.shards import ShardInfo, dictionary_columns, iter_batches, read_footer

logger = logging.getLogger("shardline.scoring")


@dataclass(frozen=True)
class ShardCapture:
    """Keep the first ``rows`` rows of each shard's model inputs and outputs under ``root`` (tier "batch")."""

    root: str
    rows: int
    tenant: str
    source: str  # the job id


@dataclass(frozen=True)
class ScoringJob:
    """What every shard of one job shares; small enough to ship to each worker.

    ``passthrough`` None keeps every input column the model does not read (ids and
    such), so each output part joins back to its shard: those of the input's first shard
    (``first_columns``, read by planning from ``first_shard``'s footer), so that every part
    of the job holds one column set; a shard whose other columns differ is quarantined
    (None: not known, each shard keeps its own). ``sample_check`` (picklable;
    the data contract) gets the first ``contract_sample_rows`` rows of each shard's
    model inputs before scoring and answers the expectations they fail; any answer
    quarantines the shard. ``capture`` keeps a sample of inputs and outputs per shard
    for drift checks.
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
    checkpoint_bytes: int = 1024 * 1024 * 1024
    retry: RetryPolicy = RetryPolicy()
    sample_check: Callable[[pa.Table], list[str]] | None = None
    contract_sample_rows: int = 1_000
    capture: ShardCapture | None = None
    job_id: str = ""  # the job's staging folder under the output is _staging/<job_id>
    first_columns: tuple[str, ...] | None = None  # auto passthrough: the first shard's columns the model does not read
    first_shard: str = ""  # that shard's relative name (for the quarantine reason)


def carried_columns(job: ScoringJob, schema: pa.Schema) -> list[str]:
    """The input columns copied to the output for this shard: the job's (``passthrough``, else ``first_columns``),
    or with neither known the shard's own (``other_columns``)."""
    if job.passthrough is not None:
        return list(job.passthrough)
    if job.first_columns is not None:
        return list(job.first_columns)
    return other_columns(job.model, schema)


def other_columns(model: ResolvedModel, schema: pa.Schema) -> list[str]:
    """The columns of a shard that auto passthrough copies: those the model neither reads nor writes."""
    inputs = set(model.manifest.signature.input_names)
    outputs = set(model.manifest.signature.output_names)
    return list(dict.fromkeys(n for n in schema.names if n not in inputs and n not in outputs))


def shadowed_columns(job: ScoringJob, schema: pa.Schema) -> list[str]:
    """The input columns auto passthrough leaves out because a model output has their name (a ``label`` of known
    answers, say: the part holds the model's); none when the job names its passthrough columns."""
    if job.passthrough is not None:
        return []
    signature = job.model.manifest.signature
    inputs, outputs = set(signature.input_names), set(signature.output_names)
    return [n for n in schema.names if n in outputs and n not in inputs]


def shadowed_note(columns: Sequence[str]) -> str:
    """The one line that tells a user about ``shadowed_columns`` (the run's log, the command's summary)."""
    return (f"input columns {list(columns)} have the names of model outputs: the parts hold the model's, not the "
            "input's (rename them in the input to keep them)")


def _check_schema(schema: pa.Schema, job: ScoringJob, carried: list[str]) -> None:
    """Refuse a shard the model cannot read, before any row is read: the kernel's message (``schema_mismatch``),
    as the online tier gives it, and passthrough columns the shard lacks."""
    mismatch = schema_mismatch(schema, job.model.manifest.signature, job.model.pinned)
    problems = list(mismatch.problems) if mismatch is not None else []
    own = other_columns(job.model, schema) if job.passthrough is None and job.first_columns is not None else None
    if own is not None and set(own) != set(carried):
        common = [c for c in carried if c in own]
        problems.append(
            f"the shard's columns besides the model's are {own}, the job's (from its first shard {job.first_shard}) "
            f"are {carried}; one job's parts hold one set of columns: name the columns to keep with --passthrough "
            f"({f'both have {common}' if common else 'they have none in common'}), or score these shards in a job "
            "of their own"
        )
    repeated = [c for c in carried if len(schema.get_all_field_indices(c)) > 1]
    if repeated:
        problems.append(f"{named_columns(repeated)} {'is' if len(repeated) == 1 else 'are'} in the data more than "
                        "once; keep one column of each name the output carries")
    missing = [c for c in carried if not schema.get_all_field_indices(c)]
    if missing and own is None:
        problems.append(f"passthrough columns {missing} are not in the shard")
    if problems:
        raise SchemaMismatch("; ".join(problems), problems)


def check_passthrough(passthrough: Sequence[str], model: ResolvedModel) -> None:
    """Refuse passthrough columns named like the model's outputs (a part cannot hold two columns of one name).

    Raises:
        InvalidInput: naming them and what to do.
    """
    clashing = set(passthrough) & set(model.manifest.signature.output_names)
    if clashing:
        raise InvalidInput(
            f"passthrough columns {sorted(clashing)} have the names of model outputs; "
            "rename them or leave them out of --passthrough"
        )


def check_passthrough_present(passthrough: Sequence[str], shard: str, schema: pa.Schema) -> None:
    """Refuse passthrough columns the input's first shard does not have: a misspelt ``--passthrough`` would
    otherwise quarantine every shard of the job, one by one, for the same request error.

    Raises:
        InvalidInput: naming the columns, the shard and the columns it has.
    """
    missing = [c for c in passthrough if schema.get_field_index(c) < 0]
    if missing:
        names = list(schema.names)
        shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
        raise InvalidInput(
            f"passthrough columns {missing} are not in the input's first shard {shard} (its columns: {shown}); "
            "check the names given to --passthrough"
        )


def output_schema(job: ScoringJob, input_schema: pa.Schema, carried: list[str]) -> pa.Schema:
    """Passthrough columns (as they are in the input) followed by the model's outputs."""
    check_passthrough(carried, job.model)
    return pa.schema([input_schema.field(c) for c in carried] + list(job.model.manifest.signature.output_schema()))


class PartWriter:
    """Writes record batches to a Parquet file on a background thread (the process's kept writers,
    ``io_threads("write")``), one batch in flight.

    Scoring the next batch overlaps writing this one. On exit the batch in flight is
    always finished before the writer closes (closing under a running write crashes
    pyarrow), and a write error is raised unless another error is already on its way.
    ``dictionary``: the columns dictionary-encoded (``dictionary_columns``).
    """

    def __init__(self, fs: Any, path: str, schema: pa.Schema, dictionary: list[str]) -> None:
        self._sink = open_file(fs, path, "wb")
        self._writer = pq.ParquetWriter(self._sink, schema, use_dictionary=dictionary)
        self._pending: Future[None] | None = None

    def write(self, batch: pa.RecordBatch) -> None:
        """Queue a batch behind the one in flight."""
        if self._pending is not None:
            self._pending.result()
        self._pending = io_threads("write").submit(self._writer.write_batch, batch)

    def __enter__(self) -> "PartWriter":
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        try:
            if self._pending is not None:
                wait([self._pending])
                if kind is None:
                    self._pending.result()
        finally:
            try:
                self._writer.close()
            finally:
                self._sink.close()


@dataclass
class _Opened:
    """A shard opened for scoring: its Parquet file and what the part will hold."""

    parquet: pq.ParquetFile
    schema: pa.Schema  # the shard's as read (``parquet.schema_arrow`` builds it anew on every access: ~18 us)
    carried: list[str]
    columns: list[str]
    target: pa.Schema
    dictionary: list[str]  # the part's dictionary-encoded columns (``dictionary_columns``)
    decoded: list[str]  # the model's input columns read in another layout than their values' (``read_schema``)


@contextlib.contextmanager
def _open_shard(job: ScoringJob, shard: ShardInfo) -> Generator[_Opened, None, None]:
    """Open a shard and check its schema against the model.

    Raises:
        CorruptShard: not readable Parquet. SchemaMismatch: the model cannot read it.
    """
    in_fs, in_path = open_fs(shard.uri, job.storage_options)
    try:
        source = open_file(in_fs, in_path, "rb")
        # pre_buffer (pyarrow's default) would read every row group's column chunks up
        # front, so a worker's memory would grow with the shard's size.
        parquet = pq.ParquetFile(source, pre_buffer=False)
    except (pa.ArrowException, OSError, ValueError) as e:
        if is_transient(e):
            raise
        raise CorruptShard(f"{shard.uri} is not a readable Parquet file ({e}); re-export it") from e
    with source:
        schema = parquet.schema_arrow
        carried = carried_columns(job, schema)
        _check_schema(schema, job, carried)
        schema, decoding = read_schema(schema, job.model.manifest.signature.input_names)
        columns = list(dict.fromkeys([*carried, *job.model.manifest.signature.input_names]))
        target = output_schema(job, schema, carried)
        yield _Opened(parquet, schema, carried, columns, target, dictionary_columns(target, carried), decoding)


def read_schema(schema: pa.Schema, inputs: Sequence[str]) -> tuple[pa.Schema, list[str]]:
    """The shard's schema as its batches are handed on (``_decoded``), and the input columns whose encoding is undone
    on read (``decoded_type``: a dictionary read as its values, ``string_view`` as ``string``): the data contract,
    the row check and capture then see the plain layout every Arrow kernel and pandas take. The schema check has
    passed: each input is there once."""
    decoding = [name for name in inputs if decoded_type(schema.field(name).type) != schema.field(name).type]
    for name in decoding:
        index = schema.get_field_index(name)
        schema = schema.set(index, schema.field(index).with_type(decoded_type(schema.field(index).type)))
    return schema, decoding


def _decoded(batch: pa.RecordBatch, names: Sequence[str]) -> pa.RecordBatch:
    """``batch`` with the columns ``names`` in their values' plain layout (``read_schema``)."""
    for name in names:
        index = batch.schema.get_field_index(name)
        column = decoded(batch.column(index))
        batch = batch.set_column(index, batch.schema.field(index).with_type(column.type), column)
    return batch


class _Sample:
    """The first rows scored in this attempt, model inputs and outputs, up to ``limit`` (for capture)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.rows = 0
        self.inputs: list[pa.RecordBatch] = []
        self.outputs: list[pa.RecordBatch] = []

    def take(self, inputs: pa.RecordBatch, outputs: pa.RecordBatch, shard: ShardInfo) -> None:
        """Keep the head of a scored batch while the sample is short: copied, so that the batch's buffers (a
        whole batch of rows) are not held while the sample waits for its task's other shards. Capture serves
        drift checks: a sample that cannot be taken is logged and dropped (the shard has no sample), never
        raised into the shard's scoring."""
        wanted = min(self.limit - self.rows, inputs.num_rows)
        if wanted <= 0:
            return
        try:
            head = arrow_array(np.arange(wanted, dtype=np.int32))
            taken = inputs.take(head), outputs.take(head)
        except Exception as e:  # (an Arrow type without a take kernel, say)
            logger.warning("capture of shard %s failed (%s: %s); the shard is scored without a capture sample",
                           shard.relative, type(e).__name__, e)
            self.limit, self.rows, self.inputs, self.outputs = 0, 0, [], []
            return
        self.inputs.append(taken[0])
        self.outputs.append(taken[1])
        self.rows += wanted


class ShardSamples:
    """The capture samples of the shards a worker scores for one task, written together (``write``): one file
    for them all, where a file each cost about 3 ms of fixed work (a tenth of a 50,000-row shard's). Each
    shard's sample is added once its part is committed; a failed write is logged, never raised (capture serves
    drift checks; the parts are what matter)."""

    def __init__(self, job: ScoringJob) -> None:
        self.job = job
        self.shards: list[str] = []
        self.samples: list[CaptureSample] = []

    def add(self, shard: ShardInfo, sample: _Sample | None) -> None:
        if self.job.capture is None or sample is None or not sample.rows:
            return
        try:
            taken = CaptureSample(pa.Table.from_batches(sample.inputs), pa.Table.from_batches(sample.outputs),
                                  datetime.now(timezone.utc))
        except Exception as e:  # capture serves drift checks; the part is committed
            logger.warning("capture of shard %s failed (%s: %s); its part is committed", shard.relative,
                           type(e).__name__, e)
            return
        self.shards.append(shard.relative)
        self.samples.append(taken)

    def write(self) -> None:
        capture, job = self.job.capture, self.job
        if capture is None or not self.samples:
            return
        try:
            write_captures(capture.root, job.model.name, job.model.version, "batch", self.samples,
                           tenant=capture.tenant, source=capture.source, storage_options=job.storage_options)
        except Exception as e:  # capture serves drift checks; the parts are committed
            one = len(self.shards) == 1
            logger.warning("capture of %s %s failed (%s: %s); %s committed", "shard" if one else "shards",
                           ", ".join(self.shards), type(e).__name__, e, "its part is" if one else "their parts are")
        self.shards, self.samples = [], []


def _contract_checked(job: ScoringJob, opened: _Opened, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``batches`` (the shard's from its first row), once the data contract has passed on their first
    ``contract_sample_rows`` rows: those batches are held until then, so the sample is the rows the shard is scored
    from, not a second read of them (which decoded each column's dictionary page again: half the reading of a
    50,000-row shard). Each held batch is let go as it is handed on, so none outlives its scoring.

    Raises:
        DataContractFailed: the sample fails expectations (the shard is quarantined; nothing was written).
    """
    held = _first_batches(batches, job.contract_sample_rows)
    _check_contract(job, opened, held)
    held.reverse()
    while held:
        yield held.pop()
    yield from batches


def _first_batches(batches: Iterator[pa.RecordBatch], rows: int) -> list[pa.RecordBatch]:
    """The batches that hold the first ``rows`` rows (all of them when there are fewer)."""
    held, found = [], 0
    for batch in batches:
        held.append(batch)
        found += batch.num_rows
        if found >= rows:
            break
    return held


_Rows = TypeVar("_Rows", pa.Table, pa.RecordBatch)


def _as_scored(sample: _Rows, signature: Signature) -> _Rows:
    """The sample's decimal and boolean columns that feed float inputs (``signature.feeds``) as those floats, as the
    row check casts them: the contract checks, and capture keeps, the values the model reads (a pandas column of
    Decimal objects is no float to great-expectations, nor to a drift check)."""
    for spec in signature.inputs:
        if casts_to_float(sample.schema.field(spec.name).type, spec.arrow_type):
            index = sample.schema.get_field_index(spec.name)
            sample = sample.set_column(index, spec.name, sample.column(index).cast(spec.arrow_type))
    return sample


def _check_contract(job: ScoringJob, opened: _Opened, held: list[pa.RecordBatch]) -> None:
    """Run the data contract on the first ``contract_sample_rows`` rows of ``held``.

    Raises:
        DataContractFailed: the sample fails expectations.
    """
    assert job.sample_check is not None
    names = job.model.manifest.signature.input_names
    schema = pa.schema([opened.schema.field(n) for n in names])
    sample = pa.Table.from_batches([b.select(names) for b in held], schema=schema).slice(0, job.contract_sample_rows)
    failures = job.sample_check(_as_scored(sample, job.model.manifest.signature))
    if failures:
        raise DataContractFailed(
            f"the first {sample.num_rows} rows fail {len(failures)} expectation(s) of {job.model.pinned}'s data "
            f"contract: {'; '.join(failures)}; fix the data or check the model's reference profile",
            failures,
        )


def _score_into(
    job: ScoringJob, shard: ShardInfo, opened: _Opened, out: OutputLayout, path: str, row_groups: list[int] | None,
    sample: _Sample | None = None,
) -> tuple[int, int]:
    """Score the shard's rows (or only ``row_groups``) into a Parquet file of ``out``'s file system; returns (rows
    in, rows out). From the shard's first row, the data contract (if any) is checked first (``_contract_checked``).
    """
    model = get_model_cache(job.cache_dir, job.cache_capacity).get(job.model, job.runtime, job.storage_options)
    signature = job.model.manifest.signature
    rows_in = rows_out = 0
    batches = _read(opened.parquet, opened.columns, job.batch_rows, shard, row_groups, opened.decoded)
    from_first_row = row_groups is None or (len(row_groups) > 0 and row_groups[0] == 0)
    contract = job.sample_check is not None and job.contract_sample_rows > 0 and from_first_row
    # closing(): the read-ahead thread stops before the source file closes, even
    # when a check below raises while the generator is suspended.
    with contextlib.closing(batches), PartWriter(out.fs, path, opened.target, opened.dictionary) as part:
        for batch in _contract_checked(job, opened, batches) if contract else batches:
            # the one row check, as the online tier's; a batch it stacks lands in this thread's scratch, whose other
            # matrix the batch before may still hold: that batch's part.write below is done once the next one is
            # handed to the writer (``PartWriter.write``), before the batch after that is stacked
            rows = check_rows(batch, signature, job.model.pinned, _scratch())
            predicted = signature.plan.answer_batch(_within_memory(model, rows, job.model.pinned))  # (numpy for floats)
            scored = pa.RecordBatch.from_arrays(
                [batch.column(c) for c in opened.carried] + predicted.columns, schema=opened.target
            )
            part.write(scored)
            if sample is not None and sample.rows < sample.limit:
                sample.take(_as_scored(batch.select(signature.input_names), signature), predicted, shard)
            rows_in += batch.num_rows
            rows_out += scored.num_rows
    return rows_in, rows_out


_SCRATCH = threading.local()


def _scratch() -> MatrixScratch:
    """This thread's matrices for stacking batches (``MatrixScratch``): kept from shard to shard of a task, let go
    at its end (``release_scratch``)."""
    scratch = getattr(_SCRATCH, "matrices", None)
    if scratch is None:
        scratch = _SCRATCH.matrices = MatrixScratch()
    return scratch


def release_scratch() -> None:
    """Let go of this thread's stacking matrices (a task's shards are scored): a worker between tasks, or kept warm
    between jobs, holds none (two of the largest batch it stacked: ~16 MiB at the default 65,536 rows)."""
    _SCRATCH.matrices = None


_FITS: dict[str, int] = {}  # per model in this worker: the most rows a call has taken since the device ran out


def _within_memory(model: Any, rows: Rows, pinned: str) -> Answer:
    """``model.predict(rows)``, in calls of at most the rows the device has held: a call the device has no memory
    for is split in two (down to one row) and the limit for the worker's later calls lowered to the half that fit,
    so a shard is never failed for what smaller batches serve. Only one row that does not fit fails the shard."""

    def split(rows_tried: int, half: int) -> None:
        _FITS[pinned] = min(half, _FITS.get(pinned, half))
        logger.warning("out of memory scoring %d rows of %s: split in two; this worker now scores at most %d rows "
                       "a call", rows_tried, pinned, _FITS[pinned])

    most = _FITS.get(pinned)
    if most is None or rows.num_rows <= most:
        return split_out_of_memory(model.predict, rows, split)
    return concat_answers([split_out_of_memory(model.predict, rows.slice(offset, min(most, rows.num_rows - offset)),
                                               split) for offset in range(0, rows.num_rows, most)])


def _read(
    parquet: pq.ParquetFile, columns: list[str], batch_rows: int, shard: ShardInfo, row_groups: list[int] | None = None,
    decoding: Sequence[str] = (),
) -> Generator[pa.RecordBatch, None, None]:
    """The shard's batches, the columns ``decoding`` in their values' plain layout (``read_schema``)."""
    batches = iter_batches(parquet, columns, batch_rows, row_groups=row_groups)
    try:
        for batch in batches:
            yield _decoded(batch, decoding) if decoding else batch
    except (pa.ArrowException, OSError) as e:
        if is_transient(e):
            raise
        raise CorruptShard(f"{shard.uri} has data that cannot be read ({e}); re-export it") from e
    finally:
        batches.close()  # its read-ahead stops before the shard's file closes (this generator closed early, too)


@dataclass
class _Scored:
    rows_in: int
    rows_out: int
    ranges: int = 1
    ranges_resumed: int = 0


def _score_to_part(job: ScoringJob, shard: ShardInfo, out: OutputLayout, final: str, captured: ShardSamples
                   ) -> _Scored:
    """Score a shard and commit its part: in one pass, or range by range with checkpoints."""
    ensure_dir(out.fs, out.staging_dir)
    sample = _Sample(job.capture.rows) if job.capture is not None and job.capture.rows > 0 else None
    with _open_shard(job, shard) as opened:
        ranges = plan_ranges(row_group_sizes(opened.parquet.metadata), job.checkpoint_bytes)
        if len(ranges) == 1:
            staged = staging_path(final, out.staging_dir)
            try:
                rows_in, rows_out = _score_into(job, shard, opened, out, staged, None, sample)
            except BaseException:
                if out.fs.exists(staged):
                    out.fs.rm(staged)
                raise
            commit_file(out.fs, staged, final)
            captured.add(shard, sample)
            return _Scored(rows_in, rows_out)
        checkpoint = ShardCheckpoint.load(out, shard, job.job_key, ranges)
        try:
            for start, end in ranges:
                if (start, end) in checkpoint.done:
                    continue
                chunk = checkpoint.new_chunk_path(start, end)
                try:
                    rows_in, rows_out = _score_into(job, shard, opened, out, chunk, list(range(start, end)), sample)
                except BaseException:
                    if out.fs.exists(chunk):
                        out.fs.rm(chunk)
                    raise
                checkpoint.finish(start, end, rows_in, rows_out, chunk)
        except InvalidInput:
            checkpoint.discard()  # the shard is quarantined: its partial scores are of no use
            raise
    checkpoint.assemble(final, opened.dictionary)
    rows_in, rows_out = checkpoint.rows()
    checkpoint.discard()
    captured.add(shard, sample)
    return _Scored(rows_in, rows_out, len(ranges), checkpoint.resumed)


def score_shard(job: ScoringJob, shard: ShardInfo, captured: ShardSamples | None = None) -> PartRecord:
    """Score one shard into its part, or quarantine it; returns its ledger record.

    Its capture sample goes to ``captured`` (a task's shards: written together once they are scored), else is
    written before this returns.

    Transient storage errors (connection, time-out, throttling) are retried with
    exponential backoff and jitter (``job.retry``); a large shard resumes from its
    last checkpointed range.

    Raises:
        Exception: anything that is not the shard's fault (storage down past the
            retries, model missing). Nothing is committed then, and a re-run scores
            the shard again.
    """
    samples = captured if captured is not None else ShardSamples(job)
    record = call_with_retries(lambda: _score_shard_once(job, shard, samples), job.retry,
                               what=f"shard {shard.relative}")
    if captured is None:
        samples.write()
    return record


def _score_shard_once(job: ScoringJob, shard: ShardInfo, captured: ShardSamples) -> PartRecord:
    started = time.perf_counter()
    out = OutputLayout(job.output_uri, job.storage_options, job.job_id)
    final = out.part_path(shard.relative)
    try:
        scored = _score_to_part(job, shard, out, final, captured)
    except InvalidInput as e:
        label = "DataContract" if isinstance(e, DataContractFailed) else type(e).__name__
        return _quarantine(job, shard, out, f"{label}: {e}", started)
    record = PartRecord(
        shard=shard.uri,
        relative=shard.relative,
        fingerprint=shard.fingerprint,
        job_key=job.job_key,
        status="committed",
        part=out.fs.unstrip_protocol(final),
        rows_in=scored.rows_in,
        rows_out=scored.rows_out,
        seconds=time.perf_counter() - started,
        ranges=scored.ranges,
        ranges_resumed=scored.ranges_resumed,
    )
    out.record(record)
    return record


def _quarantine(job: ScoringJob, shard: ShardInfo, out: OutputLayout, reason: str, started: float) -> PartRecord:
    """Record a shard the model cannot score, with the reason; no part is written."""
    rows = _row_count(shard, job)
    record = PartRecord(
        shard=shard.uri,
        relative=shard.relative,
        fingerprint=shard.fingerprint,
        job_key=job.job_key,
        status="quarantined",
        rows_in=rows,
        rows_quarantined=rows or 0,
        reason=reason,
        seconds=time.perf_counter() - started,
    )
    out.record(record)
    return record


def _row_count(shard: ShardInfo, job: ScoringJob) -> int | None:
    """Rows the footer declares, or None when even the footer is unreadable."""
    try:
        return read_footer(shard.uri, job.storage_options).num_rows
    except (CorruptShard, OSError):  # a transient error here only costs the count
        return None
