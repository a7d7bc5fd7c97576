"""Prefect tasks of the OpenAI Batch file flow (``flows/openai_batch.py``): plan, answer the parts, finish.

Thin wrappers: the checks and shapes are the kernel's (``shardline.openai_batch``), the answers its
``shardline.openai_batch_answers``, the bytes ``shardline.storage.openai_batch``. The model runs in
this process (the ``llm`` runtime's engine batches the lines of a part itself; no Dask).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from functools import partial
from typing import Any, Callable, Sequence

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, State

from shardline.errors import InferenceFailed, InvalidInput, JobFailed, OutputInUse
from shardline.openai_batch import (
    EMBEDDINGS,
    BatchFile,
    BatchJobRecord,
    BatchLine,
    PartSpec,
    batch_job_id,
    batch_object,
    check_batch_file,
    endpoint_problem,
    error_record,
    exit_status,
    identity_differences,
    pending_parts,
    plan_parts,
)
from shardline.runtimes import Runtime, RuntimeOptions
from shardline.runtimes.generation.runtime import GeneratingRuntime
from shardline.settings import BatchSettings, RuntimeSettings, StorageSettings, TenancySettings
from shardline.storage.fs import resolve_location
from shardline.storage.lease import LeaseTerms, OutputLease, holding_output  # noqa: F401 - holding_output: the flow's
from shardline.storage.model_cache import get_model_cache
from shardline.storage.openai_batch import BatchOutputFolder, read_batch_input
from shardline.storage.registry import ModelRegistry, ResolvedModel
from shardline.tasks.logs import run_logger
from shardline.tenants import BatchTenant, admit_locations, batch_tenant, check_custom_code

PartWatcher = Callable[[int, int, int], None]
"""Called as ``(parts committed, parts in the job, lines answered this run)`` each time a part is committed."""


@dataclass(frozen=True)
class OpenAIBatchSettings:
    """The settings areas the job reads, read once at the flow's start."""

    storage: StorageSettings
    batch: BatchSettings
    runtime: RuntimeSettings
    tenancy: TenancySettings

    @classmethod
    def read(cls) -> OpenAIBatchSettings:
        """The settings from the environment."""
        return cls(StorageSettings(), BatchSettings(), RuntimeSettings(), TenancySettings())


@dataclass
class OpenAIBatchPlan:
    """A job as planned: its checked file, pinned model, output folder, parts, and the lease it holds."""

    job: BatchJobRecord
    file: BatchFile
    model: ResolvedModel
    output: BatchOutputFolder
    parts: tuple[PartSpec, ...]
    pending: tuple[PartSpec, ...]
    tenant: str | None
    recorded: bool = False  # the folder held this job's record already (an earlier run's)
    lease: OutputLease | None = None
    finished: dict[str, Any] | None = None  # the folder's batch object when the job is already finished
    answered: list[str] = field(default_factory=list)  # the parts this run committed


def _refuse_another_job(output: BatchOutputFolder, recorded: BatchJobRecord | None, sha256: str, reference: str,
                        lines_per_part: int) -> None:
    """Refuse a run into a folder that holds another job (another input, model or part size), naming what differs."""
    changed = identity_differences(recorded, sha256, reference, lines_per_part) if recorded is not None else []
    if recorded is not None and changed:
        raise OutputInUse(
            f"the output {output.uri} holds OpenAI batch job {recorded.job_id} (input {recorded.input_uri}, model "
            f"{recorded.model}); this run differs in {'; '.join(changed)}: choose another --output, or delete the "
            "folder to answer this file anew", output.uri, recorded.job_id)


def _checked_model(registry: ModelRegistry, reference: str, checked: BatchFile,
                   tenant: BatchTenant | None) -> ResolvedModel:
    """The model pinned (``reference``: the file's, or the version of the job's first run), fit for the file's
    endpoints and allowed to the tenant."""
    model = registry.resolve(reference)
    manifest = model.manifest
    problem = endpoint_problem(checked.endpoints, model.pinned, manifest.runtime, manifest.signature)
    if problem is not None:
        raise InvalidInput(problem)
    check_custom_code(manifest.runtime, model.pinned, tenant.name if tenant else None,
                      tenant.custom_code if tenant else True)
    return model


