"""The ShardlineModel custom resource: its spec as the operator reads it, checked field by field.

``parse_resource(body)`` turns what the API server hands the operator into a ``ShardlineModel`` or
refuses it with one line that names every wrong field (``spec.maxReplicas: ...``). The CRD's OpenAPI
schema (deploy/k8s/crds/shardlinemodel.yaml) refuses the same shapes at ``kubectl apply`` on a real
cluster; this check is the one the operator holds itself to, and the only one that reads references
(``churn:5``, ``churn@prod``) with the registry's own parser. Pure.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.alias_generators import to_camel

from shardline.bundle import ModelRef
from shardline.durations import parse_duration
from shardline.errors import InvalidSetting, ShardlineError
from shardline.storage.registry import check_alias
from shardline.storage.rollouts import RollbackCriteria, parse_steps
from shardline.tenants import validation_problems

GROUP = "shardline.dev"
VERSION = "v1alpha1"
PLURAL = "shardlinemodels"
KIND = "ShardlineModel"
API_VERSION = f"{GROUP}/{VERSION}"

HARDWARE_CLASS = re.compile(r"cpu|gpu|mig-[1-7]g\.[0-9]{1,3}gb")
_MEMORY = re.compile(r"([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?")
_CPU = re.compile(r"[0-9]+(?:\.[0-9]+)?m?")
_UNITS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}

SloClass = Literal["interactive", "standard", "throughput"]


def memory_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (``4Gi``, ``512Mi``, ``1G``, ``1000``) in bytes.

    Raises:
        ValueError: not such a quantity.
    """
    found = _MEMORY.fullmatch(quantity.strip())
    if found is None:
        raise ValueError(f"{quantity!r} is not a memory quantity; write e.g. 4Gi or 512Mi")
    return int(float(found.group(1)) * _UNITS[found.group(2)])


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


class Resources(_Spec):
    """CPU and memory of one replica, replacing the hardware class's defaults."""

    cpu: str | None = Field(default=None, description="CPU request, e.g. 2 or 500m.")
    memory: str | None = Field(default=None, description="Memory request and limit, e.g. 4Gi.")

    @field_validator("cpu")
    @classmethod
    def _cpu(cls, value: str | None) -> str | None:
        if value is not None and not _CPU.fullmatch(value):
            raise ValueError(f"{value!r} is not a CPU quantity; write e.g. 2 or 500m")
        return value

    @field_validator("memory")
    @classmethod
    def _memory(cls, value: str | None) -> str | None:
        if value is not None:
            memory_bytes(value)
        return value


