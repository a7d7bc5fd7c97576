"""Batch throughput: `shardline batch run` against a tight loop and a plain Dask script.

Three contenders score the same Parquet shards with the same ONNX model and write
one Parquet file per shard (or partition) with the model's outputs:

- **tight loop**: one process, one Python thread, shard after shard:
  ``pq.ParquetFile.iter_batches`` -> stack the 30 features to float32 -> onnxruntime
  with every core as intra-op threads (not spinning) -> ``pq.ParquetWriter``. No
  Prefect, no Dask, no checks.
- **plain Dask**: the script a user would write instead of the platform:
  ``dask.dataframe.read_parquet(folder).map_partitions(score).to_parquet(out)`` on a
  ``LocalCluster()`` with Dask's defaults, the onnxruntime session loaded once per
  worker (cores / workers intra-op threads, not spinning: the well-tuned user).
- **platform**: ``shardline batch run --json`` as a user runs it, default settings
  (no ``SHARDLINE_*`` tuning variable in its environment), on the bench home's local
  Prefect server and warm batch runner, as a user's first run leaves them: the server is
  started before the runs and a first platform run (shown, not in the cells) starts the
  runner; both are stopped at the end. The platform's memory and CPU are those of the
  command and of the runner's whole tree (the runner holds the Dask workers).

Cells: shards of about 50k, 200k and 1M rows (about the same rows per run, so runs
take comparable time), each with the breast-cancer logistic regression (I/O-bound:
the model is a few multiply-adds a row) and the 100-tree GBT (compute-bound) of
``shardline.build.examples``. Each contender runs in its own process; its rates and CPU come
from runs left alone, and the memory (PSS) of its whole process tree from one more run sampled
with psutil (reading PSS costs the kernel a walk of each process's page tables: sampled, the
platform's six processes lost a sixth of the cores to the sampler). Each cell also measures the machine's limit on
its shards (``batch_limit.py``: onnxruntime alone on in-memory batches, stacking the features
alone, reading and writing alone, the three combined, and a bare read->stack->score->write
pipeline, each on every core), and once more with the variables the platform's Dask workers start with
(``worker_variables``: information beside the target, not the target). Printed
per cell: rows/s end to end (process start to exit, start-ups included) and in steady state
(first shard started to last part written), peak tree memory, the platform's seconds outside
the steady window (start-up plus tear-down); then the platform's steady rows/s as a fraction
of the limit and its ratios to the tight loop and to Dask, with the targets (steady >= 0.9 of
the limit, >= 1.2x the tight loop and >= 1.5x Dask; peak tree PSS <= Dask's and flat across
the cells; start-up plus tear-down <= 1 s on the warm runner) and MISSED where one is not met.

    .venv/bin/python bench/batch_throughput.py            # 4M rows a cell, 2 runs each + 1 for memory: ~10 min on 2 quiet cores
    .venv/bin/python bench/batch_throughput.py --quick    # 0.8-2M rows a cell, 1 run + 1 for memory: ~5 min (shards written once more)

Data lives under bench/.data/batch/ (git-ignored): the shards are written once and
reused; bundles, registry and outputs are made afresh on every run.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from shardline.cli.common import OFF_THE_NETWORK  # noqa: E402 (the CLI's own list)

for _key, _value in OFF_THE_NETWORK.items():
    os.environ.setdefault(_key, _value)

HERE = Path(__file__).resolve().parent
DATA = HERE / ".data" / "batch"
KINDS = ("logreg", "gbt")
BATCH_ROWS = 65_536  # the tight loop's batches, and the shards' row groups
SHARD_ROWS = (50_000, 200_000, 1_000_000)
STEADY_VS_TIGHT = 1.2  # platform steady rows/s >= 1.2 x the tight loop's
STEADY_VS_DASK = 1.5  # ... and >= 1.5 x the plain Dask script's
STEADY_VS_LIMIT = 0.9  # ... and >= 0.9 of the machine's limit (bench/batch_limit.py)
OUTSIDE_STEADY_S = 1.0  # the platform's start-up plus tear-down (end to end - steady) on a warm runner (issue 35)
MEMORY_FLAT_LIMIT = 1.25  # largest / smallest peak tree memory (PSS) of the platform across the cells
MiB = 1024 * 1024
NOISY_CORES = 0.25  # other processes using more than this during a run make it noisy
CONTENDERS = ("tight loop", "plain dask", "platform")


def model_name(kind: str) -> str:
    """The registry name of the bench's model of a kind."""
    return f"bc-{kind}"


def _features(bundle: Path) -> tuple[str, list[str]]:
    manifest = json.loads((bundle / "manifest.json").read_text())
    binding = manifest["runtime_config"]["tensor_inputs"][0]
    return binding["name"], list(binding["columns"])


