"""A model's drift check, end to end and without Prefect: what the CLI and the drift-watch flow share.

``check_drift`` pins a reference (``churn@prod`` -> ``churn:3``), reads the version's
reference profile from the registry, scans both tiers' capture of that version over
a time window (lazily, see ``shardline.storage.capture``) and computes the report
(``shardline.quality.drift``). Reports are kept as JSON, one per check, under
``<reports root>/<model>/<version>/<computed_at>.json``, which is also their history
(the HTML report plots it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, get_args

import pyarrow as pa

from shardline import durations
from shardline.bundle import DriftPolicy, ModelRef
from shardline.errors import EmptyInput, InvalidBundle, InvalidSetting
from shardline.quality.drift import DriftReport, drift_report
from shardline.settings import DriftSettings, StorageSettings
from shardline.storage.capture import CAPTURE_META, capture_root, scan_capture
from shardline.storage.fs import atomic_write_bytes, join, open_fs
from shardline.storage.ledger import Tier
from shardline.storage.registry import ModelRegistry, ResolvedModel

if TYPE_CHECKING:
    import polars as pl



MAX_WINDOW = durations.TEN_YEARS  # the longest window a check reads


def parse_window(text: str) -> timedelta:
    """A drift window (``90s``, ``30m``, ``24h``, ``7d``, ``2w``, ``1d12h``: ``shardline.durations``) as a timedelta.

    Raises:
        InvalidSetting: anything else, a zero window, or one longer than ``MAX_WINDOW`` (3650d).
    """
    return durations.parse_duration(text, "window", longest=MAX_WINDOW)


def check_window(window: timedelta) -> timedelta:
    """``window`` when it is positive and at most ``MAX_WINDOW`` (drift-watch's ``window_hours`` comes here).

    Raises:
        InvalidSetting: a window outside that range.
    """
    if not timedelta(0) < window <= MAX_WINDOW:
        raise InvalidSetting(f"a window of {window.total_seconds() / 3600:g} h is not in (0, {MAX_WINDOW.days}d], "
                             "the windows a check reads; give e.g. 24 h")
    return window


@dataclass(frozen=True)
class DriftTarget:
    """A pinned version, the alias it was reached through (if any) and its reference profile."""

    model: ResolvedModel
    alias: str | None
    profile: dict[str, Any]

    @property
    def policy(self) -> DriftPolicy | None:
        """The manifest's drift policy (None: the defaults)."""
        return self.model.manifest.drift


def load_target(registry: ModelRegistry, reference: str) -> DriftTarget:
    """Pin ``reference`` and read its reference profile from the registry (sha256-checked).

    Raises:
        ModelNotFound: the model, version or alias is not registered.
        InvalidBundle: the version has no reference profile.
        IntegrityError: the stored profile does not match its manifest.
    """
    ref = ModelRef.parse(reference)
    model = registry.resolve(ref)
    profile = registry.reference_profile(model)
    if profile is None:
        raise InvalidBundle(
            f"{model.pinned} has no reference profile, so there is nothing to compare its captured data with; "
            "package it with one (shardline.quality.profile.attach_reference_profile, or `shardline model "
            "package --signature-from DATA`), push it and promote it again"
        )
    return DriftTarget(model, ref.alias, profile)


def window_bounds(window: timedelta, until: datetime | None = None) -> tuple[datetime, datetime]:
    """``(until - window, until)`` in UTC; ``until`` defaults to now.

    Raises:
        InvalidSetting: a window that is not positive or longer than ``MAX_WINDOW`` (``check_window``).
    """
    end = (until or datetime.now(timezone.utc)).astimezone(timezone.utc)
    return end - check_window(window), end


def rows_by_tier(frame: "pl.LazyFrame") -> dict[str, int]:
    """Captured rows per tier in a capture frame."""
    import polars as pl

    counts = frame.group_by(CAPTURE_META[1]).agg(pl.len().alias("rows")).collect(engine="streaming")
    return {str(t): int(n) for t, n in zip(counts[CAPTURE_META[1]], counts["rows"])}


@dataclass
class DriftCheck:
    """One check: what was compared, over which window, and the verdict."""

    target: DriftTarget
    report: DriftReport
    since: datetime
    until: datetime
    rows_by_tier: dict[str, int] = field(default_factory=dict)
    tier: str | None = None  # None: both tiers
    contract_failures: list[str] | None = None  # None: not checked

    @property
    def reference(self) -> str:
        """``name@alias`` when reached through an alias, else ``name:version``."""
        model = self.target.model
        return f"{model.name}@{self.target.alias}" if self.target.alias else model.pinned

    def event_payload(self) -> dict[str, Any]:
        """The report's payload plus the alias and reference, for ``shardline.drift.detected``."""
        return {**self.report.event_payload(), "alias": self.target.alias, "reference": self.reference,
                "rows_by_tier": self.rows_by_tier}


def current_capture(storage: StorageSettings, target: DriftTarget, since: datetime, until: datetime,
                    tier: str | None = None) -> "pl.LazyFrame":
    """Both tiers' (or one tier's) capture of the target's version in ``[since, until)``, lazily."""
    return scan_capture(capture_root(storage), target.model.name, version=target.model.version, tier=tier,
                        since=since, until=until, storage_options=storage.storage_options)


def check_drift(
    storage: StorageSettings, reference: str, window: timedelta, *, until: datetime | None = None,
    tier: str | None = None, registry: ModelRegistry | None = None,
) -> DriftCheck:
    """Compare the last ``window`` of captured data of ``reference``'s version with its reference profile.

    Raises:
        ModelNotFound: unknown model, version or alias.
        InvalidBundle: the version has no reference profile.
        EmptyInput: nothing of the version was captured in the window.
        InvalidSetting: ``tier`` is neither ``online`` nor ``batch`` (any other was searched for, found nothing, and
            sent the user looking for a capture that was never missing).
    """
    if tier is not None and tier not in get_args(Tier):
        raise InvalidSetting(f"tier {tier!r} is not one of {', '.join(get_args(Tier))}; leave it out for both")
    registry = registry or ModelRegistry.from_settings(storage)
    target = load_target(registry, reference)
    since, end = window_bounds(window, until)
    frame = current_capture(storage, target, since, end, tier)
    counts = rows_by_tier(frame)
    if not counts:
        raise EmptyInput(
            f"nothing of {target.model.pinned} was captured between {since:%Y-%m-%d %H:%M} and {end:%Y-%m-%d %H:%M} "
            f"UTC{f' by the {tier} tier' if tier else ''} (capture root {capture_root(storage)}); widen the window, "
            "or check that the online tier samples requests and batch jobs keep samples "
            "(SHARDLINE_STORAGE_CAPTURE_URL must be the same for them and for this check)"
        )
    report = drift_report(target.profile, frame.drop(list(CAPTURE_META)), model=target.model.pinned,
                          policy=target.policy, since=since, until=end)
    return DriftCheck(target, report, since, end, counts, tier)


def contract_sample(frame: "pl.LazyFrame", target: DriftTarget, rows: int) -> pa.Table:
    """The newest ``rows`` captured rows, input columns only: what the data contract checks."""
    names = set(frame.collect_schema().names())
    inputs = [n for n in target.model.manifest.signature.input_names if n in names]
    return frame.top_k(rows, by=CAPTURE_META[0]).select(inputs).collect(engine="streaming").to_arrow()


def contract_failures(storage: StorageSettings, check: DriftCheck, sample_rows: int) -> list[str]:
    """The model's data contract (great-expectations, imported on first call) on the newest captured rows."""
    from shardline.quality.contracts import ShardContract

    sample = contract_sample(current_capture(storage, check.target, check.since, check.until, check.tier), check.target,
                             sample_rows)
    return ShardContract(check.target.model.manifest, check.target.profile)(sample)


def reports_root(storage: StorageSettings, drift: DriftSettings) -> str:
    """Where reports are kept: ``drift.reports_url``, else ``<home>/drift``."""
    return drift.reports_url or join(str(storage.home), "drift")


def save_report(root: str, report: DriftReport, storage_options: dict[str, Any] | None = None) -> str:
    """Store a report as ``<root>/<model>/<version>/<computed_at>.json`` (atomically); returns its URL."""
    name, _, version = ModelRef.split(report.model)  # pinned: "name:version"
    fs, base = open_fs(root, storage_options)
    stamp = report.computed_at.astimezone(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    path = join(base, name, version or "", f"{stamp}.json")
    atomic_write_bytes(fs, path, report.model_dump_json(indent=1).encode(), join(base, "_staging"))
    return str(fs.unstrip_protocol(path))


def report_history(root: str, model: str, version: int, storage_options: dict[str, Any] | None = None,
                   limit: int = 100) -> list[DriftReport]:
    """The newest ``limit`` stored reports of one version, oldest first."""
    fs, base = open_fs(root, storage_options)
    folder = join(base, model, str(version))
    fs.invalidate_cache(folder)
    try:
        names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(folder, detail=False) if p.endswith(".json"))
    except FileNotFoundError:
        return []
    return [DriftReport.model_validate_json(fs.cat_file(join(folder, n))) for n in names[-limit:]]
