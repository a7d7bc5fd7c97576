"""A batch job's admission and the checks it makes before it writes, without Prefect: what the batch flow does
first, and what `batch run` and `batch resume` do before they start a flow run, so that a wrong request is refused
in the command without Prefect's imports (~1.4 s on 2 cores) and starts no flow run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial

from pydantic import ValidationError

from shardline.settings import (
    BatchSettings,
    DaskSettings,
    MeteringSettings,
    RuntimeSettings,
    StorageSettings,
    TenancySettings,
)
from shardline.settings.problems import settings_error
from shardline.sla_projection import Sla, make_sla
from shardline.storage.fs import resolve_location
from shardline.storage.job_records import JobParameters
from shardline.storage.ledger import LedgerStore
from shardline.tasks.batch_survey import check_output_free, survey_job
from shardline.tasks.fairness import DeviceKind, check_gpu_quota, device_kind, job_capacity, priority_of
from shardline.tenants import BatchTenant, admit_locations, batch_tenant, resolved_prefixes


@dataclass(frozen=True)
class BatchJobSettings:
    """Every settings area a batch job reads, read once at the flow's start."""

    storage: StorageSettings
    batch: BatchSettings
    runtime: RuntimeSettings
    dask: DaskSettings
    tenancy: TenancySettings
    metering: MeteringSettings = field(default_factory=MeteringSettings)

    @classmethod
    def read(cls, batch_rows: int | None = None, given_as: str = "the flow parameter batch_rows") -> BatchJobSettings:
        """The settings from the environment; ``batch_rows`` (a flow parameter, or what ``given_as`` names)
        overrides the batch setting.

        Raises:
            InvalidSetting: a setting, or ``batch_rows``, is out of its range or not valid: one line naming it.
        """
        try:
            batch = BatchSettings() if batch_rows is None else BatchSettings(batch_rows=batch_rows)
            return cls(StorageSettings(), batch, RuntimeSettings(), DaskSettings(), TenancySettings(),
                       MeteringSettings())
        except ValidationError as e:
            given = {"batch_rows": given_as} if batch_rows is not None else {}
            raise settings_error(e, given, f"give {given_as} a value in its range") from e


@dataclass(frozen=True)
class Admission:
    """A job as it was admitted: its parameters with the resolved locations, its tenant, priority, device and SLA."""

    request: JobParameters  # input_uri and output_uri as the file system sees them: what the job uses
    tenant: BatchTenant | None  # None in single-tenant mode (no tenants file)
    priority: str
    device: DeviceKind
    sla: Sla
    started: datetime
    link_roots: list[str] | None  # where links in the input may lead (the tenant's resolved prefixes); None: anywhere
    capacity_type: str = "on-demand"  # what its workers run on (``job_capacity``): its ledger rows say so


def admit(
    request: JobParameters, sla: str | None, deadline: str | None, settings: BatchJobSettings, allow_past: bool = True
) -> Admission:
    """Admit a job before anything is read or written: its SLA, tenant, locations, priority, capacity type and
    GPU quota.

    ``allow_past``: a deadline already past is kept (a resumed job's); `batch run` refuses one, and so does the
    flow's admission (``admit_job``) for a job no earlier run began.

    Raises:
        InvalidSetting: a bad SLA or priority, an unknown tenant, locations outside its prefixes.
        QuotaExceeded: the tenant's GPU-hours of the day are used up.
    """
    started = datetime.now(timezone.utc)
    batch, storage = settings.batch, settings.storage
    promise = make_sla(started, sla, deadline, batch.default_sla, batch.sla_margin, allow_past=allow_past)
    allowed = batch_tenant(settings.tenancy.tenants_file, request.tenant)
    resolve = partial(resolve_location, storage_options=storage.storage_options)
    input_uri, output_uri = admit_locations(allowed, request.input_uri, request.output_uri, resolve)
    priority = priority_of(allowed, request.priority)
    device = device_kind(settings.runtime)
    if allowed is not None:
        check_gpu_quota(LedgerStore(storage.home, storage.storage_options), allowed, device)
    return Admission(
        request=request.model_copy(update={"input_uri": input_uri, "output_uri": output_uri}),
        tenant=allowed, priority=priority, device=device, sla=promise, started=started,
        link_roots=resolved_prefixes(allowed, resolve) if allowed is not None else None,
        capacity_type=job_capacity(request.capacity_type, settings.dask, settings.metering),
    )


def check_job(
    request: JobParameters, sla: str | None, deadline: str | None, settings: BatchJobSettings, allow_past: bool = False
) -> None:
    """Every check the flow makes before it writes, made here without Prefect and without writing: admission,
    the model, the input, the output (`batch run` and `batch resume` call it before they start a flow run, so a
    wrong request makes none; the flow checks again, for deployments and for what changed in between).

    Raises:
        ShardlineError: what is wrong (the exit code 2 errors: see :func:`admit`, and ``survey_job`` and
            ``check_output_free`` in ``tasks/batch_survey.py``).
    """
    admitted = admit(request, sla, deadline, settings, allow_past)
    job = admitted.request
    survey = survey_job(
        job.model, job.input_uri, job.output_uri, job.tenant, job.passthrough, settings.storage, settings.batch,
        settings.dask, job.variant, admitted.link_roots,
        admitted.tenant is None or admitted.tenant.custom_code,
    )
    check_output_free(survey)
