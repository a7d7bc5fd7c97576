"""The hardware a capacity plan packs onto: GPU kinds with their MIG profiles, CPU node types, their prices.

A GPU is used whole or partitioned into MIG slices. A MIG layout is valid when its slices' placements do not
overlap on the GPU's 8 memory slices and their compute adds up to at most 7 (NVIDIA's MIG user guide,
"Supported MIG Profiles": the placements below are those ``nvidia-smi mig -lgipp`` lists for the 7-compute,
8-memory-slice GPUs, A100, H100 and H200 alike). ``GpuKind.layouts`` enumerates every maximal valid layout;
a slice left empty costs nothing, so only maximal layouts are worth offering to the solver.

The hardware classes a replica can take are named ``h200`` (a whole GPU), ``h200-mig-1g.18gb`` (a slice of
that profile) and a CPU node type's name (``cpu-8c``). A class's profiles are measured on the machine kind
``shardline.machines.machine_kind`` names: ``cuda-nvidia-h200``, ``cuda-nvidia-h200-mig-1g.18gb``,
``cpu-x86_64-8c``.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shardline.errors import InvalidSetting

if TYPE_CHECKING:
    from shardline.capacity.prices import PriceTable

MEMORY_SLICES, COMPUTE_SLICES = 8, 7


class MigProfile(BaseModel):
    """One MIG profile of a GPU kind: its compute slices, memory, and where on the GPU it may start."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(description="The profile as the GPU operator names it, e.g. '1g.18gb'.")
    compute: int = Field(ge=1, le=COMPUTE_SLICES, description="Compute slices (the 'g' of the name).")
    memory_gb: float = Field(gt=0, description="Memory of one slice of this profile.")
    size: int = Field(ge=1, le=MEMORY_SLICES, description="Memory slices one instance occupies.")
    starts: tuple[int, ...] = Field(description="Memory-slice indices an instance may start at.")

    @property
    def fraction(self) -> float:
        """The share of its GPU one slice is priced at: its compute slices of the GPU's seven."""
        return self.compute / COMPUTE_SLICES


def _profiles(memory: tuple[str, str, str, str, str, str]) -> tuple[MigProfile, ...]:
    """The six profiles of a 7-compute, 8-memory-slice GPU, named by their memory ('18gb', '35gb', ...)."""
    one, one_wide, two, three, four, seven = memory
    shapes = (
        (f"1g.{one}", 1, 1, (0, 1, 2, 3, 4, 5, 6)),
        (f"1g.{one_wide}", 1, 2, (0, 2, 4, 6)),
        (f"2g.{two}", 2, 2, (0, 2, 4)),
        (f"3g.{three}", 3, 4, (0, 4)),
        (f"4g.{four}", 4, 4, (0,)),
        (f"7g.{seven}", 7, 8, (0,)),
    )
    return tuple(
        MigProfile(name=name, compute=compute, memory_gb=float(name.split(".")[1].removesuffix("gb")), size=size,
                   starts=starts)
        for name, compute, size, starts in shapes
    )


H100_MIG = _profiles(("10gb", "20gb", "20gb", "40gb", "40gb", "80gb"))
H200_MIG = _profiles(("18gb", "35gb", "35gb", "71gb", "71gb", "141gb"))
MIG_PROFILES = {"h100": H100_MIG, "h200": H200_MIG}  # the GPU kinds of ``default_hardware`` by name
MIG_MARK = "-mig-"


def split_class(hardware_class: str) -> tuple[str, str | None]:
    """A hardware class's GPU kind (or CPU type) and MIG profile: 'h100-mig-3g.40gb' -> ('h100', '3g.40gb'),
    'h200' -> ('h200', None) (``GpuKind.class_name`` the other way)."""
    kind, mark, profile = hardware_class.partition(MIG_MARK)
    return (kind, profile) if mark else (hardware_class, None)

Layout = tuple[str, ...]  # slot names of one GPU, sorted: ("whole",) or MIG profile names
WHOLE = "whole"
CapacityType = Literal["on-demand", "spot"]


def _price(name: str, on_demand: float, spot: float | None, capacity: CapacityType) -> float:
    if capacity == "on-demand":
        return on_demand
    if spot is None:
        raise InvalidSetting(
            f"hardware {name!r} has no spot price; give it spot_price_per_hour in the hardware catalogue, "
            "or compare on-demand only"
        )
    return spot


