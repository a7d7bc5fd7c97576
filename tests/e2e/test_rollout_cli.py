"""`shardline rollout start` as a user runs it: one warning line, not an error, when the canary's steps cannot
reach their minimum answers at the traffic the routers last reported on the alias (or the rule, when they
reported none), and the rollout still starts."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Callable

from shardline.online.router.rollouts import RolloutBook, Route
from shardline.storage.registry import ModelRegistry
from tests.tensor_models import breast_cancer_bundle

Shardline = Callable[..., subprocess.CompletedProcess[str]]
CHURN = "churn"


def _started(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    found = re.search(r"churn@prod: rollout ([0-9a-f]{12}) started: canary of version 2", done.stdout)
    assert found, done.stdout
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, done.stderr
    return found.group(1)


def test_a_canary_too_fine_for_the_alias_traffic_starts_with_one_warning_line(
    shardline: Shardline, shardline_home: Path, tmp_path: Path
) -> None:
    registry = ModelRegistry(str(shardline_home / "registry"))
    registry.set_alias(CHURN, "prod", registry.push(breast_cancer_bundle(tmp_path / "v1", CHURN, "gbt")).version or 1)
    registry.push(breast_cancer_bundle(tmp_path / "v2", CHURN, "logreg"))

    first = shardline("rollout", "start", CHURN, "--candidate", "2", "--steps", "1,5,25,100", "--interval", "10m")
    rollout_id = _started(first)
    assert ("warning: no traffic of churn@prod is recorded (routers report it during rollouts); step 1% needs 50 "
            "candidate answers in 60 s, i.e. about 83 requests/s to the alias; at lower traffic use larger steps or "
            "--min-requests") in first.stderr

    rollout = registry.current_move(CHURN, "prod").rollout  # type: ignore[union-attr]
    assert rollout is not None and rollout.id == rollout_id
    now = [0.0]  # what one router saw: 600 answers in its 60 s window, 10 requests/s
    book = RolloutBook(registry, set(), lambda f: f(), lambda: now[0], lambda *a: None, "router-a")
    for i in range(600):
        book.record(Route(2, "candidate", rollout) if i % 100 == 0 else Route(1, "baseline", rollout), 200, 0.002)
        now[0] += 0.098
    registry.put_rollout_report(CHURN, rollout_id, "router-a",  # as the router's refresh writes it
                                {"router": "router-a", "at": "2026-12-01T10:00:00+00:00", **book.observed(rollout)})
    aborted = shardline("rollout", "abort", CHURN, "--reason", "too slow to step")
    assert aborted.returncode == 0, aborted.stderr

    second = shardline("rollout", "start", CHURN, "--candidate", "2", "--steps", "1,5,25,100", "--interval", "10m")
    _started(second)
    assert (f"warning: the routers last saw about 10 requests/s on churn@prod (rollout {rollout_id}, 2026-12-01 10:00 "
            "UTC); steps 1%, 5% cannot reach 50 candidate answers in 60 s at that rate, so the rollout would hold "
            "there (no step, no automatic rollback): step 1% needs about 83 requests/s; use larger steps or a lower "
            "--min-requests") in second.stderr
