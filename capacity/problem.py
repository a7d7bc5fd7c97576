"""A packing problem: what each model needs, and what one replica of it does on each hardware class.

An ``Offer`` is one way to run a replica: a hardware class (a whole GPU, a MIG slice, a CPU node type), the rate
it sustains within the model's target (from its measured profile: ``shardline.placement.replica_capacity``), the
memory and cores it takes, and the batch size and batcher wait that rate assumes. ``offers_from_profiles`` makes
them from the profiles the registry stores (``shardline.quality.model_profiles``) or that a demand file gives
inline; the packer (``shardline.capacity.packing``) chooses among them.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shardline.capacity.hardware import COMPUTE_SLICES, WHOLE, CapacityType, CpuNodeType, GpuKind, Hardware
from shardline.errors import InvalidSetting
from shardline.machines import CPU_MACHINE
from shardline.placement import (
    Candidate,
    PlacementPolicy,
    Workload,
    candidates_from_profiles,
    replica_capacity,
)

Unit = Literal["rows/s", "requests/s", "tokens/s"]


def _any_price(machine: str) -> float:
    return 1.0  # profiles become candidates; the packer prices hardware, not candidates


class Offer(BaseModel):
    """One way to run a replica of a model: a hardware class, its rate within the target, what it takes."""

    model_config = ConfigDict(frozen=True)

    model: str
    hardware_class: str = Field(description="'h200' (whole GPU), 'h200-mig-1g.18gb' (a slice), 'cpu-8c' (a node type).")
    capacity: float = Field(gt=0, description="Units/s (the model's unit) one replica sustains within its target.")
    memory_gb: float = Field(gt=0, description="Memory one replica takes: device memory on a GPU, node memory on CPU.")
    cores: float = Field(default=1.0, gt=0, description="CPU cores one replica requests.")
    variant: str = "fp32"
    batch_size: int | None = None
    max_wait_ms: float | None = Field(default=None, description="Online: the batcher's wait this capacity assumes.")
    expected_p99_ms: float | None = None
    estimated: bool = Field(default=False, description="Scaled from the whole GPU's profile, not measured on the slice.")
    measured_on: str = Field(default="", description="The machine kind the profile was measured on.")


class ModelDemand(BaseModel):
    """What one model needs: a rate in its unit, within the target its offers were made for."""

    name: str
    demand: float = Field(gt=0, description="Units per second to serve.")
    unit: Unit = "rows/s"
    min_replicas: int = Field(default=1, ge=0, description="Replicas at least (availability), whatever the demand.")
    memory_gb: float = Field(gt=0, description="Memory one replica takes.")
    memory_estimated: bool = Field(default=False, description="Memory from the model's files, not given or measured.")
    target: str = Field(default="", description="The target as a person reads it: 'p99 <= 20 ms', 'batch'.")


class PackingProblem(BaseModel):
    """The models, their offers and the hardware to pack them onto."""

    hardware: Hardware
    models: list[ModelDemand]
    offers: list[Offer]

    @model_validator(mode="after")
    def _every_model_has_an_offer(self) -> "PackingProblem":
        names = [m.name for m in self.models]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"model names must be unique in a demand; {twice} appear more than once")
        known = set(names)
        stray = sorted({o.model for o in self.offers} - known)
        if stray:
            raise ValueError(f"offers name models the demand does not have: {stray}")
        classes = hardware_classes(self.hardware)
        unknown = sorted({o.hardware_class for o in self.offers} - set(classes))
        if unknown:
            raise ValueError(f"offers name hardware classes the catalogue does not have: {unknown}")
        return self

    def offers_of(self, model: str) -> list[Offer]:
        """The offers of one model."""
        return [o for o in self.offers if o.model == model]

    def model(self, name: str) -> ModelDemand:
        """The demand of one model."""
        return next(m for m in self.models if m.name == name)


def hardware_classes(hardware: Hardware) -> dict[str, tuple[GpuKind | CpuNodeType, str]]:
    """Every hardware class of a catalogue: name -> (its GPU kind and slot, or its CPU node type and 'node')."""
    classes: dict[str, tuple[GpuKind | CpuNodeType, str]] = {}
    for kind in hardware.gpus:
        for slot in kind.slots:
            classes[kind.class_name(slot)] = (kind, slot)
    for node in hardware.cpu_nodes:
        classes[node.name] = (node, "node")
    return classes


def _scaled(c: Candidate, compute: int) -> Candidate:
    """A whole GPU's candidate as an estimate for a slice of ``compute`` sevenths: rows/s scaled down, p99 up."""
    share = compute / 7
    return c.model_copy(update={"rows_per_s": c.rows_per_s * share, "p99_ms": c.p99_ms / share})


def _best(workload: Workload, candidates: list[Candidate], policy: PlacementPolicy, per_unit: float) -> dict[str, Any] | None:
    """The candidate with the most capacity within the target, as offer fields; None when none meets it."""
    best: dict[str, Any] | None = None
    for c in candidates:
        capacity = replica_capacity(workload, c, policy)
        if capacity is None:
            continue
        fields: dict[str, Any] = {
            "capacity": capacity.rows_per_s / per_unit, "variant": c.variant, "batch_size": c.batch_size,
            "max_wait_ms": capacity.max_wait_ms, "expected_p99_ms": capacity.expected_p99_ms, "measured_on": c.machine,
        }
        if best is None or (fields["capacity"], -(fields["expected_p99_ms"] or 0)) > (
                best["capacity"], -(best["expected_p99_ms"] or 0)):
            best = fields
    return best


