"""Arrow arrays from numpy arrays and Python values, and numpy views of Arrow arrays, as pyarrow makes them
but without pandas.

pyarrow asks whether a value is a pandas object before it converts numpy arrays or Python values
(``pa.array``, ``pa.scalar``, ``Array.to_numpy``), and the first question imports pandas when it is
installed: ~0.2 s and 27-32 MB of memory (PSS) in every process that asks. A batch worker, the warm
batch runner and a replica only move numbers (and a few strings) between numpy and Arrow, so their paths
make their arrays from buffers here and never pay for pandas. Anything else falls back to pyarrow's own
conversion.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

_NUMERIC_KINDS = frozenset("iuf")  # numpy kinds whose Arrow arrays share their layout (not bool: Arrow packs bits)


def arrow_array(values: np.ndarray) -> pa.Array:
    """``pa.array(values)`` for a 1-D numpy array: a numeric one (ints, floats) wraps its contiguous buffer,
    zero-copy as pyarrow's conversion is."""
    if values.dtype.kind not in _NUMERIC_KINDS or not values.dtype.isnative or values.ndim != 1:
        return pa.array(values)
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


_VIEWS = {pa.string_view(): pa.string(), pa.binary_view(): pa.binary()}


def decoded_type(dtype: pa.DataType) -> pa.DataType:
    """The type of a column's values with its encoding undone: a dictionary's is its values' (a pandas
    ``category``), ``string_view`` is ``string``, ``binary_view`` is ``binary``; any other type is its own.
    (Arrow's compute kernels, ``take`` among them, and pandas take the plain layout everywhere; the others only
    in some places.)"""
    while pa.types.is_dictionary(dtype):
        dtype = dtype.value_type
    return _VIEWS.get(dtype, dtype)


def decoded(column: pa.Array) -> pa.Array:
    """``column``'s values in the plain layout of ``decoded_type`` (the column itself when it has no encoding)."""
    if isinstance(column, pa.DictionaryArray):
        return decoded(column.dictionary).take(column.indices)  # (a null index takes a null)
    target = decoded_type(column.type)
    return column if target == column.type else column.cast(target)


def string_array(values: Sequence[str]) -> pa.Array:
    """``pa.array(values, pa.string())``: the strings' UTF-8 bytes and their offsets as the array's buffers."""
    encoded = [value.encode() for value in values]
    ends = np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)))
    if len(ends) and ends[-1] > np.iinfo(np.int32).max:  # past what 32-bit offsets address
        return pa.array(list(values), type=pa.string())
    offsets = np.zeros(len(encoded) + 1, dtype=np.int32)
    offsets[1:] = ends
    data = pa.py_buffer(b"".join(encoded))
    return pa.Array.from_buffers(pa.string(), len(encoded), [None, pa.py_buffer(offsets), data])


def numpy_values(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """``array.to_numpy(zero_copy_only=False)``: for ints and floats without nulls, a read-only view of the
    values buffer (of the one chunk; several are combined first)."""
    if isinstance(array, pa.ChunkedArray):
        array = array.chunk(0) if array.num_chunks == 1 else array.combine_chunks()
    if array.null_count or not (pa.types.is_floating(array.type) or pa.types.is_integer(array.type)):
        return array.to_numpy(zero_copy_only=False)
    dtype = np.dtype(array.type.to_pandas_dtype())
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)


# Rows a block when ``stack_columns`` fills a matrix: the block's rows of the matrix and its transposed buffer
# (columns x rows) stay within a core's L2 cache. Filling the whole matrix column by column instead writes one
# value of every row a column: past the cache, each of those writes brings the row's line in again, and stacking
# 65,536 rows of 30 float64 columns into float32 cost 0.12 us a row against 0.03 so (figures: bench/README.md,
# "Figures behind the code").
_STACK_BLOCK_BYTES = 256 * 1024


