"""Batch throughput: `shardline batch run` side by side with a tight hand-written loop.

Both sides score the same Parquet shards with the same ONNX model (the breast-cancer
GBT of ``shardline.examples``, 100 trees) and write the same output parts (``id``,
``label``, ``probabilities``):

- tight loop: one process, one Python thread, shard after shard:
  ``pq.ParquetFile.iter_batches`` -> stack the 30 features to float32 -> onnxruntime
  with every core as intra-op threads (not spinning) -> ``pq.ParquetWriter``. No
  Prefect, no Dask.
- platform: ``shardline batch run --json`` as a user runs it (Prefect's temporary
  server, a LocalCluster with one worker process per core, default settings).

Each side runs in its own process, sampled with psutil for its memory (the whole
process tree, and each Dask worker process). Printed per run: rows/s end to end
(process start to process exit: interpreter, imports, Prefect and cluster start-up
included) and in steady state (first shard started to last part committed); then the
ratios platform / tight loop. The platform also runs over twice the shards to show
that a worker's peak memory does not grow with the input.

    .venv/bin/python bench/batch_throughput.py            # full: ~1.5 min on 2 cores (+40 s once)
    .venv/bin/python bench/batch_throughput.py --quick    # small sizes: ~20 s

Data lives under bench/.data/batch/ (git-ignored): the shards are written once and
reused; the bundle, registry and outputs are made afresh on every run.
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

from shardline._cli_common import OFF_THE_NETWORK  # noqa: E402 (the CLI's own list)

for _key, _value in OFF_THE_NETWORK.items():
    os.environ.setdefault(_key, _value)

HERE = Path(__file__).resolve().parent
DATA = HERE / ".data" / "batch"
MODEL = "breast-cancer"
BATCH_ROWS = 65_536
STEADY_TARGET = 0.9  # platform steady rows/s >= 0.9 x the tight loop's
MEMORY_GROWTH_LIMIT = 1.25  # peak worker RSS at 2N shards <= 1.25 x at N shards
MiB = 1024 * 1024
NOISY_CORES = 0.25  # other processes using more than this during a run make it noisy


# --------------------------------------------------------------------------- tight loop


def tight_loop(bundle: Path, input_dir: Path, output_dir: Path, threads: int) -> dict[str, Any]:
    """Score every shard of ``input_dir`` into ``output_dir``, the plainest way; returns timings.

    Runs in a child process (``--tight-loop``) so that its start-up and memory are
    measured the same way as the platform's.
    """
    import numpy as np
    import onnxruntime as ort
    import pyarrow as pa
    import pyarrow.parquet as pq

    manifest = json.loads((bundle / "manifest.json").read_text())
    binding = manifest["runtime_config"]["tensor_inputs"][0]
    features: list[str] = binding["columns"]
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # Idle intra-op threads sleep instead of spinning while this thread reads and writes: the
    # same speed on a quiet machine, and no collapse (2-3x slower) when the cores are shared.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(bundle / "model.onnx"), options, providers=["CPUExecutionProvider"])
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
                label, probabilities = session.run(["label", "probabilities"], {binding["name"]: x})
                flat = pa.array(np.ascontiguousarray(probabilities).ravel())
                writer.write_batch(
                    pa.RecordBatch.from_arrays(
                        [batch.column("id"), pa.array(label), pa.FixedSizeListArray.from_arrays(flat, 2)],
                        schema=schema,
                    )
                )
                rows += batch.num_rows
    return {"rows": rows, "steady_seconds": time.perf_counter() - started}


# --------------------------------------------------------------------------- data


def prepare(shards: int, rows_per_shard: int) -> tuple[Path, Path, Path]:
    """Bundle, registry (model@prod) and shards under bench/.data/batch.

    The bundle and registry are made anew on every run (seconds; their formats follow
    the code), the shards once. Returns (bundle folder, N-shard input folder, 2N-shard
    input folder); the N folder holds hard links to the first N shards of the 2N
    folder, so both read the same bytes.
    """
    from shardline.examples import package_breast_cancer, write_shards
    from shardline.storage.registry import ModelRegistry

    bundle, home = DATA / "bundle", DATA / "home"
    shutil.rmtree(bundle, ignore_errors=True)
    shutil.rmtree(home, ignore_errors=True)
    package_breast_cancer(bundle, name=MODEL, kind="gbt")
    registry = ModelRegistry(str(home / "registry"))
    pushed = registry.push(bundle)
    registry.set_alias(pushed.name, "prod", pushed.version or 1, reason="bench")

    full = DATA / f"shards-{2 * shards}x{rows_per_shard}"
    stamp = full / "_complete"
    if not stamp.exists():
        shutil.rmtree(full, ignore_errors=True)
        print(f"writing {2 * shards} shards of {rows_per_shard:,} rows into {full} (once)", flush=True)
        write_shards(full, 2 * shards, rows_per_shard, row_group_rows=BATCH_ROWS)
        stamp.write_text("")
    half = DATA / f"shards-{shards}x{rows_per_shard}"
    if not (half / "_complete").exists():
        shutil.rmtree(half, ignore_errors=True)
        half.mkdir(parents=True)
        for path in sorted(full.glob("*.parquet"))[:shards]:
            try:
                os.link(path, half / path.name)
            except OSError:
                shutil.copy2(path, half / path.name)
        (half / "_complete").write_text("")
    return bundle, half, full


# --------------------------------------------------------------------------- measuring


@dataclass
class Usage:
    """What a run's process tree used: peak resident memory (bytes) and CPU time."""

    tree: int = 0  # RSS of all its processes together, at the worst sample
    worker: int = 0  # RSS of the largest Dask worker process (the tight loop: its process)
    workers: int = 0  # RSS of all Dask worker processes together, at the worst sample
    cpu_seconds: float = 0.0  # user + system CPU time of the whole tree, start-up included
    rest_cores: float = 0.0  # cores the rest of the machine used meanwhile, on average


