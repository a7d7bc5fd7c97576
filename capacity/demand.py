"""A demand file: what each model must serve, its target, and where its measured profiles come from.

``shardline plan capacity --demand demand.yaml`` reads it::

    models:
      - name: churn
        model: churn@prod          # optional: the registry version whose stored profiles are used
        demand: 400                # units/s to serve
        unit: rows/s               # rows/s, requests/s or tokens/s
        p99_ms: 20                 # online target; leave it out for a batch model (runs flat out)
        rows_per_request: 1
        min_replicas: 2
        memory_gb: 6               # memory one replica takes (device memory on a GPU)
        variants: [int8]           # precision variants whose profiles may be offered besides fp32
        profiles:                  # inline profiles, by machine kind, beside (and over) the registry's
          cuda-nvidia-h200: {throughput: 900}
    hardware: {...}                # optional: a catalogue (shardline.capacity.hardware.Hardware)
    groups:                        # optional: hardware class -> replica group of the overlay (--kustomize)
      h200-mig-2g.35gb: mig-2g

A profile is either one ``shardline model profile`` stores (``batches`` of measured batch sizes, judged against
the model's target by ``shardline.placement.replica_capacity``) or ``{throughput: N}``: the rate one replica
sustains within the target, measured elsewhere (tokens/s from a load generator). Pure: the caller reads the file
and the registry and hands both in.
"""

from __future__ import annotations

from difflib import get_close_matches
from typing import Any, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shardline.capacity.hardware import Hardware
from shardline.capacity.problem import ModelDemand, Offer, PackingProblem, Unit, offers_from_profiles
from shardline.errors import InvalidSetting, yaml_problem
from shardline.machines import CPU_MACHINE
from shardline.placement import BatchWorkload, OnlineWorkload, PlacementPolicy, Workload

# The replica groups deploy/k8s/components/production runs (docs/kubernetes.md): hardware class -> group.
DEFAULT_GROUPS: dict[str, str] = {
    "h200": "gpu",
    "h200-mig-1g.18gb": "mig-1g",
    "h200-mig-3g.71gb": "mig-3g",
    "cpu-8c": "cpu",
}


class DemandEntry(BaseModel):
    """One model of a demand file."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="The model's name in the plan.")
    model: str | None = Field(default=None, description="Registry reference whose stored profiles are used.")
    demand: float = Field(gt=0, description="Units per second to serve.")
    unit: Unit = "rows/s"
    p99_ms: float | None = Field(default=None, gt=0, description="Online: p99 latency target; absent: batch.")
    rows_per_request: int = Field(default=1, ge=1)
    min_replicas: int = Field(default=1, ge=0)
    memory_gb: float = Field(gt=0, description="Memory one replica takes.")
    variants: list[str] = Field(default_factory=list)
    profiles: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @property
    def target(self) -> str:
        """The target as a person reads it."""
        return f"p99 <= {self.p99_ms:g} ms" if self.p99_ms is not None else "batch"

    def workload(self) -> Workload | None:
        """The placement workload its measured profiles are judged against (None for tokens/s: only given
        throughputs apply)."""
        if self.unit == "tokens/s":
            return None
        rows_per_s = self.demand * (self.rows_per_request if self.unit == "requests/s" else 1)
        if self.p99_ms is None:
            return BatchWorkload(rows_per_s=rows_per_s)
        return OnlineWorkload(p99_ms=self.p99_ms, rps=rows_per_s / self.rows_per_request,
                              rows_per_request=self.rows_per_request)

    def as_demand(self) -> ModelDemand:
        """The packer's view of it."""
        return ModelDemand(name=self.name, demand=self.demand, unit=self.unit, min_replicas=self.min_replicas,
                           memory_gb=self.memory_gb, target=self.target)


class DemandFile(BaseModel):
    """A demand file: models, and optionally the hardware catalogue and the overlay's replica groups."""

    model_config = ConfigDict(extra="forbid")

    models: list[DemandEntry] = Field(min_length=1)
    hardware: Hardware | None = None
    groups: dict[str, str] = Field(default_factory=dict, description="Hardware class -> replica group name.")

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: list[DemandEntry]) -> list[DemandEntry]:
        seen: dict[str, int] = {}
        for i, entry in enumerate(models):
            if entry.name in seen:
                raise ValueError(f"models.{i}.name {entry.name!r} is models.{seen[entry.name]}'s name too; give each "
                                 "model its own name (the plan's groups are by name)")
            seen[entry.name] = i
        return models

    def replica_groups(self) -> dict[str, str]:
        """Hardware class -> replica group: the production overlay's, with this file's over them."""
        return {**DEFAULT_GROUPS, **self.groups}


