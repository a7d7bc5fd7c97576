"""Unit tests run without servers or sockets: an autouse fixture forbids them."""

from __future__ import annotations

import socket
from typing import Any

import pytest


class SocketForbidden(RuntimeError):
    """A unit test tried to use the network."""


@pytest.fixture(autouse=True)
def _no_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise SocketForbidden("unit tests may not open network connections; move this test to tests/integration")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket.socket, "bind", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
