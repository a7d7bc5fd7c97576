"""The ``shardline`` command (installed as ``shardline.cli``): the typer app and its entry point.

``app`` and ``main`` are imported when first used (PEP 562), not with the package: the warm batch runner
(``python -m shardline.cli.batch_runner``) and the supervised child start without the whole command's
imports.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = ["app", "main"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(import_module("shardline.cli.commands"), name)
    raise AttributeError(f"module 'shardline.cli' has no attribute {name!r}")