def _session(bundle: Path, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # Idle intra-op threads sleep instead of spinning while this thread reads and writes: the
    # same speed on a quiet machine, and no collapse (2-3x slower) when the cores are shared.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(bundle / "model.onnx"), options, providers=["CPUExecutionProvider"])


# --------------------------------------------------------------------------- tight loop


def tight_loop(bundle: Path, input_dir: Path, output_dir: Path, threads: int) -> dict[str, Any]:
    """Score every shard of ``input_dir`` into ``output_dir``, the plainest way; returns timings.

    Runs in a child process (``--tight-loop``) so that its start-up and memory are
    measured the same way as the others'.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    feed, features = _features(bundle)
    session = _session(bundle, threads)
    schema = pa.schema(
        [
            pa.field("id", pa.int64()),
            pa.field("label", pa.int64(), nullable=False),
            pa.field("probabilities", pa.list_(pa.float32(), 2), nullable=False),
        ]
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    rows = 0
    started = time.perf_counter()
    for shard in sorted(input_dir.glob("*.parquet")):
        with pq.ParquetWriter(output_dir / shard.name, schema) as writer:
            source = pq.ParquetFile(shard)  # pyarrow's defaults: pre_buffer reads a shard's chunks up front
            for batch in source.iter_batches(batch_size=BATCH_ROWS, columns=["id", *features]):
                x = np.empty((batch.num_rows, len(features)), dtype=np.float32)
                for j, name in enumerate(features):
                    x[:, j] = batch.column(name).to_numpy()
                label, probabilities = session.run(["label", "probabilities"], {feed: x})
                flat = pa.array(np.ascontiguousarray(probabilities).ravel())
                writer.write_batch(
                    pa.RecordBatch.from_arrays(
                        [batch.column("id"), pa.array(label), pa.FixedSizeListArray.from_arrays(flat, 2)],
                        schema=schema,
                    )
                )
                rows += batch.num_rows
    return {"rows": rows, "steady_seconds": time.perf_counter() - started}


# --------------------------------------------------------------------------- plain Dask


def dask_script(bundle: Path, input_dir: Path, output_dir: Path) -> dict[str, Any]:
    """What a user writes instead: read_parquet -> map_partitions(onnxruntime) -> to_parquet.

    A ``LocalCluster()`` on Dask's defaults (on 2 cores: 2 worker processes of 1
    thread), one onnxruntime session per worker (cores / workers threads, not
    spinning), loaded on each worker with ``client.run`` before the clock starts and
    kept on the worker object. Runs in a child process (``--dask-script``); its
    cluster start counts in its end-to-end time as the platform's does.
    """
    import dask.dataframe as dd
    import numpy as np
    import pandas as pd
    from distributed import Client, LocalCluster, get_worker

    feed, features = _features(bundle)
    with LocalCluster(dashboard_address=None) as cluster, Client(cluster) as client:
        workers = len(client.scheduler_info()["workers"])
        threads = max(1, (os.cpu_count() or 1) // max(1, workers))

        def load(dask_worker: Any) -> None:
            dask_worker.bench_session = _session(bundle, threads)

        def score(frame: pd.DataFrame) -> pd.DataFrame:
            session = get_worker().bench_session
            x = frame[features].to_numpy(dtype=np.float32)
            label, probabilities = session.run(["label", "probabilities"], {feed: x})
            return pd.DataFrame(
                {"id": frame["id"].to_numpy(), "label": label,
                 "p0": probabilities[:, 0], "p1": probabilities[:, 1]},
                index=frame.index,
            )

        meta = pd.DataFrame({"id": pd.Series(dtype="int64"), "label": pd.Series(dtype="int64"),
                             "p0": pd.Series(dtype="float32"), "p1": pd.Series(dtype="float32")})
        client.run(load)  # each worker's session, before the clock starts (as the platform loads its model)
        started = time.perf_counter()
        frame = dd.read_parquet(str(input_dir), columns=["id", *features])
        frame.map_partitions(score, meta=meta).to_parquet(str(output_dir), write_index=False)
        steady = time.perf_counter() - started
    import pyarrow.parquet as pq

    rows = sum(pq.ParquetFile(p).metadata.num_rows for p in output_dir.glob("*.parquet"))
    return {"rows": rows, "steady_seconds": steady}


# --------------------------------------------------------------------------- data


def prepare_models() -> dict[str, Path]:
    """Bundles of both models and a registry holding them at @prod, made anew; returns kind -> bundle.

    Each bundle carries the training rows' reference profile, as ``shardline demo``'s does (and a bundle packaged
    with a sample): every shard's first rows are then checked against the model's data contract, as a user's are.
    """
    from shardline.build.examples import breast_cancer, golden_table, package_breast_cancer, split
    from shardline.quality.profile import attach_reference_profile
    from shardline.storage.registry import ModelRegistry

    home = DATA / "home"
    prefect_server("stop")  # a former run's local Prefect server, before its home goes
    shutil.rmtree(home, ignore_errors=True)
    registry = ModelRegistry(str(home / "registry"))
    bundles = {}
    for kind in KINDS:
        bundle = DATA / f"bundle-{kind}"
        shutil.rmtree(bundle, ignore_errors=True)
        package_breast_cancer(bundle, name=model_name(kind), kind=kind)
        attach_reference_profile(bundle, golden_table(split(breast_cancer())[0]).drop(["target"]))
        pushed = registry.push(bundle)
        registry.set_alias(pushed.name, "prod", pushed.version or 1, reason="bench")
        bundles[kind] = bundle
    return bundles


def prepare_shards(shards: int, rows_per_shard: int) -> Path:
    """``shards`` shards of ``rows_per_shard`` rows under bench/.data/batch, written once."""
    from shardline.build.examples import write_shards

    folder = DATA / f"shards-{shards}x{rows_per_shard}"
    if not (folder / "_complete").exists():
        shutil.rmtree(folder, ignore_errors=True)
        print(f"writing {shards} shards of {rows_per_shard:,} rows into {folder} (once)", flush=True)
        write_shards(folder, shards, rows_per_shard, row_group_rows=BATCH_ROWS)
        (folder / "_complete").write_text("")
    return folder


# --------------------------------------------------------------------------- measuring


@dataclass
class Usage:
    """What a run's process tree used: peak memory (PSS, bytes) and CPU time.

    PSS (proportional set size): each page a process maps counts once, its share split among the
    processes that map it, so a tree's sum is what the tree holds (RSS counts the pages shared by the
    Dask workers and their nanny, the libraries' code among them, once per process)."""

    tree: int = 0  # PSS of all its processes together, at the worst sample
    worker: int = 0  # PSS of the largest Dask worker process (the tight loop: its process)
    cpu_seconds: float = 0.0  # user + system CPU time of the whole tree, start-up included
    rest_cores: float = 0.0  # cores the rest of the machine used meanwhile, on average


