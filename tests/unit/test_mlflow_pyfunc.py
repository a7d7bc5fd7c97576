"""The adapter a pyfunc logged from code runs behind (``shardline.build.mlflow_pyfunc``): how it takes a pyfunc's
answer, which MLmodel sections it accepts as logged from code, and when the flavor maps at all. The adapter
loading real MLflow models is tested in tests/integration/test_mlflow_pyfunc.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from shardline.errors import InvalidInput
from shardline.build.mlflow_flavors import choose_flavor
from shardline.build.mlflow_pyfunc import CODE_LOADER, from_code_refusal, pyfunc_answer
from shardline.runtimes.custom import answer_columns

FROM_CODE = {"loader_module": CODE_LOADER, "model_code_path": "/home/me/model.py", "cloudpickle_version": "3.1"}
PICKLED = {"loader_module": "mlflow.pyfunc.model", "python_model": "python_model.pkl"}


def _columns(answer: Any) -> dict[str, pa.Array]:
    return answer_columns(pyfunc_answer(answer), "pyfunc")


def test_a_data_frame_is_taken_as_it_is_and_other_answers_become_the_prediction_column() -> None:
    frame = pd.DataFrame({"score": [0.5, -1.0], "malignant": [True, False]})

    assert _columns(frame)["malignant"].to_pylist() == [True, False]
    assert _columns(pd.Series([3, 4], name="ignored")) == {"prediction": pa.array([3, 4])}
    assert _columns(np.array([0.25, 0.75]))["prediction"].to_pylist() == [0.25, 0.75]
    assert _columns(["benign", "malignant"])["prediction"].to_pylist() == ["benign", "malignant"]
    pairs = _columns(np.array([[0.5, 0.5], [0.25, 0.75]], dtype=np.float32))["prediction"]
    assert pairs.type == pa.list_(pa.float32(), 2) and pairs.to_pylist() == [[0.5, 0.5], [0.25, 0.75]]
    with pytest.raises(TypeError, match="the pyfunc answered a float; answer a DataFrame, a Series, a list"):
        pyfunc_answer(0.5)
    with pytest.raises(TypeError, match=r"answered a ndarray of shape \(1, 2, 2\)"):
        pyfunc_answer(np.zeros((1, 2, 2)))


def test_only_a_pyfunc_logged_from_code_is_accepted_and_chosen() -> None:
    assert from_code_refusal(FROM_CODE) is None
    assert from_code_refusal(PICKLED) == "python_model python_model.pkl: a class MLflow saved as a pickle"
    assert from_code_refusal({**FROM_CODE, "loader_module": "mlflow.sklearn"}) == (
        f"loader_module mlflow.sklearn, not {CODE_LOADER}")
    assert from_code_refusal({"loader_module": "mlflow.pytorch"}) == "no model_code_path: not logged from code"

    assert choose_flavor("models:/a/1", {"python_function": FROM_CODE}) == "python_function"
    sklearn = {"python_function": {"loader_module": "mlflow.sklearn"}, "sklearn": {"pickled_model": "model.skops"}}
    assert choose_flavor("models:/a/1", sklearn) == "sklearn"  # its framework, not the pyfunc beside it
    with pytest.raises(InvalidInput, match=r"has flavor python_function only, a pyfunc whose class MLflow saved as a "
                                           r"pickle .*log it from code instead: mlflow.pyfunc.log_model\("
                                           r"python_model='model.py'"):
        choose_flavor("models:/a/1", {"python_function": PICKLED})
    with pytest.raises(InvalidInput, match="wrap it in a pyfunc logged from code"):
        choose_flavor("models:/a/1", {"python_function": {"loader_module": "mlflow.pytorch"}, "pytorch": {}})
