"""Measured latency and throughput of a loaded model on this machine, per batch size.

``profile_model`` calls ``runtime.predict`` back to back at each batch size for a
set time and records the per-call p50/p99 latency and the rows per second, with
the threads and the device the model ran on. ``shardline.machines.machine_kind`` names
this machine, the key under which ``shardline.quality.model_profiles.profile_version``
stores the profile in the registry, so that the placement decision
(``shardline.placement``) can compare machines it is not on.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa

from shardline.errors import InvalidSetting
from shardline.machines import machine_kind, usable_cores
from shardline.runtimes.base import Runtime

DEFAULT_BATCH_SIZES = (1, 8, 64, 512, 4096)
PROFILE_FORMAT = 1
_MIN_CALLS = 5
_MAX_CALLS = 100_000


def _rows(sample: pa.Table, size: int) -> pa.Table:
    """Exactly ``size`` rows, repeating the sample as needed."""
    if sample.num_rows == 0:
        raise InvalidSetting("the sample table has no rows; profile with at least one row of real inputs")
    copies = -(-size // sample.num_rows)
    return pa.concat_tables([sample] * copies).slice(0, size).combine_chunks()


def _measure(runtime: Runtime, batch: pa.Table, seconds: float, clock: Callable[[], float]) -> list[float]:
    """Per-call seconds of back-to-back predicts for about ``seconds`` (at least a few calls)."""
    runtime.predict(batch)  # warm up: first-call allocations are not the steady state
    durations: list[float] = []
    start = clock()
    while len(durations) < _MAX_CALLS:
        before = clock()
        runtime.predict(batch)
        durations.append(clock() - before)
        if len(durations) >= _MIN_CALLS and clock() - start >= seconds:
            break
    return durations


def profile_model(
    runtime: Runtime,
    sample_table: pa.Table,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    seconds_per_size: float = 0.5,
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Measure a loaded model's latency and throughput at each batch size on this machine.

    Args:
        runtime: a loaded model.
        sample_table: real input rows (repeated to fill the larger batches).
        batch_sizes: rows per call to measure.
        seconds_per_size: how long to call the model at each size (at least 5 calls).
        clock: seconds, monotonic (a test may pass its own).

    Returns:
        ``{"format", "machine", "device", "threads", "measured_at", "batches": [{"batch_size",
        "calls", "p50_ms", "p99_ms", "mean_ms", "rows_per_s"}, ...]}``.

    Raises:
        InvalidSetting: a batch size below 1, a non-positive duration, or an empty sample.
    """
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise InvalidSetting(f"batch sizes must be whole numbers of at least 1, got {list(batch_sizes)}")
    if seconds_per_size <= 0:
        raise InvalidSetting(f"seconds_per_size must be positive, got {seconds_per_size}")
    rows = []
    for size in sorted(set(batch_sizes)):
        durations = np.array(_measure(runtime, _rows(sample_table, size), seconds_per_size, clock))
        total = float(durations.sum())
        rows.append({
            "batch_size": size,
            "calls": int(durations.size),
            "p50_ms": float(np.percentile(durations, 50) * 1e3),
            "p99_ms": float(np.percentile(durations, 99) * 1e3),
            "mean_ms": float(durations.mean() * 1e3),
            "rows_per_s": size * durations.size / total if total > 0 else float("inf"),
        })
    device = runtime.device
    return {
        "format": PROFILE_FORMAT,
        "machine": machine_kind(device),
        "device": device,
        "threads": runtime.options.intra_op_threads or usable_cores(),
        "measured_at": datetime.now(timezone.utc).isoformat(),
        "batches": rows,
    }

