"""Drift metrics: current data against a bundle's reference profile, per column, inputs and outputs.

``drift_report`` streams the current data (a polars LazyFrame over captured Parquet,
or a frame/table) in batches through ``LazyFrame.collect_batches``; each batch is
reduced to a handful of numbers per column (counts on the reference's bin edges,
nulls, sums, category counts) and dropped, so memory stays bounded by one batch
whatever the data's size. No great-expectations here: this path runs in flows and
the CLI, where its import (seconds) is not worth it. The GX counterparts (KL
divergence, quantiles) live in ``shardline.quality.contracts``.

Metrics, per column (``DriftPolicy`` in the manifest sets the thresholds):

- ``psi``: population stability index on the reference's decile bins (11 bins, the
  outer two open-ended; shares floored at 1e-4). For categories, on the reference's
  categories plus one bin for the rest. Its threshold is at least the value that
  sampling alone reaches with probability ``alpha``: PSI times n*m/(n+m) is about
  chi-square with bins-1 degrees of freedom.
- ``ks`` (numeric): Kolmogorov-Smirnov D, approximated on the reference's
  99-point quantile sketch: the largest gap between the reference CDF and the
  current empirical CDF at the sketch's edges. The true D lies between it and it
  plus the largest bin's mass (about 0.01). It counts as drift only when it is
  also significant at ``alpha`` for the two sample sizes (asymptotic
  Kolmogorov distribution), so a small sample's noise is not an alarm.
- ``js`` (categorical): Jensen-Shannon divergence, base 2 (0..1), over the same
  bins; for small differences JS is about PSI / (8 ln 2), which gives its
  sample-size floor the same way.
- ``new_categories`` (categorical): share of current rows whose value the
  reference never had (only when the reference listed all its categories).
- ``null_rate``: change of the null share (NaN counts as null), either way.

Free text (profile kind "text") is judged as a number: its length in characters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from statistics import NormalDist
from typing import Any, Iterator, Literal

import numpy as np
import polars as pl
import pyarrow as pa
from pydantic import BaseModel, Field

from shardline.bundle import ColumnDriftThresholds, DriftPolicy, ModelRef, version_number
from shardline.errors import InvalidInput

EPSILON = 1e-4
MAX_TRACKED_CATEGORIES = 10_000
OTHER = "(other)"
BATCH_ROWS = 262_144  # a slice of 30 float columns is ~60 MB


class ColumnDrift(BaseModel):
    """One column's verdict: the deciding metric, every metric computed, and a sentence for people."""

    column: str
    role: Literal["input", "output"]
    kind: Literal["numeric", "categorical"]
    metric: str = Field(description='The deciding metric: "psi", "ks", "js", "null_rate", "new_categories" or "rows".')
    score: float
    threshold: float
    drifted: bool
    metrics: dict[str, float] = Field(default_factory=dict)
    reason: str
    new_categories: list[str] = Field(default_factory=list, description="Values the reference never had (up to 20).")
    current: dict[str, Any] = Field(
        default_factory=dict,
        description="What the report plots: numeric 'fractions' on the reference's bins and 'cdf' at its sketch "
        "edges; categorical 'shares' of the reference's categories, '(other)' and up to 10 new ones.",
    )

    @property
    def judged(self) -> bool:
        """Whether the column was judged (False: too few current rows, see ``DriftReport.not_judged``)."""
        return self.metric != "rows"