class RolloutPolicy(_Spec):
    """How a change of the spec's version reaches callers: a canary (or a shadow) run by the routers."""

    strategy: Literal["canary", "shadow"] = "canary"
    steps: tuple[float, ...] = Field(default=(1.0, 5.0, 25.0, 100.0), description="Canary: percents of callers.")
    interval: str | None = Field(default="10m", description="Canary: each step's time before the next; null: by hand.")
    shadow: float = Field(default=0.1, gt=0, le=1, description="Shadow: the share of requests mirrored.")
    window: str | None = Field(default=None, description="Rollback window (default 60s).")
    min_requests: int | None = Field(default=None, ge=1, strict=True,
                                     description="Candidate answers before any verdict.")
    max_error_increase: float | None = Field(default=None, ge=0, le=1)
    max_p99_ratio: float | None = Field(default=None, ge=1)

    @field_validator("steps")
    @classmethod
    def _steps(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        try:
            return parse_steps(",".join(f"{s:g}" for s in value))  # the rule `rollout start --steps` holds
        except InvalidSetting as e:
            raise ValueError(str(e)) from e

    @field_validator("interval", "window")
    @classmethod
    def _duration(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                parse_duration(value, bare_seconds=True)
            except InvalidSetting as e:
                raise ValueError(str(e)) from e
        return value

    @property
    def interval_s(self) -> float | None:
        """Seconds per step, None when steps wait for `shardline rollout promote`."""
        return None if self.interval is None else parse_duration(self.interval, bare_seconds=True).total_seconds()

    def criteria(self) -> RollbackCriteria:
        """The routers' rollback criteria: the policy's own, the rest at their defaults."""
        given = {"window_s": parse_duration(self.window, bare_seconds=True).total_seconds() if self.window else None,
                 "min_requests": self.min_requests, "max_error_increase": self.max_error_increase,
                 "max_p99_ratio": self.max_p99_ratio}
        return RollbackCriteria(**{k: v for k, v in given.items() if v is not None})


class ShardlineModelSpec(_Spec):
    """What a ShardlineModel asks for: a model version served on a hardware class, within replica bounds."""

    model: str = Field(description="The reference served: name:version (a rollout on a change) or name@alias.")
    alias: str | None = Field(default=None, description="The alias routers resolve callers by (default prod).")
    hardware_class: str = Field(default="cpu", description="cpu, gpu (a whole GPU) or mig-<profile>, e.g. mig-1g.18gb.")
    min_replicas: int = Field(default=1, ge=0, le=1000, strict=True)
    max_replicas: int = Field(default=4, ge=1, le=1000, strict=True)
    slo_class: SloClass = "standard"
    rollout_policy: RolloutPolicy = Field(default_factory=RolloutPolicy)
    resources: Resources = Field(default_factory=Resources)

    @field_validator("model")
    @classmethod
    def _reference(cls, value: str) -> str:
        try:
            ModelRef.parse(value)
        except ShardlineError as e:
            raise ValueError(str(e)) from e
        return value

    @field_validator("hardware_class")
    @classmethod
    def _hardware(cls, value: str) -> str:
        if not HARDWARE_CLASS.fullmatch(value):
            raise ValueError(f"{value!r} is not a hardware class; use cpu, gpu or a MIG profile such as mig-1g.18gb "
                             "or mig-3g.71gb (the GPU operator's mixed strategy)")
        return value

    @property
    def reference(self) -> ModelRef:
        """The parsed model reference."""
        return ModelRef.parse(self.model)

    @property
    def pinned(self) -> int | None:
        """The version the spec names, None when it names an alias."""
        return self.reference.version

    @property
    def routed_alias(self) -> str:
        """The alias routers resolve this model's callers by: the reference's own, else ``alias``, else prod."""
        return self.reference.alias or self.alias or "prod"


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    spec: ShardlineModelSpec


class ShardlineModel(BaseModel):
    """A ShardlineModel as the operator reconciles it: who it is and its checked spec."""

    model_config = ConfigDict(frozen=True)

    name: str
    namespace: str
    uid: str = ""
    generation: int = 0
    created: str = ""  # metadata.creationTimestamp (RFC 3339, UTC: ordered as text)
    spec: ShardlineModelSpec


# The objects the operator makes for a ShardlineModel carry its name, a Service among them: a DNS-1035 label.
SERVICE_NAME = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")


def _cross_field_problems(spec: ShardlineModelSpec, name: str) -> list[str]:
    problems = []
    if not SERVICE_NAME.fullmatch(name):
        problems.append(f"metadata.name: {name!r} cannot name the Service made for it (a DNS-1035 label: at most 63 "
                        "lower-case letters, digits and '-', starting with a letter, not ending with '-'); rename it")
    if spec.max_replicas < spec.min_replicas:
        problems.append(f"spec.maxReplicas: {spec.max_replicas} is below spec.minReplicas {spec.min_replicas}")
    ref = spec.reference
    if ref.alias is not None and spec.alias is not None and spec.alias != ref.alias:
        problems.append(f"spec.alias: {spec.alias!r} differs from the alias spec.model names ({spec.model!r}); "
                        "leave spec.alias out or make them the same")
    if spec.alias is not None:
        try:
            check_alias(spec.alias)
        except InvalidSetting as e:
            problems.append(f"spec.alias: {e}")
    return problems


def parse_resource(body: Mapping[str, Any]) -> ShardlineModel:
    """The checked ShardlineModel of an API object.

    Raises:
        InvalidSetting: naming every wrong field (``spec.minReplicas: ...``) and what it got.
    """
    meta = body.get("metadata") or {}
    where = f"ShardlineModel {meta.get('namespace', '?')}/{meta.get('name', '?')}"
    try:
        spec = _Body.model_validate({"spec": body.get("spec")}).spec
    except ValidationError as e:
        raise InvalidSetting(f"{where} is refused: {validation_problems(e)}; correct it and apply it again") from e
    problems = _cross_field_problems(spec, str(meta.get("name", "")))
    if problems:
        raise InvalidSetting(f"{where} is refused: {'; '.join(problems)}; correct it and apply it again")
    return ShardlineModel(name=str(meta.get("name", "")), namespace=str(meta.get("namespace", "")),
                          uid=str(meta.get("uid", "")), generation=int(meta.get("generation") or 0),
                          created=str(meta.get("creationTimestamp") or ""), spec=spec)
