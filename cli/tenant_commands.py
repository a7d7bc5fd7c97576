"""`shardline tenant ...`: add, list, rotate-key, revoke-old-keys, remove: the tenants file without writing a
key's sha256 by hand. The file is edited in place (``_tenants_file``); servers and routers read it at start."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import typer

from shardline.cli.common import fail
from shardline.errors import InvalidSetting, ShardlineError

tenant_app = typer.Typer(help="Tenants: API keys, models, priority and quotas in the tenants file.",
                         no_args_is_help=True)

FILE = typer.Option(None, "--file", help="The tenants YAML \\[default: SHARDLINE_TENANTS_FILE, else "
                    "SHARDLINE_ONLINE_TENANTS_FILE, else ./tenants.yaml].")
NAME = typer.Argument(..., help="Tenant name (letters, digits, '.', '_', '-'; shown in metrics and logs).")
RESTART = "Restart the `shardline serve` and `shardline router` processes that read the file (they read it at start)"

# The file's fields as the options of `tenant add` name them (for its error messages).
_OPTIONS = {"name": "NAME", "models": "--models", "priority": "--priority", "rate": "--rate/--burst",
            "max_concurrent": "--max-concurrent", "tokens_per_minute": "--tokens-per-minute",
            "max_streams": "--max-streams", "batch": "--storage-prefix", "custom_code": "--custom-code"}


def _print_key(key: str, note: str) -> None:
    """The key alone on stdout (`KEY=$(shardline tenant add ...)`), what happened on stderr."""
    typer.echo(note, err=True)
    typer.echo(key)


def _split(values: list[str] | None) -> list[str]:
    """Repeated options, each maybe a comma-separated list: one value each."""
    return [part.strip() for value in values or [] for part in value.split(",") if part.strip()]


def _new_tenant(name: str, digest: str, fields: dict[str, Any]) -> Any:
    """The new entry, checked field by field; an error names the option that was wrong.

    Raises:
        InvalidSetting: every wrong option, with what it got.
    """
    from pydantic import ValidationError

    from shardline.tenants import TenantConfig

    try:
        return TenantConfig.model_validate({"name": name, "api_keys_sha256": [digest], **fields})
    except ValidationError as e:
        problems = []
        for error in e.errors():
            field = str(error["loc"][0]) if error["loc"] else "models"
            message = str(error["msg"]).removeprefix("Value error, ")
            problems.append(f"{_OPTIONS.get(field, field)}: {message}" +
                            (f" (got {error['input']!r})" if field == "name" else ""))
        raise InvalidSetting(f"tenant {name!r} cannot be added: {'; '.join(problems)}") from e


@tenant_app.command("add")
def tenant_add(
    name: str = NAME,
    models: list[str] = typer.Option(..., "--models", help="Model references the tenant may call, name@alias or "
                                     "name:version, one per model: comma-separated or the option repeated."),
    priority: Optional[str] = typer.Option(None, help="high, normal or low: who is shed first under overload "
                                           "(low) \\[default: normal]."),
    rate: Optional[float] = typer.Option(None, min=0, help="Requests per second on average; none: no rate limit."),
    burst: Optional[int] = typer.Option(None, min=1, help="With --rate: requests at once after a quiet spell "
                                        "\\[default: the rate, rounded up]."),
    max_concurrent: Optional[int] = typer.Option(None, min=1, help="Requests in flight at most; none: unlimited."),
    tokens_per_minute: Optional[int] = typer.Option(None, min=1, help="LLM prompt and completion tokens per "
                                                    "minute; none: unlimited."),
    max_streams: Optional[int] = typer.Option(None, min=1, help="LLM generations in flight at most; none: "
                                              "unlimited."),
    custom_code: bool = typer.Option(False, "--custom-code", help="Let the tenant call models that carry their "
                                     "own Python code (it runs inside the platform's processes)."),
    storage_prefix: Optional[list[str]] = typer.Option(None, help="For batch jobs: a folder or URL prefix the "
                                                       "tenant's jobs may read and write under; repeat. Adds a "
                                                       "batch: section (docs/batch.md)."),
    file: Optional[Path] = FILE,
) -> None:
    """Add a tenant with a new API key: the key is printed once, to stdout, and only its sha256 is written.

    The tenants file is created if there is none. Other tenants' entries and comments are kept as they
    are; the whole file is checked as the servers check it before it is written, and written whole.
    Then give the key to the tenant (`Authorization: Bearer KEY`) and restart the servers and routers
    that read the file.
    """
    from shardline.cli.tenants_file import append_entry, edit, new_api_key, tenants_path
    from shardline.tenants import hash_api_key

    path = tenants_path(file)
    key = new_api_key()
    fields: dict[str, Any] = {"models": _split(models)}
    if not fields["models"]:
        raise fail("give --models: the model references the tenant may call, e.g. --models churn@prod")
    optional = {"priority": priority, "max_concurrent": max_concurrent, "tokens_per_minute": tokens_per_minute,
                "max_streams": max_streams}
    fields.update({k: v for k, v in optional.items() if v is not None})
    if custom_code:
        fields["custom_code"] = True
    if burst is not None and rate is None:
        raise fail("--burst goes with --rate (requests per second); give both, or neither for no rate limit")
    if rate is not None:
        fields["rate"] = {"requests_per_second": int(rate) if rate.is_integer() else rate,
                          "burst": burst or max(1, math.ceil(rate))}
    if storage_prefix:
        fields["batch"] = {"storage_prefixes": storage_prefix}

    try:
        tenant = _new_tenant(name, hash_api_key(key), fields)
        edit(path, lambda document: append_entry(document, tenant), create=True)
    except ShardlineError as e:
        raise fail(e) from e
    _print_key(key, f"added tenant {name!r} to {path}; its API key (stdout) is shown this once: only its sha256 "
               f"is kept. {RESTART}.")


def _quotas(tenant: Any) -> str:
    parts = []
    if tenant.rate is not None:
        parts.append(f"{tenant.rate.requests_per_second:g}/s (burst {tenant.rate.burst})")
    for label, value in (("in flight", tenant.max_concurrent), ("tokens/min", tenant.tokens_per_minute),
                         ("streams", tenant.max_streams)):
        if value is not None:
            parts.append(f"{value} {label}")
    return ", ".join(parts) or "none"


@tenant_app.command("list")
def tenant_list(
    file: Optional[Path] = FILE,
    json_out: bool = typer.Option(False, "--json", help="Print the tenants as JSON (keys counted, never shown)."),
) -> None:
    """The tenants of the file: name, priority, models, quotas, how many keys (never the keys or digests)."""
    from shardline.cli.tenants_file import tenants_path
    from shardline.tenants import load_tenants_file

    path = tenants_path(file)
    try:
        if not path.exists():
            raise InvalidSetting(f"there is no tenants file {path}; add a tenant first (`shardline tenant add NAME "
                                 "--models MODEL@ALIAS`), or give the file with --file")
        tenants = load_tenants_file(path).tenants
    except ShardlineError as e:
        raise fail(e) from e
    if json_out:
        shown = [{**t.model_dump(mode="json", exclude={"api_keys_sha256"}), "api_keys": len(t.api_keys_sha256)}
                 for t in tenants]
        typer.echo(json.dumps(shown, indent=2))
        return
    rows = [("tenant", "keys", "priority", "quotas", "models", "batch prefixes")]
    for t in tenants:
        rows.append((t.name, str(len(t.api_keys_sha256)), t.priority + (", custom code" if t.custom_code else ""),
                     _quotas(t), ", ".join(t.models) or "-",
                     ", ".join(t.batch.storage_prefixes) if t.batch is not None else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        typer.secho("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip(), bold=i == 0)


@tenant_app.command("rotate-key")
def tenant_rotate_key(
    name: str = NAME,
    keep_old: bool = typer.Option(False, "--keep-old", help="Keep the old key(s) working beside the new one, "
                                  "until `shardline tenant revoke-old-keys NAME` (a rotation without downtime)."),
    file: Optional[Path] = FILE,
) -> None:
    """Give a tenant a new API key, printed once to stdout; its old keys stop working (unless --keep-old)."""
    from shardline.cli.tenants_file import edit, find, new_api_key, quoted, tenants_path
    from shardline.tenants import hash_api_key

    path = tenants_path(file)
    key = new_api_key()

    def rotate(document: Any) -> int:
        _, entry = find(document, name)
        if not entry.get("models"):
            raise InvalidSetting(f"tenant {name!r} calls no models (a batch-only tenant needs no key); list the "
                                 f"models it may call under its models: in {path} first")
        keys = entry.get("api_keys_sha256")
        if keys is None:
            from shardline.cli.tenants_file import flow_list

            keys = entry["api_keys_sha256"] = flow_list([])
        old = len(keys)
        if not keep_old:
            keys.clear()  # in place: the list keeps its style and the comment after it
        keys.append(quoted(hash_api_key(key)))
        return old

    try:
        old = edit(path, rotate)
    except ShardlineError as e:
        raise fail(e) from e
    kept = (f"its {old} old key(s) keep working until `shardline tenant revoke-old-keys {name}`" if keep_old
            else f"its {old} old key(s) are removed")
    _print_key(key, f"tenant {name!r} in {path}: its new API key (stdout) is shown this once; {kept}. {RESTART}.")


@tenant_app.command("revoke-old-keys")
def tenant_revoke_old_keys(name: str = NAME, file: Optional[Path] = FILE) -> None:
    """Keep only a tenant's newest API key (the last `rotate-key --keep-old` made): the others stop working."""
    from shardline.cli.tenants_file import edit, find, pull_comment, tenants_path

    path = tenants_path(file)

    def revoke(document: Any) -> int:
        _, entry = find(document, name)
        keys = entry.get("api_keys_sha256") or []
        if len(keys) < 2:
            raise InvalidSetting(f"tenant {name!r} has {len(keys)} API key(s) in {path}, no old one to revoke; "
                                 f"`shardline tenant rotate-key {name}` replaces its key")
        newest = keys[-1]
        revoked = len(keys) - 1
        keys.clear()
        keys.append(newest)
        pull_comment(entry, "api_keys_sha256")
        return revoked

    try:
        revoked = edit(path, revoke)
    except ShardlineError as e:
        raise fail(e) from e
    typer.echo(f"tenant {name!r} in {path}: {revoked} old key(s) revoked, its newest kept. {RESTART}.")


@tenant_app.command("remove")
def tenant_remove(name: str = NAME, file: Optional[Path] = FILE) -> None:
    """Remove a tenant from the file: its keys stop working and its batch jobs are refused."""
    from shardline.cli.tenants_file import edit, find, remove_entry, tenants_path

    path = tenants_path(file)

    def remove(document: Any) -> None:
        index, _ = find(document, name)
        if len(document.entries) == 1:
            raise InvalidSetting(f"{name!r} is the only tenant in {path}, and a tenants file lists at least one; "
                                 "add another first, or delete the file")
        remove_entry(document, index)

    try:
        edit(path, remove)
    except ShardlineError as e:
        raise fail(e) from e
    typer.echo(f"removed tenant {name!r} from {path}. {RESTART}.")
