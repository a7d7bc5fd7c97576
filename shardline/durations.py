"""The one duration grammar of every option and setting that takes a duration.

A duration is one or more numbers, each with a unit: ``ms``, ``s``, ``m``, ``h``, ``d``, ``w`` (``500ms``,
``90s``, ``30m``, ``1h30m``, ``1.5d``, ``2w``), spaces and case ignored. Where a caller says so, a bare
number counts as seconds (``90``: the rollout options have taken that form). A refused text gets one
message: what was given, the grammar, examples. Pure.
"""

from __future__ import annotations

import re
from datetime import timedelta

from shardline.errors import InvalidSetting

_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_BARE = re.compile(r"\d+(?:\.\d+)?")
UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3_600.0, "d": 86_400.0, "w": 604_800.0}
EXAMPLES = "90s, 30m, 24h, 1h30m or 2w"
# The longest span a time a caller adds to or takes from now may be (an SLA, a drift window): ten years, far past
# any retention, and far from the dates a datetime cannot hold (``now - 1000000d`` is before year 1).
TEN_YEARS = timedelta(days=3650)


def parse_duration(text: str, what: str = "duration", *, bare_seconds: bool = False,
                   longest: timedelta | None = None) -> timedelta:
    """A duration (see the module docstring) as a timedelta; ``what`` names it in the message (``--sla``).

    ``longest`` bounds it (a caller that subtracts it from now, say); a timedelta's own limit always does.

    Raises:
        InvalidSetting: not a duration in the grammar, not positive, or longer than ``longest``.
    """
    cleaned = (text or "").strip().lower().replace(" ", "")
    if bare_seconds and _BARE.fullmatch(cleaned):
        seconds = float(cleaned)
    else:
        parts = _PART.findall(cleaned)
        if not cleaned or "".join(n + u for n, u in parts) != cleaned:
            bare = " (a bare number is seconds)" if bare_seconds else ""
            raise InvalidSetting(f"{what} {text!r} is not a duration; write e.g. {EXAMPLES} (a number and a unit: ms, "
                                 f"s, m, h, d or w; or several{bare})")
        seconds = sum(float(n) * UNIT_SECONDS[u] for n, u in parts)
    if seconds <= 0:
        raise InvalidSetting(f"{what} {text!r} is not positive; write e.g. {EXAMPLES}")
    limit = min(longest or timedelta.max, timedelta.max)  # a timedelta holds at most 999,999,999 days
    if seconds > limit.total_seconds():
        said = f"{limit.days}d" if limit.days else f"{limit.total_seconds():g}s"
        raise InvalidSetting(f"{what} {text!r} is longer than the longest accepted, {said}; write a shorter one")
    return timedelta(seconds=seconds)
