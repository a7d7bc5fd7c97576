"""The batch side of the one tenants file both tiers read: storage prefixes, priority, quotas.

The file is the online tier's (``online/tenants.py``: API key digests, models, rate);
an entry may also carry a ``batch:`` section, and a batch-only tenant needs no keys:

    tenants:
      - name: acme
        api_keys_sha256: ["<hex sha256>"]        # online only
        models: ["churn@prod"]                   # online only
        batch:
          storage_prefixes: ["s3://lake/acme/", "/data/acme"]
          priority: normal                       # high | normal | low (backfills: low)
          max_concurrent_shards: 16              # shards of this tenant on the cluster at once
          gpu_hours_per_day: 40                  # device-hours on GPUs per UTC day

Batch jobs read it through ``TenancySettings.tenants_file`` (SHARDLINE_TENANTS_FILE,
else SHARDLINE_ONLINE_TENANTS_FILE). No file: single-tenant development mode, no
limits. A file: a job for a tenant it does not list, or one without ``batch:``, is
refused; a job's input and output must lie under one of its tenant's prefixes, compared
after both are resolved to what the file system will open (``admit_locations``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shardline.errors import AccessDenied, InvalidSetting
from shardline.locations import check_separate, is_within

Priority = Literal["high", "normal", "low"]
"""A priority class, the same in both tiers: batch jobs' share of the cluster, online requests' shedding."""
PRIORITIES: tuple[Priority, ...] = ("high", "normal", "low")  # highest first: the order work is taken in


class BatchPolicy(BaseModel):
    """A tenant's ``batch:`` section."""

    model_config = ConfigDict(extra="forbid")

    storage_prefixes: list[str] = Field(
        min_length=1, description="Folders or URL prefixes the tenant's jobs may read and write under."
    )
    priority: Priority = Field(default="normal", description="Default priority class of the tenant's jobs.")
    max_concurrent_shards: int | None = Field(
        default=None, ge=1, description="Shards of this tenant on the cluster at once, across its jobs; none: unlimited."
    )
    gpu_hours_per_day: float | None = Field(
        default=None, ge=0, description="GPU device-hours per UTC day; none: unlimited."
    )

    @field_validator("storage_prefixes")
    @classmethod
    def _prefixes(cls, value: list[str]) -> list[str]:
        for i, prefix in enumerate(value):
            text = prefix.strip()
            parts = urlsplit(text)
            if not text or (not parts.netloc and parts.path.strip("/") in ("", ".")):
                raise ValueError(f"entry {i} ({prefix!r}) is empty or the root; name the tenant's own folder")
            if "?" in text or "#" in text or "::" in text:
                raise ValueError(f"entry {i} ({prefix!r}) holds '?', '#' or '::'; give a plain folder or URL")
        return value


@dataclass(frozen=True)
class BatchTenant:
    """A tenant as batch jobs see it."""

    name: str
    policy: BatchPolicy


Resolve = Callable[[str], str]
"""A URL -> the exact location the file system will use (``storage.fs.resolve_location``)."""


def resolved_prefixes(tenant: BatchTenant, resolve: Resolve) -> list[str]:
    """The tenant's storage prefixes as the file system will use them (those this process can open)."""
    prefixes = []
    for prefix in tenant.policy.storage_prefixes:
        try:
            prefixes.append(resolve(prefix))
        except InvalidSetting:
            continue  # a prefix on a file system this process cannot open holds nothing it can open
    return prefixes


def check_locations(tenant: BatchTenant, locations: dict[str, str], resolve: Resolve) -> dict[str, str]:
    """Refuse a job whose locations (role -> URL) do not all resolve to places under the tenant's prefixes.

    Locations and prefixes are compared after ``resolve``, so what is checked is what the
    job will open (links followed on local storage, no query or fragment left over).
    The job must then use the returned locations, not the ones it was given.

    Returns:
        Role -> resolved location.

    Raises:
        AccessDenied: naming the location, its role and the prefixes allowed.
        InvalidSetting: a location cannot be resolved (a query, a fragment, a host...).
    """
    prefixes = resolved_prefixes(tenant, resolve)
    resolved = {}
    for role, location in locations.items():
        resolved[role] = where = resolve(location)
        if not any(is_within(where, p) for p in prefixes):
            allowed = ", ".join(repr(p) for p in tenant.policy.storage_prefixes)
            shown = repr(location) if where == location else f"{location!r} (which resolves to {where!r})"
            raise AccessDenied(
                f"tenant {tenant.name!r} may not use {shown} as its {role}: it is not under its storage "
                f"prefixes ({allowed}); use a location under one of them, or add a prefix to the tenant's "
                "batch: section of the tenants file",
                tenant.name,
            )
    return resolved


