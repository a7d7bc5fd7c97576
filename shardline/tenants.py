"""The tenants file, read and checked in one place for both tiers, and its batch side.

One YAML file says who the tenants are: the online tier's API key digests, models,
priority and rate, and batch jobs' storage prefixes and quotas (a ``batch:`` section).
``load_tenants_file`` reads it once and checks all of it (a wrong field stops the start
or the job with the same message in both tiers, naming it: ``tenants[0].rate.burst: ...``);
the online tier builds its key directory from it (``online/tenants.py``), batch jobs take
``batch_tenants()``. A batch-only tenant needs no keys:

    tenants:
      - name: acme
        api_keys_sha256: ["<hex sha256>"]        # online only
        models: ["churn@prod"]                   # online only
        priority: high                           # online shedding class
        rate: {requests_per_second: 200, burst: 400}
        max_concurrent: 64
        custom_code: false                       # models that carry their own Python code (both tiers)
        tokens_per_minute: 20000                 # LLM prompt + completion tokens (online)
        max_streams: 8                           # LLM generations in flight (online)
        batch:
          storage_prefixes: ["s3://lake/acme/", "/data/acme"]
          priority: normal                       # high | normal | low (backfills: low)
          max_concurrent_shards: 16              # shards of this tenant on the cluster at once
          gpu_hours_per_day: 40                  # device-hours on GPUs per UTC day
        budget: {monthly: 500.0, warn_at: 0.8, soft_at: 0.9}  # money per UTC month, both tiers (docs/cost.md)

Both tiers find it through ``TenancySettings.tenants_file`` (SHARDLINE_TENANTS_FILE,
else SHARDLINE_ONLINE_TENANTS_FILE; ``shardline serve --tenants``). No file: batch jobs
run in single-tenant development mode, no limits (the server needs one). A file: a job
for a tenant it does not list, or one without ``batch:``, is refused; a job's input and
output must lie under one of its tenant's prefixes, compared after both are resolved to
what the file system will open (``admit_locations``).
"""

from __future__ import annotations

import hashlib
import reprlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shardline.budgets import Budget
from shardline.bundle import ModelRef
from shardline.errors import AccessDenied, InvalidSetting, ShardlineError, yaml_problem
from shardline.locations import check_separate, is_within

Priority = Literal["high", "normal", "low"]
"""A priority class, the same in both tiers: batch jobs' share of the cluster, online requests' shedding."""
PRIORITIES: tuple[Priority, ...] = ("high", "normal", "low")  # highest first: the order work is taken in


def hash_api_key(key: str) -> str:
    """The hex sha256 of an API key: what the tenants file stores (the servers compare keys against it)."""
    return hashlib.sha256(key.encode()).hexdigest()


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


class RateQuota(BaseModel):
    """A token bucket: ``requests_per_second`` on average, up to ``burst`` at once."""

    model_config = ConfigDict(extra="forbid")

    requests_per_second: float = Field(gt=0, description="Average requests per second allowed.")
    burst: int = Field(ge=1, description="Requests allowed at once after a quiet spell.")


