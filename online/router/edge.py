"""The router's data plane on HAProxy, where nginx's Lua module (``nginx_edge``, the default) is not installed:
HAProxy in front, this router as its control plane (docs/routing.md).

A Python process adds ~250 us of CPU and two wake-ups to every request it relays, which is more
than nginx adds in all (bench/README.md). So when HAProxy is the data plane, ``shardline router``
starts it on the router's address and listens itself on a private unix socket behind it. HAProxy
answers the steady path natively, the *fast lane*:

- ``POST /v2/models/{name}/infer`` of a tenant whose key is in the tenants file (HAProxy looks the
  key's sha256 up in a map of digests: keys stay hashed), when the router has *pinned* the
  tenant's model to a version (``pins``: no rollout on its alias, no fallback variant, no hedging),
  without ``X-Shardline-Timeout-Ms`` or ``X-Shardline-Route-Key``, with a body of at most
  ``FAST_BODY_BYTES`` (buffered whole, so a failed try can be sent again);
- sent to the active group's replicas by consistent hashing of the pinned version with bounded
  loads (``hash-balance-factor``: c x 100), retried on another replica after a failed connection,
  an empty answer or a 502-504, within ``retries`` and the router's retry budget (below); replicas
  checked actively (``/v2/health/ready`` every ``health_interval_s``, every 250 ms while down) and
  passively (``observe layer4``: a failed connection marks a replica down until a check passes).
  With none of the group up, a request goes on to the router as rewritten (it takes its own key),
  which fails over to the next group.

Everything else goes to the router over its socket as before (``/v1``, streams, rollouts, shadows,
deadlines and route keys, hedging, fallbacks, the activator, health and metadata). The tenants'
rate and concurrency quotas are held in HAProxy for every request of both lanes (a token bucket in
Lua, the same as ``admission.TokenBucket``, and a stick table counting each tenant's requests in
flight), with the router's own answers (429, ``Retry-After``, the protocol's error form); the router
does not count a request HAProxy has already admitted (``GATED_HEADER``).

The router keeps HAProxy true through its runtime API every ``SYNC_S``: the pins (``set map``),
the active group (failover with its hysteresis stays the router's), each group's replicas in
server slots (addresses from DNS or the local replicas; a slot in maintenance while the router
has ejected its replica or opened its breaker), and reads back what the fast lane carries (each
replica's and model's requests in flight, requests taken, and each group's requests and retries) for
its metrics and its scaler. The fast lane's requests and retries count in the router's one retry
budget; when it has no room left the router tells HAProxy (the ``retries`` map) and the fast lane
stops retrying answers (``disable-l7-retry``: an empty answer or a 502-504 is passed on as it came)
until it has room again. A connection that failed is still tried on another replica: that request
never reached one, so trying it elsewhere adds no load to a failing replica set. The budget is read
every ``SYNC_S``, so the fast lane may pass it by at most one half second's retries.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from shardline.online.router.data_plane import (
    ERRORS,
    GATED_HEADER,
    FAST_BODY_BYTES,
    desired_pins,
    start_process,
    stop_process,
)
from shardline.online.tenants import TenantDirectory

if TYPE_CHECKING:
    from shardline.online.router.router import Router

log = logging.getLogger(__name__)

# HAProxy's buffer: a fast-lane request (headers and body) fits in one. Not larger: for an L7 retry HAProxy 2.6
# copies the whole buffer, whatever the request's size, before every fast-lane request is sent (128 KiB cost
# ~75 us more CPU a request at 100/s than 16 or 32 KiB, which cost alike: bench/README.md).
BUFSIZE = 32_768
DNS_SLOTS = 32  # server slots of a group found by DNS (addresses past them are served by the router alone)
_TABLE_ROW = re.compile(r"key=(\S+) use=(\d+).*?http_req_cnt=(\d+)")


@dataclass(frozen=True)
class EdgeLayout:
    """What HAProxy's configuration is made of (``render_config``)."""

    folder: Path  # private (0700): its configuration, maps, admin socket, log, and the router's socket
    listen_fd: int  # the router's listening socket, bound by the router, inherited by HAProxy
    groups: tuple[tuple[str, int], ...]  # (group name, server slots), in priority order
    router_key: str
    balance: float
    retries: int
    request_timeout_s: float
    max_timeout_s: float
    health_interval_s: float

    @property
    def router_socket(self) -> Path:
        return self.folder / "router.sock"

    @property
    def admin_socket(self) -> Path:
        return self.folder / "admin.sock"

    def map_file(self, name: str) -> Path:
        return self.folder / f"{name}.map"