def _sample(root_pid: int, usage: Usage, done: threading.Event, interval: float) -> None:
    import psutil

    try:
        root = psutil.Process(root_pid)
    except psutil.NoSuchProcess:
        return
    kinds: dict[int, bool] = {}  # pid -> is a Dask worker (spawned by multiprocessing)
    while not done.is_set():
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        tree = workers = largest = 0
        for proc in procs:
            try:
                rss = proc.memory_info().rss
                if proc.pid not in kinds:
                    kinds[proc.pid] = "spawn_main" in " ".join(proc.cmdline())
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            tree += rss
            if kinds[proc.pid]:
                workers += rss
                largest = max(largest, rss)
        usage.tree = max(usage.tree, tree)
        usage.workers = max(usage.workers, workers)
        usage.worker = max(usage.worker, largest)
        done.wait(interval)


def _busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot."""
    import psutil

    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def wait_for_quiet(limit: float = 30.0, busy_cores: float = 0.25) -> float:
    """Wait (up to ``limit`` s) until the machine uses under ``busy_cores`` cores; returns the last figure."""
    import psutil

    deadline = time.monotonic() + limit
    while True:
        used = psutil.cpu_percent(interval=1.0) / 100 * (os.cpu_count() or 1)
        if used < busy_cores or time.monotonic() > deadline:
            return used


@dataclass
class Run:
    """One side's run over one input."""

    side: str
    shards: int
    rows: int
    e2e_seconds: float
    steady_seconds: float
    usage: Usage = field(default_factory=Usage)

    @property
    def e2e_rate(self) -> float:
        """Rows per second, start-up included."""
        return self.rows / self.e2e_seconds

    @property
    def steady_rate(self) -> float:
        """Rows per second from the first shard started to the last part committed."""
        return self.rows / self.steady_seconds


def _run_measured(command: list[str], env: dict[str, str], interval: float = 0.1) -> tuple[float, str, Usage]:
    """Run a command to its end, sampling its process tree; returns (wall seconds, stdout, usage)."""
    usage, done = Usage(), threading.Event()
    wait_for_quiet()
    before, busy_before = resource.getrusage(resource.RUSAGE_CHILDREN), _busy_cpu_seconds()
    started = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = threading.Thread(target=_sample, args=(proc.pid, usage, done, interval), daemon=True)
    sampler.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - started
    done.set()
    sampler.join()
    after, busy_after = resource.getrusage(resource.RUSAGE_CHILDREN), _busy_cpu_seconds()
    # RUSAGE_CHILDREN counts every descendant that was waited for: Dask workers, Prefect's server
    usage.cpu_seconds = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
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


def _env() -> dict[str, str]:
    env = dict(os.environ, **OFF_THE_NETWORK)
    env["SHARDLINE_STORAGE_HOME"] = str(DATA / "home")
    env["PREFECT_HOME"] = str(DATA / "prefect-home")  # keep the bench's temporary server state here
    env.pop("PREFECT_API_URL", None)  # always Prefect's temporary server, as on a fresh machine
    return env


