"""The warm batch runner: one long-lived process per Shardline home that runs `batch run` jobs.

A job run cold pays, every time, for what does not change between jobs: the interpreter's
imports (Prefect, Dask, pyarrow, onnxruntime: about 3 s on 2 cores), a Dask ``LocalCluster``
started and closed (1-5 s), and each worker's first load of the model. So the first
`batch run` of a home starts this runner, detached (a session of its own, like the local
Prefect server), and hands it the job; later runs hand theirs to it too. It keeps the imports,
the Prefect API and one LocalCluster warm (its workers keep the models they loaded), runs each
job in a thread of its own with the same functions as a cold run (``shardline.cli.batch_jobs``),
and sends the command the job's log lines, progress and outcome, so the command prints what a
cold run prints and exits with the same code. The command itself imports next to nothing.

A job belongs to the command that sent it: when the command is interrupted (Ctrl-C, SIGTERM,
SIGHUP) or killed (its connection closes), the job stops (``tasks.dispatch.STOP_REQUEST``): no
shard is handed out any more, the running ones finish and commit (a group of small shards stops
after the one under way), the lease on the output is given back, and a re-run resumes.

When it is used: with ``SHARDLINE_PREFECT_SERVER=local`` (the default) and
``SHARDLINE_BATCH_RUNNER_IDLE_S`` above 0 (default 900 s, after which an idle runner exits). A
runner runs jobs with the environment and working folder it was started with, so it takes a
job only from a command whose settings are the same (``fingerprint``: the values of the
variables that steer a job, hashed, and the folder); when they differ, an idle runner is
replaced and a busy one is left to its jobs while this one runs cold. `shardline prefect stop`
stops it (and the server); so does deleting the home. ``SHARDLINE_PREFECT_SERVER=temporary``
(nothing may be left running) and ``SHARDLINE_BATCH_RUNNER_IDLE_S=0`` run every job cold.

Its files are under ``<home>/runner/``: ``runner.json`` (pid, port, token, fingerprint; mode
0600), ``runner.log`` (its output, with every job's log lines) and ``runner.lock`` (held while
a command finds or starts it). It listens on 127.0.0.1 on a free port; a request must carry the
record's token, so only who can read the home can hand it a job (what any such user can do
with the home anyway). The protocol: one JSON line per message, the request first.

POSIX only (``fcntl``, sessions); elsewhere every job runs cold.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Mapping

from shardline.errors import ChildNotReady
from shardline.processes import alive, spawn, stop_pid

RECORD, LOG, LOCK = "runner.json", "runner.log", "runner.lock"
_MARKER = b"shardline.cli.batch_runner"  # in its command line (``shardline.processes.alive``)
_CONNECT_TIMEOUT_S = 2.0
# The variables whose values a job's behaviour depends on: Shardline's settings, Prefect's, Dask's, the
# object stores' credentials and endpoints, the native libraries' threads, proxies and certificates.
_PREFIXES = ("SHARDLINE_", "PREFECT_", "DASK_", "AWS_", "AZURE_", "GOOGLE_", "GCS_", "FSSPEC_", "ORT_", "OMP_",
             "MKL_", "OPENBLAS_", "CUDA_", "NVIDIA_", "HF_", "GX_", "OTEL_")
_KEYS = ("PYTHONPATH", "HOME", "TMPDIR", "TZ", "KUBECONFIG", "http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY",
         "HTTPS_PROXY", "NO_PROXY", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
# How long a command waits for a runner it started to take jobs (imports, the Prefect server, the cluster).
START_TIMEOUT_S = 180.0
_LOG_BYTES = 16 * 1024 * 1024  # a runner's log past this is set aside when the next runner starts


def runner_dir(home: str | os.PathLike[str]) -> Path:
    """The folder of a Shardline home's batch runner: its record, log and lock."""
    return Path(home) / "runner"


