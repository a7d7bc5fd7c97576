"""The flow prefect.yaml's SLA automations run: scale the Dask cluster up if it can, and notify."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from prefect import flow

from shardline.settings import DaskSettings, StorageSettings
from shardline.tasks.notifications import record_notification
from shardline.tasks.sla_response import scale_up


@flow(name="batch-sla-response", log_prints=True)
def sla_response(
    event: str,
    job_id: str = "",
    tenant: str = "",
    deadline: str | None = None,
    projected_finish: str | None = None,
    scale_step: int = 2,
) -> dict[str, Any]:
    """Answer a batch SLA event (at-risk, breached, or a nightly job that never completed).

    Args:
        event: the event's name, e.g. shardline.batch.sla-at-risk.
        job_id: the batch job it is about ('' when the trigger is proactive).
        tenant: the job's tenant.
        deadline: the job's deadline (ISO 8601).
        projected_finish: when the job was projected to finish (None: unknown).
        scale_step: workers to add to the job's cluster (SHARDLINE_DASK_CLUSTER=kubernetes: the job's own
            DaskCluster, within its minimum and maximum); negative gives workers back, only while none is busy.

    Returns:
        The notification: the event, the job and what was done.
    """
    action = scale_up(DaskSettings(), job_id, scale_step)
    notice = {
        "event": event, "job_id": job_id, "tenant": tenant, "deadline": deadline,
        "projected_finish": projected_finish, "action": action,
        "at": datetime.now(timezone.utc).isoformat(),
    }
    notice["notification"] = record_notification(StorageSettings(), notice)
    return notice
