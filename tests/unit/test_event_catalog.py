"""The catalogue of Prefect events (``shardline/event_catalog.py``) holds both ends: what the product emits and
what prefect.yaml's automations listen for."""

from __future__ import annotations

import ast
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardline import event_catalog
from shardline.event_catalog import CATALOG, EVENTS, model_resource
from shardline.events import post_event
from shardline.tasks.events import emit

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("shardline", "build", "storage", "quality", "observability", "tasks", "flows", "online", "cli")


def trigger_events(text: str) -> dict[str, set[str]]:
    """Every event name a prefect.yaml's triggers use (``expect``, ``after``, and an ``event`` parameter they hand
    on), by the trigger's name."""
    found: dict[str, set[str]] = {}
    for deployment in yaml.safe_load(text)["deployments"]:
        for trigger in deployment.get("triggers") or []:
            names = {*trigger.get("expect", []), *trigger.get("after", [])}
            handed_on = (trigger.get("parameters") or {}).get("event", "")
            if handed_on.startswith("shardline."):
                names.add(handed_on)
            found[trigger["name"]] = names
    return found


def uncatalogued(triggers: dict[str, set[str]]) -> dict[str, list[str]]:
    return {name: sorted(events - set(CATALOG)) for name, events in triggers.items() if events - set(CATALOG)}


def test_every_trigger_in_prefect_yaml_names_a_catalogued_event() -> None:
    triggers = trigger_events((ROOT / "prefect.yaml").read_text())
    assert not uncatalogued(triggers), f"prefect.yaml's triggers name events the catalogue does not hold: " \
                                       f"{uncatalogued(triggers)}; add them to shardline/event_catalog.py"
    assert triggers == {
        "promote-on-push": {event_catalog.MODEL_PUSHED},
        "batch-sla-at-risk-or-breached": {event_catalog.BATCH_SLA_AT_RISK, event_catalog.BATCH_SLA_BREACHED},
        "nightly-batch-not-completed": {event_catalog.BATCH_STARTED, event_catalog.BATCH_COMPLETED,
                                        event_catalog.BATCH_NOT_COMPLETED},
        "revalidate-on-drift": {event_catalog.DRIFT_DETECTED},
        "rollback-on-failed-revalidation": {event_catalog.MODEL_REVALIDATION_FAILED},
        "notify-on-rollout-rollback": {event_catalog.ROLLOUT_ROLLED_BACK},
    }


def test_a_trigger_naming_an_unknown_event_is_caught() -> None:
    planted = """
deployments:
  - name: promote
    triggers:
      - name: promote-on-push
        expect: [shardline.model.pushd]
"""
    assert uncatalogued(trigger_events(planted)) == {"promote-on-push": ["shardline.model.pushd"]}


def _constants(tree: ast.AST) -> list[tuple[str, int]]:
    return [(node.value, node.lineno) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def test_no_product_module_spells_an_event_name_itself() -> None:
    """Emitters name events through the catalogue's constants; a literal would bypass it."""
    literal = []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "shardline" / "event_catalog.py":
                continue
            for value, line in _constants(ast.parse(path.read_text())):
                if value in CATALOG:
                    literal.append(f"{path.relative_to(ROOT)}:{line}: {value!r}")
    assert not literal, "event names spelt outside shardline/event_catalog.py:\n" + "\n".join(literal)


def test_every_catalogued_event_is_emitted_somewhere_or_reserved() -> None:
    constants = {value: name for name, value in vars(event_catalog).items() if name.isupper() and isinstance(value, str) and value in CATALOG}
    assert set(constants) == set(CATALOG)  # every event has its constant
    product = "\n".join(path.read_text() for folder in PRODUCT for path in (ROOT / folder).rglob("*.py")
                        if path.name != "event_catalog.py")
    unused = sorted(event for event, constant in constants.items()
                    if constant not in product and not CATALOG[event].reserved)
    assert not unused, f"catalogued but emitted nowhere: {unused}"
    assert [spec.name for spec in EVENTS if spec.reserved] == [event_catalog.BATCH_NOT_COMPLETED]


def test_both_ways_of_emitting_refuse_an_uncatalogued_event(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(KeyError, match="is not an event of shardline.event_catalog"):
        emit("shardline.model.pushd", model_resource("churn"), {})
    with caplog.at_level(logging.ERROR, logger="shardline.events"):
        # refused before any connection: the URL is never dialled
        assert post_event("http://127.0.0.1:9/api", "shardline.model.pushd", model_resource("churn"), {}) is False
    assert "not sent: 'shardline.model.pushd'" in caplog.text


def test_a_model_events_resource_is_what_the_triggers_match() -> None:
    resource: dict[str, Any] = model_resource("churn", "prod", 3)
    assert resource == {"prefect.resource.id": "shardline.model.churn", "shardline.model": "churn",
                        "shardline.version": "3", "shardline.alias": "prod"}
    assert "shardline.alias" not in model_resource("churn")
