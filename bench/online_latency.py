"""Online latency: `shardline serve` against a bare Starlette floor and LitServe, open loop.

All three serve the same small classifier (the breast-cancer logistic regression of
``shardline.examples``, one ``model.onnx``), one row per request, onnxruntime on the
CPU with ``--threads`` intra-op threads (1 by default), each in its own process:

- platform: ``shardline serve`` as a user runs it (tenants file, API key, KServe V2).
- floor: a Starlette endpoint, one uvicorn worker, same venv as the platform, that
  accepts the same V2 JSON body and calls the onnxruntime session on the event loop:
  no tenants, no batching, no metrics. What any server here pays for HTTP and JSON.
- litserve: LitServe with its defaults (one API server process, one inference worker
  process), in its own virtual environment under bench/.peers/ (made on first use),
  fed ``{"input": [30 floats]}``, its natural request format.

The load generator is open loop: request i is due at ``t0 + i / rate`` whatever the
server is doing, and its latency is counted from that intended time, so a server that
falls behind shows its queue. It runs in its own process on raw asyncio protocols
over a pool of keep-alive connections (grown on demand, up to ``--connections``), and
wakes for each send on an interval timer (``setitimer``) rather than ``asyncio.sleep``,
whose epoll timeout rounds up to whole milliseconds. Each step runs at one rate:
a warm-up, then a measured window; the rates alternate between the servers, so a
change in the machine's load hits all three alike, and a window during which the rest
of the machine used over half a core is measured again. The generator reports its own
CPU time per request and how late it sent (``lag``), so its overhead can be read off
the same table as the servers' CPU.

    .venv/bin/python bench/online_latency.py            # 100..25600 req/s doubling + 2 refinements: 3-5 min
    .venv/bin/python bench/online_latency.py --quick    # 100, 800, 3200 req/s, short steps: ~45 s
    .venv/bin/python bench/online_latency.py --servers floor,litserve --rates 500,1000

Data (bundle, registry, tenants file, server logs, last-run.json with every step's
figures) lives under bench/.data/online/ (git-ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path
from typing import Any

OFF_THE_NETWORK = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "ORT_DISABLE_TELEMETRY": "1"}
for _key, _value in OFF_THE_NETWORK.items():
    os.environ.setdefault(_key, _value)

HERE = Path(__file__).resolve().parent
DATA = HERE / ".data" / "online"
PEER_ENV = HERE / ".peers" / "litserve"
MODEL = "breast-cancer"
API_KEY = "shardline-bench-key"
P99_TARGET_MS = 10.0
P50_RATIO_TARGET = 1.3  # platform p50 at the light rate <= 1.3 x the floor's
FLOOR_RATIO_TARGET = 0.6  # platform's highest held rate >= 0.6 x the floor's
PEER_RATIO_TARGET = 4.0  # ... and >= 4 x LitServe's
SERVERS = ("platform", "floor", "litserve")
NOISY = 0.5  # cores used by the rest of the machine during a window that make it worth measuring again


# --------------------------------------------------------------------------- load generator (stdlib + psutil)


def _response_end(buf: bytearray) -> int | None:
    """Length of the first complete HTTP/1.1 response in ``buf``, or None while it is incomplete."""
    head_end = buf.find(b"\r\n\r\n")
    if head_end < 0:
        return None
    head = bytes(buf[:head_end]).lower()
    i = head.find(b"\r\ncontent-length:")
    if i >= 0:
        j = head.find(b"\r\n", i + 2)
        end = head_end + 4 + int(head[i + 17 : j if j >= 0 else None])
        return end if len(buf) >= end else None
    if b"\r\ntransfer-encoding: chunked" not in head:
        raise ValueError(f"a response with neither Content-Length nor chunked body: {head[:200]!r}")
    pos = head_end + 4
    while True:  # walk the chunks: size line, data, CRLF; the 0-size chunk ends it
        line_end = buf.find(b"\r\n", pos)
        if line_end < 0:
            return None
        size = int(bytes(buf[pos:line_end]).split(b";")[0], 16)
        if size == 0:
            end = buf.find(b"\r\n\r\n", line_end)  # past any trailers
            return end + 4 if end >= 0 else None
        pos = line_end + 2 + size + 2
        if pos > len(buf):
            return None


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request (``(due, body index, measured)``) in flight at a time."""

    def __init__(self, pool: _Pool) -> None:
        self.pool, self.buf = pool, bytearray()
        self.item: tuple[float, int, bool] | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, item: tuple[float, int, bool]) -> None:
        self.item = item
        self.transport.write(self.pool.requests[item[1]])  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = _response_end(self.buf)
        if end is None:
            return
        status = int(self.buf[9:12])
        del self.buf[:end]
        item, self.item = self.item, None
        if item is not None:
            self.pool.finished(self, item, status)

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool.lost(self)


