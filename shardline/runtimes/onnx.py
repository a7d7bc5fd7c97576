"""ONNX Runtime: CPU by default, CUDA when the session really got it.

``runtime_config`` of an ONNX bundle may hold:

- ``tensor_inputs``: ``[{"name": "X", "columns": ["a", "b"], "dtype": "float32"}]``,
  feeding the ONNX input ``X`` with those columns stacked side by side. Without it,
  each ONNX input is fed from the column of the same name.
- ``tensor_outputs``: ``{"onnx_output_name": "column_name"}``; without it, outputs
  keep their ONNX names. Only outputs that the signature lists are returned.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from shardline.bundle import Manifest
from shardline.errors import InvalidBundle, InvalidInput, RuntimeUnavailable
from shardline.runtimes.base import Runtime, RuntimeOptions

_CUDA = "CUDAExecutionProvider"
_CPU = "CPUExecutionProvider"


def _column_matrix(batch: pa.RecordBatch | pa.Table, columns: list[str], dtype: np.dtype) -> np.ndarray:
    """Stack primitive columns into one C-ordered (rows, len(columns)) matrix."""
    out = np.empty((batch.num_rows, len(columns)), dtype=dtype)
    for j, name in enumerate(columns):
        out[:, j] = batch.column(name).to_numpy()
    return out


def _column_tensor(column: pa.Array | pa.ChunkedArray, dtype: np.dtype, rank: int | None) -> np.ndarray:
    """One column as a tensor: lists become 2-D, strings object arrays."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_fixed_size_list(column.type):
        values = column.flatten().to_numpy(zero_copy_only=False)
        return values.astype(dtype, copy=False).reshape(len(column), column.type.list_size)
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        return np.asarray(column.to_pylist(), dtype=dtype)
    values = column.to_numpy(zero_copy_only=False)
    if dtype != np.dtype(object):
        values = values.astype(dtype, copy=False)
    return values.reshape(-1, 1) if rank == 2 else values


def _to_arrow(values: Any, dtype: pa.DataType) -> pa.Array:
    """A model output (ndarray) as an Arrow array of the signature's type."""
    values = np.asarray(values)
    if values.ndim == 1:
        return pa.array(values).cast(dtype)
    if values.ndim == 2 and pa.types.is_fixed_size_list(dtype):
        flat = pa.array(np.ascontiguousarray(values).ravel()).cast(dtype.value_type)
        return pa.FixedSizeListArray.from_arrays(flat, values.shape[1])
    if values.ndim == 2 and values.shape[1] == 1:
        return pa.array(values[:, 0]).cast(dtype)
    return pa.array(list(values)).cast(dtype)


