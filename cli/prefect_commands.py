"""`shardline prefect ...`: the local Prefect server that batch runs share (see ``shardline.cli.prefect_server``).

Also what `batch run`, `batch resume` and `demo` call before their flow starts (``use_prefect_api``).
"""

from __future__ import annotations

import json

import typer

from shardline.cli.common import EXIT_FAILED, fail

prefect_app = typer.Typer(
    help="The local Prefect server batch runs share (started by the first run; its UI shows every run).",
    no_args_is_help=True,
)


def _home() -> str:
    from shardline.settings import StorageSettings

    return StorageSettings().home


def use_prefect_api() -> None:
    """Point this process's flow runs at the Prefect API they should use; say so when a server was started.

    The user's PREFECT_API_URL wins; else SHARDLINE_PREFECT_SERVER=local (default) finds or starts the
    home's local server, and ``temporary`` leaves Prefect to start one inside the run.
    """
    from shardline.cli.prefect_server import api_url_for_run, started_line
    from shardline.local_prefect import LocalServer
    from shardline.settings import PrefectServerSettings

    settings = PrefectServerSettings()
    url, started = api_url_for_run(settings.server, _home(), settings.start_timeout_s)
    if started and url is not None:
        typer.secho(started_line(LocalServer(pid=0, api_url=url).ui_url), fg="cyan", err=True)


@prefect_app.command("status")
def prefect_status(json_out: bool = typer.Option(False, "--json", help="Print pid, API and UI URLs as JSON.")) -> None:
    """Whether this home's local Prefect server runs, where its API and UI are, and its warm batch runner.

    Exit code 1: the server does not run.
    """
    from shardline.cli import batch_runner
    from shardline.local_prefect import find, server_dir

    home = _home()
    server, runner = find(home), batch_runner.find(home)
    if json_out:
        typer.echo(json.dumps(None if server is None else
                              {"pid": server.pid, "api_url": server.api_url, "ui_url": server.ui_url,
                               "runner_pid": runner.pid if runner is not None else None}))
    elif server is None:
        typer.echo(f"no local Prefect server runs for the home {home} (the next `shardline batch run` starts one)")
    else:
        typer.echo(f"running  pid {server.pid}\n     UI  {server.ui_url}\n    API  {server.api_url}\n"
                   f"  files  {server_dir(home)}")
    if not json_out:
        typer.echo(f" runner  pid {runner.pid} ({batch_runner.runner_dir(home)})" if runner is not None else
                   " runner  none (the next `shardline batch run` starts it)")
    raise typer.Exit(0 if server is not None else EXIT_FAILED)


@prefect_app.command("start")
def prefect_start() -> None:
    """Start this home's local Prefect server now (batch runs start it when they need it); no-op when it runs."""
    from shardline.cli.prefect_server import ensure
    from shardline.errors import PrefectServerUnavailable
    from shardline.settings import PrefectServerSettings

    try:
        server, started = ensure(_home(), PrefectServerSettings().start_timeout_s)
    except PrefectServerUnavailable as e:
        raise fail(e, EXIT_FAILED) from e
    typer.echo(f"{'started' if started else 'already running'}: pid {server.pid}, UI {server.ui_url}")


@prefect_app.command("stop")
def prefect_stop() -> None:
    """Stop this home's warm batch runner and local Prefect server (the next batch run starts them again; the
    run history is kept). Jobs running on the runner stop as an interrupted command's would: re-run to resume."""
    from shardline.cli import batch_runner
    from shardline.cli.prefect_server import stop

    runner = batch_runner.stop(_home())
    if runner is not None:
        typer.echo(f"stopped the batch runner (pid {runner.pid})")
    stopped = stop(_home())
    typer.echo("no local Prefect server was running" if stopped is None else f"stopped the local Prefect server "
               f"(pid {stopped.pid}, {stopped.ui_url})")
