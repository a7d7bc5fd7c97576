"""One `batch run` or `batch resume` job as the CLI runs it: the request, its early checks, the flow, the outcome.

The command runs the job in a process of its own (the cold path: imports, a Dask cluster started
and closed) or hands it to its home's warm batch runner (``shardline.cli.batch_runner``), which runs
the same ``check_request`` and ``execute`` on a cluster it keeps; the user sees the same lines, the
same progress bar and the same exit code either way (``present``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import typer
from pydantic import ConfigDict

from shardline.cli.common import (
    EXIT_ALL_QUARANTINED,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_QUARANTINED,
    error_line,
    exit_code,
    one_line_user_errors,
)
from shardline.storage.job_records import JobParameters

Watcher = Callable[[int, int, int], None]  # (shards settled, shards in the job, rows): tasks.batch.ProgressWatcher


class JobRequest(JobParameters):
    """What `batch run` (or `batch resume`, from the job's record) asks for: the job's parameters and its SLA."""

    model_config = ConfigDict(frozen=True)

    sla: str | None = None
    deadline: str | None = None
    resume: bool = False  # `batch resume`: the recorded deadline is kept even when it has passed

    def to_json(self) -> dict[str, Any]:
        return self.model_dump()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobRequest:
        return cls.model_validate(data)


@dataclass(frozen=True)
class JobOutcome:
    """How a job ended, for the command to print: its exit code, summary, error line and state message."""

    code: int
    summary: dict[str, Any] | None = None
    error: str | None = None  # the line printed after "error: "
    message: str = ""  # the flow's final state message, printed after the summary

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobOutcome:
        return cls(int(data["code"]), data.get("summary"), data.get("error"), str(data.get("message") or ""))


def check_request(request: JobRequest) -> None:
    """The checks `batch run` and `batch resume` make before a flow run starts: every check the flow makes
    before it writes (``tasks.batch_admission.check_job``: the settings, SLA, priority, tenant, locations, GPU quota,
    model, input and output), so a wrong request starts no flow run. A resume keeps its recorded deadline,
    past or not.

    Raises:
        ShardlineError: what is wrong (the flow checks the same again when it starts).
    """
    from shardline.tasks.batch_admission import BatchJobSettings, check_job

    settings = BatchJobSettings.read(request.batch_rows, "--batch-rows")
    check_job(request, request.sla, request.deadline, settings, allow_past=request.resume)


def execute(request: JobRequest, watchers: Sequence[Watcher] = (), flow: Any = None) -> JobOutcome:
    """Run the batch flow (``flow``: the batch flow with other options) in this process on the Prefect API
    already chosen (``use_prefect_api``)."""
    if flow is None:
        from shardline.flows.batch_inference import batch_inference

        flow = batch_inference
    with one_line_user_errors():
        state = flow(
            model=request.model, input_uri=request.input_uri, output_uri=request.output_uri, tenant=request.tenant,
            passthrough=request.passthrough, batch_rows=request.batch_rows, variant=request.variant,
            sla=request.sla, deadline=request.deadline, priority=request.priority,
            capacity_type=request.capacity_type, watchers=list(watchers),
            return_state=True,
        )
    return outcome_of(state)


def outcome_of(state: Any) -> JobOutcome:
    """The outcome of the batch flow's final Prefect state."""
    result = state.result(raise_on_failure=False)
    if isinstance(result, BaseException):
        return JobOutcome(exit_code(result), error=error_line(result))
    summary: dict[str, Any] = result
    if summary["shards_quarantined"] and not summary["shards_committed"]:
        code = EXIT_ALL_QUARANTINED  # the data, not the run: running again cannot help
    elif state.is_failed():
        code = EXIT_FAILED
    else:
        code = EXIT_QUARANTINED if summary["shards_quarantined"] else EXIT_OK
    return JobOutcome(code, summary, message=state.message or "")


def refused(request: JobRequest) -> JobOutcome | None:
    """The outcome of a request that ``check_request`` refuses (its one line; exit code 2 for a wrong request,
    1 for a fault a re-run may not meet, such as storage down past the retries); None when it passes."""
    try:
        check_request(request)
    except Exception as e:
        return JobOutcome(exit_code(e), error=error_line(e))
    return None


def tenant_budget_state(tenant: str) -> Any:
    """The tenant's budget state now (``shardline.budgets.BudgetState``), or None: no tenants file, or no budget
    for the tenant (``cost.budgets.tenant_budget_state``, with this command's settings).

    Raises:
        ShardlineError: the tenants file or the price table is wrong (the job is refused, exit code 2).
    """
    from shardline.settings import StorageSettings, TenancySettings

    tenants_file = TenancySettings().tenants_file
    if not tenants_file:  # (before the imports below: through the ledger they load pyarrow, ~0.2 s a command)
        return None
    from shardline.cost.budgets import tenant_budget_state as budget_state_of

    storage = StorageSettings()
    return budget_state_of(tenants_file, tenant, storage.home, storage.storage_options)


def apply_budget(request: JobRequest) -> tuple[JobRequest, JobOutcome | None, str | None]:
    """What the tenant's budget makes of a new job (docs/cost.md, "Budgets"): ``hard`` refuses it (exit code 2,
    the figures), ``soft`` runs it at low priority on spot capacity (``soft_line``: where its cluster has none,
    on-demand, said so), ``warn`` runs it as asked; warn, soft and hard emit ``shardline.budget.warning``. A
    resumed job was accepted before: it is never refused.

    Returns:
        The request to run (on soft: priority low, capacity type spot), the refusal (None: run it), and the
        budget's line for a job that runs (None: nothing to say), which ``say_budget`` prints once the request's
        own checks have passed: a request they refuse does not run, and is not told that it does.
    """
    from shardline.cli.common import EXIT_USAGE
    from shardline.errors import BudgetExceeded, ShardlineError

    try:
        state = tenant_budget_state(request.tenant)
    except ShardlineError as e:
        return request, JobOutcome(EXIT_USAGE, error=str(e)), None
    if state is None or state.state == "ok":
        return request, None, None
    announce_budget(state)
    if state.state == "soft":
        from shardline.tenants import PRIORITIES

        if request.priority is not None and request.priority not in PRIORITIES:
            return request, None, None  # a wrong priority is refused by the request's checks, not made 'low'
        request = request.model_copy(update={"priority": "low", "capacity_type": "spot"})
    try:
        return request, None, state.job_line(request.resume, soft_line() if state.state == "soft" else "")
    except BudgetExceeded as e:
        return request, JobOutcome(EXIT_USAGE, error=str(e)), None


def say_budget(line: str | None) -> None:
    """The budget's line from ``apply_budget``, in the warning's colour, when a job starts."""
    if line is not None:
        typer.secho(line, fg="yellow", err=True)


def soft_line() -> str:
    """Where a job past its tenant's soft limit runs: on spot capacity when its cluster can give it
    (``fairness.job_capacity``: its own Kubernetes cluster, or one the metering settings call spot), else said."""
    from pydantic import ValidationError

    from shardline.settings import DaskSettings, MeteringSettings
    from shardline.tasks.fairness import job_capacity

    try:
        dask, metering = DaskSettings(), MeteringSettings()
    except ValidationError:  # the request's checks say what is wrong with them, next
        return "this job runs at low priority"
    if job_capacity("spot", dask, metering) == "spot":
        return "this job runs at low priority on spot capacity"
    why = ("SHARDLINE_DASK_KUBERNETES_SPOT=false: the cluster has no spot nodes" if dask.cluster == "kubernetes" else
           f"SHARDLINE_DASK_CLUSTER={dask.cluster} cannot move it; on kubernetes its workers would run on spot nodes")
    return f"this job runs at low priority on {metering.capacity_type} capacity, because none is spot here ({why})"


def announce_budget(state: Any) -> None:
    """``shardline.budget.warning`` to the Prefect API, when one is known (an event never stops the job)."""
    from shardline.event_catalog import BUDGET_WARNING, tenant_resource
    from shardline.events import post_event, prefect_api_url
    from shardline.settings import StorageSettings

    api = prefect_api_url(StorageSettings().home)
    if api is not None:
        post_event(api, BUDGET_WARNING, tenant_resource(state.tenant), {**state.to_json(), "tier": "batch"})


def progress_bar(enabled: bool) -> tuple[Any, Watcher]:
    """The shards progress bar (a rich ``Progress``, to enter) and the watcher that moves it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("shards"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[rows]:,} rows"), TimeElapsedColumn(), disable=not enabled,
    )
    task_id = bar.add_task("shards", total=None, rows=0)

    def listen(settled: int, total: int, rows: int) -> None:
        bar.update(task_id, completed=settled, total=total, rows=rows)

    return bar, listen


def present(outcome: JobOutcome, json_out: bool) -> int:
    """Print how the job ended (the error line, or the summary and message, then the JSON); returns the exit code.
    With ``json_out`` the JSON is all that goes to stdout (the summary goes to stderr), so that it pipes to jq."""
    import json

    if outcome.error is not None:
        typer.secho(f"error: {outcome.error}", fg="red", err=True)
    if outcome.summary is not None:
        _print_summary(outcome.summary, outcome.message, err=json_out)
        if json_out:
            typer.echo(json.dumps(outcome.summary, default=str))
    return outcome.code


def _print_summary(summary: dict[str, Any], message: str, err: bool = False) -> None:
    from shardline.figures import rate, rows_quarantined, shard_counts, span

    scored, seconds = summary["rows_scored"], summary["steady_seconds"]
    lines = [
        ("job", summary["job_id"]),
        ("model", summary["model"]),
        ("shards", shard_counts(summary["shards"], summary["shards_committed"], summary["shards_quarantined"],
                                summary["shards_skipped"])),
        ("rows in", f"{summary['rows_in']:,}"),
        ("rows out", f"{summary['rows_out']:,}"),
        ("rows quarantined", rows_quarantined(summary["rows_quarantined"], summary.get("shards_unreadable", 0))),
        ("throughput", f"{rate(scored, seconds, 'rows')} over {span(seconds)}" if scored else "nothing scored in "
                       "this run"),
        ("output", summary["output"]),
        ("manifest", summary["manifest"]),
    ]
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        typer.echo(f"{key.rjust(width)}  {value}", err=err)
    for shard, reason in summary["quarantined"].items():
        typer.secho(f"quarantined {shard}: {reason}", fg="yellow", err=err)
    if summary.get("shadowed_columns"):
        from shardline.storage.scoring import shadowed_note

        typer.secho(f"note: {shadowed_note(summary['shadowed_columns'])}", fg="yellow", err=err)
    if message:
        typer.echo(message, err=err)
