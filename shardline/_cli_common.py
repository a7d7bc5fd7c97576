"""What the CLI's command groups share: exit codes, error output, the registry from settings."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from shardline.storage.registry import ModelRegistry

OFF_THE_NETWORK = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "ORT_DISABLE_TELEMETRY": "1",
    "GX_ANALYTICS_ENABLED": "false",
}

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_QUARANTINED = 0, 1, 2, 3


def fail(error: BaseException | str, code: int = EXIT_USAGE) -> typer.Exit:
    """Print an error the user can act on; returns the Exit to raise."""
    typer.secho(f"error: {error}", fg="red", err=True)
    return typer.Exit(code)


def open_registry(url: str | None = None) -> "ModelRegistry":
    """The registry the settings name (or ``url``), with the settings' storage options."""
    from shardline.settings import StorageSettings
    from shardline.storage.registry import ModelRegistry

    storage = StorageSettings()
    return ModelRegistry(url or storage.registry, storage.storage_options)