class _Pool:
    """Keep-alive connections to one server; requests wait in a backlog when all are busy.

    A request is ``(intended time, body index, measured)``; its latency is counted
    from the intended time, so time spent in the backlog counts too.
    """

    def __init__(self, host: str, port: int, requests: list[bytes], max_connections: int) -> None:
        self.host, self.port, self.requests, self.max = host, port, requests, max_connections
        self.idle: deque[_Connection] = deque()
        self.backlog: deque[tuple[float, int, bool]] = deque()
        self.connections: set[_Connection] = set()
        self.opening = 0
        self.window = (math.inf, math.inf)
        self.latencies: list[float] = []
        self.lags: list[float] = []
        self.statuses: dict[int, int] = {}
        self.in_window = 0  # 200 answers completed inside the measured window
        self.outstanding = 0  # measured requests not answered yet
        self.peak_backlog = 0
        self.peak_connections = 0
        self.closing = False
        self.resent: set[tuple[float, int, bool]] = set()

    async def open(self, count: int) -> None:
        for _ in range(count):
            _, conn = await asyncio.get_running_loop().create_connection(
                lambda: _Connection(self), self.host, self.port)
            self.connections.add(conn)
            self.idle.append(conn)
        self.peak_connections = len(self.connections)

    def _grow(self) -> None:
        self.opening += 1
        task = asyncio.get_running_loop().create_task(
            asyncio.get_running_loop().create_connection(lambda: _Connection(self), self.host, self.port))

        def opened(t: asyncio.Task[Any]) -> None:
            self.opening -= 1
            if t.cancelled() or t.exception() is not None:
                return
            conn = t.result()[1]
            self.connections.add(conn)
            self.peak_connections = max(self.peak_connections, len(self.connections))
            self._give(conn)

        task.add_done_callback(opened)

    def submit(self, item: tuple[float, int, bool]) -> None:
        if item[2]:
            self.outstanding += 1
        if self.idle:
            self.idle.pop().send(item)
            return
        self.backlog.append(item)
        self.peak_backlog = max(self.peak_backlog, len(self.backlog))
        if len(self.connections) + self.opening < self.max:
            self._grow()

    def _give(self, conn: _Connection) -> None:
        if self.backlog:
            conn.send(self.backlog.popleft())
        else:
            self.idle.append(conn)

    def finished(self, conn: _Connection, item: tuple[float, int, bool], status: int) -> None:
        now = time.perf_counter()
        if item[2]:
            self.outstanding -= 1
            self.statuses[status] = self.statuses.get(status, 0) + 1
            if status == 200:
                self.latencies.append(now - item[0])
        if status == 200 and self.window[0] <= now < self.window[1]:
            self.in_window += 1
        self._give(conn)

    def lost(self, conn: _Connection) -> None:
        self.connections.discard(conn)
        if conn in self.idle:
            self.idle.remove(conn)
        item = conn.item
        if item is not None and not self.closing:
            if not conn.buf and item not in self.resent:  # the server closed an idle keep-alive connection
                self.resent.add(item)  # as we sent on it: send again once, as HTTP clients do
                self.backlog.appendleft(item)
            elif item[2]:
                self.outstanding -= 1
                self.statuses[-1] = self.statuses.get(-1, 0) + 1  # connection closed under a request
        if self.backlog and not self.closing:
            if self.idle:
                self.idle.pop().send(self.backlog.popleft())
            elif len(self.connections) + self.opening < self.max:
                self._grow()

    def close(self) -> None:
        self.closing = True
        for conn in list(self.connections):
            conn.transport.close()  # type: ignore[union-attr]


def _cpu_snapshot(root_pid: int) -> dict[int, float]:
    """user+system CPU seconds of a process and its descendants, by pid."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    found = {}
    for proc in procs:
        try:
            t = proc.cpu_times()
            found[proc.pid] = t.user + t.system
        except psutil.NoSuchProcess:
            continue
    return found


def _machine_busy() -> float:
    """CPU seconds the whole machine has spent busy (all cores, every process, the kernel)."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.inf
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


class _Schedule:
    """Sends request i at ``t0 + i / rate``, woken for each by a microsecond interval timer.

    ``asyncio.sleep`` would do, but the loop's epoll timeout rounds up to whole
    milliseconds, which would add up to 1 ms of lateness to every latency. SIGALRM
    instead writes to a socket the loop watches (``signal.set_wakeup_fd``): one
    timer, one wake-up and one read per send.
    """

    def __init__(self, pool: _Pool, rate: float, n_warm: int, n_total: int, server_pid: int) -> None:
        self.pool, self.rate, self.n_warm, self.n_total, self.server_pid = pool, rate, n_warm, n_total, server_pid
        self.i, self.t0 = 0, time.perf_counter() + 0.01
        self.cpu0: dict[int, float] = {}
        self.proc0 = self.machine0 = 0.0
        self.done = asyncio.get_running_loop().create_future()
        self.reader, self.writer = socket.socketpair()
        self.reader.setblocking(False)
        self.writer.setblocking(False)

    def __enter__(self) -> _Schedule:
        signal.signal(signal.SIGALRM, lambda signum, frame: None)
        signal.set_wakeup_fd(self.writer.fileno(), warn_on_full_buffer=False)
        asyncio.get_running_loop().add_reader(self.reader.fileno(), self._woken)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        asyncio.get_running_loop().remove_reader(self.reader.fileno())
        self.reader.close()
        self.writer.close()

    def _woken(self) -> None:
        try:
            self.reader.recv(4096)
        except BlockingIOError:
            pass
        self.tick()

    def tick(self) -> None:
        """Send every request that is due, then set the timer for the next."""
        n_bodies = len(self.pool.requests)
        while self.i < self.n_total:
            due = self.t0 + self.i / self.rate
            delay = due - time.perf_counter()
            if delay > 20e-6:
                signal.setitimer(signal.ITIMER_REAL, delay)
                return
            if self.i == self.n_warm:
                self.cpu0, self.proc0 = _cpu_snapshot(self.server_pid), time.process_time()
                self.machine0 = _machine_busy()
            if self.i >= self.n_warm:
                self.pool.lags.append(-delay)
            self.pool.submit((due, self.i % n_bodies, self.i >= self.n_warm))
            self.i += 1
        if not self.done.done():
            self.done.set_result(None)


