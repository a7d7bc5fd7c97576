"""fsspec file systems: open any URL, write a file so it appears whole or not at all.

Nothing here branches on the URL scheme: ``fsspec.url_to_fs`` picks the file system
and the rest is the same for local disk, memory and S3.
"""

from __future__ import annotations

import posixpath
import uuid
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

from shardline.errors import InvalidSetting


def open_fs(uri: str, storage_options: dict[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """The file system and the path inside it for a URL.

    Raises:
        InvalidSetting: the URL's scheme is unknown or its package is missing.
    """
    if not uri or not uri.strip():
        raise InvalidSetting("an empty URL was given; pass a local path or a URL such as s3://bucket/prefix")
    try:
        fs, path = fsspec.url_to_fs(uri, **(storage_options or {}))
    except ImportError as e:
        raise InvalidSetting(
            f"the URL {uri!r} needs a package that is not installed ({e}); for s3:// "
            "install s3fs (it comes with shardline)"
        ) from e
    except ValueError as e:
        raise InvalidSetting(f"the URL {uri!r} cannot be opened: {e}; check its scheme") from e
    return fs, path.rstrip("/") or path


def join(base: str, *parts: str) -> str:
    """Join '/'-separated path parts (fsspec paths are always '/'-separated)."""
    return posixpath.join(base, *parts)


def parent(path: str) -> str:
    """The folder holding ``path``."""
    return posixpath.dirname(path.rstrip("/"))


def ensure_dir(fs: AbstractFileSystem, path: str) -> None:
    """Create a folder and its parents where the file system has folders."""
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

    The check and the create are one step: O_EXCL on local disk, ``If-None-Match: *``
    on S3. This is the compare-and-swap the registry builds on.
    """
    ensure_dir(fs, parent(path))
    try:
        with fs.open(path, "xb") as f:
            f.write(data)
    except FileExistsError:
        return False
    return True
