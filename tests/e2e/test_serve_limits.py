"""`shardline serve` under attack without a key, over real sockets: head size and count (431), slow heads
and bodies (408, closed), half-open connections past the cap (closed to make room, health still
answers), the in-flight cap (503 + Retry-After), and /metrics only on its own loopback listener."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import httpx
import orjson
import psutil
import pytest

from shardline.local_ports import reserve_port as free_port
from shardline.storage.registry import ModelRegistry
from tests.conftest import BuiltModel
from tests.e2e.conftest import SHARDLINE
from tests.support.serve_process import KEY, wait_ready, write_tenants

MAX_CONNECTIONS = 32
MAX_IN_FLIGHT = 8


class Server:
    def __init__(self, process: subprocess.Popen[bytes], port: int, metrics_port: int, log: Path) -> None:
        self.process, self.port, self.metrics_port, self.log = process, port, metrics_port, log
        self.url = f"http://127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}"

    def connect(self, head: bytes = b"") -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port))
        if head:
            sock.sendall(head)
        return sock

    def rss(self) -> int:
        return int(psutil.Process(self.process.pid).memory_info().rss)


@pytest.fixture(scope="module")
def home(breast_cancer_model: BuiltModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("serve-limits")
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias("breast-cancer", "prod", registry.push(breast_cancer_model.bundle_dir).version or 1)
    write_tenants(home / "tenants.yaml")
    return home


def start(home: Path, name: str, **settings: str) -> Iterator[Server]:
    port, metrics_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDLINE_", "PREFECT_"))}
    env.update(SHARDLINE_STORAGE_HOME=str(home), SHARDLINE_ONLINE_TENANTS_FILE=str(home / "tenants.yaml"),
               SHARDLINE_ONLINE_METRICS_PORT=str(metrics_port), SHARDLINE_ONLINE_ACCESS_LOG="false",
               PREFECT_HOME=str(home / "prefect"), DO_NOT_TRACK="1", ORT_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1",
               **{f"SHARDLINE_ONLINE_{k.upper()}": v for k, v in settings.items()})
    log = home / f"{name}.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen([*SHARDLINE, "serve", "--port", str(port)], cwd=home, stdout=sink, stderr=sink,
                                   env=env)
    server = Server(process, port, metrics_port, log)
    try:
        wait_ready(server.url, process, log)
        yield server
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def capped(home: Path) -> Iterator[Server]:
    """Long time-outs (nothing is closed by a timer in these tests), a small connection and in-flight cap."""
    yield from start(home, "capped", max_connections=str(MAX_CONNECTIONS), max_in_flight=str(MAX_IN_FLIGHT),
                     header_timeout_s="120", body_timeout_s="120", keep_alive_s="120")


@pytest.fixture(scope="module")
def impatient(home: Path) -> Iterator[Server]:
    """Time-outs of one second."""
    yield from start(home, "impatient", header_timeout_s="1", body_timeout_s="1", keep_alive_s="1")


def read_all(sock: socket.socket, timeout: float = 30.0) -> bytes:
    """Everything the server sends until it closes the connection (a test failure if it never does)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def infer(server: Server, model: BuiltModel) -> httpx.Response:
    rows = model.data.features[:2]
    body = {"inputs": [{"name": n, "datatype": "FP32", "shape": [2], "data": rows[:, j].tolist()}
                       for j, n in enumerate(model.data.names)]}
    return httpx.post(f"{server.url}/v2/models/breast-cancer/infer", content=orjson.dumps(body),
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30)


