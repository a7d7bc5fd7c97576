"""Batch at scale: does the platform's overhead per shard stay flat as jobs grow?

Three measurements, each printed with its ratios:

1. **Planning** (``plan_batch_job`` without Prefect: resolve the model, list the
   input, read the ledger, split off settled shards) for 100, 1,000 and 10,000 tiny
   shards, on a fresh output and on a resume where every shard is already settled
   (the ledger holds N records). Per shard, in microseconds.
2. **Orchestration**: the whole batch flow (Prefect's test server, a LocalCluster of
   2 worker processes) over N tiny shards (20 rows each, so the model's work is
   negligible and what is measured is the platform's: Dask round trip, opening the
   shard, writing and committing the part, the ledger record). Per shard, in
   milliseconds; plus the Prefect task runs the job made (constant, not one per shard)
   and the flow process's peak memory growth.
3. **Memory against input size**: one shard of 1x, 4x, 16x the rows scored by
   ``score_shard`` in a fresh process (as on a worker), its peak RSS (VmHWM), in
   8,192-row batches with 8 MiB checkpointed ranges so every size spans many batches
   and the larger ones several ranges. Batches and ranges keep it flat.

    .venv/bin/python bench/batch_scale.py --quick   # planning 100/1k/10k; flow 100/1k/3k; shards of 131k-2.1M rows: < 2 min
    .venv/bin/python bench/batch_scale.py           # 100/1k/10k for both; shards of 262k-4.2M rows: ~5 min

Data lives under bench/.data/scale/ (git-ignored); the tiny shards are written once.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from shardline.cli.common import OFF_THE_NETWORK  # noqa: E402 (the CLI's own list)

for _key, _value in OFF_THE_NETWORK.items():
    os.environ.setdefault(_key, _value)
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")  # the figures, not every task run's log

HERE = Path(__file__).resolve().parent
DATA = HERE / ".data" / "scale"
MODEL = "breast-cancer"
TINY_ROWS = 20
MiB = 1024 * 1024
# The memory runs score in batches of this many rows, with checkpointed ranges of this
# many bytes, so every size measured spans many batches (and the larger ones many ranges).
MEMORY_BATCH_ROWS = 8_192
MEMORY_CHECKPOINT_BYTES = 8 * MiB


def prepare_registry() -> Path:
    """A fresh Shardline home with breast-cancer@prod; returns the home."""
    from shardline.build.examples import package_breast_cancer
    from shardline.storage.registry import ModelRegistry

    home, bundle = DATA / "home", DATA / "bundle"
    shutil.rmtree(home, ignore_errors=True)
    shutil.rmtree(bundle, ignore_errors=True)
    package_breast_cancer(bundle, name=MODEL, kind="gbt")
    registry = ModelRegistry(str(home / "registry"))
    pushed = registry.push(bundle)
    registry.set_alias(pushed.name, "prod", pushed.version or 1, reason="bench")
    os.environ["SHARDLINE_STORAGE_HOME"] = str(home)
    return home


def tiny_shards(n: int) -> Path:
    """``n`` shards of 20 rows each (written once)."""
    import pyarrow.parquet as pq

    from shardline.build.examples import breast_cancer, shard_table

    folder = DATA / f"tiny-{n}"
    if (folder / "_complete").exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    data = breast_cancer()
    table = shard_table(data, TINY_ROWS, 0, 0)
    for i in range(n):
        pq.write_table(table, folder / f"part-{i:05d}.parquet")
    (folder / "_complete").write_text("")
    return folder


def big_shard(rows: int) -> Path:
    """One shard of ``rows`` rows in row groups of 65,536 (written once)."""
    from shardline.build.examples import write_shards

    folder = DATA / f"big-{rows}"
    if not (folder / "_complete").exists():
        shutil.rmtree(folder, ignore_errors=True)
        write_shards(folder, 1, rows, row_group_rows=65_536)
        (folder / "_complete").write_text("")
    return folder / "part-00000.parquet"


def _settings() -> tuple[Any, ...]:
    from shardline.settings import BatchSettings, DaskSettings, RuntimeSettings, StorageSettings

    return StorageSettings(), BatchSettings(), RuntimeSettings(), DaskSettings(cluster="address", address="tcp://x:1")


def measure_planning(n: int) -> tuple[float, float]:
    """Seconds to plan a fresh job of ``n`` shards, and a resume where all are settled."""
    from shardline.storage.output import OutputLayout, PartRecord
    from shardline.tasks.batch import plan_batch_job

    storage, batch, runtime, dask = _settings()
    folder = tiny_shards(n)
    out = DATA / f"plan-out-{n}"
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    plan = plan_batch_job.fn(f"{MODEL}@prod", str(folder), str(out), "bench", None, storage, batch, runtime, dask)
    fresh = time.perf_counter() - started
    assert len(plan.todo) == n
    layout = OutputLayout(str(out))
    for shard in plan.todo:  # pretend every shard committed: a ledger of n records, n parts
        (out / shard.relative).parent.mkdir(parents=True, exist_ok=True)
        (out / shard.relative).write_bytes(b"")
        layout.record(PartRecord(shard=shard.uri, relative=shard.relative, fingerprint=shard.fingerprint,
                                 job_key=plan.job.job_key, status="committed", part=str(out / shard.relative),
                                 rows_in=TINY_ROWS, rows_out=TINY_ROWS))
    started = time.perf_counter()
    again = plan_batch_job.fn(f"{MODEL}@prod", str(folder), str(out), "bench", None, storage, batch, runtime, dask)
    resume = time.perf_counter() - started
    assert not again.todo and len(again.done) == n
    shutil.rmtree(out, ignore_errors=True)
    return fresh, resume


class RssPeak:
    """Samples this process's RSS on a thread; ``growth`` is the peak above the start."""

    def __init__(self) -> None:
        import psutil

        self._process = psutil.Process()
        self.start = self.peak = self._process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        """Bytes above the RSS at the start."""
        return self.peak - self.start


