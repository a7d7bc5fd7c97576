"""An open-loop HTTP load generator (stdlib + psutil), for bench/online_latency.py.

Request i is due at ``t0 + i / rate`` whatever the server is doing, and its latency is
counted from that intended time, so a server that falls behind shows its queue. It runs
in its own process on raw asyncio protocols over a pool of keep-alive connections (grown
on demand, up to ``connections``), and wakes for each send on an interval timer
(``setitimer``) rather than ``asyncio.sleep``, whose epoll timeout rounds up to whole
milliseconds. Each step runs at one rate: a warm-up, then a measured window; the rates
alternate between the servers, so a change in the machine's load hits all alike, and a
window during which the rest of the machine used over ``NOISY`` of a core is measured
again. It reports its own CPU time per request and how late it sent (``lag``).

    python bench/loadgen.py SPEC.json     # one JSON line per step on stdout

SPEC: {"targets": [{"name", "port", "pid", "requests": [raw HTTP request text, ...], "backends": [pids]}],
"ladder": [rates], "warmup", "seconds", "refine", "connections", "drain", "retries", "prewarm"}
(prewarm: seconds at 4x the lightest rate against each server before the ladder, not counted; backends,
optional: the processes a proxy sends its requests on to, whose CPU is that target's work, not noise).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

P99_TARGET_MS = 10.0
NOISY = 0.5  # cores used by the rest of the machine during a window that make it worth measuring again
PEERS_NOISY = 0.02  # ... or by the other servers under test, which should be idle (a deferred write: capture's)


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


def _on_cpu(pid: int) -> float | None:
    """Seconds a process's threads have run, from the scheduler's nanosecond count (Linux's
    /proc/PID/task/*/schedstat); None where there is none. psutil's user+system time comes in 10 ms
    ticks: at 100 req/s a one-second window's CPU per request would be known to +-100 us."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended in between
    return total / 1e9


def _cpu_snapshot(root_pid: int) -> dict[int, float]:
    """CPU seconds of a process and its descendants, by pid."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    found = {}
    for proc in procs:
        try:
            seconds = _on_cpu(proc.pid)
            if seconds is None:
                t = proc.cpu_times()
                seconds = t.user + t.system
            found[proc.pid] = seconds
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

    def __init__(self, pool: _Pool, rate: float, n_warm: int, n_total: int, server_pid: int,
                 peer_pids: list[int], backend_pids: list[int]) -> None:
        self.pool, self.rate, self.n_warm, self.n_total, self.server_pid = pool, rate, n_warm, n_total, server_pid
        self.peer_pids, self.backend_pids = peer_pids, backend_pids
        self.i, self.t0 = 0, time.perf_counter() + 0.01
        self.cpu0: dict[int, float] = {}
        self.proc0 = self.machine0 = self.peers0 = self.backends0 = 0.0
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
                self.machine0, self.peers0 = _machine_busy(), _tree_cpu(self.peer_pids)
                self.backends0 = _tree_cpu(self.backend_pids)
            if self.i >= self.n_warm:
                self.pool.lags.append(-delay)
            self.pool.submit((due, self.i % n_bodies, self.i >= self.n_warm))
            self.i += 1
        if not self.done.done():
            self.done.set_result(None)


def _tree_cpu(pids: list[int]) -> float:
    """CPU seconds of these processes and their descendants, together."""
    return sum(sum(_cpu_snapshot(pid).values()) for pid in pids)


async def run_step(spec: dict[str, Any], target: dict[str, Any], rate: float, peer_pids: list[int]) -> dict[str, Any]:
    """Send ``rate`` req/s to one server for warm-up + window seconds on schedule; returns the window's figures
    (``peer_pids``: the other servers under test, idle meanwhile: what they used is noise; the target's
    ``backends``: what it sends its requests on to, whose CPU is its own work)."""
    pool = _Pool("127.0.0.1", target["port"], target["requests"], spec["connections"])
    await pool.open(min(8, spec["connections"]))
    n_warm, n_total = int(rate * spec["warmup"]), int(rate * (spec["warmup"] + spec["seconds"]))
    backends = target.get("backends", [])
    with _Schedule(pool, rate, n_warm, n_total, target["pid"], peer_pids, backends) as schedule:
        pool.window = (schedule.t0 + n_warm / rate, schedule.t0 + n_total / rate)
        schedule.tick()
        await schedule.done
    cpu0, proc0, machine0 = schedule.cpu0, schedule.proc0, schedule.machine0
    await asyncio.sleep(max(0.0, pool.window[1] - time.perf_counter()))
    cpu1, proc1, machine1 = _cpu_snapshot(target["pid"]), time.process_time(), _machine_busy()
    peers = _tree_cpu(peer_pids) - schedule.peers0
    behind = _tree_cpu(backends) - schedule.backends0
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
        "backends_cpu": max(0.0, behind) / window,
        "other_cpu": max(0.0, (machine1 - machine0) - (proc1 - proc0) - sum(per_proc.values()) - behind) / window,
        "peers_cpu": max(0.0, peers) / window,
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

    def peers_of(target: dict[str, Any]) -> list[int]:
        """The other targets' processes, less this one's backends (a proxy's replicas may be another's server)."""
        return [p for p in pids if p != target["pid"] and p not in target.get("backends", [])]

    async def step(target: dict[str, Any], rate: float) -> None:
        """One rate against one server; measured again (best kept) when something else used the CPUs."""
        tries = []
        for _ in range(1 + spec["retries"]):
            await _quiet(pids)
            tries.append(await run_step(spec, target, rate, peers_of(target)))
            if tries[-1]["other_cpu"] <= NOISY and tries[-1]["peers_cpu"] <= PEERS_NOISY:
                break
        best = min(tries, key=lambda t: (t["other_cpu"] > NOISY or t["peers_cpu"] > PEERS_NOISY,
                                         t["other_cpu"] + t["peers_cpu"]))  # a quiet try, else the least noisy
        best["tries"] = len(tries)
        steps[target["name"]].append(best)
        print(json.dumps(best), flush=True)

    prewarm = spec.get("prewarm", 0.0)
    if prewarm > 0:  # each server's first requests pay for lazy set-up; not counted (see bench/README.md)
        for target in targets:
            await _quiet(pids)
            await run_step({**spec, "warmup": prewarm, "seconds": 0.2}, target, 4 * min(spec["ladder"]),
                           peers_of(target))
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


if __name__ == "__main__":
    sys.exit(generate(sys.argv[1]))
