"""Watching an MLflow registry: what to import, given what was seen and what MLflow lists (pure decisions).

The ``mlflow-watch`` flow (``flows/mlflow_watch.py``) lists, each run, the versions of the registered models
it watches (``NAME``: every version; ``NAME@ALIAS``: the one the alias points at) with MLflow's own client,
and compares them with a small state it keeps per tracking URI and model (``WatchState``, in
``<home>/mlflow-watch/<tracking key>/<name>.json``, ``tasks/mlflow_watch_state.py``). A version seen before,
imported or refused, is never imported again: a refused one (a pickle, an unmapped flavor) keeps its reason
and is not retried every run; one MLflow is still registering is left for a later run. A first run of a
``NAME`` watch imports every version MLflow holds, oldest first. Everything here is state in, decision out:
no MLflow, no Prefect, no file system.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal, Mapping, Sequence
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field

from shardline.build.mlflow_import import RegisteredVersions, shardline_name
from shardline.bundle import GoldenMetric, check_model_name
from shardline.errors import InvalidSetting

READY = "READY"  # MLflow's ModelVersionStatus of a version whose files are in place
_ALIAS = re.compile(r"[\w-]+")  # what MLflow allows in an alias name

Action = Literal["imported", "refused", "unchanged", "pending", "failed"]


class GoldenRows(BaseModel):
    """A watched model's golden set: Parquet rows with known answers (any URL), and the score each imported
    version must reach on them to be promoted (as ``shardline model package --golden`` takes them)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rows: str = Field(description="Parquet file of inputs and expected answers (any URL).")
    label: str = Field(default="target", description="Column with the expected answer.")
    metric: GoldenMetric = Field(default="accuracy", description="How answers are scored.")
    prediction: str = Field(default="label", description="Model output compared with the label.")
    threshold: float = Field(default=0.9, description="Score promotion demands (at least; at most for rmse).")


@dataclass(frozen=True)
class WatchTarget:
    """One watched MLflow model: every version of ``mlflow_name``, or (with ``alias``) the version it points at."""

    mlflow_name: str
    alias: str | None
    shardline_name: str
    sample: str | None = None  # Parquet rows its versions are checked on and profiled from (a URL)
    golden: GoldenRows | None = None  # the golden set its versions carry (promotion's gate evaluation asks for one)

    @property
    def label(self) -> str:
        """``NAME`` or ``NAME@ALIAS``, as the user wrote it."""
        return self.mlflow_name if self.alias is None else f"{self.mlflow_name}@{self.alias}"

    def uri(self, version: str) -> str:
        """``models:/NAME/VERSION``: the pinned MLflow URI of one of its versions."""
        return f"models:/{self.mlflow_name}/{version}"


def watch_targets(models: Sequence[str], name_map: Mapping[str, str] | None = None,
                  samples: Mapping[str, str] | None = None,
                  golden: Mapping[str, GoldenRows] | None = None) -> list[WatchTarget]:
    """The watch's targets from its ``models`` (``NAME`` or ``NAME@ALIAS``; the alias follows the last '@'),
    ``name_map`` (MLflow name -> Shardline name; default ``shardline_name``), ``samples`` (MLflow name ->
    Parquet rows of that model's inputs, e.g. its training data) and ``golden`` (MLflow name -> its golden set),
    in order, duplicates dropped.

    Raises:
        InvalidSetting: no model, an empty name or alias, an alias MLflow would not allow, a Shardline name that
            is not valid, or a ``name_map``, ``samples`` or ``golden`` entry for a model the watch does not list.
    """
    mapping = dict(name_map or {})
    rows = dict(samples or {})
    goldens = dict(golden or {})
    targets: list[WatchTarget] = []
    for given in models:
        text = given.strip()
        name, at, alias = text.rpartition("@") if "@" in text else (text, "", "")
        if not name.strip() or (at and not alias):
            raise InvalidSetting(f"the watched model {given!r} is not NAME or NAME@ALIAS; give an MLflow registered "
                                 "model's name, e.g. churn or churn@champion")
        if at and not _ALIAS.fullmatch(alias):
            raise InvalidSetting(f"the alias {alias!r} of {given!r} is not an MLflow alias (letters, digits, '_' and "
                                 "'-'); give NAME@ALIAS, e.g. churn@champion")
        target_name = mapping[name] if name in mapping else shardline_name(name)
        target = WatchTarget(name, alias or None, check_model_name(target_name), rows.get(name), goldens.get(name))
        if target not in targets:
            targets.append(target)
    if not targets:
        raise InvalidSetting("the watch lists no model; give MLflow registered model names (NAME or NAME@ALIAS)")
    for option, given_map in (("name_map", mapping), ("samples", rows), ("golden", goldens)):
        unknown = sorted(set(given_map) - {t.mlflow_name for t in targets})
        if unknown:
            raise InvalidSetting(f"{option} names {', '.join(map(repr, unknown))}, which the watch does not list; add "
                                 f"them to models or remove them from {option}")
    return targets


