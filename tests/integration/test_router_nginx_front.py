"""nginx in front of the router (online/router/nginx_front.py): its configuration, checked by nginx itself; the
settings and state it is given as Lua (key digests and quotas, never keys; strings that cannot break out); and
the lane's state pushed and its counts read back through the control socket of a real nginx; a pinned request
sent on as the router sends it (to an IPv6 replica), and to the router once no replica is left to try; nginx's own
errors in the V2 form."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import http.server
import os
import re
import socket
import socketserver
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import redis as redis_py

from shardline.errors import InvalidSetting
from shardline.local_ports import reserve_port
from shardline.online import quota_store
from shardline.online.quota_store import ADMIT, RENEW, key, lane_store
from shardline.online.router.nginx_front import (
    CONFIG_FILES,
    REDIS_CLIENT,
    NginxFront,
    NginxLayout,
    choose_front,
    find_nginx,
    listen_address,
    lua_literal,
    lua_settings,
    render_config,
)
from shardline.online.tenants import TenantDirectory, hash_api_key
from tests.support.redis_server import redis_server

NGINX = find_nginx()
needs_nginx = pytest.mark.skipif(NGINX is None, reason=(
    "nginx's Lua module is not installed (apt-get install nginx-light libnginx-mod-http-lua)"))

TENANTS = TenantDirectory.from_config({"tenants": [
    {"name": "acme", "api_keys_sha256": [hash_api_key("k-acme")], "models": ["churn@prod", "iris:3"],
     "rate": {"requests_per_second": 2.5, "burst": 5}, "max_concurrent": 4},
    {"name": "free", "api_keys_sha256": [hash_api_key("k-free-1"), hash_api_key("k-free-2")], "models": ["churn"]},
]})


def _layout(folder: Path, listener: socket.socket, key: str = "router-key-0123456789",
            store: str | None = None) -> NginxLayout:
    host, port = listener.getsockname()[:2]
    return NginxLayout(folder=folder, listen_fd=listener.fileno(), listen=listen_address(host, port), router_key=key,
                       balance=1.25, retries=2, request_timeout_s=30.0, max_timeout_s=300.0, hold_s=1.5,
                       quota_store=store, quota_routers=3)


def _unescaped(literal: str) -> str:
    """A Lua string literal as ``lua_literal`` writes it, read back (plain bytes and decimal escapes only)."""
    assert literal[0] == literal[-1] == '"'
    body = literal[1:-1]
    assert re.fullmatch(r'(?:[A-Za-z0-9 ._\-/:@+,;()\']|\\\d{3})*', body), body
    return re.sub(rb"\\(\d{3})", lambda m: bytes([int(m.group(1))]), body.encode()).decode()


@pytest.mark.parametrize("text", ["plain-name_1.2", 'a"quote\\back]]bracket\nline\x00nul', "tenant 'x' ünïcode"])
def test_a_lua_string_cannot_break_out_of_its_quotes(text: str) -> None:
    assert _unescaped(lua_literal(text)) == text
    assert lua_literal({"k": [1, 2.5, True, None]}) == '{["k"] = {1, 2.5, true, nil}}'


def test_the_settings_hold_key_digests_and_quotas_never_keys(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        text = lua_settings(_layout(tmp_path, listener), TENANTS)
    assert "k-acme" not in text and "k-free" not in text
    for key, tenant in (("k-acme", "acme"), ("k-free-1", "free"), ("k-free-2", "free")):
        assert f'["{hash_api_key(key)}"] = "{tenant}"' in text
    assert '["acme"] = {["rate"] = 2.5, ["burst"] = 5, ["most"] = 4, ["shown"] = "2.5"}' in text
    assert '["free"]' not in text.split('["quotas"]')[1]  # free has no quota: not checked


def test_with_a_quota_store_the_settings_hold_the_routers_scripts_keys_and_shares(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        text = lua_settings(_layout(tmp_path, listener, store="redis://:s3cret@redis.internal:6380/2"), TENANTS)
    assert lua_literal(ADMIT) in text and lua_literal(RENEW) in text  # the router's own scripts, and their SHA1
    assert f'["admit_sha"] = "{hashlib.sha1(ADMIT.encode()).hexdigest()}"' in text
    assert f'["renew_sha"] = "{hashlib.sha1(RENEW.encode()).hexdigest()}"' in text
    for part in ('["host"] = "redis.internal"', '["port"] = 6380', '["db"] = 2', '["password"] = "s3cret"',
                 '["routers"] = 3', '["lease_ttl_ms"] = 30000'):
        assert part in text
    # acme: 2.5 requests/s, burst 5, 4 in flight; while Redis is unreachable a third of each (rounded up)
    assert ('["share"] = {["rate"] = 0.8333333333333334, ["shown"] = "2.5", ["burst"] = 2, ["most"] = 2}, '
            f'["keys"] = {{["rate"] = {lua_literal(key("acme", "rate"))}, '
            f'["inflight"] = {lua_literal(key("acme", "inflight"))}}}, '
            '["allowance"] = 1') in text
    with pytest.raises(ValueError, match="TLS"):
        lane_store("rediss://redis.internal:6380/0", 3)


def test_the_templates_and_their_renderer_are_in_step(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:  # a KeyError here: a template names an unknown value
        files = render_config(_layout(tmp_path, listener, "k{{ listen }}$x"))
    assert set(files) == set(CONFIG_FILES) == {"nginx.conf", "fast.conf", "router.conf"}
    assert not any("{{ " in text.replace("k{{ listen }}", "") for text in files.values())  # each one filled in
    assert 'Authorization "Bearer k{{ listen }}${dollar}x";' in files["fast.conf"]  # a value is not rendered again
    assert "Authorization" not in files["nginx.conf"] + files["router.conf"]


@needs_nginx
@pytest.mark.parametrize(("key", "store"), [("router-key-0123456789", None),
                                            ('a"quote\\back$dollar%percent-key', None),
                                            ("router-key-0123456789", "redis://127.0.0.1:6379/0")])
def test_nginx_accepts_the_configuration(tmp_path: Path, key: str, store: str | None) -> None:
    """Also with a quota store: the lane then loads Redis's Lua client (lua-nginx-redis) when nginx starts."""
    assert NGINX is not None
    if store is not None and not REDIS_CLIENT.exists():
        pytest.skip("Redis's Lua client is not installed (apt-get install lua-nginx-redis)")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.set_inheritable(True)
        edge = NginxFront(NGINX, _layout(tmp_path, listener, key, store), TENANTS)
        edge.write_files()
        checked = subprocess.run([NGINX, "-t", "-p", str(tmp_path), "-e", str(tmp_path / "nginx.log"), "-c",
                                  str(tmp_path / "nginx.conf")], capture_output=True, text=True,
                                 pass_fds=(listener.fileno(),), env={**os.environ, "NGINX": f"{listener.fileno()};"})
    assert checked.returncode == 0, checked.stdout + checked.stderr
    text = (tmp_path / "nginx.conf").read_text()
    assert "proxy_next_upstream error timeout http_502 http_503 http_504 non_idempotent;" in text
    assert "proxy_next_upstream error timeout non_idempotent;" in text  # out of the retry budget: connections only
    assert f"server unix:{tmp_path}/router.sock;" in text and "worker_processes 1;" in text
    assert f"include {tmp_path}/fast.conf;" in text and f"include {tmp_path}/router.conf;" in text
    written = ("nginx.conf", "fast.conf", "router.conf", "front_lane.lua", "front_settings.lua")
    assert {(tmp_path / name).stat().st_mode & 0o777 for name in written} == {0o600}  # the router's key is in it
    assert not any("{{" in (tmp_path / name).read_text() for name in written)  # every placeholder filled in
    assert "proxy_set_header Authorization" in (tmp_path / "fast.conf").read_text()


