"""The local Prefect server that batch runs share, so that no run pays for a temporary one.

With no ``PREFECT_API_URL``, Prefect starts a temporary API server inside every flow run
(seconds each: a database to migrate, an app to build) and stops it at the end, taking
the run's history with it. Instead, the CLI finds (or, the first time, starts) one
``prefect server start`` per Shardline home, on 127.0.0.1 and a free port, detached
from the command that started it, and later runs reuse it: the runs then show in its UI.

Its state lives under ``<home>/prefect/``: Prefect's own home for it (``PREFECT_HOME``:
the SQLite database; ``profiles.toml``, the home's Prefect profile ``shardline`` whose
``PREFECT_API_URL`` is the server's address, rewritten when it starts, so that a shell with
``PREFECT_HOME=<home>/prefect``, as ``shardline prefect env`` prints, runs every ``prefect``
command, worker and flow run against this server and never reads or writes the user's own
profile), ``server.json`` (pid, API URL), Prefect's ``server.pid``
(so ``PREFECT_HOME=<home>/prefect prefect server stop`` stops it too), ``server.log`` and
``server.lock`` (held while a command looks for the server or starts it, so two first
runs at once start one server). A record whose process is gone or is not a Prefect server
is stale and replaced; so is a live server that does not answer ``GET /api/health`` within
the time a start may take (``SHARDLINE_PREFECT_START_TIMEOUT_S``).

Why not ``prefect server start --background``: it leaves the server in the starting command's
process group (which the batch command's watchdog kills, see ``_supervise``) with its output
piped to that command, which ends; so the same ``prefect server start`` runs in the foreground
of a session of its own, its output in ``server.log``, under a small keeper process (``_KEEPER``)
whose pid is where ``--background`` puts it and that stops the server if its home is deleted.

A restarted server takes its former port again (the profile's) when it is free, so a worker
or a shell keeps its address across ``shardline prefect stop``.

Which API a run uses (``api_url_for_run``): the user's ``PREFECT_API_URL`` (environment
or Prefect profile) always wins, unless it is this home's own address (its profile's: the run
then finds or starts this server, as without one); else ``SHARDLINE_PREFECT_SERVER=local``
(the default) uses this server, and ``temporary`` keeps Prefect's temporary server per run
(nothing is left running). POSIX only for the lock (``fcntl``); elsewhere two first runs at once may
each start a server, the last one recorded wins.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import tomllib
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

from shardline.errors import ChildNotReady, PrefectServerUnavailable
from shardline.local_ports import reserve_port
from shardline.local_prefect import (
    HEALTH_TIMEOUT_S,
    PREFECT_MARKER,
    RECORD,
    LocalServer,
    find,
    healthy,
    is_prefect_process,
    read_record,
    server_dir,
)
from shardline.processes import GRACE_S, Child, spawn, start_on_port, stop_pid

PREFECT_PID_FILE, LOG, LOCK = "server.pid", "server.log", "server.lock"
PROFILES, PROFILE = "profiles.toml", "shardline"  # the home's Prefect profiles file (Prefect's own name) and profile
# What a shell that uses the home's profile must not keep: each would win over the profile's API URL.
OVERRIDE_THE_PROFILE = ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH")
# What the server's environment must not inherit from the command that starts it: where another server
# is (the client side), and which Prefect home and profile to read (it has its own).
_NOT_INHERITED = ("PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_HOME", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH",
                  "PREFECT_UI_API_URL", "PREFECT_UI_URL")


def started_line(ui_url: str) -> str:
    """What a command says when it (or the batch runner it started) started the local server."""
    return f"started the local Prefect server: its UI is {ui_url}; later runs reuse it (`shardline prefect stop` stops it)"


def home_environment(home: str | os.PathLike[str]) -> dict[str, str | None]:
    """What makes a shell (or this process) use the home: ``SHARDLINE_STORAGE_HOME``, ``PREFECT_HOME`` at the home's
    Prefect home (so that every ``prefect`` command, worker and flow run reads the home's profile, whose API URL is
    its local server), telemetry off; None for the variables to unset (``OVERRIDE_THE_PROFILE``)."""
    from shardline.cli.common import OFF_THE_NETWORK

    home = Path(home).absolute()
    return {"SHARDLINE_STORAGE_HOME": str(home), "PREFECT_HOME": str(server_dir(home)),
            **dict.fromkeys(OVERRIDE_THE_PROFILE), **OFF_THE_NETWORK}


def _profiles(folder: Path) -> dict[str, Any]:
    try:
        return tomllib.loads((folder / PROFILES).read_text())
    except (OSError, tomllib.TOMLDecodeError):  # none yet, or unreadable: written anew
        return {}


def profile_api_url(home: str | os.PathLike[str]) -> str | None:
    """The home's own Prefect API address, as its profile holds it (the last its server started on); None: none yet."""
    url = _profiles(server_dir(home)).get("profiles", {}).get(PROFILE, {}).get("PREFECT_API_URL")
    return str(url) if url else None


