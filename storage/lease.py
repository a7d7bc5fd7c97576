"""One owner at a time for a batch output folder: a lease taken by compare-and-swap.

A lease is a numbered generation under the output folder::

    _lease/0000000001.json      the first owner's record
    _lease/0000000002.json      the next owner's (the highest number is the lease now)

Taking the lease creates the next generation with ``create_exclusive`` (O_EXCL/link
on local disk, ``If-None-Match: *`` on S3), the compare-and-swap the registry uses:
of two jobs that race for one folder, one creates the generation and the other sees it.
A generation is taken only when the one before it is free: released, expired (its
owner stopped renewing it), or held by a process of this host that is gone. The owner
renews its own generation (rewrites it, atomically) every ``renew_s``; it holds the
lease as long as its generation is the highest. The highest generation is never
deleted (release marks it released), so generation numbers only grow and a stale
owner always learns it lost the lease. Expiry is measured on the writers' clocks:
hosts sharing an output need clocks that agree to well within ``ttl_s``.

How a job holds one (both job kinds, the batch job and the OpenAI Batch job, the same way): its plan
takes the lease in :meth:`OutputLease.taking` and reads what the folder holds under it (a setup that
raises gives it back at once; one that returns leaves it held and renewed), and the job's body runs in
:func:`holding_output`, which gives it back however the job ends.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import socket
import threading
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Iterator, Protocol

from fsspec import AbstractFileSystem
from pydantic import BaseModel, ValidationError

from shardline import processes
from shardline.errors import OutputInUse, OutputNotWritable
from shardline.storage.fs import atomic_write_bytes, create_exclusive, inside, join, write_refusal

LEASE_DIR = "_lease"
_GENERATION = re.compile(r"^(\d{10})\.json$")
_ACQUIRE_ROUNDS = 8
logger = logging.getLogger(__name__)

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    """Now, in UTC (the lease's clock)."""
    return datetime.now(timezone.utc)


class LeaseRecord(BaseModel):
    """Who holds an output folder, since when, and until when unless renewed."""

    job_id: str
    model: str
    token: str
    host: str
    pid: int
    pid_namespace: str = ""
    generation: int
    started_at: datetime
    renewed_at: datetime
    expires_at: datetime
    released: bool = False


@dataclass(frozen=True)
class LeaseTerms:
    """How long a lease lasts unless renewed, and how often its owner renews it."""

    ttl_s: float = 180.0
    renew_s: float = 30.0


@dataclass(frozen=True)
class ThisProcess:
    """Where a lease holder runs: host name, pid, and the pid namespace the pid means something in."""

    host: str
    pid: int
    pid_namespace: str

    @classmethod
    def here(cls) -> ThisProcess:
        """This process."""
        try:
            namespace = str(os.stat("/proc/self/ns/pid").st_ino)
        except OSError:
            namespace = ""
        return cls(socket.gethostname(), os.getpid(), namespace)


def lease_is_live(record: LeaseRecord, now: datetime, here: ThisProcess, alive: Callable[[int], bool]) -> bool:
    """Whether ``record`` still holds its folder: not released, not expired, and not a dead process of this host.

    A holder on this host (same host name and pid namespace) whose pid is gone has
    died, whatever its expiry says; elsewhere only the expiry can tell.
    """
    if record.released or record.expires_at <= now:
        return False
    if record.host == here.host and record.pid_namespace == here.pid_namespace and record.pid != here.pid:
        return alive(record.pid)
    return True


def describe_holder(record: LeaseRecord) -> str:
    """'job 1a2b (model bc:2, on host h pid 42, since 10:02:03Z)'."""
    return (
        f"job {record.job_id} (model {record.model}, on host {record.host} pid {record.pid}, "
        f"since {record.started_at.isoformat(timespec='seconds')})"
    )


def refuses_writes(error: BaseException) -> bool:
    """Whether a storage error says the place cannot be written at all (a file, read-only, denied, a bucket that
    does not exist): not transient."""
    return isinstance(error, (PermissionError, NotADirectoryError, FileExistsError)) or _no_bucket(error) or (
        isinstance(error, OSError) and error.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
    )


def _no_bucket(error: BaseException) -> bool:
    """s3fs's (and the like's) answer to a write into a bucket that does not exist (Shardline makes none)."""
    text = str(error)
    return isinstance(error, FileNotFoundError) and ("bucket does not exist" in text or "NoSuchBucket" in text)


def _not_writable(output: str, error: OSError) -> OutputNotWritable:
    if isinstance(error, (NotADirectoryError, FileExistsError)):
        why, do = "is a file, not a folder", "choose a folder for --output"
    elif _no_bucket(error):
        why, do = f"cannot be written ({error})", "check the bucket's name in --output: Shardline creates no bucket"
    else:
        why, do = f"cannot be written ({error.strerror or type(error).__name__})", (
            "make it writable for this user or choose another --output"
        )
    return OutputNotWritable(f"the output {output} {why}; running again will not help: {do}", output)


class OutputLease:
    """A lease this process holds on one output folder; see the module docstring.

    Take it with :meth:`acquire`; :meth:`start_heartbeat` renews it in a thread;
    :meth:`check` raises once another job has taken it; :meth:`release` frees it.
    """

    def __init__(
        self, fs: AbstractFileSystem, root: str, output: str, record: LeaseRecord, terms: LeaseTerms,
        clock: Clock = utc_now,
    ) -> None:
        self.fs, self.root, self.output = fs, root, output
        self.record, self.terms, self.clock = record, terms, clock
        self.lost: OutputInUse | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def folder(self) -> str:
        """The ``_lease`` folder of the output."""
        return join(self.root, LEASE_DIR)

    @staticmethod
    def generations(fs: AbstractFileSystem, folder: str) -> list[int]:
        """The generation numbers present, lowest first."""
        fs.invalidate_cache(folder)
        try:
            names = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(folder, detail=False)]
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _GENERATION.match(n)))

    @staticmethod
    def read(fs: AbstractFileSystem, folder: str, generation: int) -> LeaseRecord | None:
        """A generation's record; None when it is gone or does not parse."""
        try:
            return LeaseRecord.model_validate_json(fs.cat_file(join(folder, f"{generation:010d}.json")))
        except (FileNotFoundError, ValidationError, ValueError):
            return None

    @classmethod
    def current(cls, fs: AbstractFileSystem, folder: str) -> tuple[int, LeaseRecord | None]:
        """(highest generation or 0, its record)."""
        present = cls.generations(fs, folder)
        if not present:
            return 0, None
        return present[-1], cls.read(fs, folder, present[-1])

    @classmethod
    def acquire(
        cls, fs: AbstractFileSystem, root: str, output: str, job_id: str, model: str, terms: LeaseTerms,
        *, clock: Clock = utc_now, here: ThisProcess | None = None, alive: Callable[[int], bool] = processes.alive,
    ) -> OutputLease:
        """Take the folder's lease for ``job_id``; the first write of a job, so it also probes that the output is writable.

        Raises:
            OutputInUse: another process holds a live lease (the message names its job).
            OutputNotWritable: the output is a file, read-only or not permitted.
        """
        here = here or ThisProcess.here()
        refusal = write_refusal(fs, join(root, LEASE_DIR))
        if refusal is not None:
            raise _not_writable(output, refusal)  # (an object store takes keys below an object's name)
        folder = inside(fs, root, join(root, LEASE_DIR))
        for _ in range(_ACQUIRE_ROUNDS):
            try:
                generation, holder = cls.current(fs, folder)
            except (NotADirectoryError, FileExistsError) as e:
                raise _not_writable(output, e) from e
            now = clock()
            if holder is not None and lease_is_live(holder, now, here, alive):
                raise cls._busy(output, job_id, holder)
            if holder is None and generation and cls._recently_written(fs, folder, generation, now, terms):
                continue  # a generation appears whole or not at all; an unreadable young one is being replaced
            record = LeaseRecord(
                job_id=job_id, model=model, token=uuid.uuid4().hex, host=here.host, pid=here.pid,
                pid_namespace=here.pid_namespace, generation=generation + 1, started_at=now, renewed_at=now,
                expires_at=now + timedelta(seconds=terms.ttl_s),
            )
            try:
                won = create_exclusive(fs, join(folder, f"{generation + 1:010d}.json"), record.model_dump_json().encode())
            except OSError as e:
                if not refuses_writes(e):
                    raise
                raise _not_writable(output, e) from e
            if won:
                lease = cls(fs, root, output, record, terms, clock)
                lease._prune(generation + 1)
                if holder is not None and not holder.released:
                    logger.warning("took over the output %s from %s, whose lease had lapsed", output, describe_holder(holder))
                return lease
        raise OutputInUse(
            f"the output {output} is being taken by other jobs at this very moment; wait a minute and run the "
            "same command again, or choose another --output", output, None,
        )

    @classmethod
    def check_free(
        cls, fs: AbstractFileSystem, root: str, output: str, job_id: str, *, clock: Clock = utc_now,
        here: ThisProcess | None = None, alive: Callable[[int], bool] = processes.alive,
    ) -> None:
        """What :meth:`acquire` would refuse now, found without writing (a request's check before it starts).

        Raises:
            OutputNotWritable: the output (or a folder above it) is a file, or (on local disk) cannot be written.
            OutputInUse: another process holds a live lease (the message names its job).
        """
        folder = join(root, LEASE_DIR)
        refusal = write_refusal(fs, folder)
        if refusal is not None:
            raise _not_writable(output, refusal)
        try:
            _, holder = cls.current(fs, inside(fs, root, folder))
        except (NotADirectoryError, FileExistsError) as e:
            raise _not_writable(output, e) from e
        if holder is not None and lease_is_live(holder, clock(), here or ThisProcess.here(), alive):
            raise cls._busy(output, job_id, holder)

    @classmethod
    @contextlib.contextmanager
    def taking(
        cls, fs: AbstractFileSystem, root: str, output: str, job_id: str, model: str, terms: LeaseTerms,
    ) -> Iterator[OutputLease]:
        """Take the folder's lease (:meth:`acquire`) for the job's setup done in the body (reading what the folder
        holds, under the lease): released when the body raises; when it returns, the lease stays held and is
        renewed from then on (:meth:`start_heartbeat`) until :meth:`release` (:func:`holding_output`).

        Raises:
            OutputInUse, OutputNotWritable: as :meth:`acquire`.
        """
        lease = cls.acquire(fs, root, output, job_id, model, terms)
        try:
            yield lease
        except BaseException:
            lease.release()
            raise
        lease.start_heartbeat()

    @staticmethod
    def _recently_written(fs: AbstractFileSystem, folder: str, generation: int, now: datetime, terms: LeaseTerms) -> bool:
        try:
            modified = fs.modified(join(folder, f"{generation:010d}.json"))
        except (FileNotFoundError, NotImplementedError, OSError):
            return False
        modified = modified if modified.tzinfo else modified.replace(tzinfo=timezone.utc)
        return (now - modified).total_seconds() < terms.ttl_s

    @staticmethod
    def _busy(output: str, job_id: str, holder: LeaseRecord) -> OutputInUse:
        if holder.job_id == job_id:
            message = (
                f"job {job_id} is already running on the output {output} (on host {holder.host} pid {holder.pid}, "
                f"since {holder.started_at.isoformat(timespec='seconds')}); wait for it to finish "
                f"(`shardline batch status {job_id}`) rather than running it twice"
            )
        else:
            message = (
                f"the output {output} is in use by {describe_holder(holder)}; wait for it to finish "
                f"(`shardline batch status {holder.job_id}`) or choose another --output"
            )
        return OutputInUse(message, output, holder.job_id)

    def _path(self) -> str:
        return join(self.folder, f"{self.record.generation:010d}.json")

    def _prune(self, below: int) -> None:
        """Drop generations under ``below`` (never the highest: numbers must only grow)."""
        for generation in self.generations(self.fs, self.folder):
            if generation < below:
                try:
                    self.fs.rm(join(self.folder, f"{generation:010d}.json"))
                except (FileNotFoundError, OSError) as e:
                    logger.debug("old lease generation %d not removed: %s", generation, e)

    def check(self) -> None:
        """Raise unless this lease is still the folder's (the highest generation, ours, not released).

        Raises:
            OutputInUse: another job took the folder over (our renewals stopped for longer than the TTL).
        """
        if self.lost is not None:
            raise self.lost
        generation, holder = self.current(self.fs, self.folder)
        if generation == self.record.generation and holder is not None and holder.token == self.record.token:
            return
        who = describe_holder(holder) if holder is not None else "another job"
        self.lost = OutputInUse(
            f"job {self.record.job_id} lost its lease on the output {self.output} to {who} (its renewals stopped "
            f"for over {self.terms.ttl_s:.0f} s); it stopped without writing _SUCCESS: let that job finish, then run "
            "this one again into another --output", self.output, holder.job_id if holder else None,
        )
        raise self.lost

    def renew(self) -> None:
        """Push the expiry ``ttl_s`` ahead, after checking the lease is still ours.

        Raises:
            OutputInUse: the lease was taken over.
        """
        self.check()
        now = self.clock()
        self.record = self.record.model_copy(update={"renewed_at": now, "expires_at": now + timedelta(seconds=self.terms.ttl_s)})
        self._write()

    def _write(self) -> None:
        atomic_write_bytes(self.fs, self._path(), self.record.model_dump_json().encode(), join(self.folder, "_tmp"))

    def _beat(self) -> None:
        while not self._stop.wait(self.terms.renew_s):
            try:
                self.renew()
            except OutputInUse as e:
                logger.error("%s", e)
                return
            except Exception as e:  # storage trouble: keep trying until the lease would lapse
                logger.warning("renewing the lease on %s failed (%s: %s); retrying", self.output, type(e).__name__, e)

    def start_heartbeat(self) -> None:
        """Renew the lease every ``renew_s`` in a daemon thread until :meth:`release`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, name=f"lease-{self.record.job_id}", daemon=True)
            self._thread.start()

    def release(self) -> None:
        """Stop renewing and mark the generation released (when it is still ours), so the next job can take it at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            self.check()
        except OutputInUse:
            return
        self.record = self.record.model_copy(update={"released": True, "expires_at": self.clock()})
        try:
            self._write()
        except Exception as e:  # the lease lapses by itself after ttl_s
            logger.warning("releasing the lease on %s failed (%s: %s); it lapses by itself", self.output, type(e).__name__, e)

    def as_dict(self) -> dict[str, Any]:
        """The record, as plain data (for the manifest)."""
        return json.loads(self.record.model_dump_json())


class HoldsLease(Protocol):
    """A job's plan: the output lease it took (None when it writes nothing: its output is finished already)."""

    @property
    def lease(self) -> OutputLease | None:
        """The lease the plan holds, or None."""
        ...


@contextlib.contextmanager
def holding_output(plan: HoldsLease) -> Iterator[None]:
    """Run the job's body with the output lease its plan took (:meth:`OutputLease.taking`); give it back however
    the body ends."""
    try:
        yield
    finally:
        if plan.lease is not None:
            plan.lease.release()
