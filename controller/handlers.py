"""The operator's kopf handlers: every ShardlineModel, on creation, on each change of its spec, when the operator
starts and every ``SHARDLINE_CONTROLLER_RESYNC_S``, is reconciled (``reconcile.py``) and what that returns is
applied: the owned objects (``apply.py``, through kr8s), the registry move (the alias's first version or a rollout
the routers then run), and the status (``serving``, ``rollout``, ``routerGroup``, conditions).

Run it with ``python -m shardline.controller`` (kopf's own ``kopf run`` works too: ``kopf run -m
shardline.controller.handlers --all-namespaces``). It needs the registry's settings (``SHARDLINE_STORAGE_*``) and
the Kubernetes API (in a pod: its service account; else ``KUBECONFIG``).
"""

from __future__ import annotations

import asyncio
import os
from datetime import datetime, timezone
from typing import Any

import kopf
import kr8s
import kr8s.asyncio
from kr8s.asyncio.objects import object_from_spec

from shardline.controller.apply import plan
from shardline.controller.reconcile import (
    MANAGER, AliasClaim, Autoscaler, Move, Reconciled, SetAlias, claim, conditions_at, contested, reconcile, refused,
    registry_view,
)
from shardline.controller.resource import GROUP, PLURAL, VERSION, ShardlineModel, parse_resource
from shardline.errors import AliasConflict, InvalidSetting, ShardlineError
from shardline.settings import ControllerSettings, StorageSettings
from shardline.storage import rollouts
from shardline.storage.registry import AliasMove, ModelRegistry
from shardline.storage.rollouts import RollbackCriteria

