"""HAProxy in front of the router (online/router/edge.py): its configuration, checked by haproxy itself;
the maps the router writes (key digests, quotas, pins); and which models are pinned for the fast lane."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardline.online.router.data_plane import desired_pins, find_haproxy
from shardline.online.router.edge import Edge, EdgeLayout, quota_entries, render_config, tenant_entries
from shardline.online.tenants import TenantDirectory, hash_api_key
from shardline.storage.registry import AliasMove
from shardline.storage.rollouts import Rollout

HAPROXY = find_haproxy()
needs_haproxy = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (apt-get install haproxy)")

TENANTS = TenantDirectory.from_config({"tenants": [
    {"name": "acme", "api_keys_sha256": [hash_api_key("k-acme")], "models": ["churn@prod", "iris:3", "minilm@staging"],
     "rate": {"requests_per_second": 2.5, "burst": 5}, "max_concurrent": 4},
    {"name": "free", "api_keys_sha256": [hash_api_key("k-free-1"), hash_api_key("k-free-2")], "models": ["churn"]},
]})


def _layout(folder: Path, key: str = "router-key-0123456789", fd: int = 3) -> EdgeLayout:
    return EdgeLayout(folder=folder, listen_fd=fd, groups=(("gpu-east", 2), ("cpu", 32)), router_key=key,
                      balance=1.25, retries=2, request_timeout_s=30.0, max_timeout_s=300.0,
                      health_interval_s=1.0)


@needs_haproxy
@pytest.mark.parametrize("key", ["router-key-0123456789", 'a"quote\\back$dollar%percent-key'])
def test_haproxy_accepts_the_configuration_and_the_lua_quota_check(tmp_path: Path, key: str) -> None:
    assert HAPROXY is not None
    with socket.create_server(("127.0.0.1", 0)) as listener:
        edge = Edge(HAPROXY, _layout(tmp_path, key, listener.fileno()), TENANTS)
        edge.write_files({"acme/churn": "churn/versions/2"})
        checked = subprocess.run([HAPROXY, "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True,
                                 pass_fds=(listener.fileno(),))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    text = (tmp_path / "haproxy.cfg").read_text()
    assert "hash-balance-factor 125" in text and "retries 2" in text and "error-limit 1 on-error mark-down" in text
    assert text.count(f"server router unix@{tmp_path}/router.sock backup") == 2  # a group with none up: the router
    assert "server-template r 1-2 " in text and "server-template r 1-32 " in text
    assert text.index("g_gpu-east if") < text.index("g_cpu if")  # groups in priority order
    assert (tmp_path / "pins.map").read_text() == "acme/churn churn/versions/2\n"
    assert {p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == {0o600}  # the router's key is in it


def test_the_maps_hold_key_digests_and_quotas_never_keys(tmp_path: Path) -> None:
    digests = tenant_entries(TENANTS)
    assert digests == {hash_api_key("k-acme"): "acme", hash_api_key("k-free-1"): "free",
                       hash_api_key("k-free-2"): "free"}
    assert quota_entries(TENANTS) == {"acme": "2.5,5,4,2.5"}  # free has no quota: not checked


def _router(moves: dict[tuple[str, str], AliasMove | None], **settings: float) -> SimpleNamespace:
    return SimpleNamespace(
        settings=SimpleNamespace(hedge_after_ms=settings.get("hedge_after_ms", 0.0)), activator=None,
        rollouts=SimpleNamespace(moves=moves), fallbacks={}, tenants=TENANTS)


def _move(version: int, rollout: Rollout | None = None) -> AliasMove:
    return AliasMove(seq=1, alias="prod", version=version, action="canary" if rollout else "set", by="test",
                     rollout=rollout)


def test_pins_follow_the_aliases_and_leave_a_rolling_out_model_to_the_router() -> None:
    router = _router({("churn", "prod"): _move(2)})
    # minilm@staging is not read yet: not pinned; iris:3 is pinned by the tenants file
    assert desired_pins(router) == {"acme/churn": "churn/versions/2", "acme/iris": "iris/versions/3",  # type: ignore[arg-type]
                                    "free/churn": "churn/versions/2"}
    rollout = Rollout(id="r1", baseline=2, candidate=3, mode="canary", steps=(1, 100))
    router.rollouts.moves[("churn", "prod")] = _move(2, rollout)
    assert desired_pins(router) == {"acme/iris": "iris/versions/3"}  # type: ignore[arg-type]
    router.fallbacks = {("iris", "cpu"): "int8"}
    assert desired_pins(router) == {}  # type: ignore[arg-type]
    assert desired_pins(_router({("churn", "prod"): _move(2)}, hedge_after_ms=50.0)) == {}  # type: ignore[arg-type]

