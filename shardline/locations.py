"""Decisions on resolved storage locations: is one inside another, may a job read one and write the other.

The locations are already resolved (``storage.fs.resolve_location``): exactly what the
file system will open, so plain string comparison by whole path segments is exact.
"""

from __future__ import annotations

import posixpath

from shardline.errors import InvalidSetting


def is_within(location: str, folder: str) -> bool:
    """True when the resolved ``location`` is ``folder`` or inside it (whole segments: /acme is not /acme-old)."""
    loc, base = location.rstrip("/") or "/", folder.rstrip("/") or "/"
    return loc == base or loc.startswith(base if base.endswith("/") else base + "/")


def check_separate(input_location: str, output_location: str) -> None:
    """Refuse an output that is the input, lies inside it, or holds it (both already resolved).

    Scored parts would overwrite the shards they came from, or be read back as shards
    by the next run; and an output folder's ``_SUCCESS`` would vouch for the input files.

    Raises:
        InvalidSetting: naming both locations and what to do.
    """
    if is_within(output_location, input_location) or is_within(input_location, output_location):
        how = ("is the input" if output_location.rstrip("/") == input_location.rstrip("/")
               else "lies inside the input" if is_within(output_location, input_location) else "holds the input")
        raise InvalidSetting(
            f"the output {output_location!r} {how} {input_location!r}: scored parts would overwrite or be read "
            "back as input shards; choose an --output folder outside the input (a sibling such as "
            f"{posixpath.dirname(input_location.rstrip('/')) or '/'}/scored)"
        )
