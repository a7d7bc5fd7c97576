"""The `openai-batch` flow under the real Prefect test harness with real models built here (nothing downloaded):
a tiny causal LM (random weights, the real MiniLM tokenizer) answers chat and completions lines, and the
all-MiniLM-L6-v2 bundle embeddings lines.

Every good line is answered once, matched by custom_id, with the text the engine gives for the same prompt
directly; every bad line is an error record saying why; the counts are OpenAI's; a finished job run again
writes nothing; a file the model cannot answer, and another file into the same folder, are refused."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pytest

from shardline.build.llm_build import package_tiny_llm
from shardline.bundle import Manifest, read_manifest
from shardline.errors import InvalidInput, OutputInUse
from shardline.runtimes import RuntimeOptions, create_runtime
from shardline.runtimes.generation import EngineConfig, SamplingParams
from shardline.runtimes.generation.engine import GenerationEngine
from shardline.storage.ledger import LedgerStore, month_of
from shardline.storage.registry import ModelRegistry
from tests.integration.conftest import S3Server

CHAT, TEXT, EMBED = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    folder = tmp_path_factory.mktemp("tiny-llm") / "bundle"
    return folder, package_tiny_llm(folder, name="tiny")


@pytest.fixture(scope="module")
def engine(tiny_llm: tuple[Path, Manifest]) -> Iterator[GenerationEngine]:
    """The tiny LLM's engine, started apart from the flow's: what the engine gives for a prompt directly."""
    folder, manifest = tiny_llm
    started = GenerationEngine(folder, EngineConfig.from_runtime_config(manifest.runtime_config, "tiny"), threads=1)
    started.start()
    yield started
    started.close()


@pytest.fixture
def registry(shardline_home: Path, tiny_llm: tuple[Path, Manifest], prefect_harness: None) -> ModelRegistry:
    registry = ModelRegistry(str(shardline_home / "registry"))
    registry.set_alias("tiny", "prod", registry.push(tiny_llm[0]).version or 1)
    return registry


def request(custom_id: str | None, url: str, **body: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"method": "POST", "url": url, "body": {"model": "tiny@prod", **body}}
    if custom_id is not None:
        doc["custom_id"] = custom_id
    return doc


def good_lines(count: int) -> list[dict[str, Any]]:
    """Chat and completions lines, greedy, up to 8 tokens each, some with a stop string."""
    lines = []
    for i in range(count):
        if i % 2:
            lines.append(request(f"chat-{i}", CHAT, max_tokens=4 + i % 5, temperature=0, messages=[
                {"role": "system", "content": "You are terse."}, {"role": "user", "content": f"name river {i}"}]))
        else:
            lines.append(request(f"text-{i}", TEXT, prompt=f"Once upon a time, in town {i},", max_tokens=8 - i % 4,
                                 temperature=0, **({"stop": ["the"]} if i % 6 == 0 else {})))
    return lines


def write_jsonl(path: Path, docs: list[Any]) -> Path:
    path.write_text("".join((d if isinstance(d, str) else json.dumps(d)) + "\n" for d in docs))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def direct(engine: GenerationEngine, line: dict[str, Any]) -> tuple[str, str, int, int]:
    """(text, finish_reason, prompt tokens, completion tokens) from the engine, for a line's prompt."""
    body = line["body"]
    prompt = engine.chat_prompt(body["messages"]) if line["url"] == CHAT else body["prompt"]
    done = engine.generate(engine.tokenize(prompt), SamplingParams(max_tokens=body["max_tokens"], temperature=0,
                                                                  stop=tuple(body.get("stop", ()))))
    return done.text, done.finish_reason, done.prompt_tokens, done.completion_tokens


