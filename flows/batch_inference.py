"""The batch inference flow: admit -> plan -> validate -> infer shards on Dask -> commit -> report.

Admission (before anything is read or written): the tenant is in the tenants file,
the input and output lie under its storage prefixes, its GPU-hours of the day are
not used up. While shards run, an SLA tracker projects the finish, keeps the job
record (`shardline batch status`) and emits the SLA events prefect.yaml answers.
"""

from __future__ import annotations

from datetime import datetime, timezone
from functools import partial
from typing import Any

from prefect import flow
from prefect.states import Completed, Failed, State

from shardline.settings import BatchSettings, DaskSettings, RuntimeSettings, StorageSettings, TenancySettings
from shardline.sla import make_sla
from shardline.storage.fs import resolve_location
from shardline.storage.job_records import JobParameters, JobRecord, JobRecords
from shardline.storage.metering import MeteringLedger
from shardline.tasks.batch import commit_job, infer_shards, plan_batch_job, release_output, report_job, validate_shards
from shardline.tasks.cluster import dask_scheduler
from shardline.tasks.fairness import check_gpu_quota, device_kind, fair_share, meter_run, priority_of
from shardline.tasks.sla import SlaTracker, TrackedJob, planned_vs_actual
from shardline.tenants import admit_locations, batch_tenant, resolved_prefixes


def _run_context() -> tuple[str | None, str | None]:
    """(deployment name, flow run id) of this run, when Prefect knows them."""
    from prefect.runtime import deployment, flow_run

    return deployment.name, flow_run.id


@flow(name="batch-inference", log_prints=True, validate_parameters=True)
def batch_inference(
    model: str,
    input_uri: str,
    output_uri: str,
    tenant: str = "default",
    passthrough: list[str] | None = None,
    batch_rows: int | None = None,
    variant: str | None = None,
    sla: str | None = None,
    deadline: str | None = None,
    priority: str | None = None,
) -> State[Any]:
    """Score every row of the Parquet shards under ``input_uri`` with ``model``.

    Args:
        model: ``name@alias`` or ``name:version`` in the registry.
        input_uri: folder (or file) of Parquet shards, local or any fsspec URL.
        output_uri: folder for the scored parts, one per shard, named after it.
        tenant: who the job runs for; with a tenants file, its prefixes and quotas apply.
        passthrough: input columns copied to the output; None keeps every column
            the model does not read.
        batch_rows: rows per batch; bounds worker memory (default from settings).
        variant: a precision variant to run ('int8'), or 'auto' to let placement pick
            from the version's profiles; the fp32 model when None.
        sla: how long the job may take ('2h', '90m'); default SHARDLINE_BATCH_DEFAULT_SLA.
        deadline: when it must be done (ISO 8601, '2026-12-01T06:00Z'); instead of ``sla``.
        priority: high, normal or low (backfills); default the tenant's.

    Returns:
        Completed with the summary; a Completed state named "Quarantined" when some
        shards were quarantined; Failed when none could be scored.
    """
    started = datetime.now(timezone.utc)
    storage, runtime, dask, tenancy = StorageSettings(), RuntimeSettings(), DaskSettings(), TenancySettings()
    batch = BatchSettings() if batch_rows is None else BatchSettings(batch_rows=batch_rows)
    promise = make_sla(started, sla, deadline, batch.default_sla, batch.sla_margin, allow_past=True)
    allowed = batch_tenant(tenancy.tenants_file, tenant)
    # From here on the job uses the locations it was admitted with: resolved, as the file system sees them.
    resolve = partial(resolve_location, storage_options=storage.storage_options)
    input_uri, output_uri = admit_locations(allowed, input_uri, output_uri, resolve)
    job_priority = priority_of(allowed, priority)
    device = device_kind(runtime)
    ledger = MeteringLedger(storage.home, storage.storage_options)
    if allowed is not None:
        check_gpu_quota(ledger, allowed, device)

    link_roots = resolved_prefixes(allowed, resolve) if allowed is not None else None  # where input links may lead
    plan = plan_batch_job(model, input_uri, output_uri, tenant, passthrough, storage, batch, runtime, dask, variant,
                          link_roots)
    try:  # the plan took the output's lease (one job per output folder): give it back however the job ends
        records = JobRecords(storage.home, storage.storage_options)
        deployment_name, flow_run_id = _run_context()
        earlier = records.find(plan.job_id)
        record = JobRecord(
            job_id=plan.job_id, model_pinned=plan.job.model.pinned, started_at=started, deadline=promise.deadline,
            parameters=JobParameters(model=model, input_uri=input_uri, output_uri=output_uri, tenant=tenant,
                                     passthrough=passthrough, batch_rows=batch_rows, variant=variant, priority=priority),
            shards_total=plan.total_shards, shards_done=len(plan.done), flow_run_id=flow_run_id,
            runs=earlier.runs + 1 if earlier else 1,
        )
        tracker = SlaTracker(
            TrackedJob(plan.job_id, tenant, plan.job.model.pinned, job_priority, deployment_name, flow_run_id),
            promise, records, record, batch.sla_check_interval_s, batch.sla_window_s,
        )
        tracker.start()
        try:
            plan = validate_shards(plan)
            if plan.todo:
                with fair_share(allowed, job_priority, len(plan.todo), tenancy) as max_in_flight:
                    scored = len(plan.new)
                    with dask_scheduler(dask) as address:
                        plan = infer_shards(plan, address, watchers=[tracker], max_in_flight=max_in_flight)
                meter_run(ledger, tenant, plan.job_id, device, plan.new[scored:])
            finished = datetime.now(timezone.utc)
            rows = sum(r.rows_out for r in plan.new)
            planned = planned_vs_actual(promise, finished, plan.total_shards, rows)
            summary = report_job(commit_job(plan, {"sla": planned, "priority": job_priority}), planned)
        except BaseException as e:
            tracker.finish("failed", f"{type(e).__name__}: {e}")
            raise
    finally:
        release_output(plan)
    if summary["shards_quarantined"] == 0:
        tracker.finish("completed", f"{summary['rows_out']} rows scored", summary["rows_scored"])
        return Completed(message=f"{summary['rows_out']} rows scored", data=summary)
    message = (
        f"{summary['shards_quarantined']} of {summary['shards']} shards quarantined "
        f"({summary['rows_quarantined']} rows); reasons in {summary['manifest']}"
    )
    if summary["rows_out"] == 0:
        tracker.finish("failed", message)
        return Failed(message=f"every shard was quarantined: {message}", data=summary)
    tracker.finish("quarantined", message, summary["rows_scored"])
    return Completed(name="Quarantined", message=message, data=summary)
