"""``shardline serve``: build the data plane from settings and run it under uvicorn.

Everything is checked before the port is bound: the tenants file (a bad one stops the
start, naming the field), the registry URL and the settings.

With ``workers`` > 1, uvicorn's supervisor binds the port once and starts that many
worker processes that accept on it; each builds its own data plane (``worker_app``) from
the settings this process checked, which it hands them in ``SERVE_SETTINGS_ENV``, and
holds 1/N of every tenant's quota. Prometheus' multiprocess mode combines their metrics
(a fresh ``PROMETHEUS_MULTIPROC_DIR``, removed at exit).
"""

from __future__ import annotations

import gc
import logging.config
import os
import shutil
import socket
import tempfile

from starlette.types import ASGIApp

from shardline.errors import InvalidSetting
from shardline.online.app import create_app
from shardline.online.dataplane import DataPlane
from shardline.online.logs import log_config
from shardline.online.tenants import TenantDirectory, load_tenants
from shardline.runtimes import RuntimeOptions
from shardline.settings import OnlineSettings, RuntimeSettings, StorageSettings
from shardline.storage.capture import capture_root
from shardline.storage.model_cache import get_model_cache
from shardline.storage.registry import ModelRegistry

SERVE_SETTINGS_ENV = "SHARDLINE_SERVE_WORKER_SETTINGS"  # the checked OnlineSettings, as JSON, for the workers


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
    return DataPlane(online, registry, cache, tenants, options, storage_options=storage.storage_options,
                     capture_root=capture_root(storage))


def build_app(online: OnlineSettings, storage: StorageSettings, runtime: RuntimeSettings) -> ASGIApp:
    """The ASGI app ``shardline serve`` runs (tenants and settings checked)."""
    return create_app(build_plane(online, storage, runtime), log_requests=online.access_log)


def worker_app() -> ASGIApp:
    """The app of one worker process (uvicorn's factory): the settings ``serve`` checked, from the environment."""
    online = OnlineSettings.model_validate_json(os.environ[SERVE_SETTINGS_ENV])
    logging.config.dictConfig(log_config(online.log_level))
    app = build_app(online, StorageSettings(), RuntimeSettings())
    gc.freeze()  # what is loaded by now lives as long as the server: keep it out of every collection
    return app


def serve(online: OnlineSettings, storage: StorageSettings, runtime: RuntimeSettings) -> None:
    """Run the server in this process (or its workers) until it is stopped (SIGINT or SIGTERM)."""
    import uvicorn

    config = log_config(online.log_level)
    logging.config.dictConfig(config)
    app = build_app(online, storage, runtime)
    try:
        socket.getaddrinfo(online.host, online.port)
    except socket.gaierror as e:
        raise InvalidSetting(f"--host {online.host!r} is not an address this machine can listen on ({e})") from e
    # proxy_headers off: nothing here reads the client's address (uvicorn would rewrite it from
    # X-Forwarded-For on every request, ~1 us).
    common = dict(host=online.host, port=online.port, log_config=config, access_log=False,
                  timeout_graceful_shutdown=10, server_header=False, proxy_headers=False)
    workers = online.resolved_workers()
    if workers == 1:
        gc.freeze()  # what is loaded by now lives as long as the server: keep it out of every collection
        uvicorn.run(app, workers=1, **common)  # type: ignore[arg-type]
        return
    del app  # checked; each worker builds its own
    metrics_dir = tempfile.mkdtemp(prefix="shardline-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    os.environ[SERVE_SETTINGS_ENV] = online.model_dump_json()
    try:
        uvicorn.run("shardline.online.server:worker_app", factory=True, workers=workers, **common)  # type: ignore[arg-type]
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
