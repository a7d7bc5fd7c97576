"""OpenAI Batch files, the pure part: the line checks, the part plan, the job's identity and the shapes written.

An OpenAI Batch file is JSONL, one request a line::

    {"custom_id": "q-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny@prod", ...}}

``check_batch_file`` reads every line once. A line that is not a JSON object, lacks a string
``custom_id``, has another method than POST, a URL other than ``/v1/chat/completions``,
``/v1/completions`` or ``/v1/embeddings``, or a body that endpoint's parser refuses
(``shardline.openai_wire``, as the HTTP tier reads it) becomes a ``RefusedLine``: it is answered
with an error line, the rest goes on. The whole file is refused (``InvalidInput``) only for what no
answer can fix: a ``custom_id`` twice (both lines named), bodies naming two models, or no request.
Blank lines are skipped.

``plan_parts`` cuts the lines into parts of ``lines_per_part`` consecutive lines: each part is
answered and committed as one file, and a re-run skips the parts already committed
(``pending_parts``). A job is its input's sha256, its model reference (pinned to a version at its
first run) and its part size: ``BatchJobRecord``; ``identity_differences`` says what a re-run into
the same folder changed. ``answer_record``, ``error_record`` and ``batch_object`` are the shapes of
OpenAI's output file, error file and batch object.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Collection, Sequence

import orjson
from pydantic import BaseModel

from shardline.errors import InvalidInput, ShardlineError
from shardline.openai_wire import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    EMBEDDINGS,
    EmbeddingRequest,
    GenerationRequest,
    embedding_io,
    error_object,
    parse_embedding_request,
    parse_generation_request,
    shown,
)
from shardline.runtimes import generates
from shardline.signature import Signature

ENDPOINTS = (CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS)
GENERATION_ENDPOINTS = (CHAT_COMPLETIONS, COMPLETIONS)


@dataclass(frozen=True)
class BatchLine:
    """A request line that passed its checks: where it is, its ``custom_id``, endpoint and decoded body."""

    number: int  # the line's number in the file, from 1
    custom_id: str
    url: str
    request: GenerationRequest | EmbeddingRequest

    @property
    def chat(self) -> bool:
        """Whether it is a chat completions request."""
        return self.url == CHAT_COMPLETIONS


@dataclass(frozen=True)
class RefusedLine:
    """A line answered with an error (status 400) without running the model: what was wrong with it."""

    number: int
    custom_id: str | None  # None when the line has no string custom_id
    message: str


Entry = BatchLine | RefusedLine


@dataclass(frozen=True)
class BatchFile:
    """Every non-blank line of a batch file, in order, and the one model reference the bodies name."""

    entries: tuple[Entry, ...]
    model: str

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The endpoints the accepted lines call, in the order of ``ENDPOINTS``."""
        used = {e.url for e in self.entries if isinstance(e, BatchLine)}
        return tuple(url for url in ENDPOINTS if url in used)


def _line_problem(number: int, doc: Any) -> tuple[str | None, str | None, Any]:
    """(custom_id, what is wrong or None, body) of one decoded line, before its body is parsed."""
    if not isinstance(doc, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(doc), "a number")
        return None, (f"line {number} is {kind}, not a JSON object; send "
                      "{\"custom_id\", \"method\", \"url\", \"body\"}"), None
    custom_id = doc.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, (f"line {number}: field 'custom_id' is {shown(custom_id)}; give every line a unique, "
                      "non-empty string custom_id"), None
    method = doc.get("method")
    if method != "POST":
        return custom_id, f"line {number}: field 'method' is {shown(method)}; every batch line is a \"POST\"", None
    url = doc.get("url")
    if url not in ENDPOINTS:
        return custom_id, (f"line {number}: field 'url' is {shown(url)}; use one of {', '.join(ENDPOINTS)}"), None
    body = doc.get("body")
    if not isinstance(body, dict):
        return custom_id, f"line {number}: field 'body' is {shown(body)}; send the request's JSON object", None
    return custom_id, None, body


def _parse_body(url: str, body: dict[str, Any]) -> GenerationRequest | EmbeddingRequest:
    """The body as its endpoint reads it (``InvalidInput`` naming the field), with what a batch cannot do refused."""
    if url == EMBEDDINGS:
        return parse_embedding_request(body)
    request = parse_generation_request(body, chat=url == CHAT_COMPLETIONS)
    if request.stream:
        raise InvalidInput("field 'stream' is true; a batch answers each request whole: leave 'stream' out")
    return request


