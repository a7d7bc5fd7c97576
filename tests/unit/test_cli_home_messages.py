"""Messages that read a home name it (a new shell without SHARDLINE_STORAGE_HOME reads another home)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from shardline.cli import app


def test_batch_status_with_no_jobs_names_the_home_it_read(tmp_path: Path) -> None:
    home = tmp_path / "somewhere" / "home"
    done = CliRunner().invoke(app, ["batch", "status"], env={"SHARDLINE_STORAGE_HOME": str(home), "COLUMNS": "200"})
    assert done.exit_code == 0, done.output
    assert f"no batch jobs recorded under {home} yet" in done.output
    assert "SHARDLINE_STORAGE_HOME names the home" in done.output
