"""The one body reader at the HTTP edge, as both protocols use it (ASGI apps called directly: no sockets)."""

from __future__ import annotations

import asyncio
import gzip
import logging
from pathlib import Path
from typing import Any

import orjson
import pytest

from shardline.errors import InvalidInput, PayloadTooLarge
from shardline.online.app import create_app
from shardline.online.dataplane import DataPlane
from shardline.online.edge import ClientGone, read_body
from shardline.online.tenants import TenantDirectory, hash_api_key
from shardline.runtimes import RuntimeOptions
from shardline.settings import OnlineSettings
from shardline.storage.model_cache import ModelCache
from shardline.storage.registry import ModelRegistry


def make_plane(tmp_path: Path, **settings: Any) -> DataPlane:
    tenants = TenantDirectory.from_config({"tenants": [
        {"name": "acme", "api_keys_sha256": [hash_api_key("k")], "models": ["minilm@prod"]}]})
    return DataPlane(OnlineSettings(**settings), ModelRegistry(str(tmp_path / "registry")),
                     ModelCache(tmp_path / "cache"), tenants, RuntimeOptions("cpu", 1))


def messages(*chunks: bytes, gone: bool = False) -> Any:
    queue = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1 or gone} for i, c in enumerate(chunks)]
    if gone:
        queue.append({"type": "http.disconnect"})

    async def receive() -> dict[str, Any]:
        return queue.pop(0)

    return receive


def test_one_reader_takes_chunks_and_every_gzip_member_within_the_limit(tmp_path: Path) -> None:
    plane = make_plane(tmp_path, max_body_bytes=4096)
    plain = b"x" * 3000
    two_members = gzip.compress(plain[:1000]) + gzip.compress(plain[1000:])
    assert asyncio.run(read_body(messages(b"ab", b"cd"), "4", None, plane)) == b"abcd"
    assert asyncio.run(read_body(messages(two_members[:10], two_members[10:]), None, "gzip", plane)) == plain
    with pytest.raises(PayloadTooLarge, match="is 5000 bytes, over the limit of 4096"):
        asyncio.run(read_body(messages(b""), "5000", None, plane))
    with pytest.raises(PayloadTooLarge, match="gzip request body inflates to more than the limit of 4096"):
        asyncio.run(read_body(messages(gzip.compress(b" " * 5000)), None, "gzip", plane))
    with pytest.raises(InvalidInput, match="not valid gzip data"):
        asyncio.run(read_body(messages(b"not gzip"), None, "gzip", plane))
    with pytest.raises(ClientGone):
        asyncio.run(read_body(messages(b"ab", gone=True), None, None, plane))


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_an_openai_client_that_leaves_mid_body_is_not_logged_as_a_server_fault(tmp_path: Path) -> None:
    app = create_app(make_plane(tmp_path), log_requests=False)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/embeddings", "raw_path": b"/v1/embeddings", "query_string": b"", "root_path": "",
             "headers": [(b"authorization", b"Bearer k"), (b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    records = Records()
    logging.getLogger("shardline.online").addHandler(records)
    try:
        asyncio.run(app(scope, messages(orjson.dumps({"model": "minilm"})[:5], gone=True), send))
    finally:
        logging.getLogger("shardline.online").removeHandler(records)
    # nobody reads it; before, the read failed as a 500 with a traceback, then it was a 400 (the client's fault):
    # nginx's 499, "client closed request", as V2 answers it
    assert sent and sent[0]["status"] == 499
    assert not [r for r in records.records if r.levelno >= logging.ERROR]