def _write_profile(folder: Path, api_url: str) -> None:
    """Point the home's profile at its server (``api_url``), active unless the user made another profile of the file
    active; the file's other settings and profiles are kept (``prefect config set`` in a shell using it writes here)."""
    profiles = _profiles(folder)
    mine = profiles.setdefault("profiles", {}).setdefault(PROFILE, {})
    if mine.get("PREFECT_API_URL") == api_url:
        return
    mine["PREFECT_API_URL"] = api_url
    mine.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    profiles.setdefault("active", PROFILE)
    import toml  # Prefect's own TOML writer (tomllib only reads)

    staged = folder / f".{PROFILES}.{os.getpid()}"
    staged.write_text(toml.dumps(profiles))
    os.replace(staged, folder / PROFILES)


def _former_port(home: str | os.PathLike[str]) -> int:
    """The port the home's server last ran on (0: none): a restarted server takes it again when it is free."""
    url = profile_api_url(home)
    try:
        return (urlsplit(url).port or 0) if url else 0
    except ValueError:
        return 0


@contextlib.contextmanager
def _locked(folder: Path, name: str = LOCK) -> Iterator[None]:
    """Hold ``folder/name`` (an exclusive ``flock``; ``server.lock``): one command at a time finds or starts
    the server (or the batch runner, its own lock)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / name, "a+") as lock:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock (see the module's docstring)
            yield
            return
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def server_environment(folder: Path, port: int) -> dict[str, str]:
    """The started server's environment: its own Prefect home, off the network, its UI pointed at its API."""
    from shardline.cli.common import OFF_THE_NETWORK

    env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
    api_url = f"http://127.0.0.1:{port}/api"
    env.update(OFF_THE_NETWORK)
    env.update(PREFECT_HOME=str(folder), PREFECT_UI_API_URL=api_url, PREFECT_SERVER_API_HOST="127.0.0.1",
               PREFECT_SERVER_API_PORT=str(port))
    return env


def _start(folder: Path, timeout_s: float, prefer: int = 0) -> LocalServer:
    """Start ``prefect server start`` detached (own session, so no process group kill reaches it); wait until healthy.

    Its port is reserved (``shardline.local_ports.reserve_port``: the server binds it itself), ``prefer`` while it is
    free (the UI's address stays the same across restarts); a server that exits because another process took the
    port first is started again on a new one (``processes.start_on_port``).
    """

    def start(port: int) -> Child:
        child = _spawn(folder, port)
        _write_record(folder, LocalServer(pid=child.pid, api_url=_api_url(port)))
        return child

    try:
        child, port = start_on_port(start, lambda port: healthy(_api_url(port), timeout=1.0), reserve_port(prefer=prefer),
                                    timeout_s)
    except ChildNotReady as e:
        _forget(folder)
        raise PrefectServerUnavailable(
            f"{e}. Set SHARDLINE_PREFECT_SERVER=temporary to use a temporary server per run, or PREFECT_API_URL to "
            "use your own server"
        ) from e
    child.disown()  # nobody waits for the detached server: once this command ends, init reaps it
    return LocalServer(pid=child.pid, api_url=_api_url(port))


def _api_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/api"


def _spawn(folder: Path, port: int) -> Child:
    """Start the keeper and its ``prefect server start`` on ``port``, detached (a session of their own)."""
    server_command = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    return spawn(f"the local Prefect server ({' '.join(server_command[2:])})",
                 [sys.executable, "-c", _KEEPER, str(folder), *server_command], folder / LOG,
                 env=server_environment(folder, port), cwd=folder, detached=True)


