"""nginx with LuaJIT in front of the router: the router's ``Front``, its fast lane (docs/routing.md).

Where Debian's ``nginx-light`` and ``libnginx-mod-http-lua`` are installed this is the router's front (it
replaced an HAProxy lane that did the same for more CPU: bench/README.md). Its configuration is rendered from the
templates beside this module (``nginx_front.conf``, with the two lanes' proxying in ``nginx_front_fast.conf`` and
``nginx_front_router.conf``). nginx binds nothing: it inherits the router's listening socket (nginx's ``NGINX``
variable, as for its binary upgrade), so a restarted nginx goes on serving the same endpoint. One worker process
runs ``front_lane.lua``:

- **every request**: the ``Bearer`` key's sha256 looked up among the tenants file's digests (each header's
  tenant remembered in the worker: the digest is a pure function of the key), the tenant's ``max_concurrent``
  and token bucket held (``admission.TokenBucket``'s refill, ``TenantGate``'s messages; 429 in the V2 or OpenAI
  form by the path; with a quota store, in Redis by ``quota_store``'s scripts, 1/N here while it is unreachable),
  and the admitted tenant named to the router (``GATED_HEADER``); a client's copies of the
  router's headers are dropped;
- **the fast lane**: ``POST /v2/models/{name}/infer`` (or KServe V1's ``/v1/models/{name}:predict``) of a pinned
  tenant/model (``desired_pins``), without a deadline or a route key, with a ``Content-Length`` body of at most
  ``FAST_BODY_BYTES`` (buffered, so a failed try can be sent again), while a replica in its order is up: the path
  rewritten to the pinned version, the router's key and the tenant sent, the replica chosen by ``balancer_by_lua``
  in the *router's own* rendezvous order for the pinned version (``placement.rank``, pushed by the router) with
  bounded loads over the lane's requests in flight (``placement.choose``), retried on another replica after a
  failed connection or a 502-504 (``retries``; only failed connections while the router's retry budget has no
  room), a failed connection keeping the replica out for ``hold`` seconds, and with no replica left to try, on to
  the router as rewritten (it takes its own key and the tenant); everything else goes on to the router over its
  unix socket, streamed (bodies and answers), as the client sent it.

Health stays the router's: the replicas it pushes as up are those whose checks pass, not ejected for latency,
breaker not open; nginx adds only the passive mark. The router keeps the lane true every ``SYNC_S`` (a whole new
state when anything changed, or when the worker's generation is not the one it last pushed: a restarted worker
starts empty) and reads back the lane's counts (``/counts``) for its metrics, its scaler and its retry budget.
"""

from __future__ import annotations

import asyncio
import grp
import ipaddress
import logging
import os
import pwd
import re
import shutil
import signal
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from shardline.errors import ChildNotReady, InvalidSetting
from shardline.online.admission import worker_share
from shardline.online.headers import GATED_HEADER, TENANT_HEADER, VARIANT_HEADER
from shardline.online.quota_store import allowance, lane_store
from shardline.online.quota_store import key as quota_key
from shardline.online.router.front import ANSWERED_AS, ERRORS, FAST_BODY_BYTES, desired_pins
from shardline.online.router.placement import rank
from shardline.online.tenants import TenantDirectory
from shardline.processes import Child, spawn

if TYPE_CHECKING:
    from shardline.online.router.router import Router

log = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 5.0
START_TIMEOUT_S = 10.0  # for nginx to make its control socket
MODULES = Path("/usr/lib/nginx/modules")
LUA_MODULES = ("ndk_http_module.so", "ngx_http_lua_module.so")
RESTY_CORE = Path("/usr/share/lua/5.1/resty/core.lua")  # lua-resty-core, which the Lua module needs
REDIS_CLIENT = Path("/usr/share/lua/5.1/nginx/redis.lua")  # lua-nginx-redis: the lane's quotas in a quota store
# The configuration's files in nginx's folder, by the template (package data beside this module) each is made of.
CONFIG_FILES = {"nginx.conf": "nginx_front.conf", "fast.conf": "nginx_front_fast.conf",
                "router.conf": "nginx_front_router.conf"}
LANE, LANE_SETTINGS = "front_lane.lua", "front_settings.lua"
_PLACEHOLDER = re.compile(r"\{\{ (\w+) \}\}")


def find_nginx() -> str | None:
    """The nginx executable, when it and its Lua module (with lua-resty-core) are installed; else None."""
    found = shutil.which("nginx")
    if found is None and os.access("/usr/sbin/nginx", os.X_OK):
        found = "/usr/sbin/nginx"
    if found is None or not all((MODULES / m).exists() for m in LUA_MODULES) or not RESTY_CORE.exists():
        return None
    return found