def fingerprint(env: Mapping[str, str] | None = None, cwd: str | None = None) -> dict[str, str]:
    """What a runner must share with a command to run its job: each steering variable's value, hashed (the
    record never holds a secret), the working folder, the interpreter, Shardline's code as installed (a
    runner left from before an upgrade, or a `git pull` of an editable install, would run the old code) and the
    umask (a job's files get the modes a cold run would give them: ``umask 077`` keeps them the user's)."""
    env = os.environ if env is None else env
    picked = {k: v for k, v in env.items() if k.startswith(_PREFIXES) or k in _KEYS}
    print_ = {k: hashlib.sha256(v.encode()).hexdigest()[:16] for k, v in sorted(picked.items())}
    print_["(working folder)"] = hashlib.sha256((cwd or os.getcwd()).encode()).hexdigest()[:16]
    print_["(python)"] = hashlib.sha256(sys.executable.encode()).hexdigest()[:16]
    print_["(shardline's code)"] = code_fingerprint()
    print_["(umask)"] = f"{_umask():03o}"  # the modes of what the job writes: outputs, ledger, records
    return print_


def _umask() -> int:
    """This process's file mode creation mask (read by setting it, then put back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# The installed package's areas (pyproject.toml's [tool.setuptools.package-dir]; a test holds the two together).
AREAS = ("", "build", "cli", "storage", "quality", "tasks", "flows", "online", "controller", "observability",
         "capacity", "cost")


@functools.lru_cache(maxsize=None)
def code_fingerprint(roots: tuple[str, ...] | None = None) -> str:
    """Shardline's source files as they are on disk (each path, size and modification time, hashed), under
    ``roots`` (default: where each of ``AREAS`` is installed, found without importing it): ~1 ms for ~250 files,
    once a process."""
    if roots is None:
        import importlib.util

        found = [importlib.util.find_spec(f"shardline.{area}" if area else "shardline") for area in AREAS]
        roots = tuple(p for spec in found if spec is not None for p in spec.submodule_search_locations or ())
    digest = hashlib.sha256()
    for root in sorted(set(roots)):
        for folder, folders, files in os.walk(root):
            folders[:] = sorted(f for f in folders if f != "__pycache__" and not f.startswith("."))
            for name in sorted(files):
                if name.endswith((".py", ".lua", ".conf", ".yaml")):
                    with contextlib.suppress(OSError):
                        info = os.stat(os.path.join(folder, name))
                        digest.update(f"{folder}/{name} {info.st_size} {info.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def differences(a: Mapping[str, str], b: Mapping[str, str]) -> list[str]:
    """The names whose values differ (or are set in one only) between two fingerprints."""
    return sorted(k for k in {*a, *b} if a.get(k) != b.get(k))


@dataclass(frozen=True)
class RunnerRecord:
    """A running runner: its process, where it listens, the token a request carries, what it was started with."""

    pid: int
    port: int
    token: str
    fingerprint: dict[str, str]
    started_server: str | None = None  # the UI of the local Prefect server it started, if it started one


def _read_record(folder: Path) -> RunnerRecord | None:
    try:
        data = json.loads((folder / RECORD).read_text())
        return RunnerRecord(int(data["pid"]), int(data["port"]), str(data["token"]), dict(data["fingerprint"]),
                            data.get("started_server"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _alive(pid: int) -> bool:
    return alive(pid, _MARKER)


def find(home: str | os.PathLike[str]) -> RunnerRecord | None:
    """The home's runner when its record names a live runner process."""
    record = _read_record(runner_dir(home))
    return record if record is not None and _alive(record.pid) else None


# --------------------------------------------------------------------------- the command's side


class RunnerGone(Exception):
    """The runner did not take the job (``started`` False: it is stopping, or did not answer), or went away
    while it ran it (``started`` True)."""

    def __init__(self, message: str, started: bool = False) -> None:
        super().__init__(message)
        self.started = started


