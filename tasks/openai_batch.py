"""Prefect tasks of the OpenAI Batch file flow (``flows/openai_batch.py``): plan, answer the parts, finish.

Thin wrappers: the checks and shapes are the kernel's (``shardline.openai_batch``), the answers its
``shardline.openai_batch_answers``, the bytes ``shardline.storage.openai_batch``. The model runs in
this process (the ``llm`` runtime's engine batches the lines of a part itself; no Dask).
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, State

from shardline.errors import InferenceFailed, InvalidInput, JobFailed
from shardline.openai_batch import (
    EMBEDDINGS,
    BatchLine,
    PartSpec,
    batch_object,
    error_record,
    exit_status,
    pending_parts,
)
from shardline.runtimes import Runtime, RuntimeOptions
from shardline.runtimes.generation.runtime import GeneratingRuntime
from shardline.storage.lease import LeaseTerms, OutputLease, holding_output  # noqa: F401 - holding_output: the flow's
from shardline.storage.model_cache import get_model_cache
from shardline.tasks.logs import run_logger
from shardline.tasks.openai_batch_survey import (
    OPENAI_SOFT,
    OpenAIBatchPlan,
    OpenAIBatchSettings,
    refuse_another_job,
    survey_openai_batch,
)

PartWatcher = Callable[[int, int, int], None]
"""Called as ``(parts committed, parts in the job, lines answered this run)`` each time a part is committed."""


@task(name="plan-openai-batch", cache_policy=NO_CACHE)
def plan_openai_batch(input_uri: str, output_uri: str, lines_per_part: int, tenant: str,
                      settings: OpenAIBatchSettings, deployment: str | None = None) -> OpenAIBatchPlan:
    """Admit, read and check the file, pin its model, and own the output folder: the parts left to answer.

    Nothing is written when the file or the request is refused. A job run again keeps the version its first
    run pinned, even when the file's alias has moved since. A deployment's run meets the tenant's monthly
    budget here (`batch openai` meets it in the command, before its flow run).

    Raises:
        ShardlineError: as :func:`survey_openai_batch`; also OutputInUse (another job runs on the folder),
            OutputNotWritable (the folder cannot be written) and BudgetExceeded (a deployment's new job for a
            tenant at its hard limit).
    """
    plan = survey_openai_batch(input_uri, output_uri, lines_per_part, tenant, settings)
    if deployment is not None:
        _meet_budget(plan, settings)
    if plan.finished is not None:
        return plan
    output, job, model = plan.output, plan.job, plan.model
    terms = LeaseTerms(settings.batch.lease_ttl_s, settings.batch.lease_renew_s)
    with OutputLease.taking(output.fs, output.root, output.uri, job.job_id, model.pinned, terms) as lease:
        if not plan.recorded:  # a race lost: another run recorded another job meanwhile
            refuse_another_job(output, output.create_job(job), job.input_sha256, plan.file.model, job.lines_per_part)
        plan.pending = pending_parts(plan.parts, output.committed_parts())
    plan.lease = lease
    run_logger().info("OpenAI batch job %s: %d lines, model %s, %d of %d parts to answer", job.job_id,
                      len(plan.file.entries), model.pinned, len(plan.pending), len(plan.parts))
    return plan


def _meet_budget(plan: OpenAIBatchPlan, settings: OpenAIBatchSettings) -> None:
    """The tenant's monthly budget on a deployment's run (docs/cost.md, "Budgets"), as `batch openai` applies it:
    said in the run's log and by the ``shardline.budget.warning`` event; at the hard limit a new job is refused.

    Raises:
        BudgetExceeded: the tenant is at its hard limit and no earlier run began the job.
        ShardlineError: the tenants file or the price table is wrong.
    """
    from shardline.cost.budgets import tenant_budget_state
    from shardline.event_catalog import BUDGET_WARNING, tenant_resource
    from shardline.tasks.events import emit

    state = tenant_budget_state(settings.tenancy.tenants_file, plan.tenant, settings.storage.home,
                                settings.storage.storage_options)
    if state is None or state.state == "ok":
        return
    emit(BUDGET_WARNING, tenant_resource(plan.tenant), {**state.to_json(), "tier": "batch"})
    run_logger().warning("%s", state.job_line(plan.recorded or plan.finished is not None, OPENAI_SOFT))


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
    began, use = datetime.now(timezone.utc), BatchUse()
    try:
        runtime = _load(plan, settings)
        done, lines = len(plan.parts) - len(plan.pending), 0
        for part in plan.pending:
            started = time.perf_counter()
            try:
                records = answer_part(runtime, plan, part)
            except InferenceFailed as e:  # the model's fault, not the file's: a re-run redoes this part
                raise JobFailed(f"{part.name} (lines {part.first + 1}-{part.stop}) failed: {e}; {done} of "
                                f"{len(plan.parts)} parts are committed: run the same command again to answer the "
                                "rest", {part.name: str(e)}) from e
            if plan.lease is not None:
                plan.lease.check()  # a job that lost the folder to another writes nothing more
            plan.output.commit_part(part.name, records)
            use.add(records, time.perf_counter() - started)
            plan.answered.append(part.name)
            done, lines = done + 1, lines + len(records)
            logger.info("committed %s: lines %d-%d (%d of %d parts)", part.name, part.first + 1, part.stop, done,
                        len(plan.parts))
            for watcher in watchers:
                watcher(done, len(plan.parts), lines)
    finally:
        use.meter(plan, settings, began)  # what was committed, however the run ends
    return plan


class BatchUse:
    """What a run of the job used, part by committed part, for the metering ledger: the lines answered (requests),
    their tokens, and the seconds the model took."""

    def __init__(self) -> None:
        self.requests = self.rows = self.prompt_tokens = self.completion_tokens = 0
        self.seconds = 0.0

    def add(self, records: list[dict[str, Any]], seconds: float) -> None:
        """A committed part's records (answers and error records) and the seconds it took."""
        self.rows += len(records)
        self.seconds += seconds
        for record in records:
            response = record.get("response") or {}
            if response.get("status_code") != 200:
                continue
            self.requests += 1
            usage = (response.get("body") or {}).get("usage") or {}
            self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
            self.completion_tokens += int(usage.get("completion_tokens") or 0)

    def meter(self, plan: OpenAIBatchPlan, settings: OpenAIBatchSettings, began: datetime) -> None:
        """Write the run's use to the metering ledger (the batch tier, the job's tenant, model and version), as the
        batch flow meters a run's shards: one usage row and one capacity row (one device held for the window). A
        run that committed nothing writes nothing, nor one with ``SHARDLINE_METERING_ENABLED=false``."""
        if not self.rows or not settings.metering.enabled:
            return
        from shardline.storage.ledger import LedgerStore, holding_of
        from shardline.tasks.fairness import device_kind

        device = device_kind(settings.runtime)
        window = max(0.0, (datetime.now(timezone.utc) - began).total_seconds())
        measures = {"requests": self.requests, "rows": self.rows, "prompt_tokens": self.prompt_tokens,
                    "completion_tokens": self.completion_tokens, "device_seconds": self.seconds,
                    "cpu_seconds": 0.0 if device == "gpu" else self.seconds}
        model = plan.model
        ledger = LedgerStore(settings.storage.home, settings.storage.storage_options)
        try:
            ledger.record_batch(holding_of(settings.metering, "batch", device, 1.0), plan.tenant, model.name,
                                model.version_label, plan.job.job_id, began, measures, reserved_seconds=window,
                                window_seconds=window)
        except OSError as e:  # the answers are committed: a ledger that cannot be written must not fail the job
            run_logger().error("the metering ledger could not be written (%s): this run's use is not in it", e)


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
