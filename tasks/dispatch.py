"""Hand shards to a Dask cluster a bounded number at a time, and collect their records.

This is plain Dask (no Prefect): one Prefect task calls :func:`dispatch_shards`, so a
job of 10,000 shards is one task run, not 10,000. At most ``max_in_flight`` tasks are
on the cluster at once, so the scheduler's memory and the flow's bookkeeping stay
flat however many shards a job has, and a lost worker costs only what it held.

Small shards go in groups (``group_shards``): one task scores a few, one after the other,
each committed and recorded as it finishes, and each settles here with its own record or
error when the task ends. A task costs the cluster CPU besides its work (the client, the
scheduler and the worker each handle it): a quarter of a 50,000-row shard's (figures: bench/README.md, "Figures behind the code").
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pickle
import threading
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from shardline.errors import InvalidBundle, JobStopped, NotInstalled
from shardline.storage.output import PartRecord
from shardline.storage.scoring import ScoringJob, ShardSamples, release_scratch, score_shard
from shardline.storage.shards import ShardInfo
from shardline.tasks.batch_telemetry import CURRENT, JobTelemetry

# Tasks in flight per worker thread, and at least this many in all (a cluster that is
# still scaling up reports few threads).
IN_FLIGHT_PER_THREAD = 4
MIN_IN_FLIGHT = 8
# A shard whose workers kept dying (Dask's KilledWorker after allowed-failures) is
# handed to the cluster again this many times before the job counts it as failed.
LOST_WORKER_RESUBMITS = 2
# Shards are grouped up to this many compressed bytes a task (a shard this large or larger goes alone),
# at most MAX_GROUP a task. A task costs the runner's scheduler and client ~6 ms of CPU and its worker some more:
# at 64 MiB, 200k-row shards of 30 float features (58 MB) went one a task, and the logistic regression scored
# 2.9-3.2M rows/s on 2 cores against 3.1-3.4M at 128 MiB (two a task; bench/README.md).
GROUP_BYTES = 128 * 1024 * 1024
MAX_GROUP = 8

Settled = Callable[[ShardInfo, PartRecord | None, BaseException | None], None]

# A request to stop the job this context runs: set by whoever runs the flow (the warm batch runner,
# cli/batch_runner.py, when the command that sent the job is interrupted or killed). The
# dispatcher then hands out no more shards, withdraws the tasks the cluster has not started, lets the
# running ones finish (a worker commits each part and ledger record, so the lease is held until
# then; a group stops after the shard under way, ``StopSignal``) and raises JobStopped; a re-run
# resumes from the parts committed.
STOP_REQUEST: ContextVar[threading.Event | None] = ContextVar("shardline_dispatch_stop", default=None)
# How often, at most, a group task asks whether its job was stopped (a round trip to the scheduler, ~0.5 ms
# here): before the next shard once this long has passed since the task was handed to the cluster or last asked, so
# that a task handed out and done within it never asks. A group of small shards that are slow to score (text for an
# embedding model, prompts) took minutes to stop when it scored them all; and tasks the scheduler had already sent to
# a worker, waiting there behind the one running, cannot be withdrawn (the scheduler does not know they have not
# started), so they ran to their end after a stop: a task that waited this long asks before its first shard.
STOP_CHECK_S = 1.0
STOP_WATCH_S = 0.1  # how often the dispatcher's watcher looks for the stop request while no task ends


@dataclass(frozen=True)
class StopSignal:
    """Where a group task on a worker learns that its job was stopped: a Dask ``Event`` named ``event``, set by
    the dispatcher on a stop request, read at most every ``every_s`` (``STOP_CHECK_S``), counted from
    ``handed_at`` (the wall clock, ``time.time()``, when the dispatcher handed the task to the cluster; workers
    may be other machines, whose monotonic clocks differ)."""

    event: str
    every_s: float
    handed_at: float = 0.0

    def requested(self) -> bool:
        """Whether the job was stopped; False when the scheduler cannot be asked (the shards go on)."""
        from distributed import Event

        try:
            return bool(Event(self.event).is_set())
        except Exception:  # noqa: BLE001 - no client on this worker, or no answer: score, as before stop signals
            return False


def in_flight_target(threads: int, requested: int | None) -> int:
    """How many tasks (a shard, or a group of small ones) to keep submitted: the caller's bound, else 4 per
    worker thread (at least 8)."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {requested}")
        return requested
    return max(MIN_IN_FLIGHT, IN_FLIGHT_PER_THREAD * threads)


