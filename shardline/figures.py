"""Figures as a person reads them in a report, an artifact or the command's summary: counts, rates, durations,
and plots as inline SVG.

One place for them, so the CLI, the Prefect artifacts and the job's messages say ``200,000 rows``,
``14.6 shards/min`` and ``2h03m`` alike, not ``200000``, ``0.2433 shards/s`` and ``7380.0``.
"""

from __future__ import annotations

import io
from datetime import datetime
from typing import Any

_PER = (("s", 1.0), ("min", 60.0), ("h", 3600.0))


def amount(value: float) -> str:
    """A quantity to read: thousands separated from 100 up, one decimal from 10, two significant digits below.

    ``4,878``; ``14.6``; ``0.42``; ``0``.
    """
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2g}" if value else "0"


def rate(count: float, seconds: float, unit: str) -> str:
    """``count`` per ``seconds`` in the first of per second, per minute, per hour that makes it at least 1:
    ``4,878 rows/s``, ``14.6 shards/min``, ``0.42 shards/h``; ``unknown`` when no time passed."""
    if seconds <= 0:
        return "unknown"
    if count <= 0:
        return f"0 {unit}/s"
    per_second = count / seconds
    for name, scale in _PER:
        if per_second * scale >= 1 or name == _PER[-1][0]:
            return f"{amount(per_second * scale)} {unit}/{name}"
    raise AssertionError("unreachable")  # pragma: no cover


def span(seconds: float) -> str:
    """A duration: ``0.4 s``, ``12 s``, ``41m05s``, ``2h03m``, ``3d04h``."""
    if seconds < 10:
        return f"{max(seconds, 0):.1f} s"
    whole = int(round(seconds))
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours < 48 else f"{hours // 24}d{hours % 24:02d}h"


def rows_quarantined(rows: int, unreadable_shards: int = 0) -> str:
    """The quarantined rows as a report says them: ``5,000 rows``; with shards that could not be read at all
    (their rows are unknown, and counted nowhere), ``5,000 rows + 1 unreadable shard, rows unknown``, or, with no
    rows besides, ``1 unreadable shard, rows unknown`` (never "0 rows": what they held is not known)."""
    text = f"{rows:,} row{'s' if rows != 1 else ''}"
    if unreadable_shards:
        unreadable = f"{unreadable_shards:,} unreadable shard{'s' if unreadable_shards != 1 else ''}, rows unknown"
        text = f"{text} + {unreadable}" if rows else unreadable
    return text


def shard_counts(shards: int, committed: int, quarantined: int, earlier: int) -> str:
    """A job's shards as a report says them, each way of splitting them adding up to the whole: ``9 (7 committed,
    2 quarantined: 0 this run, 9 by an earlier run)``; committed and quarantined count every shard of the job,
    ``earlier`` those an earlier run settled (of either kind)."""
    return (f"{shards:,} ({committed:,} committed, {quarantined:,} quarantined: {shards - earlier:,} this run, "
            f"{earlier:,} by an earlier run)")


def moment(iso: str) -> str:
    """An ISO 8601 time as ``2026-12-01 06:00:00 UTC``; the text as it is when it does not parse."""
    try:
        return datetime.fromisoformat(iso).strftime("%Y-%m-%d %H:%M:%S %Z").strip()
    except ValueError:
        return iso


def inline_svg(figure: Any) -> str:
    """A matplotlib figure as an SVG element to put inline in an HTML page (no XML prolog or DOCTYPE); the
    figure is closed."""
    import matplotlib.pyplot as plt

    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight")
    plt.close(figure)
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def money(value: float | None, currency: str) -> str:
    """An amount to read: four significant digits under 1, cents from 1 up; "-" for None. (Budgets' lines said
    "spent 0.00 USD of 0.00 USD (146%)" for a budget of 0.00005.)"""
    if value is None:
        return "-"
    return f"{value:.4g} {currency}" if abs(value) < 1 else f"{value:,.2f} {currency}"
