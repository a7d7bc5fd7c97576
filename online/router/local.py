"""``shardline router --local-replicas N``: N ``shardline serve`` processes on loopback, started and
kept running by the router.

Each replica serves on a free loopback port (its metrics on another), reads the same tenants
file and registry as the router, and takes requests only from this router: it is given the
sha256 of the router's key (``SHARDLINE_TENANCY_ROUTER_KEY_SHA256``). The router binds both ports
itself (``shardline.local_ports.listener``) and hands the sockets to the replica (``serve --fd
--metrics-fd``), so no other pick, here or in another process, can be given them before the replica
serves on them. The processes are ``shardline.processes``' children: a replica dies with the router, however the
router dies; one that exits is started again after a back-off (``restart_delay``: 1 s, doubling to 30 s; reset
once it has run a minute), on the same ports while nothing else holds them, else on new ones (then
``watch`` returns its new address, which the router's members follow); the router's health checks
take it out of rotation meanwhile. Stopping the router stops them (``stop_all``: SIGTERM, then SIGKILL past
``GRACE_S``).

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
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from shardline.local_ports import listener
from shardline.processes import Child, restart_delay, spawn, stop_all

log = logging.getLogger(__name__)


@dataclass
class LocalReplica:
    """One ``shardline serve`` process the router runs."""

    index: int
    port: int = 0
    metrics_port: int = 0
    sockets: tuple[socket.socket, socket.socket] | None = None  # both ports', bound here until the replica starts
    process: Child | None = None
    started_at: float = 0.0
    delay: float = 0.0
    restart_at: float | None = None
    restarts: int = 0
    running: bool = False  # a slot in use (started, or waiting to be started again after an exit)

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
        self._stopping: list[Child] = []

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
        main, metrics = (s.fileno() for s in replica.sockets)
        command = [
            sys.executable, "-m", "shardline.cli", "serve", "--fd", str(main), "--metrics-fd", str(metrics),
            "--tenants", self.tenants_file,
        ]
        try:
            replica.process = spawn(f"replica {replica.index}", command, self._log(replica), env=env,
                                    pass_fds=(main, metrics))
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
                            replica.index, process.returncode, ran, replica.delay, process.log_path)
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

    def _log(self, replica: LocalReplica) -> Path:
        return self.log_dir / f"replica-{replica.index}.log"

    def stop(self) -> None:
        """Stop every replica side by side (``stop_all``: SIGTERM, then SIGKILL past the grace period)."""
        stop_all([*(r.process for r in self.replicas if r.process is not None), *self._stopping])
        self._stopping = []
        for replica in self.replicas:
            replica.process, replica.running = None, False
            replica.close_sockets()
