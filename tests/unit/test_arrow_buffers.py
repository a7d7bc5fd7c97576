"""Arrow arrays made from numpy and Python values without pyarrow's pandas shim (``shardline.arrays``): the same
arrays ``pa.array`` and ``to_numpy`` give, for every layout a worker or replica hands them."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from shardline.arrays import arrow_array, numpy_values, string_array


@pytest.mark.parametrize("values", [
    np.array([1.5, np.nan, -np.inf, 0.0], dtype=np.float32),
    np.arange(10, dtype=np.float64)[::3],  # not contiguous
    np.arange(6, dtype=np.int64).reshape(2, 3)[:, 1],  # a column of a matrix
    np.array([1, 2, 255], dtype=np.uint8),
    np.array([], dtype=np.float32),
    np.array([True, False, True]),  # Arrow packs bits: pyarrow's own conversion
    np.array(["a", "b"], dtype=object),
])
def test_numpy_to_arrow_is_pyarrows_conversion(values: np.ndarray) -> None:
    made, expected = arrow_array(values), pa.array(values)
    made.validate(full=True)
    assert made.type == expected.type and len(made) == len(expected)
    np.testing.assert_array_equal(made.to_numpy(zero_copy_only=False), expected.to_numpy(zero_copy_only=False))
    assert made.null_count == 0  # NaN stays a value, as pa.array keeps it


def test_numpy_to_arrow_shares_a_contiguous_numeric_buffer() -> None:
    values = np.arange(4, dtype=np.float64)
    made = arrow_array(values)
    assert made.buffers()[1].address == values.ctypes.data  # no copy, as pa.array makes none


@pytest.mark.parametrize("array", [
    pa.array(np.arange(10, dtype=np.float64)).slice(3, 4),  # an offset into its buffer
    pa.array(np.array([0.25, 1e30], dtype=np.float32)),
    pa.array(np.arange(5, dtype=np.int32)),
    pa.array([1.0, None, 3.0]),  # nulls: pyarrow's own conversion
    pa.array([True, False]),
])
def test_arrow_to_numpy_is_pyarrows_conversion(array: pa.Array) -> None:
    got, expected = numpy_values(array), array.to_numpy(zero_copy_only=False)
    assert got.dtype == expected.dtype and np.array_equal(got, expected, equal_nan=True)


@pytest.mark.parametrize("values", [["acme", "", "globex"], ["ünïcode", "日本"], [], ["one"] * 1_000])
def test_strings_to_arrow_are_pyarrows_conversion(values: list[str]) -> None:
    made = string_array(values)
    made.validate(full=True)
    assert made.type == pa.string() and made.to_pylist() == values
    assert made.equals(pa.array(values, type=pa.string()))