# Read when the module is imported: kopf fixes a timer's interval when it registers it.
RESYNC_S = float(os.environ.get("SHARDLINE_CONTROLLER_RESYNC_S", ControllerSettings.model_fields["resync_s"].default))
CONFLICT_RETRY_S = 5


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Read the operator's and the registry's settings once. No deletion handler: the owned objects carry owner
    references, so Kubernetes deletes them with their ShardlineModel (kopf keeps a finalizer of its own on each,
    for the resync timer, and removes it when the ShardlineModel is deleted)."""
    memo.operator = ControllerSettings()
    memo.storage = StorageSettings()
    # warnings and errors logged on a ShardlineModel become Kubernetes events on it (kopf >= 1.45 posts log
    # records only when asked to: settings.posting.loggers)
    settings.posting.loggers = True
    settings.posting.level = 30


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The pod's service account, else ``KUBECONFIG`` (read when the operator starts, not when kopf is imported):
    kopf's own credentials, with neither the kubernetes nor the pykube client needed to find them."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


async def _api() -> Any:
    return await kr8s.asyncio.api()


async def resolve_autoscaler(api: Any, chosen: str) -> Autoscaler:
    """``keda`` or ``hpa``: the setting, or with ``auto`` KEDA when the cluster serves ScaledObjects."""
    if chosen in ("keda", "hpa"):
        return chosen  # type: ignore[return-value]
    try:
        resources = await api.api_resources()
    except Exception:  # noqa: BLE001 - discovery refused: the HPA needs nothing beyond the built-in API
        return "hpa"
    served = any(r.get("name") == "scaledobjects" and str(r.get("version", "")).startswith("keda.sh/")
                 for r in resources)
    return "keda" if served else "hpa"


async def _live(api: Any, desired: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    obj = await object_from_spec(desired, api=api, allow_unknown_type=True)
    try:
        await obj.refresh()
    except kr8s.NotFoundError:
        return obj, None
    return obj, dict(obj.raw)


async def apply_objects(api: Any, owned: tuple[dict[str, Any], ...]) -> list[str]:
    """Create or patch each object; returns what was done, one ``kind/name: created|patched|unchanged`` each."""
    done = []
    for desired in owned:
        obj, live = await _live(api, desired)
        action, body = plan(desired, live)
        if action == "create":
            created = await object_from_spec(body, api=api, allow_unknown_type=True)
            await created.create()
        elif action == "patch":
            await obj.patch(body)
        done.append(f"{desired['kind']}/{desired['metadata']['name']}: "
                    f"{ {'create': 'created', 'patch': 'patched', 'none': 'unchanged'}[action] }")
    return done


async def delete_owned(api: Any, dropped: tuple[dict[str, Any], ...], owner_uid: str) -> list[str]:
    """Delete each object reconcile no longer wants, if it exists and this ShardlineModel owns it (never one
    someone else made under the same name)."""
    done = []
    for unwanted in dropped:
        obj, live = await _live(api, unwanted)
        owners = (live or {}).get("metadata", {}).get("ownerReferences") or []
        if live is not None and owner_uid and any(o.get("uid") == owner_uid for o in owners):
            await obj.delete()
            done.append(f"{unwanted['kind']}/{unwanted['metadata']['name']}: deleted (no longer wanted)")
    return done


async def ready_replicas(api: Any, model: ShardlineModel) -> int | None:
    """The replicas' Deployment's ready replicas, None when it does not exist yet."""
    from kr8s.asyncio.objects import Deployment

    try:
        deployment = await Deployment.get(model.name, namespace=model.namespace, api=api)
    except kr8s.NotFoundError:
        return None
    return int((deployment.raw.get("status") or {}).get("readyReplicas") or 0)


def apply_move(registry: ModelRegistry, move: Move) -> AliasMove:
    """The registry move reconcile asked for: the alias's first version, or the rollout's first record (the record
    `shardline rollout start` writes last; the routers run the rollout from it).

    Raises:
        AliasConflict, RolloutConflict: the alias moved, or a rollout started, since reconcile read the registry.
    """
    if isinstance(move, SetAlias):
        return registry.set_alias(move.name, move.alias, move.version, by=MANAGER, protected=True,
                                  reason="the first version a ShardlineModel names")
    return rollouts.start(
        registry, move.name, move.alias, move.candidate, mode=move.mode, steps=move.steps, shadow=move.shadow,
        interval_s=move.interval_s, criteria=RollbackCriteria(**move.criteria), by=MANAGER, reason=move.reason,
    )


def _rollout_status(result: Reconciled, moved: AliasMove | None) -> dict[str, Any] | None:
    if moved is not None and moved.rollout is not None:
        r = moved.rollout
        return {"id": r.id, "alias": moved.alias, "candidate": r.candidate, "baseline": r.baseline,
                "describe": r.describe()}
    return result.rollout.model_dump() if result.rollout is not None else None


@kopf.index(GROUP, VERSION, PLURAL)
def alias_claims(body: kopf.Body, **_: Any) -> dict[tuple[str, str], AliasClaim] | None:
    """Every ShardlineModel naming a version, by the alias it moves (model name, alias): kopf keeps this index of
    all the ShardlineModels it watches, filled before any handler runs."""
    try:
        found = claim(parse_resource(body))
    except InvalidSetting:
        return None
    return None if found is None else {(found.model, found.alias): found}


def _refuse_claim(message: str, previous: list[Any], now: datetime, generation: int, patch: kopf.Patch,
                  logger: kopf.Logger) -> None:
    """Valid False (AliasClaimed), said once as a warning (a Kubernetes event) while it lasts, not every resync."""
    said = next((c for c in previous if isinstance(c, dict) and c.get("type") == "Valid"), {})
    if (said.get("reason"), said.get("message")) != ("AliasClaimed", message):
        logger.warning("%s", message)
    patch.status["conditions"] = refused(message, previous, now, generation, reason="AliasClaimed")
    patch.status["observedGeneration"] = generation
    patch.status["rollout"] = None


@kopf.on.resume(GROUP, VERSION, PLURAL, id="reconcile")
@kopf.on.create(GROUP, VERSION, PLURAL, id="reconcile")
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec", id="reconcile")
@kopf.timer(GROUP, VERSION, PLURAL, interval=RESYNC_S, initial_delay=RESYNC_S, id="resync")
async def reconcile_model(body: kopf.Body, status: kopf.Status, patch: kopf.Patch, memo: kopf.Memo,
                          logger: kopf.Logger, **kwargs: Any) -> None:
    """Check the spec, reconcile, apply, write the status. A refused spec is not retried (it fails until it is
    corrected: condition ``Valid`` False naming the field); a registry move that lost a race is retried. One
    naming another version of an alias an older ShardlineModel claims is refused and touches nothing (``Valid``
    False, AliasClaimed) until that one changes or goes: every resync checks again."""
    now = datetime.now(timezone.utc)
    generation = int(body.get("metadata", {}).get("generation") or 0)
    previous = list(status.get("conditions") or [])
    try:
        model = parse_resource(body)
    except InvalidSetting as e:
        patch.status["conditions"] = refused(str(e), previous, now, generation)
        patch.status["observedGeneration"] = generation
        raise kopf.PermanentError(str(e)) from e
    mine = claim(model)
    claims: kopf.Index[tuple[str, str], AliasClaim] = kwargs["alias_claims"]  # the index above, by its name
    rivalry = contested(model, claims.get((mine.model, mine.alias), ())) if mine is not None else None
    if rivalry is not None:
        _refuse_claim(rivalry, previous, now, generation, patch, logger)
        return
    settings: ControllerSettings = memo.operator
    storage: StorageSettings = memo.storage
    api = await _api()
    try:
        registry = ModelRegistry.from_settings(storage)
        view = await asyncio.to_thread(registry_view, registry, model)
    except ShardlineError as e:
        raise kopf.TemporaryError(f"the registry cannot be read: {e}", delay=CONFLICT_RETRY_S) from e
    autoscaler = await resolve_autoscaler(api, settings.autoscaler)
    result = reconcile(model, view, settings, autoscaler=autoscaler, ready_replicas=await ready_replicas(api, model))
    for line in await apply_objects(api, result.objects):
        logger.debug(line)
    for line in await delete_owned(api, result.dropped, model.uid):
        logger.info(line)
    moved = None
    if result.move is not None:
        try:
            moved = await asyncio.to_thread(apply_move, registry, result.move)
        except AliasConflict as e:  # another writer came first: read the registry again and decide again
            raise kopf.TemporaryError(str(e), delay=CONFLICT_RETRY_S) from e
        except ShardlineError as e:
            logger.warning("%s", e)
        else:
            logger.info("%s", moved.reason)
    patch.status["conditions"] = conditions_at(result.conditions, previous, now, generation)
    patch.status["observedGeneration"] = generation
    patch.status["serving"] = result.serving
    patch.status["routerGroup"] = result.router_group
    patch.status["rollout"] = _rollout_status(result, moved)
