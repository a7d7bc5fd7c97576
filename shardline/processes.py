"""The child processes Shardline starts: one way to start them, wait until they are ready, stop them, tell whether
one still runs, and start one again after a back-off. Standard library only.

Who starts what: the ``vllm`` runtime vLLM's server, the router its local replicas and nginx in front, the CLI the
home's local Prefect server (under its keeper) and the warm batch runner; a batch lease asks whether its holder on
this host still runs. They all go through here:

- ``spawn``: a ``Child`` (a ``Popen`` that knows its name and its log), its output appended to a log file, no
  stdin, the file descriptors it is handed. Unless it is ``detached`` (a session of its own, left running when this
  process ends: the Prefect server, the batch runner), it dies with this process: on Linux the kernel sends it
  SIGTERM when its parent dies, however it dies (``PR_SET_PDEATHSIG``, set between fork and exec; elsewhere
  nothing). Linux ties that signal to the *thread* that started the child: start children from a thread that lives
  as long as they should (the main thread, an event loop's, a supervisor's own).
- ``Child.wait_ready``: until a check (``ready``) passes; a child that exits first, or is not ready in time (it is
  then stopped), is a ``ChildNotReady`` whose message ends with its log's last lines.
- ``Child.stop`` and ``stop_pid`` (a process known by its recorded pid): one policy, the graceful signal (SIGTERM
  unless the program finishes its work on another, as nginx on SIGQUIT), ``grace_s`` to end (``GRACE_S`` unless the
  caller says why not), then SIGKILL, to the whole process group when the child leads one (its own children too).
- ``alive``: a pid that runs (a zombie counts as gone) and, given a marker, is ours: a process of this user whose
  command line, where /proc tells, holds the marker, so that a recorded pid the OS gave to another program since
  does not count.
- ``restart_delay``: the back-off before a child that exited is started again (pure).
- ``start_on_port``: a child that binds its port itself (``shardline.local_ports.reserve_port``'s) and exits when
  another process took the port first is started again on a new one.

``cli/supervise.py`` is not built on these: it ties a whole process group (Dask's workers, Prefect's temporary
server) to the command through a pipe that a watchdog reads, which a death signal (one process, Linux only) cannot.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from shardline.errors import ChildNotReady
from shardline.local_ports import reserve_port

GRACE_S = 10.0  # how long a stopped child is given to end before SIGKILL, unless its caller says why not
KILLED_WAIT_S = 5.0  # how long a SIGKILLed one is waited for
POLL_S = 0.05
TAIL_LINES = 3  # the log's last lines a ChildNotReady quotes
PORT_MOVES = 3  # starts on a new port, at most, when another process took the last one
RESTART_FIRST_S = 1.0
RESTART_MAX_S = 30.0
HEALTHY_RUN_S = 60.0  # a child that ran this long starts its back-off afresh
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Child(subprocess.Popen[bytes]):
    """A process this one started (``spawn``): a ``Popen`` with the name messages call it by, its log, and whether
    it leads a process group of its own (then ``stop``'s SIGKILL ends the group)."""

    def __init__(self, name: str, argv: list[str], log_path: Path | None, leads_group: bool, **popen: Any) -> None:
        self.name, self.log_path, self.leads_group = name, log_path, leads_group
        super().__init__(argv, **popen)

    def log_tail(self) -> str:
        """Its log's last lines, on one line ('' without a log)."""
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 16384))
                return last_lines(log.read().decode(errors="replace"))
        except OSError:
            return ""

    def wait_ready(self, ready: Callable[[], bool], timeout_s: float, grace_s: float = GRACE_S) -> None:
        """Return once ``ready()`` holds while it runs (a check may block a while: an HTTP request, say).

        Raises:
            ChildNotReady: it exited first, or was not ready within ``timeout_s`` (then it is stopped, with
                ``grace_s``); the message quotes its log's last lines.
        """
        deadline = time.monotonic() + timeout_s
        while self.poll() is None:
            if ready() and self.poll() is None:  # not another process's answer on its port, after it exited
                return
            if time.monotonic() > deadline:
                self.stop(grace_s)
                raise self._not_ready(f"was not ready within {timeout_s:g} s", None)
            time.sleep(POLL_S)
        raise self._not_ready(f"{exit_words(self.returncode)} while starting", self.returncode)

    def _not_ready(self, why: str, returncode: int | None) -> ChildNotReady:
        where = "" if self.log_path is None else f"; its log {self.log_path} ends: {self.log_tail() or '(nothing)'}"
        return ChildNotReady(f"{self.name} {why}{where}", returncode, self.log_path)

    def stop(self, grace_s: float = GRACE_S, signum: int = signal.SIGTERM) -> int | None:
        """Send it ``signum``, SIGKILL it (its group, when it leads one) if it has not ended within ``grace_s``.
        Harmless when it has ended. Returns its exit code (None: not even SIGKILL ended it, unheard of)."""
        stop_all([self], grace_s, signum)
        return self.returncode

    def gone_within(self, seconds: float) -> bool:
        """Whether it has ended (and is reaped) within ``seconds``."""
        try:
            self.wait(seconds)
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill(self) -> None:
        """SIGKILL it, and its process group when it leads one."""
        if self.poll() is None:
            _kill(self.pid, self.leads_group)

    def disown(self) -> None:
        """Leave it running after this process ends, with nobody to wait for it (init reaps it): also keeps
        ``Popen.__del__`` from warning that it "is still running"."""
        self.returncode = 0