def _tree(pid: int) -> list[Any]:
    """A process and all its descendants (empty when it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _sample(roots: Callable[[], list[int]], usage: Usage, done: threading.Event, interval: float) -> None:
    """Sample the memory of the trees under ``roots()`` (the command; for the platform also the home's batch
    runner, which holds the Dask workers) until ``done``."""
    import psutil

    kinds: dict[int, bool] = {}  # pid -> is a Dask worker (spawned by multiprocessing)
    while not done.is_set():
        tree = largest = 0
        for proc in [p for root in roots() for p in _tree(root)]:
            try:
                pss = proc.memory_full_info().pss
                if proc.pid not in kinds:
                    kinds[proc.pid] = "spawn_main" in " ".join(proc.cmdline())
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            tree += pss
            if kinds[proc.pid]:
                largest = max(largest, pss)
        usage.tree = max(usage.tree, tree)
        usage.worker = max(usage.worker, largest)
        done.wait(interval)


def _cpu_of(pid: int | None) -> dict[int, float]:
    """User + system CPU seconds of each process of a tree, by pid."""
    import psutil

    seconds = {}
    for proc in _tree(pid) if pid is not None else []:
        try:
            t = proc.cpu_times()
            seconds[proc.pid] = t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return seconds


def _runner_pid() -> int | None:
    """The pid of the bench home's warm batch runner, when one runs."""
    from shardline.cli.batch_runner import find

    record = find(DATA / "home")
    return record.pid if record is not None else None


def _busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot."""
    import psutil

    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


QUIET_WAIT_S = [20.0]  # how long a run waits for the machine to go quiet (quick mode: 5 s)


def wait_for_quiet(busy_cores: float = 0.25) -> float:
    """Wait (up to ``QUIET_WAIT_S`` s) until the machine uses under ``busy_cores`` cores; returns the last figure."""
    import psutil

    deadline = time.monotonic() + QUIET_WAIT_S[0]
    while True:
        used = psutil.cpu_percent(interval=1.0) / 100 * (os.cpu_count() or 1)
        if used < busy_cores or time.monotonic() > deadline:
            return used


@dataclass
class Run:
    """One contender's run over one input."""

    side: str
    rows: int
    e2e_seconds: float
    steady_seconds: float
    usage: Usage = field(default_factory=Usage)
    outside: float | None = None  # start-up plus tear-down; None: e2e_seconds - steady_seconds

    @property
    def outside_seconds(self) -> float:
        """Seconds outside the steady window: interpreter, imports, flow run, cluster, commit, exit."""
        return self.outside if self.outside is not None else self.e2e_seconds - self.steady_seconds

    @property
    def e2e_rate(self) -> float:
        """Rows per second, start-up included."""
        return self.rows / self.e2e_seconds

    @property
    def steady_rate(self) -> float:
        """Rows per second from the first shard started to the last part written."""
        return self.rows / self.steady_seconds