class GpuKind(BaseModel):
    """A kind of GPU the plan may use, its price, and how it may be partitioned."""

    name: str = Field(description="Short name, the prefix of its hardware classes: 'h200'.")
    machine: str = Field(description="Machine kind its whole-GPU profiles are stored under: 'cuda-nvidia-h200'.")
    product: str = Field(description="The node label nvidia.com/gpu.product of its nodes: 'NVIDIA-H200'.")
    memory_gb: float = Field(gt=0, description="Memory of the whole GPU.")
    price_per_hour: float = Field(gt=0, description="Price of one GPU per hour (whole or partitioned), on demand.")
    spot_price_per_hour: float | None = Field(default=None, gt=0, description="Its spot price; None: no spot.")
    gpus_per_node: int = Field(default=8, ge=1, description="GPUs on one node of this kind.")
    billing: Literal["gpu", "node"] = Field(
        default="gpu", description="gpu: pay for the GPUs used; node: nodes come whole (gpus_per_node each)."
    )
    max_gpus: int | None = Field(default=None, ge=0, description="GPUs of this kind to be had at most.")
    mig: tuple[MigProfile, ...] = Field(default=(), description="MIG profiles; empty: whole GPUs only.")

    def price(self, capacity: CapacityType = "on-demand") -> float:
        """One GPU's price per hour on demand or on spot.

        Raises:
            InvalidSetting: spot asked and this kind has no spot price.
        """
        return _price(self.name, self.price_per_hour, self.spot_price_per_hour, capacity)

    def class_name(self, slot: str) -> str:
        """The hardware class of a slot of this kind: 'h200' (whole) or 'h200-mig-1g.18gb'."""
        return self.name if slot == WHOLE else f"{self.name}{MIG_MARK}{slot}"

    def machine_of(self, slot: str) -> str:
        """The machine kind a slot's profiles are measured on: 'cuda-nvidia-h200[-mig-1g.18gb]'."""
        return self.machine if slot == WHOLE else f"{self.machine}-mig-{slot}"

    def slot_memory_gb(self, slot: str) -> float:
        """Memory of a slot: the whole GPU's, or its MIG profile's."""
        return self.memory_gb if slot == WHOLE else self.profile(slot).memory_gb

    def slot_compute(self, slot: str) -> int:
        """Compute slices of a slot (7 for the whole GPU)."""
        return COMPUTE_SLICES if slot == WHOLE else self.profile(slot).compute

    def profile(self, name: str) -> MigProfile:
        """The MIG profile of that name.

        Raises:
            InvalidSetting: this kind has no such profile.
        """
        for p in self.mig:
            if p.name == name:
                return p
        raise InvalidSetting(
            f"GPU kind {self.name!r} has no MIG profile {name!r}; its profiles are {[p.name for p in self.mig]}"
        )

    @property
    def slots(self) -> tuple[str, ...]:
        """Every slot a replica can take on this kind: the whole GPU, then each MIG profile."""
        return (WHOLE, *(p.name for p in self.mig))

    @cached_property
    def layouts(self) -> tuple[Layout, ...]:
        """Every way to use one GPU: whole, or a maximal valid MIG layout (sorted, without repeats)."""
        return ((WHOLE,), *maximal_layouts(self.mig))


def _placements(profiles: tuple[MigProfile, ...]) -> list[tuple[str, int, int, int]]:
    """(profile, compute, first memory slice, end) for every placement of every profile."""
    return [(p.name, p.compute, s, s + p.size) for p in profiles for s in p.starts]


def maximal_layouts(profiles: tuple[MigProfile, ...]) -> list[Layout]:
    """Every multiset of MIG profiles that fits one GPU (placements apart, compute <= 7) and to which no
    further slice fits; sorted by name within a layout, layouts in a stable order."""
    placements = sorted(_placements(profiles), key=lambda p: (p[2], p[0]))
    found: set[Layout] = set()

    def extend(chosen: list[tuple[str, int, int, int]], used: frozenset[int], compute: int, after: int) -> None:
        grew = False
        for i in range(after, len(placements)):
            name, g, start, end = placements[i]
            if compute + g > COMPUTE_SLICES or used & set(range(start, end)):
                continue
            grew = True
            extend([*chosen, placements[i]], used | set(range(start, end)), compute + g, i + 1)
        if not grew and chosen and not _can_grow(placements, used, compute):
            found.add(tuple(sorted(p[0] for p in chosen)))

    extend([], frozenset(), 0, 0)
    layouts = sorted(found, key=lambda layout: (-len(layout), layout))
    return [layout for layout in layouts if not any(_dominates(other, layout) for other in layouts)]


