"""`shardline model ...`: push, list, show, search, alias, promote, release, rollback, history, optimize, distill,
profile and place; `package` and `package-minilm` are in ``package_commands``, `import` and `watch-mlflow` (MLflow) in
``mlflow_commands``, on the same app.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from shardline.cli.common import (
    ALIAS_HELP,
    EXIT_FAILED,
    EXIT_USAGE,
    PRICES_HELP,
    fail,
    model_and_alias,
    open_registry,
    parse_tags,
)
from shardline.cli.package_commands import model_package, model_package_minilm
from shardline.cli.rollout_commands import MAX_ERROR_INCREASE, MAX_P99_RATIO, MIN_REQUESTS, WINDOW
from shardline.errors import GateFailed, ShardlineError

model_app = typer.Typer(help="The model registry: package, push, promote, roll back, optimize.", no_args_is_help=True)
model_app.command("package")(model_package)  # first in `shardline model --help`, as the first step
model_app.command("package-minilm")(model_package_minilm)


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
        found = open_registry().search(name=name, alias=alias, tags=parse_tags(tag))
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
    name: str = typer.Argument(..., help="Model name (or name@alias)."),
    alias: str = typer.Option("prod", help=ALIAS_HELP),
    reason: str = typer.Option("", help="Why, for the audit log."),
) -> None:
    """Move an alias back to the version it pointed at before."""
    name, alias = model_and_alias(name, alias)
    try:
        move = open_registry().rollback(name, alias, reason=reason)
    except ShardlineError as e:
        raise fail(e) from e
    typer.echo(f"{name}@{alias} -> {name}:{move.version} (was {name}:{move.previous})")


@model_app.command("history")
def model_history(
    name: str = typer.Argument(..., help="Model name (or name@alias)."),
    alias: str = typer.Option("prod", help=ALIAS_HELP),
) -> None:
    """The audit log of an alias: every move with who, when and why."""
    name, alias = model_and_alias(name, alias)
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


@model_app.command("distill")
def model_distill(
    teacher: str = typer.Argument(..., help="The teacher: name:version or name@alias (with a golden set)."),
    data: Path = typer.Option(..., "--data", help="Parquet file or folder of rows holding the teacher's inputs."),
    student: str = typer.Option("linear", "--student", help="linear, gbt (small boosted trees) or mlp."),
    trees: int = typer.Option(50, "--trees", help="gbt: how many trees."),
    max_depth: int = typer.Option(3, "--max-depth", help="gbt: how deep each tree is."),
    hidden: int = typer.Option(16, "--hidden", help="mlp: units in its one hidden layer."),
    name: Optional[str] = typer.Option(None, "--name", help="The student's model name (default <teacher>-student)."),
    prices: Optional[Path] = typer.Option(None, "--prices", help="The price table (YAML); default as `shardline "
                                          "cost report`."),
) -> None:
    """Train a smaller student on the teacher's answers over --data, gate it on the teacher's golden set like a
    precision variant, push it (lineage parent: the teacher), and show both models' cost per 1k rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardline.build.distill import StudentSize
    from shardline.capacity.prices import load_prices, prices_path
    from shardline.cost.prices import cost_per_1k_rows
    from shardline.errors import InvalidInput
    from shardline.quality.distillation import distill
    from shardline.settings import StorageSettings

    storage = StorageSettings()
    try:
        if not data.exists():
            raise InvalidInput(f"the data {str(data)!r} does not exist; give a Parquet file or a folder of them")
        try:
            table = pq.read_table(data)
        except (OSError, pa.ArrowException) as e:
            raise InvalidInput(f"the data {str(data)!r} cannot be read as Parquet ({e}); give a Parquet file or a "
                               "folder of them") from e
        price_table = load_prices(prices_path(prices))
        per_core_hour = price_table.per_unit_hour("cpu", "on-demand")
        done = distill(open_registry(), teacher, table, kind=student,
                       size=StudentSize(trees=trees, max_depth=max_depth, hidden=hidden), name=name,
                       data_source=str(data), cache_dir=storage.cache, storage_options=storage.storage_options)
    except ShardlineError as e:
        raise fail(e, EXIT_FAILED if isinstance(e, GateFailed) else EXIT_USAGE) from e
    c = price_table.currency
    typer.echo(f"distilled {done.teacher} into {done.student.reference}: {done.kind} student ({done.size}), trained "
               f"on the teacher's answers for {done.rows:,} rows; lineage parent {done.teacher}")
    typer.echo(f"  golden set: {done.metric} {done.score:.4f}, the teacher {done.baseline:.4f} (change "
               f"{done.score - done.baseline:+.4f}, max_variant_delta {done.max_variant_delta}): gate variant-accuracy pass")
    typer.echo(f"  agreement with the teacher on the golden set ({done.metric}): {done.agreement:.4f}")
    typer.echo(f"  cost on this machine, one CPU thread priced as one core at {per_core_hour:g} {c}/core-hour "
               "(cost per 1k rows = price / 3600 / rows per s x 1000):")
    for role, reference, rate in (("teacher", done.teacher, done.teacher_rows_per_s),
                                  ("student", done.student.reference, done.student_rows_per_s)):
        typer.echo(f"    {role} {reference:<24} {rate:>12,.0f} rows/s  {cost_per_1k_rows(per_core_hour, rate):.3g} "
                   f"{c} per 1k rows")
    typer.echo(f"  the student scores {done.student_rows_per_s / done.teacher_rows_per_s:.1f}x the teacher's rows per "
               "second")
    if done.new:
        announce(done.student, "model distill")


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


