"""`shardline model place` refuses a wrong workload in one line with exit 2, before it reads the registry:
numbers that are not finite and above 0, no workload at all, half an online one, or both kinds at once."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardline.cli import app


@pytest.mark.parametrize(("args", "says"), [
    (["--rows-per-s", "-5"], "--rows-per-s is -5; give a number above 0 (and finite)"),
    (["--rows-per-s", "inf"], "--rows-per-s is inf; give a number above 0 (and finite)"),
    (["--p99-ms", "-1", "--rps", "10"], "--p99-ms is -1; give a number above 0"),
    (["--p99-ms", "5", "--rps", "0"], "--rps is 0; give a number above 0"),
    (["--p99-ms", "nan", "--rps", "10"], "--p99-ms is nan; give a number above 0"),
    ([], "give the workload: --p99-ms with --rps (online), or --rows-per-s (batch)"),
    (["--p99-ms", "5"], "an online workload needs both --p99-ms and --rps"),
    (["--p99-ms", "5", "--rps", "10", "--rows-per-s", "5"],
     "give --p99-ms with --rps (an online workload), or --rows-per-s (a batch one), not both"),
])
def test_a_wrong_workload_is_one_line_and_exit_2(args: list[str], says: str, tmp_path: Path) -> None:
    done = CliRunner().invoke(app, ["model", "place", "mlp:1", *args],
                              env={"SHARDLINE_STORAGE_HOME": str(tmp_path / "home"), "COLUMNS": "200"})

    assert done.exit_code == 2, done.output
    assert done.stderr.strip() == f"error: {says}" or (done.stderr.startswith("error: ") and says in done.stderr
                                                        and len(done.stderr.strip().splitlines()) == 1), done.stderr
    assert "Traceback" not in done.output and done.stdout == ""
