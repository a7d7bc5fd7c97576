"""Batch commands in a child process group that cannot outlive the command the user started.

With no ``PREFECT_API_URL``, Prefect starts a temporary API server as a subprocess, and
a local Dask cluster starts worker processes. A command killed with SIGKILL runs no
clean-up, so they would stay behind. Hence the process the user started (the parent)
only supervises: the command runs in a child, in a process group of its own, beside a
watchdog (forked by the child before anything else starts) that holds the read end of
a pipe whose write end only the parent holds. When the parent ends, however it ends,
the pipe reads end-of-file and the watchdog kills the whole group: the child, Prefect's
server, the Dask workers, anything they started that stayed in the group, and itself.
Ctrl-C, SIGTERM and SIGHUP sent to the parent are passed on to the child, so a stop is
graceful when it can be; the parent exits with the child's exit code.

POSIX only (fork, process groups); elsewhere the command runs in the process itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import FrameType
from typing import Sequence

CHILD_FLAG = "--_supervised-child"
SUPERVISED = (("batch", "run"), ("batch", "resume"))
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def wants_supervision(argv: Sequence[str]) -> bool:
    """Whether the command line is one that starts Prefect and Dask (and the platform can supervise it)."""
    return hasattr(os, "fork") and hasattr(os, "killpg") and tuple(argv[:2]) in SUPERVISED


def run_supervised(argv: Sequence[str], module: str = "shardline.cli") -> int:
    """Run ``python -m module CHILD_FLAG <fd> argv...`` in its own process group, tied to this process.

    Returns:
        The child's exit code (128 + N when signal N ended it).
    """
    read_end, write_end = os.pipe()  # neither end is inherited unless passed
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", module, CHILD_FLAG, str(read_end), *argv], pass_fds=(read_end,), process_group=0
        )
    finally:
        os.close(read_end)

    def forward(signum: int, _frame: FrameType | None) -> None:
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in _FORWARDED}
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        os.close(write_end)  # the watchdog kills whatever of the group is left
    return code if code >= 0 else 128 - code


def become_supervised_child(fd: int) -> None:
    """In the child: fork the watchdog that kills this process group once the parent is gone.

    Call first thing, before any thread or subprocess starts.
    """
    if os.fork() == 0:  # the watchdog
        try:
            for s in _FORWARDED:  # what the group gets is for the child; this one waits for the parent only
                signal.signal(s, signal.SIG_IGN)
            while os.read(fd, 64):
                pass
        finally:
            os.killpg(0, signal.SIGKILL)
            os._exit(0)
    os.close(fd)
