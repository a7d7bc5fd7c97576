"""The price table: what one unit of a hardware class costs per hour, by capacity type (on-demand, spot).

A YAML file (``capacity/prices.yaml`` is the example, with cloud list prices)::

    currency: USD
    classes:
      cpu: {unit: core, on-demand: 0.0504, spot: 0.0202}
      h100: {unit: gpu, on-demand: 6.88, spot: 2.75}

A MIG slice's class (``h100-mig-3g.40gb``, as the capacity plan names it) is priced at its GPU's price times
the slice's fraction of the GPU (``MigProfile.fraction``: its compute slices of seven), unless the table names
the slice's class itself.

The one price table: `shardline cost report` charges the ledger with it, and the hardware catalogue
(``shardline.capacity.hardware.default_hardware``) prices its GPUs and CPU nodes from it for `shardline plan
capacity` and `shardline cost simulate`; placement's measured profiles are priced by their machine kind through
it (``PriceTable.per_machine_hour``). It lives here, not in ``shardline.cost``, because the packer may import
only the kernel and storage, and ``shardline.cost`` imports the packer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shardline.capacity.hardware import MIG_MARK, MIG_PROFILES, split_class
from shardline.errors import InvalidSetting, yaml_problem
from shardline.machines import CPU_MACHINE

EXAMPLE = Path(__file__).with_name("prices.yaml")


class ClassPrice(BaseModel):
    """One hardware class's price per unit-hour, by capacity type."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    unit: str = Field(default="unit", description="What one unit is: a core, a GPU.")
    on_demand: float = Field(alias="on-demand", ge=0)
    spot: float | None = Field(default=None, ge=0, description="Unset: spot is priced as on-demand.")


class PriceTable(BaseModel):
    """Prices per hardware class (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    currency: str = "USD"
    classes: dict[str, ClassPrice]
    source: str = Field(default="", exclude=True, description="Where the table was read from.")

    @field_validator("classes")
    @classmethod
    def _some(cls, classes: dict[str, ClassPrice]) -> dict[str, ClassPrice]:
        if not classes:
            raise ValueError("the price table names no hardware class; give at least cpu")
        return classes

    def per_unit_hour(self, hardware_class: str, capacity_type: str) -> float:
        """The price of one unit of ``hardware_class`` for an hour, bought as ``capacity_type``.

        Raises:
            InvalidSetting: the table has no price for the class (nor, for a MIG slice, for its GPU).
        """
        fraction, priced = 1.0, self.classes.get(hardware_class)
        if priced is None:
            kind, profile = split_class(hardware_class)
            if profile is not None and kind in self.classes:
                profiles = {p.name: p for p in MIG_PROFILES.get(kind, ())}
                if profile not in profiles:
                    raise InvalidSetting(
                        f"the ledger has hardware class {hardware_class!r}, but {kind!r} has no MIG profile "
                        f"{profile!r} (it has {sorted(profiles) or 'none'}); price the class itself in "
                        f"{self.source or 'the price table'}")
                fraction, priced = profiles[profile].fraction, self.classes[kind]
        if priced is None:
            raise InvalidSetting(
                f"the ledger has hardware class {hardware_class!r}, which {self.source or 'the price table'} does not "
                f"price (it prices {sorted(self.classes)}); add it, or set SHARDLINE_METERING_HARDWARE_CLASS on the "
                "servers and jobs to a class it prices")
        hourly = priced.spot if capacity_type == "spot" and priced.spot is not None else priced.on_demand
        return hourly * fraction

    def per_machine_hour(self, machine: str, capacity_type: str = "on-demand") -> float:
        """The price of one device of a machine kind (``shardline.machines.machine_kind``) for an hour: a CPU
        machine's cores at ``cpu``'s core-hour ('cpu-x86_64-8c': 8 cores); a GPU at the class its name holds
        ('cuda-nvidia-h100-80gb-hbm3': ``h100``), a MIG slice at its fraction of that GPU
        ('cuda-nvidia-h200-mig-1g.18gb': ``h200-mig-1g.18gb``). What placement (``shardline model place``, batch
        ``--variant auto``) weighs measured profiles with.

        Raises:
            InvalidSetting: a machine kind the table has no class for.
        """
        cpu = CPU_MACHINE.match(machine)
        if cpu is not None and "cpu" in self.classes:
            return self.per_unit_hour("cpu", capacity_type) * int(cpu.group("cores"))
        gpu, mark, profile = machine.removeprefix("cuda-").partition(MIG_MARK)
        words = set(gpu.split("-"))
        named = sorted((c for c in self.classes if c != "cpu" and MIG_MARK not in c and c in words), key=len)
        if not machine.startswith("cuda-") or not named:
            raise InvalidSetting(
                f"no price for machine kind {machine!r}: {self.source or 'the price table'} prices "
                f"{sorted(self.classes)}; a CPU machine is priced at class cpu's core-hour, a GPU at the class its "
                "name holds (h100 in 'cuda-nvidia-h100-80gb-hbm3'): add that class")
        return self.per_unit_hour(f"{named[-1]}{mark}{profile}" if mark else named[-1], capacity_type)


def load_prices(path: str | Path | None = None) -> PriceTable:
    """The price table in ``path`` (YAML), or the example's list prices when None.

    Raises:
        InvalidSetting: the file is missing, is not YAML, or is not a price table.
    """
    where = Path(path) if path is not None else EXAMPLE
    try:
        data: Any = yaml.safe_load(where.read_text())
    except OSError as e:
        raise InvalidSetting(f"cannot read the price table {str(where)!r} ({e.strerror or e}); give a YAML file "
                             f"like {EXAMPLE}") from e
    except yaml.YAMLError as e:
        raise InvalidSetting(f"the price table {str(where)!r} is not YAML ({yaml_problem(e)}); see {EXAMPLE}") from e
    try:
        return PriceTable.model_validate({**(data if isinstance(data, dict) else {"classes": data}),
                                          "source": str(where)})
    except ValidationError as e:
        first = e.errors()[0]
        at = ".".join(str(p) for p in first["loc"])
        raise InvalidSetting(f"the price table {str(where)!r} is wrong at {at}: {first['msg']}; see {EXAMPLE}") from e


def prices_path(given: str | Path | None = None) -> Path | None:
    """The price table to read: ``given``, else SHARDLINE_METERING_PRICES_FILE, else ``<home>/prices.yaml`` when
    there, else None (``load_prices`` then reads the example's list prices)."""
    from shardline.settings import MeteringSettings, StorageSettings

    if given is not None:
        return Path(given)
    configured = MeteringSettings().prices_file
    if configured:
        return Path(configured)
    in_home = Path(str(StorageSettings().home)) / "prices.yaml"
    return in_home if in_home.is_file() else None
