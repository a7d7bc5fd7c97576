"""Batch commands in a child process group that cannot outlive the command the user started.

A local Dask cluster starts worker processes (and, with ``SHARDLINE_PREFECT_SERVER=temporary``,
Prefect starts a temporary API server). A command killed with SIGKILL runs no clean-up, so
they would stay behind. Hence the process the user started (the parent) only supervises:
the command runs in a child, in a process group of its own, beside a
watchdog (forked by the child before anything else starts) that holds the read end of a
pipe whose write end only the parent holds. When the parent ends, however it ends, the
pipe reads end-of-file and the watchdog kills the whole group: the child, Prefect's
temporary server, the Dask workers, anything they started that stayed in the group, and
itself. (The local Prefect server, cli/prefect_server.py, leads a session of its
own on purpose: later runs reuse it.) Ctrl-C, SIGTERM and SIGHUP sent to the parent are
passed on to the child, so a stop is graceful when it can be; the parent exits with the
child's exit code.

The child is a new interpreter (``python -m shardline.cli``), not a bare fork of the parent:
the parent has loaded numpy and pyarrow, whose native threads a fork does not copy (macOS's
frameworks forbid it outright). It ends without the interpreter's teardown
(``exit_without_teardown``), which would cost the command most of a second for nothing.

POSIX only (fork, process groups); elsewhere the command runs in the process itself.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import traceback
from types import FrameType
from typing import Callable, NoReturn, Sequence

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


def run_supervised_child(fd: int, command: Callable[[], object]) -> NoReturn:
    """In the child: fork the watchdog (first thing, before any thread or subprocess starts), run
    ``command()``, and end with what it passed to ``sys.exit`` (0 when it returns; 1, with the
    traceback, when it raises), without the interpreter's teardown."""
    _become_supervised_child(fd)
    code = 1
    try:
        command()
        code = 0
    except SystemExit as e:
        code = _exit_status(e)
    except BaseException:
        traceback.print_exc()
    finally:
        exit_without_teardown(code)


def _exit_status(exit: SystemExit) -> int:
    """The status ``sys.exit(arg)`` ends a process with: 0 for None, the int, else 1 with ``arg`` printed."""
    if exit.code is None:
        return 0
    if isinstance(exit.code, int):
        return exit.code
    print(exit.code, file=sys.stderr)
    return 1


def _become_supervised_child(fd: int) -> None:
    """In the child: fork the watchdog that kills this process group once the parent is gone."""
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


def exit_without_teardown(code: int) -> NoReturn:
    """End this process as ``sys.exit`` would, less the interpreter's teardown of every module and object.

    What an exit must still do is done, in the interpreter's order: wait for the non-daemon threads,
    run the ``atexit`` handlers (Prefect's log and event flushes, ``logging.shutdown``), flush stdout
    and stderr. What is skipped is freeing the heap object by object (with Prefect, pydantic, pyarrow
    and Dask loaded: most of a second) before the process ends and the OS frees it at once.
    """
    try:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
