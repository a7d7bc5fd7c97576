"""The ONNX runtime's fast paths give exactly what ``predict`` gives through Arrow.

``predict`` of float ``Rows`` (the online tier's path: float arrays in, numpy columns out, no Arrow)
and the per-schema column plan of ``predict`` (the batch tier reads shards with extra
columns, in any order), on the real breast-cancer model.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pyarrow as pa
import pytest

from shardline.errors import InvalidInput
from shardline.rows import float_rows
from shardline.runtimes import Runtime, RuntimeOptions, create_runtime

from tests.conftest import BuiltModel


@pytest.fixture(scope="module")
def runtime(breast_cancer_model: BuiltModel) -> Iterator[Runtime]:
    loaded = create_runtime(breast_cancer_model.bundle_dir, breast_cancer_model.manifest, RuntimeOptions("cpu", 1))
    loaded.load()
    yield loaded
    loaded.close()


def signature_rows(model: BuiltModel, count: int) -> tuple[np.ndarray, pa.Table]:
    """``count`` rows (the data set repeated as needed) as a float32 matrix in the signature's order, and as a table."""
    names = model.manifest.signature.input_names
    index = [model.data.names.index(n) for n in names]
    features = np.resize(model.data.features, (count, model.data.features.shape[1]))[:, index]
    matrix = np.ascontiguousarray(features, dtype=np.float32)
    return matrix, pa.table({n: matrix[:, j] for j, n in enumerate(names)})


@pytest.mark.parametrize("count", [1, 3, 200, 1500])  # 1500: past the one-call tensor path's 1024 rows
def test_a_matrix_scores_exactly_like_its_rows_through_arrow(
    runtime: Runtime, breast_cancer_model: BuiltModel, count: int
) -> None:
    matrix, table = signature_rows(breast_cancer_model, count)
    through_arrow = runtime.predict(table)
    fast = runtime.predict(float_rows(runtime.manifest.signature.plan, (matrix,), "breast-cancer:1"))

    assert isinstance(fast, dict) and list(fast) == ["label", "probabilities"]
    assert fast["label"].dtype == np.int64 and fast["label"].shape == (count,)
    assert fast["probabilities"].dtype == np.float32 and fast["probabilities"].shape == (count, 2)
    np.testing.assert_array_equal(fast["label"], through_arrow.column("label").to_numpy())
    np.testing.assert_array_equal(  # bit for bit
        fast["probabilities"], through_arrow.column("probabilities").flatten().to_numpy().reshape(count, 2))
    expected_labels, _ = breast_cancer_model.expected(table)
    np.testing.assert_array_equal(fast["label"], expected_labels)


def test_batches_of_other_layouts_score_the_same_whichever_schema_came_before(
    runtime: Runtime, breast_cancer_model: BuiltModel
) -> None:
    _, table = signature_rows(breast_cancer_model, 40)
    expected = runtime.predict(table)
    shuffled = table.select(list(reversed(table.column_names)))  # another order of the same columns
    shard = shuffled.add_column(0, "id", pa.array(np.arange(40)))  # as a batch shard holds them
    as_batches = pa.Table.from_batches(shard.to_batches(max_chunksize=7))  # several chunks
    for rows in (shard, table, as_batches, shuffled, shard.to_batches()[0], table):  # each layout's plan is reused
        assert runtime.predict(rows).equals(expected)
    with pytest.raises(InvalidInput, match="could not be turned into tensors"):
        runtime.predict(table.drop_columns(["mean radius"]))


def test_a_model_that_reads_the_signature_columns_in_another_order_still_takes_the_matrix(
    breast_cancer_model: BuiltModel,
) -> None:
    manifest = breast_cancer_model.manifest
    binding = dict(manifest.runtime_config["tensor_inputs"][0])
    binding["columns"] = list(reversed(binding["columns"]))
    reordered = manifest.model_copy(update={"runtime_config": {**manifest.runtime_config, "tensor_inputs": [binding]}})
    model = create_runtime(breast_cancer_model.bundle_dir, reordered, RuntimeOptions("cpu", 1))
    model.load()
    try:
        matrix, table = signature_rows(breast_cancer_model, 2)
        fast = model.predict(float_rows(reordered.signature.plan, (matrix,), "breast-cancer:1"))
        assert isinstance(fast, dict)  # the binding's columns are picked from the matrix, still without Arrow
        through_arrow = model.predict(table)
        np.testing.assert_array_equal(fast["label"], through_arrow.column("label").to_numpy())
        assert through_arrow.num_rows == 2
    finally:
        model.close()
