"""Pure decisions of the resilient batch path: retry classification and backoff, checkpoint
ranges, in-flight bounds, preemption notice sources."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from pydantic import ValidationError

from shardline.errors import CorruptShard, ModelNotFound, SchemaMismatch
from shardline.settings import DaskSettings
from shardline.storage.checkpoint import plan_ranges
from shardline.storage.retry import RetryPolicy, backoff_delay, call_with_retries, is_transient
from shardline.tasks.dispatch import in_flight_target, is_lost_worker
from shardline.tasks.preemption import NoticeSources, notice_in_body


class ClientError(Exception):
    """Shaped like botocore's ClientError: the service's code in ``response``."""

    def __init__(self, code: str) -> None:
        super().__init__(f"An error occurred ({code})")
        self.response = {"Error": {"Code": code}}


class ServerDisconnectedError(OSError):
    """Named like aiohttp's."""


@pytest.mark.parametrize(
    "error",
    [
        ConnectionResetError("reset by peer"),
        TimeoutError("read timed out"),
        OSError(errno.EBUSY, "SlowDown"),  # how s3fs reports throttling and 503
        OSError(121, "InternalError"),  # s3fs: 500 as EREMOTEIO
        ClientError("SlowDown"),
        ClientError("ThrottlingException"),
        ClientError("503"),
        ServerDisconnectedError("server disconnected"),
        OSError("Please reduce your request rate: SlowDown"),
    ],
)
def test_transient_storage_errors_are_retried(error: BaseException) -> None:
    assert is_transient(error)


@pytest.mark.parametrize(
    "error",
    [
        CorruptShard("x.parquet is not a readable Parquet file"),
        SchemaMismatch("column 'a' is missing", ["column 'a' is missing"]),
        ModelNotFound("no model 'm'", "m"),
        FileNotFoundError("s3://b/k"),
        PermissionError("access denied"),
        ValueError("bad value"),
        OSError(errno.EINVAL, "invalid argument"),
        ClientError("AccessDenied"),
    ],
)
def test_errors_that_will_not_go_away_are_not_retried(error: BaseException) -> None:
    assert not is_transient(error)


def test_a_transient_cause_makes_the_wrapper_transient_unless_it_is_ours() -> None:
    try:
        try:
            raise ConnectionResetError("reset")
        except ConnectionResetError as e:
            raise OSError("read failed") from e
    except OSError as wrapped:
        assert is_transient(wrapped)
    try:
        raise CorruptShard("bad bytes") from ConnectionResetError("reset")
    except CorruptShard as ours:
        assert not is_transient(ours)


def test_backoff_doubles_up_to_the_cap_with_full_jitter() -> None:
    policy = RetryPolicy(attempts=8, base_s=0.5, cap_s=4.0)
    ceilings = [backoff_delay(n, policy, uniform=lambda: 0.999999) for n in range(6)]
    assert ceilings == pytest.approx([0.5, 1.0, 2.0, 4.0, 4.0, 4.0], rel=1e-5)
    assert backoff_delay(3, policy, uniform=lambda: 0.0) == 0.0
    assert backoff_delay(2, policy, uniform=lambda: 0.25) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        backoff_delay(-1, policy)
    with pytest.raises(ValueError, match="inconsistent"):
        RetryPolicy(attempts=1, base_s=2.0, cap_s=1.0)


def test_call_with_retries_retries_transient_then_succeeds() -> None:
    calls, sleeps = [], []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise OSError(errno.EBUSY, "SlowDown")
        return "ok"

    result = call_with_retries(flaky, RetryPolicy(4, 0.5, 8.0), sleep=sleeps.append, uniform=lambda: 0.5)
    assert result == "ok" and len(calls) == 3
    assert sleeps == [0.25, 0.5]


def test_call_with_retries_gives_up_after_the_attempts_and_never_retries_permanent() -> None:
    sleeps: list[float] = []
    with pytest.raises(TimeoutError):
        call_with_retries(lambda: (_ for _ in ()).throw(TimeoutError("slow")), RetryPolicy(2, 0.1, 1.0),
                          sleep=sleeps.append, uniform=lambda: 1.0)
    assert len(sleeps) == 2

    calls: list[int] = []

    def corrupt() -> None:
        calls.append(1)
        raise CorruptShard("not parquet")

    with pytest.raises(CorruptShard):
        call_with_retries(corrupt, RetryPolicy(5, 0.1, 1.0), sleep=sleeps.append)
    assert calls == [1]


def test_ranges_group_row_groups_to_the_target_size() -> None:
    assert plan_ranges([100] * 10, 300) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert plan_ranges([100] * 3, 10_000) == [(0, 3)]  # a small shard is one pass
    assert plan_ranges([50, 900, 50, 50], 100) == [(0, 2), (2, 4)]
    assert plan_ranges([], 100) == [(0, 0)]
    ranges = plan_ranges([7, 3, 11, 2, 5, 9, 1], 10)
    covered = [g for start, end in ranges for g in range(start, end)]
    assert covered == list(range(7))  # every row group once, in order


def test_in_flight_bound_follows_the_cluster_unless_given() -> None:
    assert in_flight_target(0, None) == 8
    assert in_flight_target(16, None) == 64
    assert in_flight_target(16, 3) == 3
    with pytest.raises(ValueError):
        in_flight_target(4, 0)


def test_lost_worker_errors_are_told_from_shard_errors() -> None:
    KilledWorker = type("KilledWorker", (Exception,), {})
    assert is_lost_worker(KilledWorker("task failed on 3 workers"))
    assert not is_lost_worker(CorruptShard("bad"))


def test_notice_sources_parse_and_a_file_notice_is_seen(tmp_path: Path) -> None:
    notice = tmp_path / "preempt"
    sources = NoticeSources.parse(("sigterm", f"file:{notice}", "http://169.254.169.254/latest/meta-data/spot/instance-action"))
    assert sources.sigterm and sources.files == (str(notice),) and len(sources.urls) == 1
    assert NoticeSources.parse((f"file://{notice}",)).files == (str(notice),)
    file_only = NoticeSources.parse((f"file:{notice}",))
    assert file_only.polled_notice() is None
    notice.write_text("terminate")
    assert file_only.polled_notice() == f"file {notice}"
    with pytest.raises(ValueError, match="unknown"):
        NoticeSources.parse(("smoke-signals",))


def test_metadata_answers_read_as_notices() -> None:
    assert notice_in_body(200, b'{"action": "terminate", "time": "2026-11-30T12:00:00Z"}')  # AWS
    assert notice_in_body(200, b"TRUE")  # GCP
    assert not notice_in_body(200, b"FALSE")
    assert not notice_in_body(404, b"Not Found")  # AWS before a notice


def test_settings_refuse_an_unknown_notice_source_early() -> None:
    assert DaskSettings(preemption_notices=("sigterm", "file:/run/preempt")).preemption_notices[1] == "file:/run/preempt"
    with pytest.raises(ValidationError, match="unknown"):
        DaskSettings(preemption_notices=("pager",))
