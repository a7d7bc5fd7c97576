"""`shardline rollout ...`: start, status, promote, abort (docs/routing.md, "Rollouts")."""

from __future__ import annotations

import json
from typing import Any, Optional

import typer

from shardline.cli.common import ALIAS_HELP, EXIT_FAILED, fail, model_and_alias, open_registry
from shardline.errors import InvalidSetting, ShardlineError

rollout_app = typer.Typer(help="Canary and shadow rollouts of a new version behind the router.", no_args_is_help=True)

# The live rollback criteria, as `rollout start` and `model release` take them (storage/rollouts.RollbackCriteria).
WINDOW = typer.Option(None, help="Rollback window (default 60s).")
MIN_REQUESTS = typer.Option(None, help="Candidate answers needed before any verdict (default 50).")
MAX_ERROR_INCREASE = typer.Option(None, help="Roll back past the baseline's error share plus this (default 0.01).")
MAX_P99_RATIO = typer.Option(None, help="Roll back past the baseline's p99 times this, plus 5 ms (default 1.5).")


# Each criterion's option, to name it when its value is out of the range RollbackCriteria allows.
CRITERIA_OPTIONS = {"window_s": "--window", "min_requests": "--min-requests", "max_error_increase": "--max-error-increase",
                    "max_p99_ratio": "--max-p99-ratio", "max_disagreement": "--max-disagreement"}


def rollback_criteria(window: str | None, min_requests: int | None, max_error_increase: float | None,
              max_p99_ratio: float | None, max_disagreement: float | None) -> dict[str, Any]:
    """The criteria given on the command line (the rest stay at their defaults), checked before anything runs.

    Raises:
        InvalidSetting: a value out of its range, naming the option and the range.
    """
    from pydantic import ValidationError

    from shardline.storage.rollouts import RollbackCriteria, parse_duration

    given = {"window_s": parse_duration(window) if window else None, "min_requests": min_requests,
             "max_error_increase": max_error_increase, "max_p99_ratio": max_p99_ratio,
             "max_disagreement": max_disagreement}
    given = {k: v for k, v in given.items() if v is not None}
    try:
        RollbackCriteria(**given)
    except ValidationError as e:
        field = str(e.errors()[0]["loc"][0])
        raise InvalidSetting(f"{CRITERIA_OPTIONS[field]} {given[field]:g} is out of range: it must be "
                             f"{_allowed(RollbackCriteria, field)}") from e
    return given


def _allowed(model: Any, field: str) -> str:
    """The range a pydantic field allows, in words: "at least 1 (default 50)"."""
    info = model.model_fields[field]
    words = {"ge": "at least", "gt": "above", "le": "at most", "lt": "below"}
    limits = [f"{words[k]} {getattr(m, k):g}" for m in info.metadata for k in words if hasattr(m, k)]
    return f"{' and '.join(limits)} (default {info.default:g})"


def warn_unreachable_steps(registry: Any, name: str, alias: str, steps: list[float], criteria: dict[str, Any]) -> None:
    """One warning line (stderr) when a canary's steps cannot reach their minimum answers at the traffic the
    routers last saw on the alias, or the rule when they saw none (``storage.rollouts.reach_warning``)."""
    from shardline.storage.rollouts import RollbackCriteria, observed_traffic, reach_warning

    warning = reach_warning(f"{name}@{alias}", tuple(steps), RollbackCriteria(**criteria),
                            observed_traffic(registry, name, alias))
    if warning is not None:
        typer.secho(f"warning: {warning}", fg="yellow", err=True)


def _candidate_version(name: str, candidate: str) -> int:
    """The version ``candidate`` (``VERSION`` or ``name:VERSION``) names of the model ``name``."""
    from shardline.bundle import ModelRef, check_model_name

    check_model_name(name)  # a wrong name says so, not that the candidate is wrong
    wrong = f"the candidate {candidate!r} is not a version of {name!r}; write {name}:VERSION"
    try:
        ref = ModelRef.parse(candidate if ":" in candidate else f"{name}:{candidate}")
    except InvalidSetting as e:
        raise InvalidSetting(wrong) from e
    if ref.name != name or ref.version is None:
        raise InvalidSetting(wrong)
    return ref.version


