"""``shardline router``: settings -> tenants, registry, replicas -> the router's ASGI app -> uvicorn.

One process, one event loop (the router's work per request is a few header copies and one
upstream call). With ``--local-replicas N`` it starts N ``shardline serve`` processes first and
stops them when it stops. With nginx and its Lua module installed (``data_plane`` auto or nginx) the router
binds its address and hands the socket to nginx, which it starts in front of itself (``nginx_front``); uvicorn
then listens on a unix socket in a private folder, for nginx alone. The private folders (nginx's, the local
replicas' logs) are removed when the router stops.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import logging.config
import os
import secrets
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from shardline.errors import InvalidSetting
from shardline.online.budgets import BudgetBoard
from shardline.online.logs import log_config
from shardline.online.models import ModelDirectory
from shardline.online.quota_store import QuotaStore, lane_reaches
from shardline.online.router.config import RouterConfig, load_router_config, local_config
from shardline.online.router.events import RouterEvents
from shardline.online.router.health import BreakerPolicy
from shardline.online.router.local import LocalReplicas
from shardline.online.router.nginx_front import (
    REDIS_CLIENT,
    NginxFront,
    NginxLayout,
    choose_front,
    listen_address,
)
from shardline.online.router.replicas import ReplicaSet
from shardline.online.router.rollouts import RolloutBook
from shardline.online.router.router import Router
from shardline.online.router.scaling import Activator, ScalePolicy, Scaler
from shardline.online.router.service import RouterService, router_app
from shardline.online.tenants import load_tenants
from shardline.settings import MeteringSettings, OnlineSettings, RouterSettings, StorageSettings, TenancySettings
from shardline.storage.ledger import LedgerStore
from shardline.storage.registry import ModelRegistry

log = logging.getLogger(__name__)


def _run_blocking(call: Any) -> Any:
    return asyncio.get_running_loop().run_in_executor(None, call)


def check_settings(settings: RouterSettings, tenancy: TenancySettings) -> None:
    """Refuse a router that could not work, before anything starts.

    Raises:
        InvalidSetting: no tenants file; neither or both of a config file and local replicas; a config
            file without the router's key; a minimum of replicas without local replicas, or above them.
    """
    if not tenancy.tenants_file:
        raise InvalidSetting("the router needs the tenants file its replicas read: pass --tenants PATH or set "
                             "SHARDLINE_TENANTS_FILE")
    if bool(settings.config_file) == bool(settings.local_replicas):
        raise InvalidSetting("give the router either --config router.yaml (its replica groups) or --local-replicas N "
                             "(it starts N replicas on loopback), not both or neither")
    if settings.min_replicas is not None and not settings.local_replicas:
        raise InvalidSetting("--min-replicas scales the router's own replicas: give --local-replicas N (the most it "
                             "runs) with it; configured groups are scaled by their own autoscaler (KEDA, an HPA)")
    if settings.min_replicas is not None and settings.min_replicas > settings.local_replicas:
        raise InvalidSetting(f"--min-replicas {settings.min_replicas} is more than --local-replicas "
                             f"{settings.local_replicas}, the most it runs; give a smaller minimum")
    if settings.config_file and not settings.key:
        raise InvalidSetting("a router over configured replicas needs its key: set SHARDLINE_ROUTER_KEY, and give its "
                             "replicas its sha256 as SHARDLINE_TENANCY_ROUTER_KEY_SHA256 (docs/routing.md)")


def build_service(settings: RouterSettings, storage: StorageSettings, tenancy: TenancySettings,
                  config: RouterConfig, key: str, local: LocalReplicas | None = None) -> RouterService:
    """The router over ``config``'s replicas, authenticating the tenants of ``tenancy``'s file."""
    assert tenancy.tenants_file
    tenants = load_tenants(tenancy.tenants_file)
    registry = ModelRegistry.from_settings(storage)
    directory = ModelDirectory(registry, _run_blocking, OnlineSettings().alias_refresh_s)
    policy = BreakerPolicy(consecutive_failures=settings.breaker_failures, open_s=settings.breaker_open_s)
    replicas = ReplicaSet(config, policy, settings.failback_s, time.monotonic)
    aliases = {(ref.name, ref.alias or "prod") for tenant in tenants.tenants.values() for ref in tenant.models.values()
               if ref.version is None}
    book = RolloutBook(registry, aliases, _run_blocking, time.monotonic, RouterEvents(storage.home),
                       f"router-{socket.gethostname()}-{os.getpid()}")
    scaler = None
    if local is not None and settings.min_replicas is not None and settings.min_replicas < settings.local_replicas:
        scaler = Scaler(ScalePolicy(settings.target_in_flight, settings.min_replicas, settings.local_replicas,
                                    settings.scale_up_delay_s, settings.scale_down_delay_s))
    activator = Activator(settings.activator_queue) if scaler is not None and settings.min_replicas == 0 else None
    budgets = BudgetBoard(LedgerStore(storage.home, storage.storage_options), MeteringSettings().budget_refresh_s)
    router = Router(settings, tenants, directory, replicas, key, rollouts=book, activator=activator, budgets=budgets)
    router.fallbacks = {(f.model, f.group): f.variant for f in config.fallbacks}
    if tenancy.quota_store:
        router.quotas = QuotaStore(tenancy.quota_store, tenancy.quota_store_routers, time.monotonic,
                                   router.metrics.registry)
    return RouterService(router, config, local, scaler)


def _listen(host: str, port: int) -> socket.socket:
    """The router's listening socket, for nginx to inherit.

    Raises:
        InvalidSetting: the address cannot be listened on.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        listener = socket.create_server((host, port), family=family, backlog=4096)
    except OSError as e:
        raise InvalidSetting(f"cannot listen on {host}:{port} ({e.strerror}); set SHARDLINE_ROUTER_PORT to a free "
                             "port") from e
    listener.set_inheritable(True)
    return listener