def _first_error(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "the file"
    return f"{where}: {str(first['msg']).removeprefix('Value error, ')}"


def _yaml(text: str, source: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise InvalidSetting(f"{source} is not YAML ({yaml_problem(e)}); fix its syntax") from e


def parse_demand(text: str, source: str = "the demand file") -> DemandFile:
    """A demand file's YAML text, checked.

    Raises:
        InvalidSetting: not YAML, or a field missing or wrong (named, with what to do).
    """
    data = _yaml(text, source)
    if not isinstance(data, dict):
        raise InvalidSetting(f"{source} must be a mapping with a 'models' list; see docs/cost.md, 'plan capacity'")
    try:
        return DemandFile.model_validate(data)
    except ValidationError as e:
        raise InvalidSetting(f"{source}: {_first_error(e)}; see docs/cost.md, 'plan capacity', for the fields") from e


def parse_hardware(text: str, source: str = "the hardware file") -> Hardware:
    """A hardware catalogue's YAML text (``gpus`` and ``cpu_nodes``), checked.

    Raises:
        InvalidSetting: not YAML, or a field missing or wrong.
    """
    try:
        return Hardware.model_validate(_yaml(text, source))
    except ValidationError as e:
        raise InvalidSetting(f"{source}: {_first_error(e)}; it holds 'gpus' and 'cpu_nodes' lists") from e


def _machine_known(name: str, kinds: set[str]) -> bool:
    """A machine kind of the catalogue (``cuda-nvidia-h200[-mig-1g.18gb]``, any ``cpu-<arch>-<N>c``), or one with a
    precision variant's ``.variant`` after it (a registry key)."""
    bare = [name, name.rsplit(".", 1)[0]]
    return any(n in kinds or CPU_MACHINE.match(n) for n in bare)


def check_profile_kinds(demand: DemandFile, hardware: Hardware) -> None:
    """Refuse a demand file's inline profile under a machine kind the catalogue does not have (a typo would be
    ignored without a word, and the model planned from another machine's profile or none).

    Raises:
        InvalidSetting: naming the entry and the kind, the closest known kind, and the known ones.
    """
    kinds = {kind.machine_of(slot) for kind in hardware.gpus for slot in kind.slots}
    for i, entry in enumerate(demand.models):
        for key, profile in entry.profiles.items():
            machine = str(profile.get("machine", key)) if isinstance(profile, Mapping) else key
            if _machine_known(machine, kinds):
                continue
            close = get_close_matches(machine, sorted(kinds), n=1)
            meant = f"did you mean {close[0]!r}? " if close else ""
            whole = ", ".join(sorted(kind.machine for kind in hardware.gpus)) or "none"
            raise InvalidSetting(
                f"models.{i}.profiles: {machine!r} ({entry.name}) is not a machine kind of the hardware catalogue; "
                f"{meant}machine kinds: {whole} (a MIG slice: add -mig-<profile>, e.g. -mig-1g.18gb), or "
                "cpu-<arch>-<cores>c; correct the key (`shardline model profile` prints the kind it measured on)"
            )


def build_problem(
    demand: DemandFile,
    hardware: Hardware,
    stored_profiles: Mapping[str, Mapping[str, Mapping[str, Any]]],
    *,
    classes: set[str] | None = None,
    policy: PlacementPolicy | None = None,
) -> PackingProblem:
    """The packing problem of a demand file (pure).

    Args:
        demand: the file.
        hardware: the catalogue to pack onto.
        stored_profiles: model name -> the registry's profiles of its version (machine kind -> profile); a
            demand entry's inline profiles are laid over them.
        classes: hardware classes the plan may use (None: every class of the catalogue).
        policy: the placement policy the offers are judged with.

    Raises:
        InvalidSetting: an inline profile under a machine kind the catalogue does not have.
    """
    check_profile_kinds(demand, hardware)
    models, offers = [], []
    for entry in demand.models:
        model = entry.as_demand()
        profiles = {**stored_profiles.get(entry.name, {}), **entry.profiles}
        found: list[Offer] = offers_from_profiles(
            model, entry.workload(), profiles, hardware, policy=policy, variants=tuple(entry.variants),
            per_unit=entry.rows_per_request if entry.unit == "requests/s" else 1.0,
        )
        models.append(model)
        offers += [o for o in found if classes is None or o.hardware_class in classes]
    return PackingProblem(hardware=hardware, models=models, offers=offers)
