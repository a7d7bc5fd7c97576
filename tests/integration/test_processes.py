"""``shardline.processes`` with real child processes: started with their output in a log, waited for until ready
(an exit or a time-out told with the log's end), stopped gracefully or killed with their process group, dying with
their parent (or, detached, outliving it and stopped later by pid), a reused pid left alone, and a child that binds
its port itself started again on a new one when another process took the port."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from shardline.errors import ChildNotReady
from shardline.local_ports import release, reserve_port
from shardline.processes import Child, alive, spawn, start_on_port, stop_pid

pytestmark = pytest.mark.timeout(120)
MARKER = b"shardline-process-test"


def _python(code: str, *args: str) -> list[str]:
    """A Python child running ``code``; its command line carries ``MARKER``."""
    return [sys.executable, "-c", textwrap.dedent(code), MARKER.decode(), *args]


def _eventually(check: Callable[[], bool], seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture()
def children() -> Iterator[list[Child]]:
    """Children a test started, killed however it ends."""
    started: list[Child] = []
    yield started
    for child in started:
        child.kill()
        child.wait()


def test_a_child_is_ready_once_its_check_passes_and_stops_on_sigterm(tmp_path: Path, children: list[Child]) -> None:
    ready = tmp_path / "ready"
    child = spawn("the sleeper", _python("""
        import sys, time
        from pathlib import Path
        print("starting", flush=True)
        time.sleep(0.3)
        Path(sys.argv[2]).touch()
        time.sleep(300)
    """, str(ready)), tmp_path / "sleeper.log")
    children.append(child)
    child.wait_ready(ready.exists, timeout_s=30)
    assert child.poll() is None and alive(child.pid, MARKER)
    assert child.stop() == -15  # SIGTERM's default action ended it
    assert not alive(child.pid, MARKER) and (tmp_path / "sleeper.log").read_text() == "starting\n"


def test_a_child_that_exits_while_starting_is_told_with_its_logs_end(tmp_path: Path) -> None:
    child = spawn("the failing one", _python("""
        import sys
        print("one\\ntwo\\n", flush=True)
        print("three", file=sys.stderr)
        sys.exit(3)
    """), tmp_path / "failing.log")
    with pytest.raises(ChildNotReady) as raised:
        child.wait_ready(lambda: False, timeout_s=30)
    assert raised.value.returncode == 3
    assert str(raised.value) == (f"the failing one exited with code 3 while starting; its log {tmp_path}/failing.log "
                                 "ends: one | two | three")


def test_a_child_not_ready_in_time_is_stopped(tmp_path: Path, children: list[Child]) -> None:
    child = spawn("the slow one", _python("import time; time.sleep(300)"), tmp_path / "slow.log")
    children.append(child)
    not_ready = r"^the slow one was not ready within 0.5 s; its log .* ends: \(nothing\)$"
    with pytest.raises(ChildNotReady, match=not_ready) as raised:
        child.wait_ready(lambda: False, timeout_s=0.5)
    assert raised.value.returncode is None and child.returncode == -15


def test_a_child_that_ignores_the_graceful_signal_is_killed_with_its_group(tmp_path: Path,
                                                                          children: list[Child]) -> None:
    grandchild = tmp_path / "grandchild"
    child = spawn("the stubborn one", _python("""
        import signal, subprocess, sys, time
        from pathlib import Path
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        Path(sys.argv[2]).write_text(str(subprocess.Popen(["sleep", "300"]).pid))
        time.sleep(300)
    """, str(grandchild)), tmp_path / "stubborn.log", own_session=True)
    children.append(child)
    child.wait_ready(grandchild.exists, timeout_s=30)
    sleeper = int(grandchild.read_text())
    assert alive(sleeper, b"sleep")
    assert child.stop(grace_s=0.5) == -9  # SIGTERM ignored: SIGKILL past the grace, to the whole group
    assert _eventually(lambda: not alive(sleeper, b"sleep")), "the child's own child outlived it"


def _parent(tmp_path: Path, detached: bool) -> tuple[subprocess.Popen[bytes], int]:
    """A process that starts a child with ``spawn`` and stays (the child's pid in ``child.pid``)."""
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen(_python(f"""
        import sys, time
        from pathlib import Path
        from shardline.processes import spawn
        child = spawn("the child", ["sleep", "300"], Path(sys.argv[2]) / "child.log", detached={detached})
        Path(sys.argv[2], "child.pid").write_text(str(child.pid))
        time.sleep(300)
    """, str(tmp_path)))
    assert _eventually(pid_file.exists), "the parent started no child"
    return parent, int(pid_file.read_text())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the death signal is Linux's")
def test_a_child_dies_with_its_parent_however_the_parent_dies(tmp_path: Path) -> None:
    parent, child = _parent(tmp_path, detached=False)
    assert alive(child, b"sleep")
    parent.kill()  # SIGKILL: the parent runs no clean-up
    parent.wait()
    assert _eventually(lambda: not alive(child, b"sleep")), "the child outlived its SIGKILLed parent"


def test_a_detached_child_outlives_its_parent_and_is_stopped_by_its_pid(tmp_path: Path) -> None:
    parent, child = _parent(tmp_path, detached=True)
    try:
        parent.kill()
        parent.wait()
        time.sleep(0.5)
        assert alive(child, b"sleep")
        assert stop_pid(child, marker=b"not-the-sleeper", group=True)  # not ours by its command line: left alone
        assert alive(child, b"sleep")
        assert stop_pid(child, marker=b"sleep", group=True) and not alive(child, b"sleep")
    finally:
        stop_pid(child, marker=b"sleep", grace_s=0)


_SERVER = """
    import socket, sys
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", int(sys.argv[2])))
    except OSError as e:
        sys.exit(f"cannot bind: {e}")
    sock.listen()
    while True:
        conn, _ = sock.accept()
        conn.sendall(b"ready\\n")
        conn.close()
"""


def _answers(port: int) -> bool:
    """Whether the server on ``port`` says it is ready (a socket that only listens there does not)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
            return conn.recv(16) == b"ready\n"
    except OSError:
        return False


def test_a_child_whose_port_another_process_took_starts_again_on_a_new_one(tmp_path: Path,
                                                                           children: list[Child]) -> None:
    def start(port: int) -> Child:
        child = spawn(f"the server on {port}", _python(_SERVER, str(port)), tmp_path / "server.log")
        children.append(child)
        return child

    first = reserve_port()
    taker = socket.socket()
    taker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    taker.bind(("127.0.0.1", first))  # another server bound the reserved port by number before the child did
    taker.listen()
    moves: list[int] = []
    try:
        child, port = start_on_port(start, _answers, first, 60, moves.append)
    finally:
        taker.close()
    assert port != first and moves == [port] and child.poll() is None and _answers(port)
    assert "cannot bind: [Errno 98] Address already in use" in (tmp_path / "server.log").read_text()
    assert children[0].returncode == 1 and children[-1] is child
    release(port)


def test_a_child_that_exits_for_another_reason_is_not_moved(tmp_path: Path) -> None:
    port = reserve_port()
    moves: list[int] = []
    with pytest.raises(ChildNotReady, match="exited with code 2 while starting") as raised:
        start_on_port(lambda p: spawn("the broken one", _python("import sys; sys.exit(2)"), tmp_path / "b.log"),
                      _answers, port, 60, moves.append)
    assert raised.value.returncode == 2 and moves == []
    release(port)
