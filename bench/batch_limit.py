"""The machine's limit for batch scoring, on the same shards and model as ``batch_throughput.py``.

Four measures, each on every core of the machine at once: one worker process per core (forked from
this one once, as Dask's local workers are one per core), each with its own onnxruntime session of one
intra-op thread, not spinning, and pyarrow on its own thread (``use_threads=False``), so no GIL is shared:

- **onnxruntime alone**: the shards' feature matrices (float32, in batches of 65,536 rows) held in
  memory beforehand (at most ``IN_MEMORY_ROWS`` rows, cycled to the cell's rows), scored and dropped.
- **stacking alone**: the same batches held as read (the shards' float64 columns), each stacked into
  the float32 ``(rows, 30)`` matrix the model takes: work neither of the two other parts does, and
  every contender must (the tight loop, the Dask script and the platform each do it their way; here the
  fastest way measured, a block of rows at a time into a matrix kept from batch to batch, as the platform's workers
  stack: ``shardline.arrays.stack_columns`` with a ``MatrixScratch``).
- **read + write alone**: each shard read in batches of 65,536 rows (``id`` and the features, as the
  platform reads them) and a part of the same rows written with the platform's output schema and
  encoding (``id``, ``label``, ``probabilities``; the model's answers to a batch computed once
  beforehand and written for every batch, so no scoring happens), one shard per worker at a time.
- **pipelined**: read -> stack the features -> score -> write, one shard per worker at a time,
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
import shutil
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardline.arrays import MatrixScratch, stack_columns

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


def _matrix(batch: pa.RecordBatch, features: list[str], scratch: MatrixScratch | None = None) -> np.ndarray:
    """The features as the model's float32 matrix, stacked the fastest way measured (a block of rows at a time
    through a transposed buffer, ``stack_columns``: a quarter of the CPU of filling it column by column), into
    ``scratch``'s matrices when given (no fresh array a batch, as the platform's workers stack)."""
    return stack_columns([batch.column(name).to_numpy() for name in features], batch.num_rows, np.float32, scratch)


_STATE: "Limits | None" = None  # the measures' inputs, set before the worker processes fork from this one
_SESSION: list[Any] = []  # in a worker process: its onnxruntime session
_SCRATCH: list[MatrixScratch] = []  # in a worker process: the matrices it stacks batches into


def _start_worker(bundle: Path) -> None:
    _SESSION.append(_session(bundle))
    _SCRATCH.append(MatrixScratch())


def _score_matrices(span: tuple[int, int]) -> int:
    state, rows = _STATE, 0
    assert state is not None
    for i in range(*span):
        x = state.matrices[i % len(state.matrices)]
        _SESSION[0].run(["label", "probabilities"], {state.feed: x})
        rows += int(x.shape[0])
    return rows


def _stack_batches(span: tuple[int, int]) -> int:
    state, rows = _STATE, 0
    assert state is not None
    for i in range(*span):
        rows += int(_matrix(state.batches[i % len(state.batches)], state.features, _SCRATCH[0]).shape[0])
    return rows


def _write_part(shard: Path, score: bool) -> int:
    """Read a shard and write its part: stacked and scored (``score``: the pipelined measure), or with the model's
    answers to one batch (read + write alone)."""
    state, rows = _STATE, 0
    assert state is not None
    with pq.ParquetWriter(state.output_dir / shard.name, state.schema, use_dictionary=state.dictionary) as out:
        for batch in pq.ParquetFile(shard).iter_batches(batch_size=BATCH_ROWS, columns=["id", *state.features],
                                                        use_threads=False):
            n = batch.num_rows
            if score:
                answers = _answers(*_SESSION[0].run(["label", "probabilities"],
                                                    {state.feed: _matrix(batch, state.features, _SCRATCH[0])}))
            else:
                answers = state.answers if n == state.answers.num_rows else state.answers.slice(0, n)
            out.write_batch(pa.RecordBatch.from_arrays([batch.column(0), *answers.columns], schema=state.schema))
            rows += n
    return rows


def _answers(label: np.ndarray, probabilities: np.ndarray) -> pa.RecordBatch:
    flat = pa.array(np.ascontiguousarray(probabilities, dtype=np.float32).ravel())
    return pa.RecordBatch.from_arrays(
        [pa.array(label), pa.FixedSizeListArray.from_arrays(flat, 2)],
        schema=pa.schema([pa.field("label", pa.int64(), nullable=False),
                          pa.field("probabilities", pa.list_(pa.float32(), 2), nullable=False)]),
    )


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
    """The measures' inputs over one folder of shards (see the module docstring), read in this process; the
    measures run in one worker process per core, forked from it, each with its own session."""

    def __init__(self, bundle: Path, input_dir: Path, output_dir: Path, rows: int) -> None:
        from shardline.storage.shards import dictionary_columns

        self.bundle = bundle
        self.feed, self.features = _features(bundle)
        self.shards = sorted(input_dir.glob("*.parquet"))
        self.output_dir = output_dir
        self.rows = rows
        self.batches: list[pa.RecordBatch] = []
        held = 0
        for shard in self.shards:
            for batch in pq.ParquetFile(shard).iter_batches(batch_size=BATCH_ROWS, columns=self.features,
                                                            use_threads=False):
                self.batches.append(batch)
                held += batch.num_rows
                if held >= min(rows, IN_MEMORY_ROWS):
                    break
            if held >= min(rows, IN_MEMORY_ROWS):
                break
        self.matrices = [_matrix(batch, self.features) for batch in self.batches]
        self.repeat = max(1, round(rows / held * len(self.batches)))  # batches a pass over in-memory rows
        # The model's answers to the first batch, written for every batch by read + write alone. (This process's
        # session runs no thread: one intra-op thread, not spinning, so the workers may fork from it.)
        label, probabilities = _session(bundle).run(["label", "probabilities"], {self.feed: self.matrices[0]})
        self.answers = _answers(label, probabilities)
        self.schema = pa.schema([pa.field("id", pa.int64()), *self.answers.schema])
        self.dictionary = dictionary_columns(self.schema, ["id"])  # the platform's encoding of its parts

    def measure(self, cores: int) -> dict[str, float]:
        """Every measure, on ``cores`` worker processes."""
        import multiprocessing

        global _STATE
        _STATE = self  # the workers inherit it (fork): the in-memory batches are not copied to them
        with multiprocessing.get_context("fork").Pool(cores, _start_worker, (self.bundle,)) as pool:
            spans = _spans(self.repeat, cores * 4)

            def shards_pass(work: Callable[[Path], int]) -> Callable[[], int]:
                def one_pass() -> int:
                    shutil.rmtree(self.output_dir, ignore_errors=True)
                    self.output_dir.mkdir(parents=True)
                    return sum(pool.map(work, self.shards, chunksize=1))
                return one_pass

            return {
                "onnxruntime": _best_rate(lambda: sum(pool.map(_score_matrices, spans, chunksize=1))),
                "stacking": _best_rate(lambda: sum(pool.map(_stack_batches, spans, chunksize=1))),
                "read_write": _best_rate(shards_pass(partial(_write_part, score=False))),
                "pipelined": _best_rate(shards_pass(partial(_write_part, score=True))),
            }


def _spans(items: int, parts: int) -> list[tuple[int, int]]:
    """``range(items)`` in about ``parts`` consecutive spans."""
    step = max(1, -(-items // parts))
    return [(i, min(items, i + step)) for i in range(0, items, step)]


def measure(bundle: Path, input_dir: Path, output_dir: Path, rows: int, cores: int) -> dict[str, Any]:
    """The measures and the limit, as a dict (rows/s)."""
    found = Limits(bundle, input_dir, output_dir, rows).measure(cores)
    shutil.rmtree(output_dir, ignore_errors=True)
    combined = 1.0 / (1.0 / found["onnxruntime"] + 1.0 / found["stacking"] + 1.0 / found["read_write"])
    return {**found, "combined": combined, "limit": max(combined, found["pipelined"]), "cores": cores}


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
