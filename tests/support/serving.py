"""``shardline serve``'s app in this process, for the tests that call it over real HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shardline.online.app import create_app
from shardline.online.dataplane import DataPlane
from shardline.online.server import build_plane
from shardline.online.tenants import TenantDirectory
from shardline.online.testing import serve_listeners_in_thread
from shardline.settings import OnlineSettings, RuntimeSettings, StorageSettings


@contextmanager
def serve_home(home: Path, tenants: TenantDirectory) -> Iterator[tuple[str, DataPlane]]:
    """Serve the registry under ``home`` to ``tenants`` as ``shardline serve`` does (default settings, models on
    the CPU with one thread a call), on a free loopback port; yields its base URL and its data plane."""
    plane = build_plane(OnlineSettings(), StorageSettings(home=str(home)),
                        RuntimeSettings(device="cpu", intra_op_threads=1), tenants)
    with serve_listeners_in_thread(create_app(plane)) as listening:
        yield listening.url, plane
