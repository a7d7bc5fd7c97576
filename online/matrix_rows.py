"""A request's rows as a float matrix (``Matrix``), and as an Arrow table in one C++ call.

Two layouts: every input a float column (``MatrixRows``: the matrix's columns are the
signature's), or one ``fixed_size_list<float>[k]`` input, a model's ``[N, k]`` tensor
(``ListRows``: the matrix is that tensor, its rows the list values).

The protocol adapters' fast path decodes the commonest request (every input a float
column) into a (rows, columns) numpy matrix. Building the Arrow table from it column by
column costs about 1 us per column (30 µs for a 30-feature model: a slice and a wrapper
each); reading it as an Arrow IPC record batch costs one call. For each row count a
template is made once from a table built the slow way: the IPC message's metadata (which
depends only on the schema and the row count) and its body layout, checked to be one
buffer per column of ``rows * itemsize`` bytes padded to 8. Only the body is written per
request. Anything the template does not fit (nulls, other types) is built the slow way.
"""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa

_MAX_TEMPLATES = 256  # row counts remembered per schema (a bound: requests choose the row count)


class Matrix:
    """A request's rows as a ``(rows, columns)`` matrix, the columns in the signature's order and
    of its one float type (the protocol adapters' fast path decodes them so), or, for a signature of
    one ``fixed_size_list<float>[k]`` column, the ``(rows, k)`` tensor of its values. The data plane and
    the batcher score it with the runtime's ``predict_matrix``; ``table()`` gives the same rows as
    Arrow, for a runtime that takes no matrix."""

    __slots__ = ("values", "builder")

    def __init__(self, values: np.ndarray, builder: MatrixRows | ListRows) -> None:
        self.values = values
        self.builder = builder

    @property
    def num_rows(self) -> int:
        """Rows (as a table's ``num_rows``)."""
        return int(self.values.shape[0])

    def table(self) -> pa.Table:
        """The rows as a table of the signature's input columns."""
        return self.builder.table(self.values)

    @staticmethod
    def concat(parts: list[Matrix]) -> Matrix:
        """The rows of ``parts`` (of one signature) one after the other."""
        if len(parts) == 1:
            return parts[0]
        return Matrix(np.concatenate([p.values for p in parts]), parts[0].builder)


class ListRows:
    """Builds tables of one ``fixed_size_list<float>[k]`` column from (rows, k) matrices: the column's
    values are the matrix's, row-major, so one Arrow call wraps them."""

    def __init__(self, schema: pa.Schema) -> None:
        only = schema.field(0).type if len(schema) == 1 else None
        if (only is None or not pa.types.is_fixed_size_list(only)
                or only.value_type not in (pa.float32(), pa.float64())):
            raise ValueError(f"ListRows needs one fixed_size_list column of float32 or float64, got {schema}")
        self.schema = schema
        self.dtype = np.dtype(only.value_type.to_pandas_dtype())
        self.width = only.list_size

    def table(self, matrix: np.ndarray) -> pa.Table:
        """The rows of ``matrix`` (shape ``(rows, k)``, any float type) as a table of the schema."""
        values = pa.array(np.ascontiguousarray(matrix, dtype=self.dtype).ravel())
        column = pa.FixedSizeListArray.from_arrays(values, type=self.schema.field(0).type)
        return pa.Table.from_arrays([column], schema=self.schema)


class MatrixRows:
    """Builds tables of one schema (every column the same primitive float type) from matrices."""

    def __init__(self, schema: pa.Schema) -> None:
        types = {field.type for field in schema}
        if len(types) != 1 or next(iter(types)) not in (pa.float32(), pa.float64()):
            raise ValueError(f"MatrixRows needs columns of one float type, got {schema}")
        self.schema = schema
        self.dtype = np.dtype(next(iter(types)).to_pandas_dtype())
        self._templates: dict[int, tuple[bytes, int] | None] = {}
        self._lock = threading.Lock()

    def table(self, matrix: np.ndarray) -> pa.Table:
        """The rows of ``matrix`` (shape ``(rows, len(schema))``, any float type) as a table of the schema."""
        matrix = matrix.astype(self.dtype, copy=False)
        rows = matrix.shape[0]
        template = self._templates.get(rows)
        if template is None and rows not in self._templates:
            template = self._template(rows)
        if template is None:
            return self._slow(matrix)
        metadata, padded = template
        body = np.zeros((len(self.schema), padded), dtype=self.dtype)
        body[:, :rows] = matrix.T
        batch = pa.ipc.read_record_batch(pa.py_buffer(metadata + body.tobytes()), self.schema)
        return pa.Table.from_batches([batch], schema=self.schema)

    def _slow(self, matrix: np.ndarray) -> pa.Table:
        values = pa.array(np.ascontiguousarray(matrix.T, dtype=self.dtype).ravel())
        rows = matrix.shape[0]
        columns = [values.slice(j * rows, rows) for j in range(len(self.schema))]
        return pa.Table.from_arrays(columns, schema=self.schema)

    def _template(self, rows: int) -> tuple[bytes, int] | None:
        """The IPC metadata and padded column length (in values) for ``rows``, or None if the layout differs."""
        with self._lock:
            if len(self._templates) >= _MAX_TEMPLATES:
                self._templates.clear()
            itemsize = self.dtype.itemsize
            padded = -(-rows * itemsize // 8) * 8 // itemsize
            probe = np.arange(rows * len(self.schema), dtype=self.dtype).reshape(rows, len(self.schema))
            expected = self._slow(probe).to_batches()  # one chunk per column: one batch
            template: tuple[bytes, int] | None = None
            if len(expected) == 1 and rows > 0:
                message = expected[0].serialize().to_pybytes()
                body_size = pa.ipc.read_message(message).body.size
                if body_size == len(self.schema) * padded * itemsize:
                    candidate = (message[: len(message) - body_size], padded)
                    body = np.zeros((len(self.schema), padded), dtype=self.dtype)
                    body[:, :rows] = probe.T
                    built = pa.ipc.read_record_batch(pa.py_buffer(candidate[0] + body.tobytes()), self.schema)
                    if built.equals(expected[0]):
                        template = candidate
            self._templates[rows] = template
            return template
