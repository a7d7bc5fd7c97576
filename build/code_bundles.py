"""Bundles of custom model code: a Python class with ``load`` and ``predict``, its files, its requirements.

``package_python`` copies the code (one ``.py`` file, or a folder of them) under ``code/`` and the
model's files (weights as files: ``.onnx``, ``.npz``, ``.json``...; never a pickle) beside it, a
folder of them whole under its own name (an MLflow model's folder, for ``shardline.build.mlflow_pyfunc``),
infers the signature from sample rows (each sample column less ``exclude`` is an input, of its
Arrow type; the outputs are what the class answers on the sample's first rows), then loads the
bundle with the runtime both tiers use (``shardline.runtimes.custom``) and checks that it
answers the sample as the class did. A bundle that does not load or answer is refused, and no
folder is left behind. The contract the class follows is in ``shardline.runtimes.custom``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa

from shardline.build.packaging import (
    GoldenSet,
    current_environment,
    feature_columns,
    finish_bundle,
    is_pickle,
    new_bundle_dir,
)
from shardline.bundle import Lineage, Manifest, describe_artifact
from shardline.errors import InvalidBundle, InvalidInput, InvalidSetting, ShardlineError
from shardline.runtimes import RuntimeOptions, create_runtime
from shardline.runtimes.custom import CODE_DIR, answer_columns, import_entry
from shardline.signature import ColumnSpec, Signature, parse_type, type_name, with_missing_values

SAMPLE_ROWS = 256  # sample rows the packaged bundle is checked on
_OUTPUT_ROWS = 16  # sample rows the class is first run on, to learn its outputs
_OPTIONS = RuntimeOptions(device="cpu", intra_op_threads=1)


def package_python(
    code: str | Path,
    out_dir: str | Path,
    *,
    name: str,
    sample: pa.Table,
    entry: str | None = None,
    exclude: Sequence[str] = (),
    files: Sequence[str | Path] = (),
    requirements: Sequence[str] = (),
    lineage: Lineage | None = None,
    golden: GoldenSet | None = None,
    reference_profile: dict[str, Any] | None = None,
    image: str | None = None,
) -> Manifest:
    """Bundle custom model code (see the module docstring).

    Args:
        code: a ``.py`` file, or a folder of Python modules (copied whole, less ``__pycache__``).
        sample: rows the model reads (e.g. its training data): its columns less ``exclude`` are the inputs.
        entry: ``module:Class``; default ``<file stem>:Model`` for a file, ``model:Model`` for a folder.
        files: the model's files (weights, vocabularies), copied into the bundle root by their names; a folder is
            copied whole under its name (its paths kept, less ``__pycache__``), each file listed as an artifact.
        requirements: PEP 508 lines the code needs beyond Shardline's own packages, checked at every load.

    Raises:
        InvalidSetting: the code or a file is missing, two files share a name, or a file (or one in a folder) is a
            pickle.
        InvalidInput: a sample column's type has no signature name, or the class fails on the sample.
        InvalidBundle: the entry is not a class with ``predict``, or its answer cannot be typed.
    """
    source = Path(code)
    if not source.exists():
        raise InvalidSetting(f"model code {source} does not exist; give a .py file or a folder of modules")
    entry = entry or (f"{source.stem}:Model" if source.is_file() else "model:Model")
    paths = [Path(f) for f in files]
    _check_files(paths)
    signature_inputs = _inputs(sample, exclude)
    out = new_bundle_dir(out_dir)
    try:
        artifacts = _copy_code(source, out) + [a for path in paths for a in _copy_file(path, out)]
        provisional = Manifest(
            name=name, runtime="python", artifacts=artifacts,
            signature=Signature.model_construct(inputs=signature_inputs, outputs=()),  # outputs: learnt below
            runtime_config={"entry": entry, "requirements": list(requirements)},
            environment=current_environment(image), lineage=lineage or Lineage(),
            tags={"framework": "python"},
        )
        outputs = _outputs(out, provisional, sample.select([c.name for c in signature_inputs]))
        manifest = provisional.model_copy(update={"signature": Signature(inputs=signature_inputs, outputs=outputs)})
        _check_bundle(out, manifest, sample)
        return finish_bundle(out, manifest, golden, reference_profile)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise


def _check_files(paths: list[Path]) -> None:
    names: dict[str, Path] = {}
    for path in paths:
        if not path.is_file() and not path.is_dir():
            raise InvalidSetting(f"model file {path} does not exist; give each file (or folder) the code loads")
        if path.name in names or path.name in (CODE_DIR, "manifest.json"):
            raise InvalidSetting(f"model files {names.get(path.name, path.name)} and {path} share the name "
                                 f"{path.name!r} in the bundle; rename one")
        names[path.name] = path


def _inputs(sample: pa.Table, exclude: Sequence[str]) -> tuple[ColumnSpec, ...]:
    kept = set(feature_columns(sample, exclude))
    inputs = []
    for field in sample.schema:
        if field.name not in kept:
            continue
        written = type_name(field.type)
        try:
            parse_type(written)
        except InvalidBundle as e:
            raise InvalidInput(f"sample column {field.name!r} is {field.type}, which a signature cannot name; cast "
                               "it (to a number, string, bool or list of them) or --exclude it") from e
        inputs.append(ColumnSpec(name=field.name, type=written, nullable=sample.column(field.name).null_count > 0))
    if not inputs:
        raise InvalidInput("the sample has no input column left after --exclude; give the rows the model reads")
    return tuple(with_missing_values(sample, inputs))  # a float column whose sample holds NaN takes them


def _copy_code(source: Path, out: Path) -> list[Any]:
    target = out / CODE_DIR
    if source.is_file():
        if source.suffix != ".py":
            raise InvalidSetting(f"model code {source} is not a .py file; give the module that holds the class")
        target.mkdir()
        shutil.copyfile(source, target / source.name)
    else:
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".*"))
    found = sorted(p for p in target.rglob("*") if p.is_file())
    if not any(p.suffix == ".py" for p in found):
        raise InvalidSetting(f"model code {source} holds no .py file; give the module that holds the class")
    pickles = [p.name for p in found if is_pickle(p, sniff=True)]
    if pickles:
        raise InvalidSetting(f"model code {source} holds pickles ({', '.join(pickles)}), which Shardline never "
                             "loads; save weights as files (ONNX, .npz, JSON) and load them in load(context)")
    return [describe_artifact(out, p.relative_to(out).as_posix(), role="code") for p in found]


def _copy_file(path: Path, out: Path) -> list[Any]:
    """Copy one model file, or a folder whole under its name, into the bundle; the artifacts (role model)."""
    if path.is_file():
        if is_pickle(path, sniff=True):
            raise InvalidSetting(f"model file {path} is a pickle, which Shardline never loads; save the weights as "
                                 "files (ONNX, .npz, JSON) and load them in load(context)")
        shutil.copyfile(path, out / path.name)
        return [describe_artifact(out, path.name, role="model")]
    pickles = [p.relative_to(path).as_posix() for p in sorted(path.rglob("*")) if p.is_file() and is_pickle(p, sniff=True)]
    if pickles:
        raise InvalidSetting(f"model folder {path} holds pickles ({', '.join(pickles[:5])}), which Shardline never "
                             "loads; save the weights as files (ONNX, .npz, JSON) and load them in load(context)")
    shutil.copytree(path, out / path.name, ignore=shutil.ignore_patterns("__pycache__"))
    found = sorted(p for p in (out / path.name).rglob("*") if p.is_file())
    return [describe_artifact(out, p.relative_to(out).as_posix(), role="model") for p in found]


def _outputs(out: Path, manifest: Manifest, sample: pa.Table) -> tuple[ColumnSpec, ...]:
    """The output columns the class answers on the sample's first rows, typed as it answers them."""
    from shardline.runtimes.custom import ModelContext, check_requirements

    check_requirements(list(manifest.runtime_config["requirements"]), manifest.name)
    cls = import_entry(out / CODE_DIR, manifest.runtime_config["entry"], f"_shardline_packaging_{id(manifest)}",
                       manifest.name)
    model = cls()
    rows = sample.slice(0, _OUTPUT_ROWS)
    try:
        if callable(getattr(model, "load", None)):
            files = {a.path: out / a.path for a in manifest.artifacts if a.role != "code"}
            model.load(ModelContext(out, manifest, _OPTIONS, files))
        given = model.preprocess(rows) if callable(getattr(model, "preprocess", None)) else rows
        answer = model.predict(given)
        if callable(getattr(model, "postprocess", None)):
            answer = model.postprocess(answer, rows)
    except ShardlineError:
        raise
    except Exception as e:  # noqa: BLE001 - the code's own error on the sample
        raise InvalidInput(f"{manifest.name}'s code failed on the sample's first {rows.num_rows} rows: "
                           f"{type(e).__name__}: {e}; fix the code (or the sample) and package again") from e
    columns = answer_columns(answer, manifest.name)
    if not columns:
        raise InvalidBundle(f"{manifest.name}'s predict answered no columns; answer at least one output column")
    outputs = []
    for column, array in columns.items():
        if len(array) != rows.num_rows:
            raise InvalidBundle(f"{manifest.name}'s predict answered {len(array)} rows of {column!r} for "
                                f"{rows.num_rows} rows; answer one row per input row")
        written = type_name(array.type)
        try:
            parse_type(written)
        except InvalidBundle as e:
            raise InvalidBundle(f"{manifest.name}'s predict answers {column!r} as {array.type}, which a signature "
                                "cannot name; answer numbers, strings, bools or lists of them") from e
        outputs.append(ColumnSpec(name=column, type=written, nullable=array.null_count > 0))
    return tuple(outputs)


def _check_bundle(out: Path, manifest: Manifest, sample: pa.Table) -> None:
    """Load the bundle as both tiers do and score the sample: it must answer every row."""
    runtime = create_runtime(out, manifest, _OPTIONS)
    runtime.load()
    try:
        rows = sample.slice(0, SAMPLE_ROWS)
        answer = runtime.predict(rows)
        if answer.num_rows != rows.num_rows:
            raise InvalidBundle(f"{manifest.name} answered {answer.num_rows} rows for {rows.num_rows} sample rows")
    finally:
        runtime.close()
