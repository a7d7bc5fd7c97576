"""Prefect tasks of the batch inference flow: thin wrappers over storage functions.

Tasks pass URLs and small records, never frames. The shard work itself runs on Dask
as plain functions (``shardline.storage.scoring.score_shard``), so workers need no
Prefect; one Prefect task submits all shards, so a job of many shards costs a handful
of task runs, not one per shard.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast
from uuid import UUID

import pyarrow as pa
from prefect import task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE

from shardline.errors import CorruptShard, JobFailed, ShardlineError
from shardline.runtimes import RuntimeOptions
from shardline.settings import BatchSettings, DaskSettings, RuntimeSettings, StorageSettings
from shardline.signature import schema_problems
from shardline.storage.capture import capture_root
from shardline.storage.job_identity import JobSummary, summarize
from shardline.storage.lease import LeaseTerms, OutputLease
from shardline.storage.output import (
    JobManifest,
    ManifestModel,
    ManifestPart,
    ManifestQuarantine,
    OutputLayout,
    PartRecord,
    split_done,
)
from shardline.storage.registry import ModelRegistry, ResolvedModel
from shardline.storage.retry import call_with_retries
from shardline.storage.scoring import ScoringJob, ShardCapture, shadowed_columns, shadowed_note
from shardline.storage.shards import ShardInfo, read_footer
from shardline.tasks.artifacts import batch_artifact_key, current_deployment, summary_markdown, totals_table
from shardline.tasks.batch_survey import (
    JobSurvey,
    refuse_foreign,
    refuse_strays,
    refuse_unknown_files,
    survey_job,
)
from shardline.tasks.cluster import threads_per_call
from shardline.tasks.dispatch import dispatch_shards
from shardline.tasks.logs import run_logger
from shardline.tasks.sla_tracking import publish_sla_table

if TYPE_CHECKING:
    from shardline.tasks.preemption import PreemptionPlugin

# Called in the flow's process as shards settle: (shards of the job settled, shards in the job, rows scored
# this run). Settled counts every shard with its outcome: committed or quarantined, by this run or an earlier
# one. The flow's ``watchers`` (the CLI's progress bar, a test) and the SLA tracker are handed to ``infer_shards``.
ProgressWatcher = Callable[[int, int, int], None]
# Jobs with more pending shards than this skip the footer check in the flow's process.
FLOW_FOOTER_CHECK_MAX = 256


@dataclass
class JobPlan:
    """What a run will do: the job, its pinned model, the shards left and those settled."""

    job: ScoringJob
    job_id: str
    tenant: str
    input_uri: str
    todo: list[ShardInfo]
    done: list[PartRecord]
    total_shards: int
    new: list[PartRecord] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    halted: ShardlineError | None = None  # a failure that fails every shard (the model cannot be loaded): it ends the job
    max_in_flight: int | None = None
    preemption: PreemptionPlugin | None = None
    lease: OutputLease | None = None
    finished: bool = False  # the output already holds this job's finished manifest: nothing is written
    shadowed: list[str] = field(default_factory=list)  # input columns an output's name keeps out (validate_shards)


def _take_output(survey: JobSurvey, terms: LeaseTerms) -> tuple[OutputLease, list[ShardInfo], list[PartRecord]]:
    """Own the output (its lease): the shards left and those settled.

    The lease is taken first (it is also the probe that the output can be written),
    then the ledger is read and checked again under it: an output holding another
    model's parts is refused.

    Raises:
        OutputInUse: another job holds the output, or it is inside another job's output folder or holds one, or it
            holds another job's parts, parts of shards this input does not have, or Parquet files no job wrote.
        OutputNotWritable: the output is a file, read-only, or not permitted.
    """
    layout, model = survey.layout, survey.model.pinned
    # before the lease, the first write, in the command's order (``check_output_free``): a folder inside another
    # job's output, holding one, or of the other kind, gets none
    OutputLease.check_free(layout.fs, layout.root, layout.uri, survey.job_id)
    layout.refuse_job_folder_overlap()
    with OutputLease.taking(layout.fs, layout.root, layout.uri, survey.job_id, model, terms) as lease:
        layout.refuse_job_folder_overlap()  # again under it, for what changed before it was taken
        ledger = call_with_retries(layout.read_ledger, survey.retry, what="reading the job's ledger")
        refuse_foreign(layout, model, survey.key, layout.any_manifest(), ledger)
        present = layout.present_parts()
        refuse_strays(layout, survey.shards, ledger, present)
        refuse_unknown_files(layout, survey.shards, ledger, present)
        todo, done = split_done(survey.shards, ledger, survey.key, present)
        if todo:
            layout.clear_success()
    return lease, todo, done


@task(name="plan", cache_policy=NO_CACHE)
def plan_batch_job(
    model: str,
    input_uri: str,
    output_uri: str,
    tenant: str,
    passthrough: list[str] | None,
    storage: StorageSettings,
    batch: BatchSettings,
    runtime: RuntimeSettings,
    dask: DaskSettings,
    variant: str | None = None,
    link_roots: list[str] | None = None,
    custom_code: bool = True,
) -> JobPlan:
    """Pin the model (and its variant), list the shards, and split off those a previous run settled.

    ``link_roots``: where links in the input may lead (the tenant's resolved prefixes); None: anywhere.
    ``custom_code``: whether the tenant may run a model that carries its own Python code (the
    tenants file's ``custom_code``; True in single-tenant mode).

    Raises:
        ShardlineError: what :func:`survey_job` refuses (model, input, output), or what taking the output
            refuses (:func:`_take_output`: another job holds it, it cannot be written).
    """
    survey = survey_job(model, input_uri, output_uri, tenant, passthrough, storage, batch, dask, variant,
                        link_roots, custom_code)
    if survey.variant_note is not None:
        run_logger().info("%s", survey.variant_note)
    resolved, this_job, key = survey.model, survey.job_id, survey.key
    shards, retry = survey.shards, survey.retry
    lease: OutputLease | None = None
    todo: list[ShardInfo] = []
    done = survey.settled
    if done is None:
        lease, todo, done = _take_output(survey, LeaseTerms(batch.lease_ttl_s, batch.lease_renew_s))
    options = RuntimeOptions(runtime.device, runtime.intra_op_threads or threads_per_call(dask), runtime.spinning)
    capture = (
        ShardCapture(capture_root(storage), batch.capture_rows_per_shard, tenant, this_job)
        if batch.capture_rows_per_shard else None
    )
    job = ScoringJob(
        job_key=key,
        model=resolved,
        output_uri=output_uri,
        passthrough=tuple(passthrough) if passthrough is not None else None,
        batch_rows=batch.batch_rows,
        cache_dir=storage.cache,
        cache_capacity=runtime.cache_capacity,
        runtime=options,
        storage_options=storage.storage_options,
        checkpoint_bytes=batch.checkpoint_bytes,
        retry=retry,
        sample_check=shard_contract(survey.registry, resolved) if batch.contract_sample_rows and todo else None,
        contract_sample_rows=batch.contract_sample_rows,
        capture=capture,
        job_id=this_job,
        first_columns=survey.first_columns,
        first_shard=shards[0].relative,
    )
    run_logger().info(
        "job %s: %s pinned to %s; %d shards, %d already settled, %d to score%s",
        this_job, model, resolved.pinned, len(shards), len(done), len(todo),
        "; a sample of each checked against the data contract" if job.sample_check else "",
    )
    if lease is None:
        run_logger().info("job %s: the output already holds its finished manifest; nothing to write", this_job)
    return JobPlan(
        job, this_job, tenant, input_uri, todo, done, len(shards), max_in_flight=batch.max_in_flight or None,
        preemption=preemption_plugin(dask), lease=lease, finished=lease is None,
    )


def preemption_plugin(dask: DaskSettings) -> PreemptionPlugin | None:
    """The worker plugin that retires a worker gracefully on a preemption notice (None: no notice source)."""
    if not dask.preemption_notices:
        return None
    from shardline.tasks.preemption import PreemptionPlugin

    return PreemptionPlugin(dask.preemption_notices, dask.preemption_poll_s, dask.preemption_drain_s)


def shard_contract(registry: ModelRegistry, model: ResolvedModel) -> Callable[[pa.Table], list[str]] | None:
    """The model's data contract for shard samples, or None when its bundle has no reference profile.

    The profile is read from the registry's copy of the bundle and checked against
    the sha256 its manifest records; great-expectations is imported only where the
    contract first runs (on the workers).

    Raises:
        IntegrityError: the stored profile does not match its manifest.
    """
    profile = registry.reference_profile(model)
    if profile is None:
        return None
    from shardline.quality.contracts import ShardContract

    return ShardContract(model.manifest, profile)


def _footer_problem(shard: ShardInfo, plan: JobPlan) -> tuple[str | None, int | None, pa.Schema | None]:
    """(why the model cannot read the shard or None, rows its footer declares, its schema when it could be read)."""
    try:
        footer = read_footer(shard.uri, plan.job.storage_options)
    except CorruptShard as e:
        return f"CorruptShard: {e}", None, None
    problems = schema_problems(footer.schema, plan.job.model.manifest.signature.inputs, plan.job.model.pinned)
    return (f"SchemaMismatch: {'; '.join(problems)}" if problems else None), footer.num_rows, footer.schema


def _first_schema(plan: JobPlan) -> pa.Schema | None:
    """The first pending shard's schema, or None: best effort, for ``_shadowed`` only (a shard that cannot be read
    here is the workers' to quarantine; a transient error loses only the note)."""
    if plan.job.passthrough is not None or not plan.todo:
        return None
    try:
        return read_footer(plan.todo[0].uri, plan.job.storage_options).schema
    except (CorruptShard, pa.ArrowException, OSError, ValueError):
        return None


def _shadowed(plan: JobPlan, schemas: list[pa.Schema | None]) -> list[str]:
    """Input columns auto passthrough leaves out of the parts for a model output of their name, in any of
    ``schemas`` (the pending shards' read here: every one of a job the flow checks, else the first), told once in
    the run's log; the summary carries them to the command. (The first shard's alone missed a column only later
    shards had.)"""
    shadowed = list(dict.fromkeys(column for schema in schemas if schema is not None
                                  for column in shadowed_columns(plan.job, schema)))
    if shadowed:
        run_logger().warning("%s", shadowed_note(shadowed))
    return shadowed


@task(name="validate", cache_policy=NO_CACHE)
def validate_shards(plan: JobPlan) -> JobPlan:
    """Read each pending shard's footer; quarantine those the model cannot read.

    Only for jobs of at most ``FLOW_FOOTER_CHECK_MAX`` pending shards: a larger job
    leaves the check to the workers (``score_shard`` checks each shard's schema as it
    opens it, with the same quarantine record), so planning 10,000 shards does not read
    10,000 footers in this process.
    """
    if len(plan.todo) > FLOW_FOOTER_CHECK_MAX:
        run_logger().info(
            "%d shards to score: their schemas are checked on the workers as each is opened", len(plan.todo)
        )
        return replace(plan, shadowed=_shadowed(plan, [_first_schema(plan)]))
    layout = OutputLayout(plan.job.output_uri, plan.job.storage_options, plan.job_id)
    with ThreadPoolExecutor(16) as pool:
        verdicts = list(pool.map(lambda s: _footer_problem(s, plan), plan.todo))
    shadowed = _shadowed(plan, [schema for _, _, schema in verdicts])
    keep, rejected = [], []
    for shard, (problem, rows, _) in zip(plan.todo, verdicts):
        if problem is None:
            keep.append(shard)
            continue
        record = PartRecord(
            shard=shard.uri, relative=shard.relative, fingerprint=shard.fingerprint,
            job_key=plan.job.job_key, status="quarantined", rows_in=rows,
            rows_quarantined=rows or 0, reason=problem,
        )
        layout.record(record)
        rejected.append(record)
        log_quarantined(record)
    return replace(plan, todo=keep, new=[*plan.new, *rejected], shadowed=shadowed)


def log_quarantined(record: PartRecord) -> None:
    """The run's log line for a quarantined shard: its name and the kind of problem. The reason itself is told
    once, where a person reads the outcome (the command's summary, the summary artifact, the manifest)."""
    kind = (record.reason or "").split(":", 1)[0] or "no reason recorded"
    run_logger().warning("quarantined %s (%s): the summary and the manifest say why", record.relative, kind)


def tell_watchers(watchers: Sequence[ProgressWatcher], settled: int, total: int, rows: int) -> None:
    """Call each progress watcher; one that raises (an event not sent) is logged: it must not stop the shards."""
    for watcher in watchers:
        try:
            watcher(settled, total, rows)
        except Exception:
            run_logger().exception("progress watcher %r failed", watcher)


@task(name="infer-shards", cache_policy=NO_CACHE)
def infer_shards(
    plan: JobPlan,
    scheduler_address: str,
    watchers: Sequence[ProgressWatcher] = (),
    max_in_flight: int | None = None,
) -> JobPlan:
    """Score every pending shard on the Dask cluster; collect records and failures.

    Args:
        plan: the validated plan; its ``todo`` shards are scored.
        scheduler_address: the Dask scheduler to submit to.
        watchers: called in this process as ``(shards of the job settled, shards in the job, rows
            scored this run)`` each time a shard settles (the SLA tracker, the flow's own watchers);
            the shards settled before (by earlier runs, or quarantined by ``validate``) count.
        max_in_flight: shards submitted to the cluster at once at most; None takes
            the plan's (``SHARDLINE_BATCH_MAX_IN_FLIGHT``), else 4 per worker thread
            (at least 8), re-sized as the cluster scales.
    """
    from distributed import Client

    logger = run_logger()
    total = plan.total_shards
    counts = {"settled": len(plan.done) + len(plan.new), "rows": 0}  # the job's shards settled already
    progress_key = batch_artifact_key("progress", plan.job.model.pinned, plan.job.output_uri, current_deployment())
    # called from sync code, Prefect's sync-compatible function returns the id itself, not a coroutine
    artifact = cast(UUID, create_progress_artifact(100.0 * counts["settled"] / total, key=progress_key,
                                                   description=f"batch job {plan.job_id}: shards settled"))
    new, failed = list(plan.new), dict(plan.failed)
    last_update = [0.0]

    def settled(shard: ShardInfo, record: PartRecord | None, error: BaseException | None) -> None:
        if plan.lease is not None and plan.lease.lost is not None:
            raise plan.lease.lost  # another job owns the folder now: stop handing out shards
        if record is None:  # not settled: a re-run scores it
            failed[shard.relative] = f"{type(error).__name__}: {error}"
            logger.error("shard %s failed: %s", shard.relative, error)
            return
        new.append(record)
        counts["rows"] += record.rows_out
        if record.status == "quarantined":
            log_quarantined(record)
        counts["settled"] += 1
        tell_watchers(watchers, counts["settled"], total, counts["rows"])
        now = time.monotonic()
        if now - last_update[0] > 1.0 or counts["settled"] == total:
            update_progress_artifact(artifact, 100.0 * counts["settled"] / total)
            last_update[0] = now

    with Client(scheduler_address) as client:
        if plan.preemption is not None:
            client.register_plugin(plan.preemption)  # every worker, present and future; idempotent
        bound = max_in_flight if max_in_flight is not None else plan.max_in_flight
        stats = dispatch_shards(client, plan.job, plan.todo, settled, bound, key_prefix=f"shard-{plan.job_id}")
    logger.info(
        "job %s: %d shards on the cluster in %.1f s (at most %d in flight, %d handed out again after lost workers)",
        plan.job_id, len(plan.todo), stats.seconds, stats.peak_in_flight, stats.resubmitted,
    )
    halted = stats.halted if isinstance(stats.halted, ShardlineError) else None
    return replace(plan, todo=[], new=new, failed=failed, halted=halted)


@task(name="commit", cache_policy=NO_CACHE)
def commit_job(plan: JobPlan, sla: dict[str, Any] | None = None, priority: str | None = None) -> JobSummary:
    """Write the job manifest and ``_SUCCESS`` once every shard is settled.

    ``sla`` (the flow's planned vs actual) and ``priority`` become sections of the manifest.

    Raises:
        JobFailed: some shards failed for reasons that are not their data; their
            neighbours' parts stay committed and a re-run resumes.
        ShardlineError: the failure that ended the job (``plan.halted``: the model cannot be loaded), its message
            followed by what happens to the parts committed.
    """
    summary = summarize(
        job_id=plan.job_id, model=plan.job.model.pinned, tenant=plan.tenant,
        output=plan.job.output_uri, total_shards=plan.total_shards, new=plan.new, skipped=plan.done,
        shadowed=plan.shadowed,
    )
    if plan.halted is not None:
        kept = summary.shards_committed + summary.shards_quarantined
        raise plan.halted.reworded(
            f"{plan.halted}; then run the same command again: the {kept} of {plan.total_shards} shards settled are "
            "kept, the rest is scored"
        )
    if plan.failed:
        first = next(iter(plan.failed.items()))
        raise JobFailed(
            f"{len(plan.failed)} of {plan.total_shards} shards failed (first: {first[0]}: {first[1]}); "
            f"{summary.shards_committed} parts are committed and kept: run the same command "
            "again to resume",
            plan.failed,
        )
    layout = OutputLayout(plan.job.output_uri, plan.job.storage_options, plan.job_id)
    if plan.finished:
        summary.manifest = layout.manifest_uri
        return summary
    records = sorted([*plan.done, *plan.new], key=lambda r: r.relative)
    model = plan.job.model
    manifest = JobManifest(
        job_id=plan.job_id,
        job_key=plan.job.job_key,
        tenant=plan.tenant,
        model=ManifestModel(reference=model.reference, pinned=model.pinned,
                            variant=model.manifest.tags.get("variant", "fp32"), digest=model.outputs_digest),
        input=plan.input_uri,
        output=plan.job.output_uri,
        passthrough=list(plan.job.passthrough) if plan.job.passthrough is not None else "auto",
        totals=summary.totals(),
        parts=[ManifestPart(part=r.part, shard=r.shard, rows=r.rows_out) for r in records if r.status == "committed"],
        quarantined=[
            ManifestQuarantine(shard=r.shard, rows=r.rows_in, reason=r.reason)
            for r in records if r.status == "quarantined"
        ],
        sla=sla,
        priority=priority,
    )
    summary.manifest = layout.commit_manifest(manifest, plan.lease.check if plan.lease is not None else lambda: None)
    return summary


@task(name="report", cache_policy=NO_CACHE)
def report_job(summary: JobSummary, planned: dict[str, Any] | None = None) -> dict[str, Any]:
    """Publish the run's artifacts and return the summary as plain data.

    Under keys stable per job (``tasks/artifacts.py``), so runs of one job form a history:
    a markdown summary (what a person reads first), the summary as a table, and, given
    ``planned`` (the SLA's planned vs actual), the SLA table.
    """
    key = partial(batch_artifact_key, model=summary.model, output=summary.output, deployment=current_deployment())
    data = summary.as_dict()
    create_markdown_artifact(summary_markdown(summary, planned), key=key("summary"),
                             description=f"batch job {summary.job_id}: summary")
    create_table_artifact(totals_table(summary), key=key("totals"), description=f"batch job {summary.job_id}")
    if planned is not None:
        publish_sla_table(summary.job_id, planned, key=key("sla"))
    return data
