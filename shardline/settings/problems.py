"""A settings class's refusal as one line, for every entry point that reads settings (the CLI, a flow)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from shardline.errors import InvalidSetting

if TYPE_CHECKING:
    from pydantic import ValidationError


def settings_error(error: ValidationError, options: Mapping[str, str] | None = None,
                   fix_option: str = "fix the option") -> InvalidSetting:
    """A settings class's refusal as one line: each variable (or, for a field in ``options``, what gave its value:
    field -> a command's ``--name``, a flow's parameter), what is wrong (the range it must be in), what it got,
    and what to do (``fix_option`` for a field in ``options``)."""
    from pydantic_settings import BaseSettings

    from shardline import settings

    area = getattr(settings, error.title, None)
    prefix = str(area.model_config.get("env_prefix", "")) if isinstance(area, type) and issubclass(
        area, BaseSettings) else ""
    options = options or {}
    problems, named = [], set()
    for e in error.errors():
        field = "_".join(str(p) for p in e["loc"])
        name = options.get(field) or f"{prefix}{field.upper()}"
        named.add("option" if field in options else "variable")
        problems.append(f"{name}: {e['msg']}" + (f" (got {e['input']!r})" if e["type"] != "missing" else ""))
    todo = {"option": fix_option, "variable": "fix or unset the variable (README.md, Settings)"}
    return InvalidSetting(f"a setting is not valid: {'; '.join(problems)}; "
                          f"{'; '.join(todo[kind] for kind in sorted(named)) or todo['variable']}")
