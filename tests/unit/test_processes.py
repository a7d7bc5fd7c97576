"""The pure parts of ``shardline.processes``: the restart back-off, how an exit and a log's end are told, and what
counts as a live process of ours. Real children are tests/integration/test_processes.py's."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from shardline.errors import ChildNotReady, ShardlineError
from shardline.processes import (
    HEALTHY_RUN_S,
    RESTART_FIRST_S,
    RESTART_MAX_S,
    alive,
    exit_words,
    last_lines,
    restart_delay,
    stop_pid,
)


def test_the_restart_back_off_doubles_to_its_cap_and_starts_afresh_after_a_healthy_run() -> None:
    delays, delay = [], 0.0
    for _ in range(8):
        delay = restart_delay(delay, ran_s=2.0)
        delays.append(delay)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert RESTART_FIRST_S == 1.0 and RESTART_MAX_S == 30.0
    assert restart_delay(30.0, ran_s=HEALTHY_RUN_S) == 1.0  # it ran a minute: afresh
    assert restart_delay(30.0, ran_s=HEALTHY_RUN_S - 1) == 30.0


def test_an_exit_is_told_in_words() -> None:
    assert exit_words(0) == "exited with code 0"
    assert exit_words(3) == "exited with code 3"
    assert exit_words(-signal.SIGKILL) == "was ended by SIGKILL"
    assert exit_words(-signal.SIGTERM) == "was ended by SIGTERM"
    assert exit_words(-200) == "was ended by signal 200"


def test_a_logs_end_is_its_last_non_blank_lines_on_one_line() -> None:
    text = "starting\n\nloading the model\n  Traceback (most recent call last):  \n\nOSError: port taken\n\n"
    assert last_lines(text) == "loading the model | Traceback (most recent call last): | OSError: port taken"
    assert last_lines(text, 1) == "OSError: port taken"
    assert last_lines("") == "" and last_lines("\n \n") == ""


def test_not_ready_is_a_shardline_error_with_its_exit() -> None:
    error = ChildNotReady("nginx exited with code 1 while starting", 1, Path("/tmp/nginx.log"))
    assert isinstance(error, ShardlineError) and isinstance(error, RuntimeError)
    assert error.returncode == 1 and error.log_path == Path("/tmp/nginx.log") and str(error).startswith("nginx")


@pytest.mark.parametrize("pid", [0, -1, "minus this process"])  # (an id stable across xdist's workers)
def test_no_pid_that_would_signal_a_group_or_every_process_counts_as_alive(pid: int | str) -> None:
    pid = -os.getpid() if pid == "minus this process" else int(pid)
    assert not alive(pid) and not alive(pid, b"python")
    assert stop_pid(pid, marker=None)  # nothing sent: kill(0 or -1, SIGTERM) would reach this test's own group


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="no /proc here")
def test_a_live_pid_is_ours_only_when_its_command_line_holds_the_marker() -> None:
    program = Path("/proc/self/cmdline").read_bytes().split(b"\0")[0]
    assert alive(os.getpid()) and alive(os.getpid(), program)
    assert not alive(os.getpid(), b"shardline-no-such-program")  # a pid reused by another program: not ours
