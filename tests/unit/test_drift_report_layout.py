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
from shardline.quality.report import render_html, time_axis_limits

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