@rollout_app.command("start")
def rollout_start(
    name: str = typer.Argument(..., help="Model name (or name@alias)."),
    candidate: str = typer.Option(..., help="The version to roll out: name:version (or just the version)."),
    alias: str = typer.Option("prod", help="The alias whose traffic it takes; or write the model as name@alias."),
    steps: Optional[str] = typer.Option(None, help="Canary: percents of callers, step by step, e.g. 1,5,25,100."),
    interval: Optional[str] = typer.Option(
        None, help="Canary: how long each step lasts before the next (then promotion), e.g. 10m; "
        "leave out to hold the first step until `rollout promote`."),
    shadow: Optional[str] = typer.Option(None, help="Shadow instead: the share of requests mirrored, e.g. 10%."),
    window: Optional[str] = WINDOW,
    min_requests: Optional[int] = MIN_REQUESTS,
    max_error_increase: Optional[float] = MAX_ERROR_INCREASE,
    max_p99_ratio: Optional[float] = MAX_P99_RATIO,
    max_disagreement: Optional[float] = typer.Option(
        None, help="Shadow: roll back past this share of disagreeing rows (default 0.01)."),
    reason: str = typer.Option("", help="Why, for the audit log."),
) -> None:
    """Run the promotion gates and an offline replay, then start the rollout (a Prefect flow); the routers do
    the rest."""
    from shardline.cli.prefect_commands import use_prefect_api
    from shardline.errors import InvalidSetting
    from shardline.storage.rollouts import check_start, parse_duration, parse_share, parse_steps

    name, alias = model_and_alias(name, alias)
    try:
        if (steps is None) == (shadow is None):
            raise InvalidSetting("give --steps 1,5,25,100 (a canary) or --shadow 10% (a shadow), one of them")
        if shadow is not None and interval is not None:
            raise InvalidSetting("a shadow rollout has no steps: leave out --interval, and promote it by hand")
        version = _candidate_version(name, candidate)
        canary = list(parse_steps(steps)) if steps is not None else None  # --steps '' is a wrong list, not none
        criteria = rollback_criteria(window, min_requests, max_error_increase, max_p99_ratio, max_disagreement)
        parameters = {
            "candidate": f"{name}:{version}", "alias": alias, "mode": "shadow" if shadow else "canary",
            "steps": canary, "shadow": parse_share(shadow) if shadow else 0.0,
            "interval_s": parse_duration(interval) if interval else None, "reason": reason, "criteria": criteria,
        }
        registry = open_registry()
        check_start(registry, name, alias, version)  # said before the gates run (the flow checks again)
        if canary:
            warn_unreachable_steps(registry, name, alias, canary, criteria)
        use_prefect_api()
    except ShardlineError as e:
        raise fail(e) from e
    from shardline.flows.rollout import start_rollout

    state = start_rollout(**parameters, return_state=True)
    result = state.result(raise_on_failure=False)
    if isinstance(result, BaseException):
        raise fail(result, EXIT_FAILED)
    for gate in result["gates"]:
        typer.echo(f"  gate {gate['gate']:<18} pass  {gate['detail']}")
    for source, found in result["replay"].items():
        typer.echo(f"  replay {source:<16} {_replay_line(found)}")
    rollout = result["rollout"]
    typer.echo(f"{name}@{alias}: rollout {rollout.id} started: {rollout.describe()} (record {result['record']})")


def _replay_line(found: dict[str, Any]) -> str:
    if not found.get("rows"):
        return found.get("note", found.get("skipped", "nothing to replay"))
    agreement = found.get("label_agreement")
    labels = f", labels agree on {agreement:.1%}" if agreement is not None else ""
    return (f"{found['compared']} of {found['rows']} rows compared, {found['disagreement']:.1%} disagree{labels}, "
            f"largest delta {found['max_delta']:.3g}")


