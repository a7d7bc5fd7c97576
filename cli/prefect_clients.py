"""The Prefect workers and flow runs that use a home's local Prefect server, found so that they stop with it.

A shell set up by ``eval "$(shardline prefect env)"`` runs ``prefect worker start`` with ``PREFECT_HOME`` at the
home's Prefect home (``<home>/prefect``); the worker's flow runs (``python -m prefect.engine``) inherit it. Nothing
records them (the user started them, as Prefect's docs say), and once the home's server stops they can do nothing
but retry it: so ``shardline prefect stop`` (and ``make clean`` through it) finds them by what they were started
with and stops them too, before the server. A process counts when it is this user's, its command line is a Prefect
worker or flow run, and its environment names the home's Prefect home or its server's API URL.

Read from ``/proc`` (Linux); where there is none, none is found and the user stops them (Ctrl-C, ``kill %1``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from shardline.local_prefect import server_dir
from shardline.processes import stop_pids

_PROC = Path("/proc")
_MARKERS = {"Prefect worker": b"prefect", "flow run": b"prefect.engine"}  # what its command line holds while it runs


@dataclass(frozen=True)
class PrefectClient:
    """A running Prefect worker or flow run of a home: its pid, what it is, its command line."""

    pid: int
    kind: str  # "Prefect worker" or "flow run"
    command: tuple[str, ...]


def _kind(argv: list[str]) -> str | None:
    """``prefect worker start ...`` (the script, or ``python -m prefect``) or ``python -m prefect.engine``."""
    for i, arg in enumerate(argv):
        if os.path.basename(arg) == "prefect" and argv[i + 1:i + 3] == ["worker", "start"]:
            return "Prefect worker"
        if arg == "-m" and argv[i + 1:i + 2] == ["prefect.engine"]:
            return "flow run"
    return None


def _environment(pid: int) -> dict[str, str]:
    items = (_PROC / str(pid) / "environ").read_bytes().decode(errors="replace").split("\0")
    return {name: value for name, equals, value in (item.partition("=") for item in items) if equals}


def _command(pid: int) -> list[str]:
    return (_PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]


def find(home: str | os.PathLike[str], api_urls: set[str]) -> list[PrefectClient]:
    """This user's Prefect workers and flow runs started with the home's Prefect home or one of ``api_urls``."""
    if not _PROC.is_dir():
        return []
    prefect_home = os.path.realpath(server_dir(home))
    found = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            argv = _command(int(entry.name))
            kind = _kind(argv)
            if kind is None:
                continue
            env = _environment(int(entry.name))
        except OSError:  # gone meanwhile, or not readable
            continue
        named = env.get("PREFECT_HOME")
        if (named and os.path.isabs(named) and os.path.realpath(named) == prefect_home) or \
                env.get("PREFECT_API_URL") in api_urls:
            found.append(PrefectClient(int(entry.name), kind, tuple(argv)))
    return sorted(found, key=lambda c: (c.kind != "Prefect worker", c.pid))  # workers first: no new runs


def stop(home: str | os.PathLike[str], api_urls: set[str], timeout_s: float = 20.0) -> list[PrefectClient]:
    """SIGTERM each of the home's workers and flow runs (``find``), SIGKILL those left after ``timeout_s``; returns
    them. Only the process itself is signalled: a worker started from a script shares the script's process group."""
    clients = find(home, api_urls)
    stop_pids(((c.pid, _MARKERS[c.kind]) for c in clients), timeout_s)
    return clients
