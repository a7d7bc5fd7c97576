"""``shardline router --local-replicas N``: N ``shardline serve`` processes on loopback, started and
kept running by the router.

Each replica serves on a free loopback port (its metrics on another), reads the same tenants
file and registry as the router, and takes requests only from this router: it is given the
sha256 of the router's key (``SHARDLINE_TENANCY_ROUTER_KEY_SHA256``). The router binds both ports
itself (``shardline.local_ports.listener``) and hands the sockets to the replica (``serve --fd
--metrics-fd``), so no other pick, here or in another process, can be given them before the replica
serves on them. A replica that exits is started again after a back-off (1 s, doubling to 30 s; reset
once it has run a minute), on the same ports while nothing else holds them, else on new ones (then
``watch`` returns its new address, which the router's members follow); the router's health checks
take it out of rotation meanwhile. Stopping the router stops them (SIGTERM, then SIGKILL after 10 s).

With autoscaling (``--min-replicas`` under ``--local-replicas``) the N are slots: ``scale_to(n)``
starts the next stopped slots or stops the highest running ones (SIGTERM: a replica finishes
what it is answering; the router has already taken it out of rotation). A slot started again
gets fresh ports (the stopping process may still hold its old ones). Only running slots are
restarted when they exit.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

from shardline.local_ports import listener

log = logging.getLogger(__name__)

RESTART_FIRST_S = 1.0
RESTART_MAX_S = 30.0
HEALTHY_RUN_S = 60.0  # a replica that ran this long starts its back-off afresh
STOP_GRACE_S = 10.0


def restart_delay(previous: float, ran_s: float) -> float:
    """The back-off before a replica that exited after ``ran_s`` seconds is started again (pure)."""
    if ran_s >= HEALTHY_RUN_S or previous <= 0:
        return RESTART_FIRST_S
    return min(RESTART_MAX_S, previous * 2)


def die_with_parent() -> None:
    """In the replica, before it runs: on Linux, be sent SIGTERM when the router dies, however it dies
    (a SIGKILLed router leaves no replica behind); elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class LocalReplica:
    """One ``shardline serve`` process the router runs."""

    index: int
    port: int = 0
    metrics_port: int = 0
    sockets: tuple[socket.socket, socket.socket] | None = None  # both ports', bound here until the replica starts
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    delay: float = 0.0
    restart_at: float | None = None
    restarts: int = 0
    running: bool = False  # a slot in use (started, or waiting to be started again after an exit)
    log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def bind(self, same_ports: bool) -> None:
        """Bind its two ports (``shardline.local_ports.listener``): the ones it had while nothing else holds them
        (``same_ports``), else new ones."""
        main = listener(prefer=self.port if same_ports else 0)
        try:
            metrics = listener(prefer=self.metrics_port if same_ports else 0)
        except OSError:
            main.close()
            raise
        self.sockets = (main, metrics)
        self.port, self.metrics_port = int(main.getsockname()[1]), int(metrics.getsockname()[1])

    def close_sockets(self) -> None:
        """Close this process's copies of its sockets (the replica holds them once started)."""
        for sock in self.sockets or ():
            sock.close()
        self.sockets = None