def run_tight(bundle: Path, input_dir: Path, shards: int) -> Run:
    """The tight loop in a child process over ``input_dir``."""
    output = DATA / "out-tight"
    shutil.rmtree(output, ignore_errors=True)
    threads = os.cpu_count() or 1
    command = [sys.executable, str(Path(__file__).resolve()), "--tight-loop",
               str(bundle), str(input_dir), str(output), str(threads)]
    wall, out, usage = _run_measured(command, _env())
    result = _last_json(out)
    usage.worker = usage.tree  # one process: it is its own worker
    return Run("tight loop", shards, result["rows"], wall, result["steady_seconds"], usage)


def run_platform(input_dir: Path, shards: int, tag: str = "") -> Run:
    """``shardline batch run`` in a child process over ``input_dir``, from a clean output."""
    output = DATA / f"out-platform{tag}"
    shutil.rmtree(output, ignore_errors=True)  # else the job would skip every committed part
    command = [sys.executable, "-m", "shardline.cli", "batch", "run", "--model", f"{MODEL}@prod",
               "--input", str(input_dir), "--output", str(output), "--json"]
    wall, out, usage = _run_measured(command, _env())
    summary = _last_json(out)
    if summary["rows_out"] != summary["rows_in"] or summary["shards_quarantined"]:
        raise SystemExit(f"the platform did not score every row: {summary}")
    return Run("platform", shards, summary["rows_scored"], wall, summary["steady_seconds"], usage)


def same_output(tight_dir: Path, platform_dir: Path) -> tuple[str | None, float]:
    """(what differs or None, largest probability difference) between the two sides' parts.

    Ids and labels must be equal. Probabilities may differ in the last float32 bits:
    onnxruntime's tree ensemble adds the trees up in another order with 2 intra-op
    threads (tight loop) than with 1 (each platform worker); with equal thread counts
    they are bit for bit the same.
    """
    import numpy as np
    import pyarrow.parquet as pq

    tight = sorted(p.name for p in tight_dir.glob("*.parquet"))
    platform = sorted(p.name for p in platform_dir.glob("*.parquet"))
    if tight != platform:
        return f"parts differ: tight loop {tight}, platform {platform}", 0.0
    largest = 0.0
    for name in tight:
        a, b = pq.read_table(tight_dir / name), pq.read_table(platform_dir / name)
        if a.schema != b.schema:
            return f"{name}: schema {a.schema} vs {b.schema}", largest
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


def report(runs: list[Run]) -> None:
    """Print one line per side and input size."""
    header = (f"{'side':<11}{'shards':>7}{'rows':>12}{'e2e s':>7}{'e2e rows/s':>12}{'steady s':>9}"
              f"{'steady rows/s':>14}{'CPU s':>7}{'rest':>6}{'tree MiB':>9}{'worker MiB':>11}{'workers MiB':>12}")
    print()
    print(header)
    print("-" * len(header))
    for r in runs:
        u = r.usage
        workers = _mib(u.workers) if r.side == "platform" else "-"
        rest = f"{u.rest_cores:.2f}" + ("!" if u.rest_cores > NOISY_CORES else " ")
        print(f"{r.side:<11}{r.shards:>7}{r.rows:>12,}{r.e2e_seconds:>7.1f}{r.e2e_rate:>12,.0f}"
              f"{r.steady_seconds:>9.2f}{r.steady_rate:>14,.0f}{u.cpu_seconds:>7.1f}{rest:>6}"
              f"{_mib(u.tree):>9}{_mib(u.worker):>11}{workers:>12}")
    print("Times: the best of the repeats. CPU s: user+system seconds of the run's whole process tree.\n"
          f"rest: cores the rest of the machine used meanwhile (! over {NOISY_CORES}: the figures are noisy).\n"
          "MiB: peak RSS over the repeats; tree = every process of the run (for the platform: the CLI,\n"
          "Prefect's temporary server, the Dask workers), worker = the largest Dask worker process\n"
          "(the tight loop's own process), workers = all Dask workers together.")


