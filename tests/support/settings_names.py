"""Every ``SHARDLINE_*`` environment name the settings package reads, for tests that check files naming them
(deploy specs, manifests, Dockerfiles)."""

from __future__ import annotations

import re

from pydantic import AliasChoices
from pydantic_settings import BaseSettings

from shardline import settings as settings_module

# whole names only: SHARDLINE_STORAGE_* is a family, not a setting
SETTING_NAME = re.compile(r"\bSHARDLINE_[A-Z0-9_]*[A-Z0-9]\b")


def known_settings() -> set[str]:
    """The env names of every settings class's fields (prefix + field) and their alias choices."""
    names = set()
    for value in vars(settings_module).values():
        if isinstance(value, type) and issubclass(value, BaseSettings) and value is not BaseSettings:
            prefix = str(value.model_config.get("env_prefix", "")).upper()
            for field_name, field in value.model_fields.items():
                names.add(f"{prefix}{field_name.upper()}")
                if isinstance(field.validation_alias, AliasChoices):
                    names |= {c.upper() for c in field.validation_alias.choices if isinstance(c, str)}
    return names


def unknown_settings(text: str) -> set[str]:
    """The ``SHARDLINE_*`` names in ``text`` that are no setting."""
    return set(SETTING_NAME.findall(text)) - known_settings()
