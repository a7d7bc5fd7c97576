"""How flows and tasks emit Shardline's Prefect events: one ``emit``, through Prefect's ``emit_event``.

The names, resources and payloads are the catalogue's (``shardline.event_catalog``); an event it does not
hold is refused here, before anything is sent. Inside a flow run the event goes to the API the run reports to.
(The router and the CLI, which never import Prefect, post the same catalogue's events over plain HTTP:
``shardline.events``.)
"""

from __future__ import annotations

from typing import Any

from prefect.events import emit_event

from shardline.event_catalog import CATALOG, model_event


def emit(event: str, resource: dict[str, str], payload: dict[str, Any],
         related: list[dict[str, str]] | None = None) -> None:
    """Emit one catalogued event about ``resource`` with ``payload`` (and ``related`` resources).

    Raises:
        KeyError: ``event`` is not in the catalogue (a programming error: catalogue it first).
    """
    if event not in CATALOG:
        raise KeyError(f"{event!r} is not an event of shardline.event_catalog; add it there before emitting it")
    emit_event(event=event, resource=resource, payload=payload, related=related)


def emit_model_event(event: str, name: str, version: int | None, alias: str | None, payload: dict[str, Any]) -> None:
    """Emit an event about a model: resource and payload from ``shardline.event_catalog.model_event`` (the
    resource ``shardline.model.<name>`` with its labels; the payload repeats name, version, alias and reference)."""
    emit(event, *model_event(name, version, alias, payload))