# The server's keeper: the process the record names, leader of the server's session, stdlib only (it
# runs with `python -c`, so that it imports nothing of Shardline). It runs `prefect server start`, passes
# SIGTERM/SIGINT/SIGHUP on (Prefect's own `prefect server stop` signals the pid in server.pid), and
# stops the server once its Prefect home is deleted (`rm -rf` of a Shardline home, a demo's or a
# benchmark's folder): without a record, no command would ever find that server again to stop it.
_KEEPER = """
import signal, subprocess, sys, time
from pathlib import Path
home, command = Path(sys.argv[1]), sys.argv[2:]
server = subprocess.Popen(command)
def forward(signum, frame):
    server.send_signal(signum)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, forward)
while server.poll() is None:
    time.sleep(2)
    if not home.exists() and server.poll() is None:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
sys.exit(server.wait())
"""


def _write_record(folder: Path, server: LocalServer) -> None:
    """Record the server (written to a temporary name, then renamed: a reader never sees half a record)."""
    staged = folder / f".{RECORD}.{os.getpid()}"
    staged.write_text(json.dumps({"pid": server.pid, "api_url": server.api_url, "ui_url": server.ui_url,
                                  "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
    os.replace(staged, folder / RECORD)
    (folder / PREFECT_PID_FILE).write_text(str(server.pid))
    _write_profile(folder, server.api_url)


def _forget(folder: Path) -> None:
    for name in (RECORD, PREFECT_PID_FILE):
        (folder / name).unlink(missing_ok=True)


def ensure(home: str | os.PathLike[str], timeout_s: float = 120.0,
           starting: Callable[[], None] | None = None) -> tuple[LocalServer, bool]:
    """The home's local server, started (detached, it outlives the command) when none answers; ``starting`` is
    called just before a start (to say what the caller waits for).

    Returns:
        The server, and whether this call started it.

    Raises:
        PrefectServerUnavailable: it could not be started (the message names its log).
    """
    found = find(home)  # the common case takes no lock: a record and one health check
    if found is not None:
        return found, False
    folder = server_dir(home)
    with _locked(folder):
        recorded = read_record(folder)
        if recorded is not None and is_prefect_process(recorded.pid):
            # Started by another command (which may since have ended), or busy: it is given the time a start
            # may take before it counts as stale, since replacing it would cut off the runs that use it.
            if _wait_healthy(recorded, timeout_s):
                return recorded, False
            _stop_process(recorded.pid)
        _forget(folder)
        if starting is not None:
            starting()
        return _start(folder, timeout_s, prefer=_former_port(home)), True


def _wait_healthy(server: LocalServer, timeout_s: float) -> bool:
    """Whether the server answers its health check within ``timeout_s`` while its process lives."""
    deadline = time.monotonic() + timeout_s
    while is_prefect_process(server.pid):
        if healthy(server.api_url, timeout=HEALTH_TIMEOUT_S):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return False


def _stop_process(pid: int, grace_s: float = GRACE_S) -> None:
    """SIGTERM the keeper (it passes it on to the server), SIGKILL its session after ``grace_s``: the keeper leads
    the server's session, both go."""
    stop_pid(pid, marker=PREFECT_MARKER, grace_s=grace_s, group=True)


def stop(home: str | os.PathLike[str], timeout_s: float = 20.0) -> LocalServer | None:
    """Stop the home's local server, if one is recorded and running; returns what was stopped (None: nothing)."""
    folder = server_dir(home)
    if not folder.exists():
        return None
    with _locked(folder):
        recorded = read_record(folder)
        running = recorded is not None and is_prefect_process(recorded.pid)
        if running and recorded is not None:
            _stop_process(recorded.pid, timeout_s)
        _forget(folder)
    return recorded if running else None


def api_url_for_run(mode: str, home: str | os.PathLike[str], timeout_s: float = 120.0,
                    starting: Callable[[], None] | None = None) -> tuple[str | None, bool]:
    """The Prefect API this process's flow runs should use, and whether this call started a server for it.

    The user's ``PREFECT_API_URL`` (environment or Prefect profile) always wins: (None, False), nothing to do;
    unless it is the home's own address (its profile's, as in a shell that ``shardline prefect env`` set up): then,
    as with none and ``local``, this finds or starts the home's server, sets ``PREFECT_API_URL`` in this process's
    environment (Dask workers started later inherit it) and refreshes Prefect's settings. With none,
    ``temporary`` leaves Prefect to start its temporary server.
    """
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if (url and url != profile_api_url(home)) or (not url and mode == "temporary"):
        return None, False
    server, started = ensure(home, timeout_s, starting)
    os.environ["PREFECT_API_URL"] = server.api_url
    from prefect.context import refresh_global_settings_context

    refresh_global_settings_context()
    return server.api_url, started
