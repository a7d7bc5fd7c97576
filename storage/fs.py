"""fsspec file systems: open any URL, write a file so it appears whole or not at all.

Nothing here branches on the URL scheme: ``fsspec.url_to_fs`` picks the file system
and the rest is the same for local disk, memory and S3. Five functions know local
storage: ``resolve_location``, ``inside`` and ``links_out`` follow symbolic links there,
since the OS will, ``create_exclusive`` links a fully written file into place, since
an O_EXCL create is visible (empty) before its write lands, and ``write_refusal`` asks the
OS whether a folder could be written without writing (object stores cannot be asked).
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import re
import socket
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal
from urllib.parse import urlsplit

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from shardline.errors import InvalidSetting
from shardline.locations import is_within


def open_fs(uri: str, storage_options: dict[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """The file system and the path inside it for a URL.

    Raises:
        InvalidSetting: the URL's scheme is unknown or its package is missing; the file system refuses
            ``storage_options`` (an option it does not take, a value of the wrong type), said as the setting's fault.
        ConnectionError: a file system that connects when it is made (ftp, sftp) could not reach its server: said
            with the URL (the bare error named neither it nor what to do); transient, as the error it replaces.
    """
    if not uri or not uri.strip():
        raise InvalidSetting("an empty URL was given; pass a local path or a URL such as s3://bucket/prefix")
    try:
        fs, path = fsspec.url_to_fs(uri, **(storage_options or {}))
        if storage_options:
            _set_up(fs)
    except (TypeError, ValueError) as e:
        if storage_options:  # the options the file system was made with are what it refused
            raise _options_refused(uri, storage_options, e) from e
        raise InvalidSetting(f"the URL {uri!r} cannot be opened: {e}; check its scheme") from e
    except (ConnectionError, TimeoutError, socket.gaierror) as e:
        raise ConnectionError(f"the location {uri} cannot be reached ({type(e).__name__}: {e}): check its URL and "
                              "that its server answers, then run again") from e
    except ImportError as e:
        raise InvalidSetting(
            f"the URL {uri!r} needs a package that is not installed ({e}); for s3:// "
            "install s3fs (it comes with shardline)"
        ) from e
    except (AttributeError, KeyError, OSError) as e:  # a wrapping scheme given no target (dir://x, zip://x, tar://x)
        raise InvalidSetting(f"the URL {uri!r} cannot be opened ({type(e).__name__}: {e}); check its scheme: pass a "
                             "local path or a URL such as s3://bucket/prefix") from e
    return fs, path.rstrip("/") or path


def _set_up(fs: AbstractFileSystem) -> None:
    """Set up now the client of a file system that sets it up on first use (s3fs's ``connect``: the session and
    client, made from the options, without a request), so that options it does not take are refused here, where
    the location is opened, rather than by whichever call comes first."""
    connect = getattr(fs, "connect", None)
    if callable(connect):
        connect()


def _options_refused(uri: str, options: dict[str, Any], error: Exception) -> InvalidSetting:
    """The file system refused the storage options it was made with: a setting's fault, said as one line."""
    keys = ", ".join(sorted(map(str, options)))
    return InvalidSetting(
        f"a setting is not valid: SHARDLINE_STORAGE_STORAGE_OPTIONS (keys {keys}) were refused by the file system "
        f"of {uri} ({type(error).__name__}: {error}); fix or unset the variable: its keys are the file system's own "
        "options (s3fs's for s3://: endpoint_url, key, secret, client_kwargs)"
    )


_POOLS: dict[str, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def io_threads(role: Literal["read", "write"]) -> ThreadPoolExecutor:
    """This process's threads that read shards ahead and write parts behind the scoring, kept for its life.

    A thread started per shard (one to read ahead, one to write) cost an eighth of a 50,000-row shard's time
    to start on a busy worker (figures: bench/README.md, "Figures behind the code"). Reads and writes have a pool each, so that a reader waiting
    for its consumer never holds up a write that consumer waits for; a pool starts a thread only when none
    of its own is idle (one of each per shard in progress).
    """
    pool = _POOLS.get(role)
    if pool is None:
        with _POOLS_LOCK:
            pool = _POOLS.get(role)
            if pool is None:
                pool = _POOLS[role] = ThreadPoolExecutor(64, thread_name_prefix=f"shard-{role}")
    return pool


def open_file(fs: AbstractFileSystem, path: str, mode: Literal["rb", "wb"]) -> Any:
    """A file to read or write Parquet through: on local disk pyarrow's own (its reads and writes never
    take the GIL), elsewhere the file system's (s3fs)."""
    if isinstance(fs, LocalFileSystem):
        import pyarrow as pa

        return pa.OSFile(path, "r" if mode == "rb" else "w")
    return fs.open(path, mode)


def join(base: str, *parts: str) -> str:
    """Join '/'-separated path parts (fsspec paths are always '/'-separated)."""
    return posixpath.join(base, *parts)


def parent(path: str) -> str:
    """The folder holding ``path``."""
    return posixpath.dirname(path.rstrip("/"))


# Object stores: no folders to make (a key is written where it is named), and making one would create the bucket a
# mistyped URL names (s3fs's makedirs does): a write to a bucket that does not exist fails instead, saying so.
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})