async def run_step(spec: dict[str, Any], target: dict[str, Any], rate: float) -> dict[str, Any]:
    """Send ``rate`` req/s to one server for warm-up + window seconds on schedule; returns the window's figures."""
    pool = _Pool("127.0.0.1", target["port"], target["requests"], spec["connections"])
    await pool.open(min(8, spec["connections"]))
    n_warm, n_total = int(rate * spec["warmup"]), int(rate * (spec["warmup"] + spec["seconds"]))
    with _Schedule(pool, rate, n_warm, n_total, target["pid"]) as schedule:
        pool.window = (schedule.t0 + n_warm / rate, schedule.t0 + n_total / rate)
        schedule.tick()
        await schedule.done
    cpu0, proc0, machine0 = schedule.cpu0, schedule.proc0, schedule.machine0
    await asyncio.sleep(max(0.0, pool.window[1] - time.perf_counter()))
    cpu1, proc1, machine1 = _cpu_snapshot(target["pid"]), time.process_time(), _machine_busy()
    deadline = time.perf_counter() + spec["drain"]
    while pool.outstanding > 0 and time.perf_counter() < deadline:
        await asyncio.sleep(0.005)
    lost = pool.outstanding
    pool.close()
    window = pool.window[1] - pool.window[0]
    sent = n_total - n_warm
    latencies, lags = sorted(pool.latencies), sorted(pool.lags)
    latencies += [math.inf] * (sent - len(latencies))  # errors and unanswered count as too slow
    per_proc = {pid: cpu1[pid] - cpu0.get(pid, 0.0) for pid in cpu1}
    errors = {str(k): v for k, v in pool.statuses.items() if k != 200}
    if lost:
        errors["unanswered"] = lost
    return {
        "server": target["name"], "rate": rate, "sent": sent, "ok": pool.statuses.get(200, 0), "errors": errors,
        "p50_ms": _percentile(latencies, 0.50) * 1e3, "p99_ms": _percentile(latencies, 0.99) * 1e3,
        "max_ms": latencies[-1] * 1e3 if latencies else math.inf,
        "achieved": pool.in_window / window,
        "lag_p50_ms": _percentile(lags, 0.5) * 1e3, "lag_p99_ms": _percentile(lags, 0.99) * 1e3,
        "gen_cpu": (proc1 - proc0) / window,
        "gen_us_per_req": (proc1 - proc0) / max(1, sent) * 1e6,
        "server_cpu": sum(per_proc.values()) / window,
        "other_cpu": max(0.0, (machine1 - machine0) - (proc1 - proc0) - sum(per_proc.values())) / window,
        "server_busiest": max(per_proc.values(), default=0.0) / window,
        "server_top": sorted((v / window for v in per_proc.values()), reverse=True)[:3],
        "server_procs": len(per_proc), "connections": pool.peak_connections,
        "peak_backlog": pool.peak_backlog,
    }


def held(step: dict[str, Any]) -> bool:
    """A rate is held when p99 < 10 ms, nothing failed, and the server kept up."""
    failed = sum(step["errors"].values())
    return step["p99_ms"] < P99_TARGET_MS and failed <= step["sent"] * 0.001 and step["achieved"] >= 0.95 * step["rate"]


def saturated(step: dict[str, Any]) -> bool:
    """Far past capacity: higher rates would only pile up a longer queue."""
    failed = sum(step["errors"].values())
    return step["p99_ms"] > 200 or failed > step["sent"] * 0.01 or step["achieved"] < 0.8 * step["rate"]


def next_refinement(steps: list[dict[str, Any]]) -> float | None:
    """The geometric midpoint between the highest held rate and the lowest failed one above it."""
    good = [s["rate"] for s in steps if held(s)]
    if not good:
        return None
    lo = max(good)
    bad = [s["rate"] for s in steps if not held(s) and s["rate"] > lo]
    if not bad:
        return None
    mid = round(math.sqrt(lo * min(bad)), -1)
    return mid if lo < mid < min(bad) else None