def _run_measured(command: list[str], env: dict[str, str], interval: float = 0.1,
                  runner: bool = False, memory: bool = False) -> tuple[float, str, Usage]:
    """Run a command to its end; returns (wall seconds, stdout, usage): the CPU of its process tree (and with
    ``runner``, of the home's batch runner's, started by the command or before it), and with ``memory`` the
    peak PSS of those trees, sampled every ``interval``.

    Reading a process's PSS costs the kernel a walk of its page tables (/proc/PID/smaps_rollup: ~5 ms of CPU
    for a Dask worker here), which competes with the run measured: sampling the platform's six processes
    every 0.1 s took 0.25-0.35 of the 2 cores, and the tight loop's one process a sixth of that. So the rates
    come from runs without it, and the memory from a run of its own (``run_cell``)."""
    usage, done = Usage(), threading.Event()
    wait_for_quiet()
    runner_before = _runner_pid() if runner else None
    runner_cpu = _cpu_of(runner_before)
    before, busy_before = resource.getrusage(resource.RUSAGE_CHILDREN), _busy_cpu_seconds()
    started = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    found = [runner_before]

    def roots() -> list[int]:
        if runner and found[0] is None:
            found[0] = _runner_pid()
        return [proc.pid, *([found[0]] if found[0] is not None else [])]

    sampler = threading.Thread(target=_sample, args=(roots, usage, done, interval), daemon=True)
    if memory:
        sampler.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - started
    done.set()
    if memory:
        sampler.join()
    after, busy_after = resource.getrusage(resource.RUSAGE_CHILDREN), _busy_cpu_seconds()
    # RUSAGE_CHILDREN counts every descendant that was waited for (Dask workers of a cold run, Prefect's
    # temporary server); the runner is no child of this process: its tree's CPU is counted from psutil
    usage.cpu_seconds = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if runner:
        runner_after = _cpu_of(roots()[-1] if len(roots()) > 1 else None)
        usage.cpu_seconds += sum(t - runner_cpu.get(pid, 0.0) for pid, t in runner_after.items())
    usage.rest_cores = max(0.0, busy_after - busy_before - usage.cpu_seconds) / wall
    if proc.returncode != 0:
        sys.stderr.write(err[-4000:])
        raise SystemExit(f"{' '.join(command[:4])} ... exited {proc.returncode}")
    return wall, out, usage


def _last_json(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"no JSON summary in the output:\n{stdout[-2000:]}")


def prefect_server(action: str) -> None:
    """``shardline prefect start|stop`` for the bench's home: the platform's runs use the local Prefect
    server a user's first run starts (the issue's targets are for runs once it runs), started before the
    runs are timed and stopped at the end, so the bench leaves nothing running."""
    subprocess.run([sys.executable, "-m", "shardline.cli", "prefect", action], env=_env(), check=action == "start",
                   stdout=subprocess.DEVNULL)


def _env() -> dict[str, str]:
    """The contenders' environment: off the network, the bench's home; no SHARDLINE_* tuning."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLINE_")}
    env.update(OFF_THE_NETWORK)
    env["SHARDLINE_STORAGE_HOME"] = str(DATA / "home")
    env.pop("PREFECT_API_URL", None)  # the home's local Prefect server, as a user's runs find it
    return env


def _output(side: str) -> Path:
    output = DATA / f"out-{side.replace(' ', '-')}"
    shutil.rmtree(output, ignore_errors=True)  # the platform would skip every committed part
    return output


def run_child(side: str, bundle: Path, input_dir: Path, memory: bool = False) -> Run:
    """The tight loop or the plain Dask script in a child process over ``input_dir``."""
    flag = "--tight-loop" if side == "tight loop" else "--dask-script"
    command = [sys.executable, str(Path(__file__).resolve()), flag, str(bundle), str(input_dir), str(_output(side))]
    wall, out, usage = _run_measured(command, _env(), memory=memory)
    result = _last_json(out)
    if side == "tight loop":
        usage.worker = usage.tree  # one process: it is its own worker
    return Run(side, result["rows"], wall, result["steady_seconds"], usage)


def run_limit(bundle: Path, input_dir: Path, retries: int, variables: dict[str, str] | None = None
              ) -> dict[str, float]:
    """The machine's limit on ``input_dir`` (bench/batch_limit.py), in a child process like the contenders: measured
    again (up to ``retries`` times) while other processes used over ``NOISY_CORES``; each measure's best.
    ``variables``: set for it besides the contenders' environment (``worker_variables``)."""
    command = [sys.executable, str(HERE / "batch_limit.py"), str(bundle), str(input_dir), str(_output("limit"))]
    found: list[dict[str, float]] = []
    while True:
        _, out, usage = _run_measured(command, {**_env(), **(variables or {})})
        found.append(_last_json(out))
        if usage.rest_cores <= NOISY_CORES or len(found) > retries:
            return {key: max(f[key] for f in found) for key in found[0]}
        print(f"  ({usage.rest_cores:.2f} cores used by other processes: measuring the limit again)", flush=True)


