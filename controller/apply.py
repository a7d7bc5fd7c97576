"""Putting reconcile's objects into the cluster: create what is missing, patch what exists (kr8s, the client
dask-kubernetes uses too).

A patch is a JSON merge patch (RFC 7386) computed against what the operator applied last, which it keeps in the
object's ``shardline.dev/last-applied`` annotation (as ``kubectl apply`` keeps its own): every field it sets is set
again (so a hand edit is undone), a field it no longer sets is removed (``null``), and fields it never set (the API
server's defaults, other controllers' fields) are left alone. A Deployment's ``spec.replicas`` is set when it is
created only: after that the autoscaler owns it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

Obj = dict[str, Any]
LAST_APPLIED = "shardline.dev/last-applied"


def merge_patch(before: Any, after: Any) -> Any:
    """The JSON merge patch that turns what was applied ``before`` into ``after`` on an object that may hold more:
    ``after``'s values, and ``None`` for each key ``before`` had and ``after`` has not (lists are replaced whole)."""
    if not isinstance(after, dict):
        return after
    patch: Obj = {}
    old = before if isinstance(before, dict) else {}
    for key in old:
        if key not in after:
            patch[key] = None
    for key, value in after.items():
        patch[key] = merge_patch(old.get(key), value) if isinstance(value, dict) else value
    return patch


def _without_replicas(obj: Obj) -> Obj:
    if obj.get("kind") != "Deployment":
        return obj
    trimmed = json.loads(json.dumps(obj))
    trimmed.get("spec", {}).pop("replicas", None)
    return trimmed


def annotated(desired: Obj) -> Obj:
    """``desired`` carrying itself (less a Deployment's replicas) in the last-applied annotation."""
    body = json.loads(json.dumps(desired))
    record = json.dumps(_without_replicas(desired), sort_keys=True, separators=(",", ":"))
    body.setdefault("metadata", {}).setdefault("annotations", {})[LAST_APPLIED] = record
    return body


def plan(desired: Obj, live: Obj | None) -> tuple[Literal["create", "patch", "none"], Obj]:
    """What to send for one object: ``("create", body)``, ``("patch", merge patch)`` or ``("none", {})`` when the
    live object already holds everything the operator sets."""
    if live is None:
        return "create", annotated(desired)
    recorded = (live.get("metadata", {}).get("annotations") or {}).get(LAST_APPLIED)
    try:
        before = json.loads(recorded) if recorded else {}
    except ValueError:
        before = {}
    wanted = annotated(_without_replicas(desired))
    patch = merge_patch(before, wanted)
    patch.pop("apiVersion", None)
    patch.pop("kind", None)
    if _holds(live, patch):
        return "none", {}
    return "patch", patch


def _holds(live: Any, patch: Any) -> bool:
    """Whether applying ``patch`` to ``live`` would change nothing."""
    if not isinstance(patch, dict):
        return bool(live == patch)
    if not isinstance(live, dict):
        return False
    for key, value in patch.items():
        if value is None:
            if key in live:
                return False
        elif key not in live or not _holds(live[key], value):
            return False
    return True
