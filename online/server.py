"""``shardline serve``: build the data plane from settings and run it under uvicorn.

Everything is checked before the port is bound: the tenants file (a bad one stops the
start, naming the field), the registry URL and the settings. With ``fd`` (``--fd``; ``metrics_fd``
for the metrics listener) it serves on a socket it inherited instead, bound by the process that
started it (``shardline.local_ports.listener``: the router's replicas), so that no other process can
take the port between the two.

With ``workers`` > 1, uvicorn's supervisor binds the port once and starts that many
worker processes that accept on it; each builds its own data plane (``worker_app``) from
the settings this process checked (online and tenancy), which it hands them in ``SERVE_SETTINGS_ENV``, and
holds 1/N of every tenant's quota. Prometheus' multiprocess mode combines their metrics
(a fresh ``PROMETHEUS_MULTIPROC_DIR``, removed at exit).

Metrics name tenants, so they have a listener of their own (``metrics_host``:``metrics_port``,
127.0.0.1:8002 by default; port 0 or ``off``: none), never the tenants' port. With one process
it is a second socket of the same uvicorn server (``LimitedHttpToolsProtocol`` picks the app by
listener, once per connection); with workers, the supervisor serves it from a thread, reading
every worker's metrics. Every listener holds its connections to ``resolve_limits(settings)``
(head size, time-outs, connection and in-flight caps: ``shardline.online.connection``), in each
worker alike.

The defaults that depend on the machine (server processes, inference threads, onnxruntime's
intra-op threads) are resolved from its cores by the settings (``OnlineSettings.resolved_*``);
``serving_settings`` gathers what a server runs with, which ``serve`` logs once at start-up
("serving settings") and ``shardline serve --help`` prints.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging.config
import os
import shutil
import socket
import tempfile
import threading
from typing import Any, Callable

from starlette.types import ASGIApp

from shardline.errors import InvalidSetting
from shardline.local_ports import inherited
from shardline.observability import tracing
from shardline.online.app import create_app
from shardline.online.budgets import BudgetBoard
from shardline.online.connection import bind_metrics_listener, uvicorn_options
from shardline.online.dataplane import DataPlane
from shardline.online.limits import ConnectionLimits, open_files_limit, resolve_limits
from shardline.online.logs import log_config
from shardline.online.metrics import Metrics, metrics_app, multiprocess_exposition
from shardline.online.tenants import TenantDirectory, load_tenants
from shardline.runtimes import RuntimeOptions
from shardline.settings import MeteringSettings, OnlineSettings, RuntimeSettings, StorageSettings, TenancySettings
from shardline.storage.capture import capture_root
from shardline.storage.ledger import LedgerStore, LedgerWriter, holding_of
from shardline.storage.model_cache import get_model_cache
from shardline.storage.registry import ModelRegistry

log = logging.getLogger(__name__)
SERVE_SETTINGS_ENV = "SHARDLINE_SERVE_WORKER_SETTINGS"  # the checked online and tenancy settings, as JSON, for the workers


def tenant_directory(tenancy: TenancySettings) -> TenantDirectory:
    """The server's tenants, from the tenants file both tiers read (``TenancySettings.tenants_file``).

    Raises:
        InvalidSetting: no tenants file (the server needs one), or a bad one.
    """
    if not tenancy.tenants_file:
        raise InvalidSetting(
            "no tenants file: pass --tenants PATH or set SHARDLINE_TENANTS_FILE (or SHARDLINE_ONLINE_TENANTS_FILE) "
            "(see online/README.md for its format)"
        )
    tenants = load_tenants(tenancy.tenants_file)
    return tenants.behind_router(tenancy.router_key_sha256) if tenancy.router_key_sha256 else tenants


def serving_settings(online: OnlineSettings, runtime: RuntimeSettings) -> dict[str, Any]:
    """What ``shardline serve`` runs with on this machine, each default resolved from its cores:
    the start-up log line and ``serve --help`` show it; ``build_plane`` uses the same values."""
    return {
        "cores": os.cpu_count() or 1,
        "workers": online.resolved_workers(),
        "inference_threads": online.resolved_threads(),
        "intra_op_threads": online.resolved_intra_op_threads(runtime.intra_op_threads),
        "spinning": runtime.spinning,
        "device": runtime.device,
        "inline_max_ms": online.inline_max_ms,
        "max_batch_size": online.max_batch_size,
        "max_batch_wait_ms": online.max_batch_wait_ms,
        "max_concurrent_batches": online.resolved_concurrent_batches(),
    }


def build_plane(
    online: OnlineSettings, storage: StorageSettings, runtime: RuntimeSettings, tenants: TenantDirectory,
    metering: MeteringSettings | None = None,
) -> DataPlane:
    """A data plane over the registry and the process's model cache (``runtime.cache_capacity``) that the settings name."""
    registry = ModelRegistry.from_settings(storage)
    cache = get_model_cache(storage.cache, runtime.cache_capacity)
    options = RuntimeOptions(runtime.device, online.resolved_intra_op_threads(runtime.intra_op_threads),
                             runtime.spinning)
    metering = metering or MeteringSettings()
    metrics = Metrics(ledger=online_ledger(online, storage, runtime, metering))
    budgets = BudgetBoard(LedgerStore(storage.home, storage.storage_options), metering.budget_refresh_s)
    return DataPlane(online, registry, cache, tenants, options, storage_options=storage.storage_options,
                     capture_root=capture_root(storage), metrics=metrics, budgets=budgets)


