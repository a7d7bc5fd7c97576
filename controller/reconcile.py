"""Reconcile: a ShardlineModel and what the registry holds -> the objects it owns, its status and the one registry
move it asks for (pure).

``reconcile(model, registry, settings, ...)`` decides everything; the kopf handlers (``handlers.py``) only apply
what it returns. ``registry_view(registry, spec)`` reads the little of the registry it needs (``RegistryView``).

What a version in ``spec.model`` leads to (``name:V`` on alias A, the spec's alias or prod):

- V is not in the registry: nothing moves; condition ``ModelFound`` False (push it, or correct the spec);
- A was never set: it is set to V (``SetAlias``): a first version has no baseline to be compared with;
- A points at V already: nothing moves;
- a rollout runs on the model: nothing moves (one rollout per model); when its candidate is not V the
  ``RolledOut`` condition says V waits for it to end;
- the routers rolled V back on A before: nothing moves, and ``RolledOut`` says so (it is not tried again until
  the spec names another version);
- else a rollout of V against A's version starts (``StartRollout``, the spec's rolloutPolicy): the same record
  `shardline rollout start` writes last (``storage.rollouts.start``); every router then splits callers, steps,
  promotes or rolls back by itself (docs/routing.md, "Rollouts").

``name@alias`` in ``spec.model`` serves what the alias points at and never moves it.

Two ShardlineModels naming different versions of one ``name@alias`` would move it against each other without end
(each one's rollout undoing the other's). The alias is claimed by the oldest ShardlineModel naming a version of it
(creationTimestamp, then namespace/name: an order every reconcile of either reads the same, and one that never
changes, so the one already serving keeps serving); ``contested`` refuses every younger one naming another version.
Several naming the same version (one model on several hardware classes) do not conflict.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Iterable, Literal

from pydantic import BaseModel, ConfigDict

from shardline.controller import objects
from shardline.controller.resource import ShardlineModel
from shardline.settings import ControllerSettings
from shardline.storage.registry import ModelRegistry
from shardline.storage.rollouts import Mode, active

Obj = dict[str, Any]
Autoscaler = Literal["keda", "hpa"]
MANAGER = "shardline-operator"


class RunningRollout(BaseModel):
    """A rollout the routers run on the model now."""

    model_config = ConfigDict(frozen=True)

    id: str
    alias: str
    candidate: int
    baseline: int
    describe: str


class RegistryView(BaseModel):
    """What reconcile reads of the registry for one ShardlineModel."""

    model_config = ConfigDict(frozen=True)

    versions: tuple[int, ...] = ()
    alias_version: int | None = None  # what the spec's alias points at; None: never set
    rollout: RunningRollout | None = None  # on any alias of the model
    rolled_back: tuple[int, ...] = ()  # candidates the routers rolled back on the spec's alias
    min_memory_mb: dict[int, int] = {}  # per version, what its manifest says it needs (hardware.min_memory_mb)


class SetAlias(BaseModel):
    """Point the alias at its first version."""

    model_config = ConfigDict(frozen=True)

    action: Literal["set-alias"] = "set-alias"
    name: str
    alias: str
    version: int


class StartRollout(BaseModel):
    """Start a rollout of ``name:candidate`` on ``name@alias`` (``storage.rollouts.start``'s arguments)."""

    model_config = ConfigDict(frozen=True)

    action: Literal["start-rollout"] = "start-rollout"
    name: str
    alias: str
    candidate: int
    baseline: int
    mode: Mode
    steps: tuple[float, ...] = ()
    shadow: float = 0.0
    interval_s: float | None = None
    criteria: dict[str, Any] = {}
    reason: str = ""


Move = SetAlias | StartRollout


class Condition(BaseModel):
    """A status condition, as Kubernetes writes them (lastTransitionTime is kept by ``conditions_at``)."""

    model_config = ConfigDict(frozen=True)

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str


class Reconciled(BaseModel):
    """Everything one reconcile decided."""

    model_config = ConfigDict(frozen=True)

    objects: tuple[Obj, ...]
    dropped: tuple[Obj, ...] = ()  # objects it may have made before and no longer wants (delete if it owns them)
    move: Move | None = None
    conditions: tuple[Condition, ...]
    serving: str | None  # name:version the alias points at after the move (None: nothing yet)
    rollout: RunningRollout | None = None
    router_group: Obj


class AliasClaim(BaseModel):
    """A ShardlineModel that names a version of ``name@alias``: it moves that alias (``claim``)."""

    model_config = ConfigDict(frozen=True)

    namespace: str
    name: str
    created: str  # creationTimestamp
    model: str
    alias: str
    version: int

    @property
    def order(self) -> tuple[str, str, str]:
        """Oldest first; the namespace and name break a tie (timestamps have whole seconds)."""
        return self.created, self.namespace, self.name


def claim(model: ShardlineModel) -> AliasClaim | None:
    """The alias the ShardlineModel moves, None when it names an alias (it follows, moving nothing)."""
    spec = model.spec
    if spec.pinned is None:
        return None
    return AliasClaim(namespace=model.namespace, name=model.name, created=model.created,
                      model=spec.reference.name, alias=spec.routed_alias, version=spec.pinned)


def contested(model: ShardlineModel, claims: Iterable[AliasClaim]) -> str | None:
    """Why the ShardlineModel may not move its alias: an older ShardlineModel claims it for another version; None
    when it may (it names an alias, it is the oldest claim, or the oldest names the same version).

    Args:
        claims: every ShardlineModel's claim the operator sees (its own included or not).
    """
    mine = claim(model)
    if mine is None:
        return None
    rivals = [c for c in claims if (c.model, c.alias) == (mine.model, mine.alias)
              and (c.namespace, c.name) != (mine.namespace, mine.name)]
    oldest = min([mine, *rivals], key=lambda c: c.order)
    if oldest.version == mine.version:
        return None
    ref = f"{mine.model}@{mine.alias}"
    return (f"ShardlineModel {model.namespace}/{model.name} is refused: {ref} is claimed by the older ShardlineModel "
            f"{oldest.namespace}/{oldest.name}, which names {mine.model}:{oldest.version} (this one names "
            f"{mine.model}:{mine.version}; two would roll the alias back and forth); name {mine.model}:"
            f"{oldest.version} or {ref}, route another alias (spec.alias), or change or delete "
            f"{oldest.namespace}/{oldest.name}")


def registry_view(registry: ModelRegistry, model: ShardlineModel) -> RegistryView:
    """Read what ``reconcile`` needs of the registry (the only I/O of this module)."""
    spec = model.spec
    name, alias = spec.reference.name, spec.routed_alias
    manifests = registry.list_versions(name)
    history = registry.alias_history(name, alias) if manifests else []
    running = None
    for on_alias, move in (registry.current_moves(name).items() if manifests else ()):
        rollout = active(move)
        if rollout is not None:
            running = RunningRollout(id=rollout.id, alias=on_alias, candidate=rollout.candidate,
                                     baseline=rollout.baseline, describe=rollout.describe())
    return RegistryView(
        versions=tuple(sorted(m.version for m in manifests)),
        alias_version=history[-1].version if history else None,
        rollout=running,
        rolled_back=tuple(sorted({m.rollout.candidate for m in history if m.action == "rollback" and m.rollout})),
        min_memory_mb={m.version: m.hardware.min_memory_mb for m in manifests if m.hardware.min_memory_mb},
    )


def reconcile(model: ShardlineModel, registry: RegistryView, settings: ControllerSettings, *,
              autoscaler: Autoscaler = "keda", ready_replicas: int | None = None) -> Reconciled:
    """The objects the ShardlineModel owns, the registry move it asks for, and its status conditions.

    Args:
        autoscaler: what scales the replicas (``settings.autoscaler`` resolved against what the cluster serves).
        ready_replicas: the Deployment's ready replicas as last seen; None before it exists.
    """
    spec = model.spec
    name, alias = spec.reference.name, spec.routed_alias
    move, rollout_condition = _decide(model, registry)
    if isinstance(move, SetAlias):
        serving_version: int | None = move.version
    else:
        serving_version = registry.alias_version
    # name@alias: found when the alias points at a version (its moves are the only reading of it here)
    found = registry.alias_version is not None if spec.pinned is None else spec.pinned in registry.versions
    # the replicas load every version a request may name: the alias's and, during a rollout, the candidate
    needs = [registry.min_memory_mb.get(v) for v in (serving_version, spec.pinned) if v is not None]
    memory = objects.memory_request(model, max((n for n in needs if n), default=None))
    replicas = max(spec.min_replicas, 1)
    owned: list[Obj] = [
        objects.deployment(model, settings, replicas, memory),
        objects.service(model, settings),
        (objects.scaled_object(model, settings) if autoscaler == "keda"
         else objects.horizontal_autoscaler(model, settings)),
        objects.disruption_budget(model),
        objects.network_policy(model, settings),
    ]
    conditions = [
        Condition(type="Valid", status="True", reason="Checked", message="the spec passed the operator's checks"),
        Condition(type="ModelFound", status="True" if found else "False",
                  reason="InRegistry" if found else
                  "AliasUnset" if spec.pinned is None and registry.versions else "NotInRegistry",
                  message=f"{spec.model} is in the registry" if found else _not_found(spec.model, name, alias,
                                                                                      spec.pinned, registry)),
        rollout_condition,
        _ready(ready_replicas, spec.min_replicas),
    ]
    running = registry.rollout
    # the other autoscaler: made before the cluster got KEDA (or lost it), it would fight this one
    other = (objects.horizontal_autoscaler(model, settings) if autoscaler == "keda"
             else objects.scaled_object(model, settings))
    dropped = {"apiVersion": other["apiVersion"], "kind": other["kind"],
               "metadata": {"name": model.name, "namespace": model.namespace}}
    return Reconciled(
        objects=tuple(owned), dropped=(dropped,), move=move, conditions=tuple(conditions),
        serving=f"{name}:{serving_version}" if serving_version is not None else None,
        rollout=running, router_group=dict(objects.router_group(model, settings)),
    )


def _versions(registry: RegistryView) -> str:
    return ", ".join(str(v) for v in registry.versions) or "none"


def _not_found(reference: str, name: str, alias: str, pinned: int | None, registry: RegistryView) -> str:
    if pinned is None and registry.versions:
        return (f"{reference}: the alias is not set (versions: {_versions(registry)}); set it (`shardline model alias "
                f"{name} {alias} VERSION`) or name a version in spec.model")
    return (f"{reference} is not in the registry (versions: {_versions(registry)}); push it with `shardline model "
            "push` or correct spec.model")


def _decide(model: ShardlineModel, registry: RegistryView) -> tuple[Move | None, Condition]:
    """The registry move the spec asks for, and the ``RolledOut`` condition that says where its version stands."""
    spec = model.spec
    name, alias, wanted = spec.reference.name, spec.routed_alias, spec.pinned

    def rolled_out(status: Literal["True", "False", "Unknown"], reason: str, message: str) -> Condition:
        return Condition(type="RolledOut", status=status, reason=reason, message=message)

    if wanted is None:
        if registry.alias_version is None:
            return None, rolled_out("False", "AliasUnset", f"{name}@{alias} is not set; set it "
                                    f"(`shardline model alias {name} {alias} VERSION`) or name a version in spec.model")
        return None, rolled_out("True", "FollowsAlias", f"serving {name}@{alias} ({name}:{registry.alias_version})")
    if wanted not in registry.versions:
        return None, rolled_out("False", "NotInRegistry", f"{name}:{wanted} is not in the registry; nothing rolled out")
    if registry.alias_version is None:
        return SetAlias(name=name, alias=alias, version=wanted), rolled_out(
            "True", "AliasSet", f"{name}@{alias} set to {name}:{wanted} (its first version: no baseline to roll out "
            "against)")
    running = registry.rollout
    if registry.alias_version == wanted:
        serving = f"{name}@{alias} points at {name}:{registry.alias_version}"
        if running is not None and running.alias == alias and running.candidate != wanted:
            # someone else's rollout (`shardline rollout start`) runs on the alias: say so, not only where it points
            return None, rolled_out("True", "Serving", f"{serving}; rollout {running.id} of {name}:"
                                    f"{running.candidate} runs on it ({running.describe}); if the routers promote "
                                    f"it, {name}:{wanted} (spec.model) is rolled out again")
        return None, rolled_out("True", "Serving", serving)
    if running is not None:
        if running.candidate == wanted and running.alias == alias:
            return None, rolled_out("False", "RollingOut", f"rollout {running.id} on {name}@{alias}: "
                                    f"{running.describe}")
        return None, rolled_out("False", "Waiting", f"a rollout runs on {name}@{running.alias} ({running.describe}); "
                                f"{name}:{wanted} starts when it ends (one rollout per model)")
    if wanted in registry.rolled_back:
        return None, rolled_out("False", "RolledBack", f"the routers rolled {name}:{wanted} back on {name}@{alias} "
                                f"(`shardline rollout status {name} --alias {alias}` says why); {name}@{alias} stays "
                                f"on {name}:{registry.alias_version}; name another version in spec.model to try again")
    policy = spec.rollout_policy
    canary = policy.strategy == "canary"
    move = StartRollout(
        name=name, alias=alias, candidate=wanted, baseline=registry.alias_version, mode=policy.strategy,
        steps=policy.steps if canary else (), shadow=0.0 if canary else policy.shadow,
        interval_s=policy.interval_s if canary else None, criteria=policy.criteria().model_dump(),
        reason=f"ShardlineModel {model.namespace}/{model.name} (generation {model.generation}) names {name}:{wanted}",
    )
    return move, rolled_out("False", "RolloutStarted", f"a {policy.strategy} of {name}:{wanted} against "
                            f"{name}:{registry.alias_version} on {name}@{alias} starts; the routers step it")


def _ready(ready_replicas: int | None, minimum: int) -> Condition:
    if ready_replicas is None:
        return Condition(type="Ready", status="Unknown", reason="Applied", message="the replicas' Deployment was "
                         "just applied")
    if ready_replicas >= max(minimum, 1) or (minimum == 0 and ready_replicas == 0):
        why = "scaled to zero: the first request wakes it" if ready_replicas == 0 else f"{ready_replicas} ready"
        return Condition(type="Ready", status="True", reason="ReplicasReady", message=why)
    return Condition(type="Ready", status="False", reason="ReplicasStarting",
                     message=f"{ready_replicas} of at least {max(minimum, 1)} replicas ready")


def conditions_at(conditions: tuple[Condition, ...], previous: list[Obj] | None, now: datetime,
                  generation: int) -> list[Obj]:
    """Conditions as written to status: lastTransitionTime kept from ``previous`` while a status is unchanged."""
    before = {c.get("type"): c for c in previous or [] if isinstance(c, dict)}
    written = []
    for condition in conditions:
        earlier = before.get(condition.type)
        changed = earlier is None or earlier.get("status") != condition.status
        stamp = (now.isoformat(timespec="seconds").replace("+00:00", "Z") if earlier is None or changed
                 else earlier["lastTransitionTime"])
        written.append({**condition.model_dump(), "lastTransitionTime": stamp, "observedGeneration": generation})
    return written


def refused(message: str, previous: list[Obj] | None, now: datetime, generation: int,
            reason: str = "InvalidSpec") -> list[Obj]:
    """The conditions of a ShardlineModel whose spec is refused: ``Valid`` False with the checks' message
    (``reason`` InvalidSpec, or AliasClaimed: ``contested``)."""
    return conditions_at((Condition(type="Valid", status="False", reason=reason, message=message),),
                         previous, now, generation)
