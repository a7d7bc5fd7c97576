"""`shardline slo render`: the SLO file turned into Prometheus rules and Grafana dashboards (docs/slo.md).

The generator is ``shardline.observability``; this command adds what it may not import: the bucket bounds of the
online tier's histograms, so that a latency threshold that is not a bound is refused here, not silently read as
no data by Prometheus.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from shardline.cli.common import EXIT_FAILED, fail
from shardline.errors import ShardlineError

slo_app = typer.Typer(help="SLOs as configuration: Prometheus rules and Grafana dashboards from an SLO file.",
                      no_args_is_help=True)

DEFAULT_CONFIG = Path("deploy/observability/slos.yaml")


def histogram_bounds() -> dict[str, tuple[float, ...]]:
    """The bucket bounds of each histogram an SLI reads, as the online tier exports them."""
    from shardline.online.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS, TTFT_BUCKETS

    return {"shardline_request_seconds": LATENCY_BUCKETS,
            "shardline_llm_time_to_first_token_seconds": TTFT_BUCKETS,
            "shardline_llm_inter_token_seconds": TOKEN_BUCKETS}


@slo_app.command("render")
def render_command(
    config: Path = typer.Option(DEFAULT_CONFIG, "--config", help="The SLO file (YAML)."),
    out: Optional[Path] = typer.Option(None, "--out", help="The folder to write into \\[default: the SLO file's "
                                       "folder]: rules/shardline-slos.rules.yaml and dashboards/*.json."),
    check: bool = typer.Option(False, "--check", help="Write nothing; exit 1 when a file in --out differs from what "
                               "would be written (for CI)."),
) -> None:
    """Write the recording rules, the burn-rate alerts and the dashboards generated from the SLO file."""
    from shardline.observability.render import alert_names, check_thresholds, load_slos, render, write

    try:
        slos = load_slos(config)
        check_thresholds(slos, histogram_bounds())
    except ShardlineError as e:
        raise fail(e) from e
    folder = out if out is not None else config.parent
    files = render(slos, str(config))
    if check:
        stale = [path for path, text in files.items() if _read(folder / path) != text]
        for path in stale:
            typer.echo(f"out of date: {folder / path}", err=True)
        if stale:
            typer.echo(f"run `shardline slo render --config {config} --out {folder}` and commit what it writes",
                       err=True)
            raise typer.Exit(EXIT_FAILED)
        typer.echo(f"{len(files)} files in {folder} match {config}")
        return
    for path in write(files, folder):
        typer.echo(f"wrote {path}")
    typer.echo(f"{len(slos.slos)} SLOs in {len(slos.classes)} classes; alerts: {', '.join(alert_names(slos))}")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
