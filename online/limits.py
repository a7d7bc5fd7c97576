"""What one server process bounds per connection, resolved from settings once at start.

``resolve_limits(settings, open_files)`` is a pure function: the settings in, the numbers the
connection protocol (``shardline.online.connection``) enforces out, with the connection cap
derived from the process's file limit (``RLIMIT_NOFILE``) when the settings leave it at 0.
Every limit is per server process: with ``workers`` > 1 each worker holds all of them.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

from shardline.errors import InvalidSetting
from shardline.settings import OnlineSettings

MAX_DERIVED_CONNECTIONS = 4096  # a derived cap stays below this: memory, not files, bounds it then
_MIN_CONNECTIONS = 16


@dataclass(frozen=True)
class ConnectionLimits:
    """The bounds one server process holds its connections to (see ``OnlineSettings`` for each)."""

    max_header_bytes: int
    max_headers: int
    header_timeout_s: float
    body_timeout_s: float
    keep_alive_s: float
    max_connections: int
    max_in_flight: int
    retry_after_s: int = 1


def open_files_limit() -> int:
    """The process's soft limit on open files (``ulimit -n``); a large number when unlimited."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else int(soft)


def connections_allowed(open_files: int) -> int:
    """The most connections a process with ``open_files`` may hold: the rest is kept for model
    files, logs, the registry, threads and the listening sockets (an eighth, at least 64)."""
    return open_files - max(64, open_files // 8)


def resolve_limits(online: OnlineSettings, open_files: int) -> ConnectionLimits:
    """The limits the settings ask for, the connection cap derived from ``open_files`` when 0.

    Raises:
        InvalidSetting: a connection cap the file limit cannot hold, or an in-flight cap
            not below the connection cap (health checks and new connections need room).
    """
    allowed = connections_allowed(open_files)
    if online.max_connections:
        if online.max_connections > allowed:
            raise InvalidSetting(
                f"max_connections is {online.max_connections}, but the open-file limit ({open_files}, ulimit -n) "
                f"leaves room for {allowed}; raise the limit or lower SHARDLINE_ONLINE_MAX_CONNECTIONS"
            )
        connections = online.max_connections
    else:
        connections = max(_MIN_CONNECTIONS, min(allowed, MAX_DERIVED_CONNECTIONS))
        if connections > allowed:
            raise InvalidSetting(
                f"the open-file limit ({open_files}, ulimit -n) is too low to serve: raise it to at least "
                f"{_MIN_CONNECTIONS + 64}"
            )
    in_flight = online.max_in_flight or max(1, connections * 3 // 4)
    if in_flight >= connections:
        raise InvalidSetting(
            f"max_in_flight is {in_flight}, not below max_connections ({connections}): health checks and new "
            "connections would find no room; lower SHARDLINE_ONLINE_MAX_IN_FLIGHT or raise the connection cap"
        )
    return ConnectionLimits(
        max_header_bytes=online.max_header_bytes,
        max_headers=online.max_headers,
        header_timeout_s=online.header_timeout_s,
        body_timeout_s=online.body_timeout_s,
        keep_alive_s=online.keep_alive_s,
        max_connections=connections,
        max_in_flight=in_flight,
    )
