"""The AWS IMDSv2 and Azure Scheduled Events notices against real HTTP servers on loopback that
answer as the metadata services do (token required, headers required, 404 until a notice)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator
from urllib.parse import parse_qs, urlsplit

import pytest

from shardline.tasks.preemption import NoticeSources


class Imds:
    """The state an imitated metadata service answers from, and what it was asked."""

    def __init__(self) -> None:
        self.tokens: set[str] = set()
        self.token_puts = 0
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.spot_action: dict[str, str] | None = None
        self.vm_name = "worker-vmss_3"
        self.events: list[dict[str, Any]] = []


def _serve(handler: Callable[[BaseHTTPRequestHandler, Imds], tuple[int, bytes]]) -> Iterator[tuple[str, Imds]]:
    state = Imds()

    class Metadata(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            state.requests.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
            status, body = handler(self, state)
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_PUT = _answer  # noqa: N815 (the stdlib's names)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()


def _aws(request: BaseHTTPRequestHandler, state: Imds) -> tuple[int, bytes]:
    """IMDSv2 in 'required' mode: a token from PUT /latest/api/token, 401 without one."""
    if request.command == "PUT" and request.path == "/latest/api/token":
        ttl = request.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
        if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
            return 400, b""
        state.token_puts += 1
        token = f"token-{state.token_puts}"
        state.tokens.add(token)
        return 200, token.encode()
    if request.command != "GET":
        return 405, b""
    if request.headers.get("X-aws-ec2-metadata-token") not in state.tokens:
        return 401, b""
    if request.path == "/latest/meta-data/spot/instance-action":
        return (404, b"Not Found") if state.spot_action is None else (200, json.dumps(state.spot_action).encode())
    return 404, b""


def _azure(request: BaseHTTPRequestHandler, state: Imds) -> tuple[int, bytes]:
    """Azure IMDS: 400 without 'Metadata: true' or an api-version; the VM's name; the events document."""
    parts = urlsplit(request.path)
    query = parse_qs(parts.query)
    if request.headers.get("Metadata") != "true" or "api-version" not in query:
        return 400, b'{"error": "Bad request. Required metadata header not specified"}'
    if parts.path == "/metadata/instance/compute/name" and query.get("format") == ["text"]:
        return 200, state.vm_name.encode()
    if parts.path == "/metadata/scheduledevents" and query["api-version"] == ["2020-07-01"]:
        return 200, json.dumps({"DocumentIncarnation": len(state.events), "Events": state.events}).encode()
    return 404, b""


@pytest.fixture
def aws() -> Iterator[tuple[str, Imds]]:
    yield from _serve(_aws)


@pytest.fixture
def azure() -> Iterator[tuple[str, Imds]]:
    yield from _serve(_azure)


def test_aws_spot_notice_through_imdsv2(aws: tuple[str, Imds]) -> None:
    base, state = aws
    sources = NoticeSources.parse((f"aws:{base}",))

    assert sources.polled_notice() is None and sources.polled_notice() is None  # 404: no notice yet
    state.spot_action = {"action": "terminate", "time": "2026-11-30T12:02:00Z"}
    assert sources.polled_notice() == "AWS spot terminate at 2026-11-30T12:02:00Z"

    assert state.token_puts == 1  # one session token, reused while it is valid
    put = next(r for r in state.requests if r[0] == "PUT")
    assert put[1] == "/latest/api/token" and put[2]["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"
    gets = [r for r in state.requests if r[0] == "GET"]
    assert len(gets) == 3 and all(r[2]["x-aws-ec2-metadata-token"] == "token-1" for r in gets)


def test_aws_token_revoked_is_renewed_on_the_next_poll(aws: tuple[str, Imds]) -> None:
    base, state = aws
    sources = NoticeSources.parse((f"aws:{base}",))
    assert sources.polled_notice() is None
    state.tokens.clear()  # expired or revoked: 401
    state.spot_action = {"action": "stop", "time": "2026-11-30T12:02:00Z"}
    assert sources.polled_notice() is None  # 401 is not a notice
    assert sources.polled_notice() == "AWS spot stop at 2026-11-30T12:02:00Z" and state.token_puts == 2


def test_azure_preempt_event_for_this_vm(azure: tuple[str, Imds]) -> None:
    base, state = azure
    sources = NoticeSources.parse((f"azure:{base}",))
    event = {
        "EventId": "602d9444-d2cd-49c7-8624-8643e7171297", "EventStatus": "Scheduled", "EventType": "Reboot",
        "ResourceType": "VirtualMachine", "Resources": ["worker-vmss_3"], "NotBefore": "Mon, 30 Nov 2026 12:00:30 GMT",
        "Description": "", "EventSource": "Platform", "DurationInSeconds": -1,
    }
    assert sources.polled_notice() is None  # no events
    state.events = [event]
    assert sources.polled_notice() is None  # a reboot is not a preemption
    state.events = [{**event, "EventType": "Preempt", "Resources": ["worker-vmss_4"]}]
    assert sources.polled_notice() is None  # another VM of the scale set
    state.events = [{**event, "EventType": "Preempt"}]
    assert sources.polled_notice() == (
        "Azure Preempt event 602d9444-d2cd-49c7-8624-8643e7171297 (not before Mon, 30 Nov 2026 12:00:30 GMT)"
    )
    assert all(headers.get("metadata") == "true" for _, _, headers in state.requests)
    assert sum(1 for _, path, _ in state.requests if path.startswith("/metadata/instance/compute/name")) == 1


def test_no_metadata_service_is_no_notice() -> None:
    from shardline.local_ports import reserve_port

    port = reserve_port()  # a loopback port nobody listens on
    sources = NoticeSources.parse((f"aws:http://127.0.0.1:{port}", f"azure:http://127.0.0.1:{port}"))
    assert sources.polled_notice(timeout=0.5) is None
