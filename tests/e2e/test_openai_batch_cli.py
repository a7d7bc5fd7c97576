"""`shardline batch openai` as a user runs it: an OpenAI Batch file answered by a tiny LLM built here, the
command SIGKILLed once some parts are committed, the same command run again: every custom_id answered exactly
once, the parts the first run committed left as they were, and OpenAI's counts in batch.json."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import psutil
import pytest

from shardline.build.llm_build import package_tiny_llm
from shardline.storage.registry import ModelRegistry

from tests.e2e.conftest import SHARDLINE

Shardline = Callable[..., subprocess.CompletedProcess[str]]
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
LINES, PER_PART = 80, 2  # 40 parts of ~0.05-0.1 s each: seconds in which to kill the run midway


@pytest.fixture
def tiny_registry(shardline_home: Path, tmp_path_factory: pytest.TempPathFactory) -> ModelRegistry:
    folder = tmp_path_factory.mktemp("tiny-llm") / "bundle"
    package_tiny_llm(folder, name="tiny")
    registry = ModelRegistry(str(shardline_home / "registry"))
    registry.set_alias("tiny", "prod", registry.push(folder).version or 1)
    return registry


def batch_file(path: Path) -> list[str]:
    """LINES chat and completions requests (greedy, 8 tokens at most) and two bad lines; their custom_ids."""
    docs: list[dict[str, Any]] = []
    for i in range(LINES):
        body: dict[str, Any] = {"model": "tiny@prod", "max_tokens": 8, "temperature": 0}
        if i % 2:
            body["messages"] = [{"role": "user", "content": f"describe lake {i}"}]
        else:
            body["prompt"] = f"The story of ship {i} began"
        docs.append({"custom_id": f"req-{i}", "method": "POST", "url": CHAT if i % 2 else TEXT, "body": body})
    docs.insert(5, {"custom_id": "bad-temperature", "method": "POST", "url": TEXT,
                    "body": {"model": "tiny@prod", "prompt": "x", "temperature": 9}})
    docs.insert(50, {"custom_id": "bad-url", "method": "POST", "url": "/v1/moderations",
                     "body": {"model": "tiny@prod", "input": "x"}})
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return [d["custom_id"] for d in docs]


def committed(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "_parts").glob("part-*.jsonl"))}


def wait_until_gone(processes: list[psutil.Process], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while True:
        alive = []
        for p in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p.pid)
        if not alive:
            return
        assert time.monotonic() < deadline, f"still running after the command was killed: {alive}"
        time.sleep(0.05)


@pytest.mark.usefixtures("tiny_registry")
def test_a_batch_file_killed_midway_and_run_again_answers_every_custom_id_exactly_once(
    cli_env: dict[str, str], tmp_path: Path,
) -> None:
    source, out = tmp_path / "requests.jsonl", tmp_path / "answers"
    custom_ids = batch_file(source)
    parts = -(-len(custom_ids) // PER_PART)
    command = [*SHARDLINE, "batch", "openai", str(source), "--output", str(out), "--lines-per-part", str(PER_PART),
               "--json"]
    log = (tmp_path / "first.log").open("w")
    victim = subprocess.Popen(command, env=cli_env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not committed(out):
            assert victim.poll() is None, f"the run ended before a part was committed: {_tail(tmp_path)}"
            assert time.monotonic() < deadline, f"no part committed within 240 s: {_tail(tmp_path)}"
            time.sleep(0.01)
        started = psutil.Process(victim.pid).children(recursive=True)
    finally:
        os.kill(victim.pid, signal.SIGKILL)  # the command only: its supervised child must go with it
        victim.wait()
    wait_until_gone(started)
    first = committed(out)
    assert 1 <= len(first) < parts and not (out / "batch.json").exists(), _tail(tmp_path)

    resumed = subprocess.run(command, env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=600)

    assert resumed.returncode == 3, resumed.stderr[-3000:]  # two lines failed: batch run's quarantine code
    summary = json.loads(resumed.stdout)  # --json: the JSON alone on stdout, the summary table on stderr
    assert summary["parts_skipped"] == len(first) and summary["parts_answered"] == parts - len(first)
    assert "80 answered, 2 failed" in resumed.stderr and str(out / "output.jsonl") in resumed.stderr
    after = committed(out)
    assert {name: after[name] for name in first} == first  # the first run's parts were not redone
    answers = [json.loads(x) for x in (out / "output.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    answered: list[str] = [a["custom_id"] for a in answers] + [e["custom_id"] for e in errors]
    assert sorted(answered) == sorted(custom_ids) and len(set(answered)) == len(answered)  # each exactly once
    assert [e["custom_id"] for e in errors] == ["bad-temperature", "bad-url"]
    assert all(a["response"]["status_code"] == 200 and a["response"]["body"]["model"] == "tiny:1" for a in answers)
    batch = json.loads((out / "batch.json").read_text())
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 82, "completed": 80, "failed": 2}
    assert batch["output_file_id"] == str(out / "output.jsonl") and batch["error_file_id"] == str(out / "errors.jsonl")

    other = tmp_path / "other.jsonl"
    other.write_text(source.read_text().replace("ship 4 ", "boat 4 "))
    refused = subprocess.run([*command[:5], str(other), *command[6:]], env=cli_env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "this run differs in the input's bytes" in refused.stderr and "Traceback" not in refused.stderr


def _tail(tmp_path: Path) -> str:
    return (tmp_path / "first.log").read_text()[-3000:]
