"""What the SLA automations do: try to add Dask workers, and always leave a notification.

Scaling is honest about what it can reach:

- ``SHARDLINE_DASK_CLUSTER=kubernetes``: the job's own DaskCluster, named from its job id
  (``shardline.tasks.kube_cluster.job_cluster_name``), is scaled by ``step`` workers within its bounds: the
  default worker group's replicas and the DaskAutoscaler's minimum are patched, never above its maximum nor
  below its minimum, and never down while a worker is busy (the scheduler is asked first);
- a scheduler at an address (``SHARDLINE_DASK_CLUSTER=address``): reached to count its
  workers, but a bare scheduler cannot start workers; the notification says so;
- a local cluster: it lives inside the job's own process; nothing to scale from here.

The notification (``tasks/notifications.py``) is a JSON file under ``<home>/notifications/batch/``
plus a Prefect markdown artifact on the response run: what a pager or chat integration would pick up.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from shardline.settings import DaskSettings


def _kubernetes_scale(dask: DaskSettings, job_id: str, step: int) -> str:
    if not job_id:
        return "no job id came with the event: its Dask cluster cannot be named; nothing scaled"
    try:
        from shardline.tasks.kube_cluster import scale_job_cluster

        return scale_job_cluster(dask, job_id, step)
    except Exception as e:  # no extra, no API access: say so, the notification still goes out
        return f"could not scale job {job_id}'s Dask cluster: {type(e).__name__}: {e}"


@task(name="scale-up", cache_policy=NO_CACHE)
def scale_up(dask: DaskSettings, job_id: str, step: int) -> str:
    """Add ``step`` workers to the job's cluster where that is possible (fewer, when negative and none is
    busy); returns what was done (or why not)."""
    if dask.cluster == "kubernetes":
        return _kubernetes_scale(dask, job_id, step)
    if dask.cluster == "address" and dask.address:
        try:
            from distributed import Client

            with Client(dask.address, timeout=10) as client:
                workers = len(client.scheduler_info().get("workers", {}))
        except Exception as e:
            return f"scheduler {dask.address} is not reachable ({type(e).__name__}: {e}); nothing scaled"
        return (
            f"scheduler {dask.address} has {workers} workers; a scheduler at an address cannot start workers "
            "itself: scale its worker deployment; nothing scaled"
        )
    return "the cluster is a LocalCluster inside the job's process; nothing to scale from outside"
