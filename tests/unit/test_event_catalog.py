"""The event catalogue (shardline/event_catalog.py) holds both ends: every event prefect.yaml's automations expect
is catalogued, every catalogued event is emitted by some product module (or is marked reserved), and no product
module spells a catalogued event's name itself (each goes through the catalogue's constant)."""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import pytest
import yaml

from shardline import event_catalog
from shardline.event_catalog import CATALOG, EVENTS

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("shardline", "build", "storage", "quality", "observability", "tasks", "flows", "online", "cli")
CONSTANTS = {name: value for name, value in vars(event_catalog).items() if isinstance(value, str) and value in CATALOG}


def _triggers(text: str | None = None) -> list[tuple[str, str]]:
    """(deployment, event) for every event a trigger of prefect.yaml (or ``text``) expects, or hands its flow as a
    parameter."""
    found = []
    for deployment in yaml.safe_load(text or (ROOT / "prefect.yaml").read_text())["deployments"]:
        for trigger in deployment.get("triggers", []):
            found += [(deployment["name"], event) for event in trigger.get("expect", [])]
            found += [(deployment["name"], event) for event in trigger.get("after", [])]
            parameters = trigger.get("parameters", {})
            event = parameters.get("event")
            if isinstance(event, str) and event.startswith("shardline."):
                found.append((deployment["name"], event))
    return found


def _product_sources() -> dict[Path, str]:
    return {path: path.read_text() for folder in PRODUCT for path in sorted((ROOT / folder).rglob("*.py"))
            if path.name != "event_catalog.py"}


def test_every_event_prefect_yaml_names_is_catalogued() -> None:
    named = _triggers()
    assert len({event for _, event in named}) >= 6  # the automations' events: the test reads what it should
    unknown = [f"{deployment}: {event}" for deployment, event in named if event not in CATALOG]
    assert not unknown, f"prefect.yaml names events shardline/event_catalog.py does not hold: {unknown}"
    assert sorted(set(named)) == sorted({
        ("promote", event_catalog.MODEL_PUSHED),
        ("sla-response", event_catalog.BATCH_SLA_AT_RISK), ("sla-response", event_catalog.BATCH_SLA_BREACHED),
        ("sla-response", event_catalog.BATCH_STARTED), ("sla-response", event_catalog.BATCH_COMPLETED),
        ("sla-response", event_catalog.BATCH_NOT_COMPLETED),
        ("revalidate", event_catalog.DRIFT_DETECTED), ("rollback", event_catalog.MODEL_REVALIDATION_FAILED),
        ("rollout-notice", event_catalog.ROLLOUT_ROLLED_BACK),
    })


def test_a_trigger_naming_an_uncatalogued_event_is_seen() -> None:
    planted = "deployments:\n  - name: promote\n    triggers:\n      - expect: [shardline.model.pushd]\n"
    assert [(d, e) for d, e in _triggers(planted) if e not in CATALOG] == [("promote", "shardline.model.pushd")]


def test_every_catalogued_event_is_emitted_somewhere_or_reserved() -> None:
    sources = _product_sources()
    used = set()
    for text in sources.values():
        tree = ast.parse(text)
        used |= {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        used |= {node.name for node in ast.walk(tree) if isinstance(node, ast.alias)}
    by_value = {value: name for name, value in CONSTANTS.items()}
    silent = [spec.name for spec in EVENTS if not spec.reserved and by_value.get(spec.name) not in used]
    assert not silent, f"catalogued but emitted nowhere (emit it, or mark it reserved): {silent}"


def test_no_product_module_spells_an_event_name_itself() -> None:
    spelled = [f"{path.relative_to(ROOT)}: {name}" for path, text in _product_sources().items()
               for name in CATALOG if re.search(rf"[\"']{re.escape(name)}[\"']", text)]
    assert not spelled, f"use shardline.event_catalog's constant instead: {spelled}"


def test_a_flow_emits_only_catalogued_events() -> None:
    from shardline.tasks.events import emit

    try:
        emit("shardline.model.made-up", {"prefect.resource.id": "x"}, {})
    except KeyError as e:
        assert "is not an event of shardline.event_catalog" in str(e)
    else:
        raise AssertionError("an uncatalogued event was emitted")


def test_the_router_and_the_cli_post_only_catalogued_events(caplog: pytest.LogCaptureFixture) -> None:
    from shardline.events import post_event

    with caplog.at_level(logging.ERROR, logger="shardline.events"):  # refused before the URL is dialled
        assert post_event("http://127.0.0.1:9/api", "shardline.model.made-up", {"prefect.resource.id": "x"}, {}) is False
    assert "not sent: 'shardline.model.made-up'" in caplog.text


def test_every_model_event_is_built_to_one_contract() -> None:
    """docs/drift.md, "Events": the version labelled, the payload names the model four ways, whatever it was given."""
    from shardline.event_catalog import model_event

    resource, payload = model_event("churn", 3, "prod", {"model": "churn", "version": 9, "reason": "r"})
    assert resource == {"prefect.resource.id": "shardline.model.churn", "shardline.model": "churn",
                        "shardline.version": "3", "shardline.alias": "prod"}
    assert payload == {"model": "churn", "name": "churn", "version": 3, "alias": "prod", "reference": "churn@prod",
                       "reason": "r"}
    pushed = model_event("churn", 4, None, {"digest": "d", "source": "cli"})[1]
    assert (pushed["alias"], pushed["reference"]) == (None, "churn:4")
    model_events = [spec for spec in EVENTS if spec.resource == event_catalog.MODEL_RESOURCE]
    assert model_events and all({"name", "version", "alias", "reference"} <= set(spec.payload) for spec in model_events)