def ratios(tight: Run, platform: Run, platform_2n: Run | None) -> bool:
    """Print platform / tight loop ratios and the memory growth; returns whether targets are met."""
    steady = platform.steady_rate / tight.steady_rate
    e2e = platform.e2e_rate / tight.e2e_rate
    ok = steady >= STEADY_TARGET
    print()
    print(f"steady state  platform / tight loop = {steady:.2f}x  (target >= {STEADY_TARGET:.2f}x: "
          f"{'met' if ok else 'MISSED'})")
    print(f"end to end    platform / tight loop = {e2e:.2f}x  (start-up and shut-down: platform "
          f"{platform.e2e_seconds - platform.steady_seconds:.1f} s, tight loop "
          f"{tight.e2e_seconds - tight.steady_seconds:.1f} s)")
    if platform_2n is not None:
        small, large = platform.usage, platform_2n.usage
        growth = large.worker / small.worker
        flat = growth <= MEMORY_GROWTH_LIMIT
        ok = ok and flat
        print(f"memory        peak worker RSS {_mib(small.worker)} MiB at {platform.shards} shards, "
              f"{_mib(large.worker)} MiB at {platform_2n.shards} = {growth:.2f}x  "
              f"(target <= {MEMORY_GROWTH_LIMIT:.2f}x: {'met' if flat else 'MISSED'}); "
              f"whole tree {_mib(small.tree)} -> {_mib(large.tree)} MiB")
    return ok


def best(runs: list[Run]) -> Run:
    """One line for a side: best steady and end-to-end times, worst memory, least CPU and noise."""
    top = max(runs, key=lambda r: r.steady_rate)
    usage = Usage(
        tree=max(r.usage.tree for r in runs),
        worker=max(r.usage.worker for r in runs),
        workers=max(r.usage.workers for r in runs),
        cpu_seconds=min(r.usage.cpu_seconds for r in runs),
        rest_cores=top.usage.rest_cores,
    )
    return Run(top.side, top.shards, top.rows, min(r.e2e_seconds for r in runs), top.steady_seconds, usage)


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


def _progress(what: str, run: Run) -> None:
    print(f"  {what}: {run.steady_rate:,.0f} rows/s steady, {run.e2e_seconds:.1f} s end to end "
          f"(rest of the machine: {run.usage.rest_cores:.2f} cores)", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Prepare the data, run both sides, print the table and the ratios."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat: under a minute")
    parser.add_argument("--shards", type=int, help="N: shards per run (the memory run uses 2N); default 16, quick 4")
    parser.add_argument("--rows", type=int, help="rows per shard; default 500,000, quick 100,000")
    parser.add_argument("--repeats", type=int, help="runs per side, best kept; default 2, quick 1")
    parser.add_argument("--no-memory-run", action="store_true", help="skip the platform run over 2N shards")
    parser.add_argument("--retries", type=int, default=1,
                        help=f"runs measured again while other processes use over {NOISY_CORES} cores (default 1)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--tight-loop", nargs=4, metavar=("BUNDLE", "INPUT", "OUTPUT", "THREADS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tight_loop:
        bundle, input_dir, output_dir, threads = args.tight_loop
        print(json.dumps(tight_loop(Path(bundle), Path(input_dir), Path(output_dir), int(threads))))
        return 0
    shards = args.shards or (4 if args.quick else 16)
    rows = args.rows or (100_000 if args.quick else 500_000)
    repeats = args.repeats or (1 if args.quick else 2)

    bundle, input_n, input_2n = prepare(shards, rows)
    load = os.getloadavg()[0]
    print(f"{os.cpu_count()} cores (load average {load:.2f}); {shards} shards x {rows:,} rows; "
          f"{repeats} run(s) per side; platform with default settings", flush=True)
    if load > 0.5:
        print("  warning: something else is using the CPUs; the figures will be noisy", flush=True)
    warm_page_cache(input_2n)
    tights, platforms = [], []
    for i in range(repeats):  # interleaved, so that a change in the machine's load hits both sides
        tights.append(quietest(lambda: run_tight(bundle, input_n, shards), args.retries))
        _progress(f"tight loop run {i + 1}", tights[-1])
        platforms.append(quietest(lambda: run_platform(input_n, shards), args.retries))
        _progress(f"platform   run {i + 1}", platforms[-1])
    mismatch, largest = same_output(DATA / "out-tight", DATA / "out-platform")
    if mismatch:
        print(f"OUTPUTS DIFFER: {mismatch}")
        return 1
    print(f"  outputs: same parts, ids and labels; probabilities within {largest:.1g}", flush=True)
    platform_2n = None
    if not args.no_memory_run:
        platform_2n = quietest(lambda: run_platform(input_2n, 2 * shards, tag="-2n"), args.retries)
        _progress(f"platform over {2 * shards} shards", platform_2n)
    runs = [best(tights), best(platforms), *([platform_2n] if platform_2n else [])]
    report(runs)
    met = ratios(runs[0], runs[1], platform_2n)
    if args.quick:
        print("(quick mode: a worker's first shard, model load included, weighs on the steady figures; "
              "read the ratios from a full run)")
    return 1 if args.strict and not met else 0


if __name__ == "__main__":
    sys.exit(main())
