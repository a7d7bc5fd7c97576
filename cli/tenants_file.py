"""Editing the tenants file for `shardline tenant ...`: add a tenant with a new key, rotate or revoke its keys,
remove it. Nothing but the CLI imports this.

The file is edited as round-trip YAML (ruamel.yaml, which Prefect already installs): the other tenants'
entries, their order, quoting and comments stay as they were, so a file kept under review by hand can also
be edited by the command (removing a tenant removes its lines and the comment lines right above it). What is
written is checked first by the one loader's check (``shardline.tenants.parse_tenants_file``, on the text as
``load_tenants_file`` reads it), then written whole: a temporary file beside it, renamed over it (through a
symbolic link to its target), with the file's own permissions. If the file changed while the command ran,
nothing is written and the command says to run it again.

API keys are made here (``new_api_key``), shown once by the caller, and only their sha256 is stored.
"""

from __future__ import annotations

import io
import os
import re
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import yaml

from shardline.errors import InvalidSetting, yaml_problem
from shardline.tenants import TenantConfig, parse_tenants_file

T = TypeVar("T")
DEFAULT_FILE = "tenants.yaml"
KEY_PREFIX = "sk-"
_HEADER = ("# Shardline tenants: API key digests, models, priority and quotas (online/README.md; batch: sections,\n"
           "# docs/batch.md). Written by `shardline tenant ...`, which keeps hand edits and comments.\n")
_ITEM = re.compile(r"^( *)- ", re.MULTILINE)


