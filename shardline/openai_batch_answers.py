"""Answering one part of an OpenAI Batch file with a loaded model: the records of OpenAI's output and error files.

- Chat and text completions (``answer_generation_part``): every line of the part is submitted to the
  ``llm`` runtime's engine at once, each with its own ``SamplingParams`` from its body (``max_tokens``,
  ``temperature``, ``top_p``, ``seed``, ``stop``), so the lines share the engine's decode steps. A line
  the engine refuses (``InvalidInput``: a prompt too long, a chat role its template does not know) is
  an error record with status 400 and the message; the rest of the part goes on. An engine that fails
  while generating fails the part (``InferenceFailed``): the job stops, and a re-run redoes the part.
- Embeddings (``answer_embedding_part``): every text of the part in one ``predict`` call (a batch the
  model refuses is answered line by line, so only the lines at fault get an error record).

Each answer's body is what the HTTP endpoint answers (``shardline.openai_wire``), with usage.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa

from shardline.bundle import Manifest
from shardline.errors import ContextLengthExceeded, InferenceFailed, InvalidInput
from shardline.openai_batch import BatchLine, answer_id, answer_record, error_record
from shardline.openai_wire import (
    CompletionAnswer,
    EmbeddingRequest,
    GenerationRequest,
    completion_answer,
    embedding_answer,
    embedding_io,
)
from shardline.runtimes.base import Runtime
from shardline.runtimes.generation import Engine, RequestHandle, SamplingParams, TokenEvent

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat may fill the context (as the HTTP tier)

Clock = Callable[[], float]


class _Collector:
    """One line's events, joined; ``done`` is set by the engine's thread with the last one."""

    def __init__(self) -> None:
        self.events: list[TokenEvent] = []
        self.done = threading.Event()

    def __call__(self, event: TokenEvent) -> None:
        self.events.append(event)
        if event.finish_reason is not None:
            self.done.set()

    def answer(self, where: str) -> CompletionAnswer:
        last = self.events[-1]
        if last.finish_reason not in ("stop", "length"):
            raise InferenceFailed(f"{where}: the generation ended {last.finish_reason!r}"
                                  f"{f' ({last.error})' if last.error else ''}; run the job again to redo this part")
        return CompletionAnswer("".join(e.text for e in self.events), last.finish_reason, last.prompt_tokens,
                                last.completion_tokens)


def sampling_for(engine: Engine, request: GenerationRequest) -> tuple[list[int], SamplingParams]:
    """A request's prompt tokens and sampling parameters, as the HTTP tier makes them.

    Raises:
        InvalidInput: a chat message the template cannot render, or a parameter out of range.
    """
    default = engine.config.max_context if request.messages is not None else COMPLETION_DEFAULT_MAX_TOKENS
    params = SamplingParams(max_tokens=request.max_tokens or default, temperature=request.temperature,
                            top_p=request.top_p, seed=request.seed, stop=request.stop)
    prompt = request.prompt if request.messages is None else engine.chat_prompt(request.messages)
    return engine.tokenize(prompt or ""), params


def answer_generation_part(engine: Engine, lines: Sequence[BatchLine], job_id: str, model: str,
                           clock: Clock = time.time) -> list[dict[str, Any]]:
    """The records of a part's chat and completions lines, in their order (see the module docstring).

    Raises:
        InferenceFailed: the engine failed while generating (nothing of the part is kept).
    """
    records: list[dict[str, Any] | None] = [None] * len(lines)
    running: list[tuple[int, _Collector]] = []
    handles: list[RequestHandle] = []
    try:
        for i, line in enumerate(lines):
            assert isinstance(line.request, GenerationRequest)
            try:
                prompt_ids, params = sampling_for(engine, line.request)
                collector = _Collector()
                handles.append(engine.submit(prompt_ids, params, collector))
            except InvalidInput as e:
                if isinstance(e, ContextLengthExceeded):
                    e.param = line.request.prompt_field
                records[i] = error_record(job_id, line.number, line.custom_id, f"line {line.number}: {e}", error=e)
                continue
            running.append((i, collector))
        for i, collector in running:
            collector.done.wait()
            line = lines[i]
            done = collector.answer(f"line {line.number} (custom_id {line.custom_id!r})")
            body = completion_answer(line.chat, answer_id(job_id, line.number, "chatcmpl-" if line.chat else "cmpl-"),
                                     int(clock()), model, done)
            records[i] = answer_record(job_id, line.number, line.custom_id, body)
    finally:
        for handle in handles:
            handle.cancel()  # a no-op for those that finished; frees the slots of the rest when one failed
    return [r for r in records if r is not None]


def _token_counter(bundle_dir: Path, manifest: Manifest) -> Callable[[list[str]], list[int]]:
    """Tokens the model reads for each text (its own tokenizer and cut, as the HTTP tier counts them); 0s for a
    model without ``text_inputs``."""
    config = manifest.runtime_config.get("text_inputs")
    if not isinstance(config, dict):
        return lambda texts: [0] * len(texts)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(bundle_dir) / config["tokenizer"]))
    tokenizer.enable_truncation(max_length=int(config["max_length"]))
    tokenizer.no_padding()
    return lambda texts: [len(e.ids) for e in tokenizer.encode_batch(texts)]


def _embed(runtime: Runtime, texts: list[str]) -> np.ndarray:
    """The (texts, size) float32 vectors of an embedding model."""
    signature = runtime.manifest.signature
    found = embedding_io(signature)
    assert found is not None, "the job checked that the model is an embedding model"
    text_column, embedding_column, size = found
    answer = runtime.predict(pa.table({text_column: pa.array(texts, pa.string())}))
    column = signature.plan.answer_table(answer).column(embedding_column).combine_chunks()
    return column.flatten().to_numpy().astype(np.float32, copy=False).reshape(len(texts), size)


def answer_embedding_part(runtime: Runtime, lines: Sequence[BatchLine], job_id: str,
                          model: str) -> list[dict[str, Any]]:
    """The records of a part's embeddings lines, in their order (see the module docstring).

    Raises:
        InferenceFailed: the model failed on texts it accepted.
    """
    found = embedding_io(runtime.manifest.signature)
    assert found is not None, "the job checked that the model is an embedding model"
    size = found[2]
    records: list[dict[str, Any] | None] = [None] * len(lines)
    todo: list[tuple[int, EmbeddingRequest]] = []
    for i, line in enumerate(lines):
        request = line.request
        assert isinstance(request, EmbeddingRequest)
        if request.dimensions is not None and request.dimensions != size:
            records[i] = error_record(job_id, line.number, line.custom_id, (
                f"line {line.number}: field 'dimensions' is {request.dimensions}; {model} makes {size}-dimensional "
                "embeddings and cannot shorten them: leave 'dimensions' out"))
        else:
            todo.append((i, request))
    count = _token_counter(runtime.bundle_dir, runtime.manifest)
    texts = [t for _, request in todo for t in request.texts]
    try:
        vectors = _embed(runtime, texts) if texts else np.zeros((0, size), np.float32)
        groups = [(i, r, vectors[at:at + len(r.texts)]) for (i, r), at in zip(todo, _offsets(todo))]
    except InvalidInput:  # one text the model refuses: find it, line by line
        groups = []
        for i, request in todo:
            try:
                groups.append((i, request, _embed(runtime, request.texts)))
            except InvalidInput as e:
                line = lines[i]
                records[i] = error_record(job_id, line.number, line.custom_id, f"line {line.number}: {e}", error=e)
    for i, request, matrix in groups:
        line = lines[i]
        body = embedding_answer(model, matrix, request.encoding, sum(count(request.texts)))
        records[i] = answer_record(job_id, line.number, line.custom_id, body)
    return [r for r in records if r is not None]


def _offsets(todo: list[tuple[int, EmbeddingRequest]]) -> list[int]:
    offsets, at = [], 0
    for _, request in todo:
        offsets.append(at)
        at += len(request.texts)
    return offsets


__all__ = ["answer_embedding_part", "answer_generation_part", "sampling_for"]