def _placement_workload(p99_ms: float | None, rps: float | None, rows_per_s: float | None) -> Any:
    """The workload ``model place`` was asked about: online (--p99-ms with --rps) or batch (--rows-per-s), each
    number finite and above 0.

    Raises:
        InvalidSetting: neither workload, both, half of the online one, or a number that is not above 0.
    """
    import math

    from shardline.errors import InvalidSetting
    from shardline.placement import BatchWorkload, OnlineWorkload

    online = p99_ms is not None or rps is not None
    if online == (rows_per_s is not None):
        raise InvalidSetting("give --p99-ms with --rps (an online workload), or --rows-per-s (a batch one), not both"
                             if online else "give the workload: --p99-ms with --rps (online), or --rows-per-s (batch)")
    if online and (p99_ms is None or rps is None):
        raise InvalidSetting("an online workload needs both --p99-ms and --rps")
    for flag, value in (("--p99-ms", p99_ms), ("--rps", rps), ("--rows-per-s", rows_per_s)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise InvalidSetting(f"{flag} is {value:g}; give a number above 0 (and finite)")
    if p99_ms is not None and rps is not None:
        return OnlineWorkload(p99_ms=p99_ms, rps=rps)
    return BatchWorkload(rows_per_s=rows_per_s)


@model_app.command("place")
def model_place(
    reference: str = typer.Argument(..., help="name:version or name@alias."),
    p99_ms: Optional[float] = typer.Option(None, help="Online: p99 latency target per request (ms)."),
    rps: Optional[float] = typer.Option(None, help="Online: expected requests per second."),
    rows_per_s: Optional[float] = typer.Option(None, help="Batch: throughput to sustain."),
    prices: Optional[Path] = typer.Option(None, "--prices", help=PRICES_HELP),
) -> None:
    """Choose device, variant and batch size for a workload from the version's stored profiles, each machine
    kind priced by the price table."""
    from shardline.capacity.prices import load_prices, prices_path
    from shardline.placement import candidates_from_profiles, choose_placement, placeable

    try:
        workload = _placement_workload(p99_ms, rps, rows_per_s)  # a wrong request: one line, before any reading
        registry = open_registry()
        resolved = registry.resolve(reference)
        measured = candidates_from_profiles(registry.profiles(resolved.name, resolved.version),
                                            load_prices(prices_path(prices)).per_machine_hour)
        candidates, left_out = placeable(measured, resolved.variants)
        placement = choose_placement(workload, candidates)
    except ShardlineError as e:
        raise fail(e) from e
    typer.echo(placement.reason + "".join(f"; {n}" for n in left_out))