class _Connection:
    """One JSON line per message over a loopback socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader: IO[str] = sock.makefile("r", encoding="utf-8", newline="\n")
        self._lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        data = (json.dumps(message, default=str) + "\n").encode()
        with self._lock:
            self.sock.sendall(data)

    def receive(self) -> dict[str, Any] | None:
        line = self.reader.readline()
        return json.loads(line) if line else None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.reader.close()
        with contextlib.suppress(OSError):
            self.sock.close()


def _connect(record: RunnerRecord, timeout: float = _CONNECT_TIMEOUT_S) -> _Connection:
    sock = socket.create_connection(("127.0.0.1", record.port), timeout=timeout)
    sock.settimeout(None)
    return _Connection(sock)


def ask(record: RunnerRecord, op: str, **fields: Any) -> dict[str, Any] | None:
    """Send the runner a one-answer request (``stop``); None when it does not answer."""
    try:
        connection = _connect(record)
    except OSError:
        return None
    try:
        connection.sock.settimeout(10.0)
        connection.send({"op": op, "token": record.token, **fields})
        return connection.receive()
    except (OSError, ValueError):
        return None
    finally:
        connection.close()


def stop(home: str | os.PathLike[str], only_if_idle: bool = False, timeout_s: float = 30.0) -> RunnerRecord | None:
    """Stop the home's runner (its running jobs stop as an interrupted command's would); returns what was stopped.

    With ``only_if_idle``, a runner with jobs running is left alone and None returned.
    """
    folder = runner_dir(home)
    record = find(home)
    if record is None:
        return None
    answer = ask(record, "stop", only_if_idle=only_if_idle)
    if answer is not None and not answer.get("stopping"):
        return None  # busy, and asked to stop only when idle
    # Asked, it stops (its running jobs' shards finish and commit: hence the longer grace); one that does not answer
    # is not taking jobs either: SIGTERM. SIGKILL reaches its session: its workers go too.
    stop_pid(record.pid, marker=_MARKER, grace_s=timeout_s, signum=signal.SIGTERM if answer is None else None,
             group=True)
    if _read_record(folder) == record:
        (folder / RECORD).unlink(missing_ok=True)
    return record


def ensure(home: str | os.PathLike[str], say: Callable[[str], None], timeout_s: float = START_TIMEOUT_S
           ) -> RunnerRecord | None:
    """The home's runner for this command's settings: found, started, or (other settings) replaced when idle.

    Returns None when a runner with other settings is busy: the command then runs its job cold.

    Raises:
        RunnerGone: a runner was started and did not come up (its log says why).
    """
    mine = fingerprint()
    folder = runner_dir(home)
    record = find(home)
    if record is not None and record.fingerprint == mine:
        return record
    from shardline.cli.prefect_server import _locked

    with _locked(folder, LOCK):
        record = find(home)
        if record is not None and record.fingerprint != mine:
            differ = differences(record.fingerprint, mine)
            if stop(home, only_if_idle=True) is None:
                say(f"the batch runner of this home (pid {record.pid}) runs jobs with {_other(differ)}: this job "
                    "runs on its own")
                return None
            say(f"replaced the batch runner of this home: it ran with {_other(differ)}")
            record = None
        if record is None:
            record = _start(folder, timeout_s, say)
            if record.started_server is not None:
                from shardline.cli.prefect_server import started_line

                say(started_line(record.started_server))
            say(f"started the batch runner of this home (pid {record.pid}): later runs start at once on its "
                "warm cluster; it exits after SHARDLINE_BATCH_RUNNER_IDLE_S idle (`shardline prefect stop` "
                "stops it now)")
        return record


def _other(differ: list[str]) -> str:
    """What a runner's fingerprint differs from the command's in, said: 'other settings (A, B differ)', or
    Shardline's code as it was before an upgrade."""
    code = "(shardline's code)" in differ
    settings = [name for name in differ if name != "(shardline's code)"]
    said = [f"other settings ({', '.join(settings[:4])} differ)"] if settings else []
    return " and ".join(said + ["Shardline's code as it was before it changed on disk"] * code)


WAITING = "waiting for "  # how the runner's log lines that say what its start waits for begin


def _waiting_lines(log: Path, start: int) -> list[str]:
    """The runner's ``WAITING`` lines written past ``start`` (its log's size before it was started)."""
    try:
        with open(log, "rb") as f:
            f.seek(start)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.startswith(WAITING)]


def _start(folder: Path, timeout_s: float, say: Callable[[str], None]) -> RunnerRecord:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RECORD).unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # one earlier log is kept: runner.log.1
        if (folder / LOG).stat().st_size > _LOG_BYTES:
            os.replace(folder / LOG, folder / f"{LOG}.1")
    start = (folder / LOG).stat().st_size if (folder / LOG).exists() else 0
    child = spawn("the batch runner", [sys.executable, "-m", _MARKER.decode(), str(folder)], folder / LOG,
                  detached=True)

    written: list[RunnerRecord] = []
    said: set[str] = set()

    def ready() -> bool:  # it takes jobs once it has written its record; meanwhile, what it waits for is said
        for line in _waiting_lines(folder / LOG, start):
            if line not in said:
                said.add(line)
                say(line)
        record = _read_record(folder)
        written[:] = [record] if record is not None and record.pid == child.pid else []
        return bool(written)

    try:
        child.wait_ready(ready, timeout_s)
    except ChildNotReady as e:
        raise RunnerGone(str(e)) from e
    child.disown()  # nobody waits for it: init reaps it
    return written[0]