def _front_with_store(plane: str, store: str) -> str | None:
    """nginx (``plane``) when its lane can hold the quotas in the store too (Redis's Lua client installed, a plain
    ``redis://`` URL); else None, logged: every request passes the router's shared quotas."""
    if not lane_reaches(store):
        log.info("quotas in %s: nginx's fast lane is not started (its Lua speaks plain TCP to Redis, not TLS); every "
                 "request passes the router's shared quotas", store)
        return None
    if not REDIS_CLIENT.exists():
        log.warning("quotas in %s: nginx's fast lane is not started (Redis's Lua client is not installed: apt-get "
                    "install lua-nginx-redis); every request passes the router's shared quotas", store)
        return None
    log.info("quotas in %s: nginx's fast lane is on and holds the rate and concurrency quotas there with every "
             "router", store)
    return plane


def _nginx_layout(settings: RouterSettings, tenancy: TenancySettings, key: str,
                  listener: socket.socket) -> NginxLayout:
    """nginx's layout: the router's failure settings; a replica whose connection failed stays out of the fast lane
    until the router's next health check could have seen it (``health_interval_s``, at least 0.25 s); the quota
    store the lane holds the quotas in with every router (unset: in its own memory)."""
    host, port = listener.getsockname()[:2]
    return NginxLayout(
        folder=Path(tempfile.mkdtemp(prefix="shardline-front-")), listen_fd=listener.fileno(),
        listen=listen_address(host, port), router_key=key, balance=settings.balance, retries=settings.retries,
        request_timeout_s=settings.request_timeout_s, max_timeout_s=settings.max_timeout_s,
        hold_s=max(0.25, settings.health_interval_s * 1.5), stall_s=settings.stall_ms / 1000,
        quota_store=tenancy.quota_store, quota_routers=tenancy.quota_store_routers)


def run_router(settings: RouterSettings, storage: StorageSettings, tenancy: TenancySettings) -> None:
    """Run the router until it is stopped (SIGINT or SIGTERM), with its local replicas if asked for.

    Raises:
        InvalidSetting: as ``check_settings``, or a bad tenants file or router config.
    """
    import uvicorn

    from shardline.observability import tracing
    from shardline.online.connection import bind_metrics_listener, uvicorn_options
    from shardline.online.limits import open_files_limit, resolve_limits
    from shardline.online.metrics import metrics_app

    config_log = log_config(settings.log_level)
    logging.config.dictConfig(config_log)
    tracing.configure("shardline-router")
    check_settings(settings, tenancy)
    assert tenancy.tenants_file
    load_tenants(tenancy.tenants_file)  # checked before any replica starts
    key = settings.key or secrets.token_urlsafe(32)
    local = None
    if settings.local_replicas:
        digest = hashlib.sha256(key.encode()).hexdigest()
        local = LocalReplicas(settings.local_replicas, tenancy.tenants_file, digest,
                              Path(tempfile.mkdtemp(prefix="shardline-replicas-")), initial=settings.min_replicas)
        config = local_config([r.url for r in local.replicas[:local.initial]])
    else:
        assert settings.config_file
        config = load_router_config(settings.config_file)
    service = build_service(settings, storage, tenancy, config, key, local)
    plane = choose_front(settings.data_plane)
    if plane is not None and tenancy.quota_store:
        plane = _front_with_store(plane, tenancy.quota_store)
    online = OnlineSettings()
    limits = resolve_limits(online, open_files_limit())
    metrics = (bind_metrics_listener(settings.metrics_host, settings.metrics_port, settings.port,
                                     "SHARDLINE_ROUTER_METRICS_PORT") if settings.metrics_port else None)
    apps = {metrics.getsockname()[1]: metrics_app(service.router.metrics.exposition)} if metrics is not None else None
    app = router_app(service, settings.max_body_bytes)
    listener = None
    if plane is not None:
        listener = _listen(settings.host, settings.port)
        service.front = NginxFront(plane, _nginx_layout(settings, tenancy, key, listener), service.router.tenants)
        service.router.behind_edge = True
        server_config = uvicorn.Config(app, uds=str(service.front.router_socket), log_config=config_log,
                                       timeout_graceful_shutdown=10, **uvicorn_options(limits, apps))
        host, port = listener.getsockname()[:2]
        log.info("router on http://%s:%d (nginx in front; the router behind it on %s)", host, port,
                 service.front.router_socket)
    else:
        server_config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=config_log,
                                       timeout_graceful_shutdown=10, **uvicorn_options(limits, apps))
    try:
        if local is not None:
            local.start()
            log.info("local replicas: %s (logs in %s)", ", ".join(local.urls) or "none until a request comes",
                     local.log_dir)
        server = uvicorn.Server(server_config)
        server.run(sockets=[server_config.bind_socket(), *([metrics] if metrics is not None else [])])
    finally:
        if service.front is not None:
            service.front.stop()
            shutil.rmtree(service.front.folder, ignore_errors=True)
        if local is not None:
            local.stop()
            shutil.rmtree(local.log_dir, ignore_errors=True)
        if metrics is not None:
            metrics.close()
        if listener is not None:
            listener.close()
    if not server.started:
        raise SystemExit(3)
