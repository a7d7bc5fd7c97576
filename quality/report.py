"""Drift reports for people: a self-contained HTML page with plots, and a markdown summary.

``render_html`` draws, with matplotlib (Agg backend, inline SVG: the page needs no
file, script or network), the drift score over time (this report and the earlier
ones, each once; one report alone is a point on a two-day axis), a table
of every judged column, and for each drifted column (and the next most moved, up
to ``PLOTTED_COLUMNS``) the reference against the current distribution: density
on the reference's quantile sketch for numbers, shares per category for
categories (new ones in red). ``render_markdown`` is the short form for a Prefect
markdown artifact. Both read only the report and the reference profile; matplotlib
is imported inside ``render_html``. Every plot is an inline SVG with a viewBox that
the page's CSS scales down to its grid cell (``max-width: 100%``), so none is cut.
"""

from __future__ import annotations

import html
from datetime import datetime, timedelta
from typing import Any, Sequence

import numpy as np
import polars as pl

from shardline.figures import inline_svg
from shardline.quality.drift import OTHER, ColumnDrift, DriftReport

PLOTTED_COLUMNS = 8
SINGLE_POINT_SPAN = timedelta(days=1)  # the time axis around one moment: one day either side
MIN_TIME_PAD = timedelta(minutes=30)  # at least this much either side of several moments
DENSITY_STEP = 5
REFERENCE_COLOR, CURRENT_COLOR, NEW_COLOR = "#4C72B0", "#DD8452", "#C44E52"

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.5em;margin-bottom:.2em} h2{font-size:1.2em;margin-top:1.6em}
.verdict{display:inline-block;padding:.25em .7em;border-radius:.3em;color:#fff;font-weight:600}
.bad{background:#C44E52}.good{background:#55A868}.unjudged{background:#8C8C8C}.muted{color:#666}
table{border-collapse:collapse;width:100%;font-size:.9em}th,td{padding:.3em .5em;border-bottom:1px solid #ddd;text-align:left}
tr.drifted td{background:#fbeaea} td.num{text-align:right;font-variant-numeric:tabular-nums}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(480px,100%),1fr));gap:1em}
figure{margin:0;min-width:0} figcaption{font-size:.85em;color:#444}
figure svg{display:block;max-width:100%;height:auto}
"""
# Each plot is an SVG with a viewBox, drawn wider than a grid cell: the rule above scales it
# down to its cell (min-width:0 lets a grid cell be narrower than its content).


def _ratio(column: ColumnDrift) -> float:
    return column.score / column.threshold if column.threshold > 0 else (np.inf if column.score > 0 else 0.0)


def _entry(reference: dict[str, Any], column: ColumnDrift) -> dict[str, Any]:
    section = "columns" if column.role == "input" else "outputs"
    return dict(reference.get(section, {}).get(column.column, {}))


def _numeric_plot(column: ColumnDrift, entry: dict[str, Any]) -> str | None:
    import matplotlib.pyplot as plt

    sketch, cdf_now = entry.get("sketch", {}), column.current.get("cdf")
    edges = np.asarray(sketch.get("edges", []), dtype=float)
    if len(edges) < 2 or not cdf_now or len(cdf_now) != len(edges):
        return None
    # Density on every 5th sketch edge (about 20 bins): the full sketch is too fine to read.
    coarse = np.unique(np.append(np.arange(0, len(edges), DENSITY_STEP), len(edges) - 1))
    bins, ref_cdf, now_cdf = edges[coarse], np.asarray(sketch["cdf"], float)[coarse], np.asarray(cdf_now, float)[coarse]
    widths = np.diff(bins)
    keep = widths > 0
    figure, (ax_density, ax_cdf) = plt.subplots(1, 2, figsize=(7.5, 2.6))
    if keep.any():
        starts, ends = bins[:-1][keep], bins[1:][keep]
        for cdf, color, label, fill in ((ref_cdf, REFERENCE_COLOR, "reference", True), (now_cdf, CURRENT_COLOR, "current", False)):
            density = np.diff(cdf)[keep] / widths[keep]
            ax_density.bar(starts, density, width=ends - starts, align="edge", label=label, fill=fill,
                           color=color if fill else None, edgecolor=color, alpha=0.4 if fill else 1.0, linewidth=1.4)
    ax_density.set_title("density, 1st-99th reference percentile", fontsize=9)
    ax_density.legend(fontsize=8)
    ax_cdf.plot(edges, sketch["cdf"], color=REFERENCE_COLOR, label="reference")
    ax_cdf.plot(edges, cdf_now, color=CURRENT_COLOR, label="current")
    ax_cdf.set_title(f"CDF (KS {column.metrics.get('ks', float('nan')):.3f})", fontsize=9)
    for ax in (ax_density, ax_cdf):
        ax.tick_params(labelsize=7)
    figure.suptitle(column.column, fontsize=10, y=1.05)
    return inline_svg(figure)


def _categorical_plot(column: ColumnDrift, entry: dict[str, Any]) -> str | None:
    import matplotlib.pyplot as plt

    shares = column.current.get("shares")
    if not shares:
        return None
    reference = dict(entry.get("top", {}))
    reference[OTHER] = entry.get("other", 0.0)
    rest = [OTHER] if reference[OTHER] > 0 or shares.get(OTHER, 0.0) > 0 else []
    labels = [k for k in reference if k != OTHER][:15] + rest + [k for k in column.new_categories[:5] if k in shares]
    x = np.arange(len(labels))
    figure, ax = plt.subplots(figsize=(7.5, 2.6))
    ax.bar(x - 0.2, [reference.get(k, 0.0) for k in labels], 0.4, color=REFERENCE_COLOR, label="reference")
    colors = [NEW_COLOR if k in column.new_categories else CURRENT_COLOR for k in labels]
    ax.bar(x + 0.2, [shares.get(k, 0.0) for k in labels], 0.4, color=colors, label="current (red: new)")
    ax.set_xticks(x, [k if len(k) <= 14 else k[:13] + "…" for k in labels], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("share of rows", fontsize=8)
    ax.legend(fontsize=8)
    ax.set_title(column.column, fontsize=10)
    return inline_svg(figure)


def _moment(report: DriftReport) -> datetime:
    return report.until or report.computed_at


def _distinct(reports: Sequence[DriftReport]) -> list[DriftReport]:
    """The reports oldest first, each once (a caller may pass the current report in the history too)."""
    seen: dict[tuple[str, datetime, datetime | None], DriftReport] = {}
    for r in reports:
        seen.setdefault((r.model, r.computed_at, r.until), r)
    return sorted(seen.values(), key=_moment)


def time_axis_limits(when: Sequence[datetime]) -> tuple[datetime, datetime]:
    """The span of the drift-over-time axis: one day either side of a single moment, else the moments padded.

    matplotlib widens a zero span to years (one report drew 2025 to 2029); a few
    reports minutes apart get at least ``MIN_TIME_PAD`` either side.
    """
    first, last = min(when), max(when)
    if first == last:
        return first - SINGLE_POINT_SPAN, last + SINGLE_POINT_SPAN
    pad = max((last - first) / 20, MIN_TIME_PAD)
    return first - pad, last + pad


def score_axis_limits(values: Sequence[float]) -> tuple[float, float]:
    """The drift-over-time plot's y span (score / threshold): from 0, to past the threshold (1) and every point.

    Left to matplotlib, one report at 0.5 drew an axis from 0.45: a reader takes the point for the floor.
    """
    finite = [v for v in values if np.isfinite(v)]
    return 0.0, max([1.25, *(1.1 * v for v in finite)])


def trend_score(report: DriftReport) -> float:
    """A report's point on the drift-over-time plot: its score, or NaN (a gap in the line, not a 0 that reads as
    "calm") for a report that judged nothing (too few rows)."""
    return report.score if report.judged else float("nan")


def _history_plot(report: DriftReport, history: Sequence[DriftReport]) -> str | None:
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    reports = _distinct([*history, report])
    moments = [_moment(r) for r in reports]
    when = mdates.date2num(moments)
    figure, ax = plt.subplots(figsize=(9, 2.8))
    scores = [trend_score(r) for r in reports]
    ax.plot(when, scores, marker="o", color="#333", label="report (worst column)")
    worst = sorted({c for r in reports for c in r.drifted_columns},
                   key=lambda name: -max((_ratio(c) for r in reports for c in r.columns if c.column == name), default=0))[:5]
    plotted = list(scores)
    for name in worst:
        series = [next((_ratio(c) if c.judged else np.nan for c in r.columns if c.column == name), np.nan)
                  for r in reports]
        ax.plot(when, series, marker=".", linewidth=1, label=name)
        plotted += series
    ax.axhline(1.0, color=NEW_COLOR, linestyle="--", linewidth=1, label="threshold")
    ax.set_ylim(*score_axis_limits(plotted))
    span = time_axis_limits(moments)
    ax.set_xlim(*(float(mdates.date2num(t)) for t in span))
    locator = mdates.AutoDateLocator(minticks=3, maxticks=8)
    ax.xaxis.set_major_locator(locator)
    # no offset text (the year or day matplotlib writes under the axis's right end, easily read as a stray
    # label): the x label says the year instead
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator, offset_formats=[""] * 6))
    ax.set_ylabel("score / threshold", fontsize=8)
    years = sorted({span[0].year, span[1].year})
    ax.set_xlabel(f"end of the report's window (UTC), {'-'.join(str(y) for y in years)}", fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.tick_params(labelsize=7)
    return inline_svg(figure)


def _score(column: ColumnDrift) -> str:
    """A column's score as the tables show it; "-" for one not judged (its 0 is no score), as ``drift check`` does."""
    return f"{column.score:.3g}" if column.judged else "-"


def _column_rows(report: DriftReport) -> str:
    rows = []
    for c in sorted(report.columns, key=lambda c: -_ratio(c)):
        rows.append(
            f"<tr class=\"{'drifted' if c.drifted else ''}\"><td>{html.escape(c.column)}</td><td>{c.role}</td>"
            f"<td>{c.kind}</td><td>{c.metric}</td><td class=num>{_score(c)}</td><td class=num>{c.threshold:.3g}</td>"
            f"<td>{'drifted' if c.drifted else 'ok' if c.judged else 'not judged'}</td><td>{html.escape(c.reason)}</td></tr>"
        )
    return "".join(rows)


def render_html(report: DriftReport, reference: dict[str, Any], current: pl.LazyFrame | None = None,
                history: Sequence[DriftReport] = ()) -> str:
    """A self-contained HTML page with plots for one drift report (and the reports before it).

    ``current`` is accepted for callers that hold the data; the plots need only what
    the report kept (shares on the reference's bins and sketch), so it is not read.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # text stays text: smaller pages
    window = " to ".join(t.strftime("%Y-%m-%d %H:%M UTC") for t in (report.since, report.until) if t) or "all captured data"
    tone = "bad" if report.drifted else "good" if report.judged else "unjudged"
    verdict = f'<span class="verdict {tone}">{html.escape(report.verdict)}</span>'
    parts = [
        f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>Drift: {html.escape(report.model)}</title>"
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>Drift report: {html.escape(report.model)}</h1>{verdict}",
        f"<p class=muted>{report.rows_current:,} current rows ({window}) against {report.rows_reference:,} reference rows; "
        f"computed {report.computed_at:%Y-%m-%d %H:%M UTC}.</p>",
    ]
    trend = _history_plot(report, history)
    if trend:
        parts.append(f"<h2>Drift score over time</h2><figure class=trend>{trend}</figure>")
    chosen = sorted(report.columns, key=lambda c: (not c.drifted, -_ratio(c)))[:max(PLOTTED_COLUMNS, len(report.drifted_columns))]
    figures = []
    for column in chosen:
        entry = _entry(reference, column)
        svg = _numeric_plot(column, entry) if column.kind == "numeric" else _categorical_plot(column, entry)
        if svg:
            figures.append(f"<figure class=column data-column=\"{html.escape(column.column)}\">{svg}"
                           f"<figcaption>{html.escape(column.reason)}</figcaption></figure>")
    if figures:
        parts.append(f"<h2>Reference against current</h2><div class=plots>{''.join(figures)}</div>")
    parts.append("<h2>Every column</h2><table><tr><th>column</th><th>role</th><th>kind</th><th>metric</th>"
                 f"<th>score</th><th>threshold</th><th>verdict</th><th>why</th></tr>{_column_rows(report)}</table>")
    parts.append("</body></html>")
    return "".join(parts)


def render_markdown(report: DriftReport) -> str:
    """A markdown summary of a drift report, for a Prefect markdown artifact."""
    window = " to ".join(t.isoformat(timespec="minutes") for t in (report.since, report.until) if t) or "all captured data"
    verdict = f"**{report.verdict}**" if report.drifted else report.verdict
    head = (f"## Drift: `{report.model}` - {verdict}\n\n"
            f"{report.rows_current:,} current rows ({window}) against {report.rows_reference:,} reference rows.\n\n")
    shown = sorted(report.columns, key=lambda c: (not c.drifted, -_ratio(c)))[:max(10, len(report.drifted_columns))]
    lines = ["| column | role | metric | score | threshold | verdict | why |", "|---|---|---|---:|---:|---|---|"]
    for c in shown:
        reason = c.reason.replace("|", "\\|")
        lines.append(f"| {c.column} | {c.role} | {c.metric} | {_score(c)} | {c.threshold:.3g} | "
                     f"{'**drifted**' if c.drifted else 'ok' if c.judged else 'not judged'} | {reason} |")
    more = len(report.columns) - len(shown)
    tail = f"\n\n{more} more columns within their thresholds." if more > 0 else ""
    return head + "\n".join(lines) + tail + "\n"