def _quoted(value: str) -> str:
    """``value`` inside a double-quoted log-format argument of HAProxy's configuration."""
    return re.sub(r'([\\"$])', r"\\\1", value).replace("%", "%%")


def _v2_error(message: str) -> str:
    return '{"error": "' + message + '"}'


def render_config(layout: EdgeLayout) -> str:
    """HAProxy's configuration for the layout (checked by ``haproxy -c`` in the tests)."""
    m = layout.map_file
    fast = "fast"
    lines = [
        "global",
        f"    stats socket {layout.admin_socket} mode 600 level admin",
        f"    lua-load {layout.folder / 'quotas.lua'}",
        f"    tune.bufsize {BUFSIZE}",
        "",
        "defaults",
        "    mode http",
        "    timeout connect 2s",
        f"    timeout client {layout.max_timeout_s + 10:g}s",  # a stream's client waits as long as its server
        "    timeout http-request 30s",
        "    timeout http-keep-alive 75s",
        f"    timeout server {layout.max_timeout_s + 10:g}s",
        "    timeout queue 2s",
        "    http-reuse always",
        *(f"    http-error status {code} content-type application/json string '{_v2_error(message)}'"
          + (" hdr retry-after 1" if retry else "") for code, (message, retry) in ERRORS.items() if code != 500),
        "",
        "frontend shardline",
        f"    bind fd@{layout.listen_fd}",
        # Set here only: a client's copies are dropped.
        "    http-request del-header x-shardline-tenant",
        f"    http-request del-header {GATED_HEADER}",
        "    http-request del-header x-shardline-variant",
        # The tenant: the sha256 of its key in the digests map (what TenantDirectory.authenticate accepts).
        "    http-request set-var(txn.tenant) req.fhdr(authorization),regsub(\"^bearer +\",\"\",i),sha2(256),hex,lower,"
        f"map({m('tenants')}) if {{ req.fhdr(authorization) -m found }}",
        "    acl tenant var(txn.tenant) -m found",
        "    http-request track-sc0 var(txn.tenant) table quotas if tenant",
        f"    http-request set-var(txn.quota) var(txn.tenant),map({m('quotas')}) if tenant",
        "    http-request lua.shardline_quota if tenant { var(txn.quota) -m found }",
        f"    http-request set-header {GATED_HEADER} %[var(txn.tenant)] if tenant",
        # The fast lane: a pinned model's V2 inference, nothing the router must see.
        "    acl infer path_reg ^/v2/models/[^/]+/infer$",
        "    acl deadline req.hdr_cnt(x-shardline-timeout-ms) gt 0",
        "    acl keyed req.hdr_cnt(x-shardline-route-key) gt 0",
        "    acl chunked req.hdr_cnt(transfer-encoding) gt 0",
        f"    acl small req.hdr(content-length) -m int le {FAST_BODY_BYTES}",
        "    http-request set-var(txn.model) path,field(4,/) if tenant METH_POST infer small !deadline !keyed !chunked",
        f"    http-request set-var(txn.pin) var(txn.tenant),concat(/,txn.model),map({m('pins')}) "
        "if { var(txn.model) -m found }",
        f"    acl {fast} var(txn.pin) -m found",
        f"    http-request set-var(txn.group) str(active),map({m('groups')}) if {fast}",
        f"    http-request track-sc1 var(txn.pin) table models if {fast}",
        f"    http-request set-path /v2/models/%[var(txn.pin)]/infer if {fast}",
        f"    http-request set-header authorization \"Bearer {_quoted(layout.router_key)}\" if {fast}",
        f"    http-request set-header x-shardline-tenant %[var(txn.tenant)] if {fast}",
        f"    http-request del-header {GATED_HEADER} if {fast}",
        # Out of the router's retry budget: answers are passed on as they came (a failed connection is still retried).
        f"    http-request disable-l7-retry if {fast} {{ str(l7),map({m('retries')}) -m str off }}",
    ]
    for name, _ in layout.groups:
        lines.append(f"    use_backend g_{name} if {fast} {{ var(txn.group) -m str {name} }} {{ nbsrv(g_{name}) gt 0 }}")
    lines += [
        "    default_backend router",
        "",
        "backend quotas",  # a tenant's requests in flight (the trackers of its entry)
        "    stick-table type string len 64 size 100k store http_req_cnt",
        "",
        "backend models",  # a pinned model version's fast-lane requests: in flight, and taken
        "    stick-table type string len 200 size 100k store http_req_cnt",
        "",
        "backend router",
        f"    server router unix@{layout.router_socket}",
    ]
    check_ms = max(100, round(layout.health_interval_s * 1000))
    for name, slots in layout.groups:
        lines += [
            "",
            f"backend g_{name}",
            "    balance hash var(txn.pin)",
            "    hash-type consistent",
            f"    hash-balance-factor {max(100, round(layout.balance * 100))}",
            "    option http-buffer-request",
            f"    retries {layout.retries}",
            "    retry-on conn-failure empty-response 502 503 504",
            "    option redispatch 1",
            f"    timeout server {layout.request_timeout_s:g}s",
            "    option httpchk GET /v2/health/ready",
            "    http-check expect status 200",
            f"    server-template r 1-{slots} 127.0.0.1:1 disabled check inter {check_ms} downinter 250 rise 1 "
            "fall 2 observe layer4 error-limit 1 on-error mark-down",
            # With none of the group's replicas up, the request goes to the router as HAProxy has rewritten it
            # (the router takes its own key: ``Router.handle``), which fails over to the next group.
            f"    server router unix@{layout.router_socket} backup",
        ]
    return "\n".join(lines) + "\n"


