"""The machine's limit for batch scoring, on the same shards and model as ``batch_throughput.py``.

Three measures, each on every core of the machine at once (one Python thread per core, each with its
own onnxruntime session of one intra-op thread, not spinning; onnxruntime and pyarrow release the GIL
for their work, so the threads run side by side as worker processes would):

- **onnxruntime alone**: the shards' feature matrices (float32, in batches of 65,536 rows) held in
  memory beforehand (at most ``IN_MEMORY_ROWS`` rows, cycled to the cell's rows), scored and dropped.
- **stacking alone**: the same batches held as read (the shards' float64 columns), each stacked into
  the float32 ``(rows, 30)`` matrix the model takes: work neither of the two other parts does, and
  every contender must (the tight loop, the Dask script and the platform each do it their way).
- **read + write alone**: each shard read in batches of 65,536 rows (``id`` and the features, as the
  platform reads them) and a part of the same rows written with the platform's output schema and
  encoding (``id``, ``label``, ``probabilities``; the model's answers to a batch computed once
  beforehand and written for every batch, so no scoring happens), one shard per thread at a time.
- **pipelined**: read -> stack the features -> score -> write, one shard per thread at a time,
  nothing else (no checks, no ledger, no capture, no commit): what the machine does with both.

Then ``combined = 1 / (1/onnxruntime + 1/stacking + 1/read+write)`` (the parts sharing the cores, one
after the other) and ``limit = max(combined, pipelined)``: the platform's fraction is taken against the
higher, so that it is never flattered. Each measure is the best of ``WINDOWS`` timed windows of at least
``WINDOW_S`` seconds (whole passes over the cell's rows): a busy machine only ever lowers a rate.

    .venv/bin/python bench/batch_limit.py BUNDLE INPUT_DIR OUTPUT_DIR [--rows N]   # prints one JSON line

Run by ``batch_throughput.py`` in a child process per cell, like its contenders.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

BATCH_ROWS = 65_536
IN_MEMORY_ROWS = 524_288  # onnxruntime and stacking alone: at most this many rows held (~190 MiB)
WINDOWS = 3
WINDOW_S = 0.5


def _features(bundle: Path) -> tuple[str, list[str]]:
    manifest = json.loads((bundle / "manifest.json").read_text())
    binding = manifest["runtime_config"]["tensor_inputs"][0]
    return binding["name"], list(binding["columns"])


def _session(bundle: Path) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(bundle / "model.onnx"), options, providers=["CPUExecutionProvider"])


def _matrix(batch: pa.RecordBatch, features: list[str]) -> np.ndarray:
    x = np.empty((batch.num_rows, len(features)), dtype=np.float32)
    for j, name in enumerate(features):
        x[:, j] = batch.column(name).to_numpy()
    return x


def _on_every_core(work: list[Any], do: Callable[[int, Any], int], cores: int) -> int:
    """``do(thread, item)`` for every item, ``cores`` threads taking items in turn; returns the rows they did."""
    items: queue.SimpleQueue[Any] = queue.SimpleQueue()
    for item in work:
        items.put(item)
    done = [0] * cores
    errors: list[BaseException] = []

    def run(me: int) -> None:
        try:
            while True:
                try:
                    item = items.get_nowait()
                except queue.Empty:
                    return
                done[me] += do(me, item)
        except BaseException as e:  # raised again in the caller
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(cores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sum(done)


def _best_rate(one_pass: Callable[[], int]) -> float:
    """Rows/s of ``one_pass`` (returns the rows it did): the best of ``WINDOWS`` windows of whole passes, each at
    least ``WINDOW_S`` seconds."""
    best = 0.0
    for _ in range(WINDOWS):
        rows, started = 0, time.perf_counter()
        while True:
            rows += one_pass()
            elapsed = time.perf_counter() - started
            if elapsed >= WINDOW_S:
                break
        best = max(best, rows / elapsed)
    return best


class Limits:
    """The three measures over one folder of shards (see the module docstring)."""

    def __init__(self, bundle: Path, input_dir: Path, output_dir: Path, rows: int, cores: int) -> None:
        from shardline.storage.shards import dictionary_columns

        self.feed, self.features = _features(bundle)
        self.shards = sorted(input_dir.glob("*.parquet"))
        self.output_dir = output_dir
        self.rows = rows
        self.cores = cores
        self.sessions = [_session(bundle) for _ in range(cores)]
        first = next(pq.ParquetFile(self.shards[0]).iter_batches(batch_size=BATCH_ROWS, columns=self.features))
        label, probabilities = self.sessions[0].run(["label", "probabilities"], {self.feed: _matrix(first, self.features)})
        self.answers = self._answers(label, probabilities)
        self.schema = pa.schema([pa.field("id", pa.int64()), *self.answers.schema])
        self.dictionary = dictionary_columns(self.schema, ["id"])  # the platform's encoding of its parts

    def _answers(self, label: np.ndarray, probabilities: np.ndarray) -> pa.RecordBatch:
        flat = pa.array(np.ascontiguousarray(probabilities, dtype=np.float32).ravel())
        return pa.RecordBatch.from_arrays(
            [pa.array(label), pa.FixedSizeListArray.from_arrays(flat, 2)],
            schema=pa.schema([pa.field("label", pa.int64(), nullable=False),
                              pa.field("probabilities", pa.list_(pa.float32(), 2), nullable=False)]),
        )

    def _shard_passes(self, shard_job: Callable[[int, Path], int]) -> Callable[[], int]:
        """One pass: every shard once (at least the cell's rows: the folder holds them)."""
        def one_pass() -> int:
            shutil.rmtree(self.output_dir, ignore_errors=True)
            self.output_dir.mkdir(parents=True)
            return _on_every_core(self.shards, shard_job, self.cores)
        return one_pass

    def in_memory(self) -> tuple[float, float]:
        """Rows/s of the sessions alone on in-memory matrices, and of stacking in-memory batches into them."""
        batches, held = [], 0
        for shard in self.shards:
            for batch in pq.ParquetFile(shard).iter_batches(batch_size=BATCH_ROWS, columns=self.features):
                batches.append(batch)
                held += batch.num_rows
                if held >= min(self.rows, IN_MEMORY_ROWS):
                    break
            if held >= min(self.rows, IN_MEMORY_ROWS):
                break
        matrices = [_matrix(batch, self.features) for batch in batches]
        repeat = max(1, round(self.rows / held * len(batches)))

        def score(me: int, x: np.ndarray) -> int:
            self.sessions[me].run(["label", "probabilities"], {self.feed: x})
            return int(x.shape[0])

        def stack(me: int, batch: pa.RecordBatch) -> int:
            return int(_matrix(batch, self.features).shape[0])

        scored = _best_rate(lambda: _on_every_core([matrices[i % len(matrices)] for i in range(repeat)], score,
                                                   self.cores))
        stacked = _best_rate(lambda: _on_every_core([batches[i % len(batches)] for i in range(repeat)], stack,
                                                    self.cores))
        return scored, stacked

    def read_write(self) -> float:
        """Rows/s of reading each shard and writing a part of its rows, no scoring."""
        def copy(me: int, shard: Path) -> int:
            rows = 0
            with pq.ParquetWriter(self.output_dir / shard.name, self.schema, use_dictionary=self.dictionary) as out:
                for batch in pq.ParquetFile(shard).iter_batches(batch_size=BATCH_ROWS, columns=["id", *self.features],
                                                                use_threads=False):
                    n = batch.num_rows
                    answers = self.answers if n == self.answers.num_rows else self.answers.slice(0, n)
                    out.write_batch(pa.RecordBatch.from_arrays([batch.column(0), *answers.columns], schema=self.schema))
                    rows += n
            return rows

        return _best_rate(self._shard_passes(copy))

    def pipelined(self) -> float:
        """Rows/s of read -> stack -> score -> write, nothing else."""
        def score(me: int, shard: Path) -> int:
            rows = 0
            with pq.ParquetWriter(self.output_dir / shard.name, self.schema, use_dictionary=self.dictionary) as out:
                for batch in pq.ParquetFile(shard).iter_batches(batch_size=BATCH_ROWS, columns=["id", *self.features],
                                                                use_threads=False):
                    label, probabilities = self.sessions[me].run(["label", "probabilities"],
                                                                 {self.feed: _matrix(batch, self.features)})
                    answers = self._answers(label, probabilities)
                    out.write_batch(pa.RecordBatch.from_arrays([batch.column(0), *answers.columns], schema=self.schema))
                    rows += batch.num_rows
            return rows

        return _best_rate(self._shard_passes(score))


def measure(bundle: Path, input_dir: Path, output_dir: Path, rows: int, cores: int) -> dict[str, Any]:
    """The three measures and the limit, as a dict (rows/s)."""
    limits = Limits(bundle, input_dir, output_dir, rows, cores)
    (ort_rate, stacking), io_rate, pipelined = limits.in_memory(), limits.read_write(), limits.pipelined()
    shutil.rmtree(output_dir, ignore_errors=True)
    combined = 1.0 / (1.0 / ort_rate + 1.0 / stacking + 1.0 / io_rate)
    return {"onnxruntime": ort_rate, "stacking": stacking, "read_write": io_rate, "combined": combined,
            "pipelined": pipelined, "limit": max(combined, pipelined), "cores": cores}


def main(argv: list[str] | None = None) -> int:
    """Measure and print one JSON line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("input_dir", type=Path)
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--rows", type=int, help="rows of a pass over in-memory batches (default: the folder's)")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    rows = args.rows or sum(pq.ParquetFile(p).metadata.num_rows for p in args.input_dir.glob("*.parquet"))
    print(json.dumps(measure(args.bundle, args.input_dir, args.output_dir, rows, args.cores)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
