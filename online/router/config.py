"""The router's replica groups: ``router.yaml``, read and checked once when the router starts.

    groups:
      - name: cpu-east            # a hardware class, a zone or a region
        priority: 0               # lower first: traffic fails over to the next priority when none is left
        replicas: ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
      - name: cpu-west
        priority: 1
        dns: {name: shardline-west.serving.svc.cluster.local, port: 8000, refresh_s: 10}   # a headless Service

A group lists its replicas as static addresses or as a DNS name resolved every ``refresh_s``
(each address it resolves to is a replica). ``shardline router --local-replicas N`` needs no file:
it makes one group of the N replicas it starts on loopback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shardline.errors import InvalidSetting
from shardline.tenants import read_yaml, validation_problems


class DnsReplicas(BaseModel):
    """Replicas found by resolving a DNS name (A/AAAA records), each address on ``port``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=253)
    port: int = Field(default=8000, ge=1, le=65_535)
    refresh_s: float = Field(default=10.0, gt=0, le=3600)


class ReplicaGroup(BaseModel):
    """A group of replicas that fail over together."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([a-z0-9._-]*[a-z0-9])?$")
    priority: int = Field(default=0, ge=0, le=1000)
    replicas: tuple[str, ...] = ()
    dns: DnsReplicas | None = None

    @field_validator("replicas")
    @classmethod
    def _urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for url in value:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
                raise ValueError(f"{url!r} is not a replica address; write it as http://HOST:PORT (the router speaks "
                                 "plain HTTP to its replicas: keep them on a private network)")
        return tuple(url.rstrip("/") for url in value)

    @model_validator(mode="after")
    def _one_source(self) -> "ReplicaGroup":
        if bool(self.replicas) == (self.dns is not None):
            raise ValueError("give a group either 'replicas' (a list of addresses) or 'dns', not both or neither")
        return self


class Fallback(BaseModel):
    """A model's degraded mode: on ``group``'s replicas it is answered by its precision ``variant``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="The model name.")
    variant: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$", description="e.g. int8 (`shardline model optimize`).")
    group: str = Field(description="The group (a CPU pool) whose replicas serve the variant.")


class RouterConfig(BaseModel):
    """The whole of ``router.yaml``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    groups: tuple[ReplicaGroup, ...] = Field(min_length=1)
    fallbacks: tuple[Fallback, ...] = ()

    @model_validator(mode="after")
    def _unique(self) -> "RouterConfig":
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"group names must be unique, got {names}")
        for fallback in self.fallbacks:
            if fallback.group not in names:
                raise ValueError(f"the fallback of {fallback.model!r} names group {fallback.group!r}, which is not "
                                 f"one of the groups {names}")
        return self


def parse_router_config(data: Any, where: str) -> RouterConfig:
    """Check parsed YAML against the router's format.

    Raises:
        InvalidSetting: naming every wrong field (``groups[0].replicas``) and what it got.
    """
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as e:
        raise InvalidSetting(f"the router config {where} is not valid: {validation_problems(e)}; see docs/routing.md") from e


def load_router_config(path: str | Path) -> RouterConfig:
    """Read and check ``router.yaml``.

    Raises:
        InvalidSetting: the file is missing, is not YAML, or a field is wrong.
    """
    data = read_yaml(path, "the router config", "check --config (SHARDLINE_ROUTER_CONFIG_FILE)")
    return parse_router_config(data, str(path))


LOCAL_GROUP = "local"


def local_config(urls: list[str]) -> RouterConfig:
    """The config of ``--local-replicas``: one group of the replicas the router runs (none at first when it
    scales from zero: the group's members follow the scaling)."""
    group = ReplicaGroup.model_construct(name=LOCAL_GROUP, priority=0, replicas=tuple(urls), dns=None)
    return RouterConfig.model_construct(groups=(group,))