@rollout_app.command("status")
def rollout_status(
    name: str = typer.Argument(..., help="Model name (or name@alias)."),
    alias: str = typer.Option("prod", help=ALIAS_HELP),
    json_out: bool = typer.Option(False, "--json", help="Print the rollout record and the routers' reports as JSON."),
) -> None:
    """Where the rollout on name@alias stands (or how the last one ended), and what each router saw."""
    from shardline.storage.rollouts import active

    name, alias = model_and_alias(name, alias)
    try:
        registry = open_registry()
        registry.require_model(name)  # an unknown model is a wrong request, not "no rollout has run"
        history = registry.alias_history(name, alias)
    except ShardlineError as e:
        raise fail(e) from e
    last = next((m for m in reversed(history) if m.rollout is not None), None)
    if last is None or last.rollout is None:
        where = f"it points at {name}:{history[-1].version}" if history else "the alias is not set"
        typer.echo(f"no rollout has run on {name}@{alias} ({where})")
        return
    rollout = last.rollout
    running = active(history[-1]) is not None and history[-1].rollout is not None and history[-1].rollout.id == rollout.id
    reports = registry.rollout_reports(name, rollout.id)
    steps = [m for m in history if m.rollout is not None and m.rollout.id == rollout.id]
    if json_out:
        typer.echo(json.dumps({"running": running, "rollout": rollout.model_dump(mode="json"),
                               "records": [m.model_dump(mode="json", exclude={"rollout"}) for m in steps],
                               "reports": reports}, indent=2, default=str))
        return
    state = "running" if running else {"promote": "promoted", "rollback": "rolled back"}.get(last.action, last.action)
    typer.echo(f"{name}@{alias}: rollout {rollout.id} {state}: {rollout.describe()} (baseline {name}:{rollout.baseline})")
    for move in steps:
        typer.echo(f"  {move.seq:>4}  {move.at:%Y-%m-%d %H:%M:%S}  {move.action:<8} {name}:{move.version:<4} by "
                   f"{move.by:<12} {move.reason}")
    for source, report in sorted(reports.items()):
        base, cand = report.get("baseline", {}), report.get("candidate", {})
        line = (f"  {source}: {report.get('verdict')} ({report.get('reason')}); baseline {base.get('requests')} answers "
                f"{base.get('error_rate', 0):.1%} errors, candidate {cand.get('requests')} answers "
                f"{cand.get('error_rate', 0):.1%} errors")
        shadow = report.get("shadow")
        if shadow:
            line += f"; shadow {shadow['rows']} rows compared, {shadow['disagreement']:.1%} disagree"
        typer.echo(line + f" (at {report.get('at')})")


def _end(name: str, alias: str, action: str, reason: str) -> None:
    from shardline.cli.prefect_commands import use_prefect_api
    from shardline.errors import RolloutConflict
    from shardline.storage.rollouts import active

    name, alias = model_and_alias(name, alias)
    try:
        registry = open_registry()
        registry.require_model(name)  # an unknown model is said as such, not as "no rollout runs"
        if active(registry.current_move(name, alias)) is None:  # said before any flow starts
            raise RolloutConflict(f"no rollout runs on {name}@{alias} (see `shardline rollout status {name} --alias "
                                  f"{alias}`)")
        use_prefect_api()
    except ShardlineError as e:
        raise fail(e) from e
    from shardline.flows.rollout import end_rollout

    state = end_rollout(name=name, alias=alias, action=action, reason=reason, return_state=True)
    move = state.result(raise_on_failure=False)
    if isinstance(move, BaseException):
        raise fail(move, EXIT_FAILED)
    typer.echo(f"{name}@{alias} -> {name}:{move.version}: {move.reason}")


@rollout_app.command("promote")
def rollout_promote(
    name: str = typer.Argument(..., help="Model name (or name@alias)."),
    alias: str = typer.Option("prod", help=ALIAS_HELP),
    reason: str = typer.Option("", help="Why, for the audit log."),
) -> None:
    """Promote the candidate now: the alias points at it and the rollout ends."""
    name, alias = model_and_alias(name, alias)
    _end(name, alias, "promote", reason)


@rollout_app.command("abort")
def rollout_abort(
    name: str = typer.Argument(..., help="Model name (or name@alias)."),
    alias: str = typer.Option("prod", help=ALIAS_HELP),
    reason: str = typer.Option("", help="Why, for the audit log."),
) -> None:
    """Stop the rollout: every caller goes back to the baseline."""
    name, alias = model_and_alias(name, alias)
    _end(name, alias, "abort", reason)
