"""What the CLI's command groups share: exit codes, error output, the registry from settings."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import typer

from shardline.errors import InvalidSetting, JobFailed, PrefectServerUnavailable, ShardlineError

if TYPE_CHECKING:
    from shardline.storage.registry import ModelRegistry

OFF_THE_NETWORK = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "ORT_DISABLE_TELEMETRY": "1",
    "GX_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",  # MLflow reads DO_NOT_TRACK only as "true", not "1"
}

# `batch run` and `batch resume`: every shard scored; failed (run it again to resume); the request was wrong;
# some shards quarantined, the rest scored; every shard quarantined (the data is wrong: running again cannot help).
# 4 is `drift check`'s "drift found" (cli/drift_commands.py); 130 a run stopped by Ctrl-C.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_QUARANTINED, EXIT_ALL_QUARANTINED = 0, 1, 2, 3, 5


def fail(error: BaseException | str, code: int = EXIT_USAGE) -> typer.Exit:
    """Print an error the user can act on; returns the Exit to raise."""
    typer.secho(f"error: {error}", fg="red", err=True)
    return typer.Exit(code)


ALIAS_HELP = "The alias; or write the model as name@alias."


def model_and_alias(name: str, alias: str) -> tuple[str, str]:
    """The (model name, alias) a command on an alias was given: ``NAME --alias ALIAS``, or ``NAME@ALIAS`` as every
    model reference is written (the runbooks' ``churn@prod``; ``--alias`` then left at its default, prod).

    Raises:
        typer.Exit: exit code 2 after one line: a version instead of an alias, or two different aliases.
    """
    from shardline.bundle import ModelRef, check_model_name
    from shardline.errors import InvalidSetting

    model, named, version = ModelRef.split(name)
    try:
        if version is not None:
            raise InvalidSetting(f"{name.strip()!r} names a version; this command takes an alias: give the model "
                                 f"as {model} or {model}@ALIAS")
        if named is not None and alias != "prod" and named != alias:
            raise InvalidSetting(f"{name.strip()!r} and --alias {alias} name two aliases; give one")
        chosen = named if named is not None else alias
        if not chosen:
            raise InvalidSetting(f"model reference {name.strip()!r} has an empty alias")
        return check_model_name(model), chosen
    except InvalidSetting as e:
        raise fail(e) from e


def check_output_file(path: Path | None, option: str) -> None:
    """Refuse, before any work is done or printed, a file the command was asked to write (``option``: the flag
    that named it) that could not be written: a folder, a folder that does not exist, or one this user may not
    write (``storage.fs.write_refusal``). A write that fails later still says so in one line.

    Raises:
        typer.Exit: exit code 2, after the one ``error:`` line.
    """
    if path is None:
        return
    from fsspec.implementations.local import LocalFileSystem

    from shardline.storage.fs import write_refusal

    if path.is_dir():
        raise fail(f"cannot write {str(path)!r}: it is a folder; pass a file's path to {option}")
    refused = write_refusal(LocalFileSystem(), str(path.parent))
    if refused is None and not path.parent.exists():
        raise fail(f"cannot write {str(path)!r}: the folder {path.parent} does not exist; make it or pass another "
                   f"path to {option}")
    if refused is None and path.exists() and not os.access(path, os.W_OK):
        refused = PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
    if refused is not None:
        raise fail(f"cannot write {str(path)!r} ({refused.strerror}: {refused.filename}); pass another path to "
                   f"{option}")


def open_registry(url: str | None = None) -> "ModelRegistry":
    """The registry the settings name (or ``url``), with the settings' storage options."""
    from shardline.settings import StorageSettings
    from shardline.storage.registry import ModelRegistry

    storage = StorageSettings()
    return ModelRegistry(url, storage.storage_options) if url else ModelRegistry.from_settings(storage)


def parse_tags(pairs: list[str] | None) -> dict[str, str]:
    """The ``--tag KEY=VALUE`` options as a dict."""
    tags = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ShardlineError(f"tag {pair!r} is not KEY=VALUE")
        key, value = pair.split("=", 1)
        tags[key] = value
    return tags


def unparsed_setting(error: Exception) -> InvalidSetting:
    """pydantic-settings' refusal of a variable whose value is not JSON where JSON is read (a dict, a list), which
    names the field and not the variable, as one line that names the variable(s) and what the parser said."""
    import re

    from pydantic_settings import BaseSettings

    from shardline import settings

    match = re.search(r'field "([^"]+)"', str(error))
    field = match.group(1) if match else "?"
    variables = sorted(
        f"{area.model_config.get('env_prefix', '')}{field}".upper() for area in vars(settings).values()
        if isinstance(area, type) and issubclass(area, BaseSettings) and field in area.model_fields)
    named = " or ".join(variables) or f"the variable of setting {field!r}"
    return InvalidSetting(f"a setting is not valid: {named} is not valid JSON ({error.__cause__ or error}); fix or "
                          "unset the variable (README.md, Settings)")


def exit_code(error: BaseException) -> int:
    """1 for a job a re-run resumes (some shards failed, or an unexpected fault); 2 for a request to change."""
    from pydantic_settings import SettingsError

    from shardline.storage.lease import refuses_writes

    if isinstance(error, (JobFailed, PrefectServerUnavailable)):  # a server that did not start may next time
        return EXIT_FAILED
    if isinstance(error, (ShardlineError, SettingsError)) or refuses_writes(error):  # a re-run cannot cure these
        return EXIT_USAGE
    return EXIT_FAILED


def error_line(error: BaseException) -> str:
    """The one line that tells the user what went wrong and what to do."""
    from pydantic_settings import SettingsError

    from shardline.storage.lease import refuses_writes

    if isinstance(error, SettingsError):
        return str(unparsed_setting(error))
    if refuses_writes(error) and not isinstance(error, ShardlineError):
        return (f"{type(error).__name__}: {error}; the output (or a file under it) cannot be written: make it "
                "writable or choose another --output (running again will not help)")
    return str(error)


class _UserErrorsAtDebug(logging.Filter):
    """Prefect's run loggers report a failed task or flow at ERROR, with the traceback, then repeat the
    error in their "Finished in state Failed(...)" lines. For a user error (exit 2) the CLI's one
    ``error:`` line says it all: those records are logged at DEBUG instead, traceback kept (shown with
    PREFECT_LOGGING_LEVEL=DEBUG, and in the Prefect UI's debug logs). Other Shardline errors (a failed
    job) keep their ERROR lines without the traceback."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()  # the user errors' texts, to know their repeats

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and exit_code(error) == EXIT_USAGE:
            if str(error):
                self._seen.add(str(error))
        elif error is not None:
            if isinstance(error, ShardlineError):
                record.exc_info, record.exc_text = None, None
            return True
        elif not any(text in record.getMessage() for text in self._seen):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)  # as a record logged at DEBUG would be


@contextlib.contextmanager
def one_line_user_errors() -> Iterator[None]:
    """While a flow runs here: a user error's records from Prefect's run loggers go to DEBUG (see
    ``_UserErrorsAtDebug``), so the user reads one ``error:`` line, not tracebacks."""
    quiet = _UserErrorsAtDebug()
    loggers = [logging.getLogger(name) for name in ("prefect.task_runs", "prefect.flow_runs")]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


PRICES_HELP = ("The price table (YAML): what a unit of each hardware class costs per hour, on demand and on spot "
               "(docs/cost.md, 'Prices'); default SHARDLINE_METERING_PRICES_FILE, else <home>/prices.yaml, else the "
               "example's cloud list prices.")