async def _quiet(pids: list[int], timeout: float = 15.0) -> None:
    """Wait until the servers use under 10% of a core together (a failed step can leave a queue)
    and the whole machine under 30%, or until ``timeout``."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        servers, machine = sum(sum(_cpu_snapshot(pid).values()) for pid in pids), _machine_busy()
        await asyncio.sleep(0.2)
        if sum(sum(_cpu_snapshot(pid).values()) for pid in pids) - servers < 0.02 and _machine_busy() - machine < 0.06:
            return


async def _generate(spec: dict[str, Any]) -> None:
    """The ladder, each rate against every server in turn (so a change in the machine's load hits all
    alike), skipping a server's higher rates once it is saturated; then the refinements."""
    targets = spec["targets"]
    pids = [t["pid"] for t in targets]
    for t in targets:
        t["requests"] = [r.encode("latin-1") for r in t["requests"]]
    steps: dict[str, list[dict[str, Any]]] = {t["name"]: [] for t in targets}

    async def step(target: dict[str, Any], rate: float) -> None:
        """One rate against one server; measured again (best kept) when something else used the CPUs."""
        tries = []
        for _ in range(1 + spec["retries"]):
            await _quiet(pids)
            tries.append(await run_step(spec, target, rate))
            if tries[-1]["other_cpu"] <= NOISY:
                break
        best = min(tries, key=lambda t: t["other_cpu"])
        best["tries"] = len(tries)
        steps[target["name"]].append(best)
        print(json.dumps(best), flush=True)

    for rate in spec["ladder"]:
        for target in targets:
            if not any(saturated(s) for s in steps[target["name"]]):
                await step(target, rate)
    for _ in range(spec["refine"]):
        for target in targets:
            rate = next_refinement(steps[target["name"]])
            if rate is not None:
                await step(target, rate)


def generate(spec_file: str) -> int:
    """The load generator's process: run the ladder against the servers, one JSON line per step."""
    asyncio.run(_generate(json.loads(Path(spec_file).read_text())))
    return 0


# --------------------------------------------------------------------------- the floor and LitServe


def _session(model_file: str, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model_file, options, providers=["CPUExecutionProvider"])


