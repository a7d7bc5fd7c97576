"""`shardline router --local-replicas` when another process takes a replica's port while the replica is down: the
replica is started again on new ports and the router sends it requests there (its ports are the router's from the
start, handed over: tests/integration/test_local_replicas.py shows every replica up when each pick collides)."""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from shardline.local_ports import reserve_port
from shardline.storage.registry import ModelRegistry
from tests.conftest import BuiltModel
from tests.e2e.conftest import SHARDLINE
from tests.support.routers import KEY, MODEL, _env, _infer_body, _scrape, _stop, _tenants, _wait_for_log, _wait_ready

pytestmark = pytest.mark.timeout(300)


def _take(port: int, timeout: float = 10) -> socket.socket:
    """Bind ``port`` by number and listen, as another server would, as soon as the dying replica lets it go."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_server(("127.0.0.1", port))
        except OSError as e:
            assert e.errno == errno.EADDRINUSE and time.monotonic() < deadline, e
            time.sleep(0.01)


def test_a_replica_whose_port_was_taken_while_it_was_down_is_started_on_new_ports_and_the_router_follows(
    tmp_path: Path, breast_cancer_model: BuiltModel
) -> None:
    home = tmp_path / "home"
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias(MODEL, "prod", registry.push(breast_cancer_model.bundle_dir).version or 1)
    port, metrics_port = reserve_port(), reserve_port()
    log = tmp_path / "router.log"
    with open(log, "wb") as sink:
        router = subprocess.Popen([*SHARDLINE, "router", "--local-replicas", "2", "--tenants",
                                   str(_tenants(tmp_path / "tenants.yaml")), "--port", str(port), "--metrics-port",
                                   str(metrics_port)], env=_env(home), stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    taker = None
    try:
        _wait_ready(url, router, log, available=2)
        started = {u: int(p) for p, u in re.findall(r"started replica \d \(pid (\d+)\) on (http://[0-9.:]+)",
                                                    log.read_text())}
        victim = sorted(started)[0]
        os.kill(started[victim], signal.SIGKILL)
        taker = _take(int(victim.rsplit(":", 1)[1]))  # taken before the router's back-off (1 s) is over
        _wait_for_log(log, r"it moves from " + re.escape(victim) + r" to http://", 30)
        moved = re.search(r"it moves from \S+ to (http://[0-9.:]+)", log.read_text())
        assert moved is not None and moved.group(1) not in started
        _wait_ready(url, router, log, available=2)

        expected = breast_cancer_model.estimator.predict(breast_cancer_model.data.features[:4].astype(np.float32))
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as client:
            answers = [client.post(f"/v2/models/{MODEL}/infer", content=_infer_body(breast_cancer_model))
                       for _ in range(20)]
        assert [a.status_code for a in answers] == [200] * 20
        assert all(a.json()["outputs"][0]["data"] == expected.tolist() for a in answers)
        series = _scrape(f"http://127.0.0.1:{metrics_port}/metrics")
        members = {dict(labels)["replica"] for name, labels in series if name == "shardline_router_replica_available"}
        assert moved.group(1) in members and victim not in members
        assert series[("shardline_router_replica_available", (("group", "local"), ("replica", moved.group(1))))] == 1
    finally:
        if taker is not None:
            taker.close()
        code = _stop(router)
    assert code in (0, -signal.SIGTERM), log.read_text()[-4000:]
