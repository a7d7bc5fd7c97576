"""The SLA model and the pure projection, on traces: steady, slowing, stalled, resumed, empty."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from shardline.errors import InvalidSetting
from shardline.sla_projection import ProgressPoint, Sla, make_sla, parse_deadline, parse_duration, project

T0 = datetime(2026, 12, 1, 2, 0, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def sla(budget_s: float, margin_s: float = 0) -> Sla:
    return Sla(deadline=at(budget_s), started=T0, margin=timedelta(seconds=margin_s))


def trace(*points: tuple[float, int]) -> list[ProgressPoint]:
    return [ProgressPoint(at(t), shards, shards * 100) for t, shards in points]


@pytest.mark.parametrize(("text", "seconds"), [("2h", 7200), ("90m", 5400), ("1h30m", 5400), ("45s", 45),
                                               ("1d", 86400), (" 0.5s ", 0.5)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text).total_seconds() == seconds


@pytest.mark.parametrize("text", ["", "2", "2 hours", "h", "0m", "-1h", "2h later"])
def test_bad_durations_say_how_to_write_one(text: str) -> None:
    with pytest.raises(InvalidSetting, match="SLA .*(not a duration|not positive)"):
        parse_duration(text)


@pytest.mark.parametrize("text", ["99999999999d", "999999999d", "3651d"])
def test_an_sla_past_ten_years_is_refused_not_an_overflow(text: str) -> None:
    # '999999999d' parsed, then made the deadline (now plus it) overflow: "error: date value out of range"
    with pytest.raises(InvalidSetting, match=f"SLA '{text}' is longer than the longest accepted, 3650d"):
        make_sla(T0, text, None, "24h")


def test_deadlines_are_aware_iso_times() -> None:
    assert parse_deadline("2026-12-01T06:00Z") == datetime(2026, 12, 1, 6, tzinfo=timezone.utc)
    assert parse_deadline("2026-12-01T07:00:00+01:00") == datetime(2026, 12, 1, 6, tzinfo=timezone.utc)
    with pytest.raises(InvalidSetting, match="has no time zone"):
        parse_deadline("2026-12-01T06:00")
    with pytest.raises(InvalidSetting, match="not an ISO 8601 time"):
        parse_deadline("tomorrow at six")


def test_make_sla_takes_one_of_duration_deadline_default() -> None:
    assert make_sla(T0, "2h", None, "24h").deadline == at(7200)
    assert make_sla(T0, None, None, "24h").deadline == at(86400)
    made = make_sla(T0, None, "2026-12-01T06:00Z", "24h", margin_fraction=0.25)
    assert made.deadline == at(4 * 3600) and made.margin == timedelta(hours=1)
    with pytest.raises(InvalidSetting, match="give one"):
        make_sla(T0, "2h", "2026-12-01T06:00Z", "24h")
    with pytest.raises(InvalidSetting, match="already past"):
        make_sla(T0, None, "2026-12-01T01:00Z", "24h")
    resumed = make_sla(T0, None, "2026-12-01T01:00Z", "24h", allow_past=True)  # a resumed, late job
    assert resumed.margin == timedelta(0)
    assert project([], 10, resumed, at(1)).status == "breached"


def test_steady_progress_projects_the_finish_and_is_on_track() -> None:
    steady = trace((0, 0), (10, 1), (20, 2), (30, 3), (40, 4))
    verdict = project(steady, 10, sla(200, margin_s=20), at(40))
    assert verdict.status == "on-track"
    assert verdict.shards_per_second == pytest.approx(0.1)
    assert verdict.projected_finish == at(100) and verdict.eta_seconds == 60
    assert verdict.rows_per_second == pytest.approx(10.0)


def test_a_job_that_slows_down_goes_at_risk() -> None:
    fast_then_slow = trace((0, 0), (10, 20), (20, 40), (320, 41), (620, 42))
    # over the last 300 s: one shard -> 58 left at 1/300 shards/s
    verdict = project(fast_then_slow, 100, sla(3600, margin_s=360), at(620))
    assert verdict.status == "at-risk"
    assert verdict.projected_finish is not None and verdict.projected_finish > at(3600)
    # the whole-run average would have said on-track: the window is what sees the slowdown
    assert project(fast_then_slow, 100, sla(3600, 360), at(620), window=timedelta(hours=1)).status == "on-track"


def test_a_stalled_job_goes_at_risk_then_breached_with_no_new_progress() -> None:
    stalled = trace((0, 0), (10, 2), (20, 4))
    budget = sla(1000, margin_s=100)
    assert project(stalled, 10, budget, at(25)).status == "on-track"
    late = project(stalled, 10, budget, at(400))  # nothing for a whole window
    assert late.status == "at-risk" and late.projected_finish is None and late.shards_per_second == 0
    assert project(stalled, 10, budget, at(1001)).status == "breached"


def test_a_resumed_job_counts_earlier_shards_as_done_but_not_as_throughput() -> None:
    resumed = [ProgressPoint(at(0), 90, 0), ProgressPoint(at(10), 91, 100), ProgressPoint(at(20), 92, 200)]
    verdict = project(resumed, 100, sla(100, margin_s=10), at(20))
    assert verdict.shards_done == 92
    assert verdict.shards_per_second == pytest.approx(0.1)  # 2 shards in 20 s, not 92
    assert verdict.projected_finish == at(100) and verdict.status == "at-risk"


def test_an_empty_trace_is_on_track_early_then_at_risk_in_the_margin_then_breached() -> None:
    budget = sla(1000, margin_s=100)
    assert project([], 10, budget, at(5)).status == "on-track"
    assert project([], 10, budget, at(950)).status == "at-risk"
    assert project([], 10, budget, at(1001)).status == "breached"
    assert project([], 0, budget, at(5)).status == "met"  # nothing to do


def test_a_finished_job_met_or_breached_its_deadline() -> None:
    assert project(trace((0, 0), (50, 10)), 10, sla(100), at(60)).status == "met"
    verdict = project(trace((0, 0), (150, 10)), 10, sla(100), at(160))
    assert verdict.status == "breached" and verdict.projected_finish == at(150)


def test_the_tracker_emits_once_per_status_change_and_keeps_the_record() -> None:
    import uuid

    from shardline.storage.job_records import JobParameters, JobRecord, JobRecords
    from shardline.tasks.sla_tracking import SlaTracker, TrackedJob

    now = [T0]
    sent: list[dict[str, Any]] = []
    records = JobRecords(f"memory://jobs-{uuid.uuid4().hex[:8]}")
    record = JobRecord(job_id="j1", started_at=T0, deadline=at(200), shards_total=10,
                       parameters=JobParameters(model="bc@prod", input_uri="/i", output_uri="/o", tenant="acme"))
    tracker = SlaTracker(TrackedJob("j1", "acme", "bc:1", "normal", "nightly"), sla(200, margin_s=20), records, record,
                         interval_s=1000, clock=lambda: now[0], emit=lambda **event: sent.append(event))
    tracker.start()

    def settle(t: float, shards: int) -> None:
        now[0] = at(t)
        tracker(shards, 10, shards * 100)
        tracker.check()

    for t, shards in [(10, 1), (20, 2)]:  # steady: on track, nothing sent
        settle(t, shards)
    for t, shards in [(100, 3), (110, 4), (120, 5)]:  # slowed: at risk, sent once
        settle(t, shards)
    assert records.read("j1").sla_status == "at-risk" and records.read("j1").shards_done == 5
    now[0] = at(250)  # the deadline passed with shards left: breached, sent once
    tracker.check()
    tracker.check()
    tracker.finish("completed", "done", rows_done=1000)

    names = [e["event"] for e in sent]
    assert names == ["shardline.batch.started", "shardline.batch.sla-at-risk", "shardline.batch.sla-breached",
                     "shardline.batch.completed"]
    at_risk = sent[1]
    assert at_risk["resource"]["prefect.resource.id"] == "shardline.batch-job.j1"
    assert at_risk["resource"]["shardline.deployment"] == "nightly"
    assert at_risk["payload"]["tenant"] == "acme" and at_risk["payload"]["shards_done"] == 3
    assert at_risk["payload"]["deadline"] == at(200).isoformat()
    final = records.read("j1")
    assert (final.state, final.sla_status, final.shards_done, final.finished_at) == ("completed", "breached", 10, at(250))


def _two_shard_job(job_id: str, now: list[datetime]) -> tuple[Any, Any, list[str]]:
    """A tracker of a two-shard job due at 1 s, on the clock ``now[0]``: (tracker, records, events sent)."""
    import uuid

    from shardline.storage.job_records import JobParameters, JobRecord, JobRecords
    from shardline.tasks.sla_tracking import SlaTracker, TrackedJob

    sent: list[str] = []
    records = JobRecords(f"memory://jobs-{uuid.uuid4().hex[:8]}")
    record = JobRecord(job_id=job_id, started_at=T0, deadline=at(1), shards_total=2,
                       parameters=JobParameters(model="bc@prod", input_uri="/i", output_uri="/o"))
    tracker = SlaTracker(TrackedJob(job_id, "default", "bc:1", "normal"), sla(1), records, record, interval_s=1000,
                         clock=lambda: now[0], emit=lambda **event: sent.append(event["event"]))
    tracker.start()
    return tracker, records, sent


def test_a_late_finish_that_no_check_saw_is_still_reported_breached() -> None:
    now = [T0]
    tracker, _, sent = _two_shard_job("j2", now)
    now[0] = at(5)
    tracker.finish("completed", "done")
    assert sent == ["shardline.batch.started", "shardline.batch.sla-breached", "shardline.batch.completed"]


def test_the_final_verdict_is_taken_when_the_job_settled_as_its_manifest_says() -> None:
    """The manifest's ``finished`` came before the deadline; the tracker's final check ran after it: one verdict."""
    from shardline.tasks.sla_tracking import planned_vs_actual

    now = [T0]
    tracker, records, sent = _two_shard_job("j3", now)
    now[0] = at(0.5)
    tracker(2, 2, 200)
    manifest = planned_vs_actual(sla(1), at(0.8), 2, 200)
    tracker.settled(at(0.8))
    now[0] = at(1.3)  # the artifacts took the job past its deadline
    tracker.finish("completed", "done")
    final = records.read("j3")
    assert (manifest["status"], final.sla_status, final.finished_at) == ("met", "met", at(0.8))
    assert sent == ["shardline.batch.started", "shardline.batch.completed"]


@pytest.mark.parametrize("text", ["2w", "1h30m", "500ms", "1d12h"])
def test_every_duration_option_reads_the_same_grammar(text: str) -> None:
    """--sla, rollout start --interval and drift check --window read one grammar (shardline.durations)."""
    from shardline.quality.drift_checks import parse_window
    from shardline.storage.rollouts import parse_duration as rollout_seconds

    assert parse_duration(text) == parse_window(text) == timedelta(seconds=rollout_seconds(text))