def serve_floor(port: int, model_file: str, columns_file: str, threads: int) -> int:
    """A bare Starlette endpoint over the same session: decode the V2 body, run, encode. Nothing else."""
    import numpy as np
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    session = _session(model_file, threads)
    tensor = session.get_inputs()[0].name
    columns = json.loads(Path(columns_file).read_text())

    async def infer(request: Request) -> Response:
        body = await request.json()
        values = {i["name"]: i["data"][0] for i in body["inputs"]}
        x = np.array([[values[c] for c in columns]], dtype=np.float32)
        label, probabilities = session.run(None, {tensor: x})
        return JSONResponse({"model_name": MODEL, "outputs": [
            {"name": "label", "shape": [1], "datatype": "INT64", "data": label.tolist()},
            {"name": "probabilities", "shape": [1, 2], "datatype": "FP32", "data": probabilities.ravel().tolist()},
        ]})

    async def ready(request: Request) -> Response:
        return JSONResponse({"ready": True})

    app = Starlette(routes=[Route(f"/v2/models/{MODEL}/infer", infer, methods=["POST"]),
                            Route("/v2/health/ready", ready)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    return 0


def _lit_classifier() -> type:
    """The LitAPI over the same model file (built only in LitServe's environment)."""
    import litserve as ls
    import numpy as np

    class LitClassifier(ls.LitAPI):  # type: ignore[misc]
        def __init__(self, model_file: str, threads: int, max_batch: int, batch_timeout: float) -> None:
            super().__init__(max_batch_size=max_batch, batch_timeout=batch_timeout)
            self.model_file, self.threads, self.batched = model_file, threads, max_batch > 1

        def setup(self, device: str) -> None:
            self.session = _session(self.model_file, self.threads)
            self.tensor = self.session.get_inputs()[0].name

        def decode_request(self, request):  # type: ignore[no-untyped-def]  # LitServe reads the annotation
            return np.asarray(request["input"], dtype=np.float32)

        def predict(self, x: Any) -> Any:
            rows = x.reshape(len(x), -1) if self.batched else x[None]
            label, probabilities = self.session.run(None, {self.tensor: rows})
            answers = [{"label": int(a), "probabilities": b.tolist()} for a, b in zip(label, probabilities)]
            return answers if self.batched else answers[0]

        def unbatch(self, output: Any) -> Any:
            return output

        def encode_response(self, output: Any) -> Any:
            return output

    LitClassifier.__qualname__, LitClassifier.__module__ = "LitClassifier", __name__
    return LitClassifier


# LitServe pickles its LitAPI into a spawned worker process, which imports this file
# again: the class must be a module global there too. The flag is set only for (and
# inherited from) the LitServe server process.
if os.environ.get("SHARDLINE_BENCH_LITSERVE") == "1":
    LitClassifier = _lit_classifier()


def serve_litserve(port: int, model_file: str, threads: int, max_batch: int, batch_timeout: float) -> int:
    """LitServe with its defaults over the same model; runs in the peer environment."""
    import litserve as ls

    api = LitClassifier(model_file, threads, max_batch, batch_timeout)
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1)
    server.run(host="127.0.0.1", port=port, log_level="warning", generate_client_file=False)
    return 0


# --------------------------------------------------------------------------- data and servers


def prepare() -> dict[str, Any]:
    """Bundle, registry (breast-cancer@prod), tenants file and request bodies under bench/.data/online."""
    import shutil

    import numpy as np
    import yaml

    from shardline.examples import breast_cancer, package_breast_cancer
    from shardline.storage.registry import ModelRegistry

    bundle, home = DATA / "bundle", DATA / "home"
    shutil.rmtree(bundle, ignore_errors=True)
    shutil.rmtree(home, ignore_errors=True)
    package_breast_cancer(bundle, name=MODEL, kind="logreg")
    registry = ModelRegistry(str(home / "registry"))
    pushed = registry.push(bundle)
    registry.set_alias(MODEL, "prod", pushed.version or 1, reason="bench")
    manifest = json.loads((bundle / "manifest.json").read_text())
    columns: list[str] = manifest["runtime_config"]["tensor_inputs"][0]["columns"]
    (DATA / "columns.json").write_text(json.dumps(columns))
    tenants = {"tenants": [{
        "name": "bench", "api_keys_sha256": [hashlib.sha256(API_KEY.encode()).hexdigest()],
        "models": [f"{MODEL}@prod"], "priority": "high",
        "rate": {"requests_per_second": 100_000, "burst": 100_000}, "max_concurrent": 10_000,
    }]}
    (DATA / "tenants.yaml").write_text(yaml.safe_dump(tenants, sort_keys=False))
    data = breast_cancer()
    picks = np.random.default_rng(0).choice(len(data.features), 64, replace=False)
    rows = [[float(f"{v:.6g}") for v in data.features[i]] for i in picks]
    v2 = [json.dumps({"inputs": [{"name": c, "shape": [1], "datatype": "FP32", "data": [v]}
                                 for c, v in zip(columns, row)]}, separators=(",", ":")) for row in rows]
    natural = [json.dumps({"input": row}, separators=(",", ":")) for row in rows]
    session = _session(str(bundle / "model.onnx"), 1)
    label, probabilities = session.run(None, {"X": np.asarray(rows[:1], dtype=np.float32)})
    return {"model": str(bundle / "model.onnx"), "columns": str(DATA / "columns.json"),
            "tenants": str(DATA / "tenants.yaml"), "home": str(home), "v2": v2, "natural": natural,
            "expected": (int(label[0]), [float(p) for p in probabilities[0]])}


def ensure_peer_env() -> Path:
    """LitServe's own virtual environment under bench/.peers/litserve, made once and reused."""
    python = PEER_ENV / "bin" / "python"
    probe = [str(python), "-c", "import litserve, onnxruntime, numpy"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"making LitServe's environment in {PEER_ENV} (once: pip install litserve onnxruntime numpy)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(PEER_ENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "litserve", "onnxruntime", "numpy"], check=True)
    return python


def versions(python: str, packages: list[str]) -> str:
    """'name version, ...' of packages as ``python`` sees them."""
    code = ("from importlib import metadata as m\nfor p in %r:\n    try: print(p, m.version(p))\n"
            "    except m.PackageNotFoundError: pass") % (packages,)
    out = subprocess.run([python, "-c", code], capture_output=True, text=True).stdout
    return ", ".join(out.split("\n")[:-1])


def platform_help() -> tuple[str | None, str]:
    """(why `shardline serve` cannot run here, or None; its --help text)."""
    if not any((HERE.parent / "online").glob("*.py")):
        return "online/ holds no code yet", ""
    done = subprocess.run([sys.executable, "-m", "shardline.cli", "serve", "--help"], capture_output=True, text=True)
    if done.returncode != 0:
        return "`shardline serve --help` failed: " + (done.stderr or done.stdout)[-300:], ""
    return None, done.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(port: int, path: str, body: str | None = None) -> tuple[int, Any]:
    """One blocking request with the bench's key; returns (status, parsed JSON or text)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=body.encode() if body is not None else None,
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            status, text = answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


class Server:
    """One server under test: a child process in its own session, its output in a log file."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], port: int, path: str, ready: str) -> None:
        self.name, self.command, self.env, self.port, self.path, self.ready = name, command, env, port, path, ready
        self.log = DATA / "logs" / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, probe_body: str, timeout: float = 120.0) -> float:
        """Start it and wait until it answers an inference request; returns seconds to ready."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        while time.perf_counter() - started < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited {self.proc.returncode} while starting:\n{self.tail()}")
            try:
                status, _ = http(self.port, self.ready)
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.2)
                continue
            if status == 200 or http(self.port, self.path, probe_body)[0] == 200:  # may load the model
                return time.perf_counter() - started
            time.sleep(0.2)
        raise SystemExit(f"{self.name} was not ready after {timeout:.0f} s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                return


def check_answer(server: Server, body: str, expected: tuple[int, list[float]]) -> None:
    """Stop the bench unless the server answers the first row as the model does."""
    status, answer = http(server.port, server.path, body)
    got = answer_of(answer)
    if status != 200 or got is None or got[0] != expected[0] or max(
            abs(a - b) for a, b in zip(got[1], expected[1])) > 1e-5:
        raise SystemExit(f"{server.name} answered {status} {str(answer)[:300]}; expected label {expected[0]}, "
                         f"probabilities {expected[1]}")


def answer_of(body: Any) -> tuple[int, list[float]] | None:
    """(label, probabilities) from a V2 answer or LitServe's dict; None if neither."""
    if isinstance(body, dict) and "outputs" in body:
        outputs = {o["name"]: o["data"] for o in body["outputs"]}
        if "label" in outputs and "probabilities" in outputs:
            return int(outputs["label"][0]), [float(p) for p in outputs["probabilities"]][:2]
    if isinstance(body, dict) and "label" in body:
        return int(body["label"]), [float(p) for p in body["probabilities"]]
    return None


def make_servers(names: list[str], data: dict[str, Any], args: argparse.Namespace) -> list[Server]:
    env = dict(os.environ, **OFF_THE_NETWORK)
    env.pop("PYTHONPATH", None)
    me, servers = str(Path(__file__).resolve()), []
    for name in names:
        port = free_port()
        if name == "platform":
            command = [sys.executable, "-m", "shardline.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                       "--tenants", data["tenants"], *(["--capture", "on"] if args.capture == "on" else [])]
            platform_env = dict(env, SHARDLINE_STORAGE_HOME=data["home"],
                                SHARDLINE_RUNTIME_INTRA_OP_THREADS=str(args.threads))
            servers.append(Server(name, command, platform_env, port, f"/v2/models/{MODEL}/infer", "/v2/health/ready"))
        elif name == "floor":
            command = [sys.executable, me, "--serve-floor", str(port), data["model"], data["columns"],
                       str(args.threads)]
            servers.append(Server(name, command, env, port, f"/v2/models/{MODEL}/infer", "/v2/health/ready"))
        else:
            command = [str(args.peer_python), me, "--serve-litserve", str(port), data["model"], str(args.threads),
                       str(args.litserve_batch), str(args.litserve_batch_timeout)]
            servers.append(Server(name, command, dict(env, SHARDLINE_BENCH_LITSERVE="1"), port, "/predict", "/health"))
    return servers


def run_ladder(servers: list[Server], bodies: dict[str, list[str]], args: argparse.Namespace) -> dict[str, list[Any]]:
    """Run the load generator's process against the started servers; returns each one's steps."""
    targets = [{
        "name": server.name, "port": server.port, "pid": server.proc.pid,  # type: ignore[union-attr]
        "requests": [f"POST {server.path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
                     f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(b)}\r\n\r\n{b}" for b in bodies[server.name]],
    } for server in servers]
    spec = {"targets": targets, "ladder": args.ladder, "warmup": args.warmup, "seconds": args.seconds,
            "refine": args.refine, "connections": args.connections, "drain": args.drain, "retries": args.retries}
    spec_file = DATA / "generator.json"
    spec_file.write_text(json.dumps(spec))
    gen = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--generate", str(spec_file)],
                           stdout=subprocess.PIPE, text=True)
    steps: dict[str, list[Any]] = {server.name: [] for server in servers}
    for line in gen.stdout:  # type: ignore[union-attr]
        step = json.loads(line)
        steps[step["server"]].append(step)
        print(f"  {step['rate']:>6,.0f} req/s  {step['server']:<9} p50 {step['p50_ms']:7.2f} ms  p99 "
              f"{step['p99_ms']:8.2f} ms  achieved {step['achieved']:7,.0f}/s  {'held' if held(step) else 'NOT held'}",
              flush=True)
    if gen.wait() != 0:
        raise SystemExit(f"the load generator failed (exit {gen.returncode})")
    return steps


# --------------------------------------------------------------------------- report


def _fmt(value: float, spec: str) -> str:
    return "inf" if math.isinf(value) else format(value, spec)


def report_steps(name: str, steps: list[dict[str, Any]]) -> None:
    print(f"\n{name}")
    header = (f"{'rate/s':>8}{'achieved/s':>11}{'p50 ms':>8}{'p99 ms':>9}{'max ms':>9}{'errors':>8}"
              f"{'srv CPU':>8}{'busiest':>8}{'gen CPU':>8}{'gen us/req':>11}{'lag p99':>8}{'rest':>6}{'conns':>6}"
              "  held")
    print(header)
    print("-" * len(header))
    for s in sorted(steps, key=lambda s: s["rate"]):
        errors = sum(s["errors"].values())
        print(f"{s['rate']:>8,.0f}{s['achieved']:>11,.0f}{_fmt(s['p50_ms'], '.2f'):>8}{_fmt(s['p99_ms'], '.2f'):>9}"
              f"{_fmt(s['max_ms'], '.1f'):>9}{errors:>8}{s['server_cpu']:>8.0%}{s['server_busiest']:>8.0%}"
              f"{s['gen_cpu']:>8.0%}{s['gen_us_per_req']:>11.0f}{s['lag_p99_ms']:>8.2f}"
              f"{format(s['other_cpu'], '.0%') + ('!' if s['other_cpu'] > NOISY else ''):>6}"
              f"{s['connections']:>6}  "
              f"{'yes' if held(s) else 'no'}")
        if s["errors"]:
            print(f"{'':>8}errors: {s['errors']}")


def summarize(steps: list[dict[str, Any]], light: float) -> dict[str, Any]:
    """p50 at the light rate, the highest rate held, and what the first failed step above it shows."""
    at_light = next((s for s in steps if s["rate"] == light), None)
    good = [s["rate"] for s in steps if held(s)]
    top = max(good, default=0.0)
    failed = sorted((s for s in steps if not held(s) and s["rate"] > top), key=lambda s: s["rate"])
    limit = "held every rate tried"
    if failed:
        f = failed[0]
        procs = " + ".join(f"{c:.0%}" for c in f["server_top"]) + (" + ..." if f["server_procs"] > 3 else "")
        at = f"at {f['rate']:,.0f}/s (p99 {_fmt(f['p99_ms'], '.1f')} ms): server CPU {procs} of a core"
        cores = os.cpu_count() or 1
        machine = f["server_cpu"] + f["gen_cpu"] + f["other_cpu"]
        if f["server_busiest"] >= 0.85:
            limit = f"{at}: its busiest process is saturated"
        elif machine >= 0.85 * cores:
            limit = f"{at}, generator {f['gen_cpu']:.0%}, rest {f['other_cpu']:.0%}: the cores are full"
        elif machine <= 0.6 * cores:
            limit = f"{at}: CPU to spare, so waiting (hand-offs, timers, locks), not computing"
        else:
            limit = f"{at}, generator {f['gen_cpu']:.0%}, rest {f['other_cpu']:.0%}: no one process saturated"
    return {"p50": at_light["p50_ms"] if at_light else math.nan, "held": top, "limit": limit, "capped": not failed}


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, light: float) -> dict[str, Any]:
    """Print each server's steps and the summary; returns the summary by server."""
    labels = {"platform": "platform (shardline serve)", "floor": "floor (bare Starlette, 1 uvicorn worker)",
              "litserve": f"LitServe (1 API server + 1 inference worker, max_batch_size {args.litserve_batch})"}
    for name, steps in results.items():
        report_steps(labels[name], steps)
    print("\nrate/s: the schedule; achieved/s: 200 answers completed inside the measured window per second;\n"
          "p50/p99/max: from each request's intended send time (errors and unanswered count as infinite);\n"
          "srv CPU: the server's process tree, in cores; busiest: its busiest process; gen CPU, gen us/req:\n"
          "the load generator's own process; lag p99: how late the generator sent (ms); rest: the rest of the\n"
          f"machine (kernel, interrupts, other processes; '!': over {NOISY:g} core even at the best of the tries,\n"
          "a noisy figure); conns: connections open.")
    summary = {name: summarize(steps, light) for name, steps in results.items()}
    print(f"\n{'server':<10}{'p50 ms @ ' + format(light, ',.0f') + '/s':>16}{'held at p99<10ms':>18}  limited by")
    for name, s in summary.items():
        print(f"{name:<10}{_fmt(s['p50'], '.2f'):>16}{s['held']:>16,.0f}/s  {s['limit']}")
    return summary


