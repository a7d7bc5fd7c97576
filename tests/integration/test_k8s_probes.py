"""The health paths the manifests probe (deploy/k8s) are ones `shardline serve` answers, over real HTTP on loopback."""

from __future__ import annotations

from pathlib import Path

import yaml

from shardline.tenants import parse_tenants_file
from tests.support.k8s import K8S, containers, find, render


def test_replica_probes_are_paths_serve_answers(tmp_path: Path) -> None:
    # `shardline serve` with the production overlay's own tenants file, on loopback: each probe path a replica
    # group's manifest names is answered (200, or 503 while not ready), not 404
    import httpx

    from shardline.online.tenants import TenantDirectory
    from tests.support.serving import serve_home

    objects = render(K8S / "overlays/production")
    [config] = [c for c in find(objects, "ConfigMap") if c["metadata"]["name"].startswith("shardline-tenants")]
    tenants = TenantDirectory.from_file(parse_tenants_file(yaml.safe_load(config["data"]["tenants.yaml"]), "tenants"))
    probes = {(kind, c[kind]["httpGet"]["path"]) for d in find(objects, "Deployment")
              if d["metadata"]["name"].startswith("shardline-replicas-") for c in containers(d)
              for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {path for _, path in probes} == {"/v2/health/live", "/v2/health/ready"}
    with serve_home(tmp_path, tenants) as (url, _):
        for kind, path in sorted(probes):
            status = httpx.get(url + path, timeout=10).status_code
            assert status in ({200} if kind != "readinessProbe" else {200, 503}), (kind, path, status)