def new_api_key() -> str:
    """A new API key: ``sk-`` and 256 random bits, URL-safe (what a tenant puts in ``Authorization: Bearer``)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def tenants_path(given: Path | None) -> Path:
    """The tenants file a command edits: ``--file``, else SHARDLINE_TENANTS_FILE (or SHARDLINE_ONLINE_TENANTS_FILE,
    as both tiers read it), else ./tenants.yaml."""
    if given is not None:
        return given
    from shardline.settings import TenancySettings

    configured = TenancySettings().tenants_file
    return Path(configured) if configured else Path(DEFAULT_FILE)


@dataclass
class _Document:
    """The file as read: its text (None: no file yet) and its round-trip YAML."""

    path: Path
    text: str | None
    data: Any  # ruamel's CommentedMap with a "tenants" list
    prefix: str = ""  # written above the YAML: a new file's header, or the comments of a file that held only those
    rewritten: str | None = None  # the new text, when a change edited the text itself (``remove_entry``)

    @property
    def entries(self) -> Any:
        """The ``tenants:`` list (ruamel's CommentedSeq)."""
        return self.data["tenants"]


def _round_trip(text: str | None) -> Any:
    from ruamel.yaml import YAML

    handler = YAML()
    handler.preserve_quotes = True
    handler.width = 4096  # a flow list of digests stays on its line
    offset = 2  # the documented layout: "  - name: ..." under "tenants:"
    if text:
        item = _ITEM.search(text)
        offset = len(item.group(1)) if item else offset
    handler.indent(mapping=2, sequence=offset + 2, offset=offset)
    return handler


def read_document(path: Path, create: bool = False) -> _Document:
    """The tenants file as round-trip YAML; with ``create``, an empty one when there is no file yet.

    Raises:
        InvalidSetting: no file (and not ``create``), unreadable, not YAML, or without a ``tenants:`` list.
    """
    try:
        text: str | None = path.read_text()
    except FileNotFoundError:
        if not create:
            raise InvalidSetting(f"there is no tenants file {path}; add a tenant first (`shardline tenant add NAME "
                                 f"--models MODEL@ALIAS --file {path}`), or give the file with --file") from None
        text = None
    except OSError as e:
        raise InvalidSetting(f"the tenants file {path} cannot be read ({e.strerror}); fix its permissions or give "
                             "another with --file") from e
    from ruamel.yaml.comments import CommentedMap, CommentedSeq
    from ruamel.yaml.error import YAMLError

    try:
        data = _round_trip(text).load(text) if text else None
    except YAMLError as e:
        raise InvalidSetting(f"the tenants file {path} is not valid YAML: {yaml_problem(e)}; fix it by hand, then run "
                             "the command again") from e
    prefix = ""
    if data is None:  # no file yet (a new one starts with a header), or only comments (kept above the list)
        data = CommentedMap()
        prefix = _HEADER if text is None else text if text.endswith("\n") or not text.strip() else text + "\n"
    if not isinstance(data, CommentedMap) or not isinstance(data.get("tenants"), (CommentedSeq, type(None))):
        raise InvalidSetting(f"the tenants file {path} is not a mapping with a 'tenants:' list; fix it by hand "
                             "(online/README.md shows the format), or give another with --file")
    if data.get("tenants") is None:
        data["tenants"] = CommentedSeq()
    return _Document(path, text, data, prefix.lstrip("\n") if prefix.strip() else "")


def dump(document: _Document) -> str:
    """The document's YAML text."""
    if document.rewritten is not None:
        return document.rewritten
    out = io.StringIO()
    _round_trip(document.text).dump(document.data, out)
    return document.prefix + out.getvalue()


def edit(path: Path, change: Callable[[_Document], T], create: bool = False) -> T:
    """Read the file, apply ``change`` to it, check the result with the loader, and write it atomically.

    Raises:
        InvalidSetting: the file cannot be read or written, the result is not a valid tenants file, or the
            file changed while the command ran (nothing is written then).
    """
    document = read_document(path, create)
    result = change(document)
    text = dump(document)
    parse_tenants_file(yaml.safe_load(text), str(path))
    _replace(path, text, document.text)
    return result


def _replace(path: Path, text: str, was: str | None) -> None:
    """Write ``text`` to ``path`` whole (a temporary file beside it, renamed over it), keeping its permissions;
    refused when the file is no longer ``was`` (another command or person changed it meanwhile)."""
    target = path.resolve() if path.is_symlink() else path
    folder = target.parent if str(target.parent) else Path(".")
    try:
        mode = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, staged = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    except OSError as e:
        raise InvalidSetting(f"the tenants file {path} cannot be written ({e.strerror}); fix the permissions of "
                             f"{folder}, or give another file with --file") from e
    try:
        with os.fdopen(handle, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(staged, mode)
        now = target.read_text() if target.exists() else None
        if now != was:
            raise InvalidSetting(f"the tenants file {path} changed while this command ran; nothing was written: "
                                 "run the command again")
        os.replace(staged, target)
    except BaseException:
        Path(staged).unlink(missing_ok=True)
        raise


def _index(document: _Document, name: str) -> int | None:
    return next((i for i, entry in enumerate(document.entries) if isinstance(entry, dict) and entry.get("name") == name),
                None)


def find(document: _Document, name: str) -> tuple[int, Any]:
    """The position and entry of tenant ``name``.

    Raises:
        InvalidSetting: no such tenant (naming those there are).
    """
    index = _index(document, name)
    if index is not None:
        return index, document.entries[index]
    known = ", ".join(str(e.get("name")) for e in document.entries if isinstance(e, dict)) or "none"
    raise InvalidSetting(f"there is no tenant {name!r} in {document.path} (tenants: {known}); `shardline tenant "
                         "list` shows them")


def remove_entry(document: _Document, index: int) -> None:
    """Remove the tenant at ``index``: its lines and the comment lines right above it, every other line kept as
    it was (ruamel would keep a comment with the node before it: the one above a removed tenant would stay,
    and the one above the next tenant would go)."""
    entries = document.entries
    if document.text is None or entries.fa.flow_style():  # a list on one line: ruamel rewrites it
        del entries[index]
        return
    lines = document.text.splitlines(keepends=True)

    def dash(i: int) -> int:  # the line of the item's "-"
        line, column = entries.lc.item(i)
        while line > 0 and not (lines[line].lstrip().startswith("-") and _indent(lines[line]) < column):
            line -= 1
        return line

    def above_comments(line: int, blank_too: bool = False) -> int:
        while line > 0 and (lines[line - 1].lstrip().startswith("#") or blank_too and not lines[line - 1].strip()):
            line -= 1
        return line

    start = above_comments(dash(index))
    end = above_comments(dash(index + 1) if index + 1 < len(entries) else len(lines), blank_too=index + 1 == len(entries))
    document.rewritten = "".join(lines[:start] + lines[end:])


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def pull_comment(entry: Any, key: str) -> None:
    """Bring the comment at the end of ``key``'s line back to 3 spaces after a shortened one-line list (a list
    that once grew pushed it right, and ruamel keeps a comment's column)."""
    comment = entry.ca.items.get(key, [None, None, None])[2]
    value = entry.get(key)
    if comment is None or not hasattr(value, "fa") or not value.fa.flow_style():
        return
    width = entry.lc.key(key)[1] + len(key) + 2 + len("[" + ", ".join(f'"{v}"' for v in value) + "]")
    comment.column = min(comment.column, width + 3)


def quoted(value: str) -> Any:
    """A string written double-quoted, so that every YAML reader reads it as the same string ("no", "0123")."""
    from ruamel.yaml.scalarstring import DoubleQuotedScalarString

    return DoubleQuotedScalarString(value)


def flow_list(values: list[Any]) -> Any:
    """A list written on one line: ``["a", "b"]``."""
    from ruamel.yaml.comments import CommentedSeq

    seq = CommentedSeq(values)
    seq.fa.set_flow_style()
    return seq


def append_entry(document: _Document, tenant: TenantConfig) -> None:
    """Add a new tenant's entry at the end of the list.

    Raises:
        InvalidSetting: the file has a tenant of that name already.
    """
    if _index(document, tenant.name) is not None:
        raise InvalidSetting(f"tenant {tenant.name!r} is in {document.path} already; give it a new key with `shardline "
                             f"tenant rotate-key {tenant.name}`, or remove it first (`shardline tenant remove "
                             f"{tenant.name}`)")
    document.entries.append(_entry_of(tenant))


def _entry_of(tenant: TenantConfig) -> Any:
    """A tenant as a new entry of the file: the fields it sets, in the documented order, strings quoted."""
    from ruamel.yaml.comments import CommentedMap

    entry = CommentedMap()
    entry["name"] = quoted(tenant.name)
    entry["api_keys_sha256"] = flow_list([quoted(d) for d in tenant.api_keys_sha256])
    entry["models"] = flow_list([quoted(m) for m in tenant.models])
    fields = tenant.model_dump(exclude_unset=True, exclude={"name", "api_keys_sha256", "models", "rate", "batch"})
    if "priority" in fields:
        entry["priority"] = fields.pop("priority")
    if tenant.rate is not None:
        rate = CommentedMap(requests_per_second=tenant.rate.requests_per_second, burst=tenant.rate.burst)
        rate.fa.set_flow_style()
        entry["rate"] = rate
    entry.update(fields)
    if tenant.batch is not None:
        batch = CommentedMap()
        batch["storage_prefixes"] = flow_list([quoted(p) for p in tenant.batch.storage_prefixes])
        entry["batch"] = batch
    return entry
