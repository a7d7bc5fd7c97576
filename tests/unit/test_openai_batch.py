"""OpenAI Batch files without a model: every line's check, what refuses a whole file, the part plan, the
job's identity, the records and batch object written, and the output folder on an in-memory file system."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import orjson
import pytest

from shardline.errors import InvalidInput
from shardline.build.llm_build import llm_signature
from shardline.openai_batch import (
    BatchCounts,
    BatchJobRecord,
    BatchLine,
    PartSpec,
    RefusedLine,
    answer_record,
    batch_job_id,
    batch_object,
    check_batch_file,
    endpoint_problem,
    error_record,
    exit_status,
    identity_differences,
    pending_parts,
    plan_parts,
)
from shardline.openai_wire import EmbeddingRequest, GenerationRequest
from shardline.signature import ColumnSpec, Signature
from shardline.storage.openai_batch import BatchOutputFolder

CHAT, TEXT, EMBED = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"


def line(custom_id: Any, url: str = CHAT, method: Any = "POST", **body: Any) -> bytes:
    default = ({"messages": [{"role": "user", "content": "hi"}]} if url == CHAT else
               {"input": "hi"} if url == EMBED else {"prompt": "once"})
    doc: dict[str, Any] = {"method": method, "url": url, "body": {"model": "tiny@prod", **default, **body}}
    if custom_id is not None:
        doc["custom_id"] = custom_id
    return orjson.dumps(doc)


def jsonl(*lines: bytes) -> bytes:
    return b"\n".join(lines) + b"\n"


def test_each_line_is_checked_and_a_bad_one_becomes_a_refused_line_naming_what_to_fix() -> None:
    data = jsonl(
        line("a", max_tokens=4, temperature=0, stop=["\n"], seed=3),
        b"{not json",
        line(None),
        line("b", method="GET"),
        line("c", url="/v1/images/generations"),
        line("d", TEXT, prompt="x", temperature=5),
        line("e", TEXT, prompt="x", stream=True),
        b"   ",
        b"[1, 2]",
        orjson.dumps({"custom_id": "f", "method": "POST", "url": CHAT, "body": "hello"}),
        line("g", TEXT, prompt="once", max_tokens=2),
        line("h", EMBED, input=["one", "two"], encoding_format="base64"),
    )

    checked = check_batch_file(data)

    assert checked.model == "tiny@prod" and checked.endpoints == (CHAT, TEXT, EMBED)
    assert [e.number for e in checked.entries] == [1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12]  # the blank line 8 is skipped
    good = [e for e in checked.entries if isinstance(e, BatchLine)]
    assert [(g.custom_id, g.url) for g in good] == [("a", CHAT), ("g", TEXT), ("h", EMBED)]
    first = good[0].request
    assert isinstance(first, GenerationRequest)
    assert (first.max_tokens, first.temperature, first.stop, first.seed) == (4, 0.0, ("\n",), 3)
    assert good[2].request == EmbeddingRequest("tiny@prod", ["one", "two"], "base64", None)
    refused = {e.number: e for e in checked.entries if isinstance(e, RefusedLine)}
    assert refused[2].custom_id is None and refused[2].message.startswith("line 2 is not JSON")
    assert refused[3].custom_id is None and "field 'custom_id' is None" in refused[3].message
    assert refused[4].custom_id == "b" and "field 'method' is 'GET'" in refused[4].message
    assert "field 'url' is '/v1/images/generations'; use one of /v1/chat/completions" in refused[5].message
    assert refused[6].message.startswith("line 6: field 'temperature' is 5; send a number from 0 to 2")
    assert "field 'stream' is true" in refused[7].message
    assert "line 9 is an array, not a JSON object" in refused[9].message
    assert refused[10].custom_id == "f" and "field 'body' is 'hello'" in refused[10].message


def test_a_custom_id_twice_refuses_the_file_naming_both_lines() -> None:
    data = jsonl(line("a"), line("b"), line("c", method="GET"), line("b", TEXT))
    with pytest.raises(InvalidInput, match=r"custom_id 'b' on line 2 and on line 4; custom_ids must be unique"):
        check_batch_file(data)


def test_two_models_refuse_the_file_naming_them() -> None:
    data = jsonl(line("a"), line("b", model="other@prod"))
    with pytest.raises(InvalidInput, match=r"names 2 models: 'tiny@prod' \(line 1\), 'other@prod' \(line 2\)"):
        check_batch_file(data)


def test_a_file_without_a_request_is_refused() -> None:
    with pytest.raises(InvalidInput, match="holds no request naming a model"):
        check_batch_file(b"\n{not json\n")


def test_the_model_must_fit_the_endpoints() -> None:
    embedding = Signature(inputs=(ColumnSpec(name="text", type="string"),),
                          outputs=(ColumnSpec(name="embedding", type="fixed_size_list<float32>[8]"),))
    assert endpoint_problem((CHAT, TEXT), "tiny:1", "llm", llm_signature()) is None
    assert endpoint_problem((EMBED,), "minilm:1", "onnx", embedding) is None
    problem = endpoint_problem((EMBED,), "tiny:1", "llm", llm_signature())
    assert problem is not None and "call /v1/embeddings, but tiny:1 is not an embedding model" in problem
    problem = endpoint_problem((TEXT,), "minilm:1", "onnx", embedding)
    assert problem is not None and "call /v1/completions, but minilm:1 does not generate text" in problem


def test_parts_are_consecutive_lines_and_a_rerun_skips_the_committed_ones() -> None:
    parts = plan_parts(7, 3)

    assert parts == (PartSpec(0, 0, 3), PartSpec(1, 3, 6), PartSpec(2, 6, 7))
    assert [p.name for p in parts] == ["part-000000.jsonl", "part-000001.jsonl", "part-000002.jsonl"]
    assert pending_parts(parts, {"part-000001.jsonl", "part-999999.jsonl"}) == (parts[0], parts[2])
    assert plan_parts(0, 100) == ()
    with pytest.raises(InvalidInput, match="--lines-per-part is 0"):
        plan_parts(5, 0)


def _record(**changes: Any) -> BatchJobRecord:
    fields: dict[str, Any] = dict(job_id=batch_job_id("ab" * 32, "tiny@prod", 10), input_uri="/in.jsonl",
                                  input_sha256="ab" * 32, model_reference="tiny@prod", model="tiny:1",
                                  model_digest="d", lines_per_part=10, entries=25, parts=3,
                                  created_at=datetime(2026, 1, 2, tzinfo=timezone.utc))
    return BatchJobRecord(**{**fields, **changes})


def test_a_rerun_that_changes_the_input_model_or_part_size_is_named() -> None:
    recorded = _record()

    assert identity_differences(recorded, "ab" * 32, "tiny@prod", 10) == []
    changed = identity_differences(recorded, "cd" * 32, "other@prod", 5)
    assert changed[0].startswith("the input's bytes (sha256 cdcdcdcdcdcd..., the job's abababababab...)")
    assert changed[1] == "the model ('other@prod', the job's 'tiny@prod', pinned to tiny:1)"
    assert changed[2] == "--lines-per-part (5, the job's 10)"
    assert batch_job_id("ab" * 32, "tiny@prod", 10) != batch_job_id("ab" * 32, "tiny@prod", 11)


def test_records_and_the_batch_object_have_openais_shapes() -> None:
    ok = answer_record("job1", 3, "q-3", {"object": "chat.completion"})
    failed = error_record("job1", 4, None, "line 4: field 'temperature' is 5; send a number from 0 to 2")

    assert ok["id"].startswith("batch_req_") and ok["error"] is None and ok["custom_id"] == "q-3"
    assert ok["response"]["status_code"] == 200 and ok["response"]["request_id"].startswith("req_")
    assert ok == answer_record("job1", 3, "q-3", {"object": "chat.completion"})  # the same line: the same ids
    assert failed["response"]["status_code"] == 400 and failed["custom_id"] is None
    assert failed["response"]["body"]["error"] == {
        "message": "line 4: field 'temperature' is 5; send a number from 0 to 2", "type": "invalid_request_error",
        "param": "temperature", "code": None}
    counts = BatchCounts(25, 23, 2)
    batch = batch_object(_record(), (CHAT, TEXT), counts, "/out/output.jsonl", "/out/errors.jsonl",
                         datetime(2026, 1, 2, 0, 5, tzinfo=timezone.utc))
    assert (batch["object"], batch["status"], batch["endpoint"], batch["input_file_id"]) == (
        "batch", "completed", CHAT, "/in.jsonl")
    assert batch["id"] == f"batch_{_record().job_id}" and batch["completed_at"] - batch["created_at"] == 300
    assert batch["request_counts"] == {"total": 25, "completed": 23, "failed": 2}
    assert (batch["output_file_id"], batch["error_file_id"]) == ("/out/output.jsonl", "/out/errors.jsonl")
    assert batch["metadata"]["endpoints"] == f"{CHAT},{TEXT}" and batch["metadata"]["model"] == "tiny:1"
    assert (exit_status(counts), exit_status(BatchCounts(3, 3, 0))) == (3, 0)
    clean = batch_object(_record(), (TEXT,), BatchCounts(3, 3, 0), "o", "e", datetime.now(timezone.utc))
    assert clean["error_file_id"] is None


def test_the_output_folder_commits_parts_whole_and_assembles_them_in_order() -> None:
    folder = BatchOutputFolder("memory://openai-batch-unit/out")
    assert folder.read_job() is None and folder.committed_parts() == set()
    record = _record()
    assert folder.create_job(record) == record
    assert folder.create_job(_record(job_id="another")) == record  # the first record stays

    folder.commit_part("part-000001.jsonl", [answer_record("j", 3, "c", {"n": 3}), error_record("j", 4, "d", "bad")])
    folder.commit_part("part-000000.jsonl", [answer_record("j", 1, "a", {"n": 1}),
                                             answer_record("j", 2, "b", {"n": 2})])
    counts = folder.assemble(["part-000000.jsonl", "part-000001.jsonl"])

    assert folder.committed_parts() == {"part-000000.jsonl", "part-000001.jsonl"}
    assert counts == BatchCounts(4, 3, 1)
    out = [orjson.loads(x) for x in folder.fs.cat_file(folder.path("output.jsonl")).splitlines()]
    errors = [orjson.loads(x) for x in folder.fs.cat_file(folder.path("errors.jsonl")).splitlines()]
    assert [r["custom_id"] for r in out] == ["a", "b", "c"] and [r["custom_id"] for r in errors] == ["d"]
    assert folder.read_batch() is None
    folder.commit_batch({"id": "batch_x"})
    folder.drop_staging()
    assert folder.read_batch() == {"id": "batch_x"} and not folder.fs.exists(folder.path("_staging"))
