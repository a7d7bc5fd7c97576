"""How each MLflow flavor becomes a bundle: ``FLAVORS``, a table from flavor name to builder, in the order
flavors are preferred when a model has several (``shardline.build.mlflow_import`` resolves, downloads and reads the
model, then hands it to one of these as an ``ImportRequest``).

- ``onnx``: the ``.onnx`` file (``data``), packaged as any ONNX file is (``package_onnx``);
- ``xgboost``: the JSON or UBJ file XGBoost's ``save_model`` wrote, converted and checked
  (``frameworks.package_xgboost``);
- ``lightgbm``: a ``Booster``'s text model file, or a scikit-learn-API model (``LGBMClassifier``) saved
  by skops, converted and checked (``package_lightgbm``);
- ``sklearn``: an estimator saved by skops (MLflow's default), rebuilt by skops trusting scikit-learn's
  own classes and ``numpy.dtype`` only (``_SKOPS_DATA_TYPES``: types whose rebuilding calls nothing),
  converted by skl2onnx and checked on the sample rows against scikit-learn's answers on them as given
  (``package_sklearn`` with a sample: float64 inputs where float32 ones lose the answer; a classifier without
  ``predict_proba``, such as ``LinearSVC``, answers ``label`` and ``scores``, its decision function);
- ``python_function`` logged from code (``mlflow.pyfunc.log_model(python_model="model.py", artifacts=...)``:
  its MLmodel section names the code file in ``model_code_path``): a custom-code bundle (runtime ``python``,
  ``package_python``) whose class is Shardline's adapter (``shardline.build.mlflow_pyfunc``), carrying the MLflow
  model's folder whole and loading it with ``mlflow.pyfunc.load_model``; its outputs are learnt by running it
  on the sample rows. Importing runs the model's code here, and only tenants with ``custom_code: true`` may
  call the bundle. It comes after the framework flavors: the pyfunc MLflow writes beside an sklearn or
  xgboost model is not from code, and that model maps to its framework.

Nothing is unpickled: a model saved as a pickle or cloudpickle (``serialization_format``), a pyfunc whose
class MLflow cloudpickled (``python_model``, e.g. ``python_model.pkl``), a pyfunc from code whose folder holds
a pickle, and any other flavor is refused (``InvalidInput`` naming the flavor and what to log instead)
before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Sequence

import pyarrow as pa

from shardline.build.sklearn_trees import TREE_TYPES, check_trees
from shardline.bundle import Lineage, Manifest
from shardline.errors import InvalidInput, RuntimeUnavailable, ShardlineError, first_line

MLFLOW_EXTRA = "pip install 'shardline[mlflow]'"
_LOG_INSTEAD = ("log it with mlflow.onnx (convert it with skl2onnx or onnxmltools first), or with "
                "mlflow.sklearn.log_model(..., serialization_format='skops')")
# For a skops file holding types beyond scikit-learn's classes: logging it again with skops changes nothing.
_UNTRUSTED_INSTEAD = ("Shardline does not widen that list (skops_trusted_types at logging time does not either): "
                      "convert the model to ONNX yourself (skl2onnx's to_onnx) and log it with mlflow.onnx")
_PYFUNC = "python_function"
_PYFUNC_FROM_CODE = ("log it from code instead: mlflow.pyfunc.log_model(python_model='model.py', artifacts={...}), "
                     "the file defining the class and calling mlflow.models.set_model(...)")
# Types beyond scikit-learn's classes that skops may rebuild in any skops file, because rebuilding them calls
# nothing the file names (skops 0.16 reports them untrusted all the same; its own defaults, numpy's arrays,
# scalar types and ufuncs, are trusted by get_untrusted_types already):
# - numpy.dtype (SimpleImputer's ``_fit_dtype``, KBinsDiscretizer's): skops rebuilds it as the dtype of an empty array
#   that numpy.load reads with allow_pickle=False (so never an object dtype), ignoring the module and class the
#   file names; that array is itself a node skops audits.
_SKOPS_DATA_TYPES = frozenset({"numpy.dtype"})
# Types skops may rebuild for a LightGBM scikit-learn-API model: LightGBM's own (its Booster reads the
# model's text), as mlflow.lightgbm lists them.
_LIGHTGBM_SKOPS_TYPES = frozenset({"lightgbm.sklearn.LGBMClassifier", "lightgbm.sklearn.LGBMRegressor",
                                   "lightgbm.basic.Booster", "collections.OrderedDict"})


@dataclass
class ImportRequest:
    """What one import builds from: the MLflow model downloaded, its MLmodel file read, the rows it is
    checked on. Handed to a flavor's builder (``FLAVORS``)."""

    source: str  # the model URI as given
    model_dir: Path
    mlmodel: Any  # mlflow.models.Model
    flavor: str
    out_dir: Path
    name: str
    sample: pa.Table | None  # the user's rows, else the logged input example; None: neither
    sample_is_example: bool
    exclude: Sequence[str]
    lineage: Lineage

    @property
    def conf(self) -> dict[str, Any]:
        """The flavor's section of the MLmodel file."""
        return dict(self.mlmodel.flavors[self.flavor])

    def file(self, key: str) -> Path:
        """A file the flavor's section names (``data``, ``pickled_model``), inside the downloaded model."""
        relative = str(self.conf.get(key) or "")
        path = (self.model_dir / relative).resolve()
        if not relative or not path.is_file() or self.model_dir.resolve() not in path.parents:
            raise InvalidInput(f"MLflow model {self.source} (flavor {self.flavor}) names no model file in its "
                               f"MLmodel field {key!r} (got {relative!r}); log the model again with MLflow's client")
        return path

    def signature_names(self) -> list[str] | None:
        """The input column names of the MLmodel signature (None: no signature, or a tensor one)."""
        schema = getattr(self.mlmodel.signature, "inputs", None)
        if schema is None or schema.is_tensor_spec() or not schema.has_input_names():
            return None
        return [str(n) for n in schema.input_names()]

    def needs_sample(self, what: str) -> pa.Table:
        """The sample rows, or the refusal that says how to give them."""
        if self.sample is None:
            raise InvalidInput(
                f"MLflow model {self.source} (flavor {self.flavor}) has no input example, and {what} needs sample "
                "rows (the features the model reads, one column each, named as in its signature): give them with "
                "--signature-from ROWS.parquet (e.g. its training data; --exclude the label), or log the model "
                "with input_example=")
        return self.sample

    def refuse(self, why: str, do: str) -> InvalidInput:
        """The error for a model this flavor cannot map."""
        return InvalidInput(f"MLflow model {self.source} (flavor {self.flavor}{', ' + why if why else ''}) "
                            f"cannot be imported: {do}")