def online_ledger(online: OnlineSettings, storage: StorageSettings, runtime: RuntimeSettings,
                  metering: MeteringSettings) -> LedgerWriter | None:
    """This server process's meter (``storage/ledger.py``), None when metering is off. Each of ``workers`` processes
    holds its share of the machine's units (cores on a CPU, else the GPU or slice), so that together they
    hold it once."""
    if not metering.enabled:
        return None
    device = "gpu" if runtime.device == "cuda" else "cpu"
    units = float(len(os.sched_getaffinity(0))) if device == "cpu" else 1.0
    holding = holding_of(metering, "online", device, units)
    share = dataclasses.replace(holding, units=holding.units / online.resolved_workers())
    return LedgerWriter(LedgerStore(storage.home, storage.storage_options), share, metering.bucket_s)


def build_app(
    online: OnlineSettings, storage: StorageSettings, runtime: RuntimeSettings, tenancy: TenancySettings
) -> ASGIApp:
    """The ASGI app ``shardline serve`` runs (tenants and settings checked)."""
    return create_app(build_plane(online, storage, runtime, tenant_directory(tenancy)), log_requests=online.access_log)


def worker_app() -> ASGIApp:
    """The app of one worker process (uvicorn's factory): the settings ``serve`` checked, from the environment."""
    given = json.loads(os.environ[SERVE_SETTINGS_ENV])
    online = OnlineSettings.model_validate(given["online"])
    logging.config.dictConfig(log_config(online.log_level))
    tracing.configure("shardline-serve")
    app = build_app(online, StorageSettings(), RuntimeSettings(), TenancySettings.model_validate(given["tenancy"]))
    gc.freeze()  # what is loaded by now lives as long as the server: keep it out of every collection
    return app


def _check_address(host: str, port: int, what: str) -> None:
    try:
        socket.getaddrinfo(host, port)
    except socket.gaierror as e:
        raise InvalidSetting(f"{what} {host!r} is not an address this machine can listen on ({e})") from e


def inherited_socket(fd: int, option: str) -> socket.socket:
    """The bound socket this process was handed as ``fd`` (``--fd``, ``--metrics-fd``), owned from now on.

    Raises:
        InvalidSetting: ``fd`` is not a bound TCP socket.
    """
    try:
        return inherited(fd)
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise InvalidSetting(f"{option} is {fd}, which is not a socket to serve on ({why}); give the file descriptor "
                             "of a bound TCP socket this process inherited, or leave it out to listen on a port") from e


def bind_metrics_socket(online: OnlineSettings) -> socket.socket | None:
    """The metrics listener's socket, bound (the inherited one with ``metrics_fd``; None when ``metrics_port`` is 0:
    no metrics listener).

    Raises:
        InvalidSetting: the address is not one to listen on, the port is the main port or is taken, or
            ``metrics_fd`` is not a socket.
    """
    if online.metrics_fd is not None:
        return inherited_socket(online.metrics_fd, "--metrics-fd")
    if not online.metrics_port:
        return None
    _check_address(online.metrics_host, online.metrics_port, "SHARDLINE_ONLINE_METRICS_HOST")
    main_port = -1 if online.fd is not None else online.port  # an inherited main socket is on a port of its own
    return bind_metrics_listener(online.metrics_host, online.metrics_port, main_port, "SHARDLINE_ONLINE_METRICS_PORT")


