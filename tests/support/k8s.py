"""The kustomize overlays rendered and read, and objects validated (built-in kinds against Kubernetes' schemas,
custom ones against their CRDs'): what the manifest tests, the probe test and the operator's tests share."""

from __future__ import annotations

import copy
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy/k8s"
# Third parties' CRDs (KEDA, Gateway API, dask-kubernetes, Istio), and our own (ShardlineModel).
CRDS = [*sorted((REPO / "tests/support/crds").glob("*.yaml")),
        *sorted(p for p in (K8S / "crds").glob("*.yaml") if p.name != "kustomization.yaml")]


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl (client only) renders the overlays: install it to run these checks")
    return found


@cache
def render(path: Path) -> tuple[dict[str, Any], ...]:
    run = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return tuple(d for d in yaml.safe_load_all(run.stdout) if d)


def find(objects: tuple[dict[str, Any], ...], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return obj["spec"]["template"]["spec"]["containers"]  # type: ignore[no-any-return]


# custom resources against their CRDs


def _strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused, as `kubectl apply --validate=strict` does (the API server
    would otherwise prune them silently), except where the schema keeps unknown fields; and its OpenAPI 3.0
    words in JSON Schema's (draft 7): ``nullable``, a boolean ``exclusiveMinimum``/``exclusiveMaximum``."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        if schema.pop("nullable", False) and isinstance(schema.get("type"), str):
            schema["type"] = [schema["type"], "null"]
        for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if schema.get(exclusive) is True and bound in schema:
                schema[exclusive] = schema.pop(bound)
            elif schema.get(exclusive) is False:
                schema.pop(exclusive)
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@cache
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> its openAPIV3Schema, metadata left to the API server (as a CRD's is)."""
    schemas = {}
    for path in CRDS:
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
            for field in ("apiVersion", "kind", "metadata"):  # the API server's, checked above or by it
                schema.get("properties", {}).pop(field, None)
            schemas[(f"{group}/{version['name']}", kind)] = _strict(schema)
    return schemas


def validate_custom(obj: dict[str, Any]) -> None:
    """A custom resource against its CRD's schema (``jsonschema.ValidationError`` names the wrong field)."""
    key = (obj["apiVersion"], obj["kind"])
    assert key in crd_schemas(), f"{key} has no CRD schema in tests/support/crds or deploy/k8s/crds"
    body = {k: v for k, v in obj.items() if k not in {"apiVersion", "kind", "metadata"}}
    jsonschema.validate(body, crd_schemas()[key], cls=jsonschema.Draft7Validator)


def validate(obj: dict[str, Any], version: str) -> None:
    """One object: a built-in kind against Kubernetes' schemas, a custom one against its CRD."""
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        validate_custom(obj)
