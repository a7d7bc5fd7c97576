"""The promotion flow: pin -> (copy to the target registry) -> gates -> move the alias."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.states import Failed, State

from shardline.settings import StorageSettings
from shardline.tasks.promotion import announce_promotion, gate_refusal, move_alias, prepare_promotion, run_gates


@flow(name="promote-model", log_prints=True)
def promote_model(
    reference: str,
    to_alias: str,
    allow_breaking: bool = False,
    target_registry_url: str | None = None,
    by: str | None = None,
    reason: str = "",
) -> dict[str, Any] | State[Any]:
    """Point ``name@to_alias`` at the version ``reference`` names, if every gate passes.

    Args:
        reference: the candidate, ``name:version`` or ``name@alias``.
        to_alias: the alias to move, e.g. staging or prod.
        allow_breaking: let a signature that breaks the replaced version's callers through.
        target_registry_url: promote into another registry (another environment): the
            bundle is copied there and verified on arrival; the alias moves there.
        by: who asked, for the audit log (default: the OS user).
        reason: why, for the audit log.

    Returns:
        The move and every gate's verdict; a Failed state holding GateFailed when a
        gate refused.
    """
    storage = StorageSettings()
    plan = prepare_promotion(reference, to_alias, storage, target_registry_url)
    results = run_gates(plan, allow_breaking)
    refused = gate_refusal(plan, to_alias, results)
    if refused is not None:  # a verdict, not a crash: no traceback in the logs
        return Failed(message=str(refused), data=refused)
    move = move_alias(plan, to_alias, results, by, reason)
    announce_promotion(plan, to_alias, move)
    return {
        "model": plan.candidate.name,
        "alias": to_alias,
        "version": move.version,
        "previous": move.previous,
        "registry": plan.registry_url,
        "gates": [{"gate": r.gate, "passed": r.passed, "detail": r.detail} for r in results],
    }