def _router() -> SimpleNamespace:
    """What the edge reads of a router: two groups of two replicas, churn@prod at version 2."""
    groups = [("gpu", ["http://127.0.0.1:9101", "http://127.0.0.1:9102"]), ("cpu", ["http://localhost:9201"])]
    replicas = {url: SimpleNamespace(url=url) for _, urls in groups for url in urls}
    recorded: list[tuple[int, int]] = []
    return SimpleNamespace(
        settings=SimpleNamespace(hedge_after_ms=0.0), activator=None, fallbacks={}, tenants=TENANTS,
        budgets=SimpleNamespace(states={}),  # no tenant past its budget's soft limit
        rollouts=SimpleNamespace(moves={("churn", "prod"): SimpleNamespace(version=2, action="set", rollout=None)}),
        replicas=SimpleNamespace(groups=lambda: groups, replicas=replicas, active_group=lambda: "gpu",
                                 available=lambda replica, now: replica.url != "http://127.0.0.1:9102"),
        retry_budget=SimpleNamespace(has_room=lambda now: True, record=lambda now, n, r: recorded.append((n, r))),
        metrics=SimpleNamespace(front_in_flight={}, front_requests={}, front_replicas={}, front_retries={}),
        recorded=recorded)


@needs_nginx
def test_the_router_pushes_its_state_and_a_restarted_worker_is_pushed_again(tmp_path: Path) -> None:
    assert NGINX is not None
    router = _router()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.set_inheritable(True)
        edge = NginxFront(NGINX, _layout(tmp_path, listener), TENANTS)
        edge.start()
        try:
            async def run() -> tuple[str, str]:
                await edge.sync(router)  # type: ignore[arg-type]
                first = await edge.control("GET", "/counts")
                worker = next(int(p) for p in os.listdir("/proc") if p.isdigit() and _is_worker(int(p), edge))
                os.kill(worker, 9)  # nginx's master starts a new one, empty
                for _ in range(100):
                    await asyncio.sleep(0.05)
                    try:
                        if (await edge.control("GET", "/counts")).startswith("generation 0"):
                            break
                    except (OSError, RuntimeError):
                        continue
                await edge.sync(router)  # type: ignore[arg-type]
                return first, await edge.control("GET", "/counts")
            first, again = asyncio.run(run())
        finally:
            edge.stop()
    assert first.startswith("generation 1\n") and again.startswith("generation 2\n")  # the new worker pushed anew
    for counts in (first, again):
        rows = {line.split()[1]: line.split()[2:] for line in counts.splitlines() if line.startswith("replica ")}
        # up as the router sees them; a host name resolved to an address (nginx's balancer takes addresses)
        assert rows == {"http://127.0.0.1:9101": ["0", "1", "0"], "http://127.0.0.1:9102": ["0", "0", "0"],
                        "http://localhost:9201": ["0", "1", "0"]}
    assert not edge.layout.control_socket.exists()


