"""The runtime contract that both tiers call."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeAlias, overload

import numpy as np
import pyarrow as pa

from shardline.bundle import Manifest
from shardline.rows import Rows


@dataclass(frozen=True)
class RuntimeOptions:
    """How to run a model: device wanted, threads per call, and whether idle threads spin.

    ``intra_op_threads`` 0 means every core (each tier passes its own default: see
    ``RuntimeSettings``); ``spinning`` lets onnxruntime's idle intra-op threads busy-wait for the
    next call (off by default: a spinning thread takes a core from the event loop, the reader and
    the writer beside it).
    """

    device: str = "auto"
    intra_op_threads: int = 0
    spinning: bool = False


Answer: TypeAlias = "pa.RecordBatch | dict[str, np.ndarray]"
"""What ``predict`` gives for ``Rows``: a record batch, or each output column as a numpy array."""

_OUT_OF_MEMORY = ("out of memory", "failed to allocate memory", "cudaerrormemoryallocation", "cuda_error_out_of_memory",
                  "bfc_arena", "oom when allocating")


def out_of_memory(error: BaseException | None) -> bool:
    """Whether a runtime's error says the device (or host) had no memory for the batch: torch's
    ``OutOfMemoryError``, ``MemoryError``, or onnxruntime's and CUDA's allocation failures by message."""
    if error is None:
        return False
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return True
    text = str(error).lower()
    return any(phrase in text for phrase in _OUT_OF_MEMORY)


def split_out_of_memory(score: Callable[[Rows], Answer], rows: Rows, split: Callable[[int, int], None],
                        is_out_of_memory: Callable[[BaseException], bool] = out_of_memory) -> Answer:
    """``score(rows)``; a batch the device has no memory for is split in two and each half scored the same way,
    down to one row (``split(rows, half)`` is told of each split: lower a batch limit, count, log). Only a single
    row that does not fit raises. Both tiers score through it, so neither fails what a smaller batch serves."""
    try:
        return score(rows)
    except Exception as e:
        if rows.num_rows <= 1 or not is_out_of_memory(e):
            raise
    half = rows.num_rows // 2
    split(rows.num_rows, half)
    return concat_answers([split_out_of_memory(score, rows.slice(0, half), split, is_out_of_memory),
                           split_out_of_memory(score, rows.slice(half, rows.num_rows - half), split, is_out_of_memory)])


def concat_answers(parts: list[Answer]) -> Answer:
    """The answers of consecutive slices of rows, as one (all of one kind, as one runtime gives them)."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], dict):
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}  # type: ignore[index]
    return pa.concat_batches(parts)  # type: ignore[arg-type]


class Runtime(ABC):
    """A loaded model: rows in, rows out, through one method, ``predict``, that both tiers call.

    Contract (``tests/runtime_conformance.py`` checks it; a new runtime's tests mix it in):
        - ``__init__`` only stores its arguments; ``load()`` does the work and may
          raise ``RuntimeUnavailable`` (a package or device is missing: the message names
          the extra to install) or ``InvalidBundle`` (an artifact is missing or unreadable).
        - ``predict(rows)`` takes the rows in one of two forms and picks its own fast path:
            * an Arrow record batch or table holding at least the signature's input columns
              (other columns are ignored): the answer is a record batch;
            * ``shardline.rows.Rows``, rows already checked against the signature
              (``check_rows``, or ``float_rows`` for float arrays a decoder built). When they hold
              float arrays (``Rows.arrays``, in the signature's ``FloatLayout``) a runtime may score
              those without Arrow and answer each output column as a numpy array of exactly its
              signature type (shape ``(rows,)``, or ``(rows, k)`` for ``fixed_size_list[k]``); where it
              cannot, it reads ``Rows.table()`` and answers a record batch.
          Either way the answer holds exactly the signature's output columns and types, one row per
          input row, in the same order, and the same values whichever form the rows came in (floats
          to rounding). An empty batch answers no rows; a row gets the same answer alone as in any
          batch. Input columns that are missing or cannot become the model's tensors raise
          ``InvalidInput`` naming the column. It is safe to call from several threads at once.
        - ``predict`` before ``load()`` or after ``close()`` raises ``RuntimeError``.
        - ``close()`` releases what ``load()`` took (twice is harmless); the object is then unusable.
    """

    def __init__(self, bundle_dir: Path, manifest: Manifest, options: RuntimeOptions) -> None:
        self.bundle_dir = bundle_dir
        self.manifest = manifest
        self.options = options

    @abstractmethod
    def load(self) -> None:
        """Load the model into memory (and onto its device)."""

    @overload
    def predict(self, rows: Rows) -> Answer: ...

    @overload
    def predict(self, rows: pa.RecordBatch | pa.Table) -> pa.RecordBatch: ...

    @abstractmethod
    def predict(self, rows: pa.RecordBatch | pa.Table | Rows) -> Answer:
        """Score rows; see the class docstring for the contract."""

    @property
    @abstractmethod
    def device(self) -> str:
        """The device the loaded model actually runs on: 'cpu' or 'cuda'."""

    def close(self) -> None:
        """Release the model; the default has nothing to release."""
