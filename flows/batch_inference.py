"""The batch inference flow: plan -> validate -> infer shards on Dask -> commit -> report."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.states import Completed, Failed, State

from shardline.settings import BatchSettings, DaskSettings, RuntimeSettings, StorageSettings
from shardline.tasks.batch import commit_job, infer_shards, plan_batch_job, report_job, validate_shards
from shardline.tasks.cluster import dask_scheduler


@flow(name="batch-inference", log_prints=True, validate_parameters=True)
def batch_inference(
    model: str,
    input_uri: str,
    output_uri: str,
    tenant: str = "default",
    passthrough: list[str] | None = None,
    batch_rows: int | None = None,
    variant: str | None = None,
) -> State[Any]:
    """Score every row of the Parquet shards under ``input_uri`` with ``model``.

    Args:
        model: ``name@alias`` or ``name:version`` in the registry.
        input_uri: folder (or file) of Parquet shards, local or any fsspec URL.
        output_uri: folder for the scored parts, one per shard, named after it.
        tenant: who the job runs for; recorded in the manifest.
        passthrough: input columns copied to the output; None keeps every column
            the model does not read.
        batch_rows: rows per batch; bounds worker memory (default from settings).
        variant: a precision variant to run ('int8'), or 'auto' to let placement pick
            from the version's profiles; the fp32 model when None.

    Returns:
        Completed with the summary; a Completed state named "Quarantined" when some
        shards were quarantined; Failed when none could be scored.
    """
    storage, runtime, dask = StorageSettings(), RuntimeSettings(), DaskSettings()
    batch = BatchSettings() if batch_rows is None else BatchSettings(batch_rows=batch_rows)
    plan = plan_batch_job(model, input_uri, output_uri, tenant, passthrough, storage, batch, runtime, dask, variant)
    plan = validate_shards(plan)
    if plan.todo:
        with dask_scheduler(dask) as address:
            plan = infer_shards(plan, address)
    summary = report_job(commit_job(plan))
    if summary["shards_quarantined"] == 0:
        return Completed(message=f"{summary['rows_out']} rows scored", data=summary)
    message = (
        f"{summary['shards_quarantined']} of {summary['shards']} shards quarantined "
        f"({summary['rows_quarantined']} rows); reasons in {summary['manifest']}"
    )
    if summary["rows_out"] == 0:
        return Failed(message=f"every shard was quarantined: {message}", data=summary)
    return Completed(name="Quarantined", message=message, data=summary)
