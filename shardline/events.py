"""Prefect events posted over plain HTTP, for the automations in ``prefect.yaml``.

Which Prefect API: ``PREFECT_API_URL`` (the environment, else the active profile of Prefect's
profiles file), else the home's local Prefect server when one runs (``shardline.local_prefect``;
nothing here starts one). With none, an event is only logged.

An event is posted to the API's ``POST /events`` (the batch endpoint Prefect's server offers beside
its websocket). Prefect is not imported: its import costs seconds of CPU (the router would hold up
requests for it, a CLI command would wait) and it is not needed to write one JSON document.
``PREFECT_API_KEY``, when set, is sent as the bearer token (Prefect Cloud).

The names, resources and payloads are the catalogue's (``shardline.event_catalog``); flows and tasks emit
through Prefect (``shardline.tasks.events``). Who posts here: the router (``shardline.rollout.*``, ``online/router/events.py``) and the registry's
commands (``shardline.model.pushed`` from ``shardline model push`` and ``model import``, and from the
``mlflow-watch`` flow for each version it imports).
"""

from __future__ import annotations

import logging
import os
import tomllib
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson

from shardline.event_catalog import CATALOG, MODEL_PUSHED, model_event

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
    from shardline.local_prefect import find

    server = find(home)
    return server.api_url if server is not None else None


def post_event(api_url: str, event: str, resource: dict[str, str], payload: dict[str, Any]) -> bool:
    """Post one event of the catalogue to a Prefect API now (blocking); never raises (an event the catalogue does
    not hold is logged and not sent). Returns whether the API took it."""
    import httpx

    if event not in CATALOG:
        log.error("not sent: %r is not an event of shardline.event_catalog; add it there first", event)
        return False

    document = [{
        "id": str(uuid.uuid4()), "occurred": datetime.now(timezone.utc).isoformat(), "event": event,
        "resource": resource, "related": [], "payload": payload,
    }]
    headers = {"content-type": "application/json"}
    key = os.environ.get("PREFECT_API_KEY")
    if key:
        headers["authorization"] = f"Bearer {key}"
    try:
        answer = httpx.post(f"{api_url.rstrip('/')}/events", content=orjson.dumps(document, default=str),
                            headers=headers, timeout=POST_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - an event is a notice; what it tells of is recorded elsewhere
        log.warning("could not emit %s: %s: %s", event, type(e).__name__, e)
        return False
    if answer.status_code >= 300:
        log.warning("the Prefect API refused %s: %s %s", event, answer.status_code, answer.text[:200])
        return False
    return True


def announce_push(home: str, name: str, version: int, digest: str, source: str,
                  api_url: str | None = None) -> str | None:
    """Emit ``shardline.model.pushed`` for a new version (prefect.yaml's ``promote-on-push`` answers it).

    Args:
        api_url: the Prefect API to post to (a flow passes the one it runs against); default: found as
            ``prefect_api_url(home)`` finds it.

    Returns the API it went to, or None when no Prefect API is known (then nothing is sent) or it refused.
    """
    api = api_url or prefect_api_url(home)
    if api is None:
        return None
    resource, payload = model_event(name, version, None, {"digest": digest, "source": source})
    return api if post_event(api, MODEL_PUSHED, resource, payload) else None