def _features(request: ImportRequest, model: Any, sample: pa.Table) -> list[str]:
    """The feature columns in the model's order: the sample's columns the model's own names name (its file's,
    or scikit-learn's ``feature_names_in_``: ``frameworks.model_columns``), else the MLmodel signature's, else
    the sample's columns less ``exclude``."""
    from shardline.build.frameworks import model_columns

    kept = model_columns(model, sample)
    if kept is not None:
        return kept
    named = request.signature_names()
    if named is not None:
        _refuse_missing(request, sample, [n for n in named if n not in sample.column_names], len(named),
                        "its signature names")
        return named
    return [c for c in sample.column_names if c not in set(request.exclude)]


def _refuse_missing(request: ImportRequest, sample: pa.Table, missing: list[str], total: int, whose: str) -> None:
    """Refuse sample rows that lack features, in the CLI's words (``--signature-from``)."""
    if missing:
        rows = "its input example" if request.sample_is_example else "the rows given with --signature-from"
        raise request.refuse("", f"{rows} have no column {', '.join(repr(m) for m in missing[:5])}"
                             f"{' ...' if len(missing) > 5 else ''} of the {total} features {whose}; give "
                             "--signature-from rows (e.g. the training data) holding every one, named as there")


def _from_onnx(request: ImportRequest) -> Manifest:
    from shardline.build.packaging import package_onnx

    return package_onnx(request.file("data"), request.out_dir, name=request.name, sample=request.sample,
                        exclude=request.exclude, lineage=request.lineage)


def _from_xgboost(request: ImportRequest) -> Manifest:
    from shardline.build.frameworks import load_model_file, package_xgboost

    path = request.file("data")
    model_format = str(request.conf.get("model_format") or path.suffix.lstrip("."))
    if model_format not in ("json", "ubj"):
        raise request.refuse(f"model_format {model_format}", "Shardline reads XGBoost's JSON and UBJ model files; "
                             "log it again with mlflow.xgboost.log_model(..., model_format='ubj')")
    sample = request.needs_sample("converting an XGBoost model (checked against XGBoost's predictions)")
    model = load_model_file(path, "xgboost")
    features = _features(request, model, sample)
    return _converted(request, lambda: package_xgboost(model, request.out_dir, name=request.name, sample=sample,
                                                       feature_names=features, lineage=request.lineage))