class OnnxModel(Runtime):
    """An ONNX model run by onnxruntime."""

    def __init__(self, bundle_dir: Path, manifest: Manifest, options: RuntimeOptions) -> None:
        super().__init__(bundle_dir, manifest, options)
        self._session: Any = None
        self._feeds: list[dict[str, Any]] = []
        self._outputs: list[tuple[str, str, pa.DataType]] = []

    def _providers(self, ort: Any) -> list[str]:
        available = ort.get_available_providers()
        wants_cuda = self.options.device in ("auto", "cuda") and "cuda" in self.manifest.hardware.devices
        if self.options.device == "cuda" and _CUDA not in available:
            raise RuntimeUnavailable(
                f"device 'cuda' was asked for {self.manifest.reference}, but this onnxruntime "
                f"offers only {available}; install 'shardline[gpu]' on a machine with a GPU, "
                "or set SHARDLINE_RUNTIME_DEVICE=cpu"
            )
        return [_CUDA, _CPU] if wants_cuda and _CUDA in available else [_CPU]

    def load(self) -> None:
        """Create the inference session and bind columns to tensors."""
        try:
            import onnxruntime as ort
        except ImportError as e:
            raise RuntimeUnavailable(
                "onnxruntime is not installed; pip install 'shardline[cpu]' (or [gpu])"
            ) from e
        model_files = [a.path for a in self.manifest.artifacts if a.path.endswith(".onnx")]
        if len(model_files) != 1:
            raise InvalidBundle(
                f"an ONNX bundle holds exactly one .onnx artifact; {self.manifest.reference} "
                f"lists {model_files}"
            )
        so = ort.SessionOptions()
        threads = self.options.intra_op_threads or (os.cpu_count() or 1)
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        self._session = ort.InferenceSession(
            str(self.bundle_dir / model_files[0]), sess_options=so, providers=self._providers(ort)
        )
        if self.options.device == "cuda" and self.device != "cuda":
            raise RuntimeUnavailable(
                f"{self.manifest.reference} asked for CUDA but the session got "
                f"{self._session.get_providers()}; check the CUDA and cuDNN libraries "
                "(pip install 'onnxruntime-gpu[cuda,cudnn]')"
            )
        self._bind()

    def _bind(self) -> None:
        config = self.manifest.runtime_config
        onnx_inputs = {i.name: i for i in self._session.get_inputs()}
        bindings = config.get("tensor_inputs") or [{"name": n} for n in onnx_inputs]
        self._feeds = []
        for binding in bindings:
            name = binding["name"]
            if name not in onnx_inputs:
                raise InvalidBundle(
                    f"{self.manifest.reference}: runtime_config binds ONNX input {name!r}, "
                    f"the model's inputs are {sorted(onnx_inputs)}"
                )
            info = onnx_inputs[name]
            dtype = np.dtype(binding.get("dtype") or _numpy_type(info.type))
            self._feeds.append(
                {"name": name, "columns": binding.get("columns"), "dtype": dtype, "rank": len(info.shape)}
            )
        rename = config.get("tensor_outputs", {})
        wanted = {c.name: c.arrow_type for c in self.manifest.signature.outputs}
        self._outputs = []
        for output in self._session.get_outputs():
            column = rename.get(output.name, output.name)
            if column in wanted:
                self._outputs.append((output.name, column, wanted[column]))
        missing = set(wanted) - {c for _, c, _ in self._outputs}
        if missing:
            raise InvalidBundle(
                f"{self.manifest.reference}: the signature lists outputs {sorted(missing)} that "
                f"the ONNX graph does not produce ({[o.name for o in self._session.get_outputs()]})"
            )

    @property
    def device(self) -> str:
        """'cuda' only when the session really runs on the CUDA provider."""
        if self._session is None:
            return "unloaded"
        return "cuda" if _CUDA in self._session.get_providers() else "cpu"

    def predict(self, batch: pa.RecordBatch | pa.Table) -> pa.RecordBatch:
        """Score a batch; returns the signature's output columns."""
        if self._session is None:
            raise RuntimeError("predict() before load()")
        feed = {}
        try:
            for binding in self._feeds:
                if binding["columns"]:
                    feed[binding["name"]] = _column_matrix(batch, binding["columns"], binding["dtype"])
                else:
                    feed[binding["name"]] = _column_tensor(
                        batch.column(binding["name"]), binding["dtype"], binding["rank"]
                    )
        except (KeyError, ValueError, pa.ArrowException) as e:
            raise InvalidInput(
                f"rows for {self.manifest.reference} could not be turned into tensors: {e}; "
                "check them against the model's signature (`shardline model list`)"
            ) from e
        names = [o for o, _, _ in self._outputs]
        results = self._session.run(names, feed)
        arrays = [_to_arrow(values, dtype) for values, (_, _, dtype) in zip(results, self._outputs)]
        return pa.RecordBatch.from_arrays(arrays, names=[c for _, c, _ in self._outputs])

    def close(self) -> None:
        """Drop the session."""
        self._session = None


def _numpy_type(onnx_type: str) -> str:
    table = {
        "tensor(float)": "float32",
        "tensor(double)": "float64",
        "tensor(float16)": "float16",
        "tensor(int64)": "int64",
        "tensor(int32)": "int32",
        "tensor(bool)": "bool",
        "tensor(string)": "object",
    }
    return table.get(onnx_type, "float32")
