"""Arrow arrays made from numpy and Python values without pyarrow's pandas shim (``shardline.arrays``): the same
arrays ``pa.array`` and ``to_numpy`` give, for every layout a worker or replica hands them."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from shardline.arrays import MatrixScratch, arrow_array, numpy_values, records_table, stack_columns, string_array


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


def _column_by_column(columns: list[np.ndarray], rows: int, dtype: type) -> np.ndarray:
    out = np.empty((rows, len(columns)), dtype=dtype)
    for j, values in enumerate(columns):
        out[:, j] = values
    return out


@pytest.mark.parametrize("rows, width, source, dtype", [
    (6_569, 30, np.float64, np.float32),  # three blocks of 2,184 rows and 17 over: the batch tier's layout
    (65_536, 30, np.float64, np.float32),
    (70_000, 1, np.float64, np.float32),  # one column: blocks of 65,536 rows
    (5_000, 7, np.int64, np.float32),  # integers cast as the assignment casts them
    (3_000, 12, np.float32, np.float64),
    (1, 30, np.float64, np.float32),
    (0, 30, np.float64, np.float32),
])
def test_stacked_columns_are_the_matrix_filled_column_by_column(rows: int, width: int, source: type,
                                                                dtype: type) -> None:
    """Blocked through a transposed buffer, every value lands where the column-by-column fill puts it, cast
    alike: float64 -> float32 rounds as Arrow's cast does, and NaN and infinities stay what they are."""
    generator = np.random.default_rng(7)
    columns = [(generator.normal(size=rows) * 1e3).astype(source) for _ in range(width)]
    if rows > 2 and source == np.float64:
        columns[-1][-1], columns[0][rows // 2] = np.nan, -np.inf
    stacked = stack_columns(columns, rows, dtype)
    assert stacked.shape == (rows, width) and stacked.dtype == dtype and stacked.flags.c_contiguous
    np.testing.assert_array_equal(stacked, _column_by_column(columns, rows, dtype))
    if source == np.float64 and dtype == np.float32 and rows:
        cast = pa.array(columns[3 % width]).cast(pa.float32(), safe=False).to_numpy()
        np.testing.assert_array_equal(stacked[:, 3 % width], cast)


def test_no_columns_stack_into_a_matrix_of_no_columns() -> None:
    assert stack_columns([], 4, np.float32).shape == (4, 0)


def test_a_scratch_stacks_each_batch_into_the_matrix_two_batches_back() -> None:
    """A batch loop's matrices: the next batch never lands where the one before it is (it may still be in use),
    the one after does, and every batch is the matrix filled column by column whatever the scratch held."""
    generator = np.random.default_rng(11)
    scratch = MatrixScratch()
    sizes = [6_569, 6_569, 6_569, 17, 7_000, 0]  # a shard's last, smaller batch; then a larger one; then none
    batches = [[generator.normal(size=rows) for _ in range(30)] for rows in sizes]
    stacked = []
    for columns, rows in zip(batches, sizes):
        matrix = stack_columns(columns, rows, np.float32, scratch)
        assert matrix.shape == (rows, 30) and matrix.dtype == np.float32 and matrix.flags.c_contiguous
        np.testing.assert_array_equal(matrix, _column_by_column(columns, rows, np.float32))
        if stacked:
            assert not np.shares_memory(matrix, stacked[-1])  # the batch before is left alone
            np.testing.assert_array_equal(stacked[-1], _column_by_column(batches[len(stacked) - 1],
                                                                          sizes[len(stacked) - 1], np.float32))
        stacked.append(matrix)
    assert np.shares_memory(stacked[2], stacked[0]) and np.shares_memory(stacked[3], stacked[1])  # kept, not new
    assert not np.shares_memory(stacked[4], stacked[2])  # 7,000 rows: past what it held, a larger one
    assert stack_columns(batches[0][:7], 100, np.float64, scratch).shape == (100, 7)  # another width or dtype


def _ledger_rows() -> list[dict]:
    from shardline.storage.ledger import Holding, _row

    holding = Holding("batch", "cpu", "spot", 2.0)
    started = datetime(2026, 12, 6, 1, 2, 3, 987_654, tzinfo=timezone.utc).timestamp()  # within a second
    return [_row(started, 1.5, "w-1", "usage", holding, "acme", "bc", "3", [1, 2_000, 0, 0, 0.25, 1.5, 10, 20]),
            _row(started, 1.5, "w-1", "capacity", holding, reserved=3.25)]


def test_records_are_pyarrows_table_of_them() -> None:
    from shardline.storage.ledger import SCHEMA

    rows = _ledger_rows()
    made = records_table(rows, SCHEMA)
    made.validate(full=True)
    assert made.equals(pa.Table.from_pylist(rows, schema=SCHEMA))
    assert made.column("bucket_start")[0].as_py() == datetime(2026, 12, 6, 1, 2, 3, tzinfo=timezone.utc)
    # what it does not make itself, pyarrow makes: a None, a time without its zone
    rows[1]["tenant"] = None
    assert records_table(rows, SCHEMA).equals(pa.Table.from_pylist(rows, schema=SCHEMA))
    naive = [dict(rows[0], bucket_start=datetime(2026, 12, 6, 1, 2, 3))]
    assert records_table(naive, SCHEMA).equals(pa.Table.from_pylist(naive, schema=SCHEMA))
    other = [dict(rows[0], rows=2.5)]  # a value of another type: as pyarrow converts it
    assert records_table(other, SCHEMA).equals(pa.Table.from_pylist(other, schema=SCHEMA))


def test_the_batch_runners_ledger_file_is_written_without_importing_pandas(tmp_path: Path) -> None:
    """The warm runner writes each run's ledger file; pandas (~32 MB of its memory) came with that alone."""
    script = ("import sys; from datetime import datetime, timezone; "
              "from shardline.storage.ledger import Holding, LedgerStore; "
              f"store = LedgerStore({str(tmp_path)!r}); "
              "store.record_batch(Holding('batch', 'cpu'), 'acme', 'bc', '1', 'j1', datetime.now(timezone.utc), "
              "{'rows': 2000.0, 'cpu_seconds': 1.5}, 2.0, 1.0); "
              "print('pandas' in sys.modules)")
    found = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert found.split() == ["False"]
    from shardline.storage.ledger import LedgerStore

    table = LedgerStore(str(tmp_path)).read(datetime.now(timezone.utc).strftime("%Y-%m"))
    assert sorted(zip(table["kind"].to_pylist(), table["rows"].to_pylist())) == [("capacity", 0), ("usage", 2000)]
