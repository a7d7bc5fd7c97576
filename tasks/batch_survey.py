"""What planning a batch job finds before it writes anything: the model, the input, what the output holds.

Plain functions (no Prefect task): the plan task (``tasks/batch.py``, ``plan_batch_job``) calls
:func:`survey_job` and then takes the output; `batch run` and `batch resume` call it, with
:func:`check_output_free`, before they start a flow run (``tasks/batch_admission.py``, ``check_job``), so
a wrong request is refused without a flow run and without a write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from shardline.errors import CorruptShard, OutputInUse
from shardline.machines import machine_kind
from shardline.placement import BatchWorkload, Pricing, candidates_from_profiles, choose_placement, placeable
from shardline.settings import BatchSettings, DaskSettings, StorageSettings
from shardline.storage.job_identity import foreign_parts, job_id, job_key, up_to_date
from shardline.storage.lease import OutputLease
from shardline.storage.output import OutputLayout, PartRecord, check_part_names, part_name, split_done
from shardline.storage.registry import ModelRegistry, ResolvedModel
from shardline.storage.registry_integrity import check_stored, stamps_dir
from shardline.storage.retry import RetryPolicy, call_with_retries
from shardline.storage.scoring import check_passthrough, check_passthrough_present, other_columns
from shardline.storage.shards import ShardInfo, list_shards, read_footer
from shardline.tenants import check_custom_code


@dataclass(frozen=True)
class JobSurvey:
    """What planning finds before it writes anything: the pinned model, the shards, the job's identity, and
    whether the output already holds this very job finished (``settled``: its records; nothing to write)."""

    registry: ModelRegistry
    model: ResolvedModel
    variant_note: str | None  # why ``variant='auto'`` chose what it chose, for the run's log
    shards: list[ShardInfo]
    key: str
    job_id: str
    layout: OutputLayout
    retry: RetryPolicy
    settled: list[PartRecord] | None
    first_columns: tuple[str, ...] | None = None  # auto passthrough: the first shard's other columns (None: unread)


def refuse_foreign(layout: OutputLayout, model: str, key: str, manifest: dict[str, Any] | None,
                    ledger: dict[str, PartRecord]) -> None:
    """Refuse an output holding another job's parts (another model or passthrough): mixing them would corrupt it.

    Raises:
        OutputInUse: naming the job and model the folder holds.
    """
    foreign = foreign_parts(manifest, ledger, key)
    if foreign is not None and manifest is not None and (manifest.get("model") or {}).get("pinned") == model:
        raise OutputInUse(  # the same model: what differs is the columns carried along (--passthrough)
            f"the output {layout.uri} holds {foreign}, with other passthrough columns than this job's; parts with "
            "different columns in one folder would corrupt it: give the --passthrough that job had, choose another "
            "--output, or delete the folder to score it anew", layout.uri, manifest.get("job_id"),
        )
    if foreign is not None:
        raise OutputInUse(
            f"the output {layout.uri} holds {foreign}; this job runs {model}, and mixing two models' parts "
            "in one folder would corrupt it: choose another --output, or delete the folder to score it anew",
            layout.uri, manifest.get("job_id") if manifest else None,
        )


def refuse_strays(layout: OutputLayout, shards: list[ShardInfo], ledger: dict[str, PartRecord],
                  present: set[str]) -> None:
    """Refuse an output holding parts of shards this input does not have (an earlier job's input, another folder's
    or one whose shards were removed since): a reader of the folder would read those rows with this job's, while
    the manifest and ``_SUCCESS`` speak of this job's alone.

    Raises:
        OutputInUse: naming how many such parts there are, and the first.
    """
    ours = {shard.relative for shard in shards}
    strays = sorted(r.relative for r in ledger.values()
                    if r.status == "committed" and r.relative not in ours and part_name(r.relative) in present)
    if strays:
        raise OutputInUse(
            f"the output {layout.uri} holds the parts of {len(strays)} shard{'s' if len(strays) != 1 else ''} this "
            f"input does not have (first: {strays[0]}), from an earlier job's input; a reader of the folder would read "
            "them with this job's: choose another --output, or delete the folder to score it anew", layout.uri, None,
        )


def refuse_unknown_files(layout: OutputLayout, shards: list[ShardInfo], ledger: dict[str, PartRecord],
                         present: set[str]) -> None:
    """Refuse an output holding Parquet files no Shardline job wrote there (none of its ledger's, nor the part of
    a shard of this input: a part committed before its record was, which a resume writes again): a reader of the
    folder would read their rows with this job's.

    Raises:
        OutputInUse: naming how many there are, and the first.
    """
    known = {part_name(r.relative) for r in ledger.values()} | {part_name(s.relative) for s in shards}
    unknown = sorted(present - known)
    if unknown:
        raise OutputInUse(
            f"the output {layout.uri} holds {len(unknown)} Parquet file{'s' if len(unknown) != 1 else ''} no "
            f"Shardline job wrote (first: {unknown[0]}); a reader of the folder would read their rows with this "
            "job's: choose an empty folder for --output, or move them out", layout.uri, None,
        )


def survey_job(
    model: str, input_uri: str, output_uri: str, tenant: str, passthrough: list[str] | None,
    storage: StorageSettings, batch: BatchSettings, dask: DaskSettings, variant: str | None = None,
    link_roots: list[str] | None = None, custom_code: bool = True,
) -> JobSurvey:
    """Every check of planning that reads and never writes: the model (alias, version, variant, custom code),
    the input's listing, the part names, and what the output holds (links out of it, another model's parts,
    this job already finished). `batch run` calls it before any flow run; the plan task calls it again.

    Raises:
        ModelNotFound: the model, alias, version or variant is not in the registry.
        InvalidSetting: ``variant='auto'`` and the price table is wrong; the input is missing; a link leads out
            of the input's allowed places or out of the output.
        EmptyInput: the input holds no shard.
        InvalidInput: two shards would write one part; a passthrough column has the name of a model output or
            is not in the first shard.
        AccessDenied: the model carries its own code and the tenant may not run it.
        OutputInUse: the output holds another model's (or passthrough's) parts.
        IntegrityError: the registry's copy of the model is damaged (``check_stored``; not checked for a job the
            output holds finished, which loads no model).
    """
    registry = ModelRegistry.from_settings(storage)
    resolved, note = choose_variant(registry, registry.resolve(model), variant, dask.cluster == "local")
    check_custom_code(resolved.manifest.runtime, resolved.pinned, tenant, custom_code)
    if passthrough is not None:
        check_passthrough(passthrough, resolved)
    retry = RetryPolicy(batch.retry_attempts, batch.retry_base_s, max(batch.retry_cap_s, batch.retry_base_s))
    shards = call_with_retries(
        lambda: list_shards(input_uri, storage.storage_options, batch.shard_suffixes, link_roots), retry,
        what="listing the input",
    )
    check_part_names(shards)
    first = _first_schema(shards[0], storage, retry)
    if passthrough and first is not None:
        check_passthrough_present(passthrough, shards[0].relative, first)
    key = job_key(resolved.outputs_digest, passthrough)
    this_job = job_id(key, shards, output_uri)
    layout = OutputLayout(output_uri, storage.storage_options, this_job)
    layout.refuse_links_out()  # a link below the output would carry the job's writes out of the folder admitted
    settled = None
    manifest = layout.finished_manifest()
    if manifest is not None and manifest.get("job_id") == this_job:
        ledger = call_with_retries(layout.read_ledger, retry, what="reading the job's ledger")
        todo, done = split_done(shards, ledger, key, layout.present_parts())
        if not todo and up_to_date(manifest, this_job, done):
            settled = done  # a finished job's output is only read (a read-only archive re-run writes nothing)
    if settled is None:
        refuse_foreign(layout, resolved.pinned, key, layout.any_manifest(), {})
        # the workers will load it: a copy changed after its push fails every shard, and a re-run the same
        check_stored(registry, resolved, stamps_dir(storage.cache))
    first_columns = tuple(other_columns(resolved, first)) if passthrough is None and first is not None else None
    return JobSurvey(registry, resolved, note, shards, key, this_job, layout, retry, settled, first_columns)


def _first_schema(first: ShardInfo, storage: StorageSettings, retry: RetryPolicy) -> pa.Schema | None:
    """The first shard's schema (one footer read): what ``--passthrough`` is checked against, and without it
    the columns every part of the job carries. None when it is not readable Parquet: the workers quarantine it,
    as any such shard."""
    try:
        footer = call_with_retries(lambda: read_footer(first.uri, storage.storage_options), retry,
                                   what="reading the first shard's footer")
    except CorruptShard:
        return None
    return footer.schema


def check_output_free(survey: JobSurvey) -> None:
    """What taking the output would refuse, found without writing (``batch run``'s check before a flow run):
    another job holds it, it is inside another job's output or holds one, it holds another model's settled parts,
    parts of shards this input lacks or Parquet files no job wrote, or it cannot be written.

    Raises:
        OutputInUse: another job runs on it; it is inside another job's output folder or holds one (or is a
            `batch openai` job's folder: storage/job_folders.py); it holds another model's parts, another
            input's, or Parquet files no Shardline job wrote.
        OutputNotWritable: the output (or a folder above it) is a file, or it cannot be written (on local
            disk; elsewhere the flow's first write, the lease, finds that).
    """
    if survey.settled is not None:
        return  # a finished job writes nothing: a read-only archive is fine
    layout = survey.layout
    OutputLease.check_free(layout.fs, layout.root, layout.uri, survey.job_id)
    layout.refuse_job_folder_overlap()
    ledger = call_with_retries(layout.read_ledger, survey.retry, what="reading the job's ledger")
    refuse_foreign(layout, survey.model.pinned, survey.key, None, ledger)
    present = layout.present_parts()
    refuse_strays(layout, survey.shards, ledger, present)
    refuse_unknown_files(layout, survey.shards, ledger, present)


def machine_prices() -> Pricing:
    """The price of a machine kind's device-hour from the one price table (``shardline cost report``'s: the
    file SHARDLINE_METERING_PRICES_FILE names, else ``<home>/prices.yaml``, else the example's list prices).

    Raises:
        InvalidSetting: the price table cannot be read.
    """
    from shardline.capacity.prices import load_prices, prices_path

    return load_prices(prices_path()).per_machine_hour


def choose_variant(
    registry: ModelRegistry, model: ResolvedModel, variant: str | None, local: bool, price: Pricing | None = None
) -> tuple[ResolvedModel, str | None]:
    """The model a job runs, and for 'auto' why (for the run's log): fp32 unless a variant is named.

    'auto' weighs the version's profiles of fp32 and of the variants placement may pick (``placeable``: scored
    against fp32, and on a CPU not made for GPUs) (measured on this machine kind when the
    cluster is local, on every kind otherwise) by rows/s per cost (``price``; the price table's, read now,
    when None) and takes the best
    variant. A variant changes the numbers (within the golden-set delta its gate
    allowed), so a job only runs one when asked to.
    """
    if variant is None:
        return model, None
    if variant != "auto":
        return model.variant(variant), None
    here = machine_kind()
    profiles = {k: p for k, p in registry.profiles(model.name, model.version).items() if not local or p.get("machine") == here}
    candidates = candidates_from_profiles(profiles, price or machine_prices())
    known, left_out = placeable(candidates, model.variants)
    if not known:
        return model, f"variant auto: {model.pinned} has no profile on {here}; running fp32"
    chosen = choose_placement(BatchWorkload(), known)
    note = f"variant auto: {chosen.reason}" + "".join(f"; {n}" for n in left_out)
    return (model if chosen.candidate.variant == "fp32" else model.variant(chosen.candidate.variant)), note