def survey_openai_batch(input_uri: str, output_uri: str, lines_per_part: int, tenant: str,
                        settings: OpenAIBatchSettings) -> OpenAIBatchPlan:
    """Every check of planning that reads and never writes: admission, the file, its model, what the output holds.

    The plan it returns holds no lease yet (``lease`` None; ``pending`` every part unless the folder holds this
    very job finished). `batch openai` calls it before any flow run (with :func:`check_openai_batch`); the plan
    task calls it again.

    Raises:
        InvalidInput: the file is refused (a custom_id twice, two models, no request), its model does not
            fit its endpoints, or ``lines_per_part`` is below 1.
        InvalidSetting, AccessDenied: the tenant or a location is refused; the input is missing.
        ModelNotFound: the model the file names is not registered.
        OutputInUse: the folder holds another job (another input, model or part size).
    """
    storage = settings.storage
    allowed = batch_tenant(settings.tenancy.tenants_file, tenant)
    resolve = partial(resolve_location, storage_options=storage.storage_options)
    input_uri, output_uri = admit_locations(allowed, input_uri, output_uri, resolve)
    plan_parts(0, lines_per_part)  # the part size is checked before a byte is read
    data, sha256 = read_batch_input(input_uri, storage.storage_options)
    checked = check_batch_file(data)
    output = BatchOutputFolder(output_uri, storage.storage_options)
    recorded = output.read_job()
    _refuse_another_job(output, recorded, sha256, checked.model, lines_per_part)
    registry = ModelRegistry.from_settings(storage)
    model = _checked_model(registry, recorded.model if recorded else checked.model, checked, allowed)
    parts = plan_parts(len(checked.entries), lines_per_part)
    job = recorded or BatchJobRecord(
        job_id=batch_job_id(sha256, checked.model, lines_per_part), input_uri=input_uri, input_sha256=sha256,
        model_reference=checked.model, model=model.pinned, model_digest=model.content_digest,
        lines_per_part=lines_per_part, entries=len(checked.entries), parts=len(parts),
        created_at=datetime.now(timezone.utc))
    plan = OpenAIBatchPlan(job, checked, model, output, parts, parts, allowed.name if allowed else None,
                           recorded=recorded is not None)
    finished = output.read_batch()
    if recorded is not None and finished is not None and finished.get("id") == f"batch_{job.job_id}":
        return replace(plan, pending=(), finished=finished)  # a finished job run again: read, nothing written
    return plan


def check_openai_batch(input_uri: str, output_uri: str, lines_per_part: int, tenant: str,
                       settings: OpenAIBatchSettings) -> None:
    """What the plan task would refuse, found without writing (`batch openai`'s check before a flow run).

    Raises:
        ShardlineError: as :func:`survey_openai_batch`; also OutputInUse (another job runs on the folder) and
            OutputNotWritable (a file, or a folder that cannot be written: on local disk).
    """
    plan = survey_openai_batch(input_uri, output_uri, lines_per_part, tenant, settings)
    if plan.finished is None:
        output = plan.output
        OutputLease.check_free(output.fs, output.root, output.uri, plan.job.job_id)


@task(name="plan-openai-batch", cache_policy=NO_CACHE)
def plan_openai_batch(input_uri: str, output_uri: str, lines_per_part: int, tenant: str,
                      settings: OpenAIBatchSettings) -> OpenAIBatchPlan:
    """Admit, read and check the file, pin its model, and own the output folder: the parts left to answer.

    Nothing is written when the file or the request is refused. A job run again keeps the version its first
    run pinned, even when the file's alias has moved since.

    Raises:
        ShardlineError: as :func:`survey_openai_batch`; also OutputInUse (another job runs on the folder) and
            OutputNotWritable (the folder cannot be written).
    """
    plan = survey_openai_batch(input_uri, output_uri, lines_per_part, tenant, settings)
    if plan.finished is not None:
        return plan
    output, job, model = plan.output, plan.job, plan.model
    terms = LeaseTerms(settings.batch.lease_ttl_s, settings.batch.lease_renew_s)
    with OutputLease.taking(output.fs, output.root, output.uri, job.job_id, model.pinned, terms) as lease:
        if not plan.recorded:  # a race lost: another run recorded another job meanwhile
            _refuse_another_job(output, output.create_job(job), job.input_sha256, plan.file.model, job.lines_per_part)
        plan.pending = pending_parts(plan.parts, output.committed_parts())
    plan.lease = lease
    run_logger().info("OpenAI batch job %s: %d lines, model %s, %d of %d parts to answer", job.job_id,
                      len(plan.file.entries), model.pinned, len(plan.pending), len(plan.parts))
    return plan


def _load(plan: OpenAIBatchPlan, settings: OpenAIBatchSettings) -> Runtime:
    runtime = settings.runtime
    cache = get_model_cache(settings.storage.cache, runtime.cache_capacity)
    options = RuntimeOptions(runtime.device, runtime.intra_op_threads, runtime.spinning)
    return cache.get(plan.model, options, settings.storage.storage_options)