def _cpu_cores(machine: str, node: CpuNodeType) -> int | None:
    """Cores a replica measured on ``machine`` takes on ``node``; None when the profile does not apply to it."""
    found = CPU_MACHINE.match(machine)
    if found is None or found["arch"] != node.arch or int(found["cores"]) > node.cores:
        return None
    return int(found["cores"])


def offers_from_profiles(
    demand: ModelDemand,
    workload: Workload | None,
    profiles: Mapping[str, Mapping[str, Any]],
    hardware: Hardware,
    *,
    policy: PlacementPolicy | None = None,
    variants: tuple[str, ...] = (),
    per_unit: float = 1.0,
    estimate_slices: bool = True,
) -> list[Offer]:
    """The offers of one model on every hardware class of the catalogue (pure).

    Args:
        demand: the model (its memory decides which slots it fits).
        workload: its target (``shardline.placement``): profiles with ``batches`` are judged against it; a
            profile given as ``{"throughput": N}`` (units/s one replica sustains within its target, e.g. tokens/s
            measured by a load generator) is taken as it is.
        profiles: machine kind (or registry key) -> profile.
        hardware: the catalogue.
        policy: the placement policy (utilization headroom).
        variants: precision variants whose profiles may be offered besides fp32.
        per_unit: rows per unit of the demand (rows per request for requests/s; 1 otherwise).
        estimate_slices: offer MIG slices that were not measured, scaled from the whole GPU by compute (flagged).
    """
    policy = policy or PlacementPolicy()
    allowed = {"fp32", *variants}
    measured: dict[str, list[Candidate]] = {}
    given: dict[str, float] = {}
    for key, profile in profiles.items():
        machine = str(profile.get("machine", key))
        if "throughput" in profile:
            given[machine] = float(profile["throughput"])
            continue
        for c in candidates_from_profiles({key: profile}, _any_price):
            if c.variant in allowed:
                measured.setdefault(c.machine, []).append(c)
    offers = []
    for name, (kind, slot) in hardware_classes(hardware).items():
        fields = _offer_fields(demand, workload, kind, slot, measured, given, policy, per_unit, estimate_slices)
        if fields is not None:
            offers.append(Offer(model=demand.name, hardware_class=name, memory_gb=demand.memory_gb, **fields))
    return offers


def _offer_fields(
    demand: ModelDemand, workload: Workload | None, kind: GpuKind | CpuNodeType, slot: str,
    measured: dict[str, list[Candidate]], given: dict[str, float], policy: PlacementPolicy, per_unit: float,
    estimate_slices: bool,
) -> dict[str, Any] | None:
    if isinstance(kind, CpuNodeType):
        if demand.memory_gb > kind.memory_gb:
            return None
        for machine in sorted(set(measured) | set(given)):
            cores = _cpu_cores(machine, kind)
            if cores is None:
                continue
            fields = ({"capacity": given[machine], "measured_on": machine} if machine in given
                      else _best(workload, measured[machine], policy, per_unit) if workload else None)
            if fields is not None:
                return {**fields, "cores": float(cores)}
        return None
    if demand.memory_gb > kind.slot_memory_gb(slot):
        return None  # never over a GPU's or a slice's memory
    machine = kind.machine_of(slot)
    if machine in given:
        return {"capacity": given[machine], "measured_on": machine}
    if machine in measured and workload is not None:
        return _best(workload, measured[machine], policy, per_unit)
    if slot == WHOLE or not estimate_slices:
        return None
    compute = kind.slot_compute(slot)
    if kind.machine in given:
        return {"capacity": given[kind.machine] * compute / 7, "measured_on": kind.machine, "estimated": True}
    if kind.machine in measured and workload is not None:
        fields = _best(workload, [_scaled(c, compute) for c in measured[kind.machine]], policy, per_unit)
        return {**fields, "estimated": True} if fields else None
    return None


def check_offers(problem: PackingProblem) -> None:
    """Refuse a problem in which a model has no offer at all, saying why and what to do.

    Raises:
        InvalidSetting: naming each such model.
    """
    missing = [m for m in problem.models if not problem.offers_of(m.name)]
    if not missing:
        return
    classes = ", ".join(hardware_classes(problem.hardware))
    named = "; ".join(
        f"{m.name} (needs {m.memory_gb:g} GB a replica{', ' + m.target if m.target else ''})" for m in missing
    )
    raise InvalidSetting(
        f"no hardware class can serve {named}: none of {classes} has a profile of it that meets its target and "
        "memory to hold it; profile it on the hardware it may use (`shardline model profile`), give a profile "
        "inline in the demand file, or relax its target"
    )


def class_price(hardware: Hardware, hardware_class: str, capacity: CapacityType = "on-demand") -> float:
    """What one replica or worker of a hardware class costs per hour: a whole GPU's or a CPU node's price, a MIG
    slice its compute's share of its GPU's (3g: 3/7).

    Raises:
        InvalidSetting: no such class in the catalogue, or no spot price where spot is asked.
    """
    classes = hardware_classes(hardware)
    if hardware_class not in classes:
        raise InvalidSetting(f"no hardware class {hardware_class!r} in the catalogue; it has {sorted(classes)}")
    owner, slot = classes[hardware_class]
    if isinstance(owner, CpuNodeType):
        return owner.price(capacity)
    return owner.price(capacity) * owner.slot_compute(slot) / COMPUTE_SLICES
