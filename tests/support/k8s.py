"""The kustomize overlays rendered and read: what the manifest tests and the probe test share."""

from __future__ import annotations

import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy/k8s"


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