class DriftReport(BaseModel):
    """Every judged column of one model's current data against its reference profile."""

    model: str = Field(description='The pinned model, "name:version".')
    rows_reference: int
    rows_current: int
    since: datetime | None = None
    until: datetime | None = None
    computed_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    columns: list[ColumnDrift] = Field(default_factory=list)
    not_judged: str | None = Field(
        default=None,
        description="Why no column was judged (fewer current rows than the policy's min_rows); None when judged.",
    )

    @property
    def judged(self) -> bool:
        """Whether the columns were judged (False: too few current rows; no verdict, neither drift nor no drift)."""
        return self.not_judged is None

    @property
    def drifted(self) -> bool:
        """Whether any column drifted."""
        return any(c.drifted for c in self.columns)

    @property
    def verdict(self) -> str:
        """The verdict in words: "drift in 2 of 33 columns", "no drift in 33 columns" or "not judged: <why>"."""
        if self.not_judged:
            return f"not judged: {self.not_judged}"
        if self.drifted:
            return f"drift in {len(self.drifted_columns)} of {len(self.columns)} columns"
        return f"no drift in {len(self.columns)} columns"

    @property
    def drifted_columns(self) -> list[str]:
        """Names of the drifted columns, worst first (by score over threshold)."""
        worst = sorted((c for c in self.columns if c.drifted), key=lambda c: -_ratio(c.score, c.threshold))
        return [c.column for c in worst]

    @property
    def score(self) -> float:
        """The report's one number: the largest score/threshold ratio of any column (above 1: drifted)."""
        return max((_ratio(c.score, c.threshold) for c in self.columns), default=0.0)

    def event_payload(self) -> dict[str, Any]:
        """A small JSON-able dict for a ``shardline.drift.detected`` event."""
        name, _, version = ModelRef.split(self.model)
        return {
            "model": self.model,
            "name": name,
            "version": version_number(version) if version else None,
            "rows_reference": self.rows_reference,
            "rows_current": self.rows_current,
            "since": self.since.isoformat() if self.since else None,
            "until": self.until.isoformat() if self.until else None,
            "score": round(self.score, 4),
            "columns": [
                {"column": c.column, "role": c.role, "metric": c.metric, "score": round(c.score, 4),
                 "threshold": c.threshold}
                for c in sorted((c for c in self.columns if c.drifted), key=lambda c: -_ratio(c.score, c.threshold))
            ],
        }


def _ratio(score: float, threshold: float) -> float:
    if threshold <= 0:
        return math.inf if score > 0 else 0.0
    return score / threshold


@dataclass
class _Target:
    """A profiled column to judge, and the accumulators its batches fill."""

    name: str
    role: Literal["input", "output"]
    kind: Literal["numeric", "categorical"]
    entry: dict[str, Any]
    expr: pl.Expr
    rows: int = 0
    nulls: int = 0
    total: float = 0.0
    squares: float = 0.0
    low: float = math.inf
    high: float = -math.inf
    counts: np.ndarray | None = None
    categories: dict[str, int] = field(default_factory=dict)
    overflow: int = 0


def _source_expr(entry: dict[str, Any], name: str, schema: pl.Schema) -> pl.Expr | None:
    source = entry.get("source", name)
    if source not in schema:
        return None
    expr = pl.col(source)
    if "index" in entry:
        dtype = schema[source]
        if isinstance(dtype, pl.Array):
            expr = expr.arr.get(entry["index"], null_on_oob=True)
        elif isinstance(dtype, pl.List):
            expr = expr.list.get(entry["index"], null_on_oob=True)
        else:
            return None
    return expr


def _targets(reference: dict[str, Any], schema: pl.Schema, policy: DriftPolicy) -> list[_Target]:
    targets: list[_Target] = []
    for role, section in (("input", reference.get("columns", {})), ("output", reference.get("outputs", {}))):
        for name, entry in section.items():
            kind = entry.get("kind")
            if kind not in ("numeric", "categorical", "text") or policy.for_column(name).ignore:
                continue
            expr = _source_expr(entry, name, schema)
            if expr is None:
                continue
            if kind == "text":  # free text is judged on its length in characters
                kind, expr = "numeric", expr.cast(pl.String).str.len_chars()
                entry = {**entry.get("length", {}), "null_rate": entry.get("null_rate", 0.0)}
            if kind == "numeric":
                expr = expr.cast(pl.Float64).fill_nan(None)
                edges = entry.get("sketch", {}).get("edges", [])
                counts = np.zeros(len(edges) + 1, dtype=np.int64)
            else:
                expr = expr.cast(pl.String)
                counts = None
            targets.append(_Target(name, role, kind, entry, expr.alias(f"_{len(targets)}"), counts=counts))  # type: ignore[arg-type]
    return targets


def _numeric_aggregates(target: _Target, alias: str) -> list[pl.Expr]:
    c = pl.col(alias)
    edges = [-math.inf, *target.entry.get("sketch", {}).get("edges", []), math.inf]
    return [
        c.null_count().alias(f"{alias}_nulls"),
        c.sum().alias(f"{alias}_sum"),
        (c * c).sum().alias(f"{alias}_squares"),
        c.min().alias(f"{alias}_min"),
        c.max().alias(f"{alias}_max"),
        c.hist(bins=edges, include_breakpoint=False).implode().alias(f"{alias}_hist"),
    ]


