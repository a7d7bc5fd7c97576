"""The catalogue of Shardline's Prefect events: each event's name, its resource, its payload and what it says.

Every emitter names its events through these constants, never as a literal: the flows and tasks through
``shardline.tasks.events.emit`` (Prefect's ``emit_event``, to the API the run reports to), the router and the
CLI over plain HTTP (``shardline.events``: Prefect is not imported there). The automations in ``prefect.yaml``
answer them. ``tests/unit/test_event_catalog.py`` holds both ends: every trigger in prefect.yaml names a
catalogued event, every catalogued event is emitted somewhere (or is marked reserved), and no product module
spells an event's name itself. docs/architecture.md ("Events") says it for people.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODEL_RESOURCE = "shardline.model.<name>"
BATCH_JOB_RESOURCE = "shardline.batch-job.<job_id>"
TENANT_RESOURCE = "shardline.tenant.<name>"

BATCH_STARTED = "shardline.batch.started"
BATCH_SLA_AT_RISK = "shardline.batch.sla-at-risk"
BATCH_SLA_BREACHED = "shardline.batch.sla-breached"
BATCH_COMPLETED = "shardline.batch.completed"
BATCH_NOT_COMPLETED = "shardline.batch.not-completed"
MODEL_PUSHED = "shardline.model.pushed"
MODEL_PROMOTED = "shardline.model.promoted"
MODEL_REVALIDATED = "shardline.model.revalidated"
MODEL_REVALIDATION_FAILED = "shardline.model.revalidation-failed"
MODEL_ROLLED_BACK = "shardline.model.rolled-back"
DRIFT_DETECTED = "shardline.drift.detected"
QUALITY_FAILED = "shardline.quality.failed"
ROLLOUT_STARTED = "shardline.rollout.started"
ROLLOUT_STEPPED = "shardline.rollout.stepped"
ROLLOUT_PROMOTED = "shardline.rollout.promoted"
ROLLOUT_ABORTED = "shardline.rollout.aborted"
ROLLOUT_ROLLED_BACK = "shardline.rollout.rolled-back"
BUDGET_WARNING = "shardline.budget.warning"

_BATCH_PAYLOAD = ("job_id", "tenant", "model", "priority", "started", "deadline", "status", "at", "projected_finish",
                  "shards_done", "shards_total", "rows_done", "shards_per_second", "rows_per_second")
_MODEL_PAYLOAD = ("name", "version", "alias", "reference")
_REVALIDATION_PAYLOAD = (*_MODEL_PAYLOAD, "model", "labelled_uri", "rows", "metric", "score", "threshold",
                         "higher_is_better", "passed", "reason")
_ROLLOUT_PAYLOAD = (*_MODEL_PAYLOAD, "model", "rollout", "candidate", "baseline", "reason", "record", "by")
_FLOW_ROLLOUT_PAYLOAD = (*_ROLLOUT_PAYLOAD, "mode", "registry")
_ROUTER_ROLLOUT_PAYLOAD = (*_ROLLOUT_PAYLOAD, "weight", "observed")


@dataclass(frozen=True)
class EventSpec:
    """One event of the catalogue.

    Attributes:
        name: the event's name, what a trigger's ``expect`` lists.
        resource: the ``prefect.resource.id`` it is about (``<...>`` stands for the part that varies).
        payload: the keys its payload holds (an emitter may add more; these it always sends).
        description: what it says, in one line.
        emitted_by: who emits it.
        reserved: named in prefect.yaml but never emitted (see its description).
    """

    name: str
    resource: str
    payload: tuple[str, ...]
    description: str
    emitted_by: str
    reserved: bool = False


EVENTS: tuple[EventSpec, ...] = (
    EventSpec(BATCH_STARTED, BATCH_JOB_RESOURCE, _BATCH_PAYLOAD,
              "a batch job was planned and starts scoring (the proactive not-completed trigger keys on it)",
              "batch-inference (tasks/sla_tracking.py)"),
    EventSpec(BATCH_SLA_AT_RISK, BATCH_JOB_RESOURCE, _BATCH_PAYLOAD,
              "a batch job's projected finish is past its deadline less the margin, or the job stalled",
              "batch-inference (tasks/sla_tracking.py)"),
    EventSpec(BATCH_SLA_BREACHED, BATCH_JOB_RESOURCE, _BATCH_PAYLOAD,
              "a batch job's deadline passed with shards left, or the job finished late",
              "batch-inference (tasks/sla_tracking.py)"),
    EventSpec(BATCH_COMPLETED, BATCH_JOB_RESOURCE, (*_BATCH_PAYLOAD, "outcome"),
              "every shard of a batch job settled; outcome completed or quarantined (a failed job sends none)",
              "batch-inference (tasks/sla_tracking.py)"),
    EventSpec(BATCH_NOT_COMPLETED, BATCH_JOB_RESOURCE, (),
              "never emitted: the name prefect.yaml's nightly-batch-not-completed trigger hands batch-sla-response "
              "as its event when no shardline.batch.completed followed a nightly job's start in time",
              "nobody (prefect.yaml names it)", reserved=True),
    EventSpec(MODEL_PUSHED, MODEL_RESOURCE, (*_MODEL_PAYLOAD, "digest", "source"),
              "a new version was pushed to the registry (promote-on-push promotes it to staging through the gates)",
              "shardline model push / import (HTTP), mlflow-watch"),
    EventSpec(MODEL_PROMOTED, MODEL_RESOURCE, (*_MODEL_PAYLOAD, "previous", "by", "registry"),
              "an alias was moved to a version once every promotion gate passed", "promote-model"),
    EventSpec(MODEL_REVALIDATED, MODEL_RESOURCE, _REVALIDATION_PAYLOAD,
              "a version still meets its golden-set threshold on fresh labelled rows", "revalidate-model"),
    EventSpec(MODEL_REVALIDATION_FAILED, MODEL_RESOURCE, _REVALIDATION_PAYLOAD,
              "a version misses its golden-set threshold on fresh labelled rows (rollback-on-failed-revalidation "
              "answers)", "revalidate-model"),
    EventSpec(MODEL_ROLLED_BACK, MODEL_RESOURCE, (*_MODEL_PAYLOAD, "previous", "by", "reason", "seq"),
              "an alias was moved back to the version it pointed at before", "rollback-alias"),
    EventSpec(DRIFT_DETECTED, MODEL_RESOURCE,
              (*_MODEL_PAYLOAD, "model", "columns", "score", "rows_current", "rows_reference", "rows_by_tier", "since",
               "until", "report"),
              "a column of a version's captured inputs or outputs drifted from its reference profile "
              "(revalidate-on-drift answers)", "drift-watch"),
    EventSpec(QUALITY_FAILED, MODEL_RESOURCE,
              (*_MODEL_PAYLOAD, "model", "check", "failures", "failed", "report"),
              "the data contract failed on a version's newest captured rows", "drift-watch"),
    EventSpec(ROLLOUT_STARTED, MODEL_RESOURCE, _FLOW_ROLLOUT_PAYLOAD,
              "a canary or shadow rollout started once the gates and the offline replay passed", "start-rollout"),
    EventSpec(ROLLOUT_STEPPED, MODEL_RESOURCE, _ROUTER_ROLLOUT_PAYLOAD,
              "a router moved a canary to its next traffic step", "the router (HTTP)"),
    EventSpec(ROLLOUT_PROMOTED, MODEL_RESOURCE, _ROLLOUT_PAYLOAD,
              "a rollout's candidate took the alias (by the routers' verdict, or by hand)",
              "the router (HTTP), end-rollout"),
    EventSpec(ROLLOUT_ABORTED, MODEL_RESOURCE, _FLOW_ROLLOUT_PAYLOAD,
              "a rollout was stopped by hand; the alias stays on the baseline", "end-rollout"),
    EventSpec(ROLLOUT_ROLLED_BACK, MODEL_RESOURCE, _ROUTER_ROLLOUT_PAYLOAD,
              "a router rolled a rollout back on its criteria (notify-on-rollout-rollback answers)",
              "the router (HTTP)"),
    EventSpec(BUDGET_WARNING, TENANT_RESOURCE, ("tenant", "state", "spent", "budget", "month", "currency", "tier"),
              "work was submitted for a tenant past its budget's warning threshold (state warn, soft or hard: "
              "docs/cost.md, 'Budgets')", "shardline batch run (HTTP)"),
)
CATALOG: dict[str, EventSpec] = {spec.name: spec for spec in EVENTS}


def tenant_resource(name: str) -> dict[str, str]:
    """The resource of an event about a tenant: ``shardline.tenant.<name>``."""
    return {"prefect.resource.id": f"shardline.tenant.{name}", "shardline.tenant": name}


def model_resource(name: str, alias: str | None = None, version: int | None = None) -> dict[str, str]:
    """The resource of an event about a model: ``shardline.model.<name>``, labelled with the model's name and,
    when known, its version and the alias it was reached through (what the triggers' ``match`` reads)."""
    resource = {"prefect.resource.id": f"shardline.model.{name}", "shardline.model": name}
    if version is not None:
        resource["shardline.version"] = str(version)
    if alias:
        resource["shardline.alias"] = alias
    return resource


def model_event(name: str, version: int | None, alias: str | None,
                payload: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """The resource and payload of any event about a model (docs/drift.md, "Events", promises them of every one).

    The resource is ``model_resource(name, alias, version)``; the payload is ``payload`` with ``name``,
    ``version``, ``alias`` (None when the model was reached by version) and ``reference`` (``name@alias``, else
    ``name:version``) set last, so no emitter can leave them out or say them otherwise. Every emitter (the flows'
    ``shardline.tasks.events``, the CLI's ``shardline.events``, the router) builds its model events here.
    """
    reference = f"{name}@{alias}" if alias else f"{name}:{version}"
    return (model_resource(name, alias, version),
            {**payload, "name": name, "version": version, "alias": alias or None, "reference": reference})
