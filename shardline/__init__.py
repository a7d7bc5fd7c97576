"""Shardline: batch-first ML inference. The kernel: bundles, signatures, runtimes, errors, settings.

The names below are imported when first used (PEP 562), not with the package: a command that
needs none of them (``shardline batch run`` handing its job to the warm runner) starts without
pyarrow, numpy and pydantic.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardline.bundle import Manifest, ModelRef
    from shardline.errors import ShardlineError
    from shardline.signature import ColumnSpec, Signature

__version__ = "0.1.0"
__all__ = ["ColumnSpec", "Manifest", "ModelRef", "ShardlineError", "Signature", "__version__"]
_HOMES = {"Manifest": "bundle", "ModelRef": "bundle", "ShardlineError": "errors", "ColumnSpec": "signature",
          "Signature": "signature"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(import_module(f"shardline.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'shardline' has no attribute {name!r}")
