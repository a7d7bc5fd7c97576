"""Sample rows as users hold them (``packaging.sample_table``): a pandas DataFrame's columns without its index,
a Parquet file, a pyarrow Table as it is; and an ONNX model packaged from a DataFrame."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from shardline.build.frameworks import ATOL, RTOL
from shardline.build.packaging import package_onnx, sample_table
from shardline.errors import InvalidInput
from tests.framework_models import bundle_answers, training_frame, training_rows


def test_a_dataframe_becomes_its_columns_without_its_index_and_a_table_stays_as_it_is(tmp_path: Path) -> None:
    frame = training_frame(10).iloc[::3]  # index 0, 3, 6, 9: not a column of the rows

    rows = sample_table(frame)

    assert rows.column_names == list(frame.columns)
    assert rows.column("mean radius").to_pylist() == frame["mean radius"].tolist()
    table = training_rows()[3]
    assert sample_table(table) is table
    frame.to_parquet(tmp_path / "rows.parquet", index=False)
    assert sample_table(tmp_path / "rows.parquet").equals(rows)


def test_a_dataframe_column_arrow_cannot_hold_is_refused_naming_it() -> None:
    import pandas as pd

    with pytest.raises(InvalidInput) as refused:
        sample_table(pd.DataFrame({"age": [41, "unknown"]}), "the golden rows")

    message = str(refused.value)
    assert message.startswith("the golden rows, a pandas DataFrame, has a column Arrow cannot hold (")
    assert "Conversion failed for column age" in message and "\n" not in message


def test_an_onnx_model_is_packaged_from_the_dataframe_it_was_fitted_on(tmp_path: Path) -> None:
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import FloatTensorType
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    frame = training_frame()
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=500)).fit(frame, training_rows()[1])
    onx = to_onnx(model, initial_types=[("X", FloatTensorType([None, frame.shape[1]]))],
                  options={id(model.steps[-1][1]): {"zipmap": False}}, target_opset=18)
    (tmp_path / "model.onnx").write_bytes(onx.SerializeToString())

    manifest = package_onnx(tmp_path / "model.onnx", tmp_path / "bundle", name="m", sample=frame)

    assert manifest.signature.input_names == list(frame.columns)  # its features stacked into X, one column each
    got = bundle_answers(tmp_path / "bundle", manifest, pa.Table.from_pandas(frame))
    assert (got["label"] == model.predict(frame)).mean() >= 0.999
    assert np.allclose(got["probabilities"], model.predict_proba(frame), atol=ATOL, rtol=RTOL)
