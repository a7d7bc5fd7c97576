"""Prefect events from the router (``shardline.rollout.*``), for the automations in ``prefect.yaml``.

Which API and how they are posted: ``shardline.events`` (plain HTTP, no Prefect import). The router
posts from a worker thread, so a slow API never holds up a request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from shardline.event_catalog import model_event
from shardline.events import post_event, prefect_api_url

log = logging.getLogger(__name__)


class RouterEvents:
    """Emit an event about ``shardline.model.<name>`` (``shardline.event_catalog.model_event``: the version is the
    payload's), or log it when no API is known."""

    def __init__(self, home: str) -> None:
        self._home = home
        self._api: str | None | bool = False  # False: not looked for yet

    def __call__(self, event: str, name: str, alias: str, payload: dict[str, Any]) -> None:
        asyncio.get_running_loop().run_in_executor(None, self.emit, event, name, alias, payload)

    def emit(self, event: str, name: str, alias: str, payload: dict[str, Any]) -> None:
        """Post the event now (blocking); never raises."""
        log.info("event %s on %s@%s: %s", event, name, alias, payload.get("reason", ""))
        if self._api is False:
            self._api = prefect_api_url(self._home)
            if self._api is None:
                log.warning("no Prefect API (no PREFECT_API_URL, no local Prefect server for this home): "
                            "rollout events are only logged")
        if self._api:
            post_event(str(self._api), event, *model_event(name, payload.get("version"), alias, payload))