def submit(record: RunnerRecord, request: dict[str, Any], check: bool, on_line: Callable[[str, bool], None],
           on_progress: Callable[[int, int, int], None]) -> dict[str, Any]:
    """Run a job on the runner; returns its outcome (``JobOutcome.to_json``).

    Ctrl-C (or SIGTERM, SIGHUP) asks the runner to stop the job, and the outcome is still awaited;
    a second one leaves at once (the runner stops the job when the connection closes).

    Raises:
        RunnerGone: the runner did not take the job, or went away while it ran.
    """
    try:
        connection = _connect(record)
    except OSError as e:
        raise RunnerGone(f"the batch runner (pid {record.pid}) did not answer: {e}") from e
    stops = [0]

    def interrupted(signum: int, _frame: Any) -> None:
        stops[0] += 1
        if stops[0] > 1:
            connection.close()
            os._exit(128 + signum)
        on_line("stopping: no more shards are handed out; the running ones finish and are kept (press Ctrl-C "
                "again to leave at once)", True)
        with contextlib.suppress(OSError):
            connection.send({"op": "stop"})

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, interrupted) for s in handled}
    started = False
    try:
        connection.send({"op": "run", "token": record.token, "fingerprint": fingerprint(), "request": request,
                         "check": check})
        while True:
            try:
                message = connection.receive()
            except (OSError, ValueError) as e:
                message, why = None, str(e)
            else:
                why = "its connection closed"
            if message is None:
                if started:
                    raise RunnerGone(f"the batch runner (pid {record.pid}) stopped while the job ran ({why}); "
                                     f"run the same command again to resume", started=True)
                raise RunnerGone(f"the batch runner (pid {record.pid}) did not take the job ({why})")
            if "gone" in message:
                raise RunnerGone(str(message["gone"]))
            started = True
            if "line" in message:
                on_line(str(message["line"]), bool(message.get("err", True)))
            elif "progress" in message:
                on_progress(*message["progress"])
            elif "outcome" in message:
                outcome: dict[str, Any] = message["outcome"]
                if stops[0] and outcome.get("code") == 1:
                    outcome["code"] = 130  # stopped by Ctrl-C: the shell's code for it
                return outcome
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        connection.close()


# --------------------------------------------------------------------------- the runner's side


