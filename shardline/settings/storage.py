"""Where models, the model cache and a home's state live."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_home() -> str:
    return str(Path.home() / ".shardline")


class StorageSettings(BaseSettings):
    """Where models and the local model cache live."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_STORAGE_", extra="ignore")

    home: str = Field(
        default_factory=_default_home,
        description="Local folder for Shardline's own state (registry and cache defaults); a relative path is taken "
        "from the folder the command runs in.",
    )
    registry_url: str | None = Field(
        default=None,
        description="fsspec URL of the model registry; defaults to <home>/registry.",
    )
    cache_dir: str | None = Field(
        default=None,
        description="Local folder where fetched bundles are kept; defaults to <home>/cache.",
    )
    capture_url: str | None = Field(
        default=None,
        description="fsspec URL where both tiers write sampled inputs/outputs (drift checks read it); "
        "defaults to <home>/capture.",
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

    @field_validator("home")
    @classmethod
    def _absolute_home(cls, home: str) -> str:
        """One home, one name: the processes a home starts (its Prefect server, its batch runner) run in other
        folders, and messages name the home by its full path."""
        return str(Path(home).expanduser().absolute())

    @property
    def registry(self) -> str:
        """The registry URL, with the default applied."""
        return self.registry_url or str(Path(self.home) / "registry")

    @property
    def cache(self) -> str:
        """The model cache folder, with the default applied."""
        return self.cache_dir or str(Path(self.home) / "cache")
