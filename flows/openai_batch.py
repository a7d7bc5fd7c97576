"""The OpenAI Batch file flow: plan -> answer the parts -> finish (output.jsonl, errors.jsonl, batch.json).

A JSONL file of OpenAI requests (``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``) is
checked line by line, its one model pinned, and its lines answered in parts committed one by one, so a
run that stops is resumed by running it again: only the parts not yet committed are answered. The flow
only wires tasks (tasks/openai_batch.py); it reads the settings once and passes them down.
"""

from __future__ import annotations

from typing import Any, Sequence

from prefect import flow
from prefect.states import State

from shardline.tasks.arguments import whole
from shardline.tasks.artifacts import current_deployment
from shardline.tasks.openai_batch import (
    PartWatcher,
    answer_openai_parts,
    finish_openai_batch,
    holding_output,
    openai_batch_outcome,
    plan_openai_batch,
)
from shardline.tasks.openai_batch_survey import OpenAIBatchSettings


@flow(name="openai-batch", log_prints=True, validate_parameters=True)
def openai_batch(
    input_uri: str,
    output_uri: str,
    lines_per_part: int = 100,
    tenant: str = "default",
    watchers: Sequence[PartWatcher] = (),
) -> State[Any]:
    """Answer every request line of an OpenAI Batch file with the one model it names.

    Args:
        input_uri: the batch file (JSONL), local or any fsspec URL.
        output_uri: folder for ``output.jsonl``, ``errors.jsonl``, ``batch.json`` and the committed parts.
        lines_per_part: consecutive lines answered and committed together (a re-run skips committed parts).
        tenant: who the job runs for; with a tenants file, its storage prefixes apply.
        watchers: for a run in this process only (a test): called as ``(parts committed, parts, lines)``.

    Returns:
        Completed with the summary (counts and the files' URLs); Completed named "Quarantined" when
        some lines failed (their error records are in ``errors.jsonl``).
    """
    settings = OpenAIBatchSettings.read()
    plan = plan_openai_batch(input_uri, output_uri, lines_per_part, tenant, settings, current_deployment())
    with holding_output(plan):
        plan = answer_openai_parts(whole(plan), settings, watchers)
        summary = finish_openai_batch(whole(plan))
    return openai_batch_outcome(summary)