def _can_grow(placements: list[tuple[str, int, int, int]], used: frozenset[int], compute: int) -> bool:
    return any(compute + g <= COMPUTE_SLICES and not used & set(range(s, e)) for _, g, s, e in placements)


def _dominates(big: Layout, small: Layout) -> bool:
    """Whether ``big`` holds every slot of ``small`` and more (then ``small`` is never worth choosing)."""
    if big == small:
        return False
    rest = list(big)
    for slot in small:
        if slot not in rest:
            return False
        rest.remove(slot)
    return True


class CpuNodeType(BaseModel):
    """A kind of CPU node: its cores, memory and price."""

    name: str = Field(description="The hardware class and node pool name, e.g. 'cpu-8c'.")
    arch: str = Field(default="x86_64", description="CPU architecture; profiles measured on 'cpu-<arch>-<N>c' apply.")
    cores: int = Field(ge=1)
    memory_gb: float = Field(gt=0)
    price_per_hour: float = Field(gt=0, description="Price of one node per hour, on demand.")
    spot_price_per_hour: float | None = Field(default=None, gt=0, description="Its spot price; None: no spot.")
    max_nodes: int | None = Field(default=None, ge=0, description="Nodes of this type to be had at most.")

    def price(self, capacity: CapacityType = "on-demand") -> float:
        """One node's price per hour on demand or on spot.

        Raises:
            InvalidSetting: spot asked and this type has no spot price.
        """
        return _price(self.name, self.price_per_hour, self.spot_price_per_hour, capacity)


class Hardware(BaseModel):
    """The catalogue a plan may use."""

    gpus: list[GpuKind] = Field(default_factory=list)
    cpu_nodes: list[CpuNodeType] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_names(self) -> "Hardware":
        names = [g.name for g in self.gpus] + [c.name for c in self.cpu_nodes]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"hardware names must be unique; {twice} appear more than once")
        return self

    def gpu(self, name: str) -> GpuKind:
        """The GPU kind of that name.

        Raises:
            InvalidSetting: there is none.
        """
        for kind in self.gpus:
            if kind.name == name:
                return kind
        raise InvalidSetting(f"no GPU kind {name!r} in the hardware catalogue; it has {[g.name for g in self.gpus]}")


def default_hardware(prices: PriceTable) -> Hardware:
    """H100 and H200 GPUs (8 to a node, with their MIG profiles) and two CPU node types (8 and 32 cores), priced
    by the price table (``shardline.capacity.prices``, the one `shardline cost report` charges with): a GPU at
    its class's price per GPU-hour, a CPU node at ``cpu``'s price per core-hour times its cores, on demand and on
    spot. A GPU kind (or the CPU nodes) the table does not price is left out of the catalogue.

    Raises:
        InvalidSetting: the table prices none of h100, h200 and cpu.
    """

    def hourly(name: str, times: int = 1) -> tuple[float, float]:
        return times * prices.per_unit_hour(name, "on-demand"), times * prices.per_unit_hour(name, "spot")

    gpus = [GpuKind(name=name, machine=machine, product=product, memory_gb=memory, mig=MIG_PROFILES[name],
                    price_per_hour=hourly(name)[0], spot_price_per_hour=hourly(name)[1])
            for name, machine, product, memory in (("h100", "cuda-nvidia-h100-80gb-hbm3", "NVIDIA-H100-80GB-HBM3", 80),
                                                   ("h200", "cuda-nvidia-h200", "NVIDIA-H200", 141))
            if name in prices.classes]
    cpu_nodes = ([CpuNodeType(name=f"cpu-{cores}c", cores=cores, memory_gb=4 * cores,
                              price_per_hour=hourly("cpu", cores)[0], spot_price_per_hour=hourly("cpu", cores)[1])
                  for cores in (8, 32)] if "cpu" in prices.classes else [])
    if not gpus and not cpu_nodes:
        raise InvalidSetting(
            f"{prices.source or 'the price table'} prices none of the hardware a plan packs onto (h100, h200, cpu; "
            f"it prices {sorted(prices.classes)}); add them, or give the plan a hardware catalogue (--hardware)")
    return Hardware(gpus=gpus, cpu_nodes=cpu_nodes)