class _Runner:
    """The runner process: a warm cluster, a listening socket, one thread per job."""

    def __init__(self, folder: Path, idle_s: float) -> None:
        self.folder, self.idle_s = folder, idle_s
        self.token = secrets.token_urlsafe(32)
        self.fingerprint = fingerprint()
        self.lock = threading.Lock()
        # thread id -> (its job's stop request, set once the command has its outcome): a job whose command has
        # its outcome is finishing (Prefect's engine winds down), not busy; a stop still waits for it
        self.jobs: dict[int, tuple[threading.Event, threading.Event]] = {}
        self.last_active = time.monotonic()
        self.stopping = threading.Event()
        self.api_url: str | None = None
        self.started_server: str | None = None

    # -- start and stop

    def run(self) -> None:
        # Each ``WAITING`` line is said by the command that started this runner while it waits (the first run in a
        # new home waits ~10 s on two cores, most of it for the Prefect server's first start).
        print(f"{WAITING}Prefect, Dask and the batch code to load", flush=True)
        import shardline.cli.batch_jobs  # noqa: F401  (everything a job imports, before the first job)
        import shardline.flows.batch_inference  # noqa: F401
        from shardline.cli.prefect_server import api_url_for_run
        from shardline.settings import DaskSettings, PrefectServerSettings, StorageSettings
        from shardline.tasks.cluster import warm_cluster

        server = PrefectServerSettings()
        self.api_url, started = api_url_for_run(
            server.server, StorageSettings().home, server.start_timeout_s,
            starting=lambda: print(f"{WAITING}the local Prefect server to start (the first run in a home starts it; "
                                   "later runs reuse it)", flush=True))
        if started and self.api_url is not None:
            self.started_server = self.api_url.removesuffix("/api")
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, lambda *_: self.stopping.set())
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(0.5)
        dask = DaskSettings()
        if dask.cluster == "local":
            print(f"{WAITING}the Dask cluster to start", flush=True)
        with warm_cluster(dask) as address:
            if address is not None:
                _warm_workers(address)
            self._write_record(listener.getsockname()[1])
            print(f"batch runner {os.getpid()} ready on port {listener.getsockname()[1]}, cluster {address}",
                  flush=True)
            threading.Thread(target=self._watch, name="runner-watch", daemon=True).start()
            while not self.stopping.is_set():
                try:
                    sock, _ = listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    break
                threading.Thread(target=self._serve, args=(sock,), name="runner-connection", daemon=True).start()
            listener.close()
            self._forget()
            with self.lock:
                for stop_request, _ in self.jobs.values():
                    stop_request.set()
            while self._busy(finishing=True):  # the jobs stop: their running shards finish, leases are given back
                time.sleep(0.1)
        print(f"batch runner {os.getpid()} stopped", flush=True)

    def _write_record(self, port: int) -> None:
        staged = self.folder / f".{RECORD}.{os.getpid()}"
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump({"pid": os.getpid(), "port": port, "token": self.token, "fingerprint": self.fingerprint,
                       "started_server": self.started_server,
                       "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, out)
        os.replace(staged, self.folder / RECORD)

    def _forget(self) -> None:
        record = _read_record(self.folder)
        if record is not None and record.pid == os.getpid():
            (self.folder / RECORD).unlink(missing_ok=True)

    def _busy(self, finishing: bool = False) -> int:
        """Jobs whose command waits for their outcome (with ``finishing``: also those winding down)."""
        with self.lock:
            return sum(1 for _, answered in self.jobs.values() if finishing or not answered.is_set())

    def _watch(self) -> None:
        """Stop when idle too long, when the record is gone or names another runner (the home was deleted, or
        this runner replaced), or when the Prefect server its jobs use stopped."""
        from shardline.local_prefect import healthy

        checked = time.monotonic()
        while not self.stopping.wait(1.0):
            record = _read_record(self.folder)
            if record is None or record.pid != os.getpid():
                print("the runner's record is gone: stopping", flush=True)
                self.stopping.set()
            elif not self._busy() and time.monotonic() - self.last_active > self.idle_s:
                print(f"idle for {self.idle_s:.0f} s: stopping", flush=True)
                self.stopping.set()
            elif self.api_url is not None and time.monotonic() - checked > 10.0:
                checked = time.monotonic()
                if not healthy(self.api_url, timeout=5.0) and not healthy(self.api_url, timeout=5.0):
                    print(f"the Prefect server {self.api_url} does not answer: stopping", flush=True)
                    self.stopping.set()

    # -- one connection

    def _serve(self, sock: socket.socket) -> None:
        connection = _Connection(sock)
        try:
            sock.settimeout(30.0)
            request = connection.receive()
            sock.settimeout(None)
            if request is None or not hmac.compare_digest(str(request.get("token", "")), self.token):
                connection.send({"gone": "the request carried no valid token"})
                return
            op = request.get("op")
            if op == "stop":
                stopping = not (request.get("only_if_idle") and self._busy())
                if stopping:
                    self.stopping.set()
                connection.send({"stopping": stopping})
            elif op == "run":
                self._run_job(connection, request)
        except (OSError, ValueError):
            pass  # the command went away: its job (if any) was told to stop
        finally:
            connection.close()

    def _run_job(self, connection: _Connection, request: dict[str, Any]) -> None:
        from shardline.cli.batch_jobs import JobOutcome, JobRequest, execute, outcome_of, refused
        from shardline.cli.common import EXIT_FAILED
        from shardline.flows.batch_inference import batch_inference
        from shardline.tasks.dispatch import STOP_REQUEST

        if self.stopping.is_set():
            connection.send({"gone": "the batch runner is stopping"})
            return
        if request.get("fingerprint") != self.fingerprint:
            connection.send({"gone": "the batch runner runs jobs with other settings: "
                                     + ", ".join(differences(self.fingerprint, request.get("fingerprint") or {}))})
            return
        stop_request, answered = threading.Event(), threading.Event()
        me = threading.get_ident()
        with self.lock:
            self.jobs[me] = (stop_request, answered)
        threading.Thread(target=_stop_on_hangup, args=(connection, stop_request), name="runner-hangup",
                         daemon=True).start()
        forward = _Forward(connection, me, stop_request)

        def answer(outcome: JobOutcome) -> None:
            if not answered.is_set():
                forward.send({"outcome": outcome.to_json()})
                with self.lock:
                    answered.set()
                    self.last_active = time.monotonic()

        def answer_the_command(_flow: Any, _flow_run: Any, state: Any) -> None:
            # The flow run's final state is set in the API: answer now. What Prefect's engine does after
            # (stopping its heartbeat thread, which sleeps in 1 s steps: 0.5 s a run on average) the
            # command need not wait for.
            answer(outcome_of(state))

        hooks = [answer_the_command]
        flow = batch_inference.with_options(on_completion=hooks, on_failure=hooks, on_crashed=hooks)
        root = logging.getLogger()
        root.addHandler(forward)
        token = STOP_REQUEST.set(stop_request)
        try:
            job = JobRequest.from_json(request["request"])
            refusal = refused(job) if request.get("check") else None
            if refusal is not None:
                outcome = refusal
            else:
                try:
                    outcome = execute(job, watchers=[forward.progress], flow=flow)
                except Exception as e:  # not the job's outcome but a fault: say it, keep the runner
                    import traceback

                    traceback.print_exc()
                    outcome = JobOutcome(EXIT_FAILED, error=f"{type(e).__name__}: {e} (the batch runner's log "
                                                            f"{self.folder / LOG} has the traceback)")
            answer(outcome)  # unless the flow's final state did already
        finally:
            STOP_REQUEST.reset(token)
            root.removeHandler(forward)
            with self.lock:
                self.jobs.pop(me, None)
                self.last_active = time.monotonic()


def _stop_on_hangup(connection: _Connection, stop_request: threading.Event) -> None:
    """Read what the command sends while its job runs: a stop, or end-of-file (it ended, however): stop the job."""
    try:
        while True:
            message = connection.receive()
            if message is None or message.get("op") == "stop":
                break
    except (OSError, ValueError):
        pass
    stop_request.set()


class _Forward(logging.Handler):
    """Sends one job's log lines (the records logged in its thread, formatted as Prefect's console formats
    them) and its progress to its command; a command that went away asks the job to stop."""

    def __init__(self, connection: _Connection, thread: int, stop_request: threading.Event) -> None:
        console = next((h for h in logging.getLogger().handlers if type(h).__name__ == "PrefectConsoleHandler"), None)
        super().__init__(console.level if console is not None else logging.NOTSET)
        self.connection, self.thread, self.stop_request = connection, thread, stop_request
        self.setFormatter(console.formatter if console is not None and console.formatter else logging.Formatter(
            "%(asctime)s.%(msecs)03d | %(levelname)-7s | %(name)s - %(message)s", "%H:%M:%S"))

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread != self.thread or "'answer_the_command'" in str(record.msg):  # Prefect's lines on the hook
            return False
        return super().filter(record)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # a record that cannot be formatted is not the job's failure
            return
        self.send({"line": line, "err": True})

    def send(self, message: dict[str, Any]) -> None:
        try:
            self.connection.send(message)
        except OSError:
            self.stop_request.set()

    def progress(self, settled: int, total: int, rows: int) -> None:
        self.send({"progress": [settled, total, rows]})


def _warm_workers(address: str) -> None:
    """Import what a shard needs on every worker now, so that the first job's first shard does not."""
    from distributed import Client

    with Client(address) as client:
        client.run(_import_scoring)


def _import_scoring() -> None:
    import onnxruntime  # noqa: F401

    import shardline.storage.scoring  # noqa: F401


def main(argv: list[str]) -> None:
    """``python -m shardline.cli.batch_runner <runner folder>``: run the runner until it is idle or stopped."""
    from shardline.cli.common import OFF_THE_NETWORK
    from shardline.settings import BatchSettings

    for key, value in OFF_THE_NETWORK.items():
        os.environ.setdefault(key, value)
    folder = Path(argv[0])
    runner = _Runner(folder, BatchSettings().runner_idle_s)
    code = 1
    try:
        runner.run()
        code = 0
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        runner._forget()
        from shardline.cli.supervise import exit_without_teardown

        exit_without_teardown(code)  # atexit runs (Prefect sends the logs it holds), the heap's teardown does not


if __name__ == "__main__":
    main(sys.argv[1:])