class LocalReplicas:
    """Start, watch and stop the replicas (the router calls ``watch`` every half second)."""

    def __init__(self, count: int, tenants_file: str, router_key_sha256: str, log_dir: Path,
                 clock: Callable[[], float] = time.monotonic, initial: int | None = None) -> None:
        self.tenants_file = tenants_file
        self.key_sha256 = router_key_sha256
        self.log_dir = log_dir
        self._clock = clock
        self.initial = count if initial is None else initial
        self.replicas = [LocalReplica(i) for i in range(count)]
        for replica in self.replicas[:self.initial]:  # their addresses are the router's first members
            replica.bind(same_ports=False)
        self._stopping: list[subprocess.Popen[bytes]] = []

    @property
    def urls(self) -> list[str]:
        """The running slots' addresses (a slot keeps its port while it runs, restarts included, unless another
        process took it while the replica was down)."""
        return [r.url for r in self.replicas if r.running]

    @property
    def running(self) -> int:
        """Slots in use."""
        return sum(r.running for r in self.replicas)

    def start(self) -> None:
        """Start the first replicas (they load nothing until their first request; readiness is the health checks')."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.scale_to(self.initial)

    def scale_to(self, count: int) -> list[str]:
        """Run ``count`` replicas: start stopped slots, lowest first, or stop running ones, highest first;
        returns the URLs of the replicas started."""
        started = []
        for replica in self.replicas:
            if self.running >= count:
                break
            if not replica.running:
                replica.running, replica.delay = True, 0.0
                if replica.sockets is None:
                    replica.bind(same_ports=False)
                self._spawn(replica)
                started.append(replica.url)
        for replica in reversed(self.replicas):
            if self.running <= count:
                break
            if replica.running:
                replica.running, replica.restart_at = False, None
                if replica.process is not None and replica.process.poll() is None:
                    replica.process.send_signal(signal.SIGTERM)
                    self._stopping.append(replica.process)
                    log.info("stopping replica %d (pid %d) on %s", replica.index, replica.process.pid, replica.url)
                replica.process = None  # started again, it gets new ports: the stopping one may hold these a while
        return started

    def _spawn(self, replica: LocalReplica) -> None:
        """Start ``replica`` on its bound sockets (handed over: this process closes its copies)."""
        assert replica.sockets is not None
        env = dict(os.environ)
        env["SHARDLINE_TENANCY_ROUTER_KEY_SHA256"] = self.key_sha256
        for name in ("SHARDLINE_ONLINE_HOST", "SHARDLINE_ONLINE_PORT", "SHARDLINE_ONLINE_METRICS_PORT",
                     "SHARDLINE_ONLINE_FD", "SHARDLINE_ONLINE_METRICS_FD"):
            env.pop(name, None)
        if replica.log is None:
            replica.log = open(self.log_dir / f"replica-{replica.index}.log", "ab")
        main, metrics = (s.fileno() for s in replica.sockets)
        command = [
            sys.executable, "-m", "shardline.cli", "serve", "--fd", str(main), "--metrics-fd", str(metrics),
            "--tenants", self.tenants_file,
        ]
        try:
            replica.process = subprocess.Popen(command, env=env, stdout=replica.log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, pass_fds=(main, metrics),
                                               preexec_fn=die_with_parent)
        finally:
            replica.close_sockets()
        replica.started_at, replica.restart_at = self._clock(), None
        log.info("started replica %d (pid %d) on %s (metrics on port %d)", replica.index, replica.process.pid,
                 replica.url, replica.metrics_port)

    def watch(self) -> list[str]:
        """Start again each running replica that exited, after its back-off; reap the stopped ones. Returns the
        addresses of the replicas started again on a new port (another process took the old one meanwhile)."""
        moved = []
        now = self._clock()
        self._stopping = [p for p in self._stopping if p.poll() is None]
        for replica in self.replicas:
            if not replica.running:
                continue
            process = replica.process
            if process is not None and process.poll() is not None:
                ran = now - replica.started_at
                replica.delay = restart_delay(replica.delay, ran)
                replica.restart_at = now + replica.delay
                log.warning("replica %d exited with %s after %.1f s; starting it again in %.0f s (its log: %s)",
                            replica.index, process.returncode, ran, replica.delay,
                            self.log_dir / f"replica-{replica.index}.log")
                replica.process = None
            if replica.process is None and replica.restart_at is not None and now >= replica.restart_at:
                replica.restarts += 1
                old = replica.url
                replica.bind(same_ports=True)
                if replica.url != old:
                    log.warning("replica %d: another process took its port meanwhile; it moves from %s to %s",
                                replica.index, old, replica.url)
                    moved.append(replica.url)
                self._spawn(replica)
        return moved

    def stop(self) -> None:
        """SIGTERM every replica, SIGKILL those still running after the grace period."""
        running = [r.process for r in self.replicas if r.process is not None and r.process.poll() is None]
        running += [p for p in self._stopping if p.poll() is None]
        self._stopping = []
        for process in running:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for process in running:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for replica in self.replicas:
            replica.process, replica.running = None, False
            replica.close_sockets()
            if replica.log is not None:
                replica.log.close()
                replica.log = None