def _from_lightgbm(request: ImportRequest) -> Manifest:
    from shardline.build.frameworks import load_model_file, package_lightgbm

    model_class = str(request.conf.get("model_class") or "lightgbm.basic.Booster")
    if model_class == "lightgbm.basic.Booster":
        model = load_model_file(request.file("data"), "lightgbm")
    else:
        model = _skops_model(request, "data", _LIGHTGBM_SKOPS_TYPES, "a LightGBM scikit-learn-API model "
                             f"({model_class.rsplit('.', 1)[-1]})", "log its booster instead: "
                             "mlflow.lightgbm.log_model(model.booster_, ...)")
    sample = request.needs_sample("converting a LightGBM model (checked against LightGBM's predictions)")
    features = _features(request, model, sample)
    return _converted(request, lambda: package_lightgbm(model, request.out_dir, name=request.name, sample=sample,
                                                        feature_names=features, lineage=request.lineage))


def _converted(request: ImportRequest, build: Callable[[], Manifest]) -> Manifest:
    """Run a converting builder; a converter's own error (onnxmltools raises plain ones) becomes ``InvalidInput``."""
    try:
        return build()
    except ShardlineError:
        raise
    except Exception as e:  # noqa: BLE001 - the converters raise RuntimeError, ValueError, KeyError, ...
        raise request.refuse("", f"its model does not convert to ONNX ({type(e).__name__}: {first_line(e)}); export "
                             "it to ONNX yourself and log it with mlflow.onnx") from e


def _from_sklearn(request: ImportRequest) -> Manifest:
    from shardline.build.packaging import package_sklearn

    estimator = _skops_model(request, "pickled_model", frozenset(), "a scikit-learn model", _LOG_INSTEAD)
    sample = request.needs_sample("converting a scikit-learn model (checked against scikit-learn's predictions)")
    features = _features(request, estimator, sample)
    return _converted(request, lambda: package_sklearn(estimator, request.out_dir, name=request.name,
                                                       feature_names=features, lineage=request.lineage,
                                                       sample=sample))


def _from_pyfunc(request: ImportRequest) -> Manifest:
    """A pyfunc logged from code: Shardline's adapter as the bundle's code, the MLflow model's folder whole."""
    import tempfile

    from shardline.build import mlflow_pyfunc
    from shardline.build.code_bundles import package_python
    from shardline.build.packaging import is_pickle

    refused = mlflow_pyfunc.from_code_refusal(request.conf)
    if refused is not None:
        raise request.refuse(refused, _PYFUNC_FROM_CODE)
    code_file = request.model_dir / Path(str(request.conf["model_code_path"])).name
    if not code_file.is_file():
        raise request.refuse(f"model_code_path {request.conf['model_code_path']}", f"its folder has no {code_file.name}; "
                             "log the model again with MLflow's client")
    pickles = sorted(p.relative_to(request.model_dir).as_posix() for p in request.model_dir.rglob("*")
                     if p.is_file() and is_pickle(p))
    if pickles:
        raise request.refuse(f"it holds pickles: {', '.join(pickles[:5])}", "Shardline never unpickles (that runs "
                             "whatever code the file holds); log its weights as files (JSON, .npz, ONNX) in "
                             "artifacts= and read them in load_context")
    sample = request.needs_sample("learning a pyfunc's outputs (Shardline runs it on the rows)")
    with tempfile.TemporaryDirectory(prefix="shardline-pyfunc-") as staging:
        folder = Path(staging) / mlflow_pyfunc.MODEL_FOLDER  # the bundle keeps the folder under this name
        folder.symlink_to(request.model_dir.resolve(), target_is_directory=True)
        return package_python(Path(mlflow_pyfunc.__file__), request.out_dir, name=request.name, sample=sample,
                              exclude=request.exclude, files=[folder], requirements=["pandas"],
                              lineage=request.lineage)


