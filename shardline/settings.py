"""Settings: one pydantic-settings class per area, env prefix ``SHARDLINE_<AREA>_``.

They are read once, at the entry point (the CLI, a flow, the server), and passed
down; nothing reads the environment at import time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_home() -> str:
    return str(Path.home() / ".shardline")


class StorageSettings(BaseSettings):
    """Where models and the local model cache live."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_STORAGE_", extra="ignore")

    home: str = Field(
        default_factory=_default_home,
        description="Local folder for Shardline's own state (registry and cache defaults).",
    )
    registry_url: str | None = Field(
        default=None,
        description="fsspec URL of the model registry; defaults to <home>/registry.",
    )
    cache_dir: str | None = Field(
        default=None,
        description="Local folder where fetched bundles are kept; defaults to <home>/cache.",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec options for every remote URL (JSON), e.g. "
        '{"endpoint_url": "http://127.0.0.1:9000"} for an S3-compatible store.',
    )

    protected_aliases: tuple[str, ...] = Field(
        default=("staging", "prod"),
        description="Aliases that, once set, move only through promotion (gated) or rollback.",
    )

    @property
    def registry(self) -> str:
        """The registry URL, with the default applied."""
        return self.registry_url or str(Path(self.home) / "registry")

    @property
    def cache(self) -> str:
        """The model cache folder, with the default applied."""
        return self.cache_dir or str(Path(self.home) / "cache")


class RuntimeSettings(BaseSettings):
    """How models are loaded and run."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_RUNTIME_", extra="ignore")

    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto",
        description="auto: CUDA when onnxruntime-gpu and a GPU are present, else CPU.",
    )
    intra_op_threads: int = Field(
        default=0,
        ge=0,
        description="Threads per inference call; 0 lets the caller pick from its cores.",
    )
    cache_capacity: int = Field(
        default=4, ge=1, description="Loaded models kept per process (LRU)."
    )


class DaskSettings(BaseSettings):
    """Which Dask cluster the batch flow runs its shards on."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_DASK_", extra="ignore")

    cluster: Literal["local", "address", "kubernetes"] = Field(
        default="local",
        description="local: a LocalCluster in this process; address: an existing "
        "scheduler; kubernetes: a dask-kubernetes cluster from a spec file.",
    )
    address: str | None = Field(
        default=None, description="Scheduler address, e.g. tcp://10.0.0.5:8786."
    )
    n_workers: int = Field(
        default=0, ge=0, description="Local worker processes; 0 picks one per core."
    )
    threads_per_worker: int = Field(default=1, ge=1, description="Threads per local worker.")
    kubernetes_spec: str | None = Field(
        default=None,
        description="Path of a DaskCluster spec (YAML) for cluster=kubernetes.",
    )
    kubernetes_workers: int = Field(
        default=2, ge=0, description="Workers to scale a kubernetes cluster to."
    )

    @field_validator("address")
    @classmethod
    def _address_has_scheme(cls, value: str | None) -> str | None:
        if value is not None and "://" not in value:
            raise ValueError(
                f"address {value!r} has no scheme; write it as tcp://HOST:PORT"
            )
        return value

    def resolved_workers(self) -> int:
        """Local worker count, with 0 meaning one per core."""
        return self.n_workers or max(1, os.cpu_count() or 1)


class BatchSettings(BaseSettings):
    """Defaults of a batch job."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_BATCH_", extra="ignore")

    batch_rows: int = Field(
        default=65_536,
        ge=1,
        description="Rows read, scored and written at a time; bounds a worker's memory.",
    )
    shard_suffixes: tuple[str, ...] = Field(
        default=(".parquet", ".pq"), description="File suffixes that count as shards."
    )


class PlacementSettings(BaseSettings):
    """Prices the placement decision weighs measured profiles with (see docs/placement.md)."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_PLACEMENT_", extra="ignore")

    costs_per_hour: dict[str, float] = Field(
        default_factory=lambda: {"cpu": 0.20, "cuda": 4.00, "cuda-nvidia-h200-mig": 0.60},
        description="Machine kind (or a prefix of it, longest wins) -> price of one device per hour (JSON).",
    )