def parse_batch_tenants(data: Any, where: str) -> dict[str, BatchTenant | None]:
    """Every tenant of a parsed tenants file, with its batch policy (None: no ``batch:`` section).

    Only the batch part is checked here; the online tier checks the rest.

    Raises:
        InvalidSetting: the file has no ``tenants`` list, or a ``batch:`` section is wrong.
    """
    if not isinstance(data, dict) or not isinstance(data.get("tenants"), list):
        raise InvalidSetting(f"the tenants file {where} has no 'tenants:' list; see docs/batch.md for the format")
    found: dict[str, BatchTenant | None] = {}
    for i, entry in enumerate(data["tenants"]):
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name:
            raise InvalidSetting(f"the tenants file {where}: tenants[{i}] has no name")
        section = entry.get("batch")
        if section is None:
            found[name] = None
            continue
        try:
            found[name] = BatchTenant(name, BatchPolicy.model_validate(section))
        except ValidationError as e:
            problems = "; ".join(
                f"tenants[{i}].batch.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
                + (f" (got {err['input']!r})" if err["type"] != "missing" else "")
                for err in e.errors()
            )
            raise InvalidSetting(f"the tenants file {where} is not valid: {problems}") from e
    return found


def load_batch_tenants(path: str | Path) -> dict[str, BatchTenant | None]:
    """Read the tenants file's batch sections.

    Raises:
        InvalidSetting: the file is missing, not YAML, or a batch section is wrong.
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise InvalidSetting(
            f"the tenants file {path} cannot be read ({e.strerror}); fix SHARDLINE_TENANTS_FILE "
            "(or SHARDLINE_ONLINE_TENANTS_FILE), or unset it for single-tenant development"
        ) from e
    except yaml.YAMLError as e:
        raise InvalidSetting(f"the tenants file {path} is not valid YAML: {e}") from e
    return parse_batch_tenants(data, str(path))


def batch_tenant(tenants_file: str | None, name: str) -> BatchTenant | None:
    """The batch tenant a job runs for; None in single-tenant mode (no file).

    Raises:
        AccessDenied: a file is configured and does not list the tenant, or gives it no batch section.
    """
    if tenants_file is None:
        return None
    tenants = load_batch_tenants(tenants_file)
    if name not in tenants:
        known = ", ".join(sorted(tenants)) or "none"
        raise AccessDenied(
            f"tenant {name!r} is not in the tenants file {tenants_file} (tenants: {known}); run the job as one "
            "of them (--tenant), or add the tenant with a batch: section",
            name,
        )
    tenant = tenants[name]
    if tenant is None:
        raise AccessDenied(
            f"tenant {name!r} has no batch: section in {tenants_file}, so it may not run batch jobs; add "
            "batch: {storage_prefixes: [...]} to its entry",
            name,
        )
    return tenant


def admit_locations(
    tenant: BatchTenant | None, input_uri: str, output_uri: str, resolve: Resolve
) -> tuple[str, str]:
    """The (input, output) a batch job will really use, once they are resolved, separate and allowed.

    Every job resolves both (single-tenant mode too), so what was checked is what is
    opened; with a tenant, both must lie under its prefixes.

    Raises:
        InvalidSetting: a location cannot be resolved, or the output overlaps the input.
        AccessDenied: a location is outside the tenant's prefixes.
    """
    given = {"input": input_uri, "output": output_uri}
    where = check_locations(tenant, given, resolve) if tenant is not None else {r: resolve(u) for r, u in given.items()}
    check_separate(where["input"], where["output"])
    return where["input"], where["output"]