def measure_flow(n: int) -> dict[str, Any]:
    """Run the batch flow over ``n`` tiny shards; seconds, task runs, memory growth."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from shardline.flows.batch_inference import batch_inference

    folder = tiny_shards(n)
    out = DATA / f"flow-out-{n}"
    shutil.rmtree(out, ignore_errors=True)
    with RssPeak() as memory:
        started = time.perf_counter()
        state = batch_inference(model=f"{MODEL}@prod", input_uri=str(folder), output_uri=str(out), return_state=True)
        seconds = time.perf_counter() - started
    summary = state.result()
    if summary["rows_out"] != n * TINY_ROWS:
        raise SystemExit(f"the flow did not score every row: {summary}")
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    shutil.rmtree(out, ignore_errors=True)
    return {"seconds": seconds, "task_runs": len(runs), "memory": memory.growth, "steady": summary["steady_seconds"]}


def measure_memory(rows: int) -> int:
    """Peak RSS (bytes) of a fresh process scoring one shard of ``rows`` rows."""
    out = DATA / f"mem-out-{rows}"
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--score-one", str(big_shard(rows)), str(out)]
    answer = subprocess.run(command, capture_output=True, text=True, check=True, env=dict(os.environ))
    shutil.rmtree(out, ignore_errors=True)
    return int(json.loads(answer.stdout.strip().splitlines()[-1])["peak_rss"])


def score_one(shard: str, output: str) -> None:
    """Child process: score one shard as a worker would; print peak RSS as JSON."""
    from shardline.runtimes import RuntimeOptions
    from shardline.settings import StorageSettings
    from shardline.storage.job_identity import job_key
    from shardline.storage.registry import ModelRegistry
    from shardline.storage.scoring import ScoringJob, score_shard
    from shardline.storage.shards import list_shards

    storage = StorageSettings()
    model = ModelRegistry(storage.registry).resolve(f"{MODEL}@prod")
    job = ScoringJob(job_key=job_key(model.outputs_digest, None), model=model, output_uri=output, passthrough=None,
                     batch_rows=MEMORY_BATCH_ROWS, cache_dir=storage.cache, runtime=RuntimeOptions("cpu", 1),
                     checkpoint_bytes=MEMORY_CHECKPOINT_BYTES)
    record = score_shard(job, list_shards(shard)[0])
    print(json.dumps({"peak_rss": _peak_rss(), "rows": record.rows_out, "ranges": record.ranges}))


def _peak_rss() -> int:
    """This process's peak RSS in bytes: VmHWM (getrusage's ru_maxrss keeps the parent's peak across exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller flow and memory sizes: under 2 minutes")
    parser.add_argument("--score-one", nargs=2, metavar=("SHARD", "OUTPUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.score_one:
        score_one(*args.score_one)
        return 0

    DATA.mkdir(parents=True, exist_ok=True)
    prepare_registry()
    plan_sizes = [100, 1_000, 10_000]
    flow_sizes = [100, 1_000, 3_000] if args.quick else [100, 1_000, 10_000]
    # whole 65,536-row row groups: 2, 8 and 32 of them (quick), 4, 16 and 64 (full)
    memory_rows = [131_072, 524_288, 2_097_152] if args.quick else [262_144, 1_048_576, 4_194_304]
    for n in sorted(set(plan_sizes + flow_sizes)):
        tiny_shards(n)

    print("planning (no Prefect): per shard")
    measure_planning(100)  # imports and the registry's first reads, outside the figures
    plans = {}
    for n in plan_sizes:
        fresh, resume = measure_planning(n)
        plans[n] = (fresh / n, resume / n)
        print(f"  {n:>6,} shards  fresh {fresh:6.2f} s = {1e6 * fresh / n:7.1f} us/shard   "
              f"resume (all settled) {resume:6.2f} s = {1e6 * resume / n:7.1f} us/shard", flush=True)

    import logging

    import dask
    from distributed import LocalCluster

    logging.getLogger("distributed").setLevel(logging.WARNING)
    from prefect.testing.utilities import prefect_test_harness

    print("orchestration (whole flow, 2 worker processes, 20-row shards): per shard")
    flows = {}
    with dask.config.set({"distributed.scheduler.allowed-failures": 10}), LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
        scheduler_kwargs={"dashboard_address": "127.0.0.1:0"}, silence_logs=logging.WARNING,
    ) as cluster, prefect_test_harness(server_startup_timeout=120):
        os.environ["SHARDLINE_DASK_CLUSTER"] = "address"
        os.environ["SHARDLINE_DASK_ADDRESS"] = cluster.scheduler_address
        measure_flow(20)  # warm the workers' model cache and imports
        for n in flow_sizes:
            result = measure_flow(n)
            flows[n] = result
            print(f"  {n:>6,} shards  {result['seconds']:6.1f} s = {1e3 * result['seconds'] / n:6.2f} ms/shard   "
                  f"Prefect task runs {result['task_runs']}   flow process +{result['memory'] / MiB:.0f} MiB", flush=True)

    print(f"memory against input size: one shard scored in a fresh process "
          f"({MEMORY_BATCH_ROWS:,}-row batches, ranges of {MEMORY_CHECKPOINT_BYTES // MiB} MiB)")
    peaks = {}
    for rows in memory_rows:
        peaks[rows] = measure_memory(rows)
        print(f"  {rows:>9,} rows ({big_shard(rows).stat().st_size / MiB:6.1f} MiB)  peak RSS {peaks[rows] / MiB:6.0f} MiB",
              flush=True)

    small, large = plan_sizes[0], plan_sizes[-1]
    f_small, f_large = flow_sizes[0], flow_sizes[-1]
    m_small, m_large = memory_rows[0], memory_rows[-1]
    print("ratios (flat = 1.0)")
    print(f"  planning per shard, fresh   {large:,} / {small:,} shards: {plans[large][0] / plans[small][0]:.2f}")
    print(f"  planning per shard, resume  {large:,} / {small:,} shards: {plans[large][1] / plans[small][1]:.2f}")
    per_small = flows[f_small]["seconds"] / f_small
    per_large = flows[f_large]["seconds"] / f_large
    f_mid = flow_sizes[1]
    per_mid = flows[f_mid]["seconds"] / f_mid
    print(f"  flow per shard              {f_large:,} / {f_small:,} shards: {per_large / per_small:.2f}   "
          f"{f_large:,} / {f_mid:,}: {per_large / per_mid:.2f}  (a job's fixed costs spread over more shards)")
    print(f"  Prefect task runs           {f_large:,} / {f_small:,} shards: "
          f"{flows[f_large]['task_runs'] / flows[f_small]['task_runs']:.2f}")
    print(f"  peak RSS                    {m_large:,} / {m_small:,} rows ({m_large // m_small}x input): "
          f"{peaks[m_large] / peaks[m_small]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
