"""The metering ledger both tiers write (``storage/ledger.py``) and the prices a cost report reads."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

CapacityType = Literal["on-demand", "spot"]


class MeteringSettings(BaseSettings):
    """What a server or a batch job writes to the metering ledger, and on what hardware it says it ran."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_METERING_", extra="ignore")

    enabled: bool = Field(default=True, description="Write the metering ledger (<home>/metering/ledger).")
    bucket_s: float = Field(
        default=300.0, ge=0.5, le=86_400.0,
        description="Length of a ledger time bucket in seconds: a server writes one Parquet file per closed bucket "
        "(off the request path); a crash loses at most the bucket still open.",
    )
    hardware_class: str | None = Field(
        default=None,
        description="The hardware this process runs on, as the price table names it: 'cpu', 'h100', 'h200', or a MIG "
        "slice 'h100-mig-3g.40gb' (the capacity plan's class names). Unset: 'cpu' on a CPU runtime, 'gpu' on CUDA "
        "(give the GPU kind for a priced report).",
    )
    capacity_type: CapacityType = Field(default="on-demand", description="How the capacity is bought: on-demand or spot.")
    units: float | None = Field(
        default=None, gt=0,
        description="Units of the hardware class one server holds (cores for 'cpu', GPUs or slices otherwise). "
        "Unset: the cores this process may use on 'cpu', else 1.",
    )
    budget_refresh_s: float = Field(
        default=30.0, ge=0.2, le=3_600.0,
        description="How often `shardline serve` prices the month's ledger into the tenants' budget states and its "
        "server processes re-read them (off the request path; docs/cost.md, 'Budgets').",
    )
    prices_file: str | None = Field(
        default=None,
        description="The price table (YAML) `shardline cost report`, `cost simulate` and `plan capacity` price "
        "with; unset: <home>/prices.yaml, else the built-in example (cloud list prices).",
    )
