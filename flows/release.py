"""The release flow: a pushed version to prod the safe way, each step a record in the alias history.

``release-model`` takes ``name:version`` (pushed already, e.g. by CI after ``shardline model
package``) through:

1. **staging**: the promotion flow (``promote-model``) moves ``name@staging`` to it once every gate
   passes (signature, checksums, golden set, reference profile);
2. **canary on prod**: the rollout flow (``start-rollout``: the gates again and the offline replay)
   starts a canary on ``name@prod``, stepping through ``steps`` every ``interval_s``; the routers
   split the traffic, judge each step and promote or roll back by themselves
   (``online/router/rollouts.py``);
3. **the verdict**: the flow follows ``name@prod``'s newest record every ``poll_s`` until that
   rollout ends: promoted (the run completes), rolled back or aborted (the run fails with the
   reason). Past ``wait_s`` the run fails saying the rollout still runs: the routers go on, and
   ``shardline rollout status`` follows it.

A model without ``prod`` yet has no baseline to canary against: its first version goes from
staging to prod through the gates alone. A version already on prod is reported and nothing moves
(a re-run of a finished release).
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.states import Failed, State

from shardline.errors import InvalidInput
from shardline.flows.promotion import promote_model
from shardline.flows.rollout import start_rollout
from shardline.settings import StorageSettings
from shardline.tasks.release import await_verdict, release_candidate

DEFAULT_STEPS = (1.0, 5.0, 25.0, 100.0)


@flow(name="release-model", log_prints=True)
def release_model(
    candidate: str,
    steps: list[float] | None = None,
    interval_s: float = 300.0,
    criteria: dict[str, Any] | None = None,
    wait_s: float = 3600.0,
    poll_s: float = 5.0,
    by: str | None = None,
    reason: str = "",
) -> dict[str, Any] | State[Any]:
    """Release ``candidate`` (``name:version``): staging through the gates, a canary on prod, the routers'
    verdict (see the module docstring).

    Returns:
        What happened: the model, the version, ``outcome`` (``promoted``, ``first version`` or ``already on
        prod``) and the prod records of the rollout; a Failed state when a gate or the replay refused, the
        routers rolled it back, or ``wait_s`` passed first.
    """
    storage = StorageSettings()
    try:
        release = release_candidate(storage, candidate)
    except InvalidInput as error:
        return Failed(message=str(error), data=error)
    name, version = release.name, release.version
    why = reason or f"release of {candidate}"
    if release.on_prod_already:
        print(f"{name}@prod is on {version} already")  # a re-run: nothing moves
        return {"model": name, "version": version, "outcome": "already on prod", "records": []}
    staged = promote_model(candidate, "staging", by=by, reason=why, return_state=True)
    if staged.is_failed():
        return staged
    print(f"{name}@staging -> {version}: every gate passed")
    if release.prod is None:
        first = promote_model(candidate, "prod", by=by, reason=f"{why}: the first version (no baseline to canary "
                              "against)", return_state=True)
        if first.is_failed():
            return first
        print(f"{name}@prod -> {version}: the model's first version, through the gates alone")
        return {"model": name, "version": version, "outcome": "first version", "records": []}
    started = start_rollout(candidate=candidate, alias="prod", mode="canary", steps=list(steps or DEFAULT_STEPS),
                            interval_s=interval_s, criteria=criteria, by=by, reason=why, return_state=True)
    if started.is_failed():
        return started
    rollout = started.result()["rollout"]
    print(f"{name}@prod: canary {rollout.id} started: {rollout.describe()}; waiting for the routers' verdict")
    verdict = await_verdict(storage, release, rollout.id, wait_s, poll_s)
    if verdict.outcome != "promoted":
        return Failed(message=verdict.message, data={"records": verdict.records} if verdict.records else None)
    print(verdict.message)
    return {"model": name, "version": version, "outcome": "promoted", "rollout": rollout.id, "records": verdict.records}
