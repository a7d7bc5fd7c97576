"""Notifications the automations' flows leave for people: a JSON file and a markdown artifact."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from shardline.settings import StorageSettings
from shardline.storage.fs import atomic_write_bytes, join, open_fs
from shardline.tasks.logs import run_logger


@task(name="notify", cache_policy=NO_CACHE)
def record_notification(storage: StorageSettings, notice: dict[str, Any], topic: str = "batch",
                        subject: str = "job_id", title: str = "Batch SLA") -> str:
    """Write the notification under ``<home>/notifications/<topic>/`` and as a markdown artifact; returns its URL.

    Args:
        subject: the notice's field its file is named after (a job, a model).
        title: the artifact's heading, before the event's name.
    """
    fs, root = open_fs(join(storage.home, "notifications", topic), storage.storage_options)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    name = f"{notice.get(subject) or topic}-{notice['event'].rsplit('.', 1)[-1]}-{stamp}.json"
    path = join(root, name)
    atomic_write_bytes(fs, path, json.dumps(notice, indent=2, default=str).encode(), join(root, "_staging"))
    lines = "\n".join(f"- **{k}**: {v}" for k, v in notice.items())
    create_markdown_artifact(f"### {title}: {notice['event']}\n\n{lines}", description=f"{title} notification")
    run_logger().warning("%s: %s for %s: %s", title, notice["event"], notice.get(subject), notice.get("action", ""))
    return path