class TenantConfig(BaseModel):
    """One entry of the tenants file."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="Tenant name (metrics, logs).")
    api_keys_sha256: list[str] = Field(
        default_factory=list, description="Hex sha256 digests of the tenant's API keys; none: a batch-only tenant."
    )
    models: list[str] = Field(default_factory=list, description="Model references the tenant may call, one per model.")
    priority: Priority = Field(default="normal", description="Online shedding class: low is shed first.")
    rate: RateQuota | None = Field(default=None, description="Request rate quota; none means unlimited.")
    max_concurrent: int | None = Field(default=None, ge=1, description="Requests in flight at most; none: unlimited.")
    batch: BatchPolicy | None = Field(default=None, description="Batch jobs' prefixes and quotas; none: no batch jobs.")
    custom_code: bool = Field(
        default=False, description="Whether the tenant may run models that carry their own Python code (runtime "
        "'python'), online and in batch jobs: that code runs inside the platform's processes with their rights.",
    )
    tokens_per_minute: int | None = Field(
        default=None, ge=1, description="LLM tokens (prompt and completion) per minute, across the tenant's "
        "generation requests; checked before a stream starts and enforced during it. None: unlimited.",
    )
    max_streams: int | None = Field(
        default=None, ge=1, description="LLM generations (streamed or not) in flight at most; none: unlimited."
    )
    budget: Budget | None = Field(
        default=None, description="Money per UTC month across both tiers, in the price table's currency, with the "
        "fractions that warn and degrade (docs/cost.md, 'Budgets'); none: unlimited.",
    )

    @model_validator(mode="after")
    def _serves_something(self) -> "TenantConfig":
        if self.api_keys_sha256 and not self.models:
            raise ValueError("models: list at least one model the tenant may call (or drop its API keys)")
        if not self.api_keys_sha256 and self.batch is None:
            raise ValueError("api_keys_sha256: give the tenant an API key, or a batch: section for batch-only use")
        return self

    @field_validator("api_keys_sha256")
    @classmethod
    def _hex_digests(cls, value: list[str]) -> list[str]:
        digests = [v.strip().lower() for v in value]
        for i, digest in enumerate(digests):
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(
                    f"entry {i} is not a hex sha256 digest (64 hex characters); store the key's digest "
                    "(`shardline tenant add` and `rotate-key` write it), e.g. `printf %s \"$KEY\" | sha256sum`, "
                    "never the key itself"
                )
        return digests

    @field_validator("models")
    @classmethod
    def _references(cls, value: list[str]) -> list[str]:
        seen: dict[str, str] = {}
        for i, text in enumerate(value):
            try:
                ref = ModelRef.parse(text)
            except ShardlineError as e:
                raise ValueError(f"entry {i}: {e}") from e
            if ref.name in seen:
                raise ValueError(
                    f"entry {i} ({text!r}) names model {ref.name!r} again (first as {seen[ref.name]!r}); list a "
                    "model once: its reference picks the version on unversioned paths, other versions are "
                    "reached on versioned paths or as name@alias"
                )
            seen[ref.name] = text
        return value

    def model_refs(self) -> dict[str, ModelRef]:
        """The tenant's references by model name."""
        return {ref.name: ref for ref in map(ModelRef.parse, self.models)}


