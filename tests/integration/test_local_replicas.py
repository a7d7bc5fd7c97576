"""The router's local replicas (``LocalReplicas``: real ``shardline serve`` processes on loopback) on ports the router
binds and hands over: every replica serves even when each pick's first choice collides (the failure of issue 33:
one replica handed another's port, never up), and a replica whose port another process took while it was down is
started again on new ports and serves. The router following it there is tests/e2e/test_router_local_ports.py's."""

from __future__ import annotations

import errno
import hashlib
import logging
import socket
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from shardline import local_ports
from shardline.online.router.local import LocalReplicas
from shardline.online.tenants import hash_api_key

pytestmark = pytest.mark.timeout(300)


class Clock:
    """The replicas' clock, moved on by the test (their restart back-off)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def tenants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A tenants file, and a Shardline home (an empty registry) for the replicas, which inherit this environment."""
    monkeypatch.setenv("SHARDLINE_STORAGE_HOME", str(tmp_path / "home"))
    for name in ("SHARDLINE_ONLINE_WORKERS", "SHARDLINE_ONLINE_METRICS_HOST"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "tenants.yaml"
    path.write_text(f'tenants:\n  - name: acme\n    api_keys_sha256: ["{hash_api_key("sk-acme")}"]\n'
                    '    models: ["breast-cancer@prod"]\n')
    return str(path)


def _replicas(count: int, tenants: str, folder: Path, clock: Clock | None = None) -> LocalReplicas:
    digest = hashlib.sha256(b"router-key").hexdigest()
    if clock is None:
        return LocalReplicas(count, tenants, digest, folder / "logs")
    return LocalReplicas(count, tenants, digest, folder / "logs", clock=clock)


def _wait_serving(local: LocalReplicas, timeout: float = 120) -> None:
    """Until every running replica answers ready on its port, and metrics on its metrics port."""
    deadline = time.monotonic() + timeout
    for replica in local.replicas:
        if not replica.running:
            continue
        while True:
            assert replica.process is not None and replica.process.poll() is None, _log(local, replica.index)
            try:
                ready = httpx.get(f"{replica.url}/v2/health/ready", timeout=5)
                metrics = httpx.get(f"http://127.0.0.1:{replica.metrics_port}/metrics", timeout=5)
                if ready.status_code == 200 and metrics.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, _log(local, replica.index)
            time.sleep(0.2)


def _log(local: LocalReplicas, index: int) -> str:
    path = local.log_dir / f"replica-{index}.log"
    return path.read_text(errors="replace")[-3000:] if path.exists() else "no log"


@pytest.fixture()
def stopped() -> Iterator[list[LocalReplicas]]:
    """Replicas the test started, stopped however it ends."""
    started: list[LocalReplicas] = []
    yield started
    for local in started:
        local.stop()


def test_every_replica_serves_when_each_pick_first_tries_a_port_already_taken(
    tenants: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stopped: list[LocalReplicas]
) -> None:
    # Each pick first tries a port already taken: one a socket of this test holds, and every port the picks
    # before it got, which the replicas' reservations hold (the collision of issue 33: replica 2 was handed
    # replica 1's metrics port). The OS refuses each for real; the pick moves on.
    taken = socket.create_server(("127.0.0.1", 0))
    bound: list[int] = []
    refused: list[int] = []
    real_listening, real_tries = local_ports._listening, local_ports.tries

    def listening(host: str, port: int) -> socket.socket:
        try:
            sock = real_listening(host, port)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                refused.append(port)
            raise
        bound.append(int(sock.getsockname()[1]))
        return sock

    def colliding(prefer: int = 0) -> Iterator[int]:
        yield from [int(taken.getsockname()[1]), *bound]
        yield from real_tries(prefer)

    monkeypatch.setattr(local_ports, "_listening", listening)
    monkeypatch.setattr(local_ports, "tries", colliding)
    # None of the ports other tests in this process reserved: once out of TIME_WAIT the OS may hand one out
    # again, and a pick passes it over (bound, recorded above, then closed), so later picks skip it unrefused.
    monkeypatch.setattr(local_ports, "_reserved", set())
    try:
        local = _replicas(3, tenants, tmp_path)
        stopped.append(local)
        ports = [p for r in local.replicas for p in (r.port, r.metrics_port)]
        assert len(refused) == 6 + (1 + 2 + 3 + 4 + 5)  # every first choice collided, each later pick with more
        assert len(set(ports)) == 6 and taken.getsockname()[1] not in ports

        local.start()
        _wait_serving(local)
    finally:
        taken.close()
    assert len(local.urls) == 3 and all(r.restarts == 0 for r in local.replicas)


def test_a_replica_whose_port_was_taken_while_it_was_down_starts_again_on_new_ports_and_serves(
    tenants: str, tmp_path: Path, stopped: list[LocalReplicas], caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    local = _replicas(2, tenants, tmp_path, clock)
    stopped.append(local)
    local.start()
    _wait_serving(local)
    victim, other = local.replicas
    old_url, old_ports, other_url = victim.url, (victim.port, victim.metrics_port), other.url
    assert victim.process is not None
    victim.process.kill()
    victim.process.wait()
    takers = [socket.create_server(("127.0.0.1", port)) for port in old_ports]  # another server binds them by number
    try:
        with caplog.at_level(logging.WARNING, logger="shardline.online.router.local"):
            assert local.watch() == []  # seen gone: started again after its back-off
            clock.now += 1.0
            assert local.watch() == [victim.url]
        assert victim.url != old_url and victim.metrics_port not in old_ports and victim.restarts == 1
        assert f"another process took its port meanwhile; it moves from {old_url} to {victim.url}" in caplog.text
        _wait_serving(local)
        assert local.urls == [victim.url, other_url]
    finally:
        for sock in takers:
            sock.close()

    # Down again with its ports free: it comes back on the same ones (the router's members stay as they are).
    moved = victim.url
    assert victim.process is not None
    victim.process.kill()
    victim.process.wait()
    assert local.watch() == []
    clock.now += 2.0
    assert local.watch() == [] and victim.url == moved and victim.restarts == 2
    _wait_serving(local)


def test_a_replica_of_several_worker_processes_serves_on_the_sockets_it_was_handed(
    tenants: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stopped: list[LocalReplicas]
) -> None:
    monkeypatch.setenv("SHARDLINE_ONLINE_WORKERS", "2")  # the replicas inherit the router's environment
    local = _replicas(1, tenants, tmp_path)
    stopped.append(local)
    local.start()
    _wait_serving(local)
    assert "Uvicorn running on socket ('127.0.0.1', %d)" % local.replicas[0].port in _log(local, 0)
