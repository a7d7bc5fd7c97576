"""The batch inference flow: admit -> plan -> validate -> infer shards on Dask -> commit -> report.

Admission (before anything is read or written): the tenant is in the tenants file,
the input and output lie under its storage prefixes, its GPU-hours of the day are
not used up, and a deployment's run meets the tenant's monthly budget (`batch run`
meets it in the command). While shards run, an SLA tracker projects the finish,
keeps the job record (`shardline batch status`) and emits the SLA events
prefect.yaml answers.
The flow only wires tasks (tasks/batch_job.py, tasks/batch.py); it reads the
settings once and passes them down.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

from prefect import flow
from prefect.states import State

from shardline.tasks.arguments import whole
from shardline.tasks.artifacts import current_deployment
from shardline.tasks.batch import ProgressWatcher, plan_batch_job, validate_shards
from shardline.tasks.batch_admission import BatchJobSettings
from shardline.tasks.batch_job import (
    JobParameters,
    admit_job,
    apply_tenant_budget,
    finish_job,
    holding_output,
    job_outcome,
    score_shards,
    track_job,
)


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
    capacity_type: Literal["on-demand", "spot"] | None = None,
    watchers: Sequence[ProgressWatcher] = (),
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
        capacity_type: spot (or on-demand): the job's workers on that capacity only, where the job makes its own
            cluster (Kubernetes); what `batch run` asks for a tenant past its budget's soft limit. None: as the
            cluster places them.
        watchers: for a run in this process only (the CLI's progress bar, a test): called
            as ``(shards of the job settled, shards in the job, rows scored this run)`` each
            time a shard settles (quarantined shards and those of earlier runs count as settled).

    Returns:
        Completed with the summary; a Completed state named "Quarantined" when some
        shards were quarantined; Failed when none could be scored.
    """
    settings = BatchJobSettings.read(batch_rows)
    request = JobParameters(model=model, input_uri=input_uri, output_uri=output_uri, tenant=tenant,
                            passthrough=passthrough, batch_rows=batch_rows, variant=variant, priority=priority,
                            capacity_type=capacity_type)
    admitted = admit_job(request, sla, deadline, settings)
    admitted = apply_tenant_budget(admitted, settings, current_deployment())  # `batch run` applies its own
    job = admitted.request  # from here on the job uses the locations it was admitted with, as resolved
    plan = plan_batch_job(model, job.input_uri, job.output_uri, tenant, passthrough, settings.storage,
                          settings.batch, settings.runtime, settings.dask, variant, admitted.link_roots,
                          admitted.tenant is None or admitted.tenant.custom_code)
    with holding_output(plan), track_job(plan, admitted, settings) as tracker:
        plan = validate_shards(whole(plan))
        plan = score_shards(plan, admitted, settings, watchers=[tracker, *watchers])
        summary = finish_job(plan, admitted, tracker)
    return job_outcome(summary, tracker)
