"""The OpenAI Batch file job's settings, plan and every check of planning that reads and never writes, without
Prefect: `batch openai` makes them before it starts a flow run, so that a wrong file or request is refused in the
command without Prefect's imports; the plan task (``tasks/openai_batch.py``) makes them again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from functools import partial
from typing import Any

from pydantic import ValidationError

from shardline.errors import InvalidInput, OutputInUse
from shardline.openai_batch import (
    BatchFile,
    BatchJobRecord,
    PartSpec,
    batch_job_id,
    check_batch_file,
    endpoint_problem,
    identity_differences,
    plan_parts,
)
from shardline.settings import BatchSettings, MeteringSettings, RuntimeSettings, StorageSettings, TenancySettings
from shardline.settings.problems import settings_error
from shardline.storage.fs import resolve_location
from shardline.storage.job_folders import refuse_job_folder_overlap
from shardline.storage.lease import OutputLease
from shardline.storage.openai_batch import BatchOutputFolder, read_batch_input
from shardline.storage.registry import ModelRegistry, ResolvedModel
from shardline.tenants import BatchTenant, admit_locations, batch_tenant, check_custom_code

OPENAI_SOFT = "the batch file runs as it is"
"""What a tenant's soft limit makes of an OpenAI batch job: nothing (it has no priority class or capacity to lower)."""


@dataclass(frozen=True)
class OpenAIBatchSettings:
    """The settings areas the job reads, read once at the flow's start."""

    storage: StorageSettings
    batch: BatchSettings
    runtime: RuntimeSettings
    tenancy: TenancySettings
    metering: MeteringSettings

    @classmethod
    def read(cls) -> OpenAIBatchSettings:
        """The settings from the environment.

        Raises:
            InvalidSetting: a setting is not valid: one line naming its variable.
        """
        try:
            return cls(StorageSettings(), BatchSettings(), RuntimeSettings(), TenancySettings(), MeteringSettings())
        except ValidationError as e:
            raise settings_error(e) from e


@dataclass
class OpenAIBatchPlan:
    """A job as planned: its checked file, pinned model, output folder, parts, and the lease it holds."""

    job: BatchJobRecord
    file: BatchFile
    model: ResolvedModel
    output: BatchOutputFolder
    parts: tuple[PartSpec, ...]
    pending: tuple[PartSpec, ...]
    tenant: str  # who the job runs for (its use is metered to it)
    recorded: bool = False  # the folder held this job's record already (an earlier run's)
    lease: OutputLease | None = None
    finished: dict[str, Any] | None = None  # the folder's batch object when the job is already finished
    answered: list[str] = field(default_factory=list)  # the parts this run committed


def refuse_another_job(output: BatchOutputFolder, recorded: BatchJobRecord | None, sha256: str, reference: str,
                        lines_per_part: int) -> None:
    """Refuse a run into a folder that holds another job (another input, model or part size), naming what differs."""
    changed = identity_differences(recorded, sha256, reference, lines_per_part) if recorded is not None else []
    if recorded is not None and changed:
        raise OutputInUse(
            f"the output {output.uri} holds OpenAI batch job {recorded.job_id} (input {recorded.input_uri}, model "
            f"{recorded.model}); this run differs in {'; '.join(changed)}: choose another --output, or delete the "
            "folder to answer this file anew", output.uri, recorded.job_id)


def _checked_model(registry: ModelRegistry, reference: str, checked: BatchFile,
                   tenant: BatchTenant | None) -> ResolvedModel:
    """The model pinned (``reference``: the file's, or the version of the job's first run), fit for the file's
    endpoints and allowed to the tenant."""
    model = registry.resolve(reference)
    manifest = model.manifest
    problem = endpoint_problem(checked.endpoints, model.pinned, manifest.runtime, manifest.signature)
    if problem is not None:
        raise InvalidInput(problem)
    check_custom_code(manifest.runtime, model.pinned, tenant.name if tenant else None,
                      tenant.custom_code if tenant else True)
    return model


def survey_openai_batch(input_uri: str, output_uri: str, lines_per_part: int, tenant: str,
                        settings: OpenAIBatchSettings) -> OpenAIBatchPlan:
    """Every check of planning that reads and never writes: admission, the file, its model, what the output holds.

    The plan it returns holds no lease yet (``lease`` None; ``pending`` every part unless the folder holds this
    very job finished). `batch openai` calls it before any flow run (with :func:`check_openai_batch`); the plan
    task calls it again.

    Raises:
        InvalidInput: the file is refused (a custom_id twice, two models, no request), its model does not
            fit its endpoints, or ``lines_per_part`` is below 1.
        InvalidSetting, AccessDenied: the tenant or a location is refused; the input is missing.
        ModelNotFound: the model the file names is not registered.
        OutputInUse: the folder holds another job (another input, model or part size), is a `batch run` job's
            output, or is inside any job's output folder or holds one (storage/job_folders.py).
    """
    storage = settings.storage
    allowed = batch_tenant(settings.tenancy.tenants_file, tenant)
    resolve = partial(resolve_location, storage_options=storage.storage_options)
    input_uri, output_uri = admit_locations(allowed, input_uri, output_uri, resolve)
    plan_parts(0, lines_per_part)  # the part size is checked before a byte is read
    data, sha256 = read_batch_input(input_uri, storage.storage_options)
    checked = check_batch_file(data)
    output = BatchOutputFolder(output_uri, storage.storage_options)
    refuse_job_folder_overlap(output.fs, output.root, output.uri, "batch openai")
    recorded = output.read_job()
    refuse_another_job(output, recorded, sha256, checked.model, lines_per_part)
    registry = ModelRegistry.from_settings(storage)
    model = _checked_model(registry, recorded.model if recorded else checked.model, checked, allowed)
    parts = plan_parts(len(checked.entries), lines_per_part)
    job = recorded or BatchJobRecord(
        job_id=batch_job_id(sha256, checked.model, lines_per_part), input_uri=input_uri, input_sha256=sha256,
        model_reference=checked.model, model=model.pinned, model_digest=model.content_digest,
        lines_per_part=lines_per_part, entries=len(checked.entries), parts=len(parts),
        created_at=datetime.now(timezone.utc))
    plan = OpenAIBatchPlan(job, checked, model, output, parts, parts, tenant,
                           recorded=recorded is not None)
    finished = output.read_batch()
    if recorded is not None and finished is not None and finished.get("id") == f"batch_{job.job_id}":
        return replace(plan, pending=(), finished=finished)  # a finished job run again: read, nothing written
    return plan


def check_openai_batch(input_uri: str, output_uri: str, lines_per_part: int, tenant: str,
                       settings: OpenAIBatchSettings) -> OpenAIBatchPlan:
    """What the plan task would refuse, found without writing (`batch openai`'s check before a flow run); the
    job as surveyed (``recorded``: an earlier run began it).

    Raises:
        ShardlineError: as :func:`survey_openai_batch`; also OutputInUse (another job runs on the folder) and
            OutputNotWritable (a file, or a folder that cannot be written: on local disk).
    """
    plan = survey_openai_batch(input_uri, output_uri, lines_per_part, tenant, settings)
    if plan.finished is None:
        output = plan.output
        OutputLease.check_free(output.fs, output.root, output.uri, plan.job.job_id)
    return plan