def spawn(name: str, argv: list[str], log_path: Path | None, *, env: Mapping[str, str] | None = None,
          cwd: Path | None = None, pass_fds: Collection[int] = (), detached: bool = False,
          own_session: bool = False) -> Child:
    """Start ``argv`` as a ``Child`` called ``name``, its output appended to ``log_path`` (None: this process's),
    stdin from /dev/null, handed ``pass_fds``.

    ``detached``: a session of its own and no death signal, so it outlives this process (who stops it later finds
    it by the pid it recorded: ``stop_pid``). Otherwise it is sent SIGTERM when this process dies (the thread that
    starts it, on Linux: see the module docstring); ``own_session`` puts it in a session of its own as well (a
    terminal's Ctrl-C does not reach it: its parent stops it, gracefully; ``stop``'s SIGKILL ends its group).

    Raises:
        OSError: ``argv[0]`` cannot be run, or the log cannot be opened.
    """
    sink = None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        sink = open(log_path, "ab")  # noqa: SIM115 - the child holds it from now on
    try:
        return Child(name, argv, log_path, detached or own_session, stdin=subprocess.DEVNULL, stdout=sink,
                     stderr=subprocess.STDOUT if sink is not None else None, env=env, cwd=cwd,
                     pass_fds=tuple(pass_fds), start_new_session=detached or own_session,
                     preexec_fn=None if detached else _death_signal(signal.SIGTERM))
    finally:
        if sink is not None:
            sink.close()


def _death_signal(signum: int) -> Callable[[], None] | None:
    """What a child runs between fork and exec to be sent ``signum`` when its parent dies (Linux's prctl, looked
    up here, before the fork, so the child imports nothing); None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = _prctl()
    parent = os.getpid()

    def die_with_parent() -> None:  # pragma: no cover - runs in the child
        prctl(_PR_SET_PDEATHSIG, signum)
        if os.getppid() != parent:  # the parent died before the prctl: no signal would come
            os.kill(os.getpid(), signum)

    return die_with_parent


@functools.cache
def _prctl() -> Callable[..., int]:
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]


def alive(pid: int, marker: bytes | None = None) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone) and, given ``marker``, is ours: a process of this user whose
    command line holds ``marker`` where /proc tells (so that a pid the OS reused for another program does not
    count). Without a marker, another user's process counts as running."""
    if pid <= 0:  # os.kill would signal a group, or every process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user: not ours
        if marker is not None:
            return False
    proc = Path(f"/proc/{pid}")
    try:
        state = (proc / "stat").read_bytes().rsplit(b")", 1)[-1].split()[0]
        if state in (b"Z", b"X"):
            return False
        return marker is None or marker in (proc / "cmdline").read_bytes()
    except FileNotFoundError:  # no /proc here (macOS): the live pid is all we can tell; or it ended just now
        return not Path("/proc/self").exists()
    except (OSError, IndexError):
        return marker is None


def stop_all(children: Iterable[Child], grace_s: float = GRACE_S, signum: int = signal.SIGTERM) -> None:
    """Stop several children side by side, as ``Child.stop`` stops one: ``signum`` to each, one ``grace_s`` for
    all, then SIGKILL to those still running."""
    _stop([c for c in children if c.poll() is None], grace_s, signum)