def worker_variables() -> dict[str, str]:
    """The variables the platform's local Dask workers start with besides the command's, from the same config the
    runner's cluster reads: Dask's own (``MALLOC_TRIM_THRESHOLD_``: every allocation past 128 KiB a fresh mapping;
    one thread for OpenMP, MKL and OpenBLAS) and ours: Arrow's jemalloc pool and glibc's 32 MiB mmap threshold
    (``tasks/cluster.py``)."""
    import dask
    import distributed  # noqa: F401  (its defaults join dask.config on import)

    from shardline.tasks.cluster import worker_memory_config

    found = {**dask.config.get("distributed.nanny.pre-spawn-environ"),
             **{key.rsplit(".", 1)[1]: value for key, value in worker_memory_config().items()}}
    return {name: str(value) for name, value in found.items() if value is not None}


def run_platform(kind: str, input_dir: Path, memory: bool = False) -> Run:
    """``shardline batch run`` in a child process over ``input_dir``, from a clean output."""
    command = [sys.executable, "-m", "shardline.cli", "batch", "run", "--model", f"{model_name(kind)}@prod",
               "--input", str(input_dir), "--output", str(_output("platform")), "--json"]
    wall, out, usage = _run_measured(command, _env(), runner=True, memory=memory)
    summary = _last_json(out)
    if summary["rows_out"] != summary["rows_in"] or summary["shards_quarantined"]:
        raise SystemExit(f"the platform did not score every row: {summary}")
    return Run("platform", summary["rows_scored"], wall, summary["steady_seconds"], usage)


def same_output(tight_dir: Path, platform_dir: Path) -> tuple[str | None, float]:
    """(what differs or None, largest probability difference) between the tight loop's and the platform's parts.

    Ids and labels must be equal. Probabilities may differ in the last float32 bits:
    onnxruntime adds a tree ensemble up in another order with 2 intra-op threads
    (tight loop) than with 1 (each platform worker).
    """
    import numpy as np
    import pyarrow.parquet as pq

    tight = sorted(p.name for p in tight_dir.glob("*.parquet"))
    platform = sorted(p.name for p in platform_dir.glob("*.parquet"))
    if tight != platform:
        return f"parts differ: tight loop {tight[:3]}..., platform {platform[:3]}...", 0.0
    largest = 0.0
    for name in tight:
        a = pq.read_table(tight_dir / name)
        b = pq.read_table(platform_dir / name, columns=a.schema.names)
        for column in ("id", "label"):
            if not a.column(column).equals(b.column(column)):
                return f"{name}: column {column!r} differs", largest
        pa_, pb = (t.column("probabilities").combine_chunks().flatten().to_numpy() for t in (a, b))
        largest = max(largest, float(np.abs(pa_ - pb).max(initial=0.0)))
    if largest > 1e-5:
        return f"probabilities differ by up to {largest:.3g}", largest
    return None, largest


# --------------------------------------------------------------------------- report


def _mib(value: int) -> str:
    return f"{value / MiB:,.0f}"


@dataclass
class Cell:
    """One model at one shard size: the best run of each contender."""

    kind: str
    shards: int
    rows_per_shard: int
    runs: dict[str, Run]
    limit: dict[str, float]  # bench/batch_limit.py's measures (rows/s), the best of the repeats
    # the same measures with the platform's workers' variables (``worker_variables``): information, not a target
    limit_as_workers: dict[str, float]

    @property
    def of_limit(self) -> float:
        """The platform's steady rows/s as a fraction of the machine's limit."""
        return self.runs["platform"].steady_rate / self.limit["limit"]

    @property
    def of_limit_as_workers(self) -> float:
        """The platform's steady rows/s as a fraction of the limit measured in its workers' environment."""
        return self.runs["platform"].steady_rate / self.limit_as_workers["limit"]

    def ratio(self, what: str, against: str) -> float:
        """platform / ``against`` for 'steady', 'e2e' (rows/s) or 'memory' (peak tree PSS)."""
        mine, theirs = self.runs["platform"], self.runs[against]
        if what == "steady":
            return mine.steady_rate / theirs.steady_rate
        if what == "e2e":
            return mine.e2e_rate / theirs.e2e_rate
        return mine.usage.tree / theirs.usage.tree


