"""The connection limits resolved from settings and the open-file limit (a pure function)."""

from __future__ import annotations

import pickle

import pytest

from shardline.errors import InvalidSetting
from shardline.online.connection import LimitedHttpToolsProtocol, limited_protocol
from shardline.online.limits import MAX_DERIVED_CONNECTIONS, resolve_limits
from shardline.settings import OnlineSettings


@pytest.mark.parametrize(("open_files", "connections"), [(256, 192), (1024, 896), (20_000, MAX_DERIVED_CONNECTIONS)])
def test_the_connection_cap_is_derived_below_the_open_file_limit(open_files: int, connections: int) -> None:
    limits = resolve_limits(OnlineSettings(), open_files)
    assert limits.max_connections == connections
    assert limits.max_in_flight == connections * 3 // 4
    assert (limits.max_header_bytes, limits.max_headers, limits.header_timeout_s) == (65536, 100, 10.0)


def test_caps_the_file_limit_cannot_hold_or_that_leave_no_room_are_refused_at_start() -> None:
    with pytest.raises(InvalidSetting, match=r"open-file limit \(256, ulimit -n\) leaves room for 192"):
        resolve_limits(OnlineSettings(max_connections=300), 256)
    with pytest.raises(InvalidSetting, match="max_in_flight is 100, not below max_connections \\(100\\)"):
        resolve_limits(OnlineSettings(max_connections=100, max_in_flight=100), 1024)
    assert resolve_limits(OnlineSettings(max_connections=100, max_in_flight=99), 1024).max_in_flight == 99


def test_the_metrics_listener_is_off_with_0_or_off() -> None:
    assert OnlineSettings().metrics_port == 8002 and OnlineSettings().metrics_host == "127.0.0.1"
    assert OnlineSettings(metrics_port="off").metrics_port == 0
    assert OnlineSettings(metrics_port=0).metrics_port == 0


def test_the_protocol_factory_pickles_for_worker_processes_without_this_process_apps() -> None:
    factory = limited_protocol(resolve_limits(OnlineSettings(), 1024), {9999: object()})  # type: ignore[dict-item]
    copy = pickle.loads(pickle.dumps(factory))
    assert copy.func is LimitedHttpToolsProtocol and copy.keywords["limits"] == factory.keywords["limits"]
    assert copy.keywords["listeners"].apps_by_port == {}