def serve(online: OnlineSettings, storage: StorageSettings, runtime: RuntimeSettings, tenancy: TenancySettings) -> None:
    """Run the server in this process (or its workers) until it is stopped (SIGINT or SIGTERM).

    The tenants' port serves the app; ``/metrics`` is on the metrics listener only (``metrics_host``:
    ``metrics_port``, loopback by default), answered by this process (the supervisor, with workers).

    Raises:
        InvalidSetting: a bad setting, tenants file, or address.
    """
    config = log_config(online.log_level)
    logging.config.dictConfig(config)
    limits = resolve_limits(online, open_files_limit())
    if online.fd is None:
        _check_address(online.host, online.port, "--host")
    main_sock = inherited_socket(online.fd, "--fd") if online.fd is not None else None
    workers = online.resolved_workers()
    if workers == 1:
        tracing.configure("shardline-serve")  # with workers, each worker process turns it on for itself
    tenants = tenant_directory(tenancy)
    log.info("serving settings", extra={"fields": serving_settings(online, runtime)})
    if workers == 1:
        plane = build_plane(online, storage, runtime, tenants)
        app = create_app(plane, log_requests=online.access_log)
        _serve_one(online, limits, config, app, plane.metrics.exposition, main_sock)
    else:
        build_plane(online, storage, runtime, tenants)  # checked; each worker builds its own
        _serve_workers(online, tenancy, limits, config, workers, main_sock)


def _serve_one(online: OnlineSettings, limits: ConnectionLimits, config: dict[str, Any], app: ASGIApp,
               exposition: Callable[[], tuple[bytes, str]], main_sock: socket.socket | None) -> None:
    import uvicorn

    metrics_sock = bind_metrics_socket(online)
    apps = {metrics_sock.getsockname()[1]: metrics_app(exposition)} if metrics_sock is not None else None
    server_config = uvicorn.Config(app, host=online.host, port=online.port, log_config=config,
                                   timeout_graceful_shutdown=10, **uvicorn_options(limits, apps))
    if main_sock is not None:
        log.info("serving on http://%s:%d (inherited socket %d)", *main_sock.getsockname()[:2], online.fd)
    try:
        sockets = [main_sock or server_config.bind_socket()] + ([metrics_sock] if metrics_sock is not None else [])
        server = uvicorn.Server(server_config)
        gc.freeze()  # what is loaded by now lives as long as the server: keep it out of every collection
        server.run(sockets=sockets)
    finally:
        if metrics_sock is not None:
            metrics_sock.close()
    if not server.started:
        raise SystemExit(3)  # uvicorn's startup failure (the log says why)


def _serve_workers(online: OnlineSettings, tenancy: TenancySettings, limits: ConnectionLimits, config: dict[str, Any],
                   workers: int, main_sock: socket.socket | None) -> None:
    import uvicorn

    metrics_dir = tempfile.mkdtemp(prefix="shardline-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    os.environ[SERVE_SETTINGS_ENV] = json.dumps(
        {"online": online.model_dump(mode="json"), "tenancy": tenancy.model_dump(mode="json")})
    metrics: tuple[Any, threading.Thread] | None = None
    try:
        metrics_sock = bind_metrics_socket(online)
        if metrics_sock is not None:
            metrics = _start_in_thread(metrics_app(lambda: multiprocess_exposition(metrics_dir)), metrics_sock, limits)
        uvicorn.run("shardline.online.server:worker_app", factory=True, workers=workers, host=online.host,  # type: ignore[arg-type]
                    port=online.port, fd=main_sock.fileno() if main_sock is not None else None, log_config=config,
                    timeout_graceful_shutdown=10, **uvicorn_options(limits))
    finally:
        if metrics is not None:
            metrics[0].should_exit = True
            metrics[1].join(timeout=10)
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _start_in_thread(app: ASGIApp, sock: socket.socket, limits: ConnectionLimits) -> tuple[Any, threading.Thread]:
    """A uvicorn server for ``app`` on ``sock`` in a thread of this process (the supervisor's metrics)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="off", **uvicorn_options(limits)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="shardline-metrics", daemon=True)
    thread.start()
    return server, thread