def print_cell(cell: Cell) -> None:
    """One line per contender, then the ratios with the targets."""
    header = (f"{'contender':<12}{'rows':>11}{'e2e s':>7}{'e2e rows/s':>12}{'steady s':>9}"
              f"{'steady rows/s':>14}{'CPU s':>7}{'rest':>6}{'tree MiB':>9}{'worker MiB':>11}")
    print(f"\n{cell.kind}, {cell.shards} shards x {cell.rows_per_shard:,} rows")
    print(header)
    print("-" * len(header))
    for side in CONTENDERS:
        r = cell.runs[side]
        u = r.usage
        rest = f"{u.rest_cores:.2f}" + ("!" if u.rest_cores > NOISY_CORES else " ")
        print(f"{side:<12}{r.rows:>11,}{r.e2e_seconds:>7.1f}{r.e2e_rate:>12,.0f}{r.steady_seconds:>9.2f}"
              f"{r.steady_rate:>14,.0f}{u.cpu_seconds:>7.1f}{rest:>6}{_mib(u.tree):>9}{_mib(u.worker):>11}")
    steady_t, steady_d = cell.ratio("steady", "tight loop"), cell.ratio("steady", "plain dask")
    memory = cell.ratio("memory", "plain dask")
    outside = cell.runs["platform"].outside_seconds
    lim = cell.limit
    print(f"machine's limit ({lim['cores']:.0f} cores): onnxruntime alone {lim['onnxruntime']:,.0f} rows/s, stacking the "
          f"features alone {lim['stacking']:,.0f}, read + write alone {lim['read_write']:,.0f}; combined "
          f"1/(1/a+1/s+1/b) {lim['combined']:,.0f}, pipelined read->stack->score->write {lim['pipelined']:,.0f}; "
          f"limit (the higher) {lim['limit']:,.0f} rows/s")
    print(f"platform steady / limit: {cell.of_limit:.2f}{_mark(cell.of_limit >= STEADY_VS_LIMIT)}; / the limit "
          f"with the workers' variables ({', '.join(sorted(worker_variables()))}): {cell.of_limit_as_workers:.2f} "
          f"(information: the target is the limit's)")
    print(f"platform start-up + tear-down (e2e - steady): {outside:.2f} s{_mark(outside <= OUTSIDE_STEADY_S)}")
    print(f"platform / tight loop: steady {steady_t:.2f}x{_mark(steady_t >= STEADY_VS_TIGHT)}, "
          f"e2e {cell.ratio('e2e', 'tight loop'):.2f}x;  platform / plain dask: steady {steady_d:.2f}x"
          f"{_mark(steady_d >= STEADY_VS_DASK)}, e2e {cell.ratio('e2e', 'plain dask'):.2f}x, "
          f"tree memory {memory:.2f}x{_mark(memory <= 1.0)}", flush=True)


def _mark(met: bool) -> str:
    return "" if met else " MISSED"


