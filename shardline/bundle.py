"""Model bundles: a folder with ``manifest.json`` and the artifacts it lists.

The manifest names the model, its runtime, every artifact with its sha256, the
input/output signature, hardware hints, environment and lineage. Two digests name
a bundle: ``outputs_digest`` covers what decides the model's outputs (batch jobs key
their output on it), ``content_digest`` covers the whole bundle (the registry
recognises a re-push of the same bytes by it, the model cache keys on it).
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator

from shardline.errors import IntegrityError, InvalidBundle, InvalidSetting
from shardline.signature import Signature

MANIFEST = "manifest.json"
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_VERSION = re.compile(r"[0-9]{1,9}")  # ASCII digits only (str.isdigit takes '²', int() does not), a sane length
_CHUNK = 1 << 20


def sha256_of(stream: IO[bytes]) -> str:
    """Hex sha256 of a binary stream, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    while chunk := stream.read(_CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a local file."""
    with open(path, "rb") as f:
        return sha256_of(f)


def version_number(text: str) -> int | None:
    """The version a text names (``"3"`` -> 3): 1-9 ASCII digits, else None."""
    return int(text) if _VERSION.fullmatch(text) else None


def check_model_name(name: str) -> str:
    """Return ``name`` if it is a valid model name, else raise InvalidSetting."""
    if not _NAME.fullmatch(name):  # fullmatch: '$' would let a trailing newline through
        raise InvalidSetting(
            f"model name {name!r} is not allowed; use 1-64 lower-case letters, digits, "
            "'.', '_' or '-', starting with a letter or digit"
        )
    return name


ArtifactRole = Literal["model", "code", "tokenizer", "golden", "profile", "other"]
# Roles that describe or check a model without changing what it computes.
_NOT_IN_DIGEST = ("golden", "profile")


class Artifact(BaseModel):
    """One file of a bundle."""

    path: str = Field(description="Path relative to the bundle folder, '/'-separated.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)
    role: ArtifactRole = Field(default="model", description="What the file is for.")

    @field_validator("path")
    @classmethod
    def _relative(cls, value: str) -> str:
        if value.startswith("/") or ".." in value.split("/") or value == MANIFEST:
            raise ValueError(f"artifact path {value!r} must be relative, inside the bundle")
        return value


DISTILLATION_ROWS = "distillation_rows"  # the ``Lineage.metrics`` key of a distilled student: the rows it learnt from


class Lineage(BaseModel):
    """Where a model came from (a distilled student: ``parent`` its teacher, ``metrics`` holding
    ``DISTILLATION_ROWS``)."""

    training_data: str | None = None
    training_data_digest: str | None = None
    source_commit: str | None = None
    parent: str | None = None
    metrics: dict[str, float] = Field(default_factory=dict)


Device = Literal["cpu", "cuda"]


def _all_devices() -> list[Device]:
    return ["cpu", "cuda"]


class HardwareHints(BaseModel):
    """What a model can run on."""

    devices: list[Device] = Field(default_factory=_all_devices)
    min_memory_mb: int | None = None


GoldenMetric = Literal["accuracy", "rmse", "cosine_min"]  # how a golden set's answers are scored


class Evaluation(BaseModel):
    """How promotion checks a version: a golden data set and the scores it must reach."""

    golden: str = Field(description="Artifact path of the golden Parquet file.")
    label_column: str = Field(description="Column of the golden set holding the expected answer.")
    metric: GoldenMetric = Field(
        description="accuracy: label == prediction; rmse: of a numeric prediction; cosine_min: "
        "the least cosine similarity between an embedding and the expected one."
    )
    prediction_column: str = Field(description="Output column compared with the label.")
    threshold: float = Field(description="At least this (accuracy, cosine_min) or at most this (rmse).")
    max_variant_delta: float = Field(
        default=0.01, ge=0, description="How far from fp32's score, either way, a precision variant may score."
    )

    def passes(self, score: float) -> bool:
        """Whether a score meets the threshold, in the metric's direction."""
        return score <= self.threshold if self.metric == "rmse" else score >= self.threshold


class ColumnDriftThresholds(BaseModel):
    """Per-column overrides of a drift policy's thresholds; unset fields keep the policy's."""

    psi: float | None = Field(default=None, ge=0, description="Population stability index above which it drifted.")
    ks: float | None = Field(default=None, ge=0, le=1, description="Kolmogorov-Smirnov D above which it drifted.")
    js: float | None = Field(default=None, ge=0, le=1, description="Jensen-Shannon divergence (bits) above which it drifted.")
    null_rate: float | None = Field(
        default=None, ge=0, le=1, description="Change of the null share (either way) above which it drifted."
    )
    new_categories: float | None = Field(
        default=None, ge=0, le=1, description="Share of rows in categories the reference never had, above which it drifted."
    )
    ignore: bool = Field(default=False, description="Never judge this column (ids, timestamps, free text).")


class DriftPolicy(ColumnDriftThresholds):
    """When a model's inputs or outputs count as drifted: thresholds, and overrides per column.

    The defaults follow common practice: PSI 0.2 (0.1-0.25 is a moderate shift), KS
    D 0.1, Jensen-Shannon 0.1 bits, a null share moved by 5 points, 1% of rows in new
    categories. PSI, KS and JS must also be significant at ``alpha`` for the two
    sample sizes, so a small reference raises their thresholds. Outputs are judged
    like inputs (named after the output column; a fixed-size list element is
    ``name[i]``). A threshold of None switches that metric off.
    """

    psi: float | None = Field(default=0.2, ge=0, description="Population stability index above which a column drifted.")
    ks: float | None = Field(default=0.1, ge=0, le=1, description="Kolmogorov-Smirnov D above which a number drifted.")
    js: float | None = Field(default=0.1, ge=0, le=1, description="Jensen-Shannon divergence above which a category drifted.")
    null_rate: float | None = Field(default=0.05, ge=0, le=1, description="Change of the null share above which it drifted.")
    new_categories: float | None = Field(
        default=0.01, ge=0, le=1, description="Share of rows in unseen categories above which a column drifted."
    )
    alpha: float = Field(
        default=0.001, gt=0, lt=1,
        description="PSI, KS and JS must also be significant at this level for the two sample sizes: a small "
        "reference or sample is not judged on its noise.",
    )
    min_rows: int = Field(default=100, ge=1, description="Fewer current rows than this: reported, not judged.")
    columns: dict[str, ColumnDriftThresholds] = Field(default_factory=dict, description="Overrides by column name.")

    def for_column(self, name: str) -> ColumnDriftThresholds:
        """The thresholds that apply to one column: the policy's, with that column's overrides on top."""
        override = self.columns.get(name)
        base = ColumnDriftThresholds(psi=self.psi, ks=self.ks, js=self.js, null_rate=self.null_rate,
                                     new_categories=self.new_categories)
        if override is None:
            return base
        return base.model_copy(update=override.model_dump(exclude_unset=True))


class Manifest(BaseModel):
    """The contents of ``manifest.json``."""

    format_version: Literal[1] = 1
    name: str
    version: int | None = Field(default=None, description="Set by the registry at push.")
    runtime: str = Field(description="Runtime that loads it, e.g. 'onnx'.")
    artifacts: list[Artifact] = Field(min_length=1)
    signature: Signature
    runtime_config: dict[str, Any] = Field(
        default_factory=dict, description="Runtime-specific settings (tensor bindings)."
    )
    hardware: HardwareHints = Field(default_factory=HardwareHints)
    environment: dict[str, str] = Field(default_factory=dict)
    lineage: Lineage = Field(default_factory=Lineage)
    evaluation: Evaluation | None = None
    reference_profile: str | None = Field(
        default=None, description="Artifact path of the reference data profile (for drift checks)."
    )
    drift: DriftPolicy | None = Field(
        default=None, description="When inputs or outputs count as drifted; None: the defaults of DriftPolicy."
    )
    tags: dict[str, str] = Field(default_factory=dict)
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        return check_model_name(value)

    def _hash(self, artifacts: list[tuple[str, str]], **extra: Any) -> str:
        content = {
            "runtime": self.runtime,
            "runtime_config": self.runtime_config,
            "signature": self.signature.model_dump(mode="json"),
            "artifacts": sorted(artifacts),
            **extra,
        }
        return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    @property
    def outputs_digest(self) -> str:
        """sha256 over what decides the model's outputs: runtime, config, signature, model artifacts.

        Batch jobs key their output on it: re-packaging a model with another golden
        set or profile does not invalidate what it already scored.
        """
        return self._hash([(a.path, a.sha256) for a in self.artifacts if a.role not in _NOT_IN_DIGEST])

    @property
    def content_digest(self) -> str:
        """sha256 over the whole bundle: every artifact and the evaluation it declares.

        The registry recognises a re-push of the same bundle by it; the model cache keys on it.
        """
        evaluation = self.evaluation.model_dump(mode="json") if self.evaluation else None
        extra: dict[str, Any] = {"evaluation": evaluation, "reference_profile": self.reference_profile}
        if self.drift is not None:  # only when set: bundles without a policy keep their content digest
            extra["drift"] = self.drift.model_dump(mode="json")
        return self._hash([(a.path, a.sha256) for a in self.artifacts], **extra)

    @property
    def reference(self) -> str:
        """``name:version``, or just the name before the registry numbers it."""
        return self.name if self.version is None else f"{self.name}:{self.version}"

    def artifact(self, role: ArtifactRole) -> Artifact | None:
        """The first artifact with a role, if any."""
        return next((a for a in self.artifacts if a.role == role), None)

    def to_json(self) -> str:
        """The manifest as pretty JSON."""
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> "Manifest":
        """Parse a manifest; ``where`` names its location in the error."""
        try:
            return cls.model_validate_json(text)
        except ValidationError as e:
            raise InvalidBundle(
                f"the manifest at {where} is not valid: {e}; rebuild the bundle with "
                "`shardline model package` or fix the fields named"
            ) from e


def read_manifest(bundle_dir: str | Path) -> Manifest:
    """Read the manifest of a local bundle folder."""
    path = Path(bundle_dir) / MANIFEST
    if not path.is_file():
        raise InvalidBundle(
            f"{bundle_dir} has no {MANIFEST}; a bundle is a folder with a manifest and "
            "its artifacts (make one with `shardline model package`)"
        )
    return Manifest.from_json(path.read_bytes(), str(path))


def write_manifest(bundle_dir: str | Path, manifest: Manifest) -> None:
    """Write ``manifest.json`` into a local bundle folder."""
    (Path(bundle_dir) / MANIFEST).write_text(manifest.to_json())


def verify_artifacts(bundle_dir: str | Path, manifest: Manifest) -> None:
    """Check every artifact's size and sha256 against the manifest.

    Raises:
        IntegrityError: an artifact is missing or its bytes differ.
    """
    for artifact in manifest.artifacts:
        path = Path(bundle_dir) / artifact.path
        if not path.is_file():
            raise IntegrityError(
                f"artifact {artifact.path!r} of {manifest.reference} is missing from "
                f"{bundle_dir}; re-fetch the bundle or push it again",
                artifact.path,
                artifact.sha256,
                "missing",
            )
        got = sha256_file(path)
        if got != artifact.sha256:
            raise IntegrityError(
                f"artifact {artifact.path!r} of {manifest.reference} has sha256 {got[:12]}..., "
                f"the manifest says {artifact.sha256[:12]}...; the file was changed after "
                "packaging: do not load it, re-fetch or re-package the model",
                artifact.path,
                artifact.sha256,
                got,
            )


def describe_artifact(bundle_dir: str | Path, relative: str, role: ArtifactRole = "model") -> Artifact:
    """Make the manifest entry for a file already inside a bundle folder."""
    path = Path(bundle_dir) / relative
    return Artifact(path=relative, sha256=sha256_file(path), size=path.stat().st_size, role=role)


class ModelRef(BaseModel):
    """A parsed model reference: ``name@alias``, ``name:version`` or bare ``name``."""

    name: str
    version: int | None = None
    alias: str | None = None

    @staticmethod
    def split(text: str) -> tuple[str, str | None, str | None]:
        """The (name, alias, version) a reference is written with, unchecked: the one place its syntax lives.

        ``name@alias`` -> (name, alias, None); ``name:version`` -> (name, None, version); a bare
        ``name`` -> (name, None, None). An empty part stays "" (``name@`` -> alias ""). Callers
        that answer a wire request check the parts in their own words; others use ``parse``.
        """
        text = text.strip()
        name, at, alias = text.partition("@")
        if at:
            return name, alias, None
        name, colon, version = text.partition(":")
        return name, None, version if colon else None

    @classmethod
    def parse(cls, text: str) -> "ModelRef":
        """Parse a reference string; a bare name means the alias ``prod``."""
        text = text.strip()
        name, alias, version = cls.split(text)
        if alias is not None:
            if not alias:
                raise InvalidSetting(f"model reference {text!r} has an empty alias")
            return cls(name=check_model_name(name), alias=alias)
        if version is not None:
            number = version_number(version)
            if number is None:
                raise InvalidSetting(
                    f"model reference {text!r}: the version {version!r} is not a number; "
                    "write name:3 for a version or name@prod for an alias"
                )
            return cls(name=check_model_name(name), version=number)
        return cls(name=check_model_name(text), alias="prod")

    def __str__(self) -> str:
        return f"{self.name}:{self.version}" if self.version is not None else f"{self.name}@{self.alias}"