def _is_worker(pid: int, edge: NginxFront) -> bool:
    """Whether ``pid`` is the worker of ``edge``'s nginx."""
    assert edge.process is not None
    try:
        return (Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"nginx: worker process")
                and Path(f"/proc/{pid}/stat").read_text().split()[3] == str(edge.process.pid))
    except OSError:
        return False


def test_the_data_plane_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert choose_front("python") is None
    if NGINX is not None:
        assert choose_front("auto") == NGINX  # nginx in front where its Lua module is installed
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr("shardline.online.router.nginx_front.os.access", lambda *_: False)
    assert choose_front("auto") is None
    with pytest.raises(InvalidSetting, match="apt-get install nginx-light libnginx-mod-http-lua"):
        choose_front("nginx")


@needs_nginx
def test_nginxs_own_errors_are_json_and_say_when_to_retry(tmp_path: Path) -> None:
    """With nothing behind it (no router on its socket), a request of either lane gets nginx's 502 in the V2 form."""
    assert NGINX is not None
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.set_inheritable(True)
        edge = NginxFront(NGINX, _layout(tmp_path, listener), TENANTS)
        edge.start()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        try:
            answers = [httpx.get(f"{url}/v2/health/ready"),
                       httpx.post(f"{url}/v2/models/churn/infer", content=b"{}",
                                  headers={"Authorization": "Bearer k-acme"})]
        finally:
            edge.stop()
    for answer in answers:
        assert answer.status_code == 502 and answer.headers["retry-after"] == "1"
        assert answer.json() == {"error": "no replica gave a valid answer; retry after the Retry-After seconds"}