def summary(cells: list[Cell]) -> bool:
    """The ratios of every cell in one table, memory flatness per model; returns whether every target is met."""
    header = (f"{'model':<8}{'shard rows':>11}{'shards':>7} | {'limit rows/s':>13}{'of limit':>9}{'(workers)':>10}"
              f"{'steady/tight':>13}"
              f"{'steady/dask':>12}{'e2e/tight':>10}{'e2e/dask':>9}{'tree/dask':>10}{'outside s':>10} | "
              f"{'tree MiB':>9}{'dask MiB':>9}")
    print(f"\nplatform ratios (targets: steady/limit >= {STEADY_VS_LIMIT}, steady/tight >= {STEADY_VS_TIGHT}, "
          f"steady/dask >= {STEADY_VS_DASK}, tree/dask <= 1.0 (peak PSS), start-up + tear-down (outside steady) <= "
          f"{OUTSIDE_STEADY_S} s; ! = missed)")
    print(header)
    print("-" * len(header))
    ok = True
    for c in cells:
        st, sd, mem = c.ratio("steady", "tight loop"), c.ratio("steady", "plain dask"), c.ratio("memory", "plain dask")
        outside = c.runs["platform"].outside_seconds
        marks = [st >= STEADY_VS_TIGHT, sd >= STEADY_VS_DASK, mem <= 1.0, outside <= OUTSIDE_STEADY_S,
                 c.of_limit >= STEADY_VS_LIMIT]
        ok = ok and all(marks)
        print(f"{c.kind:<8}{c.rows_per_shard:>11,}{c.shards:>7} | {c.limit['limit']:>13,.0f}"
              f"{c.of_limit:>8.2f}{' ' if marks[4] else '!'}{c.of_limit_as_workers:>10.2f}"
              f"{st:>12.2f}{' ' if marks[0] else '!'}"
              f"{sd:>11.2f}{' ' if marks[1] else '!'}{c.ratio('e2e', 'tight loop'):>10.2f}"
              f"{c.ratio('e2e', 'plain dask'):>9.2f}{mem:>9.2f}{' ' if marks[2] else '!'}"
              f"{outside:>9.2f}{' ' if marks[3] else '!'} | "
              f"{_mib(c.runs['platform'].usage.tree):>9}{_mib(c.runs['plain dask'].usage.tree):>9}")
    for kind in sorted({c.kind for c in cells}):
        trees = [c.runs["platform"].usage.tree for c in cells if c.kind == kind]
        if len(trees) > 1:
            growth = max(trees) / min(trees)
            flat = growth <= MEMORY_FLAT_LIMIT
            ok = ok and flat
            print(f"{kind}: platform peak tree memory (PSS) {_mib(min(trees))}-{_mib(max(trees))} MiB across the shard "
                  f"sizes = {growth:.2f}x (target <= {MEMORY_FLAT_LIMIT}{'' if flat else ': MISSED'})")
    print("Times: the best of the repeats. CPU s: user+system seconds of the run's whole process tree.\n"
          f"rest: cores the rest of the machine used meanwhile (! over {NOISY_CORES}: the figures are noisy).\n"
          "tree MiB: peak PSS of every process of the run together (the platform: the command and the home's\n"
          "batch runner with its scheduler, nannies and workers; the local Prefect server, shared by every run, is\n"
          "not counted); worker MiB: the largest Dask worker (tight loop: itself). outside s: the platform's\n"
          "end-to-end seconds less its steady window (start-up and tear-down), on the warm batch runner.\n"
          "limit: the machine's, on the cell's shards (bench/batch_limit.py): the higher of onnxruntime alone,\n"
          "stacking the features alone and read + write alone combined, 1/(1/a+1/s+1/b), and a measured\n"
          "read->stack->score->write pipeline on every core; of limit: the platform's steady rows/s / limit.\n"
          "(workers): the same, of the limit measured once more with the variables the platform's Dask workers\n"
          "start with (Dask's MALLOC_TRIM_THRESHOLD_ and thread counts, Arrow's jemalloc pool, glibc's mmap threshold): "
          "information only.")
    return ok


def best(runs: list[Run], memory: Run) -> Run:
    """One line for a contender: best steady and end-to-end times and least CPU of ``runs``, the memory of the
    ``memory`` run."""
    top = max(runs, key=lambda r: r.steady_rate)
    usage = Usage(
        tree=memory.usage.tree,
        worker=memory.usage.worker,
        cpu_seconds=min(r.usage.cpu_seconds for r in runs),
        rest_cores=top.usage.rest_cores,
    )
    return Run(top.side, top.rows, min(r.e2e_seconds for r in runs), top.steady_seconds, usage,
               outside=min(r.outside_seconds for r in runs))


def warm_page_cache(folder: Path) -> None:
    """Read every shard once, so that no run pays for the disk and the first run is like the others."""
    for path in sorted(folder.glob("*.parquet")):
        with open(path, "rb") as f:
            while f.read(16 * MiB):
                pass


def quietest(measure: Callable[[], Run], retries: int) -> Run:
    """Run ``measure``, again (up to ``retries`` times) while the rest of the machine was busy; keep the quietest."""
    runs = [measure()]
    while runs[-1].usage.rest_cores > NOISY_CORES and len(runs) <= retries:
        print(f"  ({runs[-1].usage.rest_cores:.2f} cores used by other processes: measuring again)", flush=True)
        runs.append(measure())
    return min(runs, key=lambda r: r.usage.rest_cores)