def ensure_dir(fs: AbstractFileSystem, path: str) -> None:
    """Create a folder and its parents where the file system has folders (never a bucket)."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if protocols & _OBJECT_STORES:
        return
    fs.makedirs(path, exist_ok=True)


def fingerprint(info: dict[str, Any]) -> str:
    """A string that changes when a file's bytes change: size plus etag or mtime."""
    marker = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("created") or ""
    if hasattr(marker, "isoformat"):
        marker = marker.isoformat()
    return f"{info.get('size')}:{str(marker).strip(chr(34))}"


def staging_path(final: str, staging_dir: str) -> str:
    """A unique staging name beside ``staging_dir`` for a file that will become ``final``."""
    return join(staging_dir, f"{posixpath.basename(final)}.{uuid.uuid4().hex}.tmp")


def commit_file(fs: AbstractFileSystem, staged: str, final: str) -> None:
    """Move a fully written staged file to its final name.

    A local rename is atomic; on object stores the destination object appears whole
    (server-side copy), so readers never see a half-written file.
    """
    ensure_dir(fs, parent(final))
    fs.mv(staged, final)


def atomic_write_bytes(fs: AbstractFileSystem, final: str, data: bytes, staging_dir: str) -> None:
    """Write ``data`` to ``final`` so that it appears whole or not at all."""
    ensure_dir(fs, staging_dir)
    staged = staging_path(final, staging_dir)
    with fs.open(staged, "wb") as f:
        f.write(data)
    commit_file(fs, staged, final)


def create_exclusive(fs: AbstractFileSystem, path: str, data: bytes) -> bool:
    """Create ``path`` holding ``data`` unless it exists; False when it already did.

    The check and the create are one step, and the file appears whole or not at all:
    on local disk ``data`` is written (and fsynced) to a temporary name beside ``path``
    and hard-linked to ``path`` (``link`` fails when the name exists), so no reader
    ever sees it empty or cut short, even when the writer dies halfway; on S3 it is
    one PUT with ``If-None-Match: *``. This is the compare-and-swap the registry builds on.
    """
    ensure_dir(fs, parent(path))
    if isinstance(fs, LocalFileSystem):  # an O_EXCL create is visible empty until its write lands
        return _link_exclusive(fs._strip_protocol(path), data)
    try:
        with fs.open(path, "xb") as f:
            f.write(data)
    except FileExistsError:
        return False
    return True


_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV}


def _link_exclusive(path: str, data: bytes) -> bool:
    """Local create-exclusive: write a temporary file, then link it to ``path`` (atomic, never partial)."""
    staged = f"{path}.{uuid.uuid4().hex}.tmp"  # beside it: the same file system, so the link can be made
    try:
        with open(staged, "xb") as f:
            _write_synced(f, data)
        try:
            os.link(staged, path)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in _NO_HARD_LINKS:
                raise
            return _open_exclusive(path, data)  # no hard links here: O_EXCL, written and fsynced at once
        _fsync_dir(posixpath.dirname(path))
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged)


def _open_exclusive(path: str, data: bytes) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        _write_synced(f, data)
    return True


def _write_synced(f: Any, data: bytes) -> None:
    """Write ``data`` and wait until it is on the disk."""
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


