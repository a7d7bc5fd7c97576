"""`shardline model import` (a model kept in MLflow) and `shardline model watch-mlflow` (one run of the
mlflow-watch flow): the model commands that talk to MLflow, on ``model_app`` (``model_commands``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from shardline.cli.common import EXIT_FAILED, EXIT_USAGE, fail, open_registry
from shardline.cli.model_commands import announce, model_app, push_version
from shardline.cli.package_commands import (
    _GOLDEN_HELP,
    _LABEL,
    _METRIC,
    _PREDICTION,
    _THRESHOLD,
    _check_metric,
    _golden_set,
    sample_lineage,
    sample_rows,
    signature_lines,
)
from shardline.errors import ShardlineError

_IMPORT_NO_PROFILE = (
    "  no reference profile: drift checks and the promotion gate 'reference-profile' need one; import again with "
    "--signature-from ROWS.parquet (rows the model reads, e.g. its training data)"
)


@model_app.command("import")
def model_import(
    uri: str = typer.Argument(..., help="The MLflow model: mlflow:/models/NAME/VERSION, or MLflow's own "
                              "models:/NAME/VERSION, models:/NAME@ALIAS, models:/m-MODEL_ID or runs:/RUN_ID/PATH."),
    tracking_uri: Optional[str] = typer.Option(None, help="MLflow's tracking URI (sqlite:///mlflow.db, "
                                               "http://host:5000, ...); default: MLflow's own (MLFLOW_TRACKING_URI, "
                                               "else its default store here)."),
    name: Optional[str] = typer.Option(None, help="Shardline model name; default: the MLflow name, lower-cased, "
                                       "other characters made '-'."),
    signature_from: Optional[Path] = typer.Option(
        None, exists=True, dir_okay=False, help="Sample Parquet rows the model reads (e.g. its training data): the "
        "signature is checked on them and their profile becomes the reference profile. Default: the input example "
        "logged with the model; XGBoost, LightGBM and scikit-learn models need one or the other."),
    exclude: Optional[list[str]] = typer.Option(None, help="Sample column that is not a feature (label, id); repeat."),
    golden: Optional[Path] = typer.Option(None, exists=True, dir_okay=False, help=_GOLDEN_HELP + "."),
    label: str = _LABEL,
    metric: str = _METRIC,
    prediction: str = _PREDICTION,
    threshold: float = _THRESHOLD,
    out: Optional[Path] = typer.Option(None, help="Bundle folder; default: ./<name>-bundle with --no-push, a "
                                       "temporary folder (removed after the push) otherwise."),
    push: bool = typer.Option(True, "--push/--no-push", help="Push the bundle to the registry as its next version, "
                              "as `shardline model push` does."),
) -> None:
    """Make a bundle from a model kept in MLflow (its onnx, xgboost, lightgbm or sklearn flavor, or a pyfunc logged
    from code, which becomes custom model code), with its lineage: run, experiment, metrics. Pickled models and
    pickled pyfuncs are refused: nothing is unpickled."""
    import contextlib
    import os
    import tempfile

    from shardline.build.mlflow_import import import_mlflow_model
    from shardline.quality.profile import attach_reference_profile

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one error line, no progress bars
    try:
        sample = sample_rows(signature_from, exclude)
        lineage = sample_lineage(signature_from)
        with contextlib.ExitStack() as scratch:
            folder = out
            if folder is None and push:
                folder = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="shardline-import-"))) / "bundle"
            imported = import_mlflow_model(uri, folder, name=name, tracking_uri=tracking_uri, sample=sample,
                                           exclude=exclude or [], lineage=lineage,
                                           golden=_golden_set(golden, label, metric, prediction, threshold))
            manifest = imported.manifest
            if sample is not None:
                manifest = attach_reference_profile(imported.folder, sample)
            pushed, new = push_version(open_registry(), imported.folder) if push else (None, False)
    except ShardlineError as e:
        raise fail(e) from e
    where = "" if pushed is not None and out is None else f" in {imported.folder}"
    typer.echo(f"imported {imported.source} (flavor {imported.flavor}) as {manifest.name}{where}\n"
               f"{signature_lines(manifest)}")
    if sample is None:
        typer.echo(_IMPORT_NO_PROFILE)
    if pushed is not None:
        typer.echo(f"pushed {pushed.reference} (digest {pushed.outputs_digest[:12]})")
        if new:
            announce(pushed, f"model import {imported.source}")


@model_app.command("watch-mlflow")
def model_watch_mlflow(
    models: list[str] = typer.Argument(..., help="MLflow registered models: NAME (every version) or NAME@ALIAS (the "
                                       "version the alias points at)."),
    tracking_uri: Optional[str] = typer.Option(None, help="MLflow's tracking URI (sqlite:///mlflow.db, "
                                               "http://host:5000, ...); default: MLflow's own (MLFLOW_TRACKING_URI, "
                                               "else its default store here)."),
    name: Optional[list[str]] = typer.Option(None, help="MLFLOW_NAME=SHARDLINE_NAME: the Shardline name of a watched "
                                             "model (default: the MLflow name, lower-cased, other characters '-'); "
                                             "repeat."),
    sample: Optional[list[str]] = typer.Option(None, help="MLFLOW_NAME=ROWS.parquet: rows a watched model reads (e.g. "
                                               "its training data, any URL): its versions are checked on them and get "
                                               "their profile as reference profile, which promotion's gates ask for; "
                                               "repeat."),
    exclude: Optional[list[str]] = typer.Option(None, help="A sample column that is not a feature (label, id); repeat."),
    golden: Optional[list[str]] = typer.Option(None, help="MLFLOW_NAME=GOLDEN.parquet (any URL): the golden set each "
                                               "imported version of that model carries: inputs with known answers, "
                                               "which promotion's gate 'evaluation' scores (it refuses a version "
                                               "without one); repeat. --label, --metric, --prediction and --threshold "
                                               "apply to each."),
    label: str = _LABEL,
    metric: str = _METRIC,
    prediction: str = _PREDICTION,
    threshold: float = _THRESHOLD,
) -> None:
    """One run of the mlflow-watch flow: import each MLflow version not seen before, push it and announce it as
    shardline.model.pushed (prefect.yaml's promote-on-push promotes it to staging). What it has seen is kept under
    <home>/mlflow-watch/; a refused version (a pickle, a flavor that does not map) is recorded, not retried. Exit 1
    when a model or version could not be done (the next run retries it), 2 for a wrong request."""
    import os

    from shardline.build.mlflow_import import mlflow_tracking_uri
    from shardline.build.mlflow_watch import GoldenRows, watch_targets
    from shardline.cli.common import exit_code, one_line_user_errors
    from shardline.cli.prefect_commands import use_prefect_api

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one error line, no progress bars
    try:
        name_map = _pairs("--name", name, "MLFLOW_NAME=SHARDLINE_NAME, e.g. --name 'Churn Model=churn'")
        samples = _pairs("--sample", sample, "MLFLOW_NAME=ROWS.parquet, e.g. --sample 'Churn Model=train.parquet'")
        goldens = _pairs("--golden", golden, "MLFLOW_NAME=GOLDEN.parquet, e.g. --golden 'Churn Model=golden.parquet'")
        if goldens:
            _check_metric(metric)
        golden_rows = {model: GoldenRows(rows=rows, label=label, metric=metric,  # type: ignore[arg-type]
                                         prediction=prediction, threshold=threshold) for model, rows in goldens.items()}
        watch_targets(models, name_map, samples, golden_rows)  # a wrong request is one line here, before any flow starts
        tracking = mlflow_tracking_uri(tracking_uri)
        use_prefect_api()
    except ShardlineError as e:
        raise fail(e) from e
    from shardline.flows.mlflow_watch import mlflow_watch

    with one_line_user_errors():
        state = mlflow_watch(models=models, tracking_uri=tracking, name_map=name_map or None, samples=samples or None,
                             exclude=exclude or None, golden=golden_rows or None, return_state=True)
    result = state.result(raise_on_failure=False)
    if isinstance(result, BaseException):
        raise fail(result, exit_code(result))
    for outcome in result["outcomes"]:
        typer.echo(f"  {outcome['line']}")
    typer.echo(result["headline"])
    failed = [o for o in result["outcomes"] if o["action"] == "failed"]
    if failed:
        raise fail(f"{len(failed)} not done: {failed[0]['line']}",
                   EXIT_USAGE if all(o["user_error"] for o in failed) else EXIT_FAILED)


def _pairs(option: str, given: list[str] | None, form: str) -> dict[str, str]:
    """``KEY=VALUE`` options as a dict (the key may hold '=' up to the last one)."""
    pairs = {}
    for pair in given or []:
        key, equals, value = pair.rpartition("=")
        if not equals or not key or not value:
            raise ShardlineError(f"{option} {pair!r} is not {form}")
        pairs[key] = value
    return pairs
