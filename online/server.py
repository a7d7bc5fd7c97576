"""``shardline serve``: build the data plane from settings and run it under uvicorn (one worker).

Everything is checked before the port is bound: the tenants file (a bad one stops the
start, naming the field), the registry URL and the settings.
"""

from __future__ import annotations

import logging.config
import socket

from starlette.applications import Starlette

from shardline.errors import InvalidSetting
from shardline.online.app import create_app
from shardline.online.dataplane import DataPlane
from shardline.online.logs import log_config
from shardline.online.tenants import TenantDirectory, load_tenants
from shardline.runtimes import RuntimeOptions
from shardline.settings import OnlineSettings, RuntimeSettings, StorageSettings
from shardline.storage.model_cache import get_model_cache
from shardline.storage.registry import ModelRegistry


def build_plane(
    online: OnlineSettings,
    storage: StorageSettings,
    runtime: RuntimeSettings,
    tenants: TenantDirectory | None = None,
) -> DataPlane:
    """A data plane over the registry and the process's model cache that the settings name.

    Raises:
        InvalidSetting: no tenants file, or a bad one.
    """
    if tenants is None:
        if not online.tenants_file:
            raise InvalidSetting(
                "no tenants file: pass --tenants PATH or set SHARDLINE_ONLINE_TENANTS_FILE "
                "(see online/README.md for its format)"
            )
        tenants = load_tenants(online.tenants_file)
    registry = ModelRegistry(storage.registry, storage.storage_options)
    cache = get_model_cache(storage.cache, max(online.max_loaded_models, runtime.cache_capacity))
    options = RuntimeOptions(runtime.device, runtime.intra_op_threads)
    return DataPlane(online, registry, cache, tenants, options, storage_options=storage.storage_options)


def build_app(online: OnlineSettings, storage: StorageSettings, runtime: RuntimeSettings) -> Starlette:
    """The ASGI app ``shardline serve`` runs (tenants and settings checked)."""
    return create_app(build_plane(online, storage, runtime), log_requests=online.access_log)


def serve(online: OnlineSettings, storage: StorageSettings, runtime: RuntimeSettings) -> None:
    """Run the server in this process until it is stopped (SIGINT or SIGTERM)."""
    import uvicorn

    config = log_config(online.log_level)
    logging.config.dictConfig(config)
    app = build_app(online, storage, runtime)
    try:
        socket.getaddrinfo(online.host, online.port)
    except socket.gaierror as e:
        raise InvalidSetting(f"--host {online.host!r} is not an address this machine can listen on ({e})") from e
    uvicorn.run(
        app, host=online.host, port=online.port, workers=1, log_config=config, access_log=False,
        timeout_graceful_shutdown=10, server_header=False,
    )
