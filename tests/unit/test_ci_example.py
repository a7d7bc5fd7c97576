"""deploy/ci/release-model.yml, the example CI workflow, stays true to the CLI: every `shardline` command it
runs exists with every option it passes, and its push step reads the version from what `model push` prints."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml
from typer.testing import CliRunner

from shardline.cli.commands import app

WORKFLOW = Path(__file__).resolve().parents[2] / "deploy" / "ci" / "release-model.yml"


def _commands() -> list[list[str]]:
    steps = yaml.safe_load(WORKFLOW.read_text())["jobs"]["release"]["steps"]
    found = []
    for step in steps:
        for line in str(step.get("run", "")).splitlines():
            if ".venv/bin/shardline" in line:
                words = shlex.split(line.split("$(")[-1].rstrip(")"), posix=True)
                found.append(words[words.index(".venv/bin/shardline") + 1:])
    return found


def test_every_shardline_command_and_option_the_workflow_runs_exists() -> None:
    commands = _commands()
    assert [c[:2] for c in commands] == [["model", "package"], ["model", "push"], ["model", "release"]]
    runner = CliRunner()
    for words in commands:
        shown = runner.invoke(app, [*words[:2], "--help"], env={"COLUMNS": "200"})
        assert shown.exit_code == 0, shown.output
        for option in (w for w in words if w.startswith("--")):
            assert option in shown.output, f"`shardline {' '.join(words[:2])}` has no {option}"


def test_the_push_step_reads_the_version_from_what_model_push_prints(shardline_home: Path, tmp_path: Path) -> None:
    from shardline.build.examples import package_breast_cancer

    package_breast_cancer(tmp_path / "churn-bundle", name="churn", kind="logreg")
    pushed = CliRunner().invoke(app, ["model", "push", str(tmp_path / "churn-bundle")],
                                env={"SHARDLINE_STORAGE_HOME": str(shardline_home)})
    assert pushed.exit_code == 0, pushed.output
    sed = re.search(r"sed -n '(s/.*/p)'", WORKFLOW.read_text())
    assert sed, "the push step no longer reads the version with sed -n 's/.../p'"
    pattern = sed.group(1).split("/")[1].replace("\\(", "(").replace("\\)", ")")  # sed's BRE groups, as Python's
    found = [m.group(1) for line in pushed.output.splitlines() if (m := re.match(pattern, line))]
    assert found == ["churn:1"], pushed.output
