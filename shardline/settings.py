"""Settings: one pydantic-settings class per area, env prefix ``SHARDLINE_<AREA>_``.

They are read once, at the entry point (the CLI, a flow, the server), and passed
down; nothing reads the environment at import time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
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


class ModelServing(BaseModel):
    """Per-model overrides of the online tier's defaults (any field left out keeps the default)."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int | None = Field(default=None, ge=1, description="Rows per batch at most.")
    max_batch_wait_ms: float | None = Field(
        default=None, ge=0, le=10_000, description="How long the oldest queued request may wait for a fuller batch."
    )
    queue_capacity: int | None = Field(default=None, ge=1, description="Requests queued for the model at most.")
    idle_timeout_s: float | None = Field(
        default=None, ge=0, description="Unload the model after this many idle seconds; 0 keeps it loaded."
    )


class OnlineSettings(BaseSettings):
    """The HTTP tier: where it listens, who may call it, how it batches, sheds and scales to zero."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_ONLINE_", extra="ignore")

    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(default=8000, ge=0, le=65_535, description="TCP port to listen on (0 picks a free one).")
    tenants_file: str | None = Field(
        default=None, description="Path of the tenants YAML (API key hashes, models, priority, quotas)."
    )
    max_batch_size: int = Field(
        default=64, ge=1, description="Rows per batch at most, for models without a profile or an override."
    )
    max_batch_wait_ms: float = Field(
        default=0.0,
        ge=0,
        le=10_000,
        description="How long the oldest queued request may wait for a fuller batch while the model is idle; "
        "0 sends what is queued at once (batches still form while the model is busy).",
    )
    batch_latency_budget_ms: float = Field(
        default=10.0,
        gt=0,
        description="With a measured profile, the largest batch size whose p99 fits this budget is the default.",
    )
    max_concurrent_batches: int = Field(
        default=1, ge=1, description="Batches of one model running at once (more only helps models that leave cores idle)."
    )
    queue_capacity: int = Field(
        default=256,
        ge=1,
        description="Requests queued per model; low priority is shed at half of it, normal at 80%, high when full.",
    )
    idle_timeout_s: float = Field(
        default=300.0, ge=0, description="Unload a model idle this long (scale to zero); 0 keeps models loaded."
    )
    reap_interval_s: float = Field(default=1.0, gt=0, description="How often idle models are looked for.")
    alias_refresh_s: float = Field(
        default=5.0, ge=0, description="How long an alias's version is trusted before the registry is read again."
    )
    inference_threads: int = Field(
        default=0, ge=0, description="Threads that run inference off the event loop; 0 picks one per core."
    )
    max_loaded_models: int = Field(default=8, ge=1, description="Models held loaded at once (the model cache's size).")
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024, description="Largest request body, compressed and decompressed."
    )
    models: dict[str, ModelServing] = Field(
        default_factory=dict,
        description='Per-model overrides (JSON), e.g. {"minilm": {"max_batch_size": 16, "idle_timeout_s": 60}}.',
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="Log level.")
    access_log: bool = Field(default=True, description="Write one JSON line per request.")

    @field_validator("models")
    @classmethod
    def _model_names(cls, value: dict[str, ModelServing]) -> dict[str, ModelServing]:
        from shardline.bundle import check_model_name

        for name in value:
            check_model_name(name)
        return value

    def resolved_threads(self) -> int:
        """Inference threads, with 0 meaning one per core."""
        return self.inference_threads or max(1, os.cpu_count() or 1)
