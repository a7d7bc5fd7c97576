"""Promotion gates: each looks at a candidate version and says pass or refuse, and why.

The gates are functions of what was measured (manifests, a fetched bundle folder, a
golden-set score); the promotion flow gathers those and calls them. A failed gate
refuses the promotion with its name and reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shardline.bundle import Manifest, verify_artifacts
from shardline.errors import GateFailed, IntegrityError
from shardline.signature import is_compatible, named_columns, parse_type

SIGNATURE, CHECKSUMS, EVALUATION, REFERENCE_PROFILE = "signature", "checksums", "evaluation", "reference-profile"


@dataclass(frozen=True)
class GateResult:
    """One gate's verdict."""

    gate: str
    passed: bool
    detail: str


def signature_breaks(candidate: Manifest, current: Manifest) -> list[str]:
    """How ``candidate`` would break callers and consumers of ``current``; empty when it would not.

    A caller sends what ``current`` accepts: every candidate input must be one of
    those, with a type those values fit. A consumer reads what ``current`` returns:
    every current output must still come, with the same type.
    """
    breaks = []
    accepted = {c.name: c for c in current.signature.inputs}
    for spec in candidate.signature.inputs:
        old = accepted.get(spec.name)
        if old is None:
            breaks.append(f"input {spec.name!r} is new: rows that {current.reference} accepted lack it")
        elif not is_compatible(parse_type(old.type), parse_type(spec.type)):
            breaks.append(f"input {spec.name!r} was {old.type}, is now {spec.type}")
    returned = {c.name: c for c in candidate.signature.outputs}
    for spec in current.signature.outputs:
        new = returned.get(spec.name)
        if new is None:
            breaks.append(f"output {spec.name!r} of {current.reference} is gone")
        elif new.type != spec.type:
            breaks.append(f"output {spec.name!r} was {spec.type}, is now {new.type}")
    return breaks


def signature_gate(candidate: Manifest, current: Manifest | None, allow_breaking: bool) -> GateResult:
    """Refuse a version whose signature breaks the one it replaces, unless breaking is allowed."""
    if current is None:
        return GateResult(SIGNATURE, True, "nothing to replace: the alias is new")
    breaks = signature_breaks(candidate, current)
    if not breaks:
        return GateResult(SIGNATURE, True, f"compatible with {current.reference}")
    if allow_breaking:
        return GateResult(SIGNATURE, True, f"breaking changes allowed: {'; '.join(breaks)}")
    return GateResult(
        SIGNATURE, False,
        f"{candidate.reference} is not compatible with {current.reference}: {'; '.join(breaks)}; "
        "pass --allow-breaking if every caller is ready",
    )


def checksum_gate(bundle_dir: Path, manifest: Manifest) -> GateResult:
    """Refuse a version whose stored artifacts differ from their recorded sha256."""
    try:
        verify_artifacts(bundle_dir, manifest)
    except IntegrityError as e:
        return GateResult(CHECKSUMS, False, str(e))
    return GateResult(CHECKSUMS, True, f"{len(manifest.artifacts)} artifacts match their sha256")


def evaluation_gate(manifest: Manifest, score: float | None, problem: str | None = None) -> GateResult:
    """Refuse a version without a golden set, whose golden set could not be scored (``problem``: why, e.g. its
    columns cannot feed the model), or whose golden-set score misses its threshold."""
    if problem is not None:
        return GateResult(EVALUATION, False, problem)
    evaluation = manifest.evaluation
    if evaluation is None or score is None:
        return GateResult(
            EVALUATION, False,
            f"{manifest.reference} declares no golden data set; give it one when it is packaged or imported "
            "(`shardline model package|import --golden`, the mlflow-watch flow's golden) so promotion can check it",
        )
    direction = "at most" if evaluation.metric == "rmse" else "at least"
    verdict = f"{evaluation.metric} {score:.4f} on {evaluation.golden}, the bundle asks {direction} {evaluation.threshold}"
    return GateResult(EVALUATION, evaluation.passes(score), verdict)


def reference_profile_gate(bundle_dir: Path, manifest: Manifest) -> GateResult:
    """Refuse a version without a reference data profile (drift checks need one)."""
    if manifest.reference_profile is None:
        return GateResult(
            REFERENCE_PROFILE, False,
            f"{manifest.reference} has no reference data profile; package it with sample data "
            "(`shardline model package --signature-from DATA`) so drift checks have a baseline",
        )
    try:
        profile = json.loads((bundle_dir / manifest.reference_profile).read_text())
    except (OSError, ValueError) as e:
        return GateResult(REFERENCE_PROFILE, False, f"the reference profile cannot be read: {e}")
    columns = profile.get("columns", {})
    missing = [c for c in manifest.signature.input_names if c not in columns]
    if missing:
        return GateResult(REFERENCE_PROFILE, False, f"the reference profile lacks input columns {missing}")
    inputs, outputs = len(manifest.signature.input_names), len(profile.get("outputs", {}))
    others = [c for c in columns if c not in manifest.signature.input_names]
    rows = profile.get("rows")
    detail = (f"{_count(inputs, 'input')} and {_count(outputs, 'output column')} profiled over "
              f"{f'{rows:,}' if isinstance(rows, int) else rows} rows")
    if others:  # the reference rows' other columns (a label, an id): drift compares them where current data has them
        detail += f", besides {_count(len(others), 'column')} the model does not read ({named_columns(others)})"
    return GateResult(REFERENCE_PROFILE, True, detail)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def refusal(candidate: str, alias: str, results: list[GateResult]) -> GateFailed | None:
    """The error to refuse a promotion with, naming the first refusing gate and every reason; None if all passed."""
    refused = [r for r in results if not r.passed]
    if not refused:
        return None
    reasons = "; ".join(f"{r.gate}: {r.detail}" for r in refused)
    return GateFailed(f"{candidate} was not promoted to {alias}: gate {refused[0].gate} refused ({reasons})", refused[0].gate)
