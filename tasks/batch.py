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
from typing import Any, Callable

from prefect import task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from shardline.tasks.logs import run_logger

from shardline.errors import CorruptShard, JobFailed
from shardline.runtimes import RuntimeOptions
from shardline.placement import BatchWorkload, CostTable, candidates_from_profiles, choose_placement
from shardline.profiling import machine_kind
from shardline.settings import BatchSettings, DaskSettings, PlacementSettings, RuntimeSettings, StorageSettings
from shardline.signature import schema_problems
from shardline.storage.jobs import JobSummary, job_id, job_key, summarize
from shardline.storage.output import OutputLayout, PartRecord, check_part_names, split_done
from shardline.storage.registry import ModelRegistry, ResolvedModel
from shardline.storage.scoring import ScoringJob, score_shard
from shardline.storage.shards import ShardInfo, list_shards, read_footer
from shardline.tasks.cluster import threads_per_call

# In-process listeners (the CLI's progress bar): called with (shards settled, shards to do, rows).
ProgressListener = Callable[[int, int, int], None]
progress_listeners: list[ProgressListener] = []


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


def choose_variant(registry: ModelRegistry, model: ResolvedModel, variant: str | None, local: bool) -> ResolvedModel:
    """The model a job runs: fp32 unless a variant is named; 'auto' lets placement choose.

    'auto' weighs the version's profiles (measured on this machine kind when the
    cluster is local, on every kind otherwise) by rows/s per cost and takes the best
    variant. A variant changes the numbers (within the golden-set delta its gate
    allowed), so a job only runs one when asked to.
    """
    if variant is None:
        return model
    if variant != "auto":
        return model.variant(variant)
    here = machine_kind()
    profiles = {k: p for k, p in registry.profiles(model.name, model.version).items() if not local or p.get("machine") == here}
    candidates = candidates_from_profiles(profiles, CostTable(per_hour=PlacementSettings().costs_per_hour))
    known = [c for c in candidates if c.variant == "fp32" or c.variant in model.variants]
    if not known:
        run_logger().info("variant auto: %s has no profile on %s; running fp32", model.pinned, here)
        return model
    chosen = choose_placement(BatchWorkload(), known)
    run_logger().info("variant auto: %s", chosen.reason)
    return model if chosen.candidate.variant == "fp32" else model.variant(chosen.candidate.variant)


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
) -> JobPlan:
    """Pin the model (and its variant), list the shards, and split off those a previous run settled."""
    registry = ModelRegistry(storage.registry, storage.storage_options)
    resolved = choose_variant(registry, registry.resolve(model), variant, local=dask.cluster == "local")
    shards = list_shards(input_uri, storage.storage_options, batch.shard_suffixes)
    check_part_names(shards)
    key = job_key(resolved.digest, passthrough)
    layout = OutputLayout(output_uri, storage.storage_options)
    todo, done = split_done(shards, layout.read_ledger(), key, layout.present_parts())
    if todo:
        layout.clear_success()
    options = RuntimeOptions(runtime.device, runtime.intra_op_threads or threads_per_call(dask))
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
    )
    run_logger().info(
        "job %s: %s pinned to %s; %d shards, %d already settled, %d to score",
        job_id(key, shards), model, resolved.pinned, len(shards), len(done), len(todo),
    )
    return JobPlan(job, job_id(key, shards), tenant, input_uri, todo, done, len(shards))


def _footer_problem(shard: ShardInfo, plan: JobPlan) -> tuple[str | None, int | None]:
    """(why the model cannot read the shard or None, rows its footer declares)."""
    try:
        footer = read_footer(shard.uri, plan.job.storage_options)
    except CorruptShard as e:
        return f"CorruptShard: {e}", None
    problems = schema_problems(footer.schema, plan.job.model.manifest.signature.inputs, plan.job.model.pinned)
    return (f"SchemaMismatch: {'; '.join(problems)}" if problems else None), footer.num_rows


@task(name="validate", cache_policy=NO_CACHE)
def validate_shards(plan: JobPlan) -> JobPlan:
    """Read each pending shard's footer; quarantine those the model cannot read."""
    layout = OutputLayout(plan.job.output_uri, plan.job.storage_options)
    with ThreadPoolExecutor(16) as pool:
        verdicts = list(pool.map(lambda s: _footer_problem(s, plan), plan.todo))
    keep, rejected = [], []
    for shard, (problem, rows) in zip(plan.todo, verdicts):
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
        run_logger().warning("quarantined %s: %s", shard.relative, problem)
    return replace(plan, todo=keep, new=[*plan.new, *rejected])


