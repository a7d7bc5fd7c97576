"""The batch flow's job-level steps: the admission task, the job's record and SLA tracker, fair share, metering,
outcome.

The flow (``flows/batch_inference.py``) wires these with the shard tasks of
``tasks/batch.py``; settings are read once there (:meth:`BatchJobSettings.read`, in
``tasks/batch_admission.py`` with admission itself, which the command's checks use without Prefect) and
passed down, so no task reads the environment.
"""

from __future__ import annotations

import contextlib
from datetime import datetime, timezone
from typing import Any, Iterator, Sequence

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, Failed, State

from shardline.figures import rows_quarantined
from shardline.sla_projection import make_sla
from shardline.storage.job_identity import JobSummary
from shardline.storage.job_records import JobParameters, JobRecord, JobRecords
from shardline.storage.lease import holding_output  # noqa: F401 - the flow holds the lease its plan took with it
from shardline.storage.ledger import LedgerStore
from shardline.tasks.arguments import whole
from shardline.tasks.batch import JobPlan, ProgressWatcher, commit_job, infer_shards, report_job, tell_watchers
from shardline.tasks.batch_admission import Admission, BatchJobSettings, admit
from shardline.tasks.batch_telemetry import CURRENT, JobTelemetry, job_span, serve_metrics, watching
from shardline.tasks.cluster import dask_scheduler
from shardline.tasks.fairness import batch_slots, cluster_capacity, fair_share, meter_run
from shardline.tasks.sla_tracking import SlaTracker, TrackedJob, planned_vs_actual


@task(name="admit", cache_policy=NO_CACHE)
def admit_job(
    request: JobParameters, sla: str | None, deadline: str | None, settings: BatchJobSettings
) -> Admission:
    """The flow's admission (:func:`admit`): a deadline already past is kept for a job an earlier run began (a
    resumed job's, breached from its start) and refused for a new one, as `batch run` refuses it (a deployment's
    run gets no check from the command).

    Raises:
        InvalidSetting: a deadline already past for a new job; else as :func:`admit`.
        AccessDenied, QuotaExceeded: as :func:`admit`.
    """
    admitted = admit(request, sla, deadline, settings)
    if deadline and admitted.sla.deadline <= admitted.started and not _begun(admitted, settings):
        batch = settings.batch
        make_sla(admitted.started, sla, deadline, batch.default_sla, batch.sla_margin)  # raises the command's message
    return admitted


def apply_tenant_budget(admitted: Admission, settings: BatchJobSettings, deployment: str | None) -> Admission:
    """A deployment's run under its tenant's monthly budget (docs/cost.md, "Budgets"), before anything is
    written, as `batch run` applies it in the command to its own runs: ``hard`` refuses a job no earlier run
    began (new work), ``soft`` runs it at the low priority on spot capacity (where its cluster has any), ``warn``
    runs it as it is; each said in one line of the run's log and by the ``shardline.budget.warning`` event. A run
    from no deployment (``deployment`` None: the command's, which applied the budget before it started) is left
    as it is.

    Raises:
        BudgetExceeded: the tenant is at its hard limit and the job is new.
        ShardlineError: the tenants file or the price table is wrong.
    """
    if deployment is None:
        return admitted
    from dataclasses import replace

    from shardline.cost.budgets import tenant_budget_state
    from shardline.event_catalog import BUDGET_WARNING, tenant_resource
    from shardline.tasks.events import emit
    from shardline.tasks.fairness import job_capacity
    from shardline.tasks.logs import run_logger

    tenant = admitted.request.tenant
    state = tenant_budget_state(settings.tenancy.tenants_file, tenant, settings.storage.home,
                                settings.storage.storage_options)
    if state is None or state.state == "ok":
        return admitted
    emit(BUDGET_WARNING, tenant_resource(tenant), {**state.to_json(), "tier": "batch"})
    capacity = job_capacity("spot", settings.dask, settings.metering)
    line = state.job_line(state.state == "hard" and _begun(admitted, settings),
                          f"this job runs at low priority on {capacity} capacity")
    run_logger().warning("%s", line)
    if state.state != "soft":
        return admitted
    request = admitted.request.model_copy(update={"priority": "low", "capacity_type": "spot"})
    return replace(admitted, request=request, priority="low", capacity_type=capacity)


def _begun(admitted: Admission, settings: BatchJobSettings) -> bool:
    """Whether an earlier run began this job (its record is kept), read without writing (``survey_job``)."""
    from shardline.tasks.batch_survey import survey_job

    job = admitted.request
    survey = survey_job(job.model, job.input_uri, job.output_uri, job.tenant, job.passthrough, settings.storage,
                        settings.batch, settings.dask, job.variant, admitted.link_roots,
                        admitted.tenant is None or admitted.tenant.custom_code)
    records = JobRecords(settings.storage.home, settings.storage.storage_options)
    return survey.settled is not None or records.find(survey.job_id) is not None


def _run_context() -> tuple[str | None, str | None]:
    """(deployment name, flow run id) of this run, when Prefect knows them."""
    from prefect.runtime import flow_run

    from shardline.tasks.artifacts import current_deployment

    return current_deployment(), flow_run.id


