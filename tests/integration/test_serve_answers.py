"""How ``shardline serve``'s protocol (``online/connection.py``) writes an answer, on a real socket: the head and
body of an answer of known length in one send, a stream's head at once."""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any, Iterator

import pytest


async def _answer(scope: Any, receive: Any, send: Any) -> None:
    """An app with both kinds of answer: a body of known length, and a stream whose first chunk is late."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await asyncio.sleep(0.5)
        await send({"type": "http.response.body", "body": b"late", "more_body": False})
        return
    body = b'{"answer": 42}'
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def plain_server() -> Iterator[int]:
    """``_answer`` under uvicorn with serve's protocol and bounds, on a real socket in a thread of this process."""
    from shardline.online.testing import serve_in_thread

    with serve_in_thread(_answer) as url:
        yield int(url.rsplit(":", 1)[1])


def _ask(port: int, path: str) -> socket.socket:
    client = socket.create_connection(("127.0.0.1", port))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client.settimeout(5)
    client.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
    return client


def _data_segments_in(client: socket.socket) -> int:
    """Segments with data this socket has received (Linux's ``tcp_info.tcpi_data_segs_in``, since 4.6)."""
    info = client.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return int(struct.unpack_from("I", info, 152)[0])


def test_an_answer_of_known_length_leaves_in_one_send_head_and_body(plain_server: int) -> None:
    """One segment per answer on loopback (written apart, head and body were two: the test fails so)."""
    client = _ask(plain_server, "/")
    for i in range(5):  # and again on the same connection
        if i:
            client.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = b""
        while not answer.endswith(b'{"answer": 42}'):
            answer += client.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"HTTP/1.1") == 1, answer
        assert _data_segments_in(client) == i + 1
    client.close()


def test_a_streams_head_is_not_held_for_its_first_chunk(plain_server: int) -> None:
    """The head arrives alone: held for the next write, it would have come with the chunk 0.5 s later."""
    client = _ask(plain_server, "/stream")
    head = client.recv(65536)
    assert head.startswith(b"HTTP/1.1 200") and b"late" not in head, head
    rest = b""
    while not rest.endswith(b"0\r\n\r\n"):
        rest += client.recv(65536)
    assert b"late" in rest
    client.close()