def test_a_file_of_chat_and_completions_lines_is_answered_once_per_custom_id(
    registry: ModelRegistry, engine: GenerationEngine, tmp_path: Path, shardline_home: Path,
) -> None:
    from shardline.flows.openai_batch import openai_batch

    lines = good_lines(40)
    bad = [
        "{this is not json",
        request(None, TEXT, prompt="no id"),
        {**request("get", TEXT, prompt="x"), "method": "GET"},
        request("images", "/v1/images/generations", prompt="x"),
        request("hot", TEXT, prompt="x", temperature=5),
        request("long", TEXT, prompt="word " * 600, max_tokens=4),
        request("tool", CHAT, messages=[{"role": "tool", "content": "42"}], max_tokens=2),
    ]
    docs: list[Any] = lines[:10] + bad[:4] + lines[10:30] + bad[4:] + lines[30:]
    source = write_jsonl(tmp_path / "requests.jsonl", docs)
    out = tmp_path / "answers"
    committed: list[tuple[int, int, int]] = []

    state = openai_batch(str(source), str(out), lines_per_part=8, watchers=[lambda *a: committed.append(a)],
                         return_state=True)

    assert state.is_completed() and state.name == "Quarantined", state.message
    summary = state.result()
    assert (summary["total"], summary["completed"], summary["failed"]) == (47, 40, 7)
    assert summary["parts"] == 6 and summary["parts_answered"] == 6 and committed[-1] == (6, 6, 47)
    answers, errors = read_jsonl(out / "output.jsonl"), read_jsonl(out / "errors.jsonl")
    assert [a["custom_id"] for a in answers] == [line["custom_id"] for line in lines]  # each once, in input order
    for line, answer in zip(lines, answers):
        response = answer["response"]
        assert response["status_code"] == 200 and answer["error"] is None and answer["id"].startswith("batch_req_")
        body = response["body"]
        chat = line["url"] == CHAT
        assert body["object"] == ("chat.completion" if chat else "text_completion") and body["model"] == "tiny:1"
        choice = body["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        usage = body["usage"]
        got = (text, choice["finish_reason"], usage["prompt_tokens"], usage["completion_tokens"])
        assert got == direct(engine, line), line["custom_id"]  # greedy: the engine's own answer
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert [e["custom_id"] for e in errors] == [None, None, "get", "images", "hot", "long", "tool"]
    assert all(e["response"]["status_code"] == 400 and e["error"] is None for e in errors)
    messages = [e["response"]["body"]["error"]["message"] for e in errors]
    assert messages[0].startswith("line 11 is not JSON") and "field 'custom_id'" in messages[1]
    assert "field 'method' is 'GET'" in messages[2] and "field 'url'" in messages[3]
    assert "field 'temperature' is 5" in messages[4]
    assert "the prompt is" in messages[5] and "this model takes at most 511" in messages[5]
    assert "field 'messages[0].role' is 'tool'; tool and function calls are not supported" in messages[6]
    long = errors[5]["response"]["body"]["error"]  # the code and param serve answers the same prompt with
    assert (long["code"], long["param"]) == ("context_length_exceeded", "prompt")
    assert errors[6]["response"]["body"]["error"]["param"] == "messages[0].role"
    batch = json.loads((out / "batch.json").read_text())
    assert (batch["object"], batch["status"], batch["request_counts"]) == (
        "batch", "completed", {"total": 47, "completed": 40, "failed": 7})
    assert batch["output_file_id"] == str(out / "output.jsonl") and batch["error_file_id"] == str(out / "errors.jsonl")
    assert batch["input_file_id"] == str(source) and batch["metadata"]["model"] == "tiny:1"
    assert not (out / "_staging").exists()

    # the run's use is in the metering ledger, as a batch job's is: its lines, tokens and seconds, for its tenant
    [usage] = [r for r in LedgerStore(str(shardline_home)).read(month_of(datetime.now(timezone.utc))).to_pylist()
               if r["kind"] == "usage"]
    assert (usage["tier"], usage["tenant"], usage["model"], usage["version"]) == ("batch", "default", "tiny", "1")
    assert (usage["requests"], usage["rows"]) == (40, 47) and usage["device_seconds"] > 0
    assert usage["prompt_tokens"] == sum(a["response"]["body"]["usage"]["prompt_tokens"] for a in answers)
    assert usage["completion_tokens"] == sum(a["response"]["body"]["usage"]["completion_tokens"] for a in answers)

    before = {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    again = openai_batch(str(source), str(out), lines_per_part=8, return_state=True)

    assert again.result()["parts_answered"] == 0 and again.result()["completed"] == 40
    assert {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before  # nothing written
    assert len(LedgerStore(str(shardline_home)).read(month_of(datetime.now(timezone.utc)))) == 2  # nor metered


def test_a_rerun_with_another_file_or_part_size_is_refused_and_a_resume_keeps_the_pinned_version(
    registry: ModelRegistry, tmp_path: Path,
) -> None:
    from shardline.flows.openai_batch import openai_batch

    source = write_jsonl(tmp_path / "requests.jsonl", good_lines(3))
    out = tmp_path / "answers"
    assert openai_batch(str(source), str(out), lines_per_part=2, return_state=True).name == "Completed"
    for name in ("batch.json", "output.jsonl", "errors.jsonl", "_parts/part-000001.jsonl"):
        (out / name).unlink()  # as a run killed before its last part leaves the folder
    package_tiny_llm(tmp_path / "tiny-2", name="tiny", seed=1)
    registry.set_alias("tiny", "prod", registry.push(tmp_path / "tiny-2").version or 2)  # prod moves on

    other = write_jsonl(tmp_path / "other.jsonl", good_lines(4))
    refused = openai_batch(str(other), str(out), lines_per_part=3, return_state=True)

    error = refused.result(raise_on_failure=False)
    assert isinstance(error, OutputInUse)
    assert "holds OpenAI batch job" in str(error) and "model tiny:1" in str(error)
    assert "this run differs in the input's bytes" in str(error) and "--lines-per-part (3, the job's 2)" in str(error)
    resumed = openai_batch(str(source), str(out), lines_per_part=2, return_state=True).result()
    assert (resumed["parts_answered"], resumed["parts_skipped"], resumed["model"]) == (1, 1, "tiny:1")
    answers = read_jsonl(out / "output.jsonl")
    assert [a["response"]["body"]["model"] for a in answers] == ["tiny:1"] * 3  # the version pinned at the start


def test_embeddings_lines_for_a_text_generation_model_refuse_the_file(registry: ModelRegistry, tmp_path: Path) -> None:
    from shardline.flows.openai_batch import openai_batch

    source = write_jsonl(tmp_path / "requests.jsonl", [request("e-1", EMBED, input="hello")])
    out = tmp_path / "answers"

    error = openai_batch(str(source), str(out), return_state=True).result(raise_on_failure=False)

    assert isinstance(error, InvalidInput)
    assert "lines call /v1/embeddings, but tiny:1 is not an embedding model" in str(error)
    assert not out.exists()  # a refused file writes nothing


def test_embeddings_lines_are_answered_with_the_models_vectors(
    shardline_home: Path, minilm_bundle: Path, prefect_harness: None, tmp_path: Path,
) -> None:
    from shardline.flows.openai_batch import openai_batch

    registry = ModelRegistry(str(shardline_home / "registry"))
    registry.set_alias("minilm", "prod", registry.push(minilm_bundle).version or 1)
    bodies: list[dict[str, Any]] = [{"input": "a red river"}, {"input": ["two", "texts"], "encoding_format": "base64"},
                                    {"input": "cut", "dimensions": 8}]
    docs = [{"custom_id": f"e-{i}", "method": "POST", "url": EMBED, "body": {"model": "minilm@prod", **body}}
            for i, body in enumerate(bodies)]
    source = write_jsonl(tmp_path / "requests.jsonl", docs)

    summary = openai_batch(str(source), str(tmp_path / "answers"), lines_per_part=2, return_state=True).result()

    assert (summary["total"], summary["completed"], summary["failed"]) == (3, 2, 1)
    answers = read_jsonl(tmp_path / "answers" / "output.jsonl")
    runtime = create_runtime(minilm_bundle, read_manifest(minilm_bundle), RuntimeOptions(device="cpu"))
    runtime.load()
    expected = runtime.predict(pa.table({"text": ["a red river", "two", "texts"]})).column(0).to_pylist()
    first = answers[0]["response"]["body"]
    assert first["object"] == "list" and first["model"] == "minilm:1" and first["usage"]["prompt_tokens"] > 0
    np.testing.assert_allclose(first["data"][0]["embedding"], expected[0], rtol=1e-5, atol=1e-6)
    import base64

    second = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in answers[1]["response"]["body"]["data"]]
    np.testing.assert_allclose(np.stack(second), np.array(expected[1:]), rtol=1e-5, atol=1e-6)
    error = read_jsonl(tmp_path / "answers" / "errors.jsonl")[0]
    assert error["custom_id"] == "e-2" and "field 'dimensions' is 8; minilm:1 makes 384-dimensional" in \
        error["response"]["body"]["error"]["message"]


@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_the_flows_refuse_each_others_output_folders(
    registry: ModelRegistry, input_shards: Path, tmp_path: Path,
) -> None:
    """A deployment's run gets no check from the command: the `openai-batch` flow refuses a finished `batch run`
    folder, one inside it and one holding it, and the `batch-inference` flow a finished OpenAI batch folder, one
    inside it and one holding it; nothing is written into either."""
    from shardline.flows.batch_inference import batch_inference
    from shardline.flows.openai_batch import openai_batch

    source = write_jsonl(tmp_path / "requests.jsonl", good_lines(2))
    scored, answers = tmp_path / "run" / "scored", tmp_path / "openai" / "answers"
    assert batch_inference(model="breast-cancer@prod", input_uri=str(input_shards), output_uri=str(scored),
                           return_state=True).is_completed()
    assert openai_batch(str(source), str(answers), return_state=True).is_completed()
    before = {p: p.stat().st_mtime_ns for folder in (scored, answers) for p in folder.rglob("*") if p.is_file()}

    for out, how in ((scored, "is a"), (scored / "sub", f"is inside {scored}, another"),
                     (scored.parent, f"holds {scored}, another")):
        error = openai_batch(str(source), str(out), return_state=True).result(raise_on_failure=False)
        assert isinstance(error, OutputInUse), error
        assert f"the output {out} {how}" in str(error) and "`batch run` job's" in str(error)
    for out, how in ((answers, "is a"), (answers / "sub", f"is inside {answers}, another"),
                     (answers.parent, f"holds {answers}, another")):
        state = batch_inference(model="breast-cancer@prod", input_uri=str(input_shards), output_uri=str(out),
                                return_state=True)
        error = state.result(raise_on_failure=False)
        assert isinstance(error, OutputInUse), error
        assert "`batch openai` job's" in str(error) and str(error).startswith(f"the output {out} {how}")
    after = {p: p.stat().st_mtime_ns for folder in (scored, answers) for p in folder.rglob("*") if p.is_file()}
    assert {p: t for p, t in after.items() if "_lease" not in p.parts} == \
        {p: t for p, t in before.items() if "_lease" not in p.parts}
    assert not (scored / "sub").exists() and not (answers / "sub").exists()


def s3_requests(s3_server: S3Server, prefix: str, lines: list[dict[str, Any]]) -> tuple[Any, str]:
    """The S3 file system and the URL of a batch file of ``lines`` written under ``prefix``."""
    fs = s3_server.filesystem()
    source = s3_server.url(prefix, "in", "requests.jsonl")
    fs.pipe_file(source.removeprefix("s3://"), "".join(json.dumps(d) + "\n" for d in lines).encode())
    return fs, source


@pytest.mark.s3
def test_a_batch_run_folder_on_s3_is_refused_as_on_local_disk(
    registry: ModelRegistry, s3_server: S3Server, s3_prefix: str,
) -> None:
    from shardline.flows.openai_batch import openai_batch

    fs, source = s3_requests(s3_server, s3_prefix, good_lines(2))
    scored = s3_server.url(s3_prefix, "scored")
    fs.pipe_file(f"{scored.removeprefix('s3://')}/_ledger/part-00000.json", b"{}")  # a `batch run` job's record

    for out in (scored, f"{scored}/sub"):
        error = openai_batch(source, out, return_state=True).result(raise_on_failure=False)
        assert isinstance(error, OutputInUse), error
        assert f"the output {out} is " in str(error) and "`batch run` job's" in str(error)
    assert fs.find(scored.removeprefix("s3://")) == [f"{scored.removeprefix('s3://')}/_ledger/part-00000.json"]


@pytest.mark.s3
def test_a_file_on_s3_is_answered_into_s3_and_resumed(
    registry: ModelRegistry, s3_server: S3Server, s3_prefix: str,
) -> None:
    from shardline.flows.openai_batch import openai_batch

    lines = good_lines(6) + [request("hot", TEXT, prompt="x", temperature=5)]
    fs, source = s3_requests(s3_server, s3_prefix, lines)
    out = s3_server.url(s3_prefix, "answers")

    first = openai_batch(source, out, lines_per_part=3, return_state=True).result()
    root = out.removeprefix("s3://")
    fs.rm(f"{root}/batch.json")
    fs.rm(f"{root}/_parts/part-000002.jsonl")  # as a run killed before its last part leaves the folder
    kept = fs.cat_file(f"{root}/_parts/part-000000.jsonl")
    again = openai_batch(source, out, lines_per_part=3, return_state=True).result()

    assert (first["total"], first["completed"], first["failed"]) == (7, 6, 1)
    assert (again["parts_answered"], again["parts_skipped"], again["failed"]) == (1, 2, 1)
    assert fs.cat_file(f"{root}/_parts/part-000000.jsonl") == kept
    answers = [json.loads(x) for x in fs.cat_file(f"{root}/output.jsonl").splitlines()]
    assert [a["custom_id"] for a in answers] == [d["custom_id"] for d in lines[:6]]
    batch = json.loads(fs.cat_file(f"{root}/batch.json"))
    assert batch["request_counts"] == {"total": 7, "completed": 6, "failed": 1} and batch["input_file_id"] == source
    assert batch["output_file_id"] == f"{out}/output.jsonl" and not fs.exists(f"{root}/_staging")


def test_a_deployments_run_meets_its_tenants_budget_as_the_command_does(
    registry: ModelRegistry, tmp_path: Path, shardline_home: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The flow deployed and run as a worker runs it (its parameters from the API): at its tenant's hard limit a new
    file is refused before anything is written, with the command's line; the flow from no deployment (what `batch
    openai` starts, having met the budget itself) is not refused again, and a deployment's run of a file begun before
    goes on to the end."""
    import yaml
    from prefect.client.orchestration import get_client

    from shardline.flows.openai_batch import openai_batch
    from tests.integration.automations import run_deployment_here
    from tests.support.budgets import spend, write_prices

    write_prices(shardline_home)
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"tenants": [{"name": "iota", "batch": {"storage_prefixes": [str(tmp_path)]},
                                                    "budget": {"monthly": 1000.0}}]}))
    monkeypatch.setenv("SHARDLINE_TENANTS_FILE", str(tenants))
    spend(shardline_home, "iota", 1025.0)
    with get_client(sync_client=True) as client:  # (Prefect's client: a busy test server's 503 is retried)
        deployment = client.create_deployment(client.create_flow_from_name("openai-batch"), "nightly-openai",
                                              entrypoint="flows/openai_batch.py:openai_batch")
    source = write_jsonl(tmp_path / "requests.jsonl", good_lines(4))

    def run(output: Path) -> Any:
        return run_deployment_here(str(deployment), {"input_uri": str(source), "output_uri": str(output),
                                                     "lines_per_part": 2, "tenant": "iota"})

    refused = run(tmp_path / "refused")
    assert refused.is_failed(), refused
    assert "tenant 'iota' is at its budget's hard limit: new work is refused until the month ends or the budget " \
           "grows (spent 1,025.00 USD of 1,000.00 USD (102%)" in str(refused.message)
    assert "the job was not started" in str(refused.message) and not (tmp_path / "refused").exists()

    begun = openai_batch(str(source), str(tmp_path / "begun"), lines_per_part=2, tenant="iota", return_state=True)
    assert begun.is_completed(), begun.message
    again = run(tmp_path / "begun")
    assert again.is_completed(), again.message
    assert (again.result()["total"], again.result()["parts_skipped"]) == (4, 2)