def _slices(frame: pl.LazyFrame) -> Iterator[pl.DataFrame]:
    """The frame's rows, BATCH_ROWS at a time, each slice collected on its own.

    Not ``collect_batches``: its producer runs ahead of a slower consumer and buffers
    (peak memory grew with the data, 2.6x at 4M rows). A slice of a Parquet scan is
    pushed down to the row groups it needs, so memory stays at one slice. A frame
    with a row filter is re-read up to each slice's offset: filter by time with
    ``scan_capture(since=...)`` (whole date partitions are pruned) and keep windows
    to a few million rows.
    """
    offset = 0
    while True:
        batch = frame.slice(offset, BATCH_ROWS).collect(engine="streaming")
        if batch.height:
            yield batch
        if batch.height < BATCH_ROWS:
            return
        offset += batch.height


def _accumulate(targets: list[_Target], frame: pl.LazyFrame) -> int:
    """Stream the frame's batches into the targets' accumulators; returns the row count."""
    numeric = [(t, f"_{i}") for i, t in enumerate(targets) if t.kind == "numeric"]
    categorical = [(t, f"_{i}") for i, t in enumerate(targets) if t.kind == "categorical"]
    aggregates = [e for t, alias in numeric for e in _numeric_aggregates(t, alias)]
    rows = 0
    for batch in _slices(frame.select([t.expr for t in targets])):
        rows += batch.height
        if aggregates:
            row = batch.select(aggregates).row(0, named=True)
            for t, alias in numeric:
                t.nulls += int(row[f"{alias}_nulls"])
                t.total += float(row[f"{alias}_sum"] or 0.0)
                t.squares += float(row[f"{alias}_squares"] or 0.0)
                if row[f"{alias}_min"] is not None:
                    t.low = min(t.low, float(row[f"{alias}_min"]))
                    t.high = max(t.high, float(row[f"{alias}_max"]))
                assert t.counts is not None
                t.counts += np.asarray(row[f"{alias}_hist"], dtype=np.int64)
        for t, alias in categorical:
            counts = batch.get_column(alias).value_counts()
            for value, count in counts.iter_rows():
                if value is None:
                    t.nulls += count
                elif value in t.categories or len(t.categories) < MAX_TRACKED_CATEGORIES:
                    t.categories[value] = t.categories.get(value, 0) + count
                else:
                    t.overflow += count
    for t in targets:
        t.rows = rows
    return rows


def psi(reference: np.ndarray, current: np.ndarray) -> float:
    """Population stability index of two share vectors over the same bins (shares floored at 1e-4)."""
    r = np.maximum(reference, EPSILON)
    c = np.maximum(current, EPSILON)
    return float(np.sum((c - r) * np.log(c / r)))


def js_divergence(reference: np.ndarray, current: np.ndarray) -> float:
    """Jensen-Shannon divergence, base 2 (0: same, 1: disjoint), of two share vectors."""
    r = reference / max(reference.sum(), EPSILON)
    c = current / max(current.sum(), EPSILON)
    m = (r + c) / 2

    def kl(p: np.ndarray) -> float:
        mask = p > 0
        return float(np.sum(p[mask] * np.log2(p[mask] / m[mask])))

    return max(0.0, (kl(r) + kl(c)) / 2)


def ks_pvalue(d: float, n: int, m: int) -> float:
    """Asymptotic two-sample Kolmogorov-Smirnov p-value of statistic ``d`` for sample sizes n and m."""
    if n <= 0 or m <= 0 or d <= 0:
        return 1.0
    lam = (math.sqrt(n * m / (n + m)) + 0.12 + 0.11 / math.sqrt(n * m / (n + m))) * d
    total = sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return float(min(1.0, max(0.0, 2 * total)))


def ks_critical(alpha: float, n: int, m: int) -> float:
    """The D above which two samples of sizes n and m differ at significance ``alpha`` (asymptotic)."""
    return math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((n + m) / (n * m))


def psi_critical(alpha: float, bins: int, n: int, m: int) -> float:
    """The PSI that two samples of sizes n and m from one distribution exceed with probability ``alpha``.

    PSI * n*m/(n+m) is about chi-square with bins-1 degrees of freedom; its quantile
    by the Wilson-Hilferty approximation.
    """
    k = max(1, bins - 1)
    z = NormalDist().inv_cdf(1 - alpha)
    chi2 = k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3
    return chi2 * (n + m) / (n * m)


