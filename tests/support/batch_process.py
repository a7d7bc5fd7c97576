"""A batch command's processes and files, watched: read-only folders, the descendants still alive, a wait."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator

import psutil
import pytest


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """``folder`` read-only for the commands run inside: a read-only bind mount as root (root ignores modes)."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [folder, *folder.rglob("*")]}
        for p in modes:
            p.chmod(modes[p] & ~0o222)
        try:
            yield
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    if subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True).returncode != 0:
        pytest.skip("needs a read-only bind mount (root without CAP_SYS_ADMIN here)")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], capture_output=True).returncode != 0:
            pytest.skip("cannot remount the bind mount read-only here")
        yield
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def wait_for(what: str, ready: Callable[[], bool], process: subprocess.Popen[str] | None = None,
             seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        assert process is None or process.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.05)


def descendants_alive(processes: list[psutil.Process]) -> list[str]:
    alive = []
    for p in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
    return alive