def stack_columns(columns: Sequence[np.ndarray], rows: int, dtype: Any, scratch: MatrixScratch | None = None
                  ) -> np.ndarray:
    """The 1-D ``columns`` (each ``rows`` long) as one C-ordered ``(rows, len(columns))`` matrix of ``dtype``, each
    value cast as numpy's assignment casts it (float64 -> float32 rounds as Arrow's cast does). With ``scratch``,
    filled into the matrix it hands out (see there for how long that matrix stays the caller's)."""
    if scratch is not None:
        out = scratch.take(rows, len(columns), dtype)
    else:
        out = np.empty((rows, len(columns)), dtype=dtype)
    if not columns or not rows:
        return out
    step = max(64, _STACK_BLOCK_BYTES // (len(columns) * out.itemsize))
    buffer = np.empty((len(columns), min(step, rows)), dtype=dtype)
    for start in range(0, rows, step):
        end = min(rows, start + step)
        block = buffer[:, : end - start]
        for j, values in enumerate(columns):
            block[j] = values[start:end]
        out[start:end] = block.T
    return out


class MatrixScratch:
    """Two matrices that ``stack_columns`` fills in turn, for a loop that stacks one batch of rows after another
    (a batch worker's): each batch's matrix is one the loop has filled before, not a fresh array of ~8 MiB a batch.
    A fresh one is a new mapping (past glibc's mmap threshold, which Dask's ``MALLOC_TRIM_THRESHOLD_`` pins at 128
    KiB): its pages faulted in and zeroed on every batch, ~4% of the logistic regression's CPU a row (figures:
    bench/README.md, "Figures behind the code").

    A matrix taken is the caller's until the second ``take`` after it: the next one lands in the other matrix, so
    the batch before may still be in use meanwhile (its answers being written by another thread). Not for rows
    whose lifetimes are not so ordered (an online server's requests): those take fresh arrays. One per thread,
    dropped when its loop ends (it keeps two of the largest batch it was asked for).
    """

    def __init__(self) -> None:
        self._matrices: list[np.ndarray | None] = [None, None]
        self._turn = 0

    def take(self, rows: int, width: int, dtype: Any) -> np.ndarray:
        """A C-ordered ``(rows, width)`` matrix of ``dtype`` (its values left as they were)."""
        self._turn ^= 1
        held = self._matrices[self._turn]
        if held is None or held.shape[0] < rows or held.shape[1] != width or held.dtype != np.dtype(dtype):
            held = self._matrices[self._turn] = np.empty((rows, width), dtype=dtype)
        return held[:rows]  # (the first rows of a C-ordered matrix: one contiguous block)


def records_table(rows: Sequence[Mapping[str, Any]], schema: pa.Schema) -> pa.Table:
    """``pa.Table.from_pylist(rows, schema=schema)`` where every row holds every column as a value of its type (a
    ``str``, an ``int``, a ``float``, a zoned ``datetime`` for seconds): a ledger's rows; pyarrow's own otherwise
    (a None, another type: pyarrow converts it or says what is wrong)."""
    columns = []
    for field in schema:
        values: list[Any] = [row.get(field.name) for row in rows]
        if None in values:
            return pa.Table.from_pylist(list(rows), schema=schema)
        kinds = set(map(type, values))
        if pa.types.is_string(field.type) and kinds <= {str}:
            columns.append(string_array(values))
        elif (pa.types.is_integer(field.type) and kinds <= {int}) or (pa.types.is_floating(field.type)
                                                                       and kinds <= {int, float}):
            columns.append(arrow_array(np.array(values, dtype=field.type.to_pandas_dtype())))
        elif (pa.types.is_timestamp(field.type) and field.type.unit == "s" and field.type.tz is not None
              and all(value.tzinfo is not None for value in values)):  # naive times: as pyarrow reads them
            seconds = np.array([int(value.timestamp()) for value in values], dtype=np.int64)
            columns.append(arrow_array(seconds).cast(field.type))
        else:
            return pa.Table.from_pylist(list(rows), schema=schema)
    return pa.Table.from_arrays(columns, schema=schema)