def choose_front(setting: str) -> str | None:
    """The nginx executable the router puts in front of itself (``SHARDLINE_ROUTER_DATA_PLANE``, with its Lua
    module); None for the router alone.

    Raises:
        InvalidSetting: ``nginx`` asked for and not installed.
    """
    if setting == "python":
        return None
    nginx = find_nginx()
    if nginx is not None:
        return nginx
    if setting == "nginx":
        raise InvalidSetting("SHARDLINE_ROUTER_DATA_PLANE=nginx but nginx or its Lua module is not installed: "
                             "apt-get install nginx-light libnginx-mod-http-lua (Debian's packages), or set it "
                             "to auto or python")
    log.warning("nginx with its Lua module is not installed: the router relays every request itself (slower: "
                "docs/routing.md); apt-get install nginx-light libnginx-mod-http-lua to put nginx in front")
    return None


@dataclass(frozen=True)
class NginxLayout:
    """What nginx's configuration is made of (``render_config``)."""

    folder: Path  # private (0700): its configuration, Lua, sockets, log, and the router's socket
    listen_fd: int  # the router's listening socket, bound by the router, inherited by nginx
    listen: str  # that socket's address as nginx's ``listen`` names it (it matches the inherited one by it)
    router_key: str
    balance: float
    retries: int
    request_timeout_s: float
    max_timeout_s: float
    hold_s: float  # how long a replica whose connection failed (or whose try stalled) is kept out of the fast lane
    stall_s: float = 0.0  # a try's bound (all but the last), at least: ``RouterSettings.stall_ms``
    quota_store: str | None = None  # SHARDLINE_TENANCY_QUOTA_STORE: the lane holds the quotas there (Redis)
    quota_routers: int = 1  # SHARDLINE_TENANCY_QUOTA_STORE_ROUTERS: the lane's share while Redis is unreachable

    @property
    def router_socket(self) -> Path:
        return self.folder / "router.sock"

    @property
    def control_socket(self) -> Path:
        return self.folder / "control.sock"


def listen_address(host: str, port: int) -> str:
    """``listen``'s form of an address: ``[v6]:port`` or ``v4:port``."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def lua_literal(value: Any) -> str:
    """``value`` (str, int, float, bool, None, list, dict with str keys) as a Lua expression; every byte of a
    string outside a plain set is a decimal escape, so no value can end a string or a bracket early."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        plain = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ._-/:@+,;()'"
        return '"' + "".join(chr(b) if b in plain else f"\\{b:03d}" for b in value.encode()) + '"'
    if isinstance(value, (list, tuple)):
        return "{" + ", ".join(lua_literal(v) for v in value) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"[{lua_literal(str(k))}] = {lua_literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no Lua form for {type(value).__name__}")


def lua_settings(layout: NginxLayout, tenants: TenantDirectory) -> str:
    """front_settings.lua: the tenants' key digests and quotas, and the lane's settings (fixed for nginx's life).

    With a quota store (``layout.quota_store``) also the store (``quota_store.lane_store``: its server and the
    scripts) and, for each tenant, its keys there, its local allowance (``quota_store.allowance``) and its share of
    each quota while Redis cannot be reached (``TenantGate``'s 1/N: ``worker_share``)."""
    store, routers = layout.quota_store, layout.quota_routers
    quotas = {}
    for tenant in tenants.tenants.values():
        rate = tenant.rate
        if rate is None and tenant.max_concurrent is None:
            continue
        quota: dict[str, Any] = {"rate": float(rate.requests_per_second) if rate else 0.0,
                                 "burst": rate.burst if rate else 0, "most": tenant.max_concurrent or 0,
                                 "shown": f"{rate.requests_per_second if rate else 0:g}"}
        if store is not None:
            quota["share"] = {"rate": quota["rate"] / routers, "shown": quota["shown"],
                              "burst": worker_share(rate.burst, routers) if rate else 0,
                              "most": worker_share(tenant.max_concurrent, routers) if tenant.max_concurrent else 0}
            quota["keys"] = {"rate": quota_key(tenant.name, "rate"), "inflight": quota_key(tenant.name, "inflight")}
            quota["allowance"] = allowance(rate.requests_per_second, rate.burst) if rate else 0
        quotas[tenant.name] = quota
    return "return " + lua_literal({
        "tenants": dict(tenants.digests()), "quotas": quotas, "retries": layout.retries,
        "balance": layout.balance, "fast_body": FAST_BODY_BYTES, "hold": layout.hold_s,
        "stall": layout.stall_s, "request_timeout": layout.request_timeout_s,
        "router": f"unix:{layout.router_socket}",
        "store": None if store is None else lane_store(store, routers)}) + "\n"


