"""The Dask cluster a batch job runs its shards on, chosen by settings, not code."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Iterator, cast

from shardline.errors import InvalidSetting
from shardline.settings import DaskSettings

# LocalClusters this process keeps running across jobs (the warm batch runner's, see ``warm_cluster``),
# by the settings they were started with.
_WARM: dict[str, str] = {}


@contextlib.contextmanager
def dask_scheduler(settings: DaskSettings, job_id: str | None = None,
                   capacity_type: str | None = None) -> Iterator[str]:
    """Yield a scheduler address: a new LocalCluster, an existing one, or the job's own dask-kubernetes cluster.

    A cluster this function started is closed on exit; an existing one is left alone. With
    ``SHARDLINE_DASK_CLUSTER=local``, a cluster this process keeps warm for these settings
    (``warm_cluster``) is used instead of a new one. ``SHARDLINE_DASK_CLUSTER=kubernetes`` needs the
    ``job_id``: the cluster is named from it (``shardline.tasks.kube_cluster``), its workers on ``capacity_type``
    nodes when given (a local or shared cluster runs where it runs: ``fairness.job_capacity``).
    """
    if settings.cluster == "address":
        if not settings.address:
            raise InvalidSetting(
                "SHARDLINE_DASK_CLUSTER=address needs SHARDLINE_DASK_ADDRESS=tcp://HOST:PORT"
            )
        yield settings.address
        return
    if settings.cluster == "kubernetes":
        with _kubernetes_cluster(settings, job_id, capacity_type) as address:
            yield address
        return
    if settings.cluster == "local" and (warm := _WARM.get(settings.model_dump_json())) is not None:
        yield warm
        return
    import dask
    from distributed import LocalCluster

    # The scheduler runs in this process: keep its chatter out of the user's console.
    logging.getLogger("distributed").setLevel(logging.WARNING)
    # A worker lost with no notice counts against its shards' allowed failures; a few
    # preemptions must never fail a job (the scheduler reads this when it starts).
    config = {"distributed.scheduler.allowed-failures": settings.allowed_failures, **quiet_cluster_config(),
              **worker_memory_config(), **worker_preload_config()}
    with dask.config.set(config), LocalCluster(
        n_workers=settings.resolved_workers(),
        threads_per_worker=settings.threads_per_worker,
        processes=True,
        dashboard_address=None,
        # no dashboard; the scheduler's health/metrics server on any free port, not 8787
        scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
        silence_logs=logging.WARNING,
    ) as cluster:
        yield cluster.scheduler_address


# Dask's defaults for what only a dashboard shows, which the clusters this module starts do not serve:
# each worker's statistical profiler (every task thread's stack sampled every 10 ms), the event loop's
# blocked-loop check every 20 ms and psutil's system samples every 500 ms. Off, workers use less CPU and an idle
# cluster almost none (figures: bench/README.md, "Figures behind the code"). What the user configured (DASK_* variables, a Dask YAML file) wins.
QUIET_CLUSTER = {
    "distributed.worker.profile.enabled": False,
    "distributed.admin.tick.interval": "1s",
    "distributed.admin.system-monitor.interval": "2s",
}


# Arrow's allocator for the workers this module starts: jemalloc, not pyarrow's default (mimalloc). Measured on
# 2 cores with the logistic regression, 4M rows a job on a warm runner, two runs each: peak tree memory 724-730 /
# 842-855 / 883-887 MiB at shards of 50k / 200k / 1M rows against mimalloc's 783 / 1,024-1,025 / 999-1,011 (flat
# within 1.23x instead of 1.31x: a worker keeps ~300 MiB at 50k-row shards and ~415 from 200k with mimalloc, which
# holds on to the pages of the larger decoded batches), at the same or better rows/s (1.28-1.45M / 1.76M /
# 1.62-1.69M against 1.19-1.51M / 1.51-1.67M / 1.33-1.59M). The system allocator took memory lower still but
# rows/s down by a third (fresh pages on every batch). Only where pyarrow has jemalloc and pages are 4 KiB (its
# build assumes them: on 64 KiB-page kernels, some arm64 machines, it must not run), and never over the user's
# own ARROW_DEFAULT_MEMORY_POOL.
ARROW_POOL_VARIABLE = "ARROW_DEFAULT_MEMORY_POOL"

# glibc's mmap threshold for the same workers. Dask starts every worker with MALLOC_TRIM_THRESHOLD_ (freed memory at
# the top of the heap goes back to the system), and setting it also turns off glibc's adaptive mmap threshold: every
# allocation past 128 KiB is then a mapping of its own, its pages faulted in and zeroed on every batch (onnxruntime's
# answers, the finite check's masks: what numpy allocates; Arrow's buffers are jemalloc's). At glibc's largest
# threshold, 32 MiB, they come from the heap and are reused. Measured on 2 cores, 4M rows a job on a warm runner, two
# rounds: the logistic regression 1-5% more rows/s at every shard size in both rounds, the GBT the same within the
# noise, peak tree memory the same within 2% (bench/README.md, "Figures behind the code"). Left out where the user
# set it, and where no MALLOC_TRIM_THRESHOLD_ is set for the workers (glibc's own adaptive threshold then does this).
MMAP_THRESHOLD_VARIABLE = "MALLOC_MMAP_THRESHOLD_"
WORKER_MMAP_THRESHOLD = 32 * 1024 * 1024
_SPAWN_ENVIRON = "distributed.nanny.pre-spawn-environ"


def worker_memory_config() -> dict[str, Any]:
    """Dask config that starts each local worker with Arrow's jemalloc pool and glibc's 32 MiB mmap threshold (see
    above): each variable where it applies and the user chose none."""
    import mmap

    import dask
    import distributed  # noqa: F401  (its defaults, MALLOC_TRIM_THRESHOLD_ among them, join dask.config on import)
    import pyarrow as pa

    chosen: dict[str, Any] = {}
    if ARROW_POOL_VARIABLE not in os.environ and mmap.PAGESIZE == 4096:
        try:
            pa.jemalloc_memory_pool()
            chosen[f"{_SPAWN_ENVIRON}.{ARROW_POOL_VARIABLE}"] = "jemalloc"
        except NotImplementedError:  # a pyarrow built without it
            pass
    spawned = dask.config.get(_SPAWN_ENVIRON, None) or {}
    if (spawned.get("MALLOC_TRIM_THRESHOLD_") is not None and MMAP_THRESHOLD_VARIABLE not in os.environ
            and spawned.get(MMAP_THRESHOLD_VARIABLE) is None):
        chosen[f"{_SPAWN_ENVIRON}.{MMAP_THRESHOLD_VARIABLE}"] = str(WORKER_MMAP_THRESHOLD)
    return chosen


def worker_preload_config() -> dict[str, Any]:
    """Dask config that adds ``worker_logs`` (a worker's shutdown race kept out of the console) to the preloads
    of the workers this module starts, after any the user configured."""
    import dask
    import distributed  # noqa: F401  (its defaults join dask.config on import)

    from shardline.tasks import worker_logs

    preloads = list(dask.config.get("distributed.worker.preload", None) or [])
    return {"distributed.worker.preload": [*preloads, worker_logs.MODULE]}


def quiet_cluster_config() -> dict[str, Any]:
    """``QUIET_CLUSTER`` less the keys whose value is no longer Dask's own default (the user set them)."""
    import dask
    import distributed  # noqa: F401  (its defaults join dask.config.defaults on import)

    chosen = {}
    for key, value in QUIET_CLUSTER.items():
        library = [dask.config.get(key, None, config=cast(dict[str, Any], defaults))
                   for defaults in dask.config.defaults]
        if dask.config.get(key, None) in [d for d in library if d is not None]:
            chosen[key] = value
    return chosen


@contextlib.contextmanager
def warm_cluster(settings: DaskSettings) -> Iterator[str | None]:
    """Keep one LocalCluster running while the block runs, for every job of this process with these settings.

    Yields its scheduler address; None (and nothing started) unless ``settings.cluster`` is ``local``:
    an existing or Kubernetes cluster is not this process's to keep.
    """
    if settings.cluster != "local":
        yield None
        return
    key = settings.model_dump_json()
    with dask_scheduler(settings) as address:
        _WARM[key] = address
        try:
            yield address
        finally:
            _WARM.pop(key, None)


@contextlib.contextmanager
def _kubernetes_cluster(settings: DaskSettings, job_id: str | None, capacity_type: str | None) -> Iterator[str]:
    if not settings.kubernetes_spec or not Path(settings.kubernetes_spec).is_file():
        raise InvalidSetting(
            f"SHARDLINE_DASK_KUBERNETES_SPEC={settings.kubernetes_spec!r} is not a file; point it at "
            "a DaskCluster template such as deploy/k8s/base/tenant/dask/cluster-cpu.yaml"
        )
    if not job_id:
        raise InvalidSetting("SHARDLINE_DASK_CLUSTER=kubernetes makes one cluster per job: pass the job's id")
    import yaml

    from shardline.tasks.kube_cluster import job_cluster

    template = yaml.safe_load(Path(settings.kubernetes_spec).read_text())
    with job_cluster(settings, job_id, template, capacity_type) as address:
        yield address


def threads_per_call(settings: DaskSettings) -> int:
    """onnxruntime threads per shard so that local workers together fill the cores once."""
    if settings.cluster != "local":
        return 0
    busy = settings.resolved_workers() * settings.threads_per_worker
    return max(1, (os.cpu_count() or 1) // busy)
