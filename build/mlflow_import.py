"""Bundles from models kept in MLflow, resolved and downloaded by MLflow's own client.

``import_mlflow_model("models:/churn/3", "churn-bundle")`` finds the model (a registered version or
alias, a logged model, a run's model) with ``mlflow.MlflowClient`` against one tracking URI, downloads
its folder with ``mlflow.artifacts.download_artifacts``, reads its ``MLmodel`` file (YAML, with
``mlflow.models.Model.load``) and builds the bundle from the first flavor that maps
(``shardline.build.mlflow_flavors``: onnx, xgboost, lightgbm, sklearn saved by skops, and a pyfunc logged from
code, which becomes a custom-code bundle that runs the model's own code). Nothing is ever unpickled: a
pickled model, a pickled pyfunc and other flavors are refused, naming the flavor, and a refused import
leaves nothing behind (no bundle folder; a local tracking store that is not there is refused rather than
created empty, as MLflow's client would).

The signature comes from the rows the converted model is checked on: ``sample`` (the user's rows,
e.g. ``--signature-from``), else the input example logged with the model (a DataFrame example, read as
JSON and typed by the MLmodel signature). The tree builders and a pyfunc need such rows; an ONNX model
packages without. The feature order is the model file's own, else the MLmodel signature's input columns.

Lineage: ``parent`` is the pinned model URI (``models:/NAME/VERSION`` for an alias too),
``source_commit`` the run's ``mlflow.source.git.commit`` tag, ``metrics`` the run's metrics; the
manifest's tags carry ``mlflow.source`` (the URI as given), ``mlflow.model_version``,
``mlflow.run_id``, ``mlflow.experiment_id``, ``mlflow.model_id`` and ``mlflow.flavor``.

``list_registered_versions`` lists a registered model's versions and aliases with the same client: what the
``mlflow-watch`` flow compares with what it has seen (``shardline.build.mlflow_watch``).

MLflow (``mlflow-skinny``) and skops are imported inside the functions: ``pip install
'shardline[mlflow]'``. MLflow sends usage telemetry unless ``MLFLOW_DISABLE_TELEMETRY=true`` is set
before it is imported (it takes ``DO_NOT_TRACK`` only as ``true``, not ``1``); the ``shardline``
command sets it.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import pyarrow as pa

from shardline.build.mlflow_flavors import FLAVORS, MLFLOW_EXTRA, ImportRequest, choose_flavor
from shardline.bundle import Lineage, Manifest, check_model_name, write_manifest
from shardline.errors import InvalidInput, InvalidSetting, ModelNotFound, RuntimeUnavailable

if TYPE_CHECKING:
    from shardline.build.packaging import GoldenSet, SampleRows

_MLFLOW_TYPES = {"double": pa.float64(), "float": pa.float32(), "long": pa.int64(), "integer": pa.int32(),
                 "boolean": pa.bool_(), "string": pa.string()}


@dataclass(frozen=True)
class MlflowModelUri:
    """A model URI as MLflow reads it, parsed: one of ``models:/NAME/VERSION``, ``models:/NAME@ALIAS``,
    ``models:/m-ID`` (a logged model) or ``runs:/RUN_ID/PATH``."""

    given: str
    name: str | None = None
    version: str | None = None
    alias: str | None = None
    model_id: str | None = None
    run_id: str | None = None
    path: str | None = None


def parse_model_uri(text: str) -> MlflowModelUri:
    """Parse ``mlflow:/models/NAME/VERSION`` (Shardline's form) or MLflow's own ``models:/`` and ``runs:/`` URIs.

    Raises:
        InvalidSetting: the text is none of those forms.
    """
    uri = text.strip()
    if uri.startswith("mlflow:"):
        rest = uri[len("mlflow:"):].lstrip("/")
        kind, _, body = rest.partition("/")
        uri = f"{kind}:/{body}" if kind in ("models", "runs") else uri
    for scheme in ("models:", "runs:"):
        if uri.startswith(scheme):
            body = uri[len(scheme):].lstrip("/")
            parsed = _parse_models(text, body) if scheme == "models:" else _parse_runs(text, body)
            if parsed is not None:
                return parsed
    raise InvalidSetting(f"{text!r} is not an MLflow model URI; give mlflow:/models/NAME/VERSION, models:/NAME/VERSION, "
                         "models:/NAME@ALIAS, models:/m-MODEL_ID or runs:/RUN_ID/PATH")


def _parse_models(given: str, body: str) -> MlflowModelUri | None:
    if "@" in body and "/" not in body.split("@", 1)[1]:
        name, alias = body.split("@", 1)
        return MlflowModelUri(given, name=name, alias=alias) if name and alias else None
    if "/" in body:
        name, version = body.rsplit("/", 1)
        if name and version.isascii() and version.isdigit():
            return MlflowModelUri(given, name=name, version=version)
        return None
    return MlflowModelUri(given, model_id=body) if body.startswith("m-") else None


def _parse_runs(given: str, body: str) -> MlflowModelUri | None:
    run_id, _, path = body.partition("/")
    path = path.strip("/")
    return MlflowModelUri(given, run_id=run_id, path=path) if run_id and path else None


def shardline_name(mlflow_name: str) -> str:
    """A valid Shardline model name made from an MLflow one: lower-cased, every other character a '-'.

    Raises:
        InvalidSetting: nothing usable is left (give a name).
    """
    name = re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9._-]", "-", mlflow_name.lower()))
    name = name.lstrip("._-")[:64].rstrip("-")
    if not name:
        raise InvalidSetting(f"the MLflow name {mlflow_name!r} makes no Shardline model name; give one with --name")
    return check_model_name(name)


@dataclass(frozen=True)
class ImportedModel:
    """What ``import_mlflow_model`` built: the bundle, the flavor it came from and the pinned MLflow URI."""

    manifest: Manifest
    folder: Path
    flavor: str
    source: str
    sample_from_example: bool  # the signature was checked on the logged input example (no user rows)


@dataclass(frozen=True)
class _Resolved:
    """Where an MLflow model's files are, and what names it."""

    location: str  # an artifact location (a path, s3://, mlflow-artifacts:/...), never a models:/ or runs:/ URI
    pinned: str  # the URI that names this model for good (an alias resolved to its version)
    name: str  # the default Shardline name comes from it
    version: str | None = None
    run_id: str | None = None
    model_id: str | None = None


def import_mlflow_model(uri: str, out_dir: str | Path | None = None, *, name: str | None = None,
                        tracking_uri: str | None = None, sample: SampleRows | None = None, exclude: Sequence[str] = (),
                        lineage: Lineage | None = None, golden: GoldenSet | None = None) -> ImportedModel:
    """Build a bundle from a model kept in MLflow (see the module docstring).

    Args:
        uri: ``mlflow:/models/NAME/VERSION``, ``models:/NAME/VERSION``, ``models:/NAME@ALIAS``, ``models:/m-ID``
            or ``runs:/RUN_ID/PATH``.
        out_dir: the bundle folder, new or empty (default ``./<name>-bundle``).
        name: the Shardline model name (default: the MLflow name, made valid by ``shardline_name``).
        tracking_uri: MLflow's tracking URI (default: MLflow's own, ``MLFLOW_TRACKING_URI`` or its default).
        sample: rows the model reads (e.g. its training data): a pandas DataFrame, a pyarrow Table or a Parquet
            file's path; default: the input example logged with it.
        exclude: columns of ``sample`` that are not features (a label, an id).
        lineage: lineage to start from (training data); the run's metrics, commit and the URI are added.
        golden: rows with known answers and the score promotion demands on them (the gate ``evaluation``
            refuses a version without one), as ``shardline model package --golden`` adds them.

    Raises:
        InvalidSetting: the URI is malformed, the tracking store is not there or unreadable, ``out_dir`` holds files,
            or the golden set does not fit the model (no label column, or an output the model lacks): the request's
            fault, not the model's (a watch retries the version once its setting is mended).
        ModelNotFound: MLflow has no such model, version, alias or run.
        InvalidInput: the model cannot be mapped (its flavor, a pickle, no sample rows) or does not convert.
        RuntimeUnavailable: mlflow (or skops, or a framework) is not installed.
    """
    from shardline.build.packaging import sample_table

    parsed = parse_model_uri(uri)
    rows = sample_table(sample) if sample is not None else None
    mlflow = _mlflow()
    tracking = tracking_uri or str(mlflow.get_tracking_uri())
    _check_local_store(tracking)
    client = _mlflow_call(lambda: mlflow.MlflowClient(tracking_uri=tracking), parsed, tracking, "open its store for")
    with tempfile.TemporaryDirectory(prefix="shardline-mlflow-") as scratch:
        found = _mlflow_call(lambda: _resolve(client, parsed), parsed, tracking, "find the model")
        chosen = name if name is not None else shardline_name(found.name)
        check_model_name(chosen)
        out = Path(out_dir) if out_dir is not None else Path(f"{chosen}-bundle")
        existed = _check_out(out)
        model_dir = Path(_mlflow_call(lambda: mlflow.artifacts.download_artifacts(
            artifact_uri=found.location, dst_path=scratch, tracking_uri=tracking), parsed, tracking, "download the model"))
        mlmodel = _read_mlmodel(mlflow, model_dir, parsed)
        flavor = choose_flavor(parsed.given, dict(mlmodel.flavors))
        run_id = found.run_id or getattr(mlmodel, "run_id", None)
        run = _mlflow_call(lambda: client.get_run(run_id), parsed, tracking, "read the run") if run_id else None
        example = _input_example(model_dir, mlmodel) if rows is None else None
        request = ImportRequest(
            source=parsed.given, model_dir=model_dir, mlmodel=mlmodel, flavor=flavor, out_dir=out, name=chosen,
            sample=rows if rows is not None else example, sample_is_example=example is not None,
            exclude=tuple(exclude) if rows is not None else (), lineage=_lineage(lineage, found, run))
        tags = _tags(parsed, found, run, flavor, getattr(mlmodel, "model_id", None))
        try:
            manifest = FLAVORS[flavor](request)
            manifest = manifest.model_copy(update={"tags": {**manifest.tags, **tags}})
            if golden is not None:
                from shardline.build.packaging import finish_bundle

                try:
                    manifest = finish_bundle(out, manifest, golden)  # checked against the outputs; writes the manifest
                except InvalidInput as e:
                    raise InvalidSetting(f"the golden set does not fit {chosen}: {e}") from e
            else:
                write_manifest(out, manifest)
        except BaseException:
            _remove_bundle(out, existed)
            raise
    return ImportedModel(manifest, out, flavor, found.pinned, request.sample_is_example)


@dataclass(frozen=True)
class RegisteredVersions:
    """A registered model's versions (number, MLflow status such as ``READY``) and aliases, as MLflow lists them."""

    name: str
    versions: tuple[tuple[str, str], ...]
    aliases: dict[str, str]


def mlflow_tracking_uri(tracking_uri: str | None = None) -> str:
    """The tracking URI MLflow's client will use: ``tracking_uri``, else MLflow's own (``MLFLOW_TRACKING_URI``
    or its default).

    Raises:
        InvalidSetting: it names a local store that is not there.
        RuntimeUnavailable: mlflow is not installed.
    """
    tracking = tracking_uri or str(_mlflow().get_tracking_uri())
    _check_local_store(tracking)
    return tracking


def list_registered_versions(name: str, tracking_uri: str) -> RegisteredVersions:
    """Every version of the registered model ``name`` and its aliases, listed by MLflow's client.

    Raises:
        ModelNotFound: MLflow has no registered model of that name.
        InvalidSetting: the store cannot be read.
        RuntimeUnavailable: mlflow is not installed.
    """
    mlflow = _mlflow()
    uri = MlflowModelUri(f"models:/{name}", name=name)
    client = _mlflow_call(lambda: mlflow.MlflowClient(tracking_uri=tracking_uri), uri, tracking_uri, "open its store for")
    model = _mlflow_call(lambda: client.get_registered_model(name), uri, tracking_uri, "read the registered model")
    quote = "'" if "'" not in name else '"'
    query = f"name = {quote}{name}{quote}" if quote not in name else None  # a name holding both quotes: filter here
    found: list[tuple[str, str]] = []
    token = None
    while True:
        page = _mlflow_call(lambda: client.search_model_versions(filter_string=query, page_token=token), uri,
                            tracking_uri, "list the versions of")
        found += [(str(v.version), str(v.status)) for v in page if v.name == name]
        token = getattr(page, "token", None)
        if not token:
            break
    aliases = {str(alias): str(version) for alias, version in (model.aliases or {}).items()}
    return RegisteredVersions(name, tuple(found), aliases)


def _mlflow() -> Any:
    try:
        import mlflow
        import mlflow.artifacts
    except ImportError as e:
        raise RuntimeUnavailable(f"importing a model from MLflow needs MLflow's client; {MLFLOW_EXTRA}") from e
    return mlflow


def shown_uri(uri: str) -> str:
    """A URI as an error may print it: without a password."""
    return re.sub(r"//[^/@]*@", "//", uri)


def _check_local_store(tracking: str) -> None:
    """Refuse a local tracking store that is not there (MLflow would create an empty one and find nothing)."""
    from urllib.parse import unquote, urlparse

    if tracking.startswith("sqlite:///"):
        path = Path(unquote(tracking[len("sqlite:///"):]))
    elif tracking.startswith("file:"):
        path = Path(unquote(urlparse(tracking).path))
    elif "://" not in tracking and ":" not in tracking.split("/", 1)[0]:
        path = Path(tracking)
    else:
        return
    if not path.exists():
        raise InvalidSetting(f"there is no MLflow tracking store at {tracking} ({path} does not exist); give the one the "
                             "model was logged to with --tracking-uri (e.g. sqlite:///path/to/mlflow.db or "
                             "http://host:5000) or set MLFLOW_TRACKING_URI")


def _mlflow_call(call: Callable[[], Any], uri: MlflowModelUri, tracking: str, doing: str) -> Any:
    """Run one MLflow client call; its errors become Shardline's, in one line."""
    from mlflow.exceptions import MlflowException

    try:
        return call()
    except MlflowException as e:
        first = (str(e.message if hasattr(e, "message") else e).strip().splitlines() or [type(e).__name__])[0]
        if getattr(e, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND") or " not found" in first:
            raise ModelNotFound(f"MLflow at {shown_uri(tracking)} has no {uri.given} ({first}); check the name, version, "
                                "alias or run, and --tracking-uri", uri.given) from e
        raise InvalidSetting(f"MLflow at {shown_uri(tracking)} could not {doing} {uri.given} ({first}); check "
                             "--tracking-uri (or MLFLOW_TRACKING_URI) and the URI") from e


def _resolve(client: Any, uri: MlflowModelUri) -> _Resolved:
    """Find the model's files with MLflow's client (models:/ and runs:/ resolved here, against this client's
    tracking and registry URIs, so that nothing falls back to MLflow's process-wide defaults)."""
    if uri.name is not None:
        version = (client.get_model_version_by_alias(uri.name, uri.alias) if uri.alias is not None
                   else client.get_model_version(uri.name, uri.version))
        location = str(client.get_model_version_download_uri(uri.name, str(version.version)))
        if location.startswith("models:/"):
            location = str(client.get_logged_model(location[len("models:/"):]).artifact_location)
        return _Resolved(location, f"models:/{uri.name}/{version.version}", uri.name, str(version.version),
                         version.run_id or None)
    if uri.model_id is not None:
        logged = client.get_logged_model(uri.model_id)
        return _Resolved(str(logged.artifact_location), f"models:/{uri.model_id}", str(logged.name),
                         run_id=logged.source_run_id or None, model_id=uri.model_id)
    assert uri.run_id is not None and uri.path is not None
    run = client.get_run(uri.run_id)
    head, _, rest = uri.path.partition("/")
    page = [] if "'" in head else client.search_logged_models(experiment_ids=[run.info.experiment_id],
                                                             filter_string=f"name = '{head}'")
    logged = next((m for m in page if m.source_run_id == uri.run_id), None)
    if logged is not None:
        location = str(logged.artifact_location).rstrip("/") + (f"/{rest}" if rest else "")
    else:  # a model logged as run artifacts (MLflow 2)
        location = str(run.info.artifact_uri).rstrip("/") + f"/{uri.path}"
    return _Resolved(location, f"runs:/{uri.run_id}/{uri.path}", uri.path.rsplit("/", 1)[-1], run_id=uri.run_id,
                     model_id=logged.model_id if logged is not None else None)


def _read_mlmodel(mlflow: Any, model_dir: Path, uri: MlflowModelUri) -> Any:
    """The MLmodel file, read by MLflow (YAML, safe_load)."""
    if not (model_dir / "MLmodel").is_file():
        raise InvalidInput(f"{uri.given} holds no MLmodel file: it is not an MLflow model (a run's artifact folder, "
                           "not a model logged with mlflow.<flavor>.log_model); give the model's URI")
    try:
        return mlflow.models.Model.load(str(model_dir / "MLmodel"))
    except Exception as e:  # noqa: BLE001 - MLflow and YAML raise many types for a broken file
        raise InvalidInput(f"{uri.given}'s MLmodel file cannot be read ({type(e).__name__}: {e}); log the model "
                           "again with MLflow's client") from e


def _input_example(model_dir: Path, mlmodel: Any) -> pa.Table | None:
    """The logged input example as a table (a DataFrame example only), typed by the MLmodel signature; read as
    JSON, never unpickled."""
    info = getattr(mlmodel, "saved_input_example_info", None) or {}
    if info.get("type") != "dataframe" or info.get("pandas_orient", "split") != "split":
        return None
    path = model_dir / str(info.get("artifact_path") or "")
    try:
        example = json.loads(path.read_text())
        columns, data = [str(c) for c in example["columns"]], example["data"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    types: dict[str, pa.DataType] = {}
    schema = getattr(mlmodel.signature, "inputs", None)
    if schema is not None and not schema.is_tensor_spec():
        for spec in schema.inputs:
            kind = getattr(getattr(spec, "type", None), "name", None)
            if spec.name is not None and kind in _MLFLOW_TYPES:
                types[str(spec.name)] = _MLFLOW_TYPES[kind]
    arrays = {}
    for i, column in enumerate(columns):
        values = [row[i] for row in data]
        try:
            arrays[column] = pa.array(values, type=types.get(column))
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            arrays[column] = pa.array(values)
    return pa.table(arrays) if arrays and data else None


def _lineage(base: Lineage | None, found: _Resolved, run: Any) -> Lineage:
    metrics = {str(k): float(v) for k, v in (run.data.metrics.items() if run is not None else [])
               if isinstance(v, (int, float)) and math.isfinite(v)}
    commit = run.data.tags.get("mlflow.source.git.commit") if run is not None else None
    start = base or Lineage()
    return start.model_copy(update={"parent": found.pinned, "source_commit": start.source_commit or commit,
                                    "metrics": {**metrics, **start.metrics}})


def _tags(uri: MlflowModelUri, found: _Resolved, run: Any, flavor: str, model_id: str | None) -> dict[str, str]:
    tags = {"mlflow.source": uri.given, "mlflow.flavor": flavor}
    if found.version is not None:
        tags["mlflow.model_version"] = found.version
    if found.run_id or run is not None:
        tags["mlflow.run_id"] = str(found.run_id or run.info.run_id)
    if run is not None:
        tags["mlflow.experiment_id"] = str(run.info.experiment_id)
    if found.model_id or model_id:
        tags["mlflow.model_id"] = str(found.model_id or model_id)
    return tags


def _check_out(out: Path) -> bool:
    """Refuse a bundle folder that holds files, before anything is downloaded; whether it exists."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InvalidSetting(f"{out} is not an empty folder; give a new folder for the bundle with --out")
    return out.exists()


def _remove_bundle(out: Path, existed: bool) -> None:
    """Leave nothing of a refused import: the folder it made, or what it wrote into the empty one it was given."""
    if not existed:
        shutil.rmtree(out, ignore_errors=True)
    elif out.is_dir():
        for child in out.iterdir():
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)