def answer_part(runtime: Runtime, plan: OpenAIBatchPlan, part: PartSpec) -> list[dict[str, Any]]:
    """A part's records in input order: refused lines as error records, the rest answered by the model."""
    from shardline.openai_batch_answers import answer_embedding_part, answer_generation_part

    entries = plan.file.entries[part.first:part.stop]
    job_id, pinned = plan.job.job_id, plan.model.pinned
    lines = [e for e in entries if isinstance(e, BatchLine)]
    embeddings = [line for line in lines if line.url == EMBEDDINGS]
    generations = [line for line in lines if line.url != EMBEDDINGS]
    answered: dict[int, dict[str, Any]] = {}
    if generations:
        if not isinstance(runtime, GeneratingRuntime):  # plan checked that the model fits the endpoints
            raise InvalidInput(f"{pinned} does not generate text; name a model of runtime 'llm' in the file")
        records = answer_generation_part(runtime.engine, generations, job_id, pinned)
        answered.update((line.number, record) for line, record in zip(generations, records))
    if embeddings:
        records = answer_embedding_part(runtime, embeddings, job_id, pinned)
        answered.update((line.number, record) for line, record in zip(embeddings, records))
    return [answered[e.number] if isinstance(e, BatchLine) else error_record(job_id, e.number, e.custom_id, e.message)
            for e in entries]


@task(name="answer-parts", cache_policy=NO_CACHE)
def answer_openai_parts(plan: OpenAIBatchPlan, settings: OpenAIBatchSettings,
                        watchers: Sequence[PartWatcher] = ()) -> OpenAIBatchPlan:
    """Answer every pending part with the model and commit each part as it is done.

    Raises:
        JobFailed: the model failed while generating (the parts committed so far are kept: a re-run does the rest).
        OutputInUse: another job took the output over.
    """
    if not plan.pending:
        return plan
    logger = run_logger()
    runtime = _load(plan, settings)
    done, lines = len(plan.parts) - len(plan.pending), 0
    for part in plan.pending:
        try:
            records = answer_part(runtime, plan, part)
        except InferenceFailed as e:  # the model's fault, not the file's: a re-run redoes this part
            raise JobFailed(f"{part.name} (lines {part.first + 1}-{part.stop}) failed: {e}; {done} of "
                            f"{len(plan.parts)} parts are committed: run the same command again to answer the "
                            "rest", {part.name: str(e)}) from e
        if plan.lease is not None:
            plan.lease.check()  # a job that lost the folder to another writes nothing more
        plan.output.commit_part(part.name, records)
        plan.answered.append(part.name)
        done, lines = done + 1, lines + len(records)
        logger.info("committed %s: lines %d-%d (%d of %d parts)", part.name, part.first + 1, part.stop, done,
                    len(plan.parts))
        for watcher in watchers:
            watcher(done, len(plan.parts), lines)
    return plan


@task(name="finish-openai-batch", cache_policy=NO_CACHE)
def finish_openai_batch(plan: OpenAIBatchPlan) -> dict[str, Any]:
    """Write ``output.jsonl``, ``errors.jsonl`` and then ``batch.json``; the job's summary.

    A job already finished is only read.
    """
    output = plan.output
    batch = plan.finished
    if batch is None:
        if plan.lease is not None:
            plan.lease.check()
        counts = output.assemble(part.name for part in plan.parts)
        batch = batch_object(plan.job, plan.file.endpoints, counts, output.url("output.jsonl"),
                             output.url("errors.jsonl"), datetime.now(timezone.utc))
        if plan.lease is not None:
            plan.lease.check()
        output.commit_batch(batch)
        output.drop_staging()
    counts_doc = batch["request_counts"]
    return {
        "batch_id": batch["id"], "model": plan.model.pinned, "endpoint": batch["endpoint"],
        "total": counts_doc["total"], "completed": counts_doc["completed"], "failed": counts_doc["failed"],
        "parts": len(plan.parts), "parts_answered": len(plan.answered),
        "parts_skipped": len(plan.parts) - len(plan.answered),
        "output": output.url("output.jsonl"), "errors": output.url("errors.jsonl"), "batch": output.url("batch.json"),
    }


def openai_batch_outcome(summary: dict[str, Any]) -> State[Any]:
    """The flow's final state: Completed, or Completed named "Quarantined" when some lines failed."""
    from shardline.openai_batch import BatchCounts

    counts = BatchCounts(summary["total"], summary["completed"], summary["failed"])
    message = f"{counts.completed} of {counts.total} lines answered, {counts.failed} failed ({summary['errors']})"
    if exit_status(counts) == 0:
        return Completed(message=f"{counts.completed} lines answered", data=summary)
    return Completed(name="Quarantined", message=message, data=summary)