# The quota check, for both lanes: concurrency first, then a token of the rate (TenantGate's order and
# messages). The quotas map holds "rate,burst,max_concurrent,rate as the router writes it" per tenant
# (0: no such quota). One Lua state for all of HAProxy's threads (lua-load): the buckets are global.
QUOTA_LUA = r"""
local buckets = {}

local function refuse(txn, tenant, message, wait)
  local body
  if string.sub(txn.sf:path(), 1, 4) == "/v1/" then
    body = '{"error": {"message": "' .. message .. '", "type": "rate_limit_error", "param": null, ' ..
           '"code": "rate_limit_exceeded"}}'
  else
    body = '{"error": "' .. message .. '"}'
  end
  local headers = {["content-type"] = {"application/json"}, ["retry-after"] = {tostring(wait)}}
  local id = txn.sf:req_hdr("x-request-id")
  if id ~= nil and id ~= "" then headers["x-request-id"] = {id} end
  txn:done(txn:reply({status = 429, body = body, headers = headers}))
end

core.register_action("shardline_quota", {"http-req"}, function(txn)
  local quota = txn:get_var("txn.quota")
  local tenant = txn:get_var("txn.tenant")
  local rate, burst, most, shown = string.match(quota, "^([^,]+),([^,]+),([^,]+),(.*)$")
  rate, burst, most = tonumber(rate), tonumber(burst), tonumber(most)
  if most > 0 then
    local others = math.floor(txn.sf:sc0_trackers()) - 1
    if others >= most then
      refuse(txn, tenant, "tenant '" .. tenant .. "' has " .. string.format("%d", others) .. " requests in flight, its max_concurrent; " ..
             "wait for one to finish or ask for a larger quota", 1)
      return
    end
  end
  if rate > 0 then
    local t = core.now()
    local now = t.sec + t.usec / 1000000
    local b = buckets[tenant]
    if b == nil or b.rate ~= rate or b.burst ~= burst then
      b = {tokens = burst, at = now, rate = rate, burst = burst}
      buckets[tenant] = b
    end
    if now > b.at then
      b.tokens = math.min(burst, b.tokens + (now - b.at) * rate)
      b.at = now
    end
    if b.tokens >= 1 then
      b.tokens = b.tokens - 1
    else
      local wait = math.max(1, math.ceil((1 - b.tokens) / rate))
      refuse(txn, tenant, "tenant '" .. tenant .. "' is over its rate of " .. shown .. " requests/s (burst " ..
             burst .. "); retry after " .. wait .. " s", wait)
    end
  end
end)
"""


def tenant_entries(tenants: TenantDirectory) -> dict[str, str]:
    """The digests map: a key's sha256 (hex) -> its tenant."""
    return dict(tenants.digests())


def quota_entries(tenants: TenantDirectory) -> dict[str, str]:
    """The quotas map: tenant -> ``rate,burst,max_concurrent,rate shown`` (0: none), for the tenants with one."""
    found = {}
    for tenant in tenants.tenants.values():
        rate = tenant.rate
        if rate is None and tenant.max_concurrent is None:
            continue
        found[tenant.name] = (f"{rate.requests_per_second if rate else 0!r},{rate.burst if rate else 0},"
                              f"{tenant.max_concurrent or 0},{rate.requests_per_second if rate else 0:g}")
    return found


