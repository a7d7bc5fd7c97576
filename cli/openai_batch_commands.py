"""`shardline batch openai`: run the ``openai-batch`` flow in this process and print how it ended.

The command runs cold (no warm runner: the model loads in this process, in about a second for the tiny
LLM), in the supervised child ``cli.main`` starts for it, so nothing it starts outlives it.
"""

from __future__ import annotations

import json
from typing import Any

import typer

from shardline.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_QUARANTINED,
    error_line,
    exit_code,
    one_line_user_errors,
)


def run_openai_batch(input_uri: str, output_uri: str, lines_per_part: int, tenant: str, json_out: bool) -> int:
    """Check the request as the flow would before it writes (a wrong one starts no flow run: one line, exit 2),
    then run the flow on the Prefect API the settings choose; print the counts and files; returns the exit code."""
    from shardline.cli.prefect_commands import use_prefect_api
    from shardline.errors import PrefectServerUnavailable
    from shardline.tasks.openai_batch_survey import OpenAIBatchSettings, check_openai_batch

    try:
        settings = OpenAIBatchSettings.read()
        plan = check_openai_batch(input_uri, output_uri, lines_per_part, tenant, settings)
        budget_line = _budget(tenant, begun=plan.recorded or plan.finished is not None)
    except Exception as e:
        typer.secho(f"error: {error_line(e)}", fg="red", err=True)
        return exit_code(e)
    if budget_line is not None:
        typer.secho(budget_line, fg="yellow", err=True)
    try:
        use_prefect_api()
    except PrefectServerUnavailable as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        return EXIT_FAILED
    from shardline.flows.openai_batch import openai_batch

    with one_line_user_errors():
        state = openai_batch(input_uri=input_uri, output_uri=output_uri, lines_per_part=lines_per_part,
                             tenant=tenant, return_state=True)
    result = state.result(raise_on_failure=False)
    if isinstance(result, BaseException):
        typer.secho(f"error: {error_line(result)}", fg="red", err=True)
        return exit_code(result)
    summary: dict[str, Any] = result
    _print_summary(summary, err=json_out)  # with --json, stdout holds the JSON alone
    if json_out:
        typer.echo(json.dumps(summary))
    return EXIT_QUARANTINED if summary["failed"] else EXIT_OK


def _budget(tenant: str, begun: bool) -> str | None:
    """The tenant's monthly budget on this job (docs/cost.md, "Budgets"; its use is metered as a batch job's):
    the line to say before it runs, or None. At the hard limit a job no earlier run began is new work, refused.

    Raises:
        BudgetExceeded: the tenant is at its hard limit and the job is new.
        ShardlineError: the tenants file or the price table is wrong.
    """
    from shardline.cli.batch_jobs import announce_budget, tenant_budget_state
    from shardline.tasks.openai_batch_survey import OPENAI_SOFT

    state = tenant_budget_state(tenant)
    if state is None or state.state == "ok":
        return None
    announce_budget(state)
    return state.job_line(begun, OPENAI_SOFT)


def _print_summary(summary: dict[str, Any], err: bool = False) -> None:
    lines = [
        ("batch", summary["batch_id"]),
        ("model", summary["model"]),
        ("lines", f"{summary['total']} ({summary['completed']} answered, {summary['failed']} failed)"),
        ("parts", f"{summary['parts']} ({summary['parts_answered']} answered now, {summary['parts_skipped']} "
                  "already committed)"),
        ("output", summary["output"]),
        ("errors", summary["errors"]),
        ("batch object", summary["batch"]),
    ]
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        typer.echo(f"{key.rjust(width)}  {value}", err=err)