def check_batch_file(data: bytes) -> BatchFile:
    """Read and check every line of a batch file (see the module docstring).

    Raises:
        InvalidInput: a ``custom_id`` on two lines (both named), bodies naming two or more models, or no
            request at all: the file is refused and nothing is answered.
    """
    entries: list[Entry] = []
    seen: dict[str, int] = {}
    models: dict[str, int] = {}
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            entries.append(RefusedLine(number, None, f"line {number} is not JSON ({e}); send one JSON object a line"))
            continue
        custom_id, problem, body = _line_problem(number, doc)
        if custom_id is not None:
            if custom_id in seen:
                raise InvalidInput(f"the batch file has custom_id {custom_id!r} on line {seen[custom_id]} and on line "
                                   f"{number}; custom_ids must be unique in a file: rename one and submit it again")
            seen[custom_id] = number
        if isinstance(body, dict) and isinstance(body.get("model"), str) and body["model"].strip():
            models.setdefault(body["model"].strip(), number)
        if problem is not None:
            entries.append(RefusedLine(number, custom_id, problem))
            continue
        assert custom_id is not None and body is not None
        url = doc["url"]
        try:
            entries.append(BatchLine(number, custom_id, url, _parse_body(url, body)))
        except InvalidInput as e:
            entries.append(RefusedLine(number, custom_id, f"line {number}: {e}"))
    if len(models) > 1:
        named = ", ".join(f"{m!r} (line {n})" for m, n in sorted(models.items(), key=lambda kv: kv[1]))
        raise InvalidInput(f"the batch file names {len(models)} models: {named}; a batch file calls one model "
                           "(as OpenAI's do): split it into one file per model")
    if not models:
        raise InvalidInput("the batch file holds no request naming a model ('body.model'); send JSONL lines of "
                           "{\"custom_id\", \"method\": \"POST\", \"url\", \"body\": {\"model\", ...}}")
    return BatchFile(tuple(entries), next(iter(models)))


def endpoint_problem(endpoints: Sequence[str], pinned: str, runtime: str, signature: Signature) -> str | None:
    """Why the model cannot answer the file's endpoints (the message), or None when it can: text generation
    needs the ``llm`` runtime, embeddings one string input and one ``fixed_size_list<float>`` output."""
    for url in endpoints:
        if url in GENERATION_ENDPOINTS and not generates(runtime):
            return (f"the batch file's lines call {url}, but {pinned} does not generate text (runtime {runtime!r}); "
                    "name a text-generation model (runtime 'llm') in the file")
        if url == EMBEDDINGS and embedding_io(signature) is None:
            return (f"the batch file's lines call {url}, but {pinned} is not an embedding model (it reads "
                    f"{signature.input_names[:3]} and writes {signature.output_names}); name an embedding model "
                    "(one string input, one list of floats out) in the file")
    return None


@dataclass(frozen=True)
class PartSpec:
    """One part of a job: the entries ``first`` up to ``stop`` (positions among the file's entries)."""

    index: int
    first: int
    stop: int

    @property
    def name(self) -> str:
        """The part's file name under ``_parts/``."""
        return f"part-{self.index:06d}.jsonl"


def plan_parts(entries: int, lines_per_part: int) -> tuple[PartSpec, ...]:
    """Consecutive parts of ``lines_per_part`` entries (the last may be shorter).

    Raises:
        InvalidInput: ``lines_per_part`` is below 1.
    """
    if lines_per_part < 1:
        raise InvalidInput(f"--lines-per-part is {lines_per_part}; give a whole number of at least 1")
    return tuple(PartSpec(i, first, min(first + lines_per_part, entries))
                 for i, first in enumerate(range(0, entries, lines_per_part)))


def pending_parts(parts: Sequence[PartSpec], committed: Collection[str]) -> tuple[PartSpec, ...]:
    """The parts still to answer: those whose file is not committed."""
    return tuple(p for p in parts if p.name not in committed)


class BatchJobRecord(BaseModel):
    """What a job is (kept in the output folder as ``_job.json`` from its first run): its input's bytes, its
    model (the reference in the file and the version it was pinned to) and its part size."""

    job_id: str
    input_uri: str
    input_sha256: str
    model_reference: str
    model: str  # pinned: name:version
    model_digest: str
    lines_per_part: int
    entries: int
    parts: int
    created_at: datetime


