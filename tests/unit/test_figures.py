"""Figures as reports, artifacts and the command's summary write them (shardline/figures.py)."""

from __future__ import annotations

import pytest

from shardline.figures import amount, moment, rate, rows_quarantined, span


@pytest.mark.parametrize("count, seconds, unit, text", [
    (200_000, 41.0, "rows", "4,878 rows/s"),
    (8, 41.0, "shards", "11.7 shards/min"),
    (8, 86_400.0, "shards", "0.33 shards/h"),  # the SLA's planned rate for 8 shards a day: not "0.0001 shards/s"
    (3, 1.0, "shards", "3 shards/s"),
    (0, 12.0, "rows", "0 rows/s"),
    (5, 0.0, "rows", "unknown"),
])
def test_a_rate_is_given_in_the_unit_that_makes_it_at_least_one(count: float, seconds: float, unit: str,
                                                                 text: str) -> None:
    assert rate(count, seconds, unit) == text


@pytest.mark.parametrize("seconds, text", [
    (0.42, "0.4 s"), (12.4, "12 s"), (2465, "41m05s"), (7380, "2h03m"), (86_340, "23h59m"), (3 * 86_400 + 4 * 3600, "3d04h"),
])
def test_a_span_reads_as_a_duration(seconds: float, text: str) -> None:
    assert span(seconds) == text


def test_amounts_counts_and_moments() -> None:
    assert [amount(v) for v in (200_000.0, 14.63, 0.333, 0.0)] == ["200,000", "14.6", "0.33", "0"]
    assert rows_quarantined(5_000) == "5,000 rows" and rows_quarantined(1) == "1 row"
    assert rows_quarantined(0, 2) == "2 unreadable shards, rows unknown"
    assert rows_quarantined(7, 1) == "7 rows + 1 unreadable shard, rows unknown"
    assert moment("2026-12-01T06:00:00+00:00") == "2026-12-01 06:00:00 UTC" and moment("soon") == "soon"
