"""Each protocol's error form, framework-free: the servers' adapters and the router answer errors alike."""

from __future__ import annotations

import re
from typing import Any

_OPENAI_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
    413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error", 501: "not_implemented",
    503: "overloaded_error",
}
_FIELD = re.compile(r"\bfield '([A-Za-z_][\w.\[\]]*)'")
_OPENAI_CODES = {401: "invalid_api_key", 404: "model_not_found", 429: "rate_limit_exceeded", 503: "overloaded"}


def v2_error_body(message: str, status: int) -> dict[str, Any]:
    """The Open Inference Protocol's error form."""
    return {"error": message}


def openai_error_body(message: str, status: int) -> dict[str, Any]:
    """OpenAI's error form; ``param`` is the request field a 400's message names first (``field 'x'``)."""
    named = _FIELD.search(message) if status == 400 else None
    return {"error": {"message": message, "type": _OPENAI_TYPES.get(status, "server_error"),
                      "param": named.group(1) if named else None, "code": _OPENAI_CODES.get(status)}}