@task(name="infer-shards", cache_policy=NO_CACHE)
def infer_shards(plan: JobPlan, scheduler_address: str) -> JobPlan:
    """Score every pending shard on the Dask cluster; collect records and failures."""
    from distributed import Client, as_completed

    logger = run_logger()
    total = len(plan.todo)
    artifact = create_progress_artifact(0.0, description=f"batch job {plan.job_id}: shards settled")
    new, failed = list(plan.new), dict(plan.failed)
    rows = 0
    last_update = 0.0
    with Client(scheduler_address) as client:
        shared = client.scatter(plan.job, broadcast=True)
        futures = client.map(score_shard, [shared] * total, plan.todo, pure=False)
        relative = {f.key: s.relative for f, s in zip(futures, plan.todo)}
        for settled, future in enumerate(as_completed(futures), start=1):
            if future.status == "error":
                error = future.exception()
                failed[relative[future.key]] = f"{type(error).__name__}: {error}"
                logger.error("shard %s failed: %s", relative[future.key], error)
            else:
                record: PartRecord = future.result()
                new.append(record)
                rows += record.rows_out
                if record.status == "quarantined":
                    logger.warning("quarantined %s: %s", record.relative, record.reason)
            for listener in progress_listeners:
                listener(settled, total, rows)
            now = time.monotonic()
            if now - last_update > 1.0 or settled == total:
                update_progress_artifact(artifact, 100.0 * settled / total)
                last_update = now
    return replace(plan, todo=[], new=new, failed=failed)


@task(name="commit", cache_policy=NO_CACHE)
def commit_job(plan: JobPlan) -> JobSummary:
    """Write the job manifest and ``_SUCCESS`` once every shard is settled.

    Raises:
        JobFailed: some shards failed for reasons that are not their data; their
            neighbours' parts stay committed and a re-run resumes.
    """
    summary = summarize(
        job_id=plan.job_id, model=plan.job.model.pinned, tenant=plan.tenant,
        output=plan.job.output_uri, total_shards=plan.total_shards, new=plan.new, skipped=plan.done,
    )
    if plan.failed:
        first = next(iter(plan.failed.items()))
        raise JobFailed(
            f"{len(plan.failed)} of {plan.total_shards} shards failed (first: {first[0]}: {first[1]}); "
            f"{summary.shards_committed} parts are committed and kept: run the same command "
            "again to resume",
            plan.failed,
        )
    records = sorted([*plan.done, *plan.new], key=lambda r: r.relative)
    layout = OutputLayout(plan.job.output_uri, plan.job.storage_options)
    manifest: dict[str, Any] = {
        "job_id": plan.job_id,
        "tenant": plan.tenant,
        "model": {"reference": plan.job.model.reference, "pinned": plan.job.model.pinned,
                  "variant": plan.job.model.manifest.tags.get("variant", "fp32"), "digest": plan.job.model.digest},
        "input": plan.input_uri,
        "output": plan.job.output_uri,
        "passthrough": list(plan.job.passthrough) if plan.job.passthrough is not None else "auto",
        "totals": {k: v for k, v in summary.as_dict().items() if k.startswith(("shards", "rows"))},
        "parts": [
            {"part": r.part, "shard": r.shard, "rows": r.rows_out}
            for r in records if r.status == "committed"
        ],
        "quarantined": [
            {"shard": r.shard, "rows": r.rows_in, "reason": r.reason}
            for r in records if r.status == "quarantined"
        ],
    }
    summary.manifest = layout.commit_manifest(manifest)
    return summary


@task(name="report", cache_policy=NO_CACHE)
def report_job(summary: JobSummary) -> dict[str, Any]:
    """Publish the summary as a Prefect table artifact and return it as plain data."""
    data = summary.as_dict()
    rows = [{"measure": k, "value": str(v)} for k, v in data.items() if k != "quarantined"]
    rows += [{"measure": f"quarantined {k}", "value": v} for k, v in summary.quarantined.items()]
    create_table_artifact(rows, description=f"batch job {summary.job_id}")
    return data
