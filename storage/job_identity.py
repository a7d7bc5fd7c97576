"""Batch job identity and the summary of a settled job: pure functions, no I/O."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from typing import Any, Iterable, Sequence

from pydantic import BaseModel, Field

from shardline.storage.output import PartRecord
from shardline.storage.shards import ShardInfo


def job_key(model_digest: str, passthrough: Sequence[str] | None) -> str:
    """What decides a part's contents besides its shard: the model and the columns kept."""
    blob = json.dumps({"model": model_digest, "passthrough": list(passthrough) if passthrough is not None else "auto"})
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def job_id(key: str, shards: Iterable[ShardInfo], output: str | None = None) -> str:
    """A job is its key plus the exact input listing (paths and fingerprints) and where it writes.

    The output counts: the same input scored by the same model into two folders (two
    tenants, say) is two jobs, with two job records.
    """
    digest = hashlib.sha256(key.encode())
    if output is not None:
        digest.update(f"\noutput\t{output.rstrip('/')}".encode())
    for shard in shards:
        digest.update(f"\n{shard.relative}\t{shard.fingerprint}".encode())
    return digest.hexdigest()[:16]


class JobSummary(BaseModel):
    """Totals of a settled job: shards, rows, time, and what was quarantined.

    A shard that could not be read at all (not Parquet: its footer is unreadable) has no
    known row count: it is counted in ``shards_quarantined`` and ``shards_unreadable``, and
    its rows in none of the row totals, so ``rows_in == rows_out + rows_quarantined`` holds
    over the rows that could be read. ``as_dict()`` is what the flow returns and
    ``shardline batch run --json`` prints.
    """

    job_id: str
    model: str
    tenant: str
    output: str
    shards: int
    shards_committed: int
    shards_skipped: int
    shards_quarantined: int
    shards_unreadable: int = 0  # quarantined shards whose rows are unknown (counted in no row total)
    rows_in: int
    rows_out: int
    rows_quarantined: int
    rows_scored: int
    steady_seconds: float
    quarantined: dict[str, str] = Field(default_factory=dict)  # shard's relative path -> reason
    manifest: str | None = None
    # input columns auto passthrough left out for a model output of their name (``storage.scoring.shadowed_columns``,
    # of every shard whose footer the flow read: all of a job it checks, else the first)
    shadowed_columns: list[str] = Field(default_factory=list)

    @property
    def steady_rows_per_second(self) -> float:
        """Rows scored per second from the first shard started to the last part committed."""
        return self.rows_scored / self.steady_seconds if self.steady_seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain data, for manifests, artifacts and JSON output."""
        return {**self.model_dump(), "steady_rows_per_second": round(self.steady_rows_per_second, 1)}

    def totals(self) -> dict[str, int]:
        """The shard and row counts (the manifest's ``totals``)."""
        return {k: v for k, v in self.model_dump().items() if k.startswith(("shards", "rows"))}


def summarize(
    *, job_id: str, model: str, tenant: str, output: str, total_shards: int,
    new: Sequence[PartRecord], skipped: Sequence[PartRecord], shadowed: Sequence[str] = (),
) -> JobSummary:
    """Add up the ledger records of one job; ``new`` were settled by this run. ``shadowed``: see ``JobSummary``."""
    records = [*new, *skipped]
    quarantined = {r.relative: r.reason or "" for r in records if r.status == "quarantined"}
    committed_now = [r for r in new if r.status == "committed"]
    if committed_now:
        first_start = min(r.settled_at - timedelta(seconds=r.seconds) for r in committed_now)
        last_commit = max(r.settled_at for r in committed_now)
        steady = (last_commit - first_start).total_seconds()
    else:
        steady = 0.0
    return JobSummary(
        job_id=job_id,
        model=model,
        tenant=tenant,
        output=output,
        shards=total_shards,
        shards_committed=sum(r.status == "committed" for r in records),
        shards_skipped=len(skipped),
        shards_quarantined=len(quarantined),
        shards_unreadable=sum(r.status == "quarantined" and r.rows_in is None for r in records),
        rows_in=sum(r.rows_in or 0 for r in records),
        rows_out=sum(r.rows_out for r in records),
        rows_quarantined=sum(r.rows_quarantined for r in records),
        rows_scored=sum(r.rows_out for r in committed_now),
        steady_seconds=steady,
        quarantined=quarantined,
        shadowed_columns=list(shadowed),
    )


def manifest_job_key(manifest: dict[str, Any]) -> str | None:
    """The job key a manifest was written under (older manifests: computed from its model digest and passthrough)."""
    if manifest.get("job_key"):
        return str(manifest["job_key"])
    digest = (manifest.get("model") or {}).get("digest")
    if not digest:
        return None
    passthrough = manifest.get("passthrough")
    return job_key(digest, None if passthrough == "auto" else passthrough)


def foreign_parts(manifest: dict[str, Any] | None, ledger: dict[str, PartRecord], key: str) -> str | None:
    """What of another job (another model or passthrough) the output holds, in words; None when nothing.

    A job may add to an output that holds parts of its own key (the same model and
    columns: a resume, or new shards in the input), never to one holding another's:
    the folder would mix two models' predictions under one manifest.
    """
    if manifest is not None:
        theirs = manifest_job_key(manifest)
        if theirs is not None and theirs != key:
            model = (manifest.get("model") or {}).get("pinned", "another model")
            return f"the parts of job {manifest.get('job_id', '?')} (model {model}; its manifest is there)"
    others = [r for r in ledger.values() if r.job_key != key]
    if others:
        return f"{len(others)} parts settled by another model or passthrough (first: {others[0].relative})"
    return None


def up_to_date(manifest: dict[str, Any] | None, job: str, settled: Sequence[PartRecord]) -> bool:
    """Whether a finished manifest of this very job already lists exactly these settled shards: nothing to write."""
    if manifest is None or manifest.get("job_id") != job:
        return False
    parts = sorted(str(p.get("part")) for p in manifest.get("parts", []))
    quarantined = sorted(str(q.get("shard")) for q in manifest.get("quarantined", []))
    return parts == sorted(str(r.part) for r in settled if r.status == "committed") and quarantined == sorted(
        r.shard for r in settled if r.status == "quarantined"
    )