class TenantsFile(BaseModel):
    """The whole tenants file, checked; each tier takes its view of it."""

    model_config = ConfigDict(extra="forbid")

    tenants: list[TenantConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> "TenantsFile":
        names: set[str] = set()
        owners: dict[str, str] = {}
        for tenant in self.tenants:
            if tenant.name in names:
                raise ValueError(f"tenant name {tenant.name!r} appears twice; give each tenant its own name")
            names.add(tenant.name)
            for digest in tenant.api_keys_sha256:
                if digest in owners:
                    raise ValueError(
                        f"one API key digest is listed for both {owners[digest]!r} and {tenant.name!r}; "
                        "a key belongs to one tenant"
                    )
                owners[digest] = tenant.name
        return self

    def served(self) -> list[TenantConfig]:
        """The online tier's view: the tenants with API keys (a batch-only tenant is not served)."""
        return [t for t in self.tenants if t.api_keys_sha256]

    def budgets(self) -> dict[str, Budget]:
        """The tenants that have a budget, by name."""
        return {t.name: t.budget for t in self.tenants if t.budget is not None}

    def batch_tenants(self) -> dict[str, "BatchTenant | None"]:
        """Batch jobs' view: every tenant by name, with its batch policy (None: no ``batch:`` section)."""
        return {t.name: BatchTenant(t.name, t.batch, t.custom_code) if t.batch is not None else None
                for t in self.tenants}


@dataclass(frozen=True)
class BatchTenant:
    """A tenant as batch jobs see it."""

    name: str
    policy: BatchPolicy
    custom_code: bool = False  # may run models that carry their own Python code


CUSTOM_CODE_RUNTIME = "python"
"""The runtime of bundles that carry their own Python code (``shardline.runtimes.custom``)."""


def check_custom_code(runtime: str, model: str, tenant: str | None, allowed: bool) -> None:
    """Refuse a model whose bundle carries its own code (runtime 'python') to a tenant not allowed to run it.

    ``tenant`` None is single-tenant batch development (no tenants file): allowed. Both tiers ask this
    before the model is loaded, so a refused tenant never has the code imported on its behalf.

    Raises:
        AccessDenied: naming the model, the tenant and the flag that allows it.
    """
    if runtime != CUSTOM_CODE_RUNTIME or tenant is None or allowed:
        return
    raise AccessDenied(
        f"model {model} carries its own Python code, which tenant {tenant!r} may not run (it runs inside the "
        "platform's processes); set custom_code: true for the tenant in the tenants file if you trust the code's "
        "authors, or use a model without custom code",
        tenant,
    )


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


def _field_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "the file"


UNKNOWN_NAMED = 5  # unknown fields of one place named before "and N more"


def _brief(value: Any) -> str:
    """A value as a message shows it: its repr, cut short (a long string, a deep or long list or mapping)."""
    brief = reprlib.Repr()
    brief.maxstring, brief.maxother, brief.maxlevel = 60, 60, 2
    brief.maxlist = brief.maxtuple = brief.maxdict = brief.maxset = 3
    text = brief.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validation_problems(error: ValidationError) -> str:
    """The wrong fields of a YAML file's check, briefly, as ``tenants[0].rate.burst: <what> (got <value>)``, joined
    by "; " (the tenants file's, the router's config's, the SLO file's and the controller's messages).

    Only what is wrong is said: a list left too short because its items were refused is not said again (its items
    are); the unknown fields of one place are named together, without their values (``the file: format_version,
    name, runtime, artifacts, signature and 9 more are not fields of it``); a value is cut short, and a mapping or
    list a validator refused as a whole is not echoed (its message says what is wrong)."""
    errors = error.errors()
    locs = [tuple(e["loc"]) for e in errors]
    said: list[str | tuple[Any, ...]] = []  # a problem, or the place whose unknown fields are said there
    unknown: dict[tuple[Any, ...], list[str]] = {}
    for e in errors:
        loc = tuple(e["loc"])
        if e["type"] == "too_short" and any(len(other) > len(loc) and other[:len(loc)] == loc for other in locs):
            continue
        if e["type"] == "extra_forbidden":
            if loc[:-1] not in unknown:
                said.append(loc[:-1])
            unknown.setdefault(loc[:-1], []).append(str(loc[-1]))
            continue
        whole = e["type"] in ("value_error", "assertion_error") and isinstance(e["input"], (dict, list, tuple))
        got = "" if e["type"] in ("missing", "model_type") or whole else f" (got {_brief(e['input'])})"
        said.append(f"{_field_path(loc)}: {e['msg']}{got}")
    return "; ".join(each if isinstance(each, str) else _unknown_fields(each, unknown[each]) for each in said)


def _unknown_fields(place: tuple[Any, ...], names: list[str]) -> str:
    if len(names) == 1:
        return f"{_field_path((*place, names[0]))}: Extra inputs are not permitted"
    more = len(names) - UNKNOWN_NAMED
    shown = ", ".join(names[:UNKNOWN_NAMED]) + (f" and {more} more" if more > 0 else "")
    return f"{_field_path(place)}: {shown} are not fields of it (Extra inputs are not permitted)"


def parse_tenants_file(data: Any, where: str) -> TenantsFile:
    """Check parsed YAML against the tenants format (both tiers' fields).

    Raises:
        InvalidSetting: naming every wrong field (``tenants[0].rate.burst``) and what it got.
    """
    try:
        return TenantsFile.model_validate(data)
    except ValidationError as e:
        raise InvalidSetting(
            f"the tenants file {where} is not valid: {validation_problems(e)}; see online/README.md and docs/batch.md "
            "for the format"
        ) from e


def load_tenants_file(path: str | Path) -> TenantsFile:
    """Read the tenants file (YAML, once) and check all of it; both tiers call this.

    Raises:
        InvalidSetting: the file is missing, is not YAML, or a field is wrong.
    """
    data = read_yaml(path, "the tenants file", "fix SHARDLINE_TENANTS_FILE (or SHARDLINE_ONLINE_TENANTS_FILE, or "
                     "`shardline serve --tenants PATH`), or unset it for single-tenant batch development")
    return parse_tenants_file(data, str(path))


def read_yaml(path: str | Path, what: str, fix: str) -> Any:
    """The parsed YAML of a settings file (the tenants file, the router's config).

    Raises:
        InvalidSetting: "<what> <path> cannot be read (...); <fix>", or it is not valid YAML.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise InvalidSetting(f"{what} {path} cannot be read ({e.strerror}); {fix}") from e
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise InvalidSetting(f"{what} {path} is not valid YAML: {yaml_problem(e)}") from e


def batch_tenant(tenants_file: str | None, name: str) -> BatchTenant | None:
    """The batch tenant a job runs for; None in single-tenant mode (no file).

    Raises:
        AccessDenied: a file is configured and does not list the tenant, or gives it no batch section.
    """
    if tenants_file is None:
        return None
    tenants = load_tenants_file(tenants_file).batch_tenants()
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