@dataclass
class _Pushed:
    """What HAProxy holds now, as the router last set it."""

    pins: dict[str, str] = field(default_factory=dict)
    group: str | None = None
    slots: dict[str, tuple[str, int]] = field(default_factory=dict)  # replica url -> (group, slot)
    servers: dict[tuple[str, int], tuple[str, str]] = field(default_factory=dict)  # (group, slot) -> (address, state)
    retries_off: bool = False  # the fast lane out of the retry budget: answers are not retried


class Edge:
    """HAProxy in front of the router: its files, its process, and the runtime API that keeps it true."""

    def __init__(self, haproxy: str, layout: EdgeLayout, tenants: TenantDirectory) -> None:
        self.haproxy = haproxy
        self.layout = layout
        self.tenants = tenants
        self.process: subprocess.Popen[bytes] | None = None
        self._pushed = _Pushed()
        self._pinning = asyncio.Lock()
        self._totals: dict[str, tuple[int, int]] = {}  # group -> its fast lane's (requests, retries), as last read

    def write_files(self, pins: dict[str, str] | None = None) -> None:
        """The configuration, the Lua quota check and the maps (pins as given; the router adds them once it knows)."""
        folder = self.layout.folder
        (folder / "haproxy.cfg").write_text(render_config(self.layout))
        (folder / "quotas.lua").write_text(QUOTA_LUA)
        for name, entries in (("tenants", tenant_entries(self.tenants)), ("quotas", quota_entries(self.tenants)),
                              ("pins", pins or {}), ("groups", {}), ("retries", {})):
            self.layout.map_file(name).write_text("".join(f"{k} {v}\n" for k, v in entries.items()))
        for path in folder.iterdir():
            path.chmod(0o600)

    def start(self) -> None:
        """Write the files and start HAProxy on the router's listening socket (it stops with the router).

        Raises:
            InvalidSetting: HAProxy refused its configuration or did not start.
        """
        self.write_files(self._pushed.pins)
        self._pushed = _Pushed(pins=dict(self._pushed.pins))
        self._totals = {}  # a new HAProxy counts from zero
        self.process = start_process(
            "haproxy", [self.haproxy, "-db", "-f", str(self.layout.folder / "haproxy.cfg")], self.layout.folder,
            self.layout.admin_socket, self.layout.listen_fd)

    def stop(self) -> None:
        """Stop HAProxy (SIGUSR1: it finishes the requests it holds; SIGKILL after ``STOP_GRACE_S``)."""
        process, self.process = self.process, None
        stop_process(process, signal.SIGUSR1, self.layout.admin_socket)

    async def command(self, line: str) -> str:
        """One runtime API command's answer."""
        reader, writer = await asyncio.open_unix_connection(str(self.layout.admin_socket))
        try:
            writer.write(line.encode() + b"\n")
            await writer.drain()
            return (await reader.read()).decode(errors="replace")
        finally:
            writer.close()

    async def sync(self, router: Router) -> None:
        """Bring HAProxy up to date with the router (pins, active group, replicas) and read its counts back;
        a HAProxy that exited is started again (it holds the listening socket: the endpoint goes on)."""
        if self.process is None or self.process.poll() is not None:
            if self.process is not None:
                log.error("haproxy exited (code %s); starting it again", self.process.returncode)
            await asyncio.get_running_loop().run_in_executor(None, self.start)
        await self.sync_pins(router)
        await self._push_group(router.replicas.active_group())
        await self._push_servers(router)
        await self._read_counts(router)
        await self._push_budget(router)

    async def sync_pins(self, router: Router) -> None:
        """Bring the pins up to date (``desired_pins``): also called by the rollout book each time it has read the
        aliases, so that a rollout's requests all reach the router before it reports the rollout seen."""
        if self.process is None:
            return
        async with self._pinning:  # the book's call and the periodic one, one at a time
            wanted = desired_pins(router)
            pushed = self._pushed.pins
            file = self.layout.map_file("pins")
            for key in [k for k in pushed if k not in wanted]:
                await self.command(f"del map {file} {key}")
                del pushed[key]
                log.info("fast lane: %s to the router", key)
            for key, value in wanted.items():
                if pushed.get(key) == value:
                    continue
                verb = "set" if key in pushed else "add"
                await self.command(f"{verb} map {file} {key} {value}")
                pushed[key] = value
                log.info("fast lane: %s -> %s", key, value)

    async def _push_group(self, group: str | None) -> None:
        if group == self._pushed.group:
            return
        file = self.layout.map_file("groups")
        if group is None:
            await self.command(f"del map {file} active")
        else:
            await self.command(f"{'set' if self._pushed.group is not None else 'add'} map {file} active {group}")
        self._pushed.group = group

    async def _push_servers(self, router: Router) -> None:
        now = time.monotonic()
        slots_of = dict(self.layout.groups)
        pushed = self._pushed
        members = {url: group for group, urls in router.replicas.groups() for url in urls}
        for url in [u for u in pushed.slots if members.get(u) != pushed.slots[u][0]]:
            del pushed.slots[url]
        for url, group in members.items():
            if url in pushed.slots:
                continue
            taken = {slot for g, slot in pushed.slots.values() if g == group}
            free = next((s for s in range(1, slots_of.get(group, 0) + 1) if s not in taken), None)
            if free is None:
                continue  # more replicas than slots: the router alone sends them requests
            pushed.slots[url] = (group, free)
        used = {where: url for url, where in pushed.slots.items()}
        for group, slots in self.layout.groups:
            for slot in range(1, slots + 1):
                member = used.get((group, slot))
                replica = router.replicas.replicas.get(member) if member is not None else None
                if replica is None:
                    address, state = "-", "maint"
                else:
                    parts = urlsplit(replica.url)
                    address = f"{parts.hostname} port {parts.port or 80}"
                    state = "maint" if now < replica.ejected_until or replica.breaker.closed_to(now) else "ready"
                before = pushed.servers.get((group, slot))
                if before == (address, state):
                    continue
                server = f"g_{group}/r{slot}"
                if address != "-" and (before is None or before[0] != address):
                    await self.command(f"set server {server} addr {address}")
                if before is None or before[1] != state:
                    await self.command(f"set server {server} state {state}")
                pushed.servers[(group, slot)] = (address, state)

    async def _push_budget(self, router: Router) -> None:
        """Let the fast lane retry answers while the router's retry budget has room, and stop it when not."""
        off = not router.budget.has_room(time.monotonic())
        if off == self._pushed.retries_off:
            return
        file = self.layout.map_file("retries")
        await self.command(f"add map {file} l7 off" if off else f"del map {file} l7")
        self._pushed.retries_off = off
        log.warning("fast lane: out of the retry budget, answers are passed on unretried" if off else
                    "fast lane: within the retry budget again, answers are retried")

    async def _read_counts(self, router: Router) -> None:
        """The fast lane's requests in flight and taken, by pinned model version (name:version), and in flight by
        replica url, from HAProxy's tables into the router's metrics (``edge_*``); each group's requests and
        retries since the last read into the router's retry budget."""
        metrics = router.metrics
        in_flight, requests = {}, {}
        for match in _TABLE_ROW.finditer(await self.command("show table models")):
            model = match.group(1).replace("/versions/", ":")
            in_flight[model] = int(match.group(2))
            requests[model] = int(match.group(3))
        by_slot = {where: url for url, where in self._pushed.slots.items()}
        replicas: dict[str, int] = {}
        # Per group: the requests its backend took, the tries its servers took (the router's backup server's
        # included), and those passed on to the router (which counts them itself). Each try is a session of a
        # server, so the retries are the tries less the requests (HAProxy 2.6's wretr counts an L7 retry twice).
        taken: dict[str, list[int]] = {}  # group -> [requests, tries, to the router]
        lines = (await self.command("show stat")).splitlines()
        if lines and lines[0].startswith("# "):
            header = lines[0][2:].split(",")
            name, server, current, total = (header.index(k) for k in ("pxname", "svname", "scur", "stot"))
            for row in lines[1:]:
                cells = row.split(",")
                if len(cells) <= max(current, total) or not cells[name].startswith("g_"):
                    continue
                group, server_name, sessions = cells[name][2:], cells[server], int(cells[total] or 0)
                counts = taken.setdefault(group, [0, 0, 0])
                if server_name == "BACKEND":
                    counts[0] += sessions
                    continue
                counts[1] += sessions
                if server_name == "router":
                    counts[2] += sessions
                elif server_name[1:].isdigit():
                    url = by_slot.get((group, int(server_name[1:])))
                    if url is not None:
                        replicas[url] = int(cells[current] or 0)
        metrics.edge_in_flight, metrics.edge_requests, metrics.edge_replicas = in_flight, requests, replicas
        now = time.monotonic()
        for group, (requested, tries, to_router) in taken.items():
            now_taken, now_retried = requested - to_router, max(0, tries - requested)
            before_taken, before_retried = self._totals.get(group, (0, 0))
            router.budget.record(now, max(0, now_taken - before_taken), max(0, now_retried - before_retried))
            self._totals[group] = (now_taken, now_retried)
        metrics.edge_retries = {group: retried for group, (_, retried) in self._totals.items()}