def _skops_model(request: ImportRequest, key: str, also_trusted: frozenset[str], what: str, do: str) -> Any:
    """A model MLflow saved with skops, rebuilt trusting scikit-learn's own classes, numpy's dtype
    (``_SKOPS_DATA_TYPES``) and ``also_trusted`` only; a pickle is refused unread. Its trees (scikit-learn's
    ``Tree`` and ``TreePredictor``, which skops leaves untrusted) are checked before anything runs them
    (``sklearn_trees.check_trees``)."""
    serialization = str(request.conf.get("serialization_format") or "cloudpickle")
    if serialization != "skops":
        raise InvalidInput(
            f"MLflow model {request.source} (flavor {request.flavor}, serialization_format {serialization}) is "
            f"{what} saved as a pickle, which Shardline never loads (unpickling runs any code the file holds): {do}")
    try:
        import skops.io
    except ImportError as e:
        raise RuntimeUnavailable(f"reading a model MLflow saved with skops needs skops; {MLFLOW_EXTRA}") from e
    path = request.file(key)
    try:
        untrusted = [str(t) for t in skops.io.get_untrusted_types(file=path)]
    except Exception as e:  # noqa: BLE001 - skops raises its own errors for a file that is not its format
        raise InvalidInput(f"MLflow model {request.source} (flavor {request.flavor}): {path.name} is not a skops "
                           f"file skops reads ({type(e).__name__}: {e}); log the model again") from e
    trusted = also_trusted | _SKOPS_DATA_TYPES
    refused = [t for t in untrusted if t not in trusted and not _is_sklearn_class(t)]
    if refused:
        raise InvalidInput(
            f"MLflow model {request.source} (flavor {request.flavor}, skops) holds types Shardline does not "
            f"trust: {', '.join(refused[:5])}{' ...' if len(refused) > 5 else ''} (it rebuilds scikit-learn's own "
            f"classes and numpy's dtypes only); {_UNTRUSTED_INSTEAD if do == _LOG_INSTEAD else do}")
    try:
        model = skops.io.load(path, trusted=untrusted)
    except Exception as e:  # noqa: BLE001 - as above
        raise InvalidInput(f"MLflow model {request.source} (flavor {request.flavor}): skops cannot rebuild "
                           f"{path.name} here ({type(e).__name__}: {e}); {do}") from e
    if TREE_TYPES.intersection(untrusted):  # skops leaves them untrusted: their node indices go unchecked
        check_trees(model, f"MLflow model {request.source} (flavor {request.flavor}, skops)")
    return model


def _is_sklearn_class(type_name: str) -> bool:
    """Whether a skops type name is a class scikit-learn itself defines (not a function, not a name it imported)."""
    import importlib

    module_name, _, qualname = type_name.rpartition(".")
    if not module_name.startswith("sklearn.") or not qualname.isidentifier():
        return False
    try:
        found = getattr(importlib.import_module(module_name), qualname)
    except (ImportError, AttributeError):
        return False
    return isinstance(found, type) and found.__module__ == module_name and found.__qualname__ == qualname


# Flavors that map, in the order they are preferred when a model has several; python_function maps only when
# it was logged from code (``choose_flavor``).
FLAVORS: dict[str, Callable[[ImportRequest], Manifest]] = {
    "onnx": _from_onnx,
    "xgboost": _from_xgboost,
    "lightgbm": _from_lightgbm,
    "sklearn": _from_sklearn,
    "python_function": _from_pyfunc,
}


def choose_flavor(uri: str, flavors: Collection[str]) -> str:
    """The flavor of ``FLAVORS`` a model with ``flavors`` is built from.

    Args:
        flavors: the MLmodel's ``flavors`` (name -> section); python_function maps when its section names
            ``model_code_path`` (logged from code); given names alone, a pyfunc counts as pickled.

    Raises:
        InvalidInput: none maps (the message names the model's flavors, those that map, and what to do).
    """
    section = flavors.get(_PYFUNC) if isinstance(flavors, Mapping) else None
    for flavor in FLAVORS:
        if flavor in flavors and (flavor != _PYFUNC or (isinstance(section, dict) and section.get("model_code_path"))):
            return flavor
    maps = ", ".join(f for f in FLAVORS if f != _PYFUNC)
    if list(flavors) == [_PYFUNC]:
        raise InvalidInput(
            f"MLflow model {uri} has flavor python_function only, a pyfunc whose class MLflow saved as a pickle "
            f"(python_model), which Shardline never loads (unpickling runs any code the file holds): "
            f"{_PYFUNC_FROM_CODE}; or log the model with a flavor that maps ({maps})")
    raise InvalidInput(f"MLflow model {uri} has flavors {', '.join(flavors)}; Shardline maps {maps}: export the "
                       "model to ONNX (torch.onnx.export, tf2onnx, optimum) and log it with mlflow.onnx, package "
                       "the ONNX file with `shardline model package`, or wrap it in a pyfunc logged from code "
                       "(python_model='model.py')")
