"""The drift report's page as a browser lays it out: plots scale to their cells, time axes fit their points.

These read the HTML and the SVG the report holds, so they need no browser. The check in a
real browser (headless chromium measuring every plot against its cell) is
tests/integration/test_drift_report_browser.py; it skips where chromium is absent.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pytest

from shardline.build.examples import breast_cancer, shard_table, shifted_table, with_site
from shardline.quality.drift import DriftReport, drift_report
from shardline.quality.profile import profile_table
from shardline.quality.report import render_html, score_axis_limits, time_axis_limits

SVG_TAG = re.compile(r"<svg\b[^>]*>")
TREND = re.compile(r"<figure class=trend>(.*?)</figure>", re.S)
YEAR = re.compile(r"\b(20\d\d)\b")


@pytest.fixture(scope="module")
def reference() -> dict:
    """A profile of fresh rows with a site column (inputs only)."""
    return profile_table(with_site(shard_table(breast_cancer(), 2_000, 0, 1), seed=2))


def _report(reference: dict, until: datetime) -> DriftReport:
    shifted = with_site(shard_table(breast_cancer(), 2_000, 0, 8), seed=9, sites=("north", "south", "mars"))
    current: pa.Table = shifted_table(shifted, scale={"mean radius": 1.5, "worst area": 1.3}, seed=3)
    return drift_report(reference, current, model="breast-cancer:1", since=until - timedelta(hours=24), until=until)


def _trend_years(page: str) -> set[str]:
    [trend] = TREND.findall(page)
    texts = re.findall(r"<text\b[^>]*>(.*?)</text>", trend, re.S)
    return {y for t in texts for y in YEAR.findall(t)}


def test_every_plot_scales_to_its_cell(reference: dict) -> None:
    report = _report(reference, datetime(2027, 3, 4, 5, 0, tzinfo=timezone.utc))
    page = render_html(report, reference, history=[report])

    svgs = SVG_TAG.findall(page)
    assert len(svgs) >= 4 and page.count('<figure class=column') >= 3
    for tag in svgs:  # drawn at a size, but with a viewBox, so CSS may scale it
        assert re.search(r'viewBox="0 0 [\d.]+ [\d.]+"', tag), tag
    style = page[page.index("<style>"):page.index("</style>")]
    # the SVG is capped at its cell's width with its height following, and a grid cell may shrink below
    # its content's width (a grid item's min-width is auto, i.e. as wide as the plot, otherwise)
    assert re.search(r"figure svg\{[^}]*max-width:100%", style) and re.search(r"figure svg\{[^}]*height:auto", style)
    assert re.search(r"figure\{[^}]*min-width:0", style)
    # plots are drawn wider than a cell of the 1100 px page's two-column grid: without the cap they overflow
    widths_px = [float(re.search(r'width="([\d.]+)pt"', t).group(1)) * 4 / 3 for t in svgs]  # type: ignore[union-attr]
    assert max(widths_px) > 1100 / 2


def test_one_report_draws_one_point_on_a_two_day_axis(reference: dict) -> None:
    until = datetime(2027, 3, 4, 5, 0, tzinfo=timezone.utc)
    report = _report(reference, until)
    # the CLI passes the current report in the history too: it is drawn once
    for history in ([], [report]):
        page = render_html(report, reference, history=history)
        assert "Drift score over time" in page
        assert _trend_years(page) <= {"2027"}, _trend_years(page)  # not 2025..2029 around one point
    first, last = time_axis_limits([until])
    assert (first, last) == (until - timedelta(days=1), until + timedelta(days=1))


def test_the_time_axis_spans_the_reports_with_a_margin(reference: dict) -> None:
    until = datetime(2027, 3, 4, 5, 0, tzinfo=timezone.utc)
    reports = [_report(reference, until + timedelta(hours=h)) for h in (0, 1, 2, 30)]
    first, last = time_axis_limits([r.until for r in reports if r.until])
    assert first < until and last > until + timedelta(hours=30)
    assert last - first < timedelta(hours=30) * 1.2  # a margin, not years
    # reports minutes apart still get a readable span, not seconds
    close = time_axis_limits([until, until + timedelta(seconds=5)])
    assert close[1] - close[0] >= timedelta(hours=1)
    page = render_html(reports[-1], reference, history=reports[:-1])
    assert _trend_years(page) <= {"2027"}


def _trend_texts(page: str) -> list[str]:
    [trend] = TREND.findall(page)
    return [t.strip() for t in re.findall(r"<text\b[^>]*>(.*?)</text>", trend, re.S)]


def test_the_score_axis_starts_at_zero_and_no_stray_date_sits_under_the_time_axis(reference: dict) -> None:
    """One report under its threshold (score 0.5) drew an axis from 0.45, its point on the floor, and the
    time axis's offset ('2027-Mar-05') under its right end: the axis now starts at 0, reaches past the
    threshold, and the year is in the axis's label."""
    until = datetime(2027, 3, 4, 5, 0, tzinfo=timezone.utc)
    rows = with_site(shard_table(breast_cancer(), 2_000, 0, 8), seed=9)
    calm = drift_report(reference, rows, model="breast-cancer:1", since=until - timedelta(hours=24), until=until)
    assert not calm.drifted and 0 < calm.score < 1

    texts = _trend_texts(render_html(calm, reference, history=[calm]))

    ticks = [float(t) for t in texts if re.fullmatch(r"\d+\.\d", t)]
    assert ticks[0] == 0.0 and ticks[-1] >= 1.0, ticks  # from 0, past the threshold line at 1
    assert "end of the report's window (UTC), 2027" in texts
    assert not [t for t in texts if re.search(r"20\d\d-", t)], texts  # no offset label such as '2027-Mar-05'
    assert score_axis_limits([0.5]) == (0.0, 1.25)
    assert score_axis_limits([4.0, float("nan")]) == (0.0, pytest.approx(4.4))
