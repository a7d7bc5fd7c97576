"""Shardline: batch-first ML inference. The kernel: bundles, signatures, runtimes, errors, settings."""

from shardline.bundle import Manifest, ModelRef
from shardline.errors import ShardlineError
from shardline.signature import ColumnSpec, Signature

__version__ = "0.1.0"
__all__ = ["ColumnSpec", "Manifest", "ModelRef", "ShardlineError", "Signature", "__version__"]
