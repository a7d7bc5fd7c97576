"""The ``x-shardline-*`` headers (and the request id): the contract between clients, the router (nginx in front
of it too), and its replicas, one name each. Lower case, as ASGI and httptools hand them over; a module that
compares raw header bytes keeps its own ``.encode()`` of the name."""

from __future__ import annotations

# Sent by the router to a replica (a client's copy is dropped, never believed).
TENANT_HEADER = "x-shardline-tenant"  # the tenant the router authenticated (with the router's key)
GATED_HEADER = "x-shardline-gated"  # set by the data plane: the tenant whose quotas it held already
TIMEOUT_HEADER = "x-shardline-timeout-ms"  # what is left of a request's time, in milliseconds (a client may send it)
VARIANT_HEADER = "x-shardline-variant"  # a request for a version's precision variant (a router's fallback)
# Sent by a client.
ROUTE_KEY_HEADER = "x-shardline-route-key"  # optional: requests with the same key go to the same replica
REQUEST_ID_HEADER = "x-request-id"  # echoed (or made) on every answer, in every log line
# On an answer.
FALLBACK_HEADER = "x-shardline-fallback"  # from a fallback variant: name:version#variant
PROMPT_TOKENS_HEADER = "x-shardline-prompt-tokens"  # on a streamed answer: the prompt's size (the router meters it)
BUDGET_HEADER = "x-shardline-budget"  # warn or soft: the tenant is past that threshold of its budget (docs/cost.md)

__all__ = ["BUDGET_HEADER", "FALLBACK_HEADER", "GATED_HEADER", "PROMPT_TOKENS_HEADER", "REQUEST_ID_HEADER", "ROUTE_KEY_HEADER",
           "TENANT_HEADER", "TIMEOUT_HEADER", "VARIANT_HEADER"]
