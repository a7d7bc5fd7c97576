"""Ports for local processes (``shardline.local_ports``) on real sockets, and the places that start a process on one:
a reserved port is never handed out twice, and a child that binds its port itself and exits because another
process took it is started again on a new port: vLLM's server (a stand-in that binds as vLLM does,
tests/fakes/vllm_server) and the home's local Prefect server (a real one). The router's replicas, which are handed
their sockets, are tests/integration/test_local_replicas.py's."""

from __future__ import annotations

import errno
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from shardline import local_ports
from shardline.cli import prefect_server as _prefect_server
from shardline.local_ports import inherited, listener, release, reserve_port
from shardline.runtimes.vllm import VllmServer

FAKE_VLLM = Path(__file__).resolve().parents[1] / "fakes" / "vllm_server"


def _bind(port: int, reuse: bool) -> socket.socket:
    """A socket bound on loopback ``port`` and listening, as a server binds one by number (``reuse``:
    with SO_REUSEADDR, as uvicorn, nginx and vLLM do)."""
    sock = socket.socket()
    if reuse:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock


def _os_picks(count: int) -> set[int]:
    """The ports the OS hands ``count`` binds to port 0 (each held until all are bound, so all differ)."""
    held = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            held.append(sock)
        return {int(s.getsockname()[1]) for s in held}
    finally:
        for sock in held:
            sock.close()


# -- the helper ------------------------------------------------------------------------------------------------


def test_a_listeners_port_is_no_one_elses_until_it_is_closed_then_it_can_be_had_again() -> None:
    sock = listener()
    port = int(sock.getsockname()[1])
    try:
        with pytest.raises(OSError) as taken:
            _bind(port, reuse=True)
        assert taken.value.errno == errno.EADDRINUSE
        assert port not in _os_picks(2000)
    finally:
        sock.close()
    again = listener(prefer=port)  # a restarted child's: its old port, free again
    assert again.getsockname()[1] == port
    again.close()


def test_a_preferred_port_another_process_holds_gives_a_new_one() -> None:
    with _bind(0, reuse=True) as other:
        port = int(other.getsockname()[1])
        with listener(prefer=port) as sock:
            assert sock.getsockname()[1] not in (port, 0)


def test_a_reserved_port_can_be_bound_by_a_server_but_is_handed_to_no_other_pick() -> None:
    port = reserve_port()
    try:
        with pytest.raises(OSError) as plain:  # a bind without SO_REUSEADDR, as any pick of port 0 makes
            _bind(port, reuse=False)
        assert plain.value.errno == errno.EADDRINUSE
        assert port not in _os_picks(2000)
        assert len({reserve_port() for _ in range(50)} | {port}) == 51
        with _bind(port, reuse=True):  # the child it was for binds it (SO_REUSEADDR: uvicorn's, nginx's, vLLM's)
            pass
        # In this process it stays reserved until released, even where the OS would hand it out: a listener that
        # prefers it (as a restarted replica prefers its old port) gets another.
        with listener(prefer=port) as sock:
            assert sock.getsockname()[1] != port
        release(port)
        with listener(prefer=port) as sock:
            assert sock.getsockname()[1] == port
    finally:
        release(port)


def test_a_reservation_is_given_back_while_free_and_moved_when_another_process_took_it() -> None:
    port = reserve_port()
    assert reserve_port(prefer=port) == port  # its child exited for another reason: the same port
    with _bind(port, reuse=True):  # another process bound it by number meanwhile
        moved = reserve_port(prefer=port)
    assert moved != port
    assert port not in local_ports._reserved and moved in local_ports._reserved
    release(moved)


def test_a_child_serves_on_the_socket_it_was_handed() -> None:
    sock = listener()
    got = inherited(os.dup(sock.fileno()))
    assert got.getsockname() == sock.getsockname() and got.family == socket.AF_INET and got.proto == 0
    got.close()
    sock.close()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        with pytest.raises(ValueError, match="not a TCP socket"):
            inherited(udp.fileno())
    with socket.socket() as unbound:
        with pytest.raises(ValueError, match="not bound to a port"):
            inherited(unbound.fileno())
    with pytest.raises(OSError):
        inherited(os.open(os.devnull, os.O_RDONLY))


