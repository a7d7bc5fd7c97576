"""Hand shards to a Dask cluster a bounded number at a time, and collect their records.

This is plain Dask (no Prefect): one Prefect task calls :func:`dispatch_shards`, so a
job of 10,000 shards is one task run, not 10,000. At most ``max_in_flight`` shards are
on the cluster at once, so the scheduler's memory and the flow's bookkeeping stay
flat however many shards a job has, and a lost worker costs only what it held.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from shardline.storage.output import PartRecord
from shardline.storage.scoring import ScoringJob, score_shard
from shardline.storage.shards import ShardInfo

# Shards in flight per worker thread, and at least this many in all (a cluster that is
# still scaling up reports few threads).
IN_FLIGHT_PER_THREAD = 4
MIN_IN_FLIGHT = 8
# A shard whose workers kept dying (Dask's KilledWorker after allowed-failures) is
# handed to the cluster again this many times before the job counts it as failed.
LOST_WORKER_RESUBMITS = 2

Settled = Callable[[ShardInfo, PartRecord | None, BaseException | None], None]


def in_flight_target(threads: int, requested: int | None) -> int:
    """How many shards to keep submitted: the caller's bound, else 4 per worker thread (at least 8)."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {requested}")
        return requested
    return max(MIN_IN_FLIGHT, IN_FLIGHT_PER_THREAD * threads)


def is_lost_worker(error: BaseException) -> bool:
    """True for the errors Dask raises when the workers running a task died, not the task."""
    return type(error).__name__ in {"KilledWorker", "FutureCancelledError", "CancelledError"}


@dataclass
class DispatchStats:
    """What the dispatcher did, for logs and the benchmark."""

    submitted: int = 0
    resubmitted: int = 0
    peak_in_flight: int = 0
    seconds: float = 0.0
    failures: dict[str, str] = field(default_factory=dict)


def _cluster_threads(client: Any) -> int:
    try:
        workers = client.scheduler_info(n_workers=-1).get("workers", {})
    except Exception:  # an old scheduler or a hiccup: fall back to the minimum
        return 0
    return sum(int(w.get("nthreads", 1)) for w in workers.values())


def dispatch_shards(
    client: Any,
    job: ScoringJob,
    shards: Sequence[ShardInfo],
    on_settled: Settled,
    max_in_flight: int | None = None,
    key_prefix: str = "score-shard",
    resubmits: int = LOST_WORKER_RESUBMITS,
) -> DispatchStats:
    """Score ``shards`` on the cluster, at most ``max_in_flight`` at once.

    ``on_settled(shard, record, error)`` is called in this process for each shard as
    it settles: with its ledger record, or with the error that failed it (after
    ``resubmits`` extra tries when its workers kept dying). Worker loss below Dask's
    allowed-failures is invisible here: the scheduler runs the shard elsewhere.
    """
    from distributed import as_completed

    started = time.perf_counter()
    stats = DispatchStats()
    queue: Iterator[ShardInfo] = iter(shards)
    attempts: dict[str, int] = {}
    by_key: dict[str, ShardInfo] = {}
    counter = itertools.count()
    pending = as_completed()
    limit = in_flight_target(_cluster_threads(client), max_in_flight)
    last_sized = time.monotonic()

    # The job (model manifest, data contract with its reference profile: tens of KB)
    # goes to the cluster once, as a task of its own that each shard depends on:
    # workers fetch it once from a peer, and should every copy be lost with its
    # workers, the scheduler recomputes it from this task rather than failing shards.
    # Its key must not share the shards' prefix (Dask groups durations by the key's first
    # words): the scheduler would take the job's microseconds for every shard's duration,
    # never steal a shard, and leave every shard on the one worker holding the job.
    shared = client.submit(_the_job, job, key=job_task_key(key_prefix), pure=False)

    def submit(shard: ShardInfo) -> None:
        key = f"{key_prefix}-{next(counter)}"
        by_key[key] = shard
        pending.add(client.submit(score_shard, shared, shard, key=key, pure=False))
        stats.submitted += 1

    def top_up() -> None:
        for shard in itertools.islice(queue, max(0, limit - pending.count())):
            submit(shard)
        stats.peak_in_flight = max(stats.peak_in_flight, pending.count())

    top_up()
    for future in pending:  # ``submit`` adds to ``pending`` while it is iterated
        shard = by_key.pop(future.key)
        if future.status == "error":
            error = future.exception()
            tries = attempts.get(shard.relative, 0)
            if is_lost_worker(error) and tries < resubmits:
                attempts[shard.relative] = tries + 1
                stats.resubmitted += 1
                submit(shard)
            else:
                stats.failures[shard.relative] = f"{type(error).__name__}: {error}"
                on_settled(shard, None, error)
        else:
            on_settled(shard, future.result(), None)
        future.release()
        if max_in_flight is None and time.monotonic() - last_sized > 2.0:
            limit = in_flight_target(_cluster_threads(client), None)  # the cluster may have scaled
            last_sized = time.monotonic()
        top_up()
    shared.release()
    stats.seconds = time.perf_counter() - started
    return stats


def job_task_key(key_prefix: str) -> str:
    """The job task's key: ``job-<prefix>``, a task group of its own apart from the shards' ``<prefix>-<n>``."""
    return f"job-{key_prefix}"


def _the_job(job: ScoringJob) -> ScoringJob:
    """The job as a task result, so that it is shipped once and recomputable (see ``dispatch_shards``)."""
    return job

