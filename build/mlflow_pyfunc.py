"""The adapter an MLflow pyfunc logged from code runs behind: a custom-code class (the contract in
``shardline.runtimes.custom``) that loads the MLflow model folder its bundle carries with MLflow's own
``mlflow.pyfunc.load_model`` and answers in Shardline's columns.

``shardline model import`` (``shardline.build.mlflow_flavors``) copies this file as it is into the bundle's
``code/`` folder (entry ``mlflow_pyfunc:Model``) and the MLflow model's folder (its ``MLmodel``, the code
file, the ``artifacts`` it was logged with) under ``MODEL_FOLDER``. A copy, not a reference to the installed
module: the bundle holds what decides its answers (the outputs digest covers this file), and the runtime
imports code only from ``code/``.

Loading a pyfunc logged from code (``mlflow.pyfunc.log_model(python_model="model.py", ...)``) executes its
code file (MLflow's ``mlflow.pyfunc.loaders.code_model``, ``_load_model_code_path``) and unpickles nothing:
the artifacts are handed to ``load_context`` as paths. ``load`` refuses a folder whose MLmodel names another
loader or a pickled ``python_model`` before MLflow loads it.

``predict`` hands the rows to the pyfunc as a pandas DataFrame and answers as ``pyfunc_answer`` says.
"""

from __future__ import annotations

import threading
from typing import Any

MODEL_FOLDER = "mlflow_model"  # the MLflow model's folder inside the bundle
CODE_LOADER = "mlflow.pyfunc.loaders.code_model"  # the loader_module MLflow writes for a pyfunc logged from code
PREDICTION = "prediction"  # the output column of an answer that is not a DataFrame
_MLFLOW_EXTRA = "pip install 'shardline[mlflow]'"


def from_code_refusal(section: Any) -> str | None:
    """Why a python_function section of an MLmodel file is not a pyfunc logged from code (None: it is one)."""
    if not isinstance(section, dict):
        return "no python_function flavor"
    if section.get("python_model"):
        return f"python_model {section['python_model']}: a class MLflow saved as a pickle"
    if not section.get("model_code_path"):
        return "no model_code_path: not logged from code"
    if section.get("loader_module") != CODE_LOADER:
        return f"loader_module {section.get('loader_module')}, not {CODE_LOADER}"
    return None


def pyfunc_answer(answer: Any) -> Any:
    """A pyfunc's answer as the custom-code runtime takes it: a DataFrame (or a dict of columns) as it is; a
    Series, a list or a 1-D array as the column ``prediction``; a 2-D array as ``prediction`` of fixed-size lists.

    Raises:
        TypeError: another answer (a scalar, a string, an array of 3 or more dimensions).
    """
    import numpy as np
    import pandas as pd

    if isinstance(answer, (pd.DataFrame, dict)):
        return answer
    if isinstance(answer, (pd.Series, np.ndarray, list, tuple)):
        array = answer.to_numpy() if isinstance(answer, pd.Series) else np.asarray(answer)
        if array.ndim in (1, 2):
            return {PREDICTION: array}
    shape = f" of shape {np.shape(answer)}" if isinstance(answer, np.ndarray) else ""
    raise TypeError(f"the pyfunc answered a {type(answer).__name__}{shape}; answer a DataFrame, a Series, a list, "
                    "or a 1-D or 2-D array, one row per input row")


class Model:
    """A pyfunc logged from code, loaded by MLflow from the bundle's ``MODEL_FOLDER``."""

    def load(self, context: Any) -> None:
        """Load the MLflow model folder with ``mlflow.pyfunc.load_model`` (which executes its code file).

        Raises:
            NotInstalled: MLflow's client is not installed.
            ValueError: the folder's MLmodel is not a pyfunc logged from code.
        """
        from shardline.errors import NotInstalled

        folder = context.path(f"{MODEL_FOLDER}/MLmodel").parent
        try:
            import mlflow.models.model
            import mlflow.pyfunc
        except ImportError as e:
            raise NotInstalled(f"a pyfunc imported from MLflow runs with MLflow's client; {_MLFLOW_EXTRA}") from e
        refused = from_code_refusal(mlflow.models.Model.load(str(folder / "MLmodel")).flavors.get("python_function"))
        if refused is not None:
            raise ValueError(f"{folder.name}/MLmodel is not a pyfunc logged from code ({refused}); log it with "
                             "mlflow.pyfunc.log_model(python_model='model.py', ...) and import it again")
        # MLflow hands the model a code file sets (mlflow.models.set_model) back through one module global: one
        # load at a time per process, whichever bundle's copy of this file runs it.
        lock = vars(mlflow.models.model).setdefault("_shardline_load_lock", threading.Lock())
        with lock:
            self.pyfunc = mlflow.pyfunc.load_model(str(folder), suppress_warnings=True)

    def predict(self, rows: Any) -> Any:
        """Score a pyarrow Table of the signature's inputs with the pyfunc's ``predict``."""
        return pyfunc_answer(self.pyfunc.predict(rows.to_pandas()))