class SeenVersion(BaseModel):
    """An MLflow version the watch dealt with: imported (as ``reference``) or refused (``reason``)."""

    status: Literal["imported", "refused"]
    at: datetime
    reference: str | None = Field(default=None, description="name:version in the Shardline registry, when imported")
    digest: str | None = Field(default=None, description="its outputs digest, when imported")
    reason: str | None = Field(default=None, description="why the import was refused")


class WatchState(BaseModel):
    """What the watch has seen of one MLflow registered model in one tracking store."""

    tracking_uri: str = Field(description="the tracking URI, without a password")
    model: str = Field(description="the MLflow registered model's name")
    versions: dict[str, SeenVersion] = Field(default_factory=dict)
    aliases: dict[str, str] = Field(default_factory=dict, description="watched alias -> the version it pointed at")

    def with_version(self, version: str, seen: SeenVersion) -> WatchState:
        """This state with ``version`` recorded as ``seen``."""
        return self.model_copy(update={"versions": {**self.versions, version: seen}})

    def with_aliases(self, aliases: Mapping[str, str]) -> WatchState:
        """This state with the watched aliases' positions updated."""
        return self.model_copy(update={"aliases": {**self.aliases, **aliases}})


@dataclass(frozen=True)
class AliasMove:
    """A watched alias that points elsewhere than when the watch last saw it."""

    alias: str
    before: str | None
    after: str


@dataclass(frozen=True)
class WatchPlan:
    """What one run does with one target: the versions to import (oldest first) and what it leaves."""

    target: WatchTarget
    to_import: tuple[str, ...] = ()
    unchanged: tuple[str, ...] = ()  # seen before: imported, or refused and not retried
    refused_before: tuple[str, ...] = ()  # of those, the refused ones
    pending: tuple[str, ...] = ()  # not READY in MLflow (registering, or failed to): a later run looks again
    alias_moves: tuple[AliasMove, ...] = ()
    alias_unset: bool = False  # NAME@ALIAS whose alias MLflow does not have (yet)


def _number(version: str) -> tuple[int, str]:
    return (int(version), version) if version.isdigit() else (0, version)


def plan_watch(target: WatchTarget, listed: RegisteredVersions, state: WatchState) -> WatchPlan:
    """Decide what to import of ``target`` from MLflow's listing and the state the watch kept.

    ``NAME``: every ready version not seen before, oldest first. ``NAME@ALIAS``: the version the alias points at,
    if not seen before; an alias that moved to a version seen before imports nothing (the move is reported).
    """
    status = dict(listed.versions)
    if target.alias is None:
        wanted = sorted(status, key=_number)
        moves: tuple[AliasMove, ...] = ()
        unset = False
    else:
        pointed = listed.aliases.get(target.alias)
        wanted = [pointed] if pointed is not None else []
        before = state.aliases.get(target.alias)
        moves = (AliasMove(target.alias, before, pointed),) if pointed is not None and pointed != before else ()
        unset = pointed is None
    seen = [v for v in wanted if v in state.versions]
    fresh = [v for v in wanted if v not in state.versions]
    return WatchPlan(
        target,
        to_import=tuple(v for v in fresh if status.get(v, READY) == READY),
        unchanged=tuple(seen),
        refused_before=tuple(v for v in seen if state.versions[v].status == "refused"),
        pending=tuple(v for v in fresh if status.get(v, READY) != READY),
        alias_moves=moves,
        alias_unset=unset,
    )


def tracking_key(tracking_uri: str) -> str:
    """The folder of a tracking store's watch states: 16 hex digits of the URI's sha256 (no password in a path)."""
    return hashlib.sha256(tracking_uri.encode()).hexdigest()[:16]


