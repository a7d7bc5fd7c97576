"""Settings: one pydantic-settings class per area (a module each), env prefix ``SHARDLINE_<AREA>_``.

They are read once, at the entry point (the CLI, a flow, the server), and passed down; nothing reads the
environment at import time. Import them from here (``from shardline.settings import BatchSettings``).
"""

from __future__ import annotations

from shardline.settings.batch import BatchSettings, DaskSettings, PrefectServerSettings
from shardline.settings.controller import ControllerSettings
from shardline.settings.drift import DriftSettings
from shardline.settings.metering import MeteringSettings
from shardline.settings.online import ModelServing, OnlineSettings
from shardline.settings.router import RouterSettings
from shardline.settings.runtime import RuntimeSettings, VllmSettings
from shardline.settings.storage import StorageSettings
from shardline.settings.tenancy import TenancySettings

__all__ = ["BatchSettings", "ControllerSettings", "DaskSettings", "DriftSettings", "MeteringSettings", "ModelServing",
           "OnlineSettings", "PrefectServerSettings", "RouterSettings", "RuntimeSettings",
           "StorageSettings", "TenancySettings", "VllmSettings"]
