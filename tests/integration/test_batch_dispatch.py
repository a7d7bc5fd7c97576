"""The dispatcher on a real LocalCluster: it spreads a job's shards over every worker and stops on request;
the clusters this platform starts go without the dashboard's sampling, their workers on Arrow's jemalloc pool."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from dask.utils import key_split

from shardline.build.examples import write_shards
from shardline.runtimes import RuntimeOptions
from shardline.storage.job_identity import job_key
from shardline.storage.output import OutputLayout, PartRecord
from shardline.storage.registry import ModelRegistry
from shardline.storage.scoring import ScoringJob
from shardline.storage.shards import ShardInfo, list_shards
from shardline.tasks.dispatch import dispatch_shards, group_shards, job_task_key, score_group, score_traced
from tests.conftest import BuiltModel


def scoring_job(
    model_dir: Path, tmp_path: Path, shards: int, batch_rows: int, job_id: str
) -> tuple[ScoringJob, list[ShardInfo]]:
    """breast-cancer:1 in a fresh registry, ``shards`` shards of 20,000 rows, and a job scoring them."""
    registry = ModelRegistry(str(tmp_path / "registry"))
    registry.push(model_dir)
    model = registry.resolve("breast-cancer:1")
    write_shards(tmp_path / "input", shards, 20_000)
    job = ScoringJob(
        job_key=job_key(model.outputs_digest, None), model=model, output_uri=str(tmp_path / "out"),
        passthrough=None, batch_rows=batch_rows, cache_dir=str(tmp_path / "cache"), runtime=RuntimeOptions("cpu", 1),
        job_id=job_id,
    )
    return job, list_shards(str(tmp_path / "input"))


def test_the_job_task_is_a_task_group_of_its_own() -> None:
    # Dask estimates a task's duration from its group (the key's first words): shards grouped
    # with the job task would look instant, and none would be moved off the worker holding the job.
    prefix = "shard-0123456789abcdef"
    assert key_split(job_task_key(prefix)) != key_split(f"{prefix}-0")


def test_shards_run_on_every_worker(breast_cancer_model: BuiltModel, dask_address: str, tmp_path: Path) -> None:
    from distributed import Client, get_task_stream

    job, shards = scoring_job(breast_cancer_model.bundle_dir, tmp_path, 8, 5_000, "spread")
    settled: list[PartRecord] = []

    def on_settled(shard: ShardInfo, record: PartRecord | None, error: BaseException | None) -> None:
        assert error is None, error
        assert record is not None
        settled.append(record)

    with Client(dask_address) as client, get_task_stream(client) as stream:
        # every shard submitted at once: each is placed before any has run
        dispatch_shards(client, job, shards, on_settled, max_in_flight=len(shards), key_prefix="shard-0123456789abcdef")
        workers = set(client.scheduler_info()["workers"])

    ran_shards = {t["worker"] for t in stream.data if key_split(t["key"]) == "shard"}
    assert ran_shards == workers and len(workers) == 2
    assert sorted(r.relative for r in settled) == [s.relative for s in shards]
    assert OutputLayout(job.output_uri).present_parts() == {s.relative for s in shards}


def test_a_stop_request_withdraws_unstarted_shards_and_returns_once_the_running_ones_are_committed(
    breast_cancer_model: BuiltModel, dask_address: str, tmp_path: Path
) -> None:
    import threading

    from distributed import Client

    from shardline.errors import JobStopped
    from shardline.tasks.dispatch import STOP_REQUEST

    job, shards = scoring_job(breast_cancer_model.bundle_dir, tmp_path, 24, 1_000, "stopped")
    stop, settled = threading.Event(), []

    def on_settled(shard: ShardInfo, record: PartRecord | None, error: BaseException | None) -> None:
        assert error is None and record is not None, error
        settled.append(record.relative)
        if len(settled) == 2:
            stop.set()  # as the warm runner does when the job's command goes away

    token = STOP_REQUEST.set(stop)
    try:
        with Client(dask_address) as client, pytest.raises(JobStopped, match="run the same command again to resume"):
            dispatch_shards(client, job, shards, on_settled, max_in_flight=8, key_prefix="shard-stopped")
    finally:
        STOP_REQUEST.reset(token)

    layout = OutputLayout(job.output_uri)
    committed = layout.present_parts()
    assert 2 <= len(settled) < len(shards)  # the running shards finished; the withdrawn ones never ran
    assert committed == set(settled)  # every shard that ran was settled here: none commits behind the job's back
    time.sleep(1.0)
    assert layout.present_parts() == committed


def dispatch_stopped_at_the_first_commit(dask_address: str, job: ScoringJob, shards: list[ShardInfo],
                                         key_prefix: str) -> tuple[list[str], str, list[str]]:
    """Dispatch ``shards`` with a stop requested as the first part is committed: the shards settled (each
    committed), the ``JobStopped`` message, and the names of the Events the scheduler holds afterwards."""
    import threading

    from distributed import Client

    from shardline.errors import JobStopped
    from shardline.tasks import dispatch

    layout, stop, settled = OutputLayout(job.output_uri), threading.Event(), []

    def stop_at_the_first_commit() -> None:
        while not layout.present_parts() and not stop.is_set():
            time.sleep(0.005)
        stop.set()

    def on_settled(shard: ShardInfo, record: PartRecord | None, error: BaseException | None) -> None:
        assert error is None and record is not None, error
        settled.append(record.relative)

    watcher = threading.Thread(target=stop_at_the_first_commit)
    token = dispatch.STOP_REQUEST.set(stop)
    try:
        with Client(dask_address) as client:
            watcher.start()
            refused = rf"stopped on request with (\d+) of {len(shards)} shards not scored"
            with pytest.raises(JobStopped, match=refused) as stopped:
                dispatch_shards(client, job, shards, on_settled, key_prefix=key_prefix)
            events = client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.extensions["events"]._events))
    finally:
        stop.set()
        watcher.join()
        dispatch.STOP_REQUEST.reset(token)
    assert layout.present_parts() == set(settled)  # what was scored before the stop settled here: nothing behind it
    return settled, str(stopped.value), [str(e) for e in events]


def test_a_stop_ends_each_running_group_after_its_current_shard(
    breast_cancer_model: BuiltModel, dask_address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A group of small shards that are slow to score ran to its end after a stop: minutes for an embedding model.
    # 64 shards: groups of 8 on the two worker threads, each shard 200 batches; the stop comes as the first part
    # is committed, so a group that scored every shard given would settle 8 (and two running, 16).
    from shardline.tasks import dispatch

    monkeypatch.setattr(dispatch, "STOP_CHECK_S", 0.0)  # read here, sent with the tasks: ask before every shard
    job, shards = scoring_job(breast_cancer_model.bundle_dir, tmp_path, 64, 100, "groups-stopped")
    assert [len(g) for g in group_shards(shards, 2)] == [8] * 8

    settled, stopped, events = dispatch_stopped_at_the_first_commit(dask_address, job, shards, "shard-groups-stopped")

    assert 1 <= len(settled) < 8  # each running group stopped after the shard it was scoring
    assert f"with {64 - len(settled)} of 64 shards not scored" in stopped
    assert not [e for e in events if "groups-stopped" in e]  # the signal was taken off the scheduler
    time.sleep(1.0)
    assert OutputLayout(job.output_uri).present_parts() == set(settled)  # no group commits behind the job


def test_a_stop_keeps_tasks_waiting_on_a_worker_from_scoring(
    breast_cancer_model: BuiltModel, dask_address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The scheduler sends a task to a worker as soon as it is handed out, where it waits behind the one running: it
    # cannot be withdrawn, and every shard handed out ran to its end after a stop (a user's Ctrl-C at 30 of 60
    # shards saw all 60 scored). 12 shards, one a task: 8 handed out at once, 2 running, 6 waiting on the workers.
    from shardline.tasks import dispatch

    monkeypatch.setattr(dispatch, "STOP_CHECK_S", 0.2)  # a task that waited longer asks before its first shard
    job, shards = scoring_job(breast_cancer_model.bundle_dir, tmp_path, 12, 25, "waiting-stopped")
    assert [len(g) for g in group_shards(shards, 2)] == [1] * 12

    settled, stopped, _ = dispatch_stopped_at_the_first_commit(dask_address, job, shards, "shard-waiting-stopped")

    # the two running when it came, and at most one more a worker started before the signal was up (ms); before,
    # each task on a worker ran (5 of the 8 handed out here: the scheduler withdrew 3 it had not yet sent)
    assert 1 <= len(settled) <= 4
    assert f"with {12 - len(settled)} of 12 shards not scored" in stopped


def test_a_stop_withdraws_only_tasks_no_worker_was_handed(dask_address: str) -> None:
    # A task that finished before its result reached the dispatcher has committed its parts: withdrawing it too
    # (as a snapshot of the tasks processing, then a cancel, did) left those parts committed but never settled.
    from concurrent.futures import CancelledError

    from distributed import Client, Event, wait

    from shardline.tasks.dispatch import _withdraw_unstarted

    # defined here, so that they travel by value: the workers and the scheduler cannot import this module
    def hold(event_name: str) -> str:
        Event(event_name).wait(60)
        return "ran"

    def task_state(key: str, dask_scheduler: Any) -> str | None:
        task = dask_scheduler.tasks.get(key)
        return None if task is None else str(task.state)

    with Client(dask_address) as client:
        release = Event("release-held", client=client)
        done = client.submit(str.upper, "done", key="withdraw-done", pure=False)
        wait([done])
        running = client.submit(hold, "release-held", key="withdraw-running", pure=False)
        while client.run_on_scheduler(task_state, "withdraw-running") != "processing":  # on a worker
            time.sleep(0.02)
        waiting = client.submit(str.upper, running, key="withdraw-waiting", pure=False)  # waits for `running`
        while client.run_on_scheduler(task_state, "withdraw-waiting") != "waiting":
            time.sleep(0.02)
        futures = {f.key: f for f in (done, running, waiting)}

        assert _withdraw_unstarted(client, futures) == ["withdraw-waiting"]
        release.set()
        assert done.result(timeout=30) == "DONE" and running.result(timeout=30) == "ran"
        with pytest.raises(CancelledError, match="stop requested"):
            waiting.result(timeout=30)


# How many more blocks glibc maps on their own (``mallinfo2().hblks``, glibc >= 2.33) while a 1 MiB numpy array is
# alive: 1 under Dask's pinned 128 KiB mmap threshold, 0 when the array comes from the heap. Run as a process of its
# own, in the environment it is given.
_MAPPED_BLOCKS = """
import ctypes
import numpy as np
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
before = mallinfo2().hblks
array = np.ones(1 << 20, dtype=np.uint8)
print(mallinfo2().hblks - before)
"""


def _mapped_blocks(env: dict[str, str] | None = None) -> str:
    return subprocess.run([sys.executable, "-c", _MAPPED_BLOCKS], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_local_cluster_started_here_has_quiet_workers_with_arrows_jemalloc_pool_and_a_heap_for_numpy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes
    import mmap

    import dask
    import pyarrow as pa
    from distributed import Client

    from shardline.settings import DaskSettings
    from shardline.tasks.cluster import dask_scheduler

    # The nanny sets its pre-spawn variables in this process's own environment: each is set and then deleted, so that
    # monkeypatch takes it away again after the test (as it was: absent, or the value it had).
    for name in ("ARROW_DEFAULT_MEMORY_POOL", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    with dask_scheduler(DaskSettings(n_workers=1)) as address, Client(address) as client:
        on_workers = client.run(lambda: dask.config.get("distributed.worker.profile.enabled"))
        on_scheduler = client.run_on_scheduler(lambda: dask.config.get("distributed.admin.tick.interval"))
        pools = client.run(lambda: __import__("pyarrow").default_memory_pool().backend_name)
        variables = client.run(lambda: {k: os.environ.get(k)
                                        for k in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")})
        mapped = client.run(lambda: subprocess.run([sys.executable, "-c", _MAPPED_BLOCKS], capture_output=True,
                                                   text=True, check=True).stdout.strip())  # the worker's environment
    assert list(on_workers.values()) == [False] and on_scheduler == "1s"
    assert mmap.PAGESIZE == 4096 and pa.jemalloc_memory_pool()  # this machine allows it, so it is used
    assert list(pools.values()) == ["jemalloc"]
    # Dask's trim threshold is kept; glibc takes the mmap threshold, so a megabyte comes from the heap, where in a
    # process with Dask's variable alone it is a mapping of its own.
    assert list(variables.values()) == [{"MALLOC_TRIM_THRESHOLD_": "65536", "MALLOC_MMAP_THRESHOLD_": "33554432"}]
    assert hasattr(ctypes.CDLL(None), "mallinfo2")  # glibc >= 2.33, as on the machines this runs on
    assert list(mapped.values()) == ["0"]
    dask_alone = {name: value for name, value in os.environ.items() if name != "MALLOC_MMAP_THRESHOLD_"}
    assert _mapped_blocks({**dask_alone, "MALLOC_TRIM_THRESHOLD_": "65536"}) == "1"


def test_a_job_of_few_shards_is_split_evenly_over_the_workers(
    breast_cancer_model: BuiltModel, dask_address: str, tmp_path: Path
) -> None:
    # A job of at most 2 shards per worker thread is not root-ish to Dask's scheduler, which then places each shard on
    # a worker holding its dependency, the job: with the job on one worker, a job of 4 long shards on 2 workers ran 3
    # on that one and 1 on the other (work stealing moved one).
    from distributed import Client, get_task_stream

    warm_up, warm_shards = scoring_job(breast_cancer_model.bundle_dir, tmp_path / "warm", 8, 5_000, "warm")
    job, shards = scoring_job(breast_cancer_model.bundle_dir, tmp_path, 4, 5_000, "even")
    with Client(dask_address) as client:
        # every worker loads the model first, so that none is slower at its first shard and has one stolen
        dispatch_shards(client, warm_up, warm_shards, lambda *_: None, key_prefix="shard-warm")
        with get_task_stream(client) as stream:
            dispatch_shards(client, job, shards, lambda *_: None, key_prefix="shard-even")
        workers = set(client.scheduler_info()["workers"])
        steals = [msg for _, msg in client.get_events("stealing") if msg[0] == "confirm"]

    # Judged on where the scheduler placed each shard: on a loaded machine work stealing may rightly move a shard
    # off a worker starved of CPU afterwards, so a shard that was stolen counts for the worker it was taken from.
    ran = {t["key"]: t["worker"] for t in stream.data if t["key"].startswith("shard-even-")}
    placed = dict(ran)
    for _, key, _, victim, *_ in reversed(steals):  # the earliest steal of a key names where it was placed
        if key in placed:
            placed[key] = victim
    assert sorted(sum(1 for w in placed.values() if w == worker) for worker in workers) == [2, 2], (ran, steals)


def test_small_shards_go_in_groups_and_each_settles_with_its_own_record(
    breast_cancer_model: BuiltModel, dask_address: str, tmp_path: Path
) -> None:
    from distributed import Client, get_task_stream

    job, shards = scoring_job(breast_cancer_model.bundle_dir, tmp_path, 24, 5_000, "grouped")
    settled: list[str] = []

    def on_settled(shard: ShardInfo, record: PartRecord | None, error: BaseException | None) -> None:
        assert error is None and record is not None and record.relative == shard.relative, error
        settled.append(record.relative)

    with Client(dask_address) as client, get_task_stream(client) as stream:
        stats = dispatch_shards(client, job, shards, on_settled, key_prefix="shard-grouped")

    tasks = [t for t in stream.data if t["key"].startswith("shard-grouped-")]
    assert stats.submitted == 24 and stats.tasks == len(tasks) == 8  # 3 small shards a task, 4 a worker thread
    assert sorted(settled) == sorted(s.relative for s in shards)  # each once
    assert OutputLayout(job.output_uri).present_parts() == set(settled)
    ledger = OutputLayout(job.output_uri).read_ledger()
    assert {r.relative for r in ledger.values()} == set(settled) and all(r.rows_out == 20_000 for r in ledger.values())


def test_groups_are_of_small_shards_and_leave_every_worker_thread_some() -> None:
    def shards(*sizes: int) -> list[ShardInfo]:
        return [ShardInfo(f"file:///in/{i}.parquet", f"{i}.parquet", size, str(i)) for i, size in enumerate(sizes)]

    mib = 1024 * 1024
    assert [len(g) for g in group_shards(shards(*[40 * mib] * 80), threads=2)] == [3] * 26 + [2]  # 128 MiB a task
    assert [len(g) for g in group_shards(shards(*[58 * mib] * 20), threads=2)] == [2] * 10  # 200k-row shards
    assert [len(g) for g in group_shards(shards(*[mib] * 80), threads=2)] == [8] * 10  # at most 8 a task
    assert [len(g) for g in group_shards(shards(*[mib] * 24), threads=2)] == [3] * 8  # 8 tasks for 2 threads
    assert [len(g) for g in group_shards(shards(*[mib] * 8), threads=2)] == [1] * 8
    assert [len(g) for g in group_shards(shards(*[300 * mib] * 40), threads=2)] == [1] * 40  # large ones alone
    mixed = group_shards(shards(10 * mib, 200 * mib, 10 * mib, 10 * mib, *[mib] * 36), threads=1)
    assert [s.relative for g in mixed for s in g] == [f"{i}.parquet" for i in range(40)]  # in order
    assert all(len(g) == 1 or sum(s.size for s in g) <= 128 * mib for g in mixed)


def test_a_shard_failing_in_a_group_fails_alone(breast_cancer_model: BuiltModel, tmp_path: Path) -> None:
    from dataclasses import replace

    job, shards = scoring_job(breast_cancer_model.bundle_dir, tmp_path, 3, 1_000, "one-fails")
    gone = replace(shards[1], uri="nope://nowhere/part.parquet")  # no such file system: raises

    outcomes = score_group(job, [shards[0], gone, shards[2]])

    assert [r is not None and r.status for r, _ in outcomes] == ["committed", False, "committed"]
    assert outcomes[1][1] is not None and outcomes[0][1] is None and outcomes[2][1] is None
    assert OutputLayout(job.output_uri).present_parts() == {shards[0].relative, shards[2].relative}


@pytest.mark.parametrize("traced", [False, True], ids=["plain", "traced"])
def test_a_groups_capture_samples_are_one_file_of_each_committed_shards_rows(
    breast_cancer_model: BuiltModel, tmp_path: Path, traced: bool
) -> None:
    from dataclasses import replace

    from shardline.storage.capture import scan_capture
    from shardline.storage.scoring import ShardCapture

    job, shards = scoring_job(breast_cancer_model.bundle_dir, tmp_path, 3, 1_000, "captured")
    job = replace(job, capture=ShardCapture(str(tmp_path / "capture"), 150, "acme", "captured"))
    gone = replace(shards[1], uri="nope://nowhere/part.parquet")

    group = [shards[0], gone, shards[2]]
    # with tracing on (a span a shard: tests/integration/test_batch_observability.py), the group is still one
    outcomes = score_traced(job, group, [f"00-{'1' * 32}-{i:016x}-01" for i in range(1, 4)]) if traced else (
        score_group(job, group))

    assert [r is not None and r.status for r, _ in outcomes] == ["committed", False, "committed"]
    files = list((tmp_path / "capture").rglob("*.parquet"))
    assert len(files) == 1, files  # one file for the group, not one a shard
    captured = scan_capture(str(tmp_path / "capture"), job.model.name).collect()
    assert captured.height == 300 and set(captured["_source"]) == {"captured"} and set(captured["_tenant"]) == {"acme"}
    first = pq.read_table(shards[0].uri.removeprefix("file://")).slice(0, 150)
    assert captured["mean radius"].to_list()[:150] == first.column("mean radius").to_pylist()
    assert captured["_captured_at"].is_sorted()  # each shard's rows at its own time, in order
