"""Prefect events from the router (``shardline.rollout.*``), for the automations in ``prefect.yaml``.

Which Prefect API: ``PREFECT_API_URL`` (the environment, else the active profile of Prefect's
profiles file), else the home's local Prefect server when one runs (``shardline/_prefect_server.py``;
the router never starts one). With none, the event is only logged.

The event is posted to the API's ``POST /events`` (the batch endpoint Prefect's server offers
beside its websocket) from a worker thread. The router does not import Prefect: its import costs
seconds of CPU that would hold up requests, and it is not needed to write one JSON document.
``PREFECT_API_KEY``, when set, is sent as the bearer token (Prefect Cloud).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tomllib
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger(__name__)
POST_TIMEOUT_S = 10.0


def prefect_api_url(home: str) -> str | None:
    """The Prefect API events go to (see the module docstring), or None."""
    url = os.environ.get("PREFECT_API_URL")
    if url:
        return url
    prefect_home = Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect"))
    profiles = Path(os.environ.get("PREFECT_PROFILES_PATH", prefect_home / "profiles.toml"))
    try:
        parsed = tomllib.loads(profiles.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        parsed = {}
    active = os.environ.get("PREFECT_PROFILE") or parsed.get("active")
    url = parsed.get("profiles", {}).get(active, {}).get("PREFECT_API_URL") if active else None
    if url:
        return str(url)
    from shardline._prefect_server import find

    server = find(home)
    return server.api_url if server is not None else None


class RouterEvents:
    """Emit an event about ``shardline.model.<name>`` (with ``shardline.alias``), or log it when no API is known."""

    def __init__(self, home: str) -> None:
        self._home = home
        self._api: str | None | bool = False  # False: not looked for yet

    def __call__(self, event: str, name: str, alias: str, payload: dict[str, Any]) -> None:
        asyncio.get_running_loop().run_in_executor(None, self.emit, event, name, alias, payload)

    def emit(self, event: str, name: str, alias: str, payload: dict[str, Any]) -> None:
        """Post the event now (blocking); never raises."""
        import httpx

        log.info("event %s on %s@%s: %s", event, name, alias, payload.get("reason", ""))
        try:
            if self._api is False:
                self._api = prefect_api_url(self._home)
                if self._api is None:
                    log.warning("no Prefect API (no PREFECT_API_URL, no local Prefect server for this home): "
                                "rollout events are only logged")
            if not self._api:
                return
            document = [{
                "id": str(uuid.uuid4()), "occurred": datetime.now(timezone.utc).isoformat(), "event": event,
                "resource": {"prefect.resource.id": f"shardline.model.{name}", "shardline.alias": alias},
                "related": [], "payload": payload,
            }]
            headers = {"content-type": "application/json"}
            key = os.environ.get("PREFECT_API_KEY")
            if key:
                headers["authorization"] = f"Bearer {key}"
            answer = httpx.post(f"{str(self._api).rstrip('/')}/events", content=orjson.dumps(document, default=str),
                                headers=headers, timeout=POST_TIMEOUT_S)
            if answer.status_code >= 300:
                log.warning("the Prefect API refused %s: %s %s", event, answer.status_code, answer.text[:200])
        except Exception as e:  # noqa: BLE001 - an event is a notice; the rollout's record is in the registry
            log.warning("could not emit %s: %s: %s", event, type(e).__name__, e)