def _v2_error(message: str) -> str:
    """A V2 error body as a single-quoted string of nginx's configuration."""
    return "'{\"error\": \"" + message.replace("\\", "\\\\").replace("'", "\\'") + "\"}'"


def render(template: str, values: dict[str, str]) -> str:
    """One of this package's nginx templates (``nginx_front*.conf``) with each ``{{ name }}`` filled in.

    Raises:
        KeyError: the template names a value not given (a template and its renderer out of step).
    """
    text = resources.files("shardline.online.router").joinpath(template).read_text()
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def render_config(layout: NginxLayout) -> dict[str, str]:
    """nginx's configuration for the layout, by file name: ``nginx.conf`` and the two lanes' proxying it includes
    (``fast.conf``, ``router.conf``), from the templates shipped beside this module (checked by ``nginx -t`` in
    the tests)."""
    key = layout.router_key.replace("\\", "\\\\").replace('"', '\\"').replace("$", "${dollar}")
    # As root nginx would run its worker as nobody, which cannot reach the private folder: the router's user.
    user = ""
    if os.geteuid() == 0:
        user = f"user {pwd.getpwuid(os.geteuid()).pw_name} {grp.getgrgid(os.getegid()).gr_name};\n"
    values = {
        "folder": str(layout.folder), "listen": layout.listen, "router_socket": str(layout.router_socket),
        "control_socket": str(layout.control_socket), "user": user, "router_key": key,
        "load_modules": "\n".join(f"load_module {MODULES / module};" for module in LUA_MODULES),
        "request_timeout": f"{layout.request_timeout_s:g}s", "stream_timeout": f"{layout.max_timeout_s + 10:g}s",
        "tenant_header": TENANT_HEADER, "gated_header": GATED_HEADER, "variant_header": VARIANT_HEADER,
        "error_pages": "\n".join(f"        error_page {code}{f' ={ANSWERED_AS[code]}' if code in ANSWERED_AS else ''} @e{code};"
                                  for code in ERRORS),
        "error_locations": "\n".join(
            f"        location @e{code} {{ default_type application/json; log_by_lua_block {{ lane.done() }} "
            + ("add_header Retry-After 1 always; " if retry else "")
            + f"return {ANSWERED_AS.get(code, code)} {_v2_error(message)}; }}"
            for code, (message, retry) in ERRORS.items()),
    }
    return {name: render(template, values) for name, template in CONFIG_FILES.items()}


@dataclass
class _Pushed:
    state: str = ""  # the state last pushed (without its generation)
    generation: int = 0


@dataclass
class _Addresses:
    """Replica hosts resolved to addresses (nginx's balancer takes an address, not a name)."""

    found: dict[str, str] = field(default_factory=dict)

    async def of(self, host: str) -> str | None:
        try:
            ipaddress.ip_address(host)
            return host
        except ValueError:
            pass
        if host not in self.found:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, None)
            except OSError:
                return None
            self.found[host] = str(infos[0][4][0])
        return self.found[host]


