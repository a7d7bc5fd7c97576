"""SLOs as configuration, and what is generated from them: Prometheus rules and Grafana dashboards.

``load_slos`` reads and checks an SLO file (``deploy/observability/slos.yaml`` is the shipped one);
``render`` turns it into the files ``shardline slo render`` writes; ``write`` writes them.
May import the kernel only (``shardline``).
"""

from __future__ import annotations

import json
from pathlib import Path

from shardline.observability.dashboards import dashboards
from shardline.observability.rules import alert_names, rules_yaml
from shardline.observability.slos import SLIS, Slo, SloConfig, check_thresholds, load_slos, parse_slos

RULES_FILE = "rules/shardline-slos.rules.yaml"


def render(config: SloConfig, source: str | Path) -> dict[str, str]:
    """The generated files, by path relative to the output folder: the rules file and one JSON file per
    dashboard. ``source`` is the SLO file, named in the rules file's header by its file name only (the same text
    whatever the working folder or the path's spelling)."""
    files = {RULES_FILE: rules_yaml(config, source)}
    for name, model in dashboards().items():
        files[f"dashboards/{name}"] = json.dumps(model, indent=2) + "\n"
    return files


def write(files: dict[str, str], out_dir: str | Path) -> list[Path]:
    """Write ``render``'s files under ``out_dir`` (folders made as needed); the paths written."""
    written = []
    for relative, text in files.items():
        path = Path(out_dir) / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


__all__ = ["RULES_FILE", "SLIS", "Slo", "SloConfig", "alert_names", "check_thresholds", "load_slos", "parse_slos",
           "render", "write"]
