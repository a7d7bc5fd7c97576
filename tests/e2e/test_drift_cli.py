"""`shardline drift check` and `shardline drift report` as a user runs them, on real captured data."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from shardline.bundle import read_manifest
from shardline.storage.registry import ModelRegistry

from tests.conftest import BuiltModel
from tests.drift_data import capture, fresh_rows, profiled_bundle, scaled

Shardline = Callable[..., subprocess.CompletedProcess[str]]
MODEL = "breast-cancer"
EXIT_DRIFT = 4


@pytest.fixture
def captured(shardline_home: Path, breast_cancer_model: BuiltModel, tmp_path: Path) -> Path:
    """breast-cancer:1 served as prod (profiled), with a fresh batch sample and a shifted online one captured."""
    bundle = tmp_path / "bundle"
    manifest = profiled_bundle(breast_cancer_model.bundle_dir, bundle)
    registry = ModelRegistry(str(shardline_home / "registry"))
    registry.push(bundle)
    registry.set_alias(MODEL, "prod", 1)
    root = str(shardline_home / "capture")
    capture(root, bundle, read_manifest(bundle), 1, fresh_rows(1_000, seed=21), "batch", "job-1")
    capture(root, bundle, manifest, 1, scaled(fresh_rows(1_000, seed=22)), "online", "req-1")
    return bundle


@pytest.mark.usefixtures("captured")
def test_check_prints_verdicts_and_exits_non_zero_on_drift(shardline: Shardline) -> None:
    drifted = shardline("drift", "check", f"{MODEL}@prod", "--window", "1h")
    assert drifted.returncode == EXIT_DRIFT, drifted.stderr[-2000:]
    out = drifted.stdout
    assert f"{MODEL}@prod -> {MODEL}:1: 2,000 captured rows (batch 1,000, online 1,000)" in out
    assert "mean radius" in out and "DRIFT" in out and "drift in " in out

    calm = shardline("drift", "check", f"{MODEL}@prod", "--window", "1h", "--tier", "batch")
    assert calm.returncode == 0, calm.stdout[-2000:] + calm.stderr[-2000:]
    assert "no drift in" in calm.stdout and "DRIFT" not in calm.stdout


@pytest.mark.usefixtures("captured")
def test_check_json_carries_the_reports_score(shardline: Shardline) -> None:
    """docs/drift.md's report.score (worst column's score / threshold), as drift-watch and its event carry it."""
    drifted = shardline("drift", "check", f"{MODEL}@prod", "--window", "1h", "--json")
    assert drifted.returncode == EXIT_DRIFT, drifted.stderr[-2000:]
    report = json.loads(drifted.stdout)
    worst = max(c["score"] / c["threshold"] for c in report["columns"])
    assert report["score"] == pytest.approx(worst) and report["score"] > 1 and report["judged"] is True
    calm = json.loads(shardline("drift", "check", f"{MODEL}@prod", "--window", "1h", "--tier", "batch", "--json").stdout)
    assert 0 < calm["score"] <= 1 and calm["drifted"] is False


@pytest.mark.usefixtures("captured")
def test_check_errors_are_clear(shardline: Shardline) -> None:
    unknown = shardline("drift", "check", "churn@prod")
    assert unknown.returncode == 2 and "model 'churn' is not in the registry" in unknown.stderr
    # (nothing captured in the window: tests/unit/test_drift_feedback.py) a tier that is not one was searched for, and sent the user looking for a capture that was never missing
    no_tier = shardline("drift", "check", f"{MODEL}@prod", "--tier", "nightly")
    assert no_tier.returncode == 2 and no_tier.stderr.strip().splitlines() == [
        "error: tier 'nightly' is not one of online, batch; leave it out for both"], no_tier.stderr
    bad_window = shardline("drift", "check", f"{MODEL}@prod", "--window", "yesterday")
    assert bad_window.returncode == 2 and "90s, 30m, 24h" in bad_window.stderr
    for command in ("check", "report"):  # now - 1000000d is before year 1: once an OverflowError traceback
        too_long = shardline("drift", command, f"{MODEL}@prod", "--window", "1000000d")
        assert too_long.returncode == 2 and too_long.stderr.strip().splitlines() == [
            "error: window '1000000d' is longer than the longest accepted, 3650d; write a shorter one"], too_long.stderr


@pytest.mark.usefixtures("captured")
def test_report_writes_self_contained_html(shardline: Shardline, tmp_path: Path) -> None:
    saved = shardline("drift", "check", f"{MODEL}@prod", "--window", "1h", "--save")
    assert saved.returncode == EXIT_DRIFT and "saved " in saved.stderr
    target = tmp_path / "report.html"
    done = shardline("drift", "report", f"{MODEL}@prod", "-o", str(target), "--window", "1h")
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"wrote {target}" in done.stdout and "1 earlier reports" in done.stdout
    html = target.read_text()
    assert html.lstrip().lower().startswith("<!doctype html") and "mean radius" in html
    assert "<script src=" not in html  # self-contained: nothing fetched when opened
    nowhere = tmp_path / "nodir" / "report.html"  # refused before the capture is read, in one line
    refused = shardline("drift", "report", f"{MODEL}@prod", "-o", str(nowhere), "--window", "1h")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [
        f"error: cannot write '{nowhere}': the folder {nowhere.parent} does not exist; make it or pass another path "
        "to -o"], refused.stderr


def test_too_few_rows_are_not_judged_and_exit_as_no_verdict(
    shardline: Shardline, shardline_home: Path, breast_cancer_model: BuiltModel, tmp_path: Path
) -> None:
    bundle = tmp_path / "bundle"
    manifest = profiled_bundle(breast_cancer_model.bundle_dir, bundle)
    registry = ModelRegistry(str(shardline_home / "registry"))
    registry.push(bundle)
    registry.set_alias(MODEL, "prod", 1)
    capture(str(shardline_home / "capture"), bundle, manifest, 1, scaled(fresh_rows(50, seed=5)), "online", "req-1")

    sparse = shardline("drift", "check", f"{MODEL}@prod", "--window", "1h")
    # 2, as for nothing captured: a gate that passes on 0 must not pass a model nobody judged
    assert sparse.returncode == 2, sparse.stdout[-2000:] + sparse.stderr[-2000:]
    lines = sparse.stdout.strip().splitlines()
    assert lines[-1] == ("not judged: only 50 current rows; the policy judges from 100 (min_rows); "
                         "widen --window or wait for more captured rows")
    columns = [line.split() for line in lines[2:-1]]
    assert columns and all(c[-2:] == ["not", "judged"] and c[-4:-2] == ["-", "100"] for c in columns), lines
    assert "no drift" not in sparse.stdout and "DRIFT" not in sparse.stdout

    as_json = shardline("drift", "check", f"{MODEL}@prod", "--window", "1h", "--json")
    assert as_json.returncode == 2
    report = json.loads(as_json.stdout)
    assert report["judged"] is False and report["drifted"] is False
    assert report["not_judged"] == "only 50 current rows; the policy judges from 100 (min_rows)"
    assert report["score"] is None  # no column judged: no score, not 0
