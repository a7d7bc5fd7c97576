"""`shardline prefect ...`: the local Prefect server that batch runs share (see ``shardline.cli.prefect_server``).

Also what `batch run`, `batch resume` and `demo` call before their flow starts (``use_prefect_api``), and what
stops everything a home runs (``stop_home``: `prefect stop`, `demo`, `make clean`).

How a user's own ``prefect`` commands find the home's server: ``eval "$(shardline prefect env)"`` sets
``PREFECT_HOME`` to the home's Prefect home, whose profile holds the server's address. Not wrappers around
``prefect deploy`` and ``prefect worker start``: with the environment set, every Prefect command, flag and doc
works as Prefect documents it (``prefect deployment run``, ``automation ls``, the worker's options), a worker or
flow run reads it as any Prefect process does, and a profile is how Prefect itself keeps a server's address.
"""

from __future__ import annotations

import json
import os
import shlex
from typing import TYPE_CHECKING

import typer

from shardline.cli.common import EXIT_FAILED, fail

if TYPE_CHECKING:
    from shardline.cli.batch_runner import RunnerRecord
    from shardline.cli.prefect_clients import PrefectClient
    from shardline.local_prefect import LocalServer

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
                   f"  files  {server_dir(home)}\n  shell  eval \"$(shardline prefect env)\" (its prefect commands "
                   "then use this server)")
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


@prefect_app.command("env")
def prefect_env() -> None:
    """Print the shell lines that point a shell at this home: eval "$(shardline prefect env)".

    They export SHARDLINE_STORAGE_HOME and PREFECT_HOME=<home>/prefect, whose Prefect profile holds the address of
    this home's local Prefect server (started now when it does not run), so that every prefect command (deploy,
    worker start, deployment run), its workers and their flow runs use that server; they unset PREFECT_API_URL,
    PREFECT_PROFILE and PREFECT_PROFILES_PATH, each of which would win over the profile, and turn telemetry off.
    Your own Prefect profile is neither read nor changed.
    """
    from shardline.cli.prefect_server import PROFILE, PROFILES, ensure, home_environment, started_line
    from shardline.errors import PrefectServerUnavailable
    from shardline.local_prefect import server_dir
    from shardline.settings import PrefectServerSettings

    home = _home()
    try:
        server, started = ensure(home, PrefectServerSettings().start_timeout_s)
    except PrefectServerUnavailable as e:
        raise fail(e, EXIT_FAILED) from e
    if started:
        typer.secho(started_line(server.ui_url), fg="cyan", err=True)
    environment = home_environment(home)
    for name, value in environment.items():
        if value is not None:
            typer.echo(f"export {name}={shlex.quote(value)}")
    typer.echo(f"unset {' '.join(name for name, value in environment.items() if value is None)}")
    typer.echo(f"# the Prefect server of the home {home}: UI {server.ui_url}, API {server.api_url} (profile "
               f"{PROFILE!r} in {server_dir(home) / PROFILES})\n# use it in this shell: eval \"$(shardline prefect env)\"")


def stop_home(home: str | os.PathLike[str]) -> tuple[RunnerRecord | None, list[PrefectClient], LocalServer | None]:
    """Stop what runs for a home: its warm batch runner, the Prefect workers and flow runs that use its server
    (``shardline.cli.prefect_clients``), then the server and its keeper. Returns what was stopped."""
    from shardline.cli import batch_runner, prefect_clients
    from shardline.cli.prefect_server import profile_api_url, stop
    from shardline.local_prefect import read_record, server_dir

    runner = batch_runner.stop(home)
    recorded = read_record(server_dir(home))
    addresses = {url for url in (profile_api_url(home), recorded.api_url if recorded else None) if url}
    clients = prefect_clients.stop(home, addresses)
    return runner, clients, stop(home)


@prefect_app.command("stop")
def prefect_stop() -> None:
    """Stop this home's warm batch runner, the Prefect workers and flow runs started with its profile (eval "$(shardline
    prefect env)"), and its local Prefect server (the next batch run starts the runner and server again; the run
    history is kept). Jobs running on the runner stop as an interrupted command's would: re-run to resume."""
    home = _home()
    runner, clients, stopped = stop_home(home)
    if runner is not None:
        typer.echo(f"stopped the batch runner (pid {runner.pid})")
    for client in clients:
        typer.echo(f"stopped the {client.kind} (pid {client.pid}): {shlex.join(client.command)}")
    typer.echo(f"no local Prefect server was running for the home {home}" if stopped is None else
               f"stopped the local Prefect server (pid {stopped.pid}, {stopped.ui_url}) of the home {home}")