def _fmt(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def _verdict(t: _Target, limits: ColumnDriftThresholds, candidates: list[tuple[str, float, float | None]],
             metrics: dict[str, float], describe: str, new: list[str], current: dict[str, Any]) -> ColumnDrift:
    """Pick the deciding metric (largest score/threshold) and phrase the reason."""
    judged = [(name, score, limit) for name, score, limit in candidates if limit is not None and not math.isnan(score)]
    metric, score, limit = max(judged, key=lambda j: _ratio(j[1], j[2] or 0.0), default=("psi", 0.0, 0.0))
    drifted = [f"{n.replace('_', ' ')} {_fmt(s)} > {_fmt(lim or 0.0)}" for n, s, lim in judged if s > (lim or 0.0)]
    verdict = "; ".join(drifted) if drifted else f"{metric} {_fmt(score)} <= {_fmt(limit or 0.0)}"
    reason = f"{describe}; {verdict}" if describe else verdict
    return ColumnDrift(
        column=t.name, role=t.role, kind=t.kind, metric=metric, score=float(score), threshold=float(limit or 0.0),
        drifted=bool(drifted), metrics={k: float(v) for k, v in metrics.items()}, reason=reason,
        new_categories=new, current=current,
    )


def _judge_numeric(t: _Target, limits: ColumnDriftThresholds, rows_reference: int, alpha: float) -> ColumnDrift:
    entry, valid = t.entry, t.rows - t.nulls
    null_now = t.nulls / t.rows if t.rows else 0.0
    null_delta = abs(null_now - entry.get("null_rate", 0.0))
    metrics: dict[str, float] = {"null_rate_reference": entry.get("null_rate", 0.0), "null_rate_current": null_now}
    candidates: list[tuple[str, float, float | None]] = [("null_rate", null_delta, limits.null_rate)]
    describe = f"nulls {entry.get('null_rate', 0.0):.0%} -> {null_now:.0%}" if null_now or entry.get("null_rate") else ""
    current: dict[str, Any] = {}
    if valid > 0 and t.counts is not None and "sketch" in entry:
        sketch_edges = np.asarray(entry["sketch"]["edges"])
        cdf_current = np.cumsum(t.counts)[:-1] / valid
        d = float(np.max(np.abs(np.asarray(entry["sketch"]["cdf"]) - cdf_current))) if len(sketch_edges) else 0.0
        n_ref = max(1, int(round(rows_reference * (1 - entry.get("null_rate", 0.0)))))
        ks_limit = None if limits.ks is None else max(limits.ks, ks_critical(alpha, n_ref, valid))
        floor = psi_critical(alpha, len(entry["bins"]["fractions"]), n_ref, valid)
        psi_limit = None if limits.psi is None else max(limits.psi, floor)
        bin_edges = np.asarray(entry["bins"]["edges"])
        below = np.concatenate([[0.0], cdf_current[np.searchsorted(sketch_edges, bin_edges)], [1.0]])
        fractions = np.diff(below)
        score_psi = psi(np.asarray(entry["bins"]["fractions"]), fractions)
        mean = t.total / valid
        std = math.sqrt(max(0.0, t.squares / valid - mean * mean))
        metrics.update({"psi": score_psi, "ks": d, "ks_pvalue": ks_pvalue(d, n_ref, valid),
                        "mean_reference": entry.get("mean", math.nan), "mean_current": mean,
                        "std_reference": entry.get("std", math.nan), "std_current": std,
                        "min_current": t.low, "max_current": t.high})
        candidates += [("psi", score_psi, psi_limit), ("ks", d, ks_limit)]
        describe = "; ".join(filter(None, [
            f"mean {_fmt(entry.get('mean', math.nan))} -> {_fmt(mean)}, std {_fmt(entry.get('std', math.nan))} -> {_fmt(std)}",
            describe]))
        current = {"fractions": np.round(fractions, 5).tolist(), "cdf": np.round(cdf_current, 4).tolist()}
    return _verdict(t, limits, candidates, metrics, describe, [], current)


def _judge_categorical(t: _Target, limits: ColumnDriftThresholds, rows_reference: int, alpha: float) -> ColumnDrift:
    entry = t.entry
    top: dict[str, float] = entry.get("top", {})
    complete = entry.get("other", 0.0) <= 0.0
    valid = t.rows - t.nulls
    null_now = t.nulls / t.rows if t.rows else 0.0
    null_delta = abs(null_now - entry.get("null_rate", 0.0))
    metrics: dict[str, float] = {"null_rate_reference": entry.get("null_rate", 0.0), "null_rate_current": null_now}
    candidates: list[tuple[str, float, float | None]] = [("null_rate", null_delta, limits.null_rate)]
    describe = f"nulls {entry.get('null_rate', 0.0):.0%} -> {null_now:.0%}" if null_now or entry.get("null_rate") else ""
    new: list[str] = []
    current: dict[str, Any] = {}
    if valid > 0:
        unknown = {v: c for v, c in t.categories.items() if v not in top}
        unknown_rows = sum(unknown.values()) + t.overflow
        labels = list(top)
        ref = np.asarray([top[v] for v in labels] + [entry.get("other", 0.0)])
        cur = np.asarray([t.categories.get(v, 0) for v in labels] + [unknown_rows], dtype=np.float64) / valid
        score_js, score_psi = js_divergence(ref, cur), psi(ref, cur)
        n_ref = max(1, int(round(rows_reference * (1 - entry.get("null_rate", 0.0)))))
        floor = psi_critical(alpha, int(np.count_nonzero(ref)) + (1 if unknown_rows else 0), n_ref, valid)
        psi_limit = None if limits.psi is None else max(limits.psi, floor)
        js_limit = None if limits.js is None else max(limits.js, floor / (8 * math.log(2)))
        metrics.update({"js": score_js, "psi": score_psi})
        candidates += [("js", score_js, js_limit), ("psi", score_psi, psi_limit)]
        if complete:
            share_new = unknown_rows / valid
            metrics["new_categories"] = share_new
            candidates.append(("new_categories", share_new, limits.new_categories))
            new = [v for v, _ in sorted(unknown.items(), key=lambda p: -p[1])[:20]]
            if new:
                describe = "; ".join(filter(None, [
                    f"new categories {', '.join(repr(v) for v in new[:5])} ({share_new:.1%} of rows)", describe]))
        listed = sorted(unknown.items(), key=lambda p: -p[1])[:10]
        shares = dict(zip(labels, np.round(cur[:-1], 5).tolist()))
        shares[OTHER] = round((unknown_rows - sum(c for _, c in listed)) / valid, 5)  # the rest, not listed below
        shares.update({v: round(c / valid, 5) for v, c in listed})
        current = {"shares": shares}
    return _verdict(t, limits, candidates, metrics, describe, new, current)


def _lazy(current: pl.LazyFrame | pl.DataFrame | pa.Table) -> pl.LazyFrame:
    if isinstance(current, pl.LazyFrame):
        return current
    if isinstance(current, pl.DataFrame):
        return current.lazy()
    if isinstance(current, (pa.Table, pa.RecordBatch)):
        frame = pl.from_arrow(current)
        assert isinstance(frame, pl.DataFrame)
        return frame.lazy()
    raise InvalidInput(f"drift_report compares a polars LazyFrame, DataFrame or Arrow table, got {type(current).__name__}")


def drift_report(
    reference: dict[str, Any],
    current: pl.LazyFrame | pl.DataFrame | pa.Table,
    *,
    model: str,
    policy: DriftPolicy | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> DriftReport:
    """Compare current data with a bundle's reference profile, column by column, inputs and outputs.

    Columns of the profile that the current data lacks are skipped (the data
    contract reports missing inputs); so are columns the policy ignores. With fewer
    current rows than ``policy.min_rows`` every column is reported, none judged, and
    ``report.not_judged`` says why (``report.judged`` is False: no verdict either way).

    Raises:
        InvalidInput: ``reference`` is not a profile (no ``columns``), or ``current`` is not a frame.
    """
    if not isinstance(reference, dict) or "columns" not in reference:
        raise InvalidInput(
            f"the reference for {model} is not a reference profile (no 'columns'); read the bundle's "
            "reference_profile artifact, or package the model with one (shardline.quality.profile)"
        )
    policy = policy or DriftPolicy()
    frame = _lazy(current)
    targets = _targets(reference, frame.collect_schema(), policy)
    rows = _accumulate(targets, frame) if targets else frame.select(pl.len()).collect().item()
    rows_reference = int(reference.get("rows", 0))
    not_judged = (f"only {rows} current rows; the policy judges from {policy.min_rows} (min_rows)"
                  if rows < policy.min_rows else None)
    columns = []
    for t in targets:
        limits = policy.for_column(t.name)
        if not_judged:
            columns.append(ColumnDrift(
                column=t.name, role=t.role, kind=t.kind, metric="rows", score=0.0,
                threshold=float(policy.min_rows), drifted=False, metrics={}, reason=not_judged,
            ))
        elif t.kind == "numeric":
            columns.append(_judge_numeric(t, limits, rows_reference, policy.alpha))
        else:
            columns.append(_judge_categorical(t, limits, rows_reference, policy.alpha))
    return DriftReport(model=model, rows_reference=rows_reference, rows_current=rows, since=since, until=until,
                       columns=columns, not_judged=not_judged)