# -- vLLM's server: it binds its port itself -------------------------------------------------------------------


@pytest.fixture()
def vllm_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[VllmServer]:
    """The ``vllm`` runtime's supervisor of vLLM's server, over the stand-in server."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE_VLLM), os.environ.get("PYTHONPATH", "")]))
    server = VllmServer(sys.executable, tmp_path / "bundle", "tiny", [], 64, 60.0, tmp_path / "vllm.log")
    try:
        yield server
    finally:
        server.stop()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_vllm_that_exits_because_its_port_was_taken_starts_again_on_a_new_one(vllm_server: VllmServer,
                                                                               tmp_path: Path) -> None:
    moved_to: list[str] = []
    vllm_server.on_moved = moved_to.append
    first = vllm_server.port
    with _bind(first, reuse=True):  # another server bound the reserved port by number before vLLM did
        vllm_server.start()
        assert vllm_server.port != first and moved_to == [vllm_server.url]
        assert _healthy(vllm_server.url)
        assert f"error while attempting to bind on address ('127.0.0.1', {first})" in (tmp_path / "vllm.log").read_text()

        # Running, it dies; meanwhile another process takes its port: it is started again on a new one.
        second = vllm_server.port
        assert vllm_server.process is not None
        vllm_server.process.kill()
        vllm_server.process.wait()
        with _bind(second, reuse=True):
            deadline = time.monotonic() + 30
            while vllm_server.restarts == 0 or not _healthy(vllm_server.url):
                assert time.monotonic() < deadline, (tmp_path / "vllm.log").read_text()[-2000:]
                time.sleep(0.2)
    assert vllm_server.port not in (first, second) and moved_to == [f"http://127.0.0.1:{p}" for p in
                                                                     (second, vllm_server.port)]


def test_vllm_that_exits_for_another_reason_is_not_moved(vllm_server: VllmServer, tmp_path: Path) -> None:
    from shardline.errors import RuntimeUnavailable

    vllm_server.python = str(tmp_path / "python")  # exits at once: not a Python at all
    (tmp_path / "python").write_text("#!/bin/sh\nexit 7\n")
    (tmp_path / "python").chmod(0o755)
    port = vllm_server.port
    with pytest.raises(RuntimeUnavailable, match="exited with code 7 while starting"):
        vllm_server.start()
    assert vllm_server.port == port


# -- the home's local Prefect server: it binds its port itself ---------------------------------------------------


@pytest.mark.timeout(300)
def test_the_local_prefect_server_whose_port_was_taken_is_started_on_a_new_one(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[socket.socket] = []

    def taken_first(host: str = "127.0.0.1", prefer: int = 0) -> int:
        """The helper's pick, taken at once by another process that binds it by number (the first time only)."""
        port = reserve_port(host, prefer)
        if not taken:
            taken.append(_bind(port, reuse=True))
        return port

    monkeypatch.setattr(_prefect_server, "reserve_port", taken_first)
    home = tmp_path / "home"
    try:
        server, started = _prefect_server.ensure(home, timeout_s=240)
        first = int(taken[0].getsockname()[1])
        assert started and server.api_url != f"http://127.0.0.1:{first}/api"
        assert _prefect_server.healthy(server.api_url)
        assert _prefect_server.find(home) == server  # the record names the server on its new port
        log = (_prefect_server.server_dir(home) / _prefect_server.LOG).read_text()
        # Prefect's words for a port taken ("Port N is already in use", or, its pid file there, "already running")
        assert re.search(rf"Port {first} is already in use|already running on port {first}\.", log), log[-2000:]
    finally:
        _prefect_server.stop(home)
        for sock in taken:
            sock.close()
