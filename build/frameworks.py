"""Bundles from XGBoost, LightGBM and PyTorch models: converted to ONNX, then checked against the
framework's own predictions before the bundle is written.

Each builder takes the fitted model and sample rows holding the feature columns, such as the
training data, as users hold them: a pandas DataFrame, a pyarrow Table or a Parquet file's path
(``packaging.sample_table``). The features are the sample's columns ``feature_names`` names, in
the model's order; by default the names the model keeps (``saved_feature_names``: those of the
DataFrame it was fitted on, or of its file), else every sample column; ``feature_names`` that put
the model's own names in another order are refused. Each builder then:

1. converts the model to ONNX with one float32 input ``X`` of shape ``[N, k]``: XGBoost and
   LightGBM through onnxmltools (an XGBoost model's feature names are left out of the copy it
   converts: its converter reads only ``f0``, ``f1``, ...), a PyTorch module through
   ``torch.onnx.export``;
2. packages it as any ONNX bundle is packaged from sample rows (``package_onnx``): the feature
   columns, under the sample's names, are stacked into ``X``, so each tier reads them as plain
   columns, and the signature is checked on the sample;
3. loads the bundle with the runtime both tiers use and scores the sample's first
   ``CHECK_ROWS`` rows, then compares every output with the framework's predictions on them:
   within ``atol + rtol * |expected|`` (float32 conversion: ``ATOL`` 1e-4, ``RTOL`` 1e-3), and a
   classifier's labels equal wherever its two highest probabilities are further apart than that.
   A conversion that does not match is refused (``InvalidInput`` naming the output, the largest
   difference and the rows), and no bundle is left behind.

A LightGBM model is compared on the sample rounded to float32, the rows its bundle takes (LightGBM itself reads
float64); before converting, it is refused where that rounding changes LightGBM's answers on the rows as given,
and a mismatch caused by a split between two float32 values says so (``lightgbm_check``), naming the column.

Outputs, as for scikit-learn (``packaging.package_sklearn``): a classifier's ``label`` (int64)
and ``probabilities`` (one float32 per class), a regressor's ``prediction`` (float32); a PyTorch
module's outputs are named by ``output_names`` (``output`` by default), a ``[N, k]`` one a
``fixed_size_list<float32>[k]`` column. Bundles never hold pickles: the ONNX file is the model.

``load_model_file`` reads a model as the framework saves it (XGBoost's ``save_model`` JSON or UBJ,
LightGBM's text model file) for ``shardline model package --framework``: its objective says
whether it is a classifier or a regressor.

The frameworks are imported inside the builders (``pip install 'shardline[frameworks]'`` for
XGBoost, LightGBM and onnxmltools; torch is the ``embedding-build`` extra's).
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from shardline.build.packaging import GoldenSet, SampleRows, package_onnx, sample_table
from shardline.bundle import Lineage, Manifest, write_manifest
from shardline.errors import InvalidInput, RuntimeUnavailable, first_line
from shardline.signature import named_columns

CHECK_ROWS = 2_048  # sample rows the bundle's answers are compared with the framework's on
ATOL, RTOL = 1e-4, 1e-3  # the float32 conversion's tolerance
ONNX_OPSET = 15  # the highest onnxmltools' tree converters support
TORCH_OPSET = 18
FRAMEWORKS_EXTRA = "pip install 'shardline[frameworks]'"


def package_xgboost(model: Any, out_dir: str | Path, *, name: str, sample: SampleRows,
                    feature_names: Sequence[str] | None = None, lineage: Lineage | None = None,
                    golden: GoldenSet | None = None, reference_profile: dict[str, Any] | None = None,
                    image: str | None = None) -> Manifest:
    """Bundle a fitted ``xgboost.XGBClassifier`` or ``XGBRegressor`` (see the module docstring).

    ``sample``: a pandas DataFrame, a pyarrow Table or a Parquet file's path. ``feature_names``: the
    sample's columns the model reads, in its order (default: the names the model keeps, else every
    sample column).

    Raises:
        InvalidInput: the sample is none of those, lacks a feature, or the conversion does not match
            XGBoost's predictions.
        RuntimeUnavailable: xgboost or onnxmltools is not installed.
    """
    rows = sample_table(sample)
    return _package_trees("xgboost", model, out_dir, name, rows, _features(model, rows, feature_names), lineage,
                          golden, reference_profile, image)


def package_lightgbm(model: Any, out_dir: str | Path, *, name: str, sample: SampleRows,
                     feature_names: Sequence[str] | None = None, lineage: Lineage | None = None,
                     golden: GoldenSet | None = None, reference_profile: dict[str, Any] | None = None,
                     image: str | None = None) -> Manifest:
    """Bundle a fitted ``lightgbm.LGBMClassifier`` or ``LGBMRegressor`` (see the module docstring and
    ``package_xgboost``; LightGBM keeps a name with spaces as ``_``: its column is found all the same).

    Raises:
        InvalidInput: the sample is not rows, lacks a feature, or the conversion does not match LightGBM's
            predictions.
        RuntimeUnavailable: lightgbm or onnxmltools is not installed.
    """
    rows = sample_table(sample)
    return _package_trees("lightgbm", model, out_dir, name, rows, _features(model, rows, feature_names), lineage,
                          golden, reference_profile, image)


def package_torch(module: Any, out_dir: str | Path, *, name: str, sample: SampleRows,
                  feature_names: Sequence[str] | None = None, output_names: Sequence[str] = ("output",),
                  lineage: Lineage | None = None, golden: GoldenSet | None = None,
                  reference_profile: dict[str, Any] | None = None, image: str | None = None) -> Manifest:
    """Bundle a PyTorch module that maps a float32 ``[N, k]`` tensor of the features to one tensor per
    name of ``output_names`` (see the module docstring). It is exported in eval mode.

    ``sample``: a pandas DataFrame, a pyarrow Table or a Parquet file's path. ``feature_names``: the
    sample's columns the module reads, in its order (default: every sample column).

    Raises:
        InvalidInput: the sample is none of those, lacks a feature, the module's weights are not float32, it does
            not run on the features (their count is not its first layer's), it does not export, or the ONNX
            model does not match the module's outputs.
        RuntimeUnavailable: torch is not installed.
    """
    try:
        import torch
    except ImportError as e:
        raise RuntimeUnavailable("packaging a PyTorch module needs torch; pip install 'shardline[embedding-build]' "
                                 "(torch==2.13.0, the CPU build)") from e
    table = sample_table(sample)
    features = _features(None, table, feature_names)
    outputs = list(output_names)
    module = module.eval()
    _check_float32(module)
    rows = _matrix(table, features, CHECK_ROWS)
    try:
        with torch.no_grad():
            got = module(torch.from_numpy(rows))
    except RuntimeError as e:  # torch's shape and dtype errors ("mat1 and mat2 shapes cannot be multiplied ...")
        raise InvalidInput(_does_not_run(module, table, features, e)) from e
    expected_list = [got] if isinstance(got, torch.Tensor) else list(got)
    if len(expected_list) != len(outputs):
        raise InvalidInput(f"the module returns {len(expected_list)} tensors and output_names names {len(outputs)} "
                           f"({outputs}); give one name per tensor it returns")
    expected = {n: t.detach().cpu().numpy() for n, t in zip(outputs, expected_list)}
    axes = {n: {0: "batch"} for n in ["X", *outputs]}
    with tempfile.TemporaryDirectory(prefix="shardline-export-") as scratch:
        exported = Path(scratch) / "model.onnx"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
                torch.onnx.export(module, (torch.from_numpy(rows[:2]),), str(exported), input_names=["X"],
                                  output_names=outputs, dynamic_axes=axes, opset_version=TORCH_OPSET, dynamo=False)
        except Exception as e:  # noqa: BLE001 - the exporter's errors are many; the user gets its message in one line
            raise InvalidInput(f"the module does not export to ONNX ({type(e).__name__}: {first_line(e)}); "
                               "it must take one float32 [N, k] tensor and return tensors") from e
        onnx_bytes = exported.read_bytes()
    tags = {"framework": "pytorch", "module": type(module).__name__, "torch": torch.__version__}
    return _package_checked(onnx_bytes, out_dir, name, table, features, expected, None, tags, lineage, golden,
                            reference_profile, image)


def _check_float32(module: Any) -> None:
    """Refuse a module whose floating-point weights are not float32: the bundle feeds it float32 features."""
    kinds = sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters() if p.is_floating_point()})
    if kinds and kinds != ["float32"]:
        raise InvalidInput(f"the module's weights are {', '.join(kinds)}; a bundle feeds a module float32 features: "
                           "convert it with module.float() (or train it in float32) and package that")


def _does_not_run(module: Any, table: Any, features: list[str], error: Exception) -> str:
    """Why a module fails on the sample's features, in one line: the feature count its first Linear layer takes
    against the columns given, when that is it."""
    import torch

    first = next((m for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
    wants = getattr(first, "in_features", None)
    if wants is not None and wants != len(features):
        others = [c for c in table.column_names if c not in features]
        left = f"; the sample's other columns: {named_columns(others)}" if others and len(features) < wants else ""
        return (f"the module takes {wants} features a row (its first Linear layer), and {len(features)} columns were "
                f"given ({named_columns(features)}){left}: give feature_names with the {wants} columns it reads, in "
                "its order, leaving out the label and id columns")
    return (f"the module does not run on the sample's {len(features)} feature columns ({type(error).__name__}: "
            f"{first_line(error)}); it must take one float32 [N, k] tensor of them, k = {len(features)}")


FRAMEWORKS = ("xgboost", "lightgbm")  # what load_model_file reads


def load_model_file(path: str | Path, framework: str) -> Any:
    """A fitted model from its framework's own file: XGBoost's ``save_model`` (JSON or UBJ) as an
    ``XGBClassifier`` or ``XGBRegressor``, LightGBM's ``save_model`` text file as a ``Booster``.

    Raises:
        InvalidInput: the file is not such a model, or its objective is neither a classifier's nor a regressor's.
        RuntimeUnavailable: the framework is not installed.
    """
    if framework not in FRAMEWORKS:
        raise InvalidInput(f"framework {framework!r} is not one of {list(FRAMEWORKS)}")
    try:
        module = __import__(framework)
    except ImportError as e:
        raise RuntimeUnavailable(f"reading a {framework} model needs {framework}; {FRAMEWORKS_EXTRA}") from e
    try:
        if framework == "lightgbm":
            booster = module.Booster(model_file=str(path))
            dumped = booster.dump_model(num_iteration=1)  # objective and classes, with one iteration's trees only
            objective = str(dumped.get("objective", ""))
        else:
            import json

            booster = module.Booster(model_file=str(path))
            objective = json.loads(booster.save_config())["learner"]["objective"]["name"]
    except Exception as e:  # noqa: BLE001 - each framework raises its own error for a file it cannot read
        raise InvalidInput(f"{path} is not a {framework} model file ({type(e).__name__}: {first_line(e)}); "
                           f"give the file {framework}'s save_model wrote") from e
    kind = _objective_kind(framework, objective)
    if framework == "lightgbm":
        return _LightgbmBooster(booster, kind, int(dumped.get("num_class", 1)))
    model = (module.XGBClassifier if kind == "classifier" else module.XGBRegressor)()
    model.load_model(str(path))
    return model


def saved_feature_names(model: Any) -> list[str] | None:
    """The feature names a fitted model keeps, in its order: ``feature_names_in_`` (a scikit-learn-API model
    fitted on a DataFrame), else its booster's (a model read from its file); None where it keeps none
    (fitted on a matrix: XGBoost keeps none, LightGBM only ``Column_i``)."""
    kept = getattr(model, "feature_names_in_", None)
    if kept is None and isinstance(model, _LightgbmBooster):
        kept = model.booster.feature_name()
    elif kept is None and hasattr(model, "get_booster"):
        kept = model.get_booster().feature_names
    names = [str(n) for n in kept] if kept is not None else []
    return None if not names or all(n == f"Column_{i}" for i, n in enumerate(names)) else names


def model_columns(model: Any, sample: pa.Table) -> list[str] | None:
    """The sample's columns that the names the model keeps (``saved_feature_names``) name, in the model's
    order; None where it keeps none, or the sample lacks one of them."""
    kept = saved_feature_names(model)
    if kept is None:
        return None
    found = _columns_named(kept, sample.column_names)
    return None if any(c is None for c in found) else [str(c) for c in found]


def _columns_named(names: Sequence[str], columns: Sequence[str]) -> list[str | None]:
    """Per name a model keeps, the column of that name, else the one LightGBM renamed to it (it keeps a
    feature name's spaces as ``_``: the DataFrame's ``mean radius`` is its ``mean_radius``); None: neither."""
    exact = set(columns)
    renamed: dict[str, str] = {}
    for column in columns:
        renamed.setdefault(column.replace(" ", "_"), column)
    return [n if n in exact else renamed.get(n) for n in names]


def _objective_kind(framework: str, objective: str) -> str:
    name = objective.split()[0] if objective else ""
    if name.startswith(("binary", "multi")) or name in ("multiclass", "multiclassova", "cross_entropy"):
        return "classifier"
    if name.startswith(("reg:", "count:", "regression", "huber", "fair", "poisson", "quantile", "mape", "gamma",
                        "tweedie")) or name in ("reg", "l1", "l2"):
        return "regressor"
    raise InvalidInput(f"the {framework} model's objective is {objective!r}: only classifiers and regressors are "
                       "packaged (a ranking or survival model's scores have no such outputs); convert it to ONNX "
                       "yourself and package the ONNX file")


class _LightgbmBooster:
    """A LightGBM ``Booster`` read from its file, answering as ``LGBMClassifier`` / ``LGBMRegressor`` do
    (onnxmltools converts the booster itself)."""

    def __init__(self, booster: Any, kind: str, classes: int) -> None:
        self.booster = booster
        self.feature_names_in_ = None
        if kind == "classifier":
            self.classes_ = np.arange(classes if classes > 1 else 2)

    def predict_proba(self, rows: np.ndarray) -> np.ndarray:
        scores = np.asarray(self.booster.predict(rows))
        return np.column_stack([1 - scores, scores]) if scores.ndim == 1 else scores

    def predict(self, rows: np.ndarray) -> np.ndarray:
        if hasattr(self, "classes_"):
            return np.argmax(self.predict_proba(rows), axis=1)
        return np.asarray(self.booster.predict(rows))


def _features(model: Any, sample: pa.Table, feature_names: Sequence[str] | None) -> list[str]:
    """The sample's feature columns in the model's order: ``feature_names``, else the names the model keeps
    (``model`` None: it keeps none), else every sample column.

    Raises:
        InvalidInput: the sample lacks one of them, or ``feature_names`` orders the model's own names otherwise.
    """
    kept = saved_feature_names(model) if model is not None else None
    own = _columns_named(kept, sample.column_names) if kept is not None else None
    if feature_names is not None:
        names = [str(n) for n in feature_names]
        if own is not None and None not in own and names != own:
            raise InvalidInput(f"feature_names {_listed(names)} are not the features the model was fitted on, in its "
                               f"order ({_listed([str(c) for c in own])}); leave feature_names out to read the "
                               "model's own, or give them in that order")
    elif own is not None:
        names = [c if c is not None else n for c, n in zip(own, kept or [])]
    else:
        names = list(sample.column_names)
    missing = [n for n in names if n not in sample.column_names]
    if missing:
        raise InvalidInput(f"the sample has no column {_listed(missing)}; give rows that hold every feature the model "
                           f"reads ({len(names)} of them), or name the sample's columns it reads, in order, with "
                           "feature_names")
    return names


def _listed(names: Sequence[str]) -> str:
    return ", ".join(repr(m) for m in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _matrix(sample: pa.Table, features: Sequence[str], rows: int, dtype: type = np.float32) -> np.ndarray:
    head = sample.slice(0, min(rows, sample.num_rows))
    try:
        return np.column_stack([head.column(f).to_numpy(zero_copy_only=False) for f in features]).astype(dtype)
    except (TypeError, ValueError, pa.ArrowInvalid) as e:
        raise InvalidInput(f"the sample's feature columns are not all numbers ({e}); the model reads float32 "
                           "features, one column each") from e


def _package_trees(framework: str, model: Any, out_dir: str | Path, name: str, sample: pa.Table, features: list[str],
                   lineage: Lineage | None, golden: GoldenSet | None, reference_profile: dict[str, Any] | None,
                   image: str | None) -> Manifest:
    """A tree ensemble converted by onnxmltools, its outputs named as scikit-learn's builder names them, checked."""
    try:
        import onnxmltools
        from onnxmltools.convert.common.data_types import FloatTensorType
    except ImportError as e:
        raise RuntimeUnavailable(f"packaging a {framework} model needs onnxmltools; {FRAMEWORKS_EXTRA}") from e
    if framework == "lightgbm":
        from shardline.build.lightgbm_check import float32_refusal

        refused = float32_refusal(model, sample, features)
        if refused is not None:
            raise InvalidInput(refused)
    initial = [("X", FloatTensorType([None, len(features)]))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if framework == "xgboost":
            onx = onnxmltools.convert_xgboost(_unnamed(model), initial_types=initial, target_opset=ONNX_OPSET)
        else:  # a Booster read from its file converts as itself
            onx = onnxmltools.convert_lightgbm(getattr(model, "booster", model), initial_types=initial,
                                               target_opset=ONNX_OPSET, zipmap=False)
    rows = _matrix(sample, features, CHECK_ROWS)  # float32: the rows the bundle takes, the framework answers on
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "X does not have valid feature names": a model fitted on a DataFrame
        if hasattr(model, "classes_"):
            expected = {"label": np.asarray(model.predict(rows)), "probabilities": np.asarray(model.predict_proba(rows))}
        else:
            expected = {"prediction": np.asarray(model.predict(rows))}
    tie = _tie_rows(expected["probabilities"]) if "probabilities" in expected else None
    if "prediction" in expected:
        _rename_output(onx, onx.graph.output[0].name, "prediction")
    for output in onx.graph.output:  # onnxmltools declares LightGBM's label [1]: every output is [N, ...]
        dims = output.type.tensor_type.shape.dim
        if len(dims) and not dims[0].dim_param:
            dims[0].dim_param = "N"
    onx.graph.name = f"{framework}-{name}"  # onnxmltools names each graph at random: the same model, the same bytes
    booster = getattr(model, "booster", None)  # lightgbm's sklearn API: the Booster; xgboost's: a hyperparameter
    tags = {"framework": framework, "estimator": type(model if booster is None or isinstance(booster, str) else
                                                      booster).__name__}
    try:
        return _package_checked(onx.SerializeToString(), out_dir, name, sample, features, expected, tie, tags,
                                lineage, golden, reference_profile, image)
    except InvalidInput as e:
        if framework == "lightgbm":
            from shardline.build.lightgbm_check import split_refusal

            why = split_refusal(model, rows, features)
            if why is not None:
                raise InvalidInput(why) from e
        raise


def _unnamed(model: Any) -> Any:
    """An XGBoost model whose booster keeps no feature names (a copy, where it keeps some): onnxmltools reads
    each split's feature by the name XGBoost dumps and takes only ``f0``, ``f1``, ... (the i-th feature,
    as without names). The bundle's signature names the columns."""
    if not getattr(model.get_booster(), "feature_names", None):
        return model
    unnamed = copy.deepcopy(model)
    unnamed.get_booster().feature_names = None
    return unnamed


def _rename_output(onx: Any, old: str, new: str) -> None:
    for node in onx.graph.node:
        node.output[:] = [new if o == old else o for o in node.output]
    for output in onx.graph.output:
        if output.name == old:
            output.name = new


def _tie_rows(probabilities: np.ndarray) -> np.ndarray:
    """Rows whose two highest probabilities are within the tolerance: either label is right there."""
    top = np.sort(probabilities, axis=1)
    return np.abs(top[:, -1] - top[:, -2]) <= 2 * (ATOL + RTOL * top[:, -1])


def _package_checked(onnx_bytes: bytes, out_dir: str | Path, name: str, sample: pa.Table, features: list[str],
                     expected: dict[str, np.ndarray], tie: np.ndarray | None, tags: dict[str, str],
                     lineage: Lineage | None, golden: GoldenSet | None, reference_profile: dict[str, Any] | None,
                     image: str | None) -> Manifest:
    with tempfile.TemporaryDirectory(prefix="shardline-convert-") as scratch:
        onnx_file = Path(scratch) / "model.onnx"
        onnx_file.write_bytes(onnx_bytes)
        manifest = package_onnx(onnx_file, out_dir, name=name, sample=sample.select(features), lineage=lineage,
                                golden=golden, reference_profile=reference_profile, image=image)
    folder = Path(out_dir)
    try:
        _check(folder, manifest, sample.select(features).slice(0, min(CHECK_ROWS, sample.num_rows)), expected, tie,
               tags["framework"])
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    done = manifest.model_copy(update={"tags": {**manifest.tags, **tags}})
    write_manifest(folder, done)
    return done


def _check(folder: Path, manifest: Manifest, rows: pa.Table, expected: dict[str, np.ndarray], tie: np.ndarray | None,
           framework: str) -> None:
    """Score ``rows`` with the bundle as both tiers load it; refuse answers that differ from ``expected``."""
    answer = score_bundle(folder, manifest, rows)
    for output, want in expected.items():
        got = _values(answer.column(output))
        want = want.reshape(got.shape) if want.size == got.size else want
        if got.shape != want.shape:
            raise InvalidInput(f"the ONNX model's {output!r} has shape {list(got.shape)} where {framework} gives "
                               f"{list(want.shape)}; the conversion does not fit this model")
        if output == "label":
            wrong = (got != want) & ~(tie if tie is not None else False)
            if wrong.any():
                raise InvalidInput(_mismatch(framework, output, int(wrong.sum()), len(got), "labels differ"))
            continue
        bound = ATOL + RTOL * np.abs(want)
        off = np.abs(got.astype(np.float64) - want.astype(np.float64)) > bound
        if off.any():
            worst = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
            rows_off = int(off.reshape(len(off), -1).any(axis=1).sum())
            raise InvalidInput(_mismatch(framework, output, rows_off, len(got), f"off by up to {worst:.3g}"))


def score_bundle(folder: Path, manifest: Manifest, rows: pa.Table) -> pa.RecordBatch:
    """``rows`` scored by a bundle folder loaded with the runtime both tiers use (on CPU, one thread), then closed."""
    from shardline.runtimes import RuntimeOptions, create_runtime

    runtime = create_runtime(folder, manifest, RuntimeOptions("cpu", 1))
    runtime.load()
    try:
        return runtime.predict(rows)
    finally:
        runtime.close()


def _values(column: Any) -> np.ndarray:
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_fixed_size_list(array.type):
        return np.asarray(array.flatten().to_numpy(zero_copy_only=False)).reshape(len(array), array.type.list_size)
    return np.asarray(array.to_numpy(zero_copy_only=False))


def _mismatch(framework: str, output: str, rows: int, total: int, how: str) -> str:
    return (f"the ONNX conversion does not match {framework}'s own predictions: {output!r} {how} on {rows} of "
            f"{total} sample rows (tolerance {ATOL:g} + {RTOL:g} x |value|); no bundle was written. Check the model "
            "converts (its objective and options), or package its ONNX file yourself with `shardline model package`")