def is_lost_worker(error: BaseException) -> bool:
    """True for the errors Dask raises when the workers running a task died, not the task."""
    return type(error).__name__ in {"KilledWorker", "FutureCancelledError", "CancelledError"}


def group_shards(shards: Sequence[ShardInfo], threads: int) -> list[list[ShardInfo]]:
    """The shards as the tasks that score them, in order: consecutive shards together up to ``GROUP_BYTES``
    and ``MAX_GROUP`` a task, never so few tasks that a worker thread would go without (a job keeps at
    least ``IN_FLIGHT_PER_THREAD`` per thread of ``threads``, at least ``MIN_IN_FLIGHT``)."""
    spread = max(MIN_IN_FLIGHT, IN_FLIGHT_PER_THREAD * threads)
    most = max(1, min(MAX_GROUP, len(shards) // spread))
    groups: list[list[ShardInfo]] = []
    current: list[ShardInfo] = []
    size = 0
    for shard in shards:
        if current and (len(current) >= most or size + shard.size > GROUP_BYTES):
            groups.append(current)
            current, size = [], 0
        current.append(shard)
        size += shard.size
    if current:
        groups.append(current)
    return groups


# Called as each shard of a group starts (its index in the group, the shard); what it returns is called with the
# shard's outcome once it is settled. ``score_traced`` makes each shard's span with it.
ShardHook = Callable[[int, ShardInfo], Callable[[PartRecord | None, BaseException | None], None]]


def score_group(job: ScoringJob, shards: list[ShardInfo], hook: ShardHook | None = None,
                stop: StopSignal | None = None) -> list[tuple[PartRecord | None, BaseException | None]]:
    """Score a group's shards one after the other (each committed as ``score_shard`` commits it): each one's
    record, or the error that failed it, which does not stop the shards after it. Their capture samples are
    written together at the end, one file for the group (``ShardSamples``). The matrices the shards' batches were
    stacked into are kept from shard to shard and let go at the end (``release_scratch``). ``hook``: see
    ``ShardHook``. With ``stop``, the group ends early once its job is stopped: the outcomes of the shards it
    scored, fewer than it was given (the rest stay to do)."""
    settled: list[tuple[PartRecord | None, BaseException | None]] = []
    captured = ShardSamples(job)
    ask_at = (stop.handed_at or time.time()) + stop.every_s if stop is not None else 0.0
    try:
        for index, shard in enumerate(shards):
            if stop is not None and time.time() >= ask_at:
                if stop.requested():
                    break
                ask_at = time.time() + stop.every_s
            done = hook(index, shard) if hook is not None else None
            outcome: tuple[PartRecord | None, BaseException | None]
            try:
                outcome = (score_shard(job, shard, captured), None)
            except Exception as e:  # noqa: BLE001 - the shard's own failure, reported for it alone
                outcome = (None, _portable(e))
            if done is not None:
                done(*outcome)
            settled.append(outcome)
    finally:
        release_scratch()
        captured.write()
    return settled


def score_traced(job: ScoringJob, shards: list[ShardInfo], traceparents: list[str], stop: StopSignal | None = None
                 ) -> list[tuple[PartRecord | None, BaseException | None]]:
    """``score_group`` with each shard's work a span on this worker (``shardline.batch.score``), the child of the
    shard span its ``traceparent`` names; the spans are exported before the task returns (a worker may be closed
    right after). Tracing is configured here, on the worker, from its ``OTEL_*`` variables, once per process.
    The group is scored as one, as without tracing: one capture file, the matrices kept from shard to shard."""
    from shardline.observability import tracing

    tracing.configure("shardline-batch-worker")

    def traced(index: int, shard: ShardInfo) -> Callable[[PartRecord | None, BaseException | None], None]:
        span = tracing.start("shardline.batch.score", parent=tracing.parent_from(traceparents[index]),
                             attributes={"shardline.batch.shard": shard.relative, "process.pid": os.getpid()})

        def end(record: PartRecord | None, error: BaseException | None) -> None:
            if record is not None:
                span.set_attribute("shardline.batch.rows", record.rows_out)
                span.set_attribute("shardline.batch.outcome", record.status)
            tracing.end(span, error=error)
        return end

    try:
        return score_group(job, shards, traced, stop)
    finally:
        tracing.flush()


def _portable(error: BaseException) -> BaseException:
    """The error itself when it survives the trip back from the worker (pickle), else its name and message."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - an exception class whose arguments do not round-trip
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


@dataclass
class DispatchStats:
    """What the dispatcher did, for logs and the benchmark."""

    submitted: int = 0  # shards handed to the cluster (again after a lost worker included)
    tasks: int = 0  # the tasks that held them
    resubmitted: int = 0
    peak_in_flight: int = 0
    seconds: float = 0.0
    failures: dict[str, str] = field(default_factory=dict)
    halted: BaseException | None = None  # the failure that ended the dispatch (``ends_the_job``), if one did


def ends_the_job(error: BaseException) -> bool:
    """Whether a shard's failure fails every shard of its job, now and on a re-run: the model's bundle cannot be
    loaded (damaged in the registry, or not a valid bundle), or a package its runtime or code needs is not installed
    where it runs. Scoring more shards would only repeat it."""
    return isinstance(error, (InvalidBundle, NotInstalled))


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
    """Score ``shards`` on the cluster (small ones in groups, ``group_shards``), at most ``max_in_flight``
    tasks at once.

    ``on_settled(shard, record, error)`` is called in this process for each shard as
    it settles: with its ledger record, or with the error that failed it (after
    ``resubmits`` extra tries of its task when its workers kept dying). Worker loss below
    Dask's allowed-failures is invisible here: the scheduler runs the task elsewhere.

    A shard that fails for a reason every other shard meets (``ends_the_job``: the model cannot be loaded) ends
    the dispatch as a stop does, without JobStopped: no more shards are handed out, those the cluster has not
    started are withdrawn and stay to do, those running settle; ``stats.halted`` holds that error.

    Raises:
        JobStopped: ``STOP_REQUEST`` was set before every shard was handed out (see there).
    """
    started = time.perf_counter()
    stop = STOP_REQUEST.get()
    threads = _cluster_threads(client)
    limit = in_flight_target(threads, max_in_flight)
    shared = _shipped(client, job, key_prefix, stop)
    run = _Dispatch(client, shared, key_prefix, limit, stop, iter(group_shards(shards, threads)), CURRENT.get())
    attempts: dict[str, int] = {}
    settled_count = 0
    run.watch()
    try:
        run.top_up()
        for future in run.pending:  # ``submit`` adds to ``pending`` while it is iterated
            group = run.taken(future)
            if future.status == "cancelled":  # withdrawn on a stop request before it started: it stays to do
                future.release()
                continue
            if future.status == "error" and run.resubmitted(future, group, attempts, resubmits):
                continue
            outcomes = _outcomes(future, group)
            if len(outcomes) < len(group) and not run.stop_requested():  # only a stop ends a group early
                outcomes += [(None, RuntimeError("its task ended without scoring it"))] * (len(group) - len(outcomes))
            for shard, (record, failure) in zip(group, outcomes):  # on a stop, a group's unscored shards stay to do
                if failure is not None:
                    run.stats.failures[shard.relative] = f"{type(failure).__name__}: {failure}"
                    if ends_the_job(failure):
                        run.halt(failure)
                if run.telemetry is not None:
                    run.telemetry.settled(shard, record, failure)
                on_settled(shard, record, failure)
            settled_count += len(outcomes)
            future.release()
            if max_in_flight is None:
                run.resize()
            run.top_up()
    finally:
        run.close()
    shared.release()
    run.stats.seconds = time.perf_counter() - started
    if run.stopping and run.stats.halted is None:
        raise JobStopped(
            f"stopped on request with {len(shards) - settled_count} of {len(shards)} shards not scored (the parts "
            "committed are kept): run the same command again to resume"
        )
    return run.stats


def _shipped(client: Any, job: ScoringJob, key_prefix: str, stop: threading.Event | None) -> Any:
    """The job on the cluster, once, as a task of its own that each shard depends on, copied to every worker.

    The job (model manifest, data contract with its reference profile: tens of KB) is fetched by workers
    from a peer, and should every copy be lost with its workers, the scheduler recomputes it from this task
    rather than failing shards. Its key must not share the shards' prefix (Dask groups durations by the
    key's first words): the scheduler would take the job's microseconds for every shard's duration, never
    steal a shard, and leave every shard on the one worker holding the job.
    """
    shared = client.submit(_the_job, job, key=job_task_key(key_prefix), pure=False)
    _on_every_worker(client, shared, stop)
    return shared


class _Dispatch:
    """One ``dispatch_shards`` call's tasks in flight: what each holds, how many may be, and handing out more."""

    def __init__(self, client: Any, shared: Any, key_prefix: str, limit: int, stop: threading.Event | None,
                 queue: Iterator[list[ShardInfo]], telemetry: JobTelemetry | None = None) -> None:
        from distributed import as_completed

        self.client, self.shared, self.key_prefix, self.limit, self.stop, self.queue = (
            client, shared, key_prefix, limit, stop, queue)
        self.telemetry = telemetry
        self.stats = DispatchStats()
        self.stopping = False
        self.pending = as_completed()
        self.futures: dict[str, Any] = {}  # key -> future, of the tasks in flight
        self.by_key: dict[str, list[ShardInfo]] = {}
        self.counter = itertools.count()
        self.last_sized = time.monotonic()
        # where the groups look for a stop; a name of its own per dispatch (jobs share a warm runner's cluster)
        self.signal = None if stop is None else StopSignal(f"{key_prefix}-stop-{uuid.uuid4().hex}", STOP_CHECK_S)
        self._ended = threading.Event()
        self._lock = threading.Lock()
        self._signalled = False

    def submit(self, group: list[ShardInfo]) -> None:
        """Hand one task (a shard, or a group of them) to the cluster."""
        key = f"{self.key_prefix}-{next(self.counter)}"
        self.by_key[key] = group
        parents = self.telemetry.submitting(group) if self.telemetry is not None else None
        # each task's own stop signal, counted from now: one that waits on a worker behind another asks first
        signal = None if self.signal is None else dataclasses.replace(self.signal, handed_at=time.time())
        # every task a group's (a single shard too): one answer shape, and each asks about a stop the same way
        if parents is not None:
            self.futures[key] = self.client.submit(score_traced, self.shared, group, parents, signal, key=key,
                                                   pure=False)
        else:
            self.futures[key] = self.client.submit(score_group, self.shared, group, None, signal, key=key,
                                                   pure=False)
        self.pending.add(self.futures[key])
        self.stats.submitted += len(group)
        self.stats.tasks += 1

    def top_up(self) -> None:
        """Submit tasks up to the bound; on a stop request (or a halt), withdraw the unstarted ones instead (once)."""
        if self.stop_requested():
            if not self.stopping:
                self.stopping = True
                _withdraw_unstarted(self.client, self.futures)
            return
        for group in itertools.islice(self.queue, max(0, self.limit - self.pending.count())):
            self.submit(group)
        self.stats.peak_in_flight = max(self.stats.peak_in_flight, self.pending.count())

    def stop_requested(self) -> bool:
        return self.stats.halted is not None or (self.stop is not None and self.stop.is_set())

    def halt(self, error: BaseException) -> None:
        """End the dispatch for a failure that ends the job (``ends_the_job``): hand out no more shards, withdraw
        the unstarted tasks (``top_up``) and tell the running groups to stop after their shard under way."""
        if self.stats.halted is not None:
            return
        self.stats.halted = error
        with self._lock:
            if self.signal is not None and not self._ended.is_set():  # (without a stop request, groups have none)
                self._signal(True)

    def watch(self) -> None:
        """Raise the groups' stop signal as soon as the stop request comes, from a thread of its own: the
        dispatcher's loop hears of it only when a task ends, and a group is a task."""
        stop, signal = self.stop, self.signal
        if stop is None or signal is None:
            return

        def watch() -> None:
            while not stop.wait(STOP_WATCH_S):
                if self._ended.is_set():
                    return
            with self._lock:
                if not self._ended.is_set():
                    self._signal(True)

        threading.Thread(target=watch, name="shardline-stop-watch", daemon=True).start()

    def close(self) -> None:
        """Stop watching (the watcher ends by itself within ``STOP_WATCH_S``; nothing waits for it), and take the
        stop signal off the scheduler (every task has ended)."""
        with self._lock:
            self._ended.set()
            if self._signalled:
                self._signal(False)

    def _signal(self, stopped: bool) -> None:
        from distributed import Event

        assert self.signal is not None
        self._signalled = self._signalled or stopped
        try:
            event = Event(self.signal.event, client=self.client)
            if stopped:
                event.set()
            else:
                event.clear()
        except Exception:  # noqa: BLE001 - no answer from the scheduler: the groups finish their shards, as before
            pass

    def taken(self, future: Any) -> list[ShardInfo]:
        """The shards a task that has ended held, no longer in flight."""
        del self.futures[future.key]
        return self.by_key.pop(future.key)

    def resubmitted(self, future: Any, group: list[ShardInfo], attempts: dict[str, int], resubmits: int) -> bool:
        """Hand a task whose workers died to the cluster again, up to ``resubmits`` times; True when it was."""
        tries = attempts.get(group[0].relative, 0)
        if not is_lost_worker(future.exception()) or tries >= resubmits:
            return False
        attempts[group[0].relative] = tries + 1
        self.stats.resubmitted += len(group)
        self.submit(group)  # the shards it committed before it was lost are scored again, to the same parts
        future.release()
        return True

    def resize(self) -> None:
        """Every 2 s, the bound again from the cluster's threads: the cluster may have scaled."""
        if time.monotonic() - self.last_sized > 2.0:
            self.limit = in_flight_target(_cluster_threads(self.client), None)
            self.last_sized = time.monotonic()


def _outcomes(future: Any, group: list[ShardInfo]) -> list[tuple[PartRecord | None, BaseException | None]]:
    """Each shard's record or error from a task that has ended (a failed task fails all of its shards)."""
    if future.status == "error":
        return [(None, future.exception())] * len(group)
    return list(future.result())


# The scheduler's states of a task no worker has been handed: withdrawing one of these loses no work.
UNSTARTED_STATES = frozenset({"released", "waiting", "queued", "no-worker"})


def _withdraw_unstarted(client: Any, futures: dict[str, Any]) -> list[str]:
    """Cancel the tasks the cluster has not started; those running or done finish and settle (they commit as they
    end). Which is which is decided and acted on in one step of the scheduler's event loop: a snapshot of the
    tasks processing taken here, then a cancel, would also cancel a task that finished in between, and its
    committed parts would never settle. A task submitted so lately that the scheduler has not heard of it yet is
    not withdrawn: it runs and settles. Returns the keys withdrawn."""
    keys, client_id = list(futures), client.id

    def cancel_unstarted(dask_scheduler: Any) -> list[str]:
        unstarted = [key for key in keys
                     if (task := dask_scheduler.tasks.get(key)) is not None and task.state in UNSTARTED_STATES]
        if unstarted:
            dask_scheduler.stimulus_cancel(unstarted, client_id, force=False, reason="stop requested",
                                           msg="the job was stopped before this task started")
        return unstarted

    try:
        withdrawn: list[str] = client.run_on_scheduler(cancel_unstarted)
    except Exception:  # no answer from the scheduler: withdraw nothing, let every shard in flight finish
        return []
    return withdrawn


def _on_every_worker(client: Any, shared: Any, stop: threading.Event | None) -> None:
    """Wait for the job task, then copy its result to every worker, before any shard is submitted.

    Dask places a task that is not root-ish (a group of at most 2 tasks per worker thread: a job of few
    shards, or its tail) on a worker holding its dependencies, whatever that worker's load: with the job
    on one worker, a job of 4 long shards on 2 workers ran 3 on that one and 1 on the other (work
    stealing moved one). With a copy everywhere each shard goes to the least busy worker. A worker that
    joins later fetches it from a peer. A stop request ends the wait; a job task that failed is left for
    the shards to report.
    """
    from distributed import wait

    while True:
        try:
            wait([shared], timeout=0.25)
            break
        except TimeoutError:  # a cluster with no worker yet (scaling up from zero)
            if stop is not None and stop.is_set():
                return
    if shared.status != "finished":
        return
    try:
        client.replicate([shared])
    except Exception:  # placement only: the shards still run wherever the scheduler puts them
        return


def job_task_key(key_prefix: str) -> str:
    """The job task's key: ``job-<prefix>``, a task group of its own apart from the shards' ``<prefix>-<n>``."""
    return f"job-{key_prefix}"


def _the_job(job: ScoringJob) -> ScoringJob:
    """The job as a task result, so that it is shipped once and recomputable (see ``dispatch_shards``)."""
    return job