@contextlib.contextmanager
def track_job(plan: JobPlan, admitted: Admission, settings: BatchJobSettings) -> Iterator[SlaTracker]:
    """Write the job record and run its SLA tracker while the body runs; a body that raises, or a step of this
    one after the record's first write (its metrics, its span), ends the job failed.

    The tracker is also a progress watcher (give it to :func:`score_shards`); a body
    that returns leaves the outcome to :func:`job_outcome`.
    """
    records = JobRecords(settings.storage.home, settings.storage.storage_options)
    deployment_name, flow_run_id = _run_context()
    earlier = records.find(plan.job_id)
    record = JobRecord(
        job_id=plan.job_id, model_pinned=plan.job.model.pinned, started_at=admitted.started,
        deadline=admitted.sla.deadline, parameters=admitted.request, shards_total=plan.total_shards,
        shards_done=len(plan.done), flow_run_id=flow_run_id, runs=earlier.runs + 1 if earlier else 1,
    )
    tracker = SlaTracker(
        TrackedJob(plan.job_id, admitted.request.tenant, plan.job.model.pinned, admitted.priority, deployment_name,
                   flow_run_id),
        admitted.sla, records, record, settings.batch.sla_check_interval_s, settings.batch.sla_window_s,
    )
    model = plan.job.model
    try:  # from the record's first write on, whatever raises ends it failed: it never stays "running"
        tracker.start()
        serve_metrics(settings.batch.metrics_host, settings.batch.metrics_port)
        telemetry = JobTelemetry(plan.job_id, plan.tenant, model.name, model.version, plan.total_shards, tracker,
                                 job_span(plan.job_id, plan.tenant, model.name, model.version, plan.total_shards))
        telemetry.already_settled(plan.done, "resumed")
        with watching(telemetry):
            yield tracker
    except BaseException as e:
        tracker.finish("failed", f"{type(e).__name__}: {e}")
        raise


def score_shards(
    plan: JobPlan, admitted: Admission, settings: BatchJobSettings, watchers: Sequence[ProgressWatcher] = ()
) -> JobPlan:
    """Score the pending shards within the tenant's fair share on the job's Dask cluster; meter what they took.

    With none pending (all settled before, or quarantined by ``validate``) the watchers hear once that every
    shard of the job is settled."""
    telemetry = CURRENT.get()
    if telemetry is not None:  # those the footer check quarantined (``validate_shards``)
        telemetry.already_settled(plan.new, "validated")
    if not plan.todo:
        tell_watchers(watchers, plan.total_shards, plan.total_shards, 0)
        return plan
    todo = list(plan.todo)
    with fair_share(admitted.tenant, admitted.priority, len(todo), settings.tenancy) as max_in_flight:
        scored = len(plan.new)
        placed = cluster_capacity(admitted.request.capacity_type, settings.dask)
        with dask_scheduler(settings.dask, plan.job_id, placed) as address:
            began = datetime.now(timezone.utc)
            plan = infer_shards(whole(plan), address, watchers=watchers, max_in_flight=max_in_flight)
            window = (began, datetime.now(timezone.utc))
    if settings.metering.enabled:
        ledger = LedgerStore(settings.storage.home, settings.storage.storage_options)
        slots = batch_slots(settings.dask, max_in_flight, len(todo))
        meter_run(ledger, plan, settings.metering, admitted.device, plan.new[scored:], todo, window, slots,
                  admitted.capacity_type)
    return plan


def finish_job(plan: JobPlan, admitted: Admission, tracker: SlaTracker) -> dict[str, Any]:
    """Commit the manifest (with the SLA's planned vs actual and the priority) and publish the run's artifacts;
    the tracker's final verdict is taken at the manifest's ``finished``, so the two cannot disagree."""
    rows = sum(r.rows_out for r in plan.new)
    finished = datetime.now(timezone.utc)
    planned = planned_vs_actual(admitted.sla, finished, plan.total_shards, rows)
    summary = commit_job(whole(plan), sla=planned, priority=admitted.priority)
    tracker.settled(finished)
    return report_job(summary, planned)


def job_outcome(summary: dict[str, Any], tracker: SlaTracker) -> State[Any]:
    """The flow's final state (and the job record's): Completed, Completed "Quarantined", or Failed (every shard
    quarantined: nothing was scored). The job record says ``quarantined`` for both of the last: it settled, and a
    re-run will not help (its ``failed`` is a fault a re-run resumes)."""
    done = JobSummary.model_validate(summary)
    if done.shards_quarantined == 0:
        tracker.finish("completed", f"{done.rows_out:,} rows scored", done.rows_scored)
        return Completed(message=f"{done.rows_out:,} rows scored", data=summary)
    rows = rows_quarantined(done.rows_quarantined, done.shards_unreadable)
    message = f"{done.shards_quarantined:,} of {done.shards:,} shards quarantined ({rows})"
    if done.shards_committed == 0:
        message = (f"every shard was quarantined: {message}; the data cannot be scored as it is (running again "
                   f"will not help): the reasons are in {done.manifest}")
        tracker.finish("quarantined", message, done.rows_scored)
        return Failed(message=message, data=summary)
    message += f"; reasons in {done.manifest}"
    tracker.finish("quarantined", message, done.rows_scored)
    return Completed(name="Quarantined", message=message, data=summary)
