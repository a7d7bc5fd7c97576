"""The ``shardline`` command: demo, batch runs, the model registry, and the local Prefect server."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from typer.core import TyperCommand

from shardline.cli import mlflow_commands  # noqa: E402,F401 - adds model import and model watch-mlflow to model_app
from shardline.cli.batch_jobs import JobOutcome, JobRequest, apply_budget, present
from shardline.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, OFF_THE_NETWORK, open_registry, unparsed_setting
from shardline.cli.help_text import ParagraphHelp
from shardline.cli.model_commands import model_app
from shardline.errors import ShardlineError

app = typer.Typer(cls=ParagraphHelp, help="Shardline: batch-first ML inference on Prefect and Dask.",
                  no_args_is_help=True)
batch_app = typer.Typer(help="Batch inference over Parquet shards.", no_args_is_help=True)
app.add_typer(batch_app, name="batch")
app.add_typer(model_app, name="model")
from shardline.cli.drift_commands import drift_app  # noqa: E402

app.add_typer(drift_app, name="drift")
from shardline.cli.prefect_commands import prefect_app, use_prefect_api  # noqa: E402

app.add_typer(prefect_app, name="prefect")
from shardline.cli.rollout_commands import rollout_app  # noqa: E402

app.add_typer(rollout_app, name="rollout")
from shardline.cli.tenant_commands import tenant_app  # noqa: E402

app.add_typer(tenant_app, name="tenant")
from shardline.cli.capacity_commands import plan_app  # noqa: E402

app.add_typer(plan_app, name="plan")
from shardline.cli.cost_commands import cost_app  # noqa: E402

app.add_typer(cost_app, name="cost")
from shardline.cli.slo_commands import slo_app  # noqa: E402

app.add_typer(slo_app, name="slo")


# How this process runs batch jobs, as ``main`` decided: a supervised child always runs them here (cold);
# the command the user started hands them to the home's warm runner, or falls back to a supervised child.
_PROCESS = {"supervised_child": False, "supervise_fallback": False}


def runner_applies() -> bool:
    """Whether batch jobs go to the home's warm runner (cli/batch_runner.py): POSIX, not a supervised
    child, ``SHARDLINE_PREFECT_SERVER=local`` and ``SHARDLINE_BATCH_RUNNER_IDLE_S`` above 0."""
    if _PROCESS["supervised_child"] or not hasattr(os, "fork"):
        return False
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from shardline.settings import BatchSettings, PrefectServerSettings

    try:
        return PrefectServerSettings().server == "local" and BatchSettings().runner_idle_s > 0
    except (ValidationError, SettingsError):  # a bad setting: the cold path reports it as it reports any
        return False


def run_batch_job(request: JobRequest, progress: bool = True, check: bool = False,
                  budget_line: str | None = None) -> JobOutcome:
    """Run a batch job: on the home's warm runner when it applies, else in this process (cold).

    ``check``: the checks the flow makes before it writes, first (``check_request``): a wrong request starts
    no flow run. ``budget_line`` (``apply_budget``'s) is printed once those checks have passed. A command that
    ``main`` left unsupervised for the runner runs its job in a supervised child when the runner cannot take it
    (busy with other settings, or it did not start).
    """
    if runner_applies():
        outcome = _run_on_runner(request, progress, check, budget_line)
        if outcome is not None:
            return outcome
        if _PROCESS["supervise_fallback"]:
            from shardline.cli.supervise import run_supervised

            raise typer.Exit(run_supervised(sys.argv[1:]))  # the child says the budget's line itself
    return _run_here(request, progress, check, budget_line)


def _run_here(request: JobRequest, progress: bool, check: bool, budget_line: str | None) -> JobOutcome:
    from shardline.cli.batch_jobs import execute, progress_bar, refused, say_budget
    from shardline.errors import PrefectServerUnavailable

    if check:
        refusal = refused(request)  # a wrong request fails before Prefect starts (the flow checks it again)
        if refusal is not None:
            return refusal
    say_budget(budget_line)
    try:
        use_prefect_api()  # the local Prefect server, unless PREFECT_API_URL or SHARDLINE_PREFECT_SERVER say otherwise
    except PrefectServerUnavailable as e:
        return JobOutcome(EXIT_FAILED, error=str(e))
    bar, listen = progress_bar(progress)
    with bar:
        return execute(request, [listen])


def _run_on_runner(request: JobRequest, progress: bool, check: bool, budget_line: str | None) -> JobOutcome | None:
    """The job run by the home's warm runner; None when it cannot take it (the caller runs it cold). The
    budget's line comes before the job's first line: the runner sends none for a request it refuses."""
    from shardline.cli import batch_runner as runner
    from shardline.cli.batch_jobs import progress_bar, say_budget
    from shardline.settings import StorageSettings

    def say(text: str) -> None:
        typer.secho(text, fg="cyan", err=True)

    home = StorageSettings().home
    found = runner.find(home)
    # A wrong request starts nothing, not even a runner, nor replaces one with other settings: it is checked
    # here unless a runner that would take it runs (which then checks it, warm).
    if check and (found is None or found.fingerprint != runner.fingerprint()):
        from shardline.cli.batch_jobs import refused

        refusal = refused(request)
        if refusal is not None:
            return refusal
    bar, listen = progress_bar(progress)
    entered = [False]
    with contextlib.ExitStack() as shown:

        def started() -> None:  # the bar appears with the job's first line, as it does in a cold run
            if not entered[0]:
                entered[0] = True
                say_budget(budget_line)
                shown.enter_context(bar)

        def line(text: str, err: bool) -> None:
            started()
            typer.echo(text, err=err)

        def moved(settled: int, total: int, rows: int) -> None:
            started()
            listen(settled, total, rows)

        for attempt in range(2):  # a runner that stopped as this command reached it is started again, once
            try:
                record = runner.ensure(home, say)
                if record is None:
                    return None
                outcome = JobOutcome.from_json(runner.submit(record, request.to_json(), check, line, moved))
                if not entered[0] and outcome.summary is not None:
                    say_budget(budget_line)  # a job that ran without a line (a finished one, run again)
                return outcome
            except runner.RunnerGone as e:
                if e.started:
                    return JobOutcome(EXIT_FAILED, error=str(e))
                if attempt:
                    say(f"{e}: this job runs on its own")
    return None


@batch_app.command("run")
def batch_run(
    model: str = typer.Option(..., help="Model reference: name@alias or name:version."),
    input: str = typer.Option(..., "--input", help="Folder (or file) of Parquet shards: a path or URL."),
    output: str = typer.Option(..., "--output", help="Folder for the scored parts: a path or URL."),
    tenant: str = typer.Option("default", help="Tenant the job runs for."),
    passthrough: Optional[list[str]] = typer.Option(
        None, help="Input column to copy to the output (repeat); default: every column the model does not read."
    ),
    batch_rows: Optional[int] = typer.Option(None, min=1, help="Rows per batch (bounds worker memory)."),
    variant: Optional[str] = typer.Option(
        None, help="Precision variant to run (e.g. int8), or 'auto' to let placement choose from the "
        "version's profiles; default: the fp32 model."
    ),
    sla: Optional[str] = typer.Option(
        None, "--sla", help="How long the job may take: 2h, 90m, 1h30m \\[default: SHARDLINE_BATCH_DEFAULT_SLA, 24h]."
    ),
    deadline: Optional[str] = typer.Option(
        None, "--deadline", help="When the job must be done, ISO 8601: 2026-12-01T06:00Z (instead of --sla)."
    ),
    priority: Optional[str] = typer.Option(
        None, "--priority", help="high, normal or low (backfills) \\[default: the tenant's, else normal]."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON, alone on stdout."),
) -> None:
    """Score every row of the input shards and write Parquet parts to the output.

    Exit codes: 0 all scored (or already scored: a finished job writes nothing), 3 some
    shards quarantined, 5 every shard quarantined (the data is wrong: running again will not
    help), 1 failed (re-run to resume), 2 the request was wrong (model, URL, input, SLA,
    tenant, prefixes, quota, a setting; an output that is a file, read-only, in use by
    another running job, holding another model's parts or a `batch openai` job's files, or
    inside or holding another job's output folder): checked before any flow run.
    """
    request = JobRequest(model=model, input_uri=input, output_uri=output, tenant=tenant, passthrough=passthrough,
                         batch_rows=batch_rows, variant=variant, sla=sla, deadline=deadline, priority=priority)
    request, refusal, budget_line = apply_budget(request)  # before any flow run: at its hard limit nothing starts
    if refusal is not None:
        raise typer.Exit(present(refusal, json_out))
    raise typer.Exit(present(run_batch_job(request, progress=not json_out, check=True, budget_line=budget_line),
                             json_out))


def _job_records() -> Any:
    from shardline.settings import StorageSettings
    from shardline.storage.job_records import JobRecords

    storage = StorageSettings()
    return JobRecords(storage.home, storage.storage_options)


def _job_lines(record: Any) -> list[tuple[str, str]]:
    """The `batch status` view of a job record (as it stands: ``JobRecords.as_it_stands``)."""
    from datetime import datetime, timezone

    from shardline.figures import rate, span
    from shardline.settings import BatchSettings

    now = datetime.now(timezone.utc)
    state = record.state
    stale = (now - record.updated_at).total_seconds()
    done, total = record.shards_done, record.shards_total
    resume = f"run the same command again, or `shardline batch resume {record.job_id}`, to resume it"
    if state == "running" and stale > max(60.0, 6 * BatchSettings().sla_check_interval_s):
        state = f"running? (no update for {span(stale)}: the flow may have stopped; `shardline batch resume {record.job_id}`)"
    elif state == "interrupted":
        state = f"interrupted (its run stopped before the end and no run holds its output now; {resume})"
    pct = f" ({100 * done / total:.0f}%)" if total else ""
    stopped = record.state in ("failed", "interrupted")  # a re-run resumes it: it has no finish until then
    if stopped:
        eta = f"none: the job is not running ({total - done} of {total} shards left)"
    elif record.finished_at is not None:
        eta = f"finished {record.finished_at.isoformat(timespec='seconds')}"
    elif record.projected_finish is not None:
        left = (record.projected_finish - now).total_seconds()
        eta = f"{record.projected_finish.isoformat(timespec='seconds')} (in {span(max(left, 0))})"
    else:
        eta = "unknown (no throughput measured yet)"
    to_deadline = (record.deadline - now).total_seconds()
    deadline = record.deadline.isoformat(timespec="seconds")
    if record.finished_at is None or stopped:
        deadline += f" (in {span(to_deadline)})" if to_deadline >= 0 else f" ({span(-to_deadline)} ago)"
    sla = record.sla_status
    if stopped and to_deadline < 0 and done < total:
        sla = f"breached (the deadline passed with {total - done} shards left)"
    elif stopped:
        sla = f"{sla} when it stopped (it is not running)"
    params = record.parameters
    return [
        ("job", record.job_id), ("state", state), ("tenant", params.tenant),
        ("model", f"{params.model} -> {record.model_pinned}"), ("input", params.input_uri), ("output", params.output_uri),
        ("progress", f"{done}/{total} shards{pct}, {record.rows_done:,} rows this run"),
        ("throughput", f"{rate(record.rows_per_second, 1, 'rows')}, {rate(record.shards_per_second, 1, 'shards')}"),
        ("started", record.started_at.isoformat(timespec="seconds")), ("deadline", deadline), ("ETA", eta),
        ("SLA", sla), ("runs", str(record.runs)), ("message", record.message or "-"),
    ]


@batch_app.command("status")
def batch_status(
    job: Optional[str] = typer.Argument(None, help="Job id (or the start of one); none lists recent jobs."),
    json_out: bool = typer.Option(False, "--json", help="Print the job record as JSON."),
) -> None:
    """Progress, throughput, ETA against the SLA and state of a batch job (from its job record; a running job whose
    run is gone, its output's lease free or lapsed, reads `interrupted`, its progress from the output's ledger)."""
    records = _job_records()
    if job is None:
        ids = records.ids()[-20:]
        if not ids:
            from shardline.settings import StorageSettings

            typer.echo(f"no batch jobs recorded under {StorageSettings().home} yet (SHARDLINE_STORAGE_HOME names "
                       "the home; `make demo` prints the line for its own)")
        for job_id in ids:
            r = records.find(job_id)
            if r is not None:
                r = records.as_it_stands(r)
                typer.echo(f"{r.job_id}  {r.state:<11} {r.sla_status:<9} {r.shards_done}/{r.shards_total} shards  "
                           f"{r.parameters.tenant}  {r.parameters.model}")
        return
    record = records.as_it_stands(records.read(job))
    if json_out:
        typer.echo(record.model_dump_json())
        return
    lines = _job_lines(record)
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        typer.echo(f"{key.rjust(width)}  {value}")


@batch_app.command("resume")
def batch_resume(
    job: str = typer.Argument(..., help="Job id (or the start of one) to run again."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON, alone on stdout."),
) -> None:
    """Run a job again with its recorded parameters and deadline; committed parts are kept, only the rest runs.

    Exit codes as for `batch run`.
    """
    record = _job_records().read(job)
    p = record.parameters
    typer.echo(f"resuming job {record.job_id} ({record.state}, {record.shards_done}/{record.shards_total} shards settled)")
    # the pinned version, not the alias: were the alias moved since, the parts already made would not count
    request = JobRequest(**{**p.model_dump(), "model": record.model_pinned or p.model},
                         deadline=record.deadline.isoformat(), resume=True)
    request, refusal, budget_line = apply_budget(request)  # accepted before: said, never refused
    if refusal is not None:
        raise typer.Exit(present(refusal, json_out))
    raise typer.Exit(present(run_batch_job(request, progress=not json_out, check=True, budget_line=budget_line),
                             json_out))


@batch_app.command("openai")
def batch_openai(
    input: str = typer.Argument(..., help="The OpenAI Batch file (JSONL): a path or URL."),
    output: str = typer.Option(..., "--output", help="Folder for output.jsonl, errors.jsonl and batch.json: a path "
                               "or URL."),
    lines_per_part: int = typer.Option(100, "--lines-per-part", min=1, help="Lines answered and committed together; "
                                       "a re-run answers only the parts not yet committed."),
    tenant: str = typer.Option("default", help="Tenant the job runs for."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON, alone on stdout."),
) -> None:
    """Answer an OpenAI Batch file (/v1/chat/completions, /v1/completions, /v1/embeddings lines) with the one
    model it names; run it again to resume.

    Exit codes: 0 every line answered, 3 some lines failed (in errors.jsonl), 1 failed (re-run to resume),
    2 the file or request was refused (a custom_id twice, two models, a model that does not fit the endpoint,
    an output holding another job, a `batch run` job's output, or one inside or holding another job's output
    folder).
    """
    from shardline.cli.openai_batch_commands import run_openai_batch

    raise typer.Exit(run_openai_batch(input, output, lines_per_part, tenant, json_out))


@app.command()
def demo(
    workdir: Path = typer.Option(Path("shardline-demo"), help="Folder for the demo's registry, data and output."),
    shards: int = typer.Option(8, min=1, help="Input shards to write."),
    rows: int = typer.Option(25_000, min=1, help="Rows per shard."),
) -> None:
    """Build a real model and data set here, run the batch flow on a local Dask cluster, check the output."""
    import numpy as np
    import pyarrow.dataset as ds

    from shardline.build.examples import breast_cancer, golden_table, package_breast_cancer, split, write_shards
    from shardline.quality.profile import attach_reference_profile

    from shardline.cli.prefect_server import home_environment

    workdir = workdir.resolve()
    home = workdir / "home"
    if workdir.exists():
        from shardline.cli.prefect_commands import stop_home

        stop_home(home)  # a former demo's runner, Prefect server and workers: their home is about to be deleted
        shutil.rmtree(workdir)
    # The demo is an entry point choosing its own home, as `eval "$(shardline prefect env)"` does for a shell:
    # set for this process (and the runner, server and Dask workers it starts), the home's Prefect profile
    # included, so that its run, and what the README schedules later with the same lines, share one Prefect
    # server and the user's own Prefect profile is neither read nor changed. Not a flow parameter on purpose: a
    # `home` parameter would let anyone who starts a deployment move the registry and the metering
    # ledger that GPU-hour quotas are counted in.
    for name, value in home_environment(home).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    typer.echo(f"1/4 training and packaging the breast-cancer classifier in {workdir}")
    manifest, estimator = package_breast_cancer(workdir / "bundle")
    # The training rows' profile and the model's outputs on them: the data contract and drift baseline.
    attach_reference_profile(workdir / "bundle", golden_table(split(breast_cancer())[0]).drop(["target"]))
    registry = open_registry()
    pushed = registry.push(workdir / "bundle")
    registry.set_alias(pushed.name, "prod", pushed.version or 1, reason="demo")
    typer.echo(f"2/4 registered {pushed.reference} as {pushed.name}@prod; writing {shards} shards of {rows:,} rows")
    write_shards(workdir / "input", shards, rows)
    typer.echo("3/4 running the batch-inference flow on a local Dask cluster")
    outcome = run_batch_job(JobRequest(model=f"{pushed.name}@prod", input_uri=str(workdir / "input"),
                                       output_uri=str(workdir / "output"), tenant="demo"))
    code = present(outcome, json_out=False)
    if outcome.summary is None or code != EXIT_OK:
        raise typer.Exit(code or EXIT_FAILED)
    typer.echo("4/4 checking the output against scikit-learn's own predictions")
    inputs = ds.dataset(workdir / "input").to_table()
    scored = ds.dataset(workdir / "output").to_table().sort_by("id")
    names = breast_cancer().names
    expected = estimator.predict(np.column_stack([inputs.column(n).to_numpy() for n in names]).astype(np.float32))
    expected = expected[np.argsort(inputs.column("id").to_numpy())]
    ids_ok = np.array_equal(scored.column("id").to_numpy(), np.sort(inputs.column("id").to_numpy()))
    agree = float((scored.column("label").to_numpy() == expected).mean())
    if not ids_ok or agree < 0.999:
        typer.secho(f"demo check failed: ids match: {ids_ok}, labels agree on {agree:.4%}", fg="red", err=True)
        raise typer.Exit(EXIT_FAILED)
    typer.secho(
        f"demo OK: {scored.num_rows:,} rows scored, every id once, labels agree with scikit-learn on "
        f"{agree:.2%} of rows. Output: {workdir / 'output'}",
        fg="green",
    )
    from shardline.local_prefect import find

    server = find(home)
    if server is not None:
        typer.echo(f"The run is in the Prefect UI at {server.ui_url}: the Prefect server of the demo's home, which "
                   "keeps running with its warm batch runner for the next runs (`shardline prefect stop` stops both, "
                   "`make clean` too).")
    typer.echo(f"To use this home in a new shell (after `. .venv/bin/activate`), as README.md's next sections do:\n"
               f"  export SHARDLINE_STORAGE_HOME={shlex.quote(str(home))}\n"
               '  eval "$(shardline prefect env)"    # and its Prefect server for prefect commands')


class ServeCommand(TyperCommand):
    """``serve``'s command: its help shows the settings it would run with here, computed when the help is
    shown (not at import): each option's default from ``OnlineSettings`` (this shell's SHARDLINE_ONLINE_*
    variables included), and below them ``serving_settings``, the defaults resolved from this machine's cores."""

    def format_help(self, ctx: Any, formatter: Any) -> None:  # typer's own (vendored) click Context, HelpFormatter
        from pydantic import ValidationError

        from shardline.online.server import serving_settings
        from shardline.settings import OnlineSettings, RuntimeSettings

        try:
            online, runtime, note = OnlineSettings(), RuntimeSettings(), "this shell's SHARDLINE_* variables included"
        except ValidationError:
            online, runtime = OnlineSettings.model_construct(), RuntimeSettings.model_construct()
            note = "without this shell's SHARDLINE_* variables: one of them is invalid"
        values = online.model_dump()
        for param in self.params:  # the options' help names their defaults as {field} of OnlineSettings
            template = getattr(param, "help", None)
            if isinstance(template, str):
                param.help = template.format_map(values)  # type: ignore[attr-defined]
        self.epilog = serving_help(serving_settings(online, runtime), note)
        super().format_help(ctx, formatter)


def serving_help(effective: dict[str, Any], note: str) -> str:
    """The paragraph of ``serve --help`` that says what the server runs with on this machine."""
    on = effective
    return (
        f"Runs here with ({on['cores']} cores; {note}): {on['workers']} server process(es) "
        f"(SHARDLINE_ONLINE_WORKERS, 0: one per core); {on['inference_threads']} inference threads per process "
        f"(SHARDLINE_ONLINE_INFERENCE_THREADS, 0: one per core); up to {on['max_concurrent_batches']} batches of a "
        f"model at once (SHARDLINE_ONLINE_MAX_CONCURRENT_BATCHES, 0: one per inference thread); "
        f"{on['intra_op_threads']} onnxruntime intra-op thread(s) per call (SHARDLINE_RUNTIME_INTRA_OP_THREADS, 0: "
        f"cores / (processes x inference threads), at least 1); spinning {'on' if on['spinning'] else 'off'} (SHARDLINE_RUNTIME_SPINNING); models whose "
        f"batch takes under {on['inline_max_ms']:g} ms run on the event loop (SHARDLINE_ONLINE_INLINE_MAX_MS); "
        f"batches of at most {on['max_batch_size']} rows without a profile (SHARDLINE_ONLINE_MAX_BATCH_SIZE), "
        f"waiting {on['max_batch_wait_ms']:g} ms for more (SHARDLINE_ONLINE_MAX_BATCH_WAIT_MS); device "
        f"{on['device']} (SHARDLINE_RUNTIME_DEVICE). The server logs the same at start-up ('serving settings')."
    )


@app.command(cls=ServeCommand)
def serve(
    host: Optional[str] = typer.Option(None, help="Address to listen on \\[default: {host}; SHARDLINE_ONLINE_HOST]."),
    port: Optional[int] = typer.Option(
        None, min=0, max=65_535, help="TCP port \\[default: {port}; SHARDLINE_ONLINE_PORT]."
    ),
    tenants: Optional[Path] = typer.Option(
        None, "--tenants", help="Tenants YAML: API key hashes, models, priority, quotas (the file batch jobs read) "
        "\\[SHARDLINE_TENANTS_FILE, else SHARDLINE_ONLINE_TENANTS_FILE]."
    ),
    workers: Optional[int] = typer.Option(
        None, min=0, help="Server processes sharing the port, each with 1/N of every tenant quota; 0: one per "
        "core \\[default: {workers}; SHARDLINE_ONLINE_WORKERS].",
    ),
    metrics_host: Optional[str] = typer.Option(
        None, help="Address of the Prometheus /metrics listener (it names every tenant: keep it private) "
        "\\[default: {metrics_host}; SHARDLINE_ONLINE_METRICS_HOST]."),
    metrics_port: Optional[str] = typer.Option(
        None, help="Port of the /metrics listener; 0 or 'off': none. The main port has no /metrics "
        "\\[default: {metrics_port}; SHARDLINE_ONLINE_METRICS_PORT]."),
    max_connections: Optional[int] = typer.Option(
        None, min=0, help="Open connections per process; at the cap the longest-idle one makes room, or 503 when "
        "all are busy; 0: from ulimit -n (less an eighth, at most 4096) \\[default: {max_connections}; SHARDLINE_ONLINE_MAX_CONNECTIONS]."),
    max_in_flight: Optional[int] = typer.Option(
        None, min=0, help="Requests answered at once per process, more get 503 + Retry-After (not health checks); "
        "0: 3/4 of the connection cap \\[default: {max_in_flight}; SHARDLINE_ONLINE_MAX_IN_FLIGHT]."),
    max_header_bytes: Optional[int] = typer.Option(
        None, min=1024, help="Largest request head in bytes, else 431 \\[default: {max_header_bytes}; "
        "SHARDLINE_ONLINE_MAX_HEADER_BYTES; also SHARDLINE_ONLINE_MAX_HEADERS, {max_headers} fields]."),
    header_timeout: Optional[float] = typer.Option(
        None, help="Seconds a new connection has to send its first request's head, else 408 and closed "
        "\\[default: {header_timeout_s:g}; SHARDLINE_ONLINE_HEADER_TIMEOUT_S; later heads: SHARDLINE_ONLINE_KEEP_ALIVE_S, "
        "{keep_alive_s:g}]."),
    body_timeout: Optional[float] = typer.Option(
        None, help="Seconds a request's whole body has to arrive, else 408 and closed \\[default: {body_timeout_s:g}; "
        "SHARDLINE_ONLINE_BODY_TIMEOUT_S]."),
    fd: Optional[int] = typer.Option(
        None, min=0, help="Serve on this inherited socket (a file descriptor) instead of --host/--port: for a "
        "supervisor that binds the port itself, as the router does for its replicas \\[SHARDLINE_ONLINE_FD]."),
    metrics_fd: Optional[int] = typer.Option(
        None, min=0, help="The same for the /metrics listener \\[SHARDLINE_ONLINE_METRICS_FD]."),
) -> None:
    """Serve the tenants' models over HTTP: Open Inference Protocol (/v2) and OpenAI-style /v1 (embeddings, completions).

    Models come from the registry (SHARDLINE_STORAGE_HOME or SHARDLINE_STORAGE_REGISTRY_URL)
    through the same model cache as batch jobs; idle models are unloaded and load on
    their next request. Prometheus metrics are on their own listener (--metrics-host,
    --metrics-port). Stop it with Ctrl-C (SIGINT) or SIGTERM.
    """
    from pydantic import ValidationError

    from shardline.cli.common import fail
    from shardline.settings.problems import settings_error
    from shardline.online.server import serve as run_server
    from shardline.settings import OnlineSettings, RuntimeSettings, StorageSettings, TenancySettings

    given: dict[str, Any] = {"host": host, "port": port, "workers": workers, "metrics_host": metrics_host, "metrics_port": metrics_port,
                             "max_connections": max_connections, "max_in_flight": max_in_flight,
                             "max_header_bytes": max_header_bytes, "header_timeout_s": header_timeout,
                             "body_timeout_s": body_timeout, "fd": fd, "metrics_fd": metrics_fd}
    options = {"header_timeout_s": "--header-timeout", "body_timeout_s": "--body-timeout"}
    try:
        online = OnlineSettings.model_validate({k: v for k, v in given.items() if v is not None})
        tenancy = TenancySettings(tenants_file=str(tenants)) if tenants is not None else TenancySettings()
        storage = StorageSettings()
        with _budget_publisher(tenancy, storage):
            run_server(online, storage, RuntimeSettings(), tenancy)
    except ShardlineError as e:
        raise fail(e) from e
    except ValidationError as e:
        raise fail(settings_error(e, _options_given(given, options))) from e


@contextlib.contextmanager
def _budget_publisher(tenancy: Any, storage: Any) -> Any:
    """The tenants' budget states priced from the ledger beside the server or router, every
    SHARDLINE_METERING_BUDGET_REFRESH_S (``cost/budgets.py``; the server processes and the router read them): only when the
    tenants file gives a tenant a budget. A wrong price table stops the start."""
    from shardline.capacity.prices import prices_path
    from shardline.cost.budgets import BudgetPublisher
    from shardline.settings import MeteringSettings
    from shardline.storage.ledger import LedgerStore
    from shardline.tenants import load_tenants_file

    if not tenancy.tenants_file or not load_tenants_file(tenancy.tenants_file).budgets():
        yield
        return
    prices = prices_path()
    publisher = BudgetPublisher(tenancy.tenants_file, LedgerStore(storage.home, storage.storage_options),
                                str(prices) if prices is not None else None, MeteringSettings().budget_refresh_s)
    publisher.start()
    try:
        yield
    finally:
        publisher.stop()


@app.command()
def router(
    config: Optional[Path] = typer.Option(
        None, "--config", help="router.yaml: the replica groups (docs/routing.md) \\[SHARDLINE_ROUTER_CONFIG_FILE]."),
    local_replicas: Optional[int] = typer.Option(
        None, "--local-replicas", min=1, max=64,
        help="Start and supervise this many `shardline serve` replicas on loopback instead \\[SHARDLINE_ROUTER_LOCAL_REPLICAS]."),
    min_replicas: Optional[int] = typer.Option(
        None, "--min-replicas", min=0, max=64,
        help="With --local-replicas N: scale between this and N by demand; 0 scales to zero (requests wait while "
        "one starts) \\[default: N, no scaling; SHARDLINE_ROUTER_MIN_REPLICAS]."),
    tenants: Optional[Path] = typer.Option(
        None, "--tenants", help="The tenants YAML (the one its replicas read) \\[SHARDLINE_TENANTS_FILE]."),
    host: Optional[str] = typer.Option(None, help="Address to listen on \\[default: 127.0.0.1; SHARDLINE_ROUTER_HOST]."),
    port: Optional[int] = typer.Option(None, min=0, max=65_535, help="TCP port \\[default: 8080; SHARDLINE_ROUTER_PORT]."),
    metrics_port: Optional[str] = typer.Option(
        None, help="Port of the router's Prometheus /metrics listener; 0 or 'off': none \\[default: 8082; "
        "SHARDLINE_ROUTER_METRICS_PORT]."),
) -> None:
    """One endpoint over many `shardline serve` replicas: the same /v2 and /v1 wire contract.

    It authenticates tenants and holds their quotas for all replicas, pins each request's model
    version, sends a model to its replicas by rendezvous hashing with bounded loads, retries on
    another replica within a budget and the request's deadline, breaks the circuit of a failing
    replica, carries out rollouts (`shardline rollout`), and with --min-replicas scales its local
    replicas to demand (from zero). Stop it with Ctrl-C (SIGINT) or SIGTERM (its local replicas stop with it).
    """
    from pydantic import ValidationError

    from shardline.cli.common import fail
    from shardline.settings.problems import settings_error
    from shardline.online.router.server import run_router
    from shardline.settings import RouterSettings, StorageSettings, TenancySettings

    given: dict[str, Any] = {"config_file": str(config) if config else None, "local_replicas": local_replicas,
                             "min_replicas": min_replicas, "host": host, "port": port, "metrics_port": metrics_port}
    try:
        settings = RouterSettings.model_validate({k: v for k, v in given.items() if v is not None})
        tenancy = TenancySettings(tenants_file=str(tenants)) if tenants is not None else TenancySettings()
        storage = StorageSettings()
        with _budget_publisher(tenancy, storage):  # the router refuses and degrades by the same states
            run_router(settings, storage, tenancy)
    except ShardlineError as e:
        raise fail(e) from e
    except ValidationError as e:
        raise fail(settings_error(e, _options_given(given, {"config_file": "--config"}))) from e


def _options_given(given: dict[str, Any], names: dict[str, str]) -> dict[str, str]:
    """The settings fields the command line gave (not None), each with its option: ``names``, else the field's
    name as an option (``metrics_port`` -> ``--metrics-port``)."""
    return {field: names.get(field, "--" + field.replace("_", "-")) for field, value in given.items()
            if value is not None}


def main() -> None:
    """Entry point: keep every library off the network, then run the command.

    `batch run` and `batch resume` hand their job to the home's warm batch runner
    (cli/batch_runner.py), which stops the job when the command ends, however it
    ends. Where the runner does not apply (or cannot take the job), they run it cold in a
    supervised child (cli/supervise.py), so that nothing they start (Prefect's
    temporary server, Dask workers) outlives the command, even when it is killed with
    SIGKILL. `batch openai` always runs cold in such a child. Detached on purpose, for later
    runs to reuse: the runner, and the local Prefect server a first run starts
    (cli/prefect_server.py).
    """
    from shardline.cli.supervise import CHILD_FLAG, run_supervised, run_supervised_child, wants_supervision

    for key, value in OFF_THE_NETWORK.items():
        os.environ.setdefault(key, value)
    argv = sys.argv[1:]
    if argv[:1] == [CHILD_FLAG] and len(argv) > 1:
        sys.argv = [sys.argv[0], *argv[2:]]
        _PROCESS["supervised_child"] = True
        run_supervised_child(int(argv[1]), _run_app)
    elif argv[:2] == ["batch", "openai"] and hasattr(os, "fork") and hasattr(os, "killpg"):
        sys.exit(run_supervised(argv))  # always cold, in a supervised child: the model loads there
    elif wants_supervision(argv):
        if not runner_applies():
            sys.exit(run_supervised(argv))
        _PROCESS["supervise_fallback"] = True  # the job goes to the warm runner, which this command supervises
    _run_app()


def _run_app() -> None:
    """The command line's command; a Shardline error that reaches here is one `error:` line and exit code 2."""
    from pydantic_settings import SettingsError

    try:
        app()
    except ShardlineError as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        sys.exit(EXIT_USAGE)
    except SettingsError as e:  # a SHARDLINE_* variable read as JSON that is not (a ValidationError is each command's)
        typer.secho(f"error: {unparsed_setting(e)}", fg="red", err=True)
        sys.exit(EXIT_USAGE)


if __name__ == "__main__":
    main()
