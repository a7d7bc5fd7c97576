"""`shardline plan capacity`: pack every model's replicas onto nodes, whole GPUs and MIG slices at least cost,
print the plan beside its lower bound and one model per GPU, and write it (YAML) and a kustomize Component."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from shardline.cli.common import PRICES_HELP, fail
from shardline.errors import InvalidSetting, ShardlineError

plan_app = typer.Typer(help="Plans: the capacity the models' demand needs, and what it costs.", no_args_is_help=True)


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise InvalidSetting(f"cannot read the {what} {str(path)!r} ({e.strerror}); give a readable file") from e


def _stored_profiles(demand: Any) -> dict[str, dict[str, dict[str, Any]]]:
    """The registry's profiles of each model that names a version (``model:``); none opened without one."""
    named = [entry for entry in demand.models if entry.model]
    if not named:
        return {}
    from shardline.cli.common import open_registry

    registry = open_registry()
    found = {}
    for entry in named:
        resolved = registry.resolve(entry.model)
        found[entry.name] = registry.profiles(resolved.name, resolved.version)
    return found


def _summary(plan: Any) -> list[str]:
    from shardline.figures import amount

    gpus = ", ".join(f"{k}: {n}" for k, n in sorted(plan.gpus.items())) or "none"
    nodes = ", ".join(f"{k}: {n}" for k, n in sorted(plan.cpu_nodes.items())) or "none"
    base = plan.baseline
    lines = [
        f"plan ({plan.status}): {plan.cost_per_hour:.2f}/h; GPUs {plan.gpu_count} ({gpus}); CPU nodes {nodes}",
        f"  lower bound (LP relaxation): {plan.lower_bound:.2f}/h; the plan costs "
        f"{plan.cost_per_hour / plan.lower_bound if plan.lower_bound else 1:.3f}x the bound",
        f"  one model per GPU: {base.cost_per_hour:.2f}/h, {base.gpus} GPUs, {base.cpu_nodes} CPU nodes; the plan "
        f"costs {plan.cost_per_hour / base.cost_per_hour if base.cost_per_hour else 1:.3f}x"
        + (f", {1 - plan.gpu_count / base.gpus:.0%} fewer GPUs" if base.gpus else ""),
        "",
        f"{'model':<20} {'hardware class':<22} {'replicas':>8} {'capacity':>12} {'demand':>12}  unit",
    ]
    served = {s.model: s for s in plan.served}
    for group in plan.groups:
        wanted = served[group.model]
        lines.append(f"{group.model:<20} {group.hardware_class:<22} {group.replicas:>8} "
                     f"{amount(group.capacity):>12} {amount(wanted.demand):>12}  {wanted.unit}"
                     + ("  (slice rate estimated from the whole GPU)" if group.offer.estimated else ""))
    lines.append("")
    for node in plan.nodes:
        held = ([", ".join(f"{slot}: {model or '-'}" for slot, model in zip(gpu.layout, gpu.models))
                 for gpu in node.gpus] if node.kind == "gpu" else [", ".join(node.replicas)])
        lines.append(f"{node.name} ({node.price_per_hour:.2f}/h): " + " | ".join(f"[{h}]" for h in held))
    return lines


@plan_app.command("capacity")
def plan_capacity(
    demand: Path = typer.Option(..., "--demand", help="The demand YAML: models, demand, targets, profiles "
                                "(docs/cost.md, 'plan capacity')."),
    hardware: Optional[Path] = typer.Option(None, "--hardware", help="A hardware catalogue YAML (gpus, cpu_nodes) "
                                            "\\[default: the demand file's, else H100 and H200 with MIG and two "
                                            "CPU node types, priced by the price table (--prices)]."),
    prices: Optional[Path] = typer.Option(None, "--prices", help=PRICES_HELP),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the plan as YAML here."),
    kustomize: Optional[Path] = typer.Option(None, "--kustomize", help="Write a kustomize Component here (replica "
                                             "counts and resources of the overlay's replica groups); the plan then "
                                             "uses only hardware classes a group runs."),
    time_limit: float = typer.Option(30.0, "--time-limit", min=0.1, help="Seconds the solver may search."),
) -> None:
    """Pack the models' replicas onto nodes, whole GPUs and MIG slices at least cost.

    Prints the plan beside the LP lower bound and one model per GPU. Exit codes: 0 planned, 2 the demand,
    hardware or profiles were wrong or no plan fits (one line says what and what to change).
    """
    import yaml

    from shardline.capacity.demand import build_problem, parse_demand, parse_hardware
    from shardline.capacity.hardware import default_hardware
    from shardline.capacity.kustomize import component_files
    from shardline.capacity.packing import PackingPolicy, pack
    from shardline.capacity.prices import load_prices, prices_path

    try:
        parsed = parse_demand(_read(demand, "demand file"), str(demand))
        catalogue = (parse_hardware(_read(hardware, "hardware file"), str(hardware)) if hardware
                     else parsed.hardware or default_hardware(load_prices(prices_path(prices))))
        groups = parsed.replica_groups()
        problem = build_problem(parsed, catalogue, _stored_profiles(parsed),
                                classes=set(groups) if kustomize else None)
        plan = pack(problem, PackingPolicy(time_limit_s=time_limit))
        files = component_files(plan, catalogue, groups) if kustomize else {}
    except (ShardlineError, ValueError) as e:
        raise fail(e) from e
    for line in _summary(plan):
        typer.echo(line)
    if output:
        output.write_text(yaml.safe_dump(plan.model_dump(mode="json"), sort_keys=False))
        typer.echo(f"plan written to {output}")
    if kustomize:
        kustomize.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (kustomize / name).write_text(text)
        typer.echo(f"kustomize Component written to {kustomize}/ (add it to an overlay's components)")
