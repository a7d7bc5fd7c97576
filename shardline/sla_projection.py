"""Batch SLAs: a duration or a deadline, and the pure projection of a job's finish from its progress.

Everything here is state in, decision out: no clock is read, no I/O. The flow's SLA
tracker (``shardline.tasks.sla_tracking``) feeds it a trace of (time, shards settled, rows)
and acts on the verdict.

A trace's first point is where this run started, carrying the shards an earlier run
already settled (a resumed job); throughput counts only what this run settled, over
a recent window that ends *now*, so a job that slows down or stalls sees its
projection move out even while no shard settles.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Literal, Sequence

from shardline import durations
from shardline.errors import InvalidSetting

SlaStatus = Literal["on-track", "at-risk", "breached", "met"]

LONGEST_SLA = durations.TEN_YEARS  # a deadline is now plus the SLA


def parse_duration(text: str) -> timedelta:
    """An SLA's duration ('2h', '90m', '1h30m', '45s', '1d', '2w': ``shardline.durations``) -> a timedelta.

    Raises:
        InvalidSetting: the text is not such a duration, is not positive, or is longer than ``LONGEST_SLA``.
    """
    return durations.parse_duration(text, "SLA", longest=LONGEST_SLA)


def parse_deadline(text: str) -> datetime:
    """An ISO 8601 time ('2026-12-01T06:00Z', '2026-12-01T06:00:00+01:00') -> an aware datetime.

    Raises:
        InvalidSetting: not an ISO time, or one without a time zone.
    """
    try:
        moment = datetime.fromisoformat(text.strip().replace("z", "Z").replace("Z", "+00:00"))
    except ValueError as e:
        raise InvalidSetting(
            f"deadline {text!r} is not an ISO 8601 time; write it as e.g. 2026-12-01T06:00Z"
        ) from e
    if moment.tzinfo is None:
        raise InvalidSetting(
            f"deadline {text!r} has no time zone; add one (2026-12-01T06:00Z for UTC) so it means one moment"
        )
    return moment.astimezone(timezone.utc)


@dataclass(frozen=True)
class Sla:
    """What a job was promised: finish by ``deadline``; ``margin`` before it counts as at risk."""

    deadline: datetime
    started: datetime
    margin: timedelta

    @property
    def budget(self) -> timedelta:
        """The time the job was given, from its start to its deadline."""
        return self.deadline - self.started

    def as_dict(self) -> dict[str, str | float]:
        """Plain data for job records and manifests."""
        return {
            "started": self.started.isoformat(),
            "deadline": self.deadline.isoformat(),
            "margin_seconds": self.margin.total_seconds(),
        }


def make_sla(
    started: datetime, sla: str | None, deadline: str | None, default: str, margin_fraction: float = 0.1,
    allow_past: bool = False,
) -> Sla:
    """The SLA of a job started at ``started``: a duration (``sla``), a deadline, or ``default``.

    The margin is ``margin_fraction`` of the time the job was given. A resumed job
    keeps its original deadline even when it has passed (``allow_past``): it is
    breached from the start.

    Raises:
        InvalidSetting: both were given, one is malformed, or the deadline is past (unless allowed).
    """
    if sla and deadline:
        raise InvalidSetting(
            f"both an SLA ({sla!r}) and a deadline ({deadline!r}) were given; give one: a duration or a time"
        )
    if deadline:
        end = parse_deadline(deadline)
        if end <= started and not allow_past:
            raise InvalidSetting(
                f"deadline {deadline!r} is already past (now {started.isoformat(timespec='seconds')}); give a later one"
            )
    else:
        end = started + parse_duration(sla or default)
    return Sla(deadline=end, started=started, margin=max(end - started, timedelta(0)) * margin_fraction)


@dataclass(frozen=True)
class ProgressPoint:
    """Progress at one moment: shards settled in all (earlier runs included) and rows this run scored."""

    at: datetime
    shards: int
    rows: int = 0


@dataclass(frozen=True)
class Projection:
    """The verdict at ``now``: status, projected finish (None when unknown) and throughput."""

    status: SlaStatus
    now: datetime
    projected_finish: datetime | None
    shards_done: int
    shards_total: int
    rows_done: int
    shards_per_second: float
    rows_per_second: float

    @property
    def eta_seconds(self) -> float | None:
        """Seconds from ``now`` to the projected finish."""
        return None if self.projected_finish is None else max(0.0, (self.projected_finish - self.now).total_seconds())

    def as_dict(self) -> dict[str, object]:
        """Plain data for events, records and artifacts."""
        return {
            "status": self.status,
            "at": self.now.isoformat(),
            "projected_finish": self.projected_finish.isoformat() if self.projected_finish else None,
            "shards_done": self.shards_done,
            "shards_total": self.shards_total,
            "rows_done": self.rows_done,
            "shards_per_second": round(self.shards_per_second, 4),
            "rows_per_second": round(self.rows_per_second, 1),
        }


def _window_start(trace: Sequence[ProgressPoint], now: datetime, window: timedelta) -> ProgressPoint:
    """The latest point at or before ``now - window``, else the run's first point."""
    start = trace[0]
    for point in trace:
        if point.at <= now - window:
            start = point
    return start


def project(
    trace: Sequence[ProgressPoint], total_shards: int, sla: Sla, now: datetime,
    window: timedelta = timedelta(minutes=5),
) -> Projection:
    """Project a job's finish from its progress and classify it against its SLA.

    Throughput is (shards settled since the window's start) / (now - window start):
    it ends at ``now``, not at the last settled shard, so a stall lowers it.

    - ``met``: every shard is settled by the deadline; ``breached``: the deadline
      passed first (or the job finished late);
    - ``at-risk``: the projected finish is later than ``deadline - margin``, or no
      shard settled for a whole window (stalled), or none yet and the margin has begun;
    - ``on-track``: otherwise (also with no progress yet, early in the budget).
    """
    if not trace:
        trace = [ProgressPoint(sla.started, 0)]
    last = trace[-1]
    done, rows = min(last.shards, total_shards), last.rows
    start = _window_start(trace, now, window)
    elapsed = (now - start.at).total_seconds()
    shards_rate = (done - start.shards) / elapsed if elapsed > 0 else 0.0
    run_elapsed = (now - trace[0].at).total_seconds()
    rows_rate = (rows - trace[0].rows) / run_elapsed if run_elapsed > 0 else 0.0
    remaining = total_shards - done
    finish: datetime | None
    if remaining <= 0:
        finish = last.at
    elif shards_rate > 0:
        finish = now + timedelta(seconds=remaining / shards_rate)
    else:
        finish = None
    status: SlaStatus
    if remaining <= 0:
        status = "met" if last.at <= sla.deadline else "breached"
    elif now > sla.deadline:
        status = "breached"
    elif finish is None:
        stalled = now - last.at >= window
        status = "at-risk" if stalled or now >= sla.deadline - sla.margin else "on-track"
    else:
        status = "at-risk" if finish > sla.deadline - sla.margin else "on-track"
    return Projection(status, now, finish, done, total_shards, rows, max(shards_rate, 0.0), max(rows_rate, 0.0))