class NginxFront:
    """nginx in front of the router: its files, its process, and the control socket that keeps it true."""

    def __init__(self, nginx: str, layout: NginxLayout, tenants: TenantDirectory) -> None:
        self.nginx = nginx
        self.layout = layout
        self.tenants = tenants
        self.process: Child | None = None
        self._pushed = _Pushed()
        self._pinning = asyncio.Lock()
        self._addresses = _Addresses()
        self._totals: dict[str, tuple[int, int]] = {}  # group -> the lane's (requests, retries), as last read
        self._pins: dict[str, str] = {}  # as last logged
        self._budget_off = False  # as last logged
        self._store = (0, 0, True)  # the lane's quota store counts as last read: fallbacks, outages, Redis up
        self._refused: dict[tuple[str, str], int] = {}  # (tenant, quota) -> the lane's 429s, as last read

    @property
    def folder(self) -> Path:
        return self.layout.folder

    @property
    def router_socket(self) -> Path:
        return self.layout.router_socket

    def write_files(self) -> None:
        """The configuration (``render_config``), the lane's Lua and its settings."""
        folder = self.layout.folder
        for name, text in render_config(self.layout).items():
            (folder / name).write_text(text)
        (folder / LANE).write_text(resources.files("shardline.online.router").joinpath(LANE).read_text())
        (folder / LANE_SETTINGS).write_text(lua_settings(self.layout, self.tenants))
        for path in folder.iterdir():
            if path.is_file():
                path.chmod(0o600)

    def start(self) -> None:
        """Write the files and start nginx on the router's listening socket (it stops with the router).

        Raises:
            InvalidSetting: nginx refused its configuration or did not start.
        """
        self.write_files()
        self._pushed = _Pushed(generation=self._pushed.generation)
        self._totals = {}  # a new nginx counts from zero
        self._store = (0, 0, True)
        self._refused = {}
        folder, fd, ready = self.layout.folder, self.layout.listen_fd, self.layout.control_socket
        ready.unlink(missing_ok=True)  # a dead one's: the new one's tells it is up
        # Its own session: a terminal's Ctrl-C reaches the router, which stops it gracefully.
        self.process = spawn("nginx", [self.nginx, "-p", str(folder), "-e", str(folder / "nginx.log"), "-c",
                                       str(folder / "nginx.conf")], folder / "nginx.log",
                             env={**os.environ, "NGINX": f"{fd};"}, pass_fds=(fd,), own_session=True)
        try:
            self.process.wait_ready(ready.exists, START_TIMEOUT_S)
        except ChildNotReady as e:
            self.process = None
            raise InvalidSetting(f"{e}; set SHARDLINE_ROUTER_DATA_PLANE=python to run the router alone") from e
        log.info("nginx %d in front of the router (its files in %s)", self.process.pid, folder)

    def stop(self) -> None:
        """Stop nginx (SIGQUIT: it finishes the requests it holds; SIGKILL past ``processes.GRACE_S``)."""
        process, self.process = self.process, None
        if process is not None:
            process.stop(signum=signal.SIGQUIT)
        self.layout.control_socket.unlink(missing_ok=True)

    async def control(self, method: str, path: str, body: bytes = b"") -> str:
        """One request to the lane's control socket; its answer's body."""
        reader, writer = await asyncio.open_unix_connection(str(self.layout.control_socket))
        try:
            writer.write(f"{method} {path} HTTP/1.0\r\nHost: control\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                         + body)
            await writer.drain()
            async with asyncio.timeout(CONTROL_TIMEOUT_S):
                answer = await reader.read()
        finally:
            writer.close()
        head, _, text = answer.partition(b"\r\n\r\n")
        if not head.startswith((b"HTTP/1.1 200", b"HTTP/1.0 200")):
            raise RuntimeError(f"nginx's control socket answered {head[:200]!r} {text[:500]!r} to {method} {path}")
        return text.decode(errors="replace")

    async def sync(self, router: Router) -> None:
        """Bring nginx up to date with the router and read its counts back; an nginx that exited is started again
        (it holds the listening socket: the endpoint goes on)."""
        if self.process is None or self.process.poll() is not None:
            if self.process is not None:
                log.error("nginx exited (code %s); starting it again", self.process.returncode)
            await asyncio.get_running_loop().run_in_executor(None, self.start)
        generation = await self._read_counts(router)
        if generation != self._pushed.generation:
            self._pushed.state = ""  # a new worker starts empty: push it all
        await self.sync_pins(router)

    async def sync_pins(self, router: Router) -> None:
        """Push the state when it changed (``desired_pins``, the replicas, the order, the active group, the retry
        budget): also called by the rollout book each time it has read the aliases, so that a rollout's requests
        all reach the router before it reports the rollout seen."""
        if self.process is None:
            return
        async with self._pinning:
            state = await self._state(router)
            if state == self._pushed.state:
                return
            generation = self._pushed.generation + 1
            await self.control("POST", "/state", f"local s = {state}\ns.generation = {generation}\nreturn s\n".encode())
            self._pushed = _Pushed(state, generation)

    async def _state(self, router: Router) -> str:
        now = time.monotonic()
        pins = desired_pins(router)
        for key in self._pins.keys() - pins.keys():
            log.info("fast lane: %s to the router", key)
        for key, value in pins.items():
            if self._pins.get(key) != value:
                log.info("fast lane: %s -> %s", key, value)
        self._pins = pins
        replicas: dict[str, dict[str, Any]] = {}
        members: dict[str, list[str]] = {}
        for group, urls in router.replicas.groups():
            members[group] = []
            for url in urls:
                replica = router.replicas.replicas.get(url)
                parts = urlsplit(url)
                address = await self._addresses.of(parts.hostname or "")
                if replica is None or address is None:
                    continue
                members[group].append(url)
                replicas[url] = {"group": group, "ip": f"[{address}]" if ":" in address else address,
                                 "port": parts.port or 80,
                                 "up": router.replicas.available(replica, now)}
        # The router's order (``ReplicaSet.order``): the active group's replicas in the version's rendezvous order,
        # then the other groups' by priority (a retry goes there once the active group is spent).
        active = router.replicas.active_group()
        groups = sorted(members, key=lambda g: g != active)
        order = {}
        for pin in sorted(set(pins.values())):
            name, _, version = pin.partition("/versions/")
            order[pin] = [url for group in groups for url in rank(f"{name}:{version}", members[group])]
        return lua_literal({"pins": pins, "replicas": replicas, "order": order, "active": active,
                            "retries_off": not router.retry_budget.has_room(now)})

    async def _read_counts(self, router: Router) -> int:
        """The lane's requests in flight and taken by pinned version (name:version), in flight by replica, into the
        router's metrics (``front_*``); each group's requests and retries since the last read into its retry budget.
        Returns the worker's state generation."""
        generation = -1
        store: tuple[int, int, bool] | None = None
        in_flight, requests, replicas = {}, {}, {}
        taken: dict[str, tuple[int, int]] = {}
        refused: dict[tuple[str, str], int] = {}
        for line in (await self.control("GET", "/counts")).splitlines():
            kind, _, rest = line.partition(" ")
            cells = rest.split(" ")
            if kind == "generation":
                generation = int(cells[0])
            elif kind == "pin" and len(cells) == 3:
                model = cells[0].replace("/versions/", ":")
                in_flight[model], requests[model] = int(cells[1]), int(cells[2])
            elif kind == "replica" and len(cells) == 4:  # url, in flight, up (1/0), tries sent
                replicas[cells[0]] = int(cells[1])
            elif kind == "group" and len(cells) == 3:
                taken[cells[0]] = (int(cells[1]), int(cells[2]))
            elif kind == "store" and len(cells) == 3:  # fallbacks, outages, Redis up (1/0)
                store = (int(cells[0]), int(cells[1]), cells[2] == "1")
            elif kind == "refused" and len(cells) == 3:  # tenant, quota, requests refused (429)
                refused[(cells[0], cells[1])] = int(cells[2])
        metrics = router.metrics
        metrics.front_in_flight, metrics.front_requests, metrics.front_replicas = in_flight, requests, replicas
        now = time.monotonic()
        if generation != self._pushed.generation:
            self._totals = {}  # a worker nginx started anew counts from zero
            self._store = (0, 0, True)
            self._refused = {}
        if store is not None:
            self._store_counts(router, store)
        for group, (requested, retried) in taken.items():
            before_taken, before_retried = self._totals.get(group, (0, 0))
            router.retry_budget.record(now, max(0, requested - before_taken), max(0, retried - before_retried))
            self._totals[group] = (requested, retried)
        metrics.front_retries = {group: retried for group, (_, retried) in self._totals.items()}
        for counted, total in refused.items():  # into the router's own count of its refusals
            metrics.rate_limited[counted] += max(0, total - self._refused.get(counted, 0))
        self._refused = refused
        budget_off = not router.retry_budget.has_room(now)
        if budget_off != self._budget_off:
            self._budget_off = budget_off
            log.warning("fast lane: out of the retry budget, answers are passed on unretried" if budget_off else
                        "fast lane: within the retry budget again, answers are retried")
        return generation

    def _store_counts(self, router: Router, store: tuple[int, int, bool]) -> None:
        """The lane's requests admitted on its share while Redis was unreachable, into the router's
        ``shardline_router_quota_store_fallbacks_total``; each outage the lane saw logged once (a warning), and Redis
        answering again (info)."""
        fallbacks, outages, up = store
        before_fallbacks, before_outages, was_up = self._store
        if router.quotas is not None and fallbacks > before_fallbacks:
            router.quotas.fallbacks.inc(fallbacks - before_fallbacks)
        if outages > before_outages:
            log.warning("quota store %s unreachable from nginx's lane: it holds 1/%d of every quota until Redis "
                        "answers", self.layout.quota_store, self.layout.quota_routers)
        if up and (not was_up or outages > before_outages):
            log.info("quota store %s answers nginx's lane again: quotas are shared again", self.layout.quota_store)
        if router.quotas is not None and (outages > before_outages or up != was_up):
            router.quotas.up.set(1 if up else 0)
        self._store = (fallbacks, outages, up)
