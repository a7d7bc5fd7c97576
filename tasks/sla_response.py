"""What the SLA automations do: try to add Dask workers, and always leave a notification.

Scaling is honest about what it can reach:

- a dask-kubernetes cluster named by ``cluster_name``: scaled up by ``step`` workers
  through the operator (``KubeCluster.from_name(...).scale``);
- a scheduler at an address (``SHARDLINE_DASK_CLUSTER=address``): reached to count its
  workers, but a bare scheduler cannot start workers; the notification says so (scale
  its worker deployment, or let deploy/'s DaskAutoscaler do it);
- a local cluster: it lives inside the job's own process; nothing to scale from here.

The notification (``tasks/notifications.py``) is a JSON file under ``<home>/notifications/batch/``
plus a Prefect markdown artifact on the response run: what a pager or chat integration would pick up.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from shardline.settings import DaskSettings


def _kubernetes_scale(cluster_name: str, step: int) -> str:
    try:
        from dask_kubernetes.operator import KubeCluster
    except ImportError:
        return f"cannot scale {cluster_name!r}: dask-kubernetes is not installed here (pip install 'shardline[kubernetes]')"
    try:
        cluster = KubeCluster.from_name(cluster_name, shutdown_on_close=False)
        workers = len(cluster.scheduler_info.get("workers", {}))
        cluster.scale(workers + step)
        return f"scaled dask-kubernetes cluster {cluster_name!r} from {workers} to {workers + step} workers"
    except Exception as e:  # no cluster, no API access: say so, the notification still goes out
        return f"could not scale dask-kubernetes cluster {cluster_name!r}: {type(e).__name__}: {e}"


@task(name="scale-up", cache_policy=NO_CACHE)
def scale_up(dask: DaskSettings, cluster_name: str | None, step: int) -> str:
    """Add ``step`` workers where that is possible; returns what was done (or why not)."""
    if cluster_name:
        return _kubernetes_scale(cluster_name, step)
    if dask.cluster == "address" and dask.address:
        try:
            from distributed import Client

            with Client(dask.address, timeout=10) as client:
                workers = len(client.scheduler_info().get("workers", {}))
        except Exception as e:
            return f"scheduler {dask.address} is not reachable ({type(e).__name__}: {e}); nothing scaled"
        return (
            f"scheduler {dask.address} has {workers} workers; a scheduler at an address cannot start workers "
            "itself: scale its worker deployment (or its DaskAutoscaler); nothing scaled"
        )
    if dask.cluster == "kubernetes":
        return "the job's dask-kubernetes cluster is made per job; pass cluster_name to scale it; nothing scaled"
    return "the cluster is a LocalCluster inside the job's process; nothing to scale from outside"