def _held_ratio(platform: dict[str, Any], other: dict[str, Any], name: str, target: float) -> bool:
    """Print platform / other for the highest rate held, saying when a ladder's top bounds it."""
    ratio = platform["held"] / other["held"] if other["held"] else math.inf
    met = ratio >= target
    bound = []
    if platform["capped"]:
        bound.append("the platform held every rate tried, so it is a lower bound")
    if other["capped"]:
        bound.append(f"{name} held every rate tried, so it is an upper bound")
    print(f"rate held at p99<{P99_TARGET_MS:.0f}ms platform / {name} = {ratio:.2f}x  (target >= {target}x: "
          f"{'met' if met else 'MISSED'}){'; ' + ', '.join(bound) + ': add higher --rates' if bound else ''}")
    return met


def ratios(summary: dict[str, dict[str, Any]], light: float) -> bool:
    """Print the issue's targets; returns whether every one that could be computed was met."""
    print()
    platform, floor, peer = (summary.get(n) for n in SERVERS)
    if platform is None:
        print("targets: not computed (the platform was not run)")
        return True
    ok = True
    if floor is not None:
        p50 = platform["p50"] / floor["p50"]
        ok = p50 <= P50_RATIO_TARGET
        print(f"p50 at {light:,.0f}/s      platform / floor = {p50:.2f}x  (target <= {P50_RATIO_TARGET}x: "
              f"{'met' if ok else 'MISSED'})")
        ok &= _held_ratio(platform, floor, "floor", FLOOR_RATIO_TARGET)
    if peer is not None:
        ok &= _held_ratio(platform, peer, "LitServe", PEER_RATIO_TARGET)
    return ok
    if floor is not None:
        p50 = platform["p50"] / floor["p50"]
        met = p50 <= P50_RATIO_TARGET
        ok &= met
        print(f"p50 at {light:,.0f}/s      platform / floor = {p50:.2f}x  (target <= {P50_RATIO_TARGET}x: "
              f"{'met' if met else 'MISSED'})")
        held_ratio = platform["held"] / floor["held"] if floor["held"] else math.nan
        met = held_ratio >= FLOOR_RATIO_TARGET
        ok &= met
        print(f"rate held at p99<{P99_TARGET_MS:.0f}ms platform / floor = {held_ratio:.2f}x  "
              f"(target >= {FLOOR_RATIO_TARGET}x: {'met' if met else 'MISSED'})")
    if peer is not None:
        held_ratio = platform["held"] / peer["held"] if peer["held"] else math.inf
        met = held_ratio >= PEER_RATIO_TARGET
        ok &= met
        print(f"rate held at p99<{P99_TARGET_MS:.0f}ms platform / LitServe = {held_ratio:.2f}x  "
              f"(target >= {PEER_RATIO_TARGET}x: {'met' if met else 'MISSED'})")
    return ok


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with the defaults of full and quick runs filled in."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rates, short steps, one refinement: ~1 minute")
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help="comma-separated subset of platform,floor,litserve")
    parser.add_argument("--rates",
                        help="the ladder, req/s, comma-separated (default 100..25600 doubling; quick 100,800,3200)")
    parser.add_argument("--seconds", type=float, help="measured window per rate (default 5, quick 2)")
    parser.add_argument("--warmup", type=float, help="seconds at each rate before the window (default 1, quick 0.5)")
    parser.add_argument("--refine", type=int, help="bisection steps between the highest held and lowest failed rate "
                        "(default 2, quick 1)")
    parser.add_argument("--retries", type=int, help="measure a step again, up to this many times, when the rest of "
                        f"the machine used over {NOISY:g} core during it (default 2, quick 1)")
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads, every server (default 1)")
    parser.add_argument("--connections", type=int, default=256, help="most keep-alive connections per server")
    parser.add_argument("--litserve-batch", type=int, default=1,
                        help="LitServe max_batch_size (default 1: its default)")
    parser.add_argument("--litserve-batch-timeout", type=float, default=0.0, help="LitServe batch_timeout, seconds")
    parser.add_argument("--capture", choices=("on", "off"), default="off",
                        help="passed to `shardline serve --capture` when on (request capture: a later issue)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--generate", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument("--serve-floor", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--serve-litserve", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.ladder = [float(r) for r in args.rates.split(",")] if args.rates else (
        [100.0, 800.0, 3200.0] if args.quick else [100.0 * 2**k for k in range(9)])  # full: 100 .. 25,600
    args.retries = args.retries if args.retries is not None else (1 if args.quick else 2)
    args.seconds = args.seconds or (2.0 if args.quick else 5.0)
    args.warmup = args.warmup if args.warmup is not None else (0.5 if args.quick else 1.0)
    args.refine = args.refine if args.refine is not None else (1 if args.quick else 2)
    args.drain = 5.0
    args.names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = set(args.names) - set(SERVERS)
    if unknown:
        parser.error(f"unknown server(s) {sorted(unknown)}; choose from {', '.join(SERVERS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Prepare the model, start the servers, run the ladder against them in turn, print the tables and ratios."""
    args = parse_args(argv)
    if args.generate:
        return generate(args.generate)
    if args.serve_floor:
        port, model, columns, threads = args.serve_floor
        return serve_floor(int(port), model, columns, int(threads))
    if args.serve_litserve:
        port, model, threads, batch, timeout = args.serve_litserve
        return serve_litserve(int(port), model, int(threads), int(batch), float(timeout))
    names = args.names
    if "platform" in names:
        missing, usage = platform_help()
        if missing:
            print(f"note: skipping the platform: {missing}", flush=True)
            names.remove("platform")
        elif args.capture == "on" and "--capture" not in usage:
            print("note: `shardline serve` has no --capture yet (request capture is a later issue); "
                  "running it without", flush=True)
            args.capture = "off"
    if "litserve" in names:
        args.peer_python = ensure_peer_env()

    DATA.mkdir(parents=True, exist_ok=True)
    data = prepare()
    light = min(args.ladder)
    load = os.getloadavg()[0]
    print(f"{os.cpu_count()} cores (load average {load:.2f}); ladder {', '.join(f'{r:,.0f}' for r in args.ladder)} "
          f"req/s, {args.warmup:g} s warm-up + {args.seconds:g} s measured each, {args.refine} refinement(s); "
          f"onnxruntime intra-op threads {args.threads}; one row per request", flush=True)
    print(f"  this venv: {versions(sys.executable, ['uvicorn', 'starlette', 'uvloop', 'httptools', 'onnxruntime'])}")
    if "litserve" in names:
        peers = ["litserve", "uvicorn", "fastapi", "uvloop", "httptools", "onnxruntime"]
        print(f"  LitServe's venv: {versions(str(args.peer_python), peers)}")
    if load > 0.5:
        print("  warning: something else is using the CPUs; the figures will be noisy", flush=True)

    servers = make_servers(names, data, args)
    bodies = {s.name: data["natural"] if s.name == "litserve" else data["v2"] for s in servers}
    try:
        for server in servers:  # all up at once (idle, each uses ~0% CPU); the rates alternate between them
            ready = server.start(bodies[server.name][0])
            check_answer(server, bodies[server.name][0], data["expected"])
            print(f"  {server.name}: ready in {ready:.1f} s, answers as the model does", flush=True)
        results = run_ladder(servers, bodies, args)
    finally:
        for server in servers:
            server.stop()
    summary = report(results, args, light)
    (DATA / "last-run.json").write_text(json.dumps({"steps": results, "summary": summary}, indent=1))
    met = ratios(summary, light)
    return 1 if args.strict and not met else 0


if __name__ == "__main__":
    sys.exit(main())