def _fsync_dir(folder: str) -> None:
    """Make a new name in ``folder`` survive a power cut (where the OS lets a folder be fsynced)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def resolve_location(uri: str, storage_options: dict[str, Any] | None = None) -> str:
    """The one location a URL names, exactly as the file system will use it: what jobs check and use.

    Permission checks must compare what fsspec will touch, not the text the user typed:
    fsspec keeps a ``?query`` or ``#fragment`` in the path it opens, reads ``file://host/p``
    as the relative path ``host/p`` and lets the OS follow symbolic links. So the URL is
    refused when it carries any of those or a path that object stores would take
    literally (``//``, ``.``, ``..``), then resolved through fsspec itself; on local
    storage the result is the real path (links and ``..`` resolved), elsewhere the
    file system's own ``protocol://path`` (``s3a://`` becomes ``s3://``).

    Raises:
        InvalidSetting: the URL carries a query, fragment, credentials, a host for
            ``file://``, control characters, a chained ``::`` URL or empty/dot segments.
    """
    text = (uri or "").strip()
    if not text:
        raise InvalidSetting("an empty location was given; pass a local path or a URL such as s3://bucket/prefix")

    def refuse(why: str, do: str) -> InvalidSetting:
        return InvalidSetting(f"the location {uri!r} {why}; {do}")

    if _CONTROL.search(text):
        raise refuse("holds a control character", "remove it")
    if "?" in text or "#" in text:
        raise refuse("holds '?' or '#' (a URL query or fragment, which the file system would keep in the path)",
                     "pass the plain folder, and rename files or folders whose names hold '?' or '#'")
    if "::" in text:
        raise refuse("is a chained fsspec URL ('::')", "pass one plain URL or path")
    parts = urlsplit(text)
    scheme = parts.scheme if len(parts.scheme) > 1 else ""  # 'c:' is a drive, not a scheme
    if scheme and "@" in parts.netloc:
        raise refuse("carries credentials or a user in its host part",
                     "give credentials through the storage settings (SHARDLINE_STORAGE_*), not in the URL")
    if scheme == "file" and parts.netloc:
        raise refuse(f"names the host {parts.netloc!r} (file:// URLs are local)",
                     f"write file:///{parts.netloc}{parts.path} or the plain path")
    fs, path = open_fs(text, storage_options)
    if "http" in ((fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol):
        raise refuse("is a web address: a job lists, reads and writes folders at its locations, which HTTP has none "
                     "of", "pass a local path or an object store URL such as s3://bucket/prefix")
    if isinstance(fs, LocalFileSystem):
        # The OS follows links and '..', so the location is where they lead (links made
        # below it later are caught when written: ``inside``, ``links_out``).
        return os.path.realpath(path)
    if any(s in ("", ".", "..") for s in path.lstrip("/").split("/")):
        raise refuse("has an empty, '.' or '..' path segment, which object stores keep as part of the key",
                     "write the path without '//', '/./' or '/../'")
    return str(fs.unstrip_protocol(path))


def inside(fs: AbstractFileSystem, root: str, path: str, resolved_root: str | None = None) -> str:
    """``path``, once it is sure the OS will not lead it out of ``root`` through a symbolic link below root.

    A job was admitted to ``root`` (resolved, links and all, by :func:`resolve_location`);
    a link that someone put *below* it (``out/_ledger -> /elsewhere``) would carry the
    job's writes outside. Object stores have no links: there ``path`` is as given.
    ``resolved_root``: ``root`` resolved, where the caller keeps it (an output layout resolves its root once).

    Raises:
        InvalidSetting: naming the link's target and what to do.
    """
    if isinstance(fs, LocalFileSystem):
        base, where = resolved_root or os.path.realpath(root), os.path.realpath(path)
        if not is_within(where, base):
            raise InvalidSetting(
                f"{path!r} leads outside the output folder {root!r} (to {where!r}) through a symbolic link "
                "below it; remove the link: a job writes only inside the folder it was admitted to"
            )
    return path


def links_out(fs: AbstractFileSystem, root: str) -> list[tuple[str, str]]:
    """(link, where it leads) for every symbolic link below ``root`` that leads out of it; [] off local disk."""
    if not isinstance(fs, LocalFileSystem) or not os.path.isdir(root):
        return []
    base, found = os.path.realpath(root), []
    for folder, dirs, files in os.walk(root):  # links to folders are listed, not entered
        for name in dirs + files:
            path = os.path.join(folder, name)
            if os.path.islink(path) and not is_within(os.path.realpath(path), base):
                found.append((path, os.path.realpath(path)))
    return found


def write_refusal(fs: AbstractFileSystem, path: str) -> OSError | None:
    """Why a write into the folder ``path`` (made if missing) would be refused, found without writing; None when
    nothing says so.

    On local disk: a file where the folder (or the nearest of its parents that exists) should be, or a
    folder this user may not write (modes, a read-only mount), as the error the write would raise.
    Elsewhere (an object store, where a key and keys below its name live side by side and a write is
    refused only by permissions the write alone tells): an object where the folder or one of its parents
    should be, as the ``NotADirectoryError`` local disk would raise (a job's parts written below an
    earlier job's part would hide it).
    """
    if not isinstance(fs, LocalFileSystem):
        return _object_in_the_way(fs, path)
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return None
        probe = parent
    if not os.path.isdir(probe):
        return NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), probe)
    if os.access(probe, os.W_OK | os.X_OK):
        return None
    code = errno.EROFS if os.statvfs(probe).f_flag & os.ST_RDONLY else errno.EACCES
    return OSError(code, os.strerror(code), probe)  # EACCES makes a PermissionError, as the write would raise


def _object_in_the_way(fs: AbstractFileSystem, path: str) -> OSError | None:
    """An object store's object named as the folder ``path`` or one of its parents, as ``NotADirectoryError``."""
    probe = fs._strip_protocol(path).rstrip("/")
    while probe:
        try:
            if fs.isfile(probe):
                return NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), fs.unstrip_protocol(probe))
        except OSError:  # (denied, say) nothing says so; the write itself answers
            return None
        parent = posixpath.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return None