def batch_job_id(input_sha256: str, model_reference: str, lines_per_part: int) -> str:
    """A job's id: what decides its answers, hashed (the pinned version follows from the first run)."""
    key = f"{input_sha256}\n{model_reference}\n{lines_per_part}".encode()
    return hashlib.sha256(key).hexdigest()[:16]


def identity_differences(recorded: BatchJobRecord, input_sha256: str, model_reference: str,
                         lines_per_part: int) -> list[str]:
    """What a re-run changed against the job recorded in its output folder ([] for the same job)."""
    changed = []
    if recorded.input_sha256 != input_sha256:
        changed.append(f"the input's bytes (sha256 {input_sha256[:12]}..., the job's {recorded.input_sha256[:12]}...)")
    if recorded.model_reference != model_reference:
        changed.append(f"the model ({model_reference!r}, the job's {recorded.model_reference!r}, pinned to "
                       f"{recorded.model})")
    if recorded.lines_per_part != lines_per_part:
        changed.append(f"--lines-per-part ({lines_per_part}, the job's {recorded.lines_per_part})")
    return changed


def _ids(job_id: str, number: int) -> tuple[str, str]:
    """A line's (batch_req id, request_id): the same for the same job and line, so a redone part is identical."""
    digest = hashlib.sha256(f"{job_id}:{number}".encode()).hexdigest()
    return f"batch_req_{digest[:24]}", f"req_{digest[24:48]}"


def answer_id(job_id: str, number: int, prefix: str) -> str:
    """A line's completion id (``chatcmpl-...``, ``cmpl-...``), stable for the job and line."""
    return prefix + hashlib.sha256(f"{job_id}:{number}:answer".encode()).hexdigest()[:24]


def answer_record(job_id: str, number: int, custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """A line of OpenAI's output file: the answer the HTTP endpoint gives, with status 200."""
    record_id, request_id = _ids(job_id, number)
    return {"id": record_id, "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


def error_record(job_id: str, number: int, custom_id: str | None, message: str, status: int = 400,
                 error: ShardlineError | None = None) -> dict[str, Any]:
    """A line of OpenAI's error file: the status and OpenAI's error body (with ``error``'s code and param, as the
    HTTP endpoint answers them)."""
    record_id, request_id = _ids(job_id, number)
    body = error_object(message, status, error.code if error else None, error.param if error else None)
    return {"id": record_id, "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


def is_answered(record: dict[str, Any]) -> bool:
    """Whether a part's record belongs to the output file (status 200) rather than the error file."""
    return bool(record.get("response", {}).get("status_code") == 200)


@dataclass(frozen=True)
class BatchCounts:
    """OpenAI's ``request_counts``."""

    total: int
    completed: int
    failed: int

    def as_dict(self) -> dict[str, int]:
        """``{"total", "completed", "failed"}``."""
        return {"total": self.total, "completed": self.completed, "failed": self.failed}


def batch_object(job: BatchJobRecord, endpoints: Sequence[str], counts: BatchCounts, output_uri: str,
                 errors_uri: str, completed_at: datetime) -> dict[str, Any]:
    """OpenAI's batch object for a finished job (``endpoint``: the one the lines call; with several, the first,
    and ``metadata.endpoints`` lists them all)."""
    created, done = int(job.created_at.timestamp()), int(completed_at.timestamp())
    return {
        "id": f"batch_{job.job_id}", "object": "batch", "endpoint": endpoints[0] if endpoints else None,
        "errors": None, "input_file_id": job.input_uri, "completion_window": "24h", "status": "completed",
        "output_file_id": output_uri, "error_file_id": errors_uri if counts.failed else None,
        "created_at": created, "in_progress_at": created, "expires_at": None, "finalizing_at": done,
        "completed_at": done, "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
        "request_counts": counts.as_dict(),
        "metadata": {"model": job.model, "endpoints": ",".join(endpoints), "input_sha256": job.input_sha256,
                     "lines_per_part": str(job.lines_per_part)},
    }


def exit_status(counts: BatchCounts) -> int:
    """The command's exit code for a finished job: 0 when every line was answered, 3 when some failed."""
    return 0 if counts.failed == 0 else 3


__all__ = ["ENDPOINTS", "BatchCounts", "BatchFile", "BatchJobRecord", "BatchLine", "Entry", "PartSpec", "RefusedLine",
           "answer_id", "answer_record", "batch_job_id", "batch_object", "check_batch_file", "endpoint_problem",
           "error_record", "exit_status", "identity_differences", "is_answered", "pending_parts", "plan_parts"]