# -- head size and count -------------------------------------------------------------------------
def test_a_1_mib_header_is_answered_431_and_the_server_still_answers(capped: Server, breast_cancer_model: BuiltModel) -> None:
    sock = capped.connect(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
    answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b'{"error":"the request\'s headers are over 65536 bytes"}' in answer
    many = httpx.get(f"{capped.url}/v2/health/live", headers={f"x-h{i}": "1" for i in range(120)})
    assert many.status_code == 431 and "header fields" in many.json()["error"]
    assert infer(capped, breast_cancer_model).status_code == 200


def test_unfinished_huge_heads_do_not_grow_the_servers_memory(capped: Server) -> None:
    before = capped.rss()
    socks = []
    for _ in range(20):  # the attack: 20 heads of many MiB that never end (here 8 MiB each)
        sock = capped.connect(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: ")
        try:
            for _ in range(128):
                sock.sendall(b"a" * 65536)
        except OSError:
            pass  # refused and closed: the rest is not wanted
        socks.append(sock)
    answers = [read_all(sock) for sock in socks]
    grown = capped.rss() - before
    assert all(a.startswith(b"HTTP/1.1 431 ") for a in answers), [a[:40] for a in answers]
    assert grown < 32 * 1024 * 1024, f"the server grew {grown / 1e6:.0f} MB"
    for sock in socks:
        sock.close()


# -- time-outs -----------------------------------------------------------------------------------
def test_a_slow_head_is_answered_408_and_closed(impatient: Server) -> None:
    sock = impatient.connect(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"headers did not all arrive in time" in answer


def test_a_silent_connection_and_an_idle_keep_alive_one_are_closed(impatient: Server) -> None:
    silent = impatient.connect()
    assert read_all(silent) == b""  # closed by the server (read_all fails the test if it never is)
    idle = impatient.connect(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = read_all(idle)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"HTTP/1.1") == 1


def test_a_slow_body_is_answered_408_and_closed(impatient: Server, breast_cancer_model: BuiltModel) -> None:
    sock = impatient.connect(b"POST /v2/models/breast-cancer/infer HTTP/1.1\r\nHost: x\r\n"
                             b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 5000\r\n\r\n{\"inp")
    answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"body did not arrive within 1 s" in answer
    assert infer(impatient, breast_cancer_model).status_code == 200

    # and one whose client hangs up mid-body: neither is the server's fault, and neither counts as its 5xx (both
    # did, as 500s, in the error ratio an SLO alerts on): nginx's 499, "client closed request"
    gone = impatient.connect(b"POST /v2/models/breast-cancer/infer HTTP/1.1\r\nHost: x\r\n"
                             b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 5000\r\n\r\n{\"inp")
    time.sleep(0.2)
    gone.close()
    deadline, codes = time.monotonic() + 15, {}
    while time.monotonic() < deadline:
        scraped = httpx.get(f"{impatient.metrics_url}/metrics").text
        codes = {}
        for labels, value in re.findall(r"^shardline_requests_total\{([^}]*)\} (\S+)$", scraped, re.M):
            code = re.search(r'code="(\d+)"', labels).group(1)  # type: ignore[union-attr]
            codes[code] = codes.get(code, 0.0) + float(value)
        if codes.get("499") == 2:
            break
        time.sleep(0.2)
    assert codes.get("499") == 2 and "500" not in codes, codes


def _scraped(server: Server, series: str) -> dict[str, float]:
    """The breast-cancer model's values of ``series`` (``shardline_requests_total``: by code; a histogram's
    ``_count``: under "")."""
    found: dict[str, float] = {}
    for labels, value in re.findall(rf"^{series}\{{([^}}]*)\}} (\S+)$", httpx.get(f"{server.metrics_url}/metrics").text,
                                    re.M):
        if 'model="breast-cancer"' in labels:
            code = re.search(r'code="(\d+)"', labels)
            key = code.group(1) if code else ""
            found[key] = found.get(key, 0.0) + float(value)
    return found


def test_a_request_whose_client_left_before_it_began_counts_as_499_and_is_not_timed(
    capped: Server, breast_cancer_model: BuiltModel
) -> None:
    # A router's given-up copy: the whole request waits in the socket of a stopped replica, its client gone. It was
    # counted in shardline_request_seconds as a ~0 ms answer: the latency SLI read it as good, when it was late.
    assert infer(capped, breast_cancer_model).status_code == 200
    codes, timed = _scraped(capped, "shardline_requests_total"), _scraped(capped, "shardline_request_seconds_count")
    rows = breast_cancer_model.data.features[:1]
    body = orjson.dumps({"inputs": [{"name": n, "datatype": "FP32", "shape": [1], "data": rows[:, j].tolist()}
                                    for j, n in enumerate(breast_cancer_model.data.names)]})
    os.kill(capped.process.pid, signal.SIGSTOP)
    try:
        gone = capped.connect(b"POST /v2/models/breast-cancer/infer HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                              + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        gone.close()
    finally:
        os.kill(capped.process.pid, signal.SIGCONT)
    deadline, now = time.monotonic() + 15, codes
    while time.monotonic() < deadline and now.get("499", 0) == codes.get("499", 0):
        time.sleep(0.1)
        now = _scraped(capped, "shardline_requests_total")
    assert now.get("499", 0) == codes.get("499", 0) + 1, (codes, now)
    assert now.get("200") == codes.get("200")
    assert _scraped(capped, "shardline_request_seconds_count") == timed  # no answer, no time to one


@pytest.mark.parametrize(("head", "error"), [
    (b"Content-Length: abc\r\n", "the request is not valid HTTP/1.1 (Invalid character in Content-Length); send "
                                   "Content-Length once, the body's size in ASCII digits"),
    (b"Content-Length: 2\r\nContent-Length: 3\r\n", "the request is not valid HTTP/1.1 (Duplicate Content-Length); "
                                                     "send Content-Length once, the body's size in ASCII digits"),
])
def test_a_request_the_http_parser_refuses_is_a_json_400_like_every_other(
    capped: Server, breast_cancer_model: BuiltModel, head: bytes, error: str
) -> None:
    # uvicorn answered these in plain text ("Invalid HTTP request received."), unlike every other 400
    sock = capped.connect(b"POST /v2/models/breast-cancer/infer HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                          + KEY.encode() + b"\r\n" + head + b"\r\n{}")
    answer = read_all(sock)
    sock.close()
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in status.lower(), answer
    assert orjson.loads(body) == {"error": error}
    assert infer(capped, breast_cancer_model).status_code == 200


# -- connection and in-flight caps ----------------------------------------------------------------
@pytest.mark.parametrize("head", [b"", b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Slow: a"])
def test_half_open_connections_past_the_cap_cannot_keep_health_or_requests_out(
    capped: Server, breast_cancer_model: BuiltModel, head: bytes
) -> None:
    socks = [capped.connect(head) for _ in range(3 * MAX_CONNECTIONS)]
    try:
        assert httpx.get(f"{capped.url}/v2/health/live", timeout=30).status_code == 200
        assert httpx.get(f"{capped.url}/v2/health/ready", timeout=30).status_code == 200
        assert infer(capped, breast_cancer_model).status_code == 200
        closed = 0
        for sock in socks:
            sock.settimeout(0.05)
            try:
                closed += sock.recv(1) == b""
            except TimeoutError:
                pass  # still open: one of the newest
            except ConnectionResetError:
                closed += 1
        assert closed >= len(socks) - MAX_CONNECTIONS, f"only {closed} of {len(socks)} were closed"
    finally:
        for sock in socks:
            sock.close()


def test_past_the_in_flight_cap_requests_get_503_with_retry_after_and_health_still_answers(
    capped: Server, breast_cancer_model: BuiltModel
) -> None:
    held = [capped.connect(b"POST /v2/models/breast-cancer/infer HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                           + KEY.encode() + b"\r\nContent-Length: 5000\r\n\r\n{") for _ in range(MAX_IN_FLIGHT)]
    try:
        for _ in range(100):  # until the server has read every held head (no clock asserted)
            busy = infer(capped, breast_cancer_model)
            if busy.status_code == 503:
                break
            time.sleep(0.05)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1", busy.text
        assert busy.json() == {"error": f"the server is answering {MAX_IN_FLIGHT} requests already; retry after 1 s"}
        assert httpx.get(f"{capped.url}/v2/health/live").status_code == 200
    finally:
        for sock in held:
            sock.close()
    for _ in range(100):  # the held requests end when their clients go
        if (answer := infer(capped, breast_cancer_model)).status_code == 200:
            break
        time.sleep(0.05)
    assert answer.status_code == 200, answer.text


# -- metrics ----------------------------------------------------------------------------------------
def test_metrics_are_not_on_the_main_port_but_on_their_own_listener(capped: Server, breast_cancer_model: BuiltModel) -> None:
    assert infer(capped, breast_cancer_model).status_code == 200
    main = httpx.get(f"{capped.url}/metrics")
    assert main.status_code == 404 and "acme" not in main.text and "shardline_" not in main.text
    scraped = httpx.get(f"{capped.metrics_url}/metrics")
    assert scraped.status_code == 200
    assert 'tenant="acme"' in scraped.text and "shardline_requests_total" in scraped.text
    assert httpx.get(f"{capped.metrics_url}/v2/health/live").status_code == 404  # nothing else there
    assert f"metrics on http://127.0.0.1:{capped.metrics_port}/metrics" in capped.log.read_text()


def test_serve_refuses_to_start_when_the_metrics_port_is_taken(home: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDLINE_", "PREFECT_"))}
        done = subprocess.run([*SHARDLINE, "serve", "--port", str(free_port()), "--metrics-port", str(port),
                               "--tenants", str(home / "tenants.yaml")], cwd=home, capture_output=True, text=True,
                              timeout=120, env={**env, "SHARDLINE_STORAGE_HOME": str(home), "DO_NOT_TRACK": "1"})
    assert done.returncode == 2, done.stderr
    assert f"cannot listen for metrics on 127.0.0.1:{port}" in done.stderr
    assert "SHARDLINE_ONLINE_METRICS_PORT to a free port, or 'off'" in done.stderr and "Traceback" not in done.stderr
