"""Ports for the local processes Shardline starts, chosen so that two can never be given one port.

A port found by binding port 0 and closing the socket at once is free only at that instant: the next pick,
in this process or another, may be handed the same port before the child it was for has bound it (two of
``shardline router --local-replicas``' replicas were once given one port that way, and one never came up).
Here a port stays reserved until the child holds it, in one of two ways, by what the child can do:

- ``listener()``: a socket bound and listening here, handed to the child (``Popen(pass_fds=...)``), which
  serves on it (``shardline serve --fd``, as nginx does with its ``NGINX`` variable); ``inherited()`` is
  the child's side. The port is this process's from the bind and the child's from its start, so nothing can
  take it in between: the way wherever the child can serve an inherited socket. (Listening, so that no
  other bind succeeds on it; a connection made before the child serves waits in the backlog.)
- ``reserve_port()``: a port number, for a child that binds it itself (vLLM's server, Prefect's, the
  benchmarks' servers). The port is left in TIME_WAIT: for a minute no bind to port 0 on this machine is
  handed it (Linux skips such ports), while a server binding it by number with ``SO_REUSEADDR`` (uvicorn,
  nginx and vLLM all set it) can. A process that binds it by number meanwhile can still take it first:
  then the caller starts its child again with ``reserve_port(prefer=old)``, which gives the old port back
  only while nothing holds it, else a new one.

Neither hands out a port that ``reserve_port`` reserved in this process and that was not ``release``d, so one
process never hands out a port twice while the first reservation stands. Standard library only.
"""

from __future__ import annotations

import errno
import socket
import threading
from typing import Any, Callable, Collection, Iterable, Iterator, Protocol, TypeVar

LOOPBACK = "127.0.0.1"
_lock = threading.Lock()
_reserved: set[int] = set()  # the ports reserve_port handed out in this process, until released


class Bound(Protocol):
    """What ``pick`` needs of a bound socket."""

    def getsockname(self) -> Any: ...  # noqa: D102 - socket.socket's

    def close(self) -> None: ...  # noqa: D102 - socket.socket's


B = TypeVar("B", bound=Bound)


def tries(prefer: int = 0) -> Iterator[int]:
    """The ports a pick tries in turn: ``prefer`` (unless 0), then 0 (a port the OS picks) for as long as it takes."""
    if prefer:
        yield prefer
    while True:
        yield 0


def pick(bind: Callable[[int], B], ports: Iterable[int], reserved: Collection[int]) -> B:
    """The first socket ``bind`` binds on ``ports`` in turn (``tries()``'s) whose port is not in ``reserved``.

    A port taken elsewhere (``bind`` raises EADDRINUSE) is passed over; so is a reserved one (a socket the OS
    bound on one is held until the pick ends, so that the OS picks another next).

    Raises:
        OSError: ``bind`` failed otherwise (no free port left, an address that is not this machine's).
    """
    passed_over: list[B] = []
    try:
        for port in ports:
            if port in reserved:
                continue
            try:
                sock = bind(port)
            except OSError as e:
                if port == 0 or e.errno != errno.EADDRINUSE:
                    raise
                continue
            if int(sock.getsockname()[1]) in reserved:
                passed_over.append(sock)
                continue
            return sock
        raise OSError(errno.EADDRINUSE, "every port tried is taken")
    finally:
        for sock in passed_over:
            sock.close()


def listener(host: str = LOOPBACK, prefer: int = 0) -> socket.socket:
    """A TCP socket listening on ``host`` for a server to serve on: a child's (hand it over with ``pass_fds`` and
    close this process's copy once the child runs) or one in this process. On ``prefer`` while nothing holds it (a
    restarted child's old port), else on a port the OS picks.

    Raises:
        OSError: no port could be bound on ``host``.
    """
    with _lock:
        return pick(lambda port: _listening(host, port), tries(prefer), _reserved)


def reserve_port(host: str = LOOPBACK, prefer: int = 0) -> int:
    """A port on ``host`` for a child that binds it itself (with ``SO_REUSEADDR``): ``prefer`` while nothing holds
    it (a restarted child's old port, reserved again), else a new one; reserved in this process until ``release``.

    Raises:
        OSError: no port could be bound on ``host``.
    """
    with _lock:
        _reserved.discard(prefer)  # the caller's own port: its child is gone
        sock = pick(lambda port: _listening(host, port), tries(prefer), _reserved)
        with sock:
            port = int(sock.getsockname()[1])
            _park(sock)
        _reserved.add(port)
        return port


def release(port: int) -> None:
    """Forget a port ``reserve_port`` handed out (its child has stopped and it is not wanted again)."""
    with _lock:
        _reserved.discard(port)


def inherited(fd: int) -> socket.socket:
    """The TCP socket a child was handed as file descriptor ``fd`` (``listener()``'s), owned from now on.

    Raises:
        OSError: ``fd`` is not an open socket.
        ValueError: it is a socket, but not a TCP one bound to a port.
    """
    sock = socket.socket(fileno=fd)
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        sock.detach()
        raise ValueError("it is not a TCP socket")
    if not sock.getsockname()[1]:
        sock.detach()
        raise ValueError("it is not bound to a port")
    # Like the socket uvicorn binds itself (protocol 0, not the detected IPPROTO_TCP): the connections it
    # accepts are set up alike (asyncio sets TCP_NODELAY only on sockets whose protocol says TCP).
    return socket.socket(sock.family, sock.type, 0, fileno=sock.detach())


def _listening(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a dead child's TIME_WAIT does not hold it
        sock.bind((host, port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock


def _park(sock: socket.socket) -> None:
    """Leave the listening ``sock``'s port in TIME_WAIT: connect to it and close the accepted end first."""
    with socket.socket(sock.family, socket.SOCK_STREAM) as client:
        client.connect(sock.getsockname()[:2])
        accepted, _ = sock.accept()
        accepted.close()