def stop_pids(pids: Iterable[tuple[int, bytes | None]], grace_s: float = GRACE_S) -> None:
    """Stop processes known by pid and marker side by side, as ``stop_all`` stops children: SIGTERM to each (while
    ``alive(pid, marker)``), one ``grace_s`` for all, then SIGKILL to those still running."""
    _stop([_Recorded(pid, marker, False) for pid, marker in pids], grace_s, signal.SIGTERM)


def stop_pid(pid: int, *, marker: bytes | None, grace_s: float = GRACE_S, signum: int | None = signal.SIGTERM,
             group: bool = False) -> bool:
    """Stop a process known by its pid (a detached child's record) as ``Child.stop`` does: ``signum`` (None: it
    was asked some other way already), ``grace_s`` to end, then SIGKILL (to its group with ``group``: it leads
    one). Only while ``alive(pid, marker)``: a reused pid is left alone. Returns whether it is gone."""
    recorded = _Recorded(pid, marker, group)
    if recorded.gone_within(0):
        return True
    _stop([recorded], grace_s, signum)
    return recorded.gone_within(0)


class _Stoppable(Protocol):
    def send_signal(self, sig: int) -> None: ...  # noqa: D102

    def gone_within(self, seconds: float) -> bool: ...  # noqa: D102

    def kill(self) -> None: ...  # noqa: D102


@dataclass(frozen=True)
class _Recorded:
    """A process known by its recorded pid, while ``alive(pid, marker)``."""

    pid: int
    marker: bytes | None
    group: bool

    def gone_within(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while True:
            with contextlib.suppress(ChildProcessError):  # this process's own child (it started it): reap it
                os.waitpid(self.pid, os.WNOHANG)
            if not alive(self.pid, self.marker):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)

    def send_signal(self, sig: int) -> None:
        if alive(self.pid, self.marker):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        if alive(self.pid, self.marker):
            _kill(self.pid, self.group)


def _stop(processes: Sequence[_Stoppable], grace_s: float, signum: int | None) -> None:
    """The one stop policy: ``signum`` to each, ``grace_s`` for all to end, then SIGKILL to the rest."""
    if signum is not None:
        for process in processes:
            process.send_signal(signum)
    deadline = time.monotonic() + grace_s
    left = [p for p in processes if not p.gone_within(max(0.0, deadline - time.monotonic()))]
    for process in left:
        process.kill()
    for process in left:
        process.gone_within(KILLED_WAIT_S)


def _kill(pid: int, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)


def start_on_port(start: Callable[[int], Child], ready: Callable[[int], bool], port: int, timeout_s: float,
                  moved: Callable[[int], None] | None = None) -> tuple[Child, int]:
    """Start a child that binds ``port`` itself (``start(port)``) and wait until ``ready(port)``; one that exits
    while starting because another process took the port first (``reserve_port(prefer=port)`` then gives a new
    one) is started again on the new port (``moved(port)`` told first), at most ``PORT_MOVES`` times, all within
    ``timeout_s``. Returns the child and its port.

    Raises:
        ChildNotReady: it exited for another reason, or was not ready in time (then stopped).
    """
    deadline = time.monotonic() + timeout_s
    moves = 0
    while True:
        child = start(port)
        try:
            child.wait_ready(lambda: ready(port), max(0.0, deadline - time.monotonic()))
            return child, port
        except ChildNotReady as e:
            if e.returncode is None or moves >= PORT_MOVES:
                raise
            new = reserve_port(prefer=port)
            if new == port:  # its port was free: it exited for another reason
                raise
            moves, port = moves + 1, new
            if moved is not None:
                moved(port)


def restart_delay(previous: float, ran_s: float) -> float:
    """The back-off before a child that exited after running ``ran_s`` seconds is started again, its previous
    back-off ``previous`` (0: none yet): 1 s, doubling to 30 s, afresh after a run of a minute (pure)."""
    if ran_s >= HEALTHY_RUN_S or previous <= 0:
        return RESTART_FIRST_S
    return min(RESTART_MAX_S, previous * 2)


def last_lines(text: str, count: int = TAIL_LINES) -> str:
    """The last ``count`` non-blank lines of ``text``, stripped, on one line (' | ' between them)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-count:])


def exit_words(returncode: int) -> str:
    """How a process ended, as a message says it: 'exited with code 3', 'was ended by SIGKILL'."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        return f"was ended by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was ended by signal {-returncode}"


__all__ = ["GRACE_S", "Child", "alive", "exit_words", "last_lines", "restart_delay", "spawn", "start_on_port",
           "stop_all", "stop_pid"]
