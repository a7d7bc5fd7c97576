"""Drift checks: capture, windows, thresholds."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class DriftSettings(BaseSettings):
    """Drift checks over captured data, and the flows that answer them (see docs/drift.md)."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_DRIFT_", extra="ignore")

    window_hours: float = Field(
        default=24.0, gt=0, description="How far back a drift check reads captured rows when no window is given."
    )
    contract_sample_rows: int = Field(
        default=10_000, ge=1, description="Newest captured rows checked against the model's data contract per check."
    )
    reports_url: str | None = Field(
        default=None,
        description="fsspec URL where drift reports are kept, one JSON per check (their history); "
        "defaults to <home>/drift.",
    )
    labelled_url: str | None = Field(
        default=None,
        description="fsspec URL of fresh labelled data for re-validation: <url>/<model>/ holds Parquet with the "
        "model's inputs and its evaluation's label column.",
    )