def run_cell(kind: str, bundle: Path, input_dir: Path, shards: int, rows: int, repeats: int, retries: int) -> Cell:
    """Every contender over one input, ``repeats`` times interleaved; the best of each."""
    warm_page_cache(input_dir)
    measures: dict[str, Callable[[bool], Run]] = {
        "tight loop": lambda memory: run_child("tight loop", bundle, input_dir, memory),
        "plain dask": lambda memory: run_child("plain dask", bundle, input_dir, memory),
        "platform": lambda memory: run_platform(kind, input_dir, memory),
    }
    runs: dict[str, list[Run]] = {side: [] for side in CONTENDERS}
    limits: list[dict[str, float]] = []
    for i in range(repeats):  # interleaved, so that a change in the machine's load hits every side
        limits.append(run_limit(bundle, input_dir, retries))
        print(f"  {kind} {rows:,}-row shards, machine's limit run {i + 1}: {limits[-1]['limit']:,.0f} rows/s "
              f"(onnxruntime alone {limits[-1]['onnxruntime']:,.0f}, stacking alone {limits[-1]['stacking']:,.0f}, "
              f"read + write alone {limits[-1]['read_write']:,.0f}, combined {limits[-1]['combined']:,.0f}, "
              f"pipelined {limits[-1]['pipelined']:,.0f}; load average "
              f"{os.getloadavg()[0]:.2f})", flush=True)
        for side in CONTENDERS:
            run = quietest(lambda: measures[side](False), retries)
            runs[side].append(run)
            print(f"  {kind} {rows:,}-row shards, {side} run {i + 1}: {run.steady_rate:,.0f} rows/s steady, "
                  f"{run.e2e_seconds:.1f} s end to end (rest of the machine: {run.usage.rest_cores:.2f} cores)",
                  flush=True)
    memories = {}
    for side in CONTENDERS:  # a run of each with its memory sampled, its rates not counted (see _run_measured)
        memories[side] = measures[side](True)
        print(f"  {kind} {rows:,}-row shards, {side} memory run: peak PSS {_mib(memories[side].usage.tree)} MiB "
              f"(tree), {_mib(memories[side].usage.worker)} MiB (largest worker)", flush=True)
    mismatch, largest = same_output(DATA / "out-tight-loop", DATA / "out-platform")
    if mismatch:
        raise SystemExit(f"OUTPUTS DIFFER ({kind}, {rows:,}-row shards): {mismatch}")
    as_workers = run_limit(bundle, input_dir, retries, worker_variables())
    print(f"  {kind} {rows:,}-row shards, machine's limit with the workers' variables: {as_workers['limit']:,.0f} "
          f"rows/s (read + write alone {as_workers['read_write']:,.0f}, pipelined {as_workers['pipelined']:,.0f})",
          flush=True)
    return Cell(kind, shards, rows, {side: best(r, memories[side]) for side, r in runs.items()},
                {key: max(m[key] for m in limits) for key in limits[0]}, as_workers)


def main(argv: list[str] | None = None) -> int:
    """Prepare the data, run every cell, print the tables and the ratios."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="about 1M rows per cell, one run: under 3 minutes")
    parser.add_argument("--rows", type=int, help="rows per cell (each size gets rows / size shards, at least 2); "
                        "default 4,000,000, quick 800,000")
    parser.add_argument("--sizes", type=int, nargs="+", help=f"rows per shard; default {SHARD_ROWS}")
    parser.add_argument("--models", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--repeats", type=int, help="runs per contender, best kept; default 2, quick 1")
    parser.add_argument("--retries", type=int,
                        help=f"runs measured again while other processes use over {NOISY_CORES} cores (default 1, "
                        "quick 0)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--tight-loop", nargs=3, metavar=("BUNDLE", "INPUT", "OUTPUT"), help=argparse.SUPPRESS)
    parser.add_argument("--dask-script", nargs=3, metavar=("BUNDLE", "INPUT", "OUTPUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tight_loop:
        bundle, input_dir, output_dir = map(Path, args.tight_loop)
        print(json.dumps(tight_loop(bundle, input_dir, output_dir, os.cpu_count() or 1)))
        return 0
    if args.dask_script:
        print(json.dumps(dask_script(*map(Path, args.dask_script))))
        return 0
    total = args.rows or (800_000 if args.quick else 4_000_000)
    repeats = args.repeats or (1 if args.quick else 2)
    sizes = args.sizes or list(SHARD_ROWS)
    retries = args.retries if args.retries is not None else (0 if args.quick else 1)
    if args.quick:
        QUIET_WAIT_S[0] = 5.0

    bundles = prepare_models()
    inputs = [(size, max(2, round(total / size))) for size in sizes]
    folders = {size: prepare_shards(count, size) for size, count in inputs}
    load = os.getloadavg()[0]
    print(f"{os.cpu_count()} cores (load average {load:.2f}); {total:,} rows per cell; {repeats} run(s) per "
          "contender; every contender on its defaults", flush=True)
    if load > 0.5:
        print("  warning: something else is using the CPUs; the figures will be noisy", flush=True)
    cells = []
    prefect_server("start")
    try:
        # A user's first run starts the home's warm batch runner (imports, Prefect client, LocalCluster);
        # later runs hand their job to it. Shown, not timed in the cells: the targets are for runs once it runs.
        first = run_platform(args.models[0], folders[min(sizes)])
        print(f"first platform run (it starts the home's batch runner): {first.e2e_seconds:.1f} s end to end, "
              f"{first.outside_seconds:.1f} s of it outside the steady window", flush=True)
        for kind in args.models:
            for size, count in inputs:
                cell = run_cell(kind, bundles[kind], folders[size], count, size, repeats, retries)
                print_cell(cell)
                cells.append(cell)
    finally:
        prefect_server("stop")
    met = summary(cells)
    if args.quick:
        print("(quick mode: a worker's first shard, model load included, weighs on the steady figures; "
              "read the ratios from a full run)")
    return 1 if args.strict and not met else 0


if __name__ == "__main__":
    sys.exit(main())
