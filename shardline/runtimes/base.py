"""The runtime contract that both tiers call."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from shardline.bundle import Manifest


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


class Runtime(ABC):
    """A loaded model: a batch of rows in, a batch of rows out.

    Contract (``tests/runtime_conformance.py`` checks it; a new runtime's tests mix it in):
        - ``__init__`` only stores its arguments; ``load()`` does the work and may
          raise ``RuntimeUnavailable`` (a package or device is missing: the message names
          the extra to install) or ``InvalidBundle`` (an artifact is missing or unreadable).
        - ``predict(batch)`` takes an Arrow record batch or table holding at least the
          signature's input columns (already checked against it; other columns are ignored)
          and returns a record batch with exactly the signature's output columns and types,
          one row per input row, in the same order. An empty batch answers no rows; a row
          gets the same answer alone as in any batch (floats to rounding). Input columns that
          are missing or cannot become the model's tensors raise ``InvalidInput`` naming the
          column. It is safe to call from several threads at once.
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

    @abstractmethod
    def predict(self, batch: pa.RecordBatch | pa.Table) -> pa.RecordBatch:
        """Score rows; see the class docstring for the contract."""

    def predict_matrix(self, matrix: np.ndarray) -> dict[str, np.ndarray] | pa.RecordBatch | None:
        """Optional fast path for small batches: score rows given as one matrix, skipping Arrow.

        ``matrix`` is ``(rows, len(signature.inputs))``, C-ordered, of the signature's input
        type (every input a float column of one type), columns in the signature's order.
        Returns what ``predict`` would for the same rows: each output column as a numpy
        array of exactly its signature type (shape ``(rows,)``, or ``(rows, k)`` for
        ``fixed_size_list[k]``), or as the record batch when an output does not fit that form;
        None when this runtime does not take matrices (call ``predict``). The default: None.
        """
        return None

    @property
    @abstractmethod
    def device(self) -> str:
        """The device the loaded model actually runs on: 'cpu' or 'cuda'."""

    def close(self) -> None:
        """Release the model; the default has nothing to release."""
