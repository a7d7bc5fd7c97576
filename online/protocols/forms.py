"""Each protocol's error form, framework-free: the servers' adapters and the router answer errors alike.

Both take ``(message, status, code, param)``; ``code`` and ``param`` are the error's own (``ShardlineError.code``,
``.param``), which only OpenAI's form carries. OpenAI's is ``shardline.openai_wire.error_object``, the one the batch tier's OpenAI
files write too.
"""

from __future__ import annotations

from typing import Any

from shardline.openai_wire import error_object as openai_error_body


def v2_error_body(message: str, status: int, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """The Open Inference Protocol's error form (a message only)."""
    return {"error": message}


def openai_form(path: str) -> bool:
    """Whether errors on ``path`` take OpenAI's form: every path under ``/v1/`` but KServe V1's predict paths
    (``/v1/models/{name}:predict``), whose clients read ``{"error": "..."}`` as V2's do."""
    return path.startswith("/v1/") and not path.endswith(":predict")


__all__ = ["openai_error_body", "openai_form", "v2_error_body"]