def state_file_name(mlflow_name: str) -> str:
    """The file name of a model's watch state: its MLflow name, percent-encoded (any name, one file)."""
    return f"{quote(mlflow_name, safe='')}.json"


@dataclass(frozen=True)
class WatchOutcome:
    """What one run did about one target or one of its versions (one line of the summary)."""

    target: str  # NAME or NAME@ALIAS
    action: Action
    version: str | None = None  # the MLflow version, where the line is about one
    reference: str | None = None  # name:version in the Shardline registry, when imported
    detail: str = ""  # why refused or failed; what else there is to know
    user_error: bool = False  # failed because of what the watch asks for (a model MLflow does not have)
    versions: int = 1  # how many MLflow versions the line stands for (a model's versions seen before: all)

    def line(self) -> str:
        """One line for people: ``NAME version 3: imported as name:5 (...)``."""
        about = f"{self.target} version {self.version}" if self.version is not None else self.target
        what = f"{self.action} as {self.reference}" if self.reference else self.action
        return f"{about}: {what}" + (f" ({self.detail})" if self.detail else "")


def plan_outcomes(plan: WatchPlan) -> list[WatchOutcome]:
    """The summary's lines for what ``plan`` leaves alone (the imports report their own)."""
    label, lines = plan.target.label, []
    for move in plan.alias_moves:
        if move.after in plan.unchanged:
            moved = f"moved from version {move.before} to" if move.before is not None else "points at"
            lines.append(WatchOutcome(label, "unchanged", move.after,
                                      detail=f"alias {move.alias} {moved} a version seen before: nothing new"))
    if plan.alias_unset:
        lines.append(WatchOutcome(label, "unchanged", detail=f"MLflow has no alias {plan.target.alias} on it yet",
                                  versions=0))
    quiet = [v for v in plan.unchanged if v not in {m.after for m in plan.alias_moves}]
    if quiet and plan.target.alias is not None:
        [version] = quiet
        again = ", refused and not retried" if version in plan.refused_before else ""
        lines.append(WatchOutcome(label, "unchanged", version,
                                  detail=f"alias {plan.target.alias} still points at it, seen before{again}"))
    elif quiet:
        refused = [v for v in quiet if v in plan.refused_before]
        detail = f"{len(quiet)} version{'s' if len(quiet) > 1 else ''} seen before"
        detail += f", of them refused and not retried: {', '.join(refused)}" if refused else ""
        lines.append(WatchOutcome(label, "unchanged", detail=detail, versions=len(quiet)))
    unready = "not ready in MLflow (registering, or its registration failed); a later run looks again"
    lines += [WatchOutcome(label, "pending", v, detail=unready) for v in plan.pending]
    return lines


@dataclass(frozen=True)
class WatchSummary:
    """A run's outcomes and its counts: versions imported, refused, unchanged (seen before), pending, failed."""

    tracking_uri: str
    outcomes: tuple[WatchOutcome, ...] = field(default_factory=tuple)

    def count(self, action: Action) -> int:
        """How many MLflow versions the run's lines of ``action`` stand for."""
        return sum(o.versions for o in self.outcomes if o.action == action)

    @property
    def failed(self) -> list[WatchOutcome]:
        """The lines that failed (a later run tries again)."""
        return [o for o in self.outcomes if o.action == "failed"]

    def headline(self) -> str:
        """``2 imported, 1 refused, 3 unchanged`` (and failures, when there are)."""
        line = ", ".join(f"{self.count(a)} {a}" for a in ("imported", "refused", "unchanged"))
        pending, failed = self.count("pending"), len(self.failed)
        return line + (f", {pending} pending" if pending else "") + (f", {failed} failed" if failed else "")

    def as_dict(self) -> dict[str, object]:
        """The summary as the flow's result: counts and every line."""
        return {
            "tracking_uri": self.tracking_uri, "headline": self.headline(),
            **{a: self.count(a) for a in ("imported", "refused", "unchanged", "pending")},
            "failed": len(self.failed),
            "outcomes": [{"target": o.target, "action": o.action, "version": o.version, "reference": o.reference,
                          "detail": o.detail, "user_error": o.user_error, "line": o.line()} for o in self.outcomes],
        }