class _Recording(http.server.BaseHTTPRequestHandler):
    """An HTTP server's handler that records each POST's path, key and tenant and answers ``answer``."""

    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, str | None, str | None]] = []
    answer: tuple[int, bytes] = (200, b"{}")

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("content-length", 0)))
        type(self).seen.append((self.path, self.headers.get("authorization"), self.headers.get("x-shardline-tenant")))
        status, body = self.answer
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def address_string(self) -> str:
        return "stub"  # a unix socket's client has no address

    def log_message(self, *args: Any) -> None:
        pass


class _Replica(_Recording):
    """A replica that answers every inference."""

    seen: list[tuple[str, str | None, str | None]] = []
    answer = (200, b'{"model_version": "2"}')


class _ServerV6(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6
    daemon_threads = True


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@needs_nginx
@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_the_fast_lane_sends_the_pinned_version_with_the_routers_key_to_an_ipv6_replica(tmp_path: Path) -> None:
    assert NGINX is not None
    _Replica.seen = []
    stub = _ServerV6(("::1", 0), _Replica)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    url = f"http://[::1]:{stub.server_address[1]}"
    router = _router()
    router.replicas = SimpleNamespace(groups=lambda: [("v6", [url])], replicas={url: SimpleNamespace(url=url)},
                                      active_group=lambda: "v6", available=lambda replica, now: True)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.set_inheritable(True)
        edge = NginxFront(NGINX, _layout(tmp_path, listener), TENANTS)
        edge.start()
        try:
            asyncio.run(edge.sync(router))  # type: ignore[arg-type]
            answer = httpx.post(f"http://127.0.0.1:{listener.getsockname()[1]}/v2/models/churn/infer", content=b"{}",
                                headers={"Authorization": "bearer k-acme", "X-Shardline-Tenant": "free"})
        finally:
            edge.stop()
            stub.shutdown()
    assert answer.status_code == 200 and answer.json() == {"model_version": "2"}, answer.text
    # the pinned version's path, the router's key, the tenant nginx authenticated (the client's claim dropped)
    assert _Replica.seen == [("/v2/models/churn/versions/2/infer", "Bearer router-key-0123456789", "acme")]


class _RouterStub(_Recording):
    """The router behind nginx, answering 503 as a router with no replica up does."""

    seen: list[tuple[str, str | None, str | None]] = []
    answer = (503, b'{"error": "no replica can take the request now"}')


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


@needs_nginx
def test_with_no_replica_left_to_try_a_request_goes_to_the_router(tmp_path: Path) -> None:
    """The router holds both replicas up, but neither listens (stopped a moment ago): the fast lane tries each,
    then sends the request on to the router as it rewrote it; the next one goes to the router straight away."""
    assert NGINX is not None
    _RouterStub.seen = []
    router = _router()
    dead = [f"http://127.0.0.1:{reserve_port()}", f"http://127.0.0.1:{reserve_port()}"]
    router.replicas = SimpleNamespace(groups=lambda: [("gone", dead)], replicas={u: SimpleNamespace(url=u) for u in dead},
                                      active_group=lambda: "gone", available=lambda replica, now: True)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.set_inheritable(True)
        edge = NginxFront(NGINX, _layout(tmp_path, listener), TENANTS)
        stub = _UnixServer(str(edge.layout.router_socket), _RouterStub)
        threading.Thread(target=stub.serve_forever, daemon=True).start()
        edge.start()
        try:
            asyncio.run(edge.sync(router))  # type: ignore[arg-type]
            url = f"http://127.0.0.1:{listener.getsockname()[1]}/v2/models/churn/infer"
            answers = [httpx.post(url, content=b"{}", headers={"Authorization": "Bearer k-acme"}) for _ in range(2)]
        finally:
            edge.stop()
            stub.shutdown()
    assert [a.status_code for a in answers] == [503, 503]  # the router's answer, passed on
    assert answers[0].json() == {"error": "no replica can take the request now"}
    assert _RouterStub.seen == [
        ("/v2/models/churn/versions/2/infer", "Bearer router-key-0123456789", "acme"),  # after both replicas failed
        ("/v2/models/churn/infer", "Bearer k-acme", None),  # straight to the router: both are out for a while
    ]


class _SlowRouter(_Recording):
    """The router behind nginx, taking ``hold`` seconds over each request."""

    seen: list[tuple[str, str | None, str | None]] = []
    hold = 1.5

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        time.sleep(self.hold)
        super().do_POST()


@needs_nginx
def test_with_a_quota_store_the_lane_holds_leases_in_redis_renews_them_and_falls_back_to_its_share(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """max_concurrent 2 in Redis: of 3 requests at once the third is refused; their leases outlive the TTL (0.9 s
    here) while they run, renewed, and are given back when they end; with Redis gone the lane admits on its share
    (a third of 2: 1) and counts it."""
    assert NGINX is not None
    if not REDIS_CLIENT.exists():
        pytest.skip("Redis's Lua client is not installed (apt-get install lua-nginx-redis)")
    monkeypatch.setattr(quota_store, "LEASE_TTL_S", 0.9)  # renewed every 0.3 s
    redis = redis_server(tmp_path)
    tenants = TenantDirectory.from_config({"tenants": [
        {"name": "capped", "api_keys_sha256": [hash_api_key("k-capped")], "models": ["churn"], "max_concurrent": 2}]})
    leases = key("capped", "inflight")
    client = redis_py.Redis(port=redis.port)
    try:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            listener.set_inheritable(True)
            edge = NginxFront(NGINX, _layout(tmp_path, listener, store=redis.url), tenants)
            stub = _UnixServer(str(edge.layout.router_socket), _SlowRouter)
            threading.Thread(target=stub.serve_forever, daemon=True).start()
            edge.start()
            url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1/embeddings"

            def post() -> httpx.Response:
                return httpx.post(url, content=b"{}", headers={"Authorization": "Bearer k-capped"}, timeout=10)

            try:
                with concurrent.futures.ThreadPoolExecutor(3) as pool:
                    started = [pool.submit(post) for _ in range(3)]
                    time.sleep(1.2)  # past the leases' TTL: renewed, still held
                    held = client.zrange(leases, 0, -1, withscores=True)
                    redis_ms = client.time()[0] * 1000
                    answers = sorted((f.result() for f in started), key=lambda a: a.status_code)
                time.sleep(0.2)
                after = client.zcard(leases)
                counts = asyncio.run(edge.control("GET", "/counts"))
                redis.stop()
                _SlowRouter.hold = 0.0
                alone = post()
                down = asyncio.run(edge.control("GET", "/counts"))
            finally:
                _SlowRouter.hold = 1.5
                edge.stop()
                stub.shutdown()
    finally:
        redis.stop()
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert "tenant 'capped' has 2 requests in flight, its max_concurrent" in answers[2].text
    assert answers[2].headers["retry-after"] == "1"
    assert len(held) == 2 and all(score > redis_ms for _, score in held)  # renewed past their first expiry
    assert all(member.startswith(b"nginx-") for member, _ in held)
    assert after == 0  # given back as each request ended
    assert "store 0 0 1" in counts.splitlines()
    assert alone.status_code == 200  # Redis gone: admitted on the lane's share
    assert "store 1 1 0" in down.splitlines()
