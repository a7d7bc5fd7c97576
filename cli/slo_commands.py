"""`shardline slo render` and `shardline slo rules`: the SLO file turned into Prometheus rules and Grafana dashboards
(docs/slo.md).

The generator is ``shardline.observability``; this command adds what it may not import: the bucket bounds of the
online tier's histograms, so that a latency threshold that is not a bound is refused here, not silently read as
no data by Prometheus.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from shardline.cli.common import EXIT_FAILED, fail
from shardline.errors import ShardlineError

if TYPE_CHECKING:
    from shardline.observability.slos import SloConfig

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
    from shardline.observability.render import alert_names, render, write

    slos = _load(config)
    folder = out if out is not None else config.parent
    files = render(slos, config)
    if check:
        if folder.exists() and not folder.is_dir():
            raise fail(f"--out {folder} is a file; --check compares the files in a folder: pass the folder the "
                       "rules and dashboards are in")
        stale = [path for path, text in files.items() if _read(folder / path) != text]
        for path in stale:
            typer.echo(f"out of date: {folder / path}", err=True)
        if stale:
            typer.echo(f"run `shardline slo render --config {config} --out {folder}` and commit what it writes",
                       err=True)
            raise typer.Exit(EXIT_FAILED)
        typer.echo(f"{len(files)} files in {folder} match {config}")
        return
    try:
        written = write(files, folder)
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        raise fail(f"cannot write the generated files into {folder}: {e.strerror or e}{where}; pass a writable "
                   "folder with --out") from e
    for path in written:
        typer.echo(f"wrote {path}")
    typer.echo(f"{len(slos.slos)} SLOs in {len(slos.classes)} classes; alerts: {', '.join(alert_names(slos))}")


@slo_app.command("rules")
def rules_command(
    config: Path = typer.Option(DEFAULT_CONFIG, "--config", help="The SLO file (YAML)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="The Prometheus rules file to write "
                                          "\\[default: standard output]; its folder is made as needed."),
) -> None:
    """Write only the Prometheus rules (recording rules and burn-rate alerts) generated from the SLO file, for a
    Prometheus's rule_files or `promtool check rules`."""
    from shardline.observability.rules import alert_names, rules_yaml

    slos = _load(config)
    text = rules_yaml(slos, config)
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text)
    except OSError as e:
        raise fail(f"cannot write the rules file {output}: {e.strerror or e}; pass a writable path with -o") from e
    typer.echo(f"wrote {output}: {len(slos.slos)} SLOs in {len(slos.classes)} classes; alerts: "
               f"{', '.join(alert_names(slos))}", err=True)


def _load(config: Path) -> SloConfig:
    """The SLO file, checked, with every latency threshold a bucket bound the replicas export."""
    from shardline.observability.slos import check_thresholds, load_slos

    try:
        slos = load_slos(config)
        check_thresholds(slos, histogram_bounds())
    except ShardlineError as e:
        raise fail(e) from e
    return slos


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
